"""The direct kernel launches of ``custom_ops.runtime.launch`` (``launch_direct``): the key that picks a
cached compiled kernel must tell apart every pair of arguments Triton compiles apart, and a
cached launch must pass the arguments Triton's own launch would.

On the CPU a stand-in kernel records what would be launched; on a GPU the ops run across
dtypes, shapes, strides and misaligned views, each against its reference."""

import inspect
import itertools

import pytest
import torch

from triton import knobs

from custom_ops.runtime import launch


def _triton_specialization():
    try:
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.compiler import BaseBackend
    except ImportError:
        return None
    return lambda a: native_specialize_impl(BaseBackend, a, False, True, True)


def _sample_arguments():
    ints = [-(2**63), -(2**31) - 1, -(2**31), -17, -16, -1, 0, 1, 2, 15, 16, 17, 32, 2**31 - 16, 2**31 - 1, 2**31,
            2**32, 2**63 - 16, 2**63, 2**64 - 1]  # fmt: skip
    values = ints + [0.0, 0.5, 1.0, 3.0, True, False, None]
    base = torch.zeros(64, dtype=torch.int64)
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.int32, torch.int64,
                  torch.uint8, torch.bool):  # fmt: skip
        t = base.view(torch.uint8).view(dtype)
        values += [t, t[1:], t[16 // t.element_size() :]]  # aligned, misaligned (unless 16-byte steps), aligned again
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:
        return values
    for dtype in (torch.bfloat16, torch.float16):
        m = torch.zeros(64, 64, dtype=dtype)
        values += [TensorDescriptor.from_tensor(m, [16, 32]), TensorDescriptor.from_tensor(m, [32, 32])]
    return values


def test_key_tells_apart_what_triton_compiles_apart():
    spec = _triton_specialization()
    if spec is None:
        pytest.skip("this triton has no native_specialize_impl")
    samples = _sample_arguments()
    for a, b in itertools.combinations(samples, 2):
        try:
            sa, sb = spec(a), spec(b)
        except Exception:  # a value this triton does not take as an argument
            continue
        if sa != sb:
            assert launch.spec_key(a) != launch.spec_key(b), (a, b, sa, sb)


def test_key_of_a_size_ignores_its_value_within_its_class():
    assert launch.spec_key(4096) == launch.spec_key(8192)
    assert launch.spec_key(4095) == launch.spec_key(17)
    assert launch.spec_key(1) != launch.spec_key(17)
    assert launch.spec_key(2**31) != launch.spec_key(2**31 - 16)
    assert launch.spec_key([1, 2]) is launch.NO_KEY


# --- a stand-in kernel ---------------------------------------------------------------------------


class _Param:
    def __init__(self, name, is_constexpr):
        self.name, self.is_constexpr = name, is_constexpr


class _Compiled:
    function, packed_metadata = "function", "packed"

    def __init__(self, log):
        self.log = log

    def launch_metadata(self, grid, stream, *args):
        return ("metadata", grid)

    def run(self, *launch):
        self.log.append(("direct", launch))


class _Kernel:
    """Records launches: ("triton", grid, args, kwargs) where Triton would bind and launch
    (returning a compiled kernel, as ``JITFunction.run`` does), ("direct", launch arguments)
    where the cached compiled kernel is launched."""

    def __init__(self):
        def kernel(x_ptr, out_ptr, n, scale, BLOCK: "tl.constexpr", FLAG: "tl.constexpr" = False):  # noqa: F821
            pass

        self.signature = inspect.signature(kernel)
        self.params = [_Param(n, n.isupper()) for n in self.signature.parameters]
        self.log = []
        self.compiled = _Compiled(self.log)

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.log.append(("triton", grid, args, kwargs))
            return self.compiled

        return run


class _Launcher:
    """A direct launcher of its own that takes the stand-in kernel for a compiled one, on a
    device the test sets (``device``) and stream ``1234 + device``."""

    def __init__(self, compiled=True):
        self.device = 0
        self.launch_direct = launch.direct_launcher(
            device=lambda: self.device, stream=lambda device: 1234 + device, compiled=lambda kernel: compiled
        )


@pytest.fixture
def launcher():
    return _Launcher()


@pytest.fixture
def kernel():
    return _Kernel()


def _kinds(log):
    return [entry[0] for entry in log]


def test_first_call_goes_through_triton_then_direct(kernel, launcher):
    x, out = torch.zeros(64), torch.zeros(64)
    launcher.launch_direct(kernel, (4, 2), x, out, 4096, 0.5, BLOCK=64, num_warps=4)
    launcher.launch_direct(kernel, (8,), x, out, 8192, 0.25, BLOCK=64, num_warps=4)
    assert _kinds(kernel.log) == ["triton", "direct"]
    assert kernel.log[0][1:] == ((4, 2), (x, out, 4096, 0.5), {"BLOCK": 64, "num_warps": 4})
    runtime = knobs.runtime
    launch = kernel.log[1][1]
    # grid padded to 3-D, the stream, the compiled kernel's handles, no metadata without hooks,
    # then every argument in signature order: constexprs from the keywords, defaults for the rest
    assert launch[:6] == (8, 1, 1, 1234, "function", "packed")
    assert launch[6] is None or not getattr(runtime.launch_enter_hook, "calls", runtime.launch_enter_hook)
    assert launch[7] is runtime.launch_enter_hook and launch[8] is runtime.launch_exit_hook
    assert launch[9:] == (x, out, 8192, 0.25, 64, False)


@pytest.mark.parametrize(
    "change",
    [
        "dtype", "misaligned", "size one", "size not a multiple of 16", "64-bit size", "constexpr", "default constexpr",
        "num_warps", "device",
    ],
)  # fmt: skip
def test_a_change_triton_compiles_apart_goes_through_triton(kernel, launcher, change):
    x, out = torch.zeros(64), torch.zeros(64)
    args, kwargs = [x, out, 4096, 0.5], {"BLOCK": 64, "num_warps": 4}
    launcher.launch_direct(kernel, (1,), *args, **kwargs)
    if change == "dtype":
        args[0] = x.double()
    elif change == "misaligned":
        args[0] = x[1:]
    elif change == "size one":
        args[2] = 1
    elif change == "size not a multiple of 16":
        args[2] = 4097
    elif change == "64-bit size":
        args[2] = 2**33
    elif change == "constexpr":
        kwargs["BLOCK"] = 128
    elif change == "default constexpr":
        kwargs["FLAG"] = True
    elif change == "num_warps":
        kwargs["num_warps"] = 8
    elif change == "device":
        launcher.device = 1
    launcher.launch_direct(kernel, (1,), *args, **kwargs)
    launcher.launch_direct(kernel, (1,), *args, **kwargs)
    assert _kinds(kernel.log) == ["triton", "triton", "direct"]


def test_runtime_argument_by_keyword_never_launches_directly(kernel, launcher):
    x, out = torch.zeros(64), torch.zeros(64)
    for _ in range(3):
        launcher.launch_direct(kernel, (1,), x, out, scale=0.5, n=16, BLOCK=64)
    assert _kinds(kernel.log) == ["triton"] * 3


def test_unhashable_argument_goes_through_triton(kernel, launcher):
    x, out = torch.zeros(64), torch.zeros(64)
    for _ in range(2):
        launcher.launch_direct(kernel, (1,), x, out, [16], 0.5, BLOCK=64)
    assert _kinds(kernel.log) == ["triton"] * 2


def test_launch_hooks_get_their_metadata(kernel, launcher):
    hook = knobs.runtime.launch_enter_hook
    if not hasattr(hook, "add"):
        pytest.skip("this triton's launch hooks are not a HookChain")
    x, out = torch.zeros(64), torch.zeros(64)

    def seen(metadata):
        pass

    hook.add(seen)
    try:
        for _ in range(2):
            launcher.launch_direct(kernel, (3,), x, out, 16, 0.5, BLOCK=64)
    finally:
        hook.remove(seen)
    assert kernel.log[1][1][6] == ("metadata", (3,))


def test_interpreted_kernels_always_go_through_triton():
    k, launcher = _Kernel(), _Launcher(compiled=False)
    for _ in range(2):
        launcher.launch_direct(k, (1,), torch.zeros(4), torch.zeros(4), 4, 0.5, BLOCK=4)
    assert _kinds(k.log) == ["triton"] * 2


# --- the ops on a GPU: one cache across dtypes, shapes, strides and alignments -------------------


@pytest.mark.gpu
def test_layout_ops_across_launch_keys():
    import custom_ops

    torch.manual_seed(0)
    cup64 = torch.tensor([0, 16, 48, 64], device="cuda")
    for dtype, trailing, index_dtype, offset in itertools.product(
        (torch.bfloat16, torch.float32, torch.int8, torch.float64), ((3,), (16, 4), ()), (torch.int32, torch.int64),
        (0, 1),
    ):  # fmt: skip
        cup = cup64.to(index_dtype)
        big = torch.randn((65 + offset,) + trailing, device="cuda").to(dtype)
        x = big[offset : offset + 64]  # a view that starts one row in: its pointer is misaligned
        for w in (2, 4):
            ref = custom_ops.thd_seq_to_rank_order_reference(x, cup, w)
            assert torch.equal(custom_ops.thd_seq_to_rank_order(x, cup, w), ref)
            assert torch.equal(custom_ops.thd_rank_to_seq_order(ref, cup, w), x)
        cu = (cup - torch.tensor([0, 3, 3, 5], device="cuda", dtype=index_dtype)).clamp(min=0).cummax(0).values
        src = torch.randn_like(x.float()).to(dtype)
        expected = custom_ops.thd_copy_valid_tokens_reference(x, src, cup, cu)
        assert torch.equal(custom_ops.thd_copy_valid_tokens(x, src, cup, cu), expected)
    for dtype, rows, offset in itertools.product((torch.bfloat16, torch.float32, torch.int64), (1, 7, 33), (0, 1)):
        x = torch.randn(rows * 24 + offset, device="cuda").to(dtype)[offset:].view(rows, 24)
        for sections, w in (([8, 16], 2), ([8, 8, 8], 4)):
            ref = custom_ops.permute_sections_reference(x, sections, w)
            assert torch.equal(custom_ops.permute_sections(x, sections, w), ref)
            assert torch.equal(custom_ops.unpermute_sections(ref, sections, w), x)
            blocks = custom_ops.sections_to_rank_blocks(x, sections, w)
            assert torch.equal(blocks, ref.view(rows, w, -1).movedim(1, 0))
            assert torch.equal(custom_ops.rank_blocks_to_sections(blocks, sections, w), x)
