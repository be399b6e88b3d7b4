"""thd_seq_to_rank_order / thd_rank_to_seq_order: reference, opcheck, gradients, compile, kernel."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import custom_ops
from cp_ops import pad_cu_seqlens
from custom_ops import kernels_visible_to_compiler
from custom_ops.testing import (
    UNSIGNED_DTYPES,
    layout_dtypes,
    poisoned_allocations,
    random_tensor,
    same_bits,
    strided_views,
    thd_layouts,
    thd_packings,
    trailing_shapes,
)
from custom_ops.thd_reorder.reference import (
    thd_rank_to_seq_order_loop,
    thd_rank_to_seq_order_reference,
    thd_seq_to_rank_order_loop,
    thd_seq_to_rank_order_reference,
)

OPS = [
    (custom_ops.thd_seq_to_rank_order, thd_seq_to_rank_order_loop),
    (custom_ops.thd_rank_to_seq_order, thd_rank_to_seq_order_loop),
]


def _case(cp_size, seqlens, trailing, dtype, index_dtype=torch.int32):
    _, cup = pad_cu_seqlens(seqlens, cp_size)
    x = random_tensor((int(cup[-1]),) + trailing, dtype)
    return x, cup.to(index_dtype)


def _rank_order_rows(packing) -> list[int]:
    """The sequence-order row of every rank-order row, from the layout's definition
    (docs/design.md section 2) by plain loops: rank r holds chunk r then chunk 2W-1-r of
    every sequence, in order."""
    w, rows = packing.cp_size, []
    bounds = packing.cu_seqlens_padded.tolist()
    for r in range(w):
        for start, end in zip(bounds[:-1], bounds[1:]):
            c = (end - start) // (2 * w)
            for j in (r, 2 * w - 1 - r):
                rows.extend(range(start + j * c, start + (j + 1) * c))
    return rows


def _check_against_definition(packing, trailing, dtype, data):
    """Both ops on a drawn memory layout of x against the definition: every dtype compared as bits."""
    x = random_tensor((packing.num_rows,) + trailing, dtype)
    x_view = data.draw(strided_views(x), label="x memory layout")
    rows = torch.tensor(_rank_order_rows(packing), dtype=torch.int64)
    want_rank = x[rows]
    want_seq = x[torch.argsort(rows)]  # the inverse permutation
    cup, w = packing.cu_seqlens_padded, packing.cp_size
    assert same_bits(custom_ops.thd_seq_to_rank_order(x_view, cup, w), want_rank)
    assert same_bits(custom_ops.thd_rank_to_seq_order(x_view, cup, w), want_seq)


# --- agreement with the definition -------------------------------------------------------------


@given(thd_packings(), trailing_shapes(), layout_dtypes(), st.data())
def test_matches_the_definition_any_dtype_and_memory_layout(packing, trailing, dtype, data):
    """No sequences, empty and one-token ones, W = 1-8, int32 and int64 cu_seqlens_padded,
    every dtype, contiguous / offset / strided / transposed inputs."""
    _check_against_definition(packing, trailing, dtype, data)


@pytest.mark.slow
@settings(max_examples=400)
@given(thd_packings(max_seqs=12, max_len=200), trailing_shapes(), layout_dtypes(), st.data())
def test_matches_the_definition_wide(packing, trailing, dtype, data):
    _check_against_definition(packing, trailing, dtype, data)



@given(thd_layouts(), trailing_shapes())
def test_round_trips_are_identity(layout, trailing):
    cp_size, seqlens = layout
    x, cup = _case(cp_size, seqlens, trailing, torch.float32)
    rank_order = custom_ops.thd_seq_to_rank_order(x, cup, cp_size)
    assert torch.equal(custom_ops.thd_rank_to_seq_order(rank_order, cup, cp_size), x)
    seq_order = custom_ops.thd_rank_to_seq_order(x, cup, cp_size)
    assert torch.equal(custom_ops.thd_seq_to_rank_order(seq_order, cup, cp_size), x)


@pytest.mark.parametrize("dtype", UNSIGNED_DTYPES)
def test_unsigned_dtypes_of_one_dim_on_cpu(dtype):
    x, cup = _case(2, [5, 3], (), dtype)
    assert same_bits(custom_ops.thd_seq_to_rank_order(x, cup, 2), thd_seq_to_rank_order_loop(x, cup, 2))


def test_torch_ops_namespace_is_the_same_op():
    x, cup = _case(2, [5, 0, 9], (3,), torch.float32)
    assert torch.equal(torch.ops.cp_ops.thd_seq_to_rank_order(x, cup, 2), custom_ops.thd_seq_to_rank_order(x, cup, 2))
    assert torch.equal(torch.ops.cp_ops.thd_rank_to_seq_order(x, cup, 2), custom_ops.thd_rank_to_seq_order(x, cup, 2))


def test_known_small_layout():
    # W = 2, one sequence of 8 rows: chunks of 2; rank 0 holds chunks 0, 3; rank 1 holds 1, 2.
    x = torch.arange(8)
    cup = torch.tensor([0, 8], dtype=torch.int32)
    assert custom_ops.thd_seq_to_rank_order(x, cup, 2).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]


# --- opcheck ----------------------------------------------------------------------------------


def _opcheck_samples():
    x, cup = _case(3, [7, 0, 1, 12], (4, 2), torch.float32)
    yield x, cup, 3
    yield x.double(), cup.long(), 3
    yield x[:0], torch.zeros(1, dtype=torch.int32), 3  # T = 0, B = 0
    xt = random_tensor((8, int(cup[-1])), torch.float32).t()  # non-contiguous
    yield xt, cup, 3
    yield x.requires_grad_(), cup, 1


@pytest.mark.parametrize("op", [custom_ops.thd_seq_to_rank_order, custom_ops.thd_rank_to_seq_order])
def test_opcheck(op):
    for args in _opcheck_samples():
        torch.library.opcheck(op, args)


# --- gradients --------------------------------------------------------------------------------


@pytest.mark.parametrize("cp_size,seqlens", [(1, [3, 0, 2]), (2, [5, 1]), (3, [0, 7, 12]), (5, [11])])
def test_gradcheck(cp_size, seqlens):
    x, cup = _case(cp_size, seqlens, (2,), torch.float64)
    x.requires_grad_()
    for fn in (
        custom_ops.thd_seq_to_rank_order,
        custom_ops.thd_rank_to_seq_order,
        thd_seq_to_rank_order_reference,
        thd_rank_to_seq_order_reference,
    ):
        assert torch.autograd.gradcheck(lambda t, fn=fn: fn(t, cup, cp_size), (x,))


def test_backward_is_inverse_reorder():
    x, cup = _case(4, [9, 3, 20], (3,), torch.float32)
    x.requires_grad_()
    grad = torch.randn_like(x)
    custom_ops.thd_seq_to_rank_order(x, cup, 4).backward(grad)
    assert torch.equal(x.grad, thd_rank_to_seq_order_loop(grad, cup, 4))


# --- compile ----------------------------------------------------------------------------------


def test_compiled_fullgraph_dynamic_no_recompile():
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")

    def round_trip(x, cup):
        y = torch.ops.cp_ops.thd_seq_to_rank_order(x * 2, cup, 2)
        return torch.ops.cp_ops.thd_rank_to_seq_order(y, cup, 2) + 1, y

    compiled = torch.compile(round_trip, backend=counter, fullgraph=True, dynamic=True)
    # Sizes chosen so no row count or B+1 equals a trailing dim: dynamo's duck sizing would
    # otherwise tie the two symbols together and recompile when they part.
    for seqlens in ([5, 9], [17, 0, 3, 8], [40], [1, 2, 3, 4, 5, 6], [33, 12, 7]):
        x, cup = _case(2, seqlens, (16, 64), torch.float32)
        out, y = compiled(x, cup)
        assert torch.equal(out, x * 2 + 1)
        assert torch.equal(y, thd_seq_to_rank_order_loop(x * 2, cup, 2))
    assert counter.frame_count == 1


# --- the Triton kernel (CPU tensors, TRITON_INTERPRET=1) ----------------------------------------


def _check_kernel(packing, trailing, dtype, data):
    x = random_tensor((packing.num_rows,) + trailing, dtype)
    x_view = data.draw(strided_views(x), label="x memory layout")
    cup, w = packing.cu_seqlens_padded, packing.cp_size
    with poisoned_allocations():
        to_rank = custom_ops.thd_seq_to_rank_order(x_view, cup, w)
        to_seq = custom_ops.thd_rank_to_seq_order(x_view, cup, w)
    assert same_bits(to_rank, thd_seq_to_rank_order_loop(x, cup, w))
    assert same_bits(to_seq, thd_rank_to_seq_order_loop(x, cup, w))


@pytest.mark.interpret
@given(thd_packings(max_seqs=4, max_len=24), trailing_shapes(), layout_dtypes(), st.data())
def test_kernel_matches_reference_bit_exact(packing, trailing, dtype, data):
    """The kernel with int32 and int64 cu_seqlens_padded, W = 1-8, no sequences, every dtype
    (those Triton has no type for moved as integer words) and every memory layout of x."""
    _check_kernel(packing, trailing, dtype, data)


@pytest.mark.interpret
@pytest.mark.slow
@settings(max_examples=200)
@given(thd_packings(max_seqs=8, max_len=80), trailing_shapes(), layout_dtypes(), st.data())
def test_kernel_matches_reference_bit_exact_wide(packing, trailing, dtype, data):
    _check_kernel(packing, trailing, dtype, data)


@pytest.mark.interpret
def test_kernel_two_word_dtypes_of_contiguous_strided_views():
    """complex128 moves as two int64 words; a tensor contiguous by torch's rule (no element, or
    one) may still have a last stride other than 1, which a view in words cannot take."""
    x = random_tensor((0, 6), torch.complex128)[:, ::2]  # contiguous (no elements), stride (6, 2)
    cup = torch.zeros(1, dtype=torch.int32)
    assert same_bits(custom_ops.thd_seq_to_rank_order(x, cup, 2), x)


@pytest.mark.interpret
def test_kernel_wide_rows_and_gradient(poison_empty):
    # rows wider than one tile (second grid axis) and the autograd path through the kernel
    x, cup = _case(3, [13, 0, 1, 30], (3, 1100), torch.float32)
    x.requires_grad_()
    y = custom_ops.thd_seq_to_rank_order(x, cup, 3)
    assert torch.equal(y, thd_seq_to_rank_order_loop(x.detach(), cup, 3))
    grad = torch.randn_like(y)
    y.backward(grad)
    assert torch.equal(x.grad, thd_rank_to_seq_order_loop(grad, cup, 3))


# --- bad input --------------------------------------------------------------------------------


@pytest.mark.parametrize("op", [custom_ops.thd_seq_to_rank_order, custom_ops.thd_rank_to_seq_order])
def test_bad_input(op):
    x, cup = _case(2, [4, 8], (3,), torch.float32)
    with pytest.raises(TypeError, match="cu_seqlens_padded must be int32 or int64"):
        op(x, cup.float(), 2)
    with pytest.raises(ValueError, match="cp_size must be >= 1"):
        op(x, cup, 0)
    with pytest.raises(ValueError, match="must be 1-D"):
        op(x, cup[None], 2)
    with pytest.raises(ValueError, match="not a multiple of 2\\*cp_size"):
        op(x[:6], cup, 2)
    with pytest.raises(ValueError, match="on meta but the data is on cpu"):
        op(x, cup.to("meta"), 2)


# --- GPU ----------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.complex64, torch.bool])
@pytest.mark.parametrize("cp_size", [1, 2, 3, 8])
def test_gpu_kernel_matches_loop_definition(dtype, cp_size):
    g = torch.Generator().manual_seed(cp_size)
    seqlens = [0, 1] + torch.randint(0, 1200, (13,), generator=g).tolist()
    for trailing in [(16, 64), (3,), (), (2, 4100)]:
        _, cup = pad_cu_seqlens(seqlens, cp_size)
        x = random_tensor((int(cup[-1]),) + trailing, torch.float32).to(dtype) if dtype != torch.bool else (
            random_tensor((int(cup[-1]),) + trailing, torch.float32) > 0
        )
        x_gpu, cup_gpu = x.cuda(), cup.cuda()
        assert torch.equal(custom_ops.thd_seq_to_rank_order(x_gpu, cup_gpu, cp_size).cpu().view(torch.uint8),
                           thd_seq_to_rank_order_loop(x, cup, cp_size).view(torch.uint8))
        assert torch.equal(custom_ops.thd_rank_to_seq_order(x_gpu, cup_gpu, cp_size).cpu().view(torch.uint8),
                           thd_rank_to_seq_order_loop(x, cup, cp_size).view(torch.uint8))


@pytest.mark.gpu
def test_gpu_compiled_graph_runs_the_triton_kernel():
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    x, cup = _case(4, [100, 7, 0, 300], (16, 64), torch.bfloat16)
    x, cup = x.cuda().requires_grad_(), cup.cuda()

    def fn(x):
        return (torch.ops.cp_ops.thd_seq_to_rank_order(x, cup, 4).float() * 2).sum()

    compiled = torch.compile(fn, fullgraph=True)
    loss, code = run_and_get_code(lambda: compiled(x))
    # the kernel itself in Inductor's code, or the opaque op that launches it (kernels_visible_to_compiler)
    launcher = "thd_reorder_kernel" if kernels_visible_to_compiler() else "cp_ops.thd_seq_to_rank_order"
    assert any(launcher in c for c in code)
    loss.backward()
    assert torch.equal(x.grad, torch.full_like(x, 2))


def test_compiled_with_cp_size_changing_between_calls():
    # dynamo makes an int that changes between calls symbolic: the op must accept a SymInt cp_size
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, cup, w: torch.ops.cp_ops.thd_seq_to_rank_order(x, cup, w), fullgraph=True)
    for w in (2, 4, 8):
        x, cup = _case(w, [19, 0, 40], (5,), torch.float32)
        assert torch.equal(compiled(x, cup, w), thd_seq_to_rank_order_loop(x, cup, w))
