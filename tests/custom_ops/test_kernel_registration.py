"""Which way the ops register their Triton kernels: visible to Inductor, or opaque; and,
for the visible form, that torch's analysis of each kernel finds what it writes.

The rule lives in ``custom_ops.runtime.registration`` (``visible_to_compiler``, which
``kernels_visible_to_compiler`` applies to the installed versions); ``make test`` also reruns
the compile tests with ``CP_OPS_OPAQUE_KERNELS=1`` (``make test-opaque``).
"""

import pytest
import torch
import triton

from custom_ops.runtime import registration
from custom_ops.sections.kernels import permute_sections_kernel
from custom_ops.testing import kernel_constexprs
from custom_ops.thd_reorder.kernels import thd_reorder_kernel
from custom_ops.valid_tokens.kernels import thd_copy_valid_tokens_kernel


def rule(pin, installed, env=None):
    """The rule for a given torch pin / installed triton / ``CP_OPS_OPAQUE_KERNELS``."""
    return registration.visible_to_compiler(pin, installed, env)


def test_kernels_visible_with_the_pinned_triton_or_an_older_one():
    assert rule("3.6.0", "3.6.0")
    assert rule("3.6.0", "3.6.1")  # same minor release
    assert rule("3.7.1", "3.6.0")


def test_kernels_opaque_with_a_newer_triton_than_torch_pins():
    # torch 2.11 pins triton 3.6.0; FLA's GDN backward on Hopper needs 3.7.1
    assert not rule("3.6.0", "3.7.1")
    assert not rule("3.6.0+git1234", "4.0.0")


def test_kernels_visible_without_a_pin():
    # CPU wheels pin no triton; there the ops run torch references under compile
    assert rule(None, "3.9.0")


def test_environment_forces_the_choice(monkeypatch):
    assert not rule("3.6.0", "3.6.0", env="1")
    assert rule("3.6.0", "3.7.1", env="0")
    with pytest.raises(ValueError, match="CP_OPS_OPAQUE_KERNELS"):
        rule("3.6.0", "3.6.0", env="yes")
    # what the registration reads: the environment, whatever the versions
    for env, visible in (("1", False), ("0", True)):
        monkeypatch.setenv("CP_OPS_OPAQUE_KERNELS", env)
        assert registration.kernels_visible_to_compiler.__wrapped__() is visible
    monkeypatch.setenv("CP_OPS_OPAQUE_KERNELS", "yes")
    with pytest.raises(ValueError, match="CP_OPS_OPAQUE_KERNELS"):
        registration.kernels_visible_to_compiler.__wrapped__()
    # unset: the rule for this torch's pin and the installed triton
    monkeypatch.delenv("CP_OPS_OPAQUE_KERNELS")
    expected = rule(registration.torch_triton_pin(), triton.__version__)
    assert registration.kernels_visible_to_compiler.__wrapped__() is expected


def test_pin_is_read_from_torch_metadata():
    requires = ["filelock", 'triton==3.6.0; platform_system == "Linux"', "sympy>=1.13.3"]
    assert registration.triton_pin(requires) == "3.6.0"
    assert registration.triton_pin(["pytorch-triton==3.7.0+git4c3"]) == "3.7.0+git4c3"
    assert registration.triton_pin(["filelock"]) is None
    pin = registration.torch_triton_pin()  # this torch's own metadata
    assert pin is None or registration.triton_pin([f"triton=={pin}"]) == pin


# Every kernel a visible op launches through wrap_triton: (kernel, constexprs, tensors it writes,
# large inputs it only reads). The attention ops pass host TMA descriptors and always register
# as opaque ops (custom_ops.segment_attention.op), so their kernels are not here.
_VISIBLE_KERNELS = {
    "thd_reorder": (thd_reorder_kernel, dict(TO_RANK=True, BLOCK_R=16, BLOCK_D=64), {"out_ptr"}, {"x_ptr"}),
    "permute_sections": (permute_sections_kernel, dict(LOFF=(0, 8, 24), BLOCKS=(8, 16), TO_BLOCKS=True, BLOCK_R=16),
                         {"blocked_ptr"}, {"plain_ptr"}),
    "unpermute_sections": (permute_sections_kernel,
                           dict(LOFF=(0, 8, 24), BLOCKS=(8, 16), TO_BLOCKS=False, BLOCK_R=16),
                           {"plain_ptr"}, {"blocked_ptr"}),
    "thd_copy_valid_tokens": (thd_copy_valid_tokens_kernel, dict(IN_PLACE=False, BLOCK_R=16, BLOCK_D=64),
                              {"out_ptr"}, {"src_ptr", "dst_ptr"}),
    "thd_copy_valid_tokens_in_place": (thd_copy_valid_tokens_kernel, dict(IN_PLACE=True, BLOCK_R=16, BLOCK_D=64),
                                       {"out_ptr"}, {"src_ptr"}),
}  # fmt: skip


@pytest.mark.parametrize("name", list(_VISIBLE_KERNELS))
def test_compiler_sees_what_each_visible_kernel_writes(name, monkeypatch):
    """Where the kernels are visible to Inductor (``triton_op``), torch analyses each one's
    Triton IR for the tensors it writes; when that analysis fails it takes every tensor
    argument as written and Inductor copies inputs around the call (with triton 3.7.1 under
    torch 2.11 it then asserted, hence the opaque form there). Run here for sm_90 without a
    GPU, the analysis must find each kernel's outputs and leave its large inputs read-only.
    (It also counts small index tables handed to a nested ``@triton.jit`` function as written:
    it does not follow pointers into calls.)"""
    pytest.importorskip("triton.backends.nvidia")
    try:
        from torch._higher_order_ops.triton_kernel_wrap import identify_accessed_tensors
        from triton.backends.compiler import GPUTarget
        from triton.runtime.driver import driver
    except ImportError as e:  # private APIs of torch and triton
        pytest.skip(f"no kernel analysis in this torch / triton: {e}")

    class Hopper:
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

    monkeypatch.setattr(driver, "_active", Hopper(), raising=False)
    kernel, constants, outputs, read_only = _VISIBLE_KERNELS[name]
    constants = kernel_constexprs(kernel, constants)
    kwargs = {}
    for arg in kernel.arg_names:
        if arg in constants:
            kwargs[arg] = constants[arg]
        elif arg.endswith("_ptr"):
            kwargs[arg] = torch.zeros(64 * 64, dtype=torch.int32)
        else:  # sizes, strides, scales, window bounds
            kwargs[arg] = 0.5 if arg.endswith("scale") else 3
    try:
        accesses = identify_accessed_tensors(kernel, kwargs, {})
    except TypeError as e:  # another signature of the private API
        pytest.skip(f"identify_accessed_tensors: {e}")
    written = {dep.name for dep in accesses.read_writes.writes}
    assert outputs <= written and not (written & read_only), written


def test_custom_ops_have_their_bodies_as_cpu_and_cuda_kernels():
    """Every ``custom_op`` or ``triton_op`` of the package also has its body as its CPU and CUDA
    kernel (``registration._register_eager_kernels``): a backend kernel takes precedence over
    ``custom_op``'s ``CompositeExplicitAutograd`` wrapper, so eager calls skip that wrapper."""
    import custom_ops  # noqa: F401  (registers every op)
    from torch._library.custom_ops import OPDEFS

    names = [name for name in OPDEFS if name.startswith("cp_ops::")]
    assert len(names) >= 15, names
    for name in names:
        for key in ("CPU", "CUDA"):
            assert torch._C._dispatch_has_kernel_for_dispatch_key(name, key), (name, key)
