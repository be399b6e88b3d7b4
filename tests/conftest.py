import os
import secrets

import pytest
import torch

from custom_ops.testing import poisoned_allocations
from tests import _profiles  # noqa: F401 (registers and loads the hypothesis profiles)

SEED_OPTION = "--hypothesis-seed"  # hypothesis's pytest plugin's option: the seed of every property


@pytest.hookimpl(tryfirst=True)  # before hypothesis's plugin reads the option
def pytest_configure(config):
    """Seed hypothesis for the run: ``--hypothesis-seed``, else ``HYPOTHESIS_SEED``, else a new
    seed. Exported as ``HYPOTHESIS_SEED`` so that worker processes draw with the same one."""
    seed = config.getoption(SEED_OPTION) or os.environ.get("HYPOTHESIS_SEED") or str(secrets.randbelow(2**32))
    config.option.hypothesis_seed = seed
    os.environ["HYPOTHESIS_SEED"] = str(seed)


def _seed_line(config) -> str:
    from hypothesis import settings

    seed, profile = config.getoption(SEED_OPTION), settings.get_current_profile_name()
    env = "" if profile == "default" else f"HYPOTHESIS_PROFILE={profile} "
    return (f"hypothesis seed {seed}, profile {profile!r} ({settings.default.max_examples} examples); reproduce: "
            f"HYPOTHESIS_SEED={seed} make test, or {env}python -m pytest {SEED_OPTION}={seed} TEST")  # fmt: skip


def pytest_report_header(config):
    return _seed_line(config)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """The seed again at the end of the log (``-q`` prints no header), under any failure."""
    terminalreporter.write_line(_seed_line(config) + ("" if exitstatus == 0 else "; then pin it with @example"))


def pytest_collection_modifyitems(config, items):
    interpreting = os.environ.get("TRITON_INTERPRET", "0") == "1"
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    skip_interp = pytest.mark.skip(reason="needs TRITON_INTERPRET=1 before triton is imported (make test runs it)")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
        if "interpret" in item.keywords and not interpreting:
            item.add_marker(skip_interp)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def poison_empty():
    """Poison fresh allocations for the whole test (see custom_ops.testing.poisoned_allocations)."""
    with poisoned_allocations():
        yield


@pytest.fixture(autouse=True)
def _checked_mode():
    """Each test leaves the checked mode and ``CP_OPS_CHECKS`` as it found them: a benchmark's
    ``main`` that a test calls turns the checks off for its process (``benchmarks.runner.checks_off``)."""
    from custom_ops import checks_enabled, set_checks

    mode, variable = checks_enabled(), os.environ.get("CP_OPS_CHECKS")
    yield
    set_checks(mode)
    if variable is None:
        os.environ.pop("CP_OPS_CHECKS", None)
    else:
        os.environ["CP_OPS_CHECKS"] = variable
