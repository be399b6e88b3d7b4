"""A CPU run prints nothing of its own making: importing the packages is silent, FLA's notice
that Triton has no GPU driver is silenced where this package imports FLA (and nothing else is),
and spawned ranks leave no semaphore for multiprocessing's resource tracker to report."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(code: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    env.pop("PYTHONWARNINGS", None)  # the default filters, as a user's run has them
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=120)  # fmt: skip


def test_importing_the_packages_and_fla_through_the_ops_prints_nothing():
    """The packages, then FLA's modules as the ops load them, in one process (each import is a
    few seconds of a fresh interpreter)."""
    out = _run("""
        import custom_ops, cp_ops, cp_ops.demo.cli, cp_ops.integrations.transformers
        from custom_ops.fla.adapter import fla_module
        fla_module("fla.ops.gated_delta_rule.chunk")
        fla_module("fla.modules.causal_conv1d.ops")
        import fla.utils.hardware  # loaded: a later import by anyone warns no more
    """)
    assert out.returncode == 0, out.stderr
    assert (out.stdout, out.stderr) == ("", "")


def test_other_warnings_pass(tmp_path):
    """Only FLA's hardware probe's notice is silenced: the same text from another module, and
    another warning, still show."""
    (tmp_path / "noisy.py").write_text(
        "import warnings\n"
        "warnings.warn('Triton is not supported on current platform, roll back to CPU.')\n"
        "warnings.warn('something else')\n"
    )
    out = _run("from custom_ops.fla.adapter import fla_module; fla_module('noisy')", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "roll back to CPU" in out.stderr and "something else" in out.stderr


SPAWN = """
import multiprocessing
import sys

import torch.distributed as dist
import torch.multiprocessing as mp

from cp_ops.local_ranks import init_local_rank, leave_local_rank, local_rendezvous


def entry(rank, world, init_method):
    init_local_rank(rank, world, init_method, "cpu", num_threads=1)
    lock = multiprocessing.RLock()  # a named semaphore, as tqdm's write lock is
    dist.barrier()
    dist.destroy_process_group()
    leave_local_rank()


if __name__ == "__main__":
    with local_rendezvous() as init_method:
        mp.spawn(entry, args=(2, init_method), nprocs=2, join=True)
    print("done")
"""


@pytest.mark.dist
def test_spawned_ranks_leave_no_semaphore(tmp_path):
    """Ranks that end with leave_local_rank (skipping the interpreter's teardown) while holding
    a multiprocessing lock: the parent's resource tracker finds nothing leaked at its exit."""
    script = tmp_path / "ranks.py"
    script.write_text(SPAWN)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout == "done\n", out.stderr
    assert "resource_tracker" not in out.stderr and "leaked" not in out.stderr, out.stderr


def test_rel_error_of_tensors_that_require_grad_warns_nothing():
    import warnings

    import torch

    from custom_ops.testing import rel_error

    x = torch.randn(8, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert rel_error(x * 2, x) == pytest.approx(1.0)
