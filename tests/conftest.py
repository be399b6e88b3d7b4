import os

import pytest
import torch
from hypothesis import HealthCheck, settings

from custom_ops.testing import poisoned_allocations

# "default" keeps CPU CI fast; HYPOTHESIS_PROFILE=thorough for a long local run.
settings.register_profile(
    "default", max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("thorough", max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


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
