"""permute_sections / unpermute_sections: reference, opcheck, gradients, compile, kernel."""

import contextlib
import inspect

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import custom_ops
from custom_ops.sections.op import rank_blocks_to_sections, sections_to_rank_blocks
from custom_ops.sections.reference import (
    permute_sections_loop,
    permute_sections_reference,
    unpermute_sections_reference,
)
from custom_ops.testing import (
    LAYOUT_DTYPES,
    UNSIGNED_DTYPES,
    layout_dtypes,
    poisoned_allocations,
    random_tensor,
    same_bits,
    section_layouts,
    strided_views,
)

# (cp_size, sections, leading shape): W = 1-8, zero-width and unequal sections
section_cases = section_layouts


def _case(cp_size, sections, lead, dtype):
    if dtype.is_complex:  # random_tensor covers real and integer dtypes
        return torch.randn(lead + (sum(sections),), dtype=dtype)
    return random_tensor(lead + (sum(sections),), dtype)


# --- agreement with the definition -------------------------------------------------------------


def _definition(x, sections, cp_size):
    """Output block r = rank r's contiguous slice of every section, in section order, by loops."""
    cols, start = [], 0
    for r in range(cp_size):
        start = 0
        for width in sections:
            part = width // cp_size
            cols.extend(range(start + r * part, start + (r + 1) * part))
            start += width
    return torch.tensor(cols, dtype=torch.int64)


def _check(case, dtype, data, kernel=False):
    cp_size, sections, lead = case
    x = _case(cp_size, sections, lead, dtype)
    x_view = data.draw(strided_views(x), label="x memory layout")
    cols = _definition(x, sections, cp_size)
    want = x[..., cols]
    want_inverse = x[..., torch.argsort(cols)]
    with poisoned_allocations() if kernel else contextlib.nullcontext():
        out = custom_ops.permute_sections(x_view, sections, cp_size)
        back = custom_ops.unpermute_sections(x_view, sections, cp_size)
    assert same_bits(out, want)
    assert same_bits(back, want_inverse)


@given(section_cases(), layout_dtypes(), st.data())
def test_matches_the_definition_any_dtype_and_memory_layout(case, dtype, data):
    """Both directions against the definition: W = 1-8, every dtype, any memory layout of x."""
    _check(case, dtype, data)


@pytest.mark.slow
@settings(max_examples=400)
@given(section_layouts(max_sections=10, max_multiple=40), layout_dtypes(), st.data())
def test_matches_the_definition_wide(case, dtype, data):
    _check(case, dtype, data)


@pytest.mark.parametrize("dtype", UNSIGNED_DTYPES)
def test_unsigned_dtypes_of_one_dim_on_cpu(dtype):
    x = _case(2, [4, 2], (), dtype)
    assert same_bits(custom_ops.permute_sections(x, [4, 2], 2), permute_sections_loop(x, [4, 2], 2))


@given(section_cases())
def test_rank_blocks_are_the_permutation_with_blocks_in_front(case):
    # the send-buffer layout of the all-to-all: [W, ..., F/W], block d = output block d
    cp_size, sections, lead = case
    x = _case(cp_size, sections, lead, torch.float32)
    blocks = torch.ops.cp_ops.sections_to_rank_blocks(x, sections, cp_size)
    width = sum(sections) // cp_size
    expect = permute_sections_loop(x, sections, cp_size).unflatten(-1, (cp_size, width)).movedim(-2, 0)
    assert torch.equal(blocks, expect)
    assert torch.equal(torch.ops.cp_ops.rank_blocks_to_sections(blocks, sections, cp_size), x)


def test_known_small_layout():
    # W = 2, sections [4, 2]: rank 0 gets columns 0,1 (of a) and 4 (of b); rank 1 gets 2,3 and 5
    x = torch.arange(6)[None]
    assert custom_ops.permute_sections(x, [4, 2], 2).tolist() == [[0, 1, 4, 2, 3, 5]]


