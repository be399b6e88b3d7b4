"""thd_copy_valid_tokens (functional) and thd_copy_valid_tokens_ (in place)."""

import contextlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import custom_ops
from cp_ops import local_cu_seqlens, pad_cu_seqlens
from custom_ops.testing import (
    index_dtypes,
    layout_dtypes,
    poisoned_allocations,
    random_tensor,
    same_bits,
    strided_views,
    thd_layouts,
    trailing_shapes,
)
from custom_ops.valid_tokens.reference import thd_copy_valid_tokens_loop, thd_copy_valid_tokens_reference


def _case(cp_size, seqlens, trailing, dtype, local=False, offsets_len="B+1", index_dtype=torch.int32):
    """dst, src over the padded layout; segments at the padded (or local) offsets."""
    cu, cup = pad_cu_seqlens(seqlens, cp_size)
    offsets = cup
    if local:  # a rank's local shard: offsets cup / W, real lengths capped to the local rows
        offsets = local_cu_seqlens(cup, cp_size)
        cu, _ = pad_cu_seqlens([min(n, int(p) // cp_size) for n, p in zip(seqlens, cup.diff())], 1)
    if offsets_len == "B":
        offsets = offsets[:-1]
    rows = int(offsets[-1]) if offsets_len == "B+1" else int(cup[-1]) // (cp_size if local else 1)
    dst = random_tensor((rows,) + trailing, dtype)
    src = random_tensor((rows,) + trailing, dtype)
    return dst, src, offsets.to(index_dtype), cu.to(index_dtype)


# (cp_size, seqlens), a local shard's offsets or the global ones, offsets of B or B+1 entries
layouts = st.tuples(thd_layouts(min_seqs=0), st.booleans(), st.sampled_from(["B", "B+1"]))


def _definition(dst, src, offsets, cu):
    """The contract spelled out row by row: rows offsets[i] + j, j < L_i, from src."""
    out = dst.clone()
    bounds = cu.tolist()
    for i in range(len(bounds) - 1):
        start = int(offsets[i])
        for row in range(start, start + bounds[i + 1] - bounds[i]):
            out[row] = src[row]
    return out


def _check(layout, trailing, dtype, index_dtype, data, kernel=False):
    (cp_size, seqlens), local, offsets_len = layout
    dst, src, offsets, cu = _case(cp_size, seqlens, trailing, dtype, local, offsets_len, index_dtype)
    dst_view = data.draw(strided_views(dst), label="dst memory layout")
    src_view = data.draw(strided_views(src), label="src memory layout")
    expected = _definition(dst, src, offsets, cu)
    with poisoned_allocations() if kernel else contextlib.nullcontext():
        out = custom_ops.thd_copy_valid_tokens(dst_view, src_view, offsets, cu)
    assert same_bits(out, expected)
    # in place: any dst on the CPU path; the kernel path writes a contiguous dst (offset in its storage or not)
    inplace = dst_view.clone() if not kernel or dst_view.is_contiguous() else dst.clone()
    with poisoned_allocations() if kernel else contextlib.nullcontext():
        custom_ops.thd_copy_valid_tokens_(inplace, src_view, offsets, cu)
    assert same_bits(inplace, expected)


@given(layouts, trailing_shapes(), layout_dtypes(), index_dtypes(), st.data())
def test_matches_the_definition(layout, trailing, dtype, index_dtype, data):
    """No sequences, empty and one-token ones, W = 1-8, global and local offsets, int32 and
    int64 indices, every dtype, dst and src in any memory layout; functional and in place."""
    _check(layout, trailing, dtype, index_dtype, data)


@pytest.mark.slow
@settings(max_examples=400)
@given(
    st.tuples(thd_layouts(max_seqs=12, max_len=200, min_seqs=0), st.booleans(), st.sampled_from(["B", "B+1"])),
    trailing_shapes(), layout_dtypes(), index_dtypes(), st.data(),
)  # fmt: skip
def test_matches_the_definition_wide(layout, trailing, dtype, index_dtype, data):
    _check(layout, trailing, dtype, index_dtype, data)


def test_no_sequences_returns_dst():
    dst, src = torch.randn(4, 2), torch.randn(4, 2)
    cu = torch.zeros(1, dtype=torch.int32)
    assert torch.equal(custom_ops.thd_copy_valid_tokens(dst, src, cu[:0], cu), dst)


def test_unsorted_gaps_and_partial_rows():
    # segments need not start at 0 nor tile the rows
    dst, src = torch.randn(12, 3), torch.randn(12, 3)
    offsets = torch.tensor([2, 5, 11], dtype=torch.int64)
    cu = torch.tensor([0, 2, 2, 3], dtype=torch.int64)
    out = torch.ops.cp_ops.thd_copy_valid_tokens(dst, src, offsets, cu)
    from_src = torch.zeros(12, dtype=torch.bool)
    from_src[[2, 3, 11]] = True
    assert torch.equal(out[from_src], src[from_src]) and torch.equal(out[~from_src], dst[~from_src])


# --- opcheck ----------------------------------------------------------------------------------


def _opcheck_samples():
    dst, src, offsets, cu = _case(2, [5, 0, 1, 9], (2, 3), torch.float32)
    yield dst, src, offsets, cu
    yield dst.double(), src.double(), offsets.long(), cu.long()
    yield dst, src, offsets[:-1], cu
    yield dst[:0], src[:0], torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    yield dst.transpose(1, 2), src.transpose(1, 2), offsets, cu  # non-contiguous
    yield dst.clone().requires_grad_(), src.clone().requires_grad_(), offsets, cu


def test_opcheck():
    for args in _opcheck_samples():
        torch.library.opcheck(custom_ops.thd_copy_valid_tokens, args)
    for dst, src, offsets, cu in _opcheck_samples():
        if not dst.requires_grad:
            torch.library.opcheck(custom_ops.thd_copy_valid_tokens_, (dst.clone(), src, offsets, cu))


# --- gradients --------------------------------------------------------------------------------


@pytest.mark.parametrize("cp_size,seqlens,local", [(1, [3, 0, 2], False), (2, [5, 1, 8], True), (3, [0, 7], False)])
def test_gradcheck(cp_size, seqlens, local):
    dst, src, offsets, cu = _case(cp_size, seqlens, (2,), torch.float64, local)
    dst.requires_grad_()
    src.requires_grad_()
    for fn in (custom_ops.thd_copy_valid_tokens, thd_copy_valid_tokens_reference):
        assert torch.autograd.gradcheck(lambda d, s, fn=fn: fn(d, s, offsets, cu), (dst, src))


# --- compile ----------------------------------------------------------------------------------


def _functional(dst, src, offsets, cu):
    return torch.ops.cp_ops.thd_copy_valid_tokens(dst, src * 3, offsets, cu) + 1


def _in_place(dst, src, offsets, cu):
    out = dst * 2
    torch.ops.cp_ops.thd_copy_valid_tokens_(out, src, offsets, cu)
    return out


@pytest.mark.parametrize(
    "fn,expected",
    [
        # the functional form in the slow tier: test_op_contracts.py compiles it with Inductor
        pytest.param(_functional, lambda d, s, o, c: thd_copy_valid_tokens_loop(d, s * 3, o, c) + 1,
                     marks=pytest.mark.slow, id="functional"),
        pytest.param(_in_place, lambda d, s, o, c: thd_copy_valid_tokens_loop(d * 2, s, o, c), id="in_place"),
    ],
)
def test_compiled_fullgraph_dynamic_no_recompile(fn, expected):
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(fn, backend=counter, fullgraph=True, dynamic=True)
    for seqlens in ([5, 9], [17, 0, 3, 8], [40], [1, 2, 3, 4, 5, 6], [33, 12, 7]):
        dst, src, offsets, cu = _case(2, seqlens, (16, 64), torch.float32)
        assert torch.equal(compiled(dst, src, offsets, cu), expected(dst, src, offsets, cu))
    assert counter.frame_count == 1


# --- the Triton kernel (CPU tensors, TRITON_INTERPRET=1) ----------------------------------------


@pytest.mark.interpret
@given(layouts, trailing_shapes(), layout_dtypes(), index_dtypes(), st.data())
def test_kernel_matches_reference_bit_exact(layout, trailing, dtype, index_dtype, data):
    """The kernel with int32 and int64 indices, every dtype (those Triton has no type for moved
    as integer words), dst and src in any memory layout; fresh memory poisoned."""
    _check(layout, trailing, dtype, index_dtype, data, kernel=True)


@pytest.mark.interpret
@pytest.mark.slow
@settings(max_examples=200)
@given(
    st.tuples(thd_layouts(max_seqs=8, max_len=80, min_seqs=0), st.booleans(), st.sampled_from(["B", "B+1"])),
    trailing_shapes(), layout_dtypes(), index_dtypes(), st.data(),
)  # fmt: skip
def test_kernel_matches_reference_bit_exact_wide(layout, trailing, dtype, index_dtype, data):
    _check(layout, trailing, dtype, index_dtype, data, kernel=True)


@pytest.mark.interpret
def test_kernel_gradient(poison_empty):
    dst, src, offsets, cu = _case(2, [7, 0, 13], (2, 700), torch.float32, local=True)
    dst.requires_grad_()
    src.requires_grad_()
    grad = torch.randn_like(dst)
    custom_ops.thd_copy_valid_tokens(dst, src, offsets, cu).backward(grad)
    mask = thd_copy_valid_tokens_loop(torch.zeros_like(grad), torch.ones_like(grad), offsets, cu).bool()
    assert torch.equal(src.grad, torch.where(mask, grad, 0))
    assert torch.equal(dst.grad, torch.where(mask, 0, grad))


# --- bad input --------------------------------------------------------------------------------


def test_bad_input():
    dst, src, offsets, cu = _case(2, [4, 8], (3,), torch.float32)
    op = custom_ops.thd_copy_valid_tokens
    with pytest.raises(TypeError, match="cu_seqlens must be int32 or int64"):
        op(dst, src, offsets, cu.float())
    with pytest.raises(TypeError, match="offsets must be int32 or int64"):
        op(dst, src, offsets.double(), cu)
    with pytest.raises(ValueError, match="offsets must have B or B\\+1 entries"):
        op(dst, src, offsets[:1], cu)
    with pytest.raises(ValueError, match="one shape"):
        op(dst, src[:4], offsets, cu)
    with pytest.raises(TypeError, match="one dtype"):
        op(dst, src.double(), offsets, cu)
    with pytest.raises(ValueError, match="dst is on cpu but src is on meta"):
        op(dst, src.to("meta"), offsets, cu)
    with pytest.raises(ValueError, match="cu_seqlens is on meta but the data is on cpu"):
        op(dst, src, offsets, cu.to("meta"))


# --- GPU ----------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn])
@pytest.mark.parametrize("local", [False, True])
def test_gpu_kernel_matches_loop_definition(dtype, local):
    g = torch.Generator().manual_seed(int(local))
    seqlens = [0, 1] + torch.randint(0, 1200, (13,), generator=g).tolist()
    for trailing in [(16, 64), (3,), (2, 4100)]:
        dst, src, offsets, cu = _case(4, seqlens, trailing, torch.float32, local)
        dst, src = dst.to(dtype), src.to(dtype)
        expected = thd_copy_valid_tokens_loop(dst, src, offsets, cu).view(torch.uint8)
        args = [t.cuda() for t in (dst, src, offsets, cu)]
        assert torch.equal(custom_ops.thd_copy_valid_tokens(*args).cpu().view(torch.uint8), expected)
        custom_ops.thd_copy_valid_tokens_(*args)
        assert torch.equal(args[0].cpu().view(torch.uint8), expected)


@pytest.mark.interpret
def test_in_place_kernel_writes_a_one_element_strided_dst():
    """A one-element complex128 dst is contiguous by torch's rule whatever its strides; its view in
    words must then be a copy, and the in-place op still writes dst itself."""
    dst = random_tensor((1, 2), torch.complex128).as_strided((1, 1), (2, 2))
    src = random_tensor((1, 1), torch.complex128)
    assert dst.is_contiguous() and dst.stride(-1) != 1
    cu = torch.tensor([0, 1], dtype=torch.int32)
    custom_ops.thd_copy_valid_tokens_(dst, src, torch.zeros(1, dtype=torch.int32), cu)
    assert same_bits(dst, src)
