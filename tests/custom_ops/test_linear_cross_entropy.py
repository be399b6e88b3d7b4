"""custom_ops.linear_cross_entropy: the cross-entropy of a linear head's logits, over row chunks.

Against the unfused loss (the reference: ``F.cross_entropy`` on the full logits) on drawn shapes,
labels and chunk sizes (chunks that do not divide the rows, rows without a target, none with
one), in float32 and float64; gradcheck in float64; bf16 inputs with float32 accumulation;
opcheck; the largest allocation is one chunk's logits; compiled with ``fullgraph=True`` over two
packings without a recompile; bad input.
"""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from custom_ops import default_chunk_rows, linear_cross_entropy, linear_cross_entropy_reference
from custom_ops.cross_entropy.kernels import BLOCK_COLS
from custom_ops.testing import TOLERANCE, rel_error

IGNORE = -100


@st.composite
def cases(draw):
    """``(rows, hidden, vocab, chunk_rows, labels)``: some rows without a target (all, in some
    draws), chunks of any size (larger than the rows too)."""
    rows, hidden, vocab = draw(st.integers(0, 60)), draw(st.integers(1, 12)), draw(st.integers(2, 40))
    chunk_rows = draw(st.integers(1, rows + 5))
    ignored = draw(st.sampled_from([0.0, 0.3, 1.0]))
    labels = draw(st.lists(st.integers(0, vocab - 1), min_size=rows, max_size=rows))
    drop = draw(st.lists(st.floats(0, 1), min_size=rows, max_size=rows))
    labels = [IGNORE if d < ignored else y for y, d in zip(labels, drop)]
    return rows, hidden, vocab, chunk_rows, torch.tensor(labels, dtype=torch.int64)