def test_reference_signature_and_namespace():
    x = random_tensor((5, 12), torch.float32)
    for name in ("permute_sections", "unpermute_sections"):
        op, ref = getattr(custom_ops, name), getattr(custom_ops, f"{name}_reference")
        assert list(inspect.signature(ref).parameters) == ["x", "sections", "cp_size"]
        assert torch.equal(getattr(torch.ops.cp_ops, name)(x, [6, 3, 3], 3), op(x, [6, 3, 3], 3))
        assert torch.equal(op(x, [6, 3, 3], 3), ref(x, [6, 3, 3], 3))


# --- opcheck ----------------------------------------------------------------------------------


def _opcheck_samples():
    x = random_tensor((5, 3, 18), torch.float32)
    yield x, [6, 0, 9, 3], 3
    yield x.double(), [18], 1
    yield x[:0], [6, 12], 3  # no rows
    yield random_tensor((18, 5), torch.float32).t(), [12, 6], 2  # non-contiguous
    yield random_tensor((4, 0), torch.float32), [], 2  # no features
    yield x.clone().requires_grad_(), [2, 4, 12], 2


@pytest.mark.parametrize("op", [custom_ops.permute_sections, custom_ops.unpermute_sections, sections_to_rank_blocks])
def test_opcheck(op):
    for args in _opcheck_samples():
        torch.library.opcheck(op, args)


def test_opcheck_rank_blocks_to_sections():
    for x, sections, cp_size in _opcheck_samples():
        blocks = sections_to_rank_blocks(x.detach(), sections, cp_size).requires_grad_(x.requires_grad)
        torch.library.opcheck(rank_blocks_to_sections, (blocks, sections, cp_size))


# --- gradients --------------------------------------------------------------------------------


@pytest.mark.parametrize("cp_size,sections", [(1, [3, 2]), (2, [4, 0, 2]), (3, [9, 3, 6]), (4, [4])])
def test_gradcheck(cp_size, sections):
    x = random_tensor((3, 2, sum(sections)), torch.float64).requires_grad_()
    for fn in (
        custom_ops.permute_sections,
        custom_ops.unpermute_sections,
        permute_sections_reference,
        unpermute_sections_reference,
    ):
        assert torch.autograd.gradcheck(lambda t, fn=fn: fn(t, sections, cp_size), (x,))
    assert torch.autograd.gradcheck(lambda t: sections_to_rank_blocks(t, sections, cp_size), (x,))
    blocks = sections_to_rank_blocks(x.detach(), sections, cp_size).requires_grad_()
    assert torch.autograd.gradcheck(lambda t: rank_blocks_to_sections(t, sections, cp_size), (blocks,))


def test_backward_is_the_inverse_permutation():
    sections = [8, 4, 12, 4]
    x = random_tensor((6, sum(sections)), torch.float32).requires_grad_()
    grad = random_tensor((6, sum(sections)), torch.float32)
    custom_ops.permute_sections(x, sections, 4).backward(grad)
    assert torch.equal(x.grad, unpermute_sections_reference(grad, sections, 4))


# --- compile ----------------------------------------------------------------------------------


def test_compiled_fullgraph():
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    sections = [6, 2, 10, 0, 4]

    def round_trip(x):
        y = torch.ops.cp_ops.permute_sections(x * 2, sections, 2)
        return torch.ops.cp_ops.unpermute_sections(y, sections, 2) + 1, y

    compiled = torch.compile(round_trip, backend=counter, fullgraph=True, dynamic=True)
    for rows in (5, 17, 40):
        x = random_tensor((rows, 3, sum(sections)), torch.float32).requires_grad_()
        out, y = compiled(x)
        assert torch.equal(y, permute_sections_loop(x.detach() * 2, sections, 2))
        assert torch.equal(out, x.detach() * 2 + 1)
        grad = random_tensor(y.shape, torch.float32)
        (x.grad,) = torch.autograd.grad(y, x, grad)
        assert torch.equal(x.grad, unpermute_sections_reference(grad, sections, 2) * 2)
    assert counter.frame_count == 1


