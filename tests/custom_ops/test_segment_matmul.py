"""custom_ops.segment_matmul: rows grouped by segment bounds, each times its segment's matrix.

The reference against a Python loop (the definition), gradcheck in float64, the Triton kernels
under the interpreter against the reference (hypothesis-drawn bounds: empty segments, rows
before the first and after the last, one tile spanning many segments), compiled for sm_90 at
each operand precision, opcheck, bad input."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from custom_ops.grouped_matmul.op import segment_matmul
from custom_ops.grouped_matmul.reference import segment_matmul_reference, segment_matmul_weight_grad_reference
from custom_ops.testing import TOLERANCE, rel_error


def _loop(x, w, cu):
    y = torch.zeros(*x.shape[:2], w.shape[-1], dtype=torch.float64)
    bounds = cu.tolist()
    for s in range(len(bounds) - 1):
        for r in range(max(bounds[s], 0), min(bounds[s + 1], x.shape[0])):
            y[r] = torch.einsum("hk,hkn->hn", x[r].double(), w[s].double())
    return y


@st.composite
def cases(draw, max_rows=70):
    """``(rows, lengths, start)``: segments of the drawn lengths from row ``start`` (0 allowed:
    empty segments), inside ``rows`` rows."""
    lengths = draw(st.lists(st.integers(0, 30), min_size=1, max_size=6))
    start = draw(st.integers(0, 5))
    rows = start + sum(lengths) + draw(st.integers(0, 5))
    return min(rows, max_rows), lengths, start


def _tensors(case, heads, k, n, dtype, index_dtype=torch.int64):
    rows, lengths, start = case
    cu = torch.tensor([start] + lengths, dtype=torch.int64).cumsum(0).clamp(max=rows).to(index_dtype)
    x = torch.randn(rows, heads, k, dtype=dtype)
    w = torch.randn(len(lengths), heads, k, n, dtype=torch.float32 if dtype != torch.float64 else dtype)
    return x, w, cu


@given(cases())
def test_reference_is_the_definition(case):
    x, w, cu = _tensors(case, 2, 5, 3, torch.float64)
    assert rel_error(segment_matmul_reference(x, w, cu), _loop(x, w, cu)) < 1e-12


def test_gradcheck():
    x, w, cu = _tensors((30, [4, 0, 9, 11], 3), 2, 4, 3, torch.float64)
    assert torch.autograd.gradcheck(segment_matmul, (x.requires_grad_(), w.requires_grad_(), cu))


def test_weight_grad_reference_is_the_gradient():
    x, w, cu = _tensors((25, [6, 1, 0, 12], 2), 3, 4, 5, torch.float64)
    w.requires_grad_()
    dy = torch.randn(25, 3, 5, dtype=torch.float64)
    (segment_matmul_reference(x, w, cu) * dy).sum().backward()
    assert rel_error(segment_matmul_weight_grad_reference(x, dy, cu), w.grad) < 1e-12


def _assert_kernels_match(x, w, cu, device="cpu"):
    """segment_matmul on ``device`` against the float64 reference: the output and both
    gradients, to the tolerance of x's dtype."""
    leaves = [t.to(device).requires_grad_() for t in (x, w)]
    y = segment_matmul(*leaves, cu.to(device))
    dy = torch.randn(y.shape).to(x.dtype)
    y.backward(dy.to(device))
    xd, wd, dyd = x.double(), w.double(), dy.double()
    tol = TOLERANCE[x.dtype]
    assert y.dtype == x.dtype and rel_error(y.cpu(), segment_matmul_reference(xd, wd, cu)) < tol
    assert rel_error(leaves[1].grad.cpu(), segment_matmul_weight_grad_reference(xd, dyd, cu)) < tol
    assert rel_error(leaves[0].grad.cpu(), segment_matmul_reference(dyd, wd.transpose(-1, -2), cu)) < tol


@pytest.mark.interpret
@given(cases(), st.sampled_from([(1, 16, 16), (2, 20, 40), (3, 128, 72)]),
       st.sampled_from([torch.float32, torch.bfloat16]), st.sampled_from([torch.int32, torch.int64]))  # fmt: skip
