"""Which way the ops register their Triton kernels: visible to Inductor, or opaque.

The rule lives in ``custom_ops._common.kernels_visible_to_compiler``; ``make test``
also reruns the compile tests with ``CP_OPS_OPAQUE_KERNELS=1`` (``make test-opaque``).
"""

import pytest
import triton

from custom_ops import _common


@pytest.fixture
def rule(monkeypatch):
    """Evaluate the rule for a given torch pin / installed triton / environment."""

    def evaluate(pin, installed, env=None):
        monkeypatch.setattr(_common, "_torch_triton_pin", lambda: pin)
        monkeypatch.setattr(triton, "__version__", installed)
        if env is None:
            monkeypatch.delenv("CP_OPS_OPAQUE_KERNELS", raising=False)
        else:
            monkeypatch.setenv("CP_OPS_OPAQUE_KERNELS", env)
        return _common.kernels_visible_to_compiler.__wrapped__()

    return evaluate


def test_kernels_visible_with_the_pinned_triton_or_an_older_one(rule):
    assert rule("3.6.0", "3.6.0")
    assert rule("3.6.0", "3.6.1")  # same minor release
    assert rule("3.7.1", "3.6.0")


def test_kernels_opaque_with_a_newer_triton_than_torch_pins(rule):
    # torch 2.11 pins triton 3.6.0; FLA's GDN backward on Hopper needs 3.7.1
    assert not rule("3.6.0", "3.7.1")
    assert not rule("3.6.0+git1234", "4.0.0")


def test_kernels_visible_without_a_pin(rule):
    # CPU wheels pin no triton; there the ops run torch references under compile
    assert rule(None, "3.9.0")


def test_environment_forces_the_choice(rule):
    assert not rule("3.6.0", "3.6.0", env="1")
    assert rule("3.6.0", "3.7.1", env="0")
    with pytest.raises(ValueError, match="CP_OPS_OPAQUE_KERNELS"):
        rule("3.6.0", "3.6.0", env="yes")


def test_pin_is_read_from_torch_metadata(monkeypatch):
    requires = ["filelock", 'triton==3.6.0; platform_system == "Linux"', "sympy>=1.13.3"]
    monkeypatch.setattr(_common.importlib.metadata, "requires", lambda name: requires)
    assert _common._torch_triton_pin() == "3.6.0"
    monkeypatch.setattr(_common.importlib.metadata, "requires", lambda name: ["pytorch-triton==3.7.0+git4c3"])
    assert _common._torch_triton_pin() == "3.7.0+git4c3"
    monkeypatch.setattr(_common.importlib.metadata, "requires", lambda name: ["filelock"])
    assert _common._torch_triton_pin() is None