# --- the Triton kernel (CPU tensors, TRITON_INTERPRET=1) ----------------------------------------


def _check_kernel(case, dtype, data):
    cp_size, sections, lead = case
    _check(case, dtype, data, kernel=True)
    x = _case(cp_size, sections, lead, dtype)
    with poisoned_allocations():
        blocks = sections_to_rank_blocks(x, sections, cp_size)
        from_blocks = rank_blocks_to_sections(blocks, sections, cp_size)
    want = permute_sections_loop(x, sections, cp_size)
    assert same_bits(blocks, want.unflatten(-1, (cp_size, x.shape[-1] // cp_size)).movedim(-2, 0))
    assert same_bits(from_blocks, x)


@pytest.mark.interpret
@given(section_cases(max_sections=4), layout_dtypes(), st.data())
def test_kernel_matches_reference_bit_exact(case, dtype, data):
    """The kernels, W = 1-8, every dtype (those Triton has no type for moved as integer words),
    any memory layout of x; fresh memory poisoned."""
    _check_kernel(case, dtype, data)


@pytest.mark.interpret
@pytest.mark.slow
@settings(max_examples=100)
@given(section_layouts(max_sections=8, max_multiple=12), layout_dtypes(), st.data())
def test_kernel_matches_reference_bit_exact_wide(case, dtype, data):
    _check_kernel(case, dtype, data)


@pytest.mark.interpret
def test_kernel_wide_rows_and_gradient(poison_empty):
    # sections of many column tiles (4 words in the interpreter), a non-contiguous input, and autograd
    # through the kernel
    sections = [96, 192, 24, 0, 75]
    x = random_tensor((sum(sections), 5), torch.float32).t().requires_grad_()
    y = custom_ops.permute_sections(x, sections, 3)
    assert torch.equal(y, permute_sections_loop(x.detach(), sections, 3))
    grad = random_tensor(y.shape, torch.float32)
    y.backward(grad)
    assert torch.equal(x.grad, unpermute_sections_reference(grad, sections, 3))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.complex128])
@pytest.mark.parametrize("cp_size", [1, 2, 3, 8])
def test_gpu_kernel_matches_reference(dtype, cp_size):
    # Qwen3-Next's GDN sections (column tiles of 16 to 4096 bytes), odd and zero widths, trailing dims
    for sections, lead in (([2048, 2048, 4096, 4096, 32, 32], (77,)), ([3, 0, 17, 1], (5, 3)), ([1], (0,))):
        sections = [s * cp_size for s in sections]
        x = _case(cp_size, sections, lead, dtype)
        x_gpu = x.cuda()
        out = custom_ops.permute_sections(x_gpu, sections, cp_size)
        blocks = sections_to_rank_blocks(x_gpu, sections, cp_size)
        bits = x_gpu.view(torch.uint8)  # compared as bytes: torch.equal does not take every dtype on CUDA
        assert torch.equal(out.cpu().view(torch.uint8), permute_sections_reference(x, sections, cp_size).view(torch.uint8))
        assert torch.equal(custom_ops.unpermute_sections(out, sections, cp_size).view(torch.uint8), bits)
        assert torch.equal(rank_blocks_to_sections(blocks, sections, cp_size).view(torch.uint8), bits)


# --- code generation for Hopper (compiled here, no GPU needed) ------------------------------------


def _global_access_bytes(ptx: str, op: str) -> dict[bool, int]:
    """Bytes per thread moved by ``ld.global`` / ``st.global`` instructions in ``ptx``, split
    into vector (``.v2`` / ``.v4``) and scalar accesses: ``{True: vector, False: scalar}``."""
    import re

    out = {True: 0, False: 0}
    for vec, bits in re.findall(rf"{op}\.global(?:\.[\w:]+)*?(?:\.v(\d))?\.b(\d+)", ptx):
        out[bool(vec)] += int(vec or 1) * int(bits) // 8
    return out


@pytest.mark.parametrize("to_blocks", [True, False])
def test_kernel_moves_whole_vectors_on_hopper(to_blocks):
    """Loads and stores of the section-permutation kernel are 16-byte vectors (Qwen3-Next's GDN
    sections at W = 2, bf16). An earlier kernel computed each column's destination in the
    kernel; the compiler could not prove the blocked side contiguous and stored every bf16
    element on its own (scalar st.global.b16), at 1.7 TB/s on an H200 against 3.9 for a row copy."""
    pytest.importorskip("triton.backends.nvidia")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from custom_ops.sections.kernels import permute_sections_kernel as kernel
    from custom_ops.sections.op import SECTION_SETTINGS, section_tiles

    local = [s // 2 for s in (2048, 2048, 4096, 4096, 32, 32)]
    loff = [0]
    for w in local:
        loff.append(loff[-1] + w)
    blocks, block_r, _ = section_tiles(local, 2)
    constants = dict(LOFF=tuple(loff), BLOCKS=blocks, TO_BLOCKS=to_blocks, BLOCK_R=block_r)
    names = kernel.arg_names
    signature = {n: "constexpr" if n in constants else "*bf16" if n.endswith("_ptr") else "i32" for n in names}
    # what the launcher passes: 16-byte-aligned pointers, strides and row count divisible by 16
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n not in constants and n != "cp_size"}
    source = ASTSource(
        fn=kernel, signature=signature, constexprs={(names.index(k),): v for k, v in constants.items()}, attrs=aligned
    )
    try:
        ptx = triton.compile(
            source, target=GPUTarget("cuda", 90, 32), options={"num_warps": SECTION_SETTINGS.num_warps}
        ).asm["ptx"]
    except (ImportError, TypeError, AttributeError) as e:  # compile API of another triton release
        pytest.skip(f"cannot compile for sm_90 with triton {triton.__version__}: {e}")
    for op in ("ld", "st"):
        moved = _global_access_bytes(ptx, op)
        assert moved[True] >= 0.9 * (moved[True] + moved[False]), f"{op}.global mostly scalar: {moved}"


# --- bad input --------------------------------------------------------------------------------


@pytest.mark.parametrize("op", [custom_ops.permute_sections, custom_ops.unpermute_sections])
def test_bad_input(op):
    x = random_tensor((4, 12), torch.float32)
    with pytest.raises(ValueError, match=r"sections\[0\] = 9 is not divisible by cp_size = 2"):
        op(x, [9, 3], 2)
    with pytest.raises(ValueError, match=r"sum to 10, but x has 12 features"):
        op(x, [6, 4], 2)
    with pytest.raises(ValueError, match="cp_size must be >= 1"):
        op(x, [12], 0)
    with pytest.raises(ValueError, match="is negative"):
        op(x, [16, -4], 2)
    with pytest.raises(ValueError, match="0-d tensor"):
        op(x[0, 0], [], 1)


def test_bad_rank_blocks():
    blocks = random_tensor((2, 4, 6), torch.float32)
    with pytest.raises(ValueError, match=r"rank blocks must be \[cp_size = 3, ..., F/cp_size\], got \(2, 4, 6\)"):
        rank_blocks_to_sections(blocks, [9, 9], 3)
    with pytest.raises(ValueError, match=r"sum to 10, but blocks \(cp_size x last dim\) has 12 features"):
        rank_blocks_to_sections(blocks, [6, 4], 2)
    with pytest.raises(ValueError, match=r"sections\[0\] = 9 is not divisible by cp_size = 2"):
        sections_to_rank_blocks(random_tensor((4, 12), torch.float32), [9, 3], 2)