def _leaves(rows, hidden, vocab, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, hidden, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    w = torch.randn(vocab, hidden, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    return h, w


def _loss_and_grads(fn, h, w, labels, **kwargs):
    h, w = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    loss = fn(h, w, labels, **kwargs)
    loss.backward()
    return loss.detach(), h.grad, w.grad


@given(cases(), st.sampled_from([torch.float32, torch.float64]), st.sampled_from(["mean", "sum"]))
def test_matches_the_unfused_loss(case, dtype, reduction):
    rows, hidden, vocab, chunk_rows, labels = case
    h, w = _leaves(rows, hidden, vocab, dtype)
    got = _loss_and_grads(linear_cross_entropy, h, w, labels, reduction=reduction, chunk_rows=chunk_rows)
    want = _loss_and_grads(linear_cross_entropy_reference, h, w, labels, reduction=reduction)
    assert got[0].dtype == want[0].dtype == dtype
    if reduction == "mean" and not (labels != IGNORE).any():
        assert got[0].isnan() and want[0].isnan()  # no target: the mean is 0 / 0, as F.cross_entropy's
        return
    for name, a, b in zip(("loss", "d hidden", "d weight"), got, want):
        assert rel_error(a, b) < TOLERANCE[dtype], f"{name}: {rows} rows, chunks of {chunk_rows}"


def _against_reference(h, w, labels, dtype, reduction="sum", chunk_rows=None, oracle=torch.float64):
    """The op (its chunk kernel where Triton runs) against the unfused loss on the same inputs in
    ``oracle``'s dtype: loss, d hidden and d weight within ``dtype``'s tolerance."""
    got = _loss_and_grads(linear_cross_entropy, h, w, labels, reduction=reduction, chunk_rows=chunk_rows)
    want = _loss_and_grads(linear_cross_entropy_reference, h.to(oracle), w.to(oracle), labels, reduction=reduction)
    if reduction == "mean" and not (labels != IGNORE).any():
        assert got[0].isnan()
        return
    for name, a, b in zip(("loss", "d hidden", "d weight"), got, want):
        assert rel_error(a.double(), b) < TOLERANCE[dtype], f"{name}: {tuple(h.shape)} {tuple(w.shape)}"


@pytest.mark.interpret
@given(cases(), st.sampled_from([torch.float32, torch.bfloat16]), st.sampled_from(["mean", "sum"]))
def test_kernel_matches_the_float64_loss(case, dtype, reduction):
    """The chunk kernel in Triton's interpreter: rows without a target (all, in some draws), chunks
    of any size, one column block a row."""
    rows, hidden, vocab, chunk_rows, labels = case
    _against_reference(*_leaves(rows, hidden, vocab, dtype), labels, dtype, reduction, chunk_rows)


@pytest.mark.interpret
@pytest.mark.parametrize("vocab", [BLOCK_COLS + 3, 2 * BLOCK_COLS])
def test_kernel_over_several_column_blocks(vocab):
    """Vocabularies over one column block: the log-sum-exp carried across blocks, a masked tail."""
    labels = torch.tensor([0, vocab - 1, IGNORE, 5, BLOCK_COLS, BLOCK_COLS - 1])
    _against_reference(*_leaves(6, 4, vocab, torch.float32, seed=1), labels, torch.float32, chunk_rows=4)


@pytest.mark.interpret
def test_kernel_reads_strided_labels():
    """Labels that are a strided view (a column of a [N, 2] tensor) give the loss of their values."""
    labels = torch.stack([torch.tensor([3, IGNORE, 0, 6, 2]), torch.tensor([1, 2, 3, 4, 5])], 1)[:, 0]
    assert labels.stride(0) == 2
    _against_reference(*_leaves(5, 4, 7, torch.float32, seed=2), labels, torch.float32, chunk_rows=2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_kernel_matches_the_float64_loss(dtype):
    """The CUDA path at a real vocabulary (Qwen3-Next's), several chunks, some rows without a target.
    bf16 against the unfused loss in bf16, whose logits are rounded as the op's are (against float64
    that rounding alone, about |logit| 2^-9 in each softmax term, exceeds bf16's tolerance)."""
    gen = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 151936, (700,), generator=gen)
    labels[::7] = IGNORE
    h, w = (t.cuda().detach().requires_grad_() for t in _leaves(700, 64, 151936, dtype))
    oracle = torch.float64 if dtype == torch.float32 else dtype
    _against_reference(h, w, labels.cuda(), dtype, "mean", chunk_rows=256, oracle=oracle)


def test_no_target_gives_zero_sum_and_zero_gradients():
    h, w = _leaves(13, 5, 7, torch.float64)
    labels = torch.full((13,), IGNORE)
    loss, dh, dw = _loss_and_grads(linear_cross_entropy, h, w, labels, reduction="sum", chunk_rows=4)
    assert loss.item() == 0.0 and not dh.any() and not dw.any()


def test_gradcheck():
    """float64, 11 rows in chunks of 4 (the last one short), two rows without a target, every
    reduction."""
    h, w = _leaves(11, 6, 9, torch.float64)
    labels = torch.tensor([3, IGNORE, 0, 8, 8, 1, IGNORE, 2, 5, 7, 4])
    for reduction in ("mean", "sum"):
        assert torch.autograd.gradcheck(lambda a, b: linear_cross_entropy(a, b, labels, IGNORE, reduction, 4), (h, w))


def test_bf16_inputs_accumulate_in_float32():
    """bf16 hidden and weight: a float32 loss, gradients in bf16, within bf16's tolerance of the
    unfused loss on the same bf16 logits and of float64; the weight's gradient summed over the
    chunks in float32."""
    h, w = _leaves(300, 64, 500, torch.bfloat16)
    labels = torch.randint(0, 500, (300,), generator=torch.Generator().manual_seed(1))
    labels[::7] = IGNORE
    got = _loss_and_grads(linear_cross_entropy, h, w, labels, chunk_rows=37)
    want = _loss_and_grads(linear_cross_entropy_reference, h, w, labels)
    exact = _loss_and_grads(linear_cross_entropy_reference, h.double(), w.double(), labels)
    assert got[0].dtype == torch.float32 and got[1].dtype == got[2].dtype == torch.bfloat16
    for a, b, c in zip(got, want, exact):
        assert rel_error(a, b) < TOLERANCE[torch.bfloat16] and rel_error(a, c) < TOLERANCE[torch.bfloat16]


def test_largest_allocation_is_one_chunk_of_logits():
    """Forward and backward of 512 rows over a vocabulary of 300 in chunks of 64: no allocation
    exceeds one chunk's float32 logits; the unfused loss allocates all of them at once."""
    from torch.profiler import ProfilerActivity, profile

    h, w = _leaves(512, 8, 300, torch.float32)
    labels = torch.randint(0, 300, (512,))

    def largest(fn, **kwargs):
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fn(h, w, labels, **kwargs).backward()
        return max(e.cpu_memory_usage for e in prof.events())

    assert largest(linear_cross_entropy, chunk_rows=64) <= 64 * 300 * 4
    assert largest(linear_cross_entropy_reference) >= 512 * 300 * 4


def test_no_gradients_computed_without_grad():
    h, w = _leaves(20, 4, 6, torch.float32)
    labels = torch.randint(0, 6, (20,))
    _, d_hidden, d_weight = torch.ops.cp_ops.linear_cross_entropy_forward(h, w, labels, IGNORE, 8, False, False)
    assert d_hidden.numel() == d_weight.numel() == 0
    with torch.no_grad():
        loss, want = linear_cross_entropy(h, w, labels), linear_cross_entropy_reference(h, w, labels)
    assert not loss.requires_grad and rel_error(loss, want) < 1e-6


def test_opcheck():
    h, w = _leaves(10, 3, 5, torch.float32)
    labels = torch.tensor([0, 4, IGNORE, 1, 1, 2, 3, IGNORE, 0, 4])
    for grads in ((True, True), (True, False), (False, False)):
        torch.library.opcheck(torch.ops.cp_ops.linear_cross_entropy_forward.default, (h, w, labels, IGNORE, 4, *grads))
    torch.library.opcheck(torch.ops.cp_ops.linear_cross_entropy.default, (h, w, labels, IGNORE, "sum", 3))


def test_default_chunk_rows():
    assert default_chunk_rows(32000) == 4160 and default_chunk_rows(151936) == 832
    assert default_chunk_rows(2**27) == 1 and default_chunk_rows(2**22) == 32


def test_compiled_fullgraph_two_packings_no_recompile():
    """A loss step (a pointwise op before the head, the sum over the targets divided by a
    count passed in, as under CP) compiled with fullgraph and dynamic shapes: two packings of
    different row counts run one graph, with the eager step's loss and gradients."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    head = torch.nn.Linear(16, 29, bias=False)

    def step(x, labels, count):
        return linear_cross_entropy(torch.tanh(x), head.weight, labels, IGNORE, "sum", 6) / count

    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(step, fullgraph=True, dynamic=True, backend=counter)
    for rows in (40, 53):
        x = torch.randn(rows, 16)
        labels = torch.randint(0, 29, (rows,))
        labels[: rows // 5] = IGNORE
        count = (labels != IGNORE).sum()
        results = []
        for fn in (step, compiled):
            leaf = x.clone().requires_grad_()
            head.zero_grad()
            loss = fn(leaf, labels, count)
            loss.backward()
            results.append((loss.detach(), leaf.grad, head.weight.grad.clone()))
        for got, want in zip(*results):
            assert rel_error(got, want) < 1e-5
    assert counter.frame_count == 1


@pytest.mark.parametrize(
    "shapes, labels, message",
    [
        (((4, 3), (5, 2)), (4,), "hidden must be \\[N, H\\] and weight \\[V, H\\]"),
        (((4, 3, 1), (5, 3)), (4,), "hidden must be \\[N, H\\]"),
        (((4, 3), (5, 3)), (3,), "labels must be int32 or int64 \\[N\\] with N = 4"),
    ],
)
def test_bad_input(shapes, labels, message):
    (hs, ws) = shapes
    with pytest.raises(ValueError, match=message):
        linear_cross_entropy(torch.randn(hs), torch.randn(ws), torch.zeros(labels, dtype=torch.int64))


def test_bad_dtypes_and_settings():
    h, w, labels = torch.randn(4, 3), torch.randn(5, 3), torch.zeros(4, dtype=torch.int64)
    with pytest.raises(TypeError, match="share one floating dtype"):
        linear_cross_entropy(h, w.double(), labels)
    with pytest.raises(ValueError, match="labels must be int32 or int64"):
        linear_cross_entropy(h, w, labels.float())
    with pytest.raises(ValueError, match="reduction must be one of"):
        linear_cross_entropy(h, w, labels, reduction="none")
    with pytest.raises(ValueError, match="chunk_rows must be at least 1"):
        linear_cross_entropy(h, w, labels, chunk_rows=0)