def test_kernels_match_the_reference(case, dims, dtype, index_dtype):
    _assert_kernels_match(*_tensors(case, *dims, dtype, index_dtype))


def test_opcheck():
    x, w, cu = _tensors((20, [5, 0, 9], 1), 2, 4, 3, torch.float32)
    torch.library.opcheck(torch.ops.cp_ops.segment_matmul.default, (x, w, cu))
    torch.library.opcheck(torch.ops.cp_ops.segment_matmul_weight_grad.default, (x, torch.randn(20, 2, 3), cu))


@pytest.mark.parametrize(
    "shapes, message",
    [
        (((4, 2, 3), (2, 2, 3, 5), 3), None),
        (((4, 2, 3), (2, 2, 3, 5), 4), "S = len\\(cu\\) - 1"),
        (((4, 2, 3), (2, 2, 4, 5), 3), "x's \\[H, K\\]"),
        (((4, 3), (2, 2, 3, 5), 3), "x must be 3-D"),
        (((4, 2, 3), (2, 3, 5), 3), "w must be 4-D"),
    ],
)
def test_bad_input(shapes, message):
    (xs, ws, n_cu) = shapes
    x, w, cu = torch.randn(xs), torch.randn(ws), torch.arange(n_cu)
    if message is None:
        assert segment_matmul(x, w, cu).shape == (4, 2, 5)
        return
    with pytest.raises(ValueError, match=message):
        segment_matmul(x, w, cu)
    with pytest.raises(TypeError, match="int32 or int64"):
        segment_matmul(torch.randn(4, 2, 3), torch.randn(2, 2, 3, 5), torch.arange(3.0))


@pytest.mark.parametrize("kind", ["forward", "weight_grad"])
@pytest.mark.parametrize("x_type, other_type", [("*bf16", "*fp32"), ("*bf16", "*bf16"), ("*fp32", "*fp32")])
def test_kernels_compile_for_hopper(kind, x_type, other_type):
    """The interpreter ignores tl.dot's input precision: compile both kernels for sm_90 with the
    precision the op gives their operands (TF32 for 16-bit ones, TF32x3 with a float32 one) at the
    state mode's widths (128 x 128), as the GPU launches them, down to tensor-core instructions."""
    pytest.importorskip("triton.backends.nvidia")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from custom_ops.grouped_matmul import kernels
    from custom_ops.grouped_matmul.op import _tiles

    kernel = kernels.segment_matmul_kernel if kind == "forward" else kernels.segment_matmul_weight_grad_kernel
    dtypes = {"*bf16": torch.bfloat16, "*fp32": torch.float32}
    operands = (torch.empty(0, dtype=dtypes[x_type]), torch.empty(0, dtype=dtypes[other_type]))
    constants = {**_tiles(128, 128, *operands), "BLOCK_M": 64}
    assert constants["PRECISION"] == ("tf32" if x_type == other_type == "*bf16" else "tf32x3")
    out_type = x_type if kind == "forward" else "*fp32"
    pointers = {"X": x_type, "W": other_type, "DY": other_type, "CU": "*i64", "Y": out_type, "DW": out_type}
    names = kernel.arg_names
    signature = {n: "constexpr" if n in constants else pointers.get(n, "i32") for n in names}
    source = ASTSource(fn=kernel, signature=signature, constexprs={(names.index(k),): v for k, v in constants.items()})
    try:
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
    except (ImportError, TypeError, AttributeError) as e:  # compile API of another triton release
        pytest.skip(f"cannot compile for sm_90 with triton {triton.__version__}: {e}")
    assert "wgmma" in compiled.asm["ptx"] or "mma.sync" in compiled.asm["ptx"]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lengths", [[300, 0, 1, 200, 64, 7], [4096, 1000, 3]])
def test_cuda_kernels_match_the_reference(lengths, dtype):
    """The compiled kernels at the state mode's widths (32 heads, 128 x 128 matrices) against
    the float64 reference: output and both gradients."""
    _assert_kernels_match(*_tensors((sum(lengths) + 5, lengths, 2), 32, 128, 128, dtype), device="cuda")
