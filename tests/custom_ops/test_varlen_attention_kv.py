"""varlen_attention_kv: segment attention over one K/V tensor read through a row map, against
varlen_attention on the gathered rows (reference, gradcheck, opcheck, the Triton kernels)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import custom_ops
from custom_ops.segment_attention import launch
from custom_ops.segment_attention.configs import ATTENTION_SETTINGS
from custom_ops.segment_attention.reference import resolve_scale, varlen_attention_reference
from custom_ops.testing import poisoned_allocations
from custom_ops.segment_attention.op import varlen_attention_kv
from custom_ops.thd.index import rank_to_seq_index
from tests._profiles import examples
from tests.custom_ops.test_varlen_attention import (
    WINDOWS,
    _assert_agree,
    _cotangents,
    _loss,
    _score_tolerance,
    _tensors,
    segment_layouts,
)


def _kv_case(layout, heads, d, dtype, seed):
    """q, kv ``[Tk, 2*Hkv, D]``, a random permutation ``rows`` and the segments."""
    q, k, v, seg = _tensors(layout, heads, d, dtype, seed=seed)
    rows = torch.randperm(k.shape[0], generator=torch.Generator().manual_seed(seed))
    kv = torch.empty((k.shape[0], 2 * k.shape[1], d), dtype=dtype)
    kv[rows] = torch.cat([k, v], dim=1)  # so that kv[rows] holds k's and v's rows in order
    return q, kv, rows, seg


def _run_kv(fn, q, kv, rows, seg, causal, window, dout, dlse):
    """out, lse and (dq, dkv) of ``fn(q, kv, rows, *seg)`` for :func:`_loss`'s cotangents."""
    q, kv = (t.detach().clone().requires_grad_() for t in (q, kv))
    out, lse = fn(q, kv, rows, *seg, causal=causal, window=window)
    loss = _loss(out, lse, dout, dlse)
    if not loss.requires_grad:
        return out.detach(), lse.detach(), [torch.zeros_like(q), torch.zeros_like(kv)]
    grads = torch.autograd.grad(loss, (q, kv), allow_unused=True)
    return out.detach(), lse.detach(), [torch.zeros_like(t) if g is None else g for g, t in zip(grads, (q, kv))]


def _gathered(fn):
    """``fn`` (varlen_attention's signature) on ``kv[rows]`` split into K and V: the definition."""

    def run(q, kv, rows, *seg, **kwargs):
        kv_rows = kv[rows]
        hkv = kv.shape[1] // 2
        return fn(q, kv_rows[:, :hkv], kv_rows[:, hkv:], *seg, **kwargs)

    return run


@settings(max_examples=examples(25))
@given(segment_layouts(), st.sampled_from([(1, 1), (2, 1), (4, 2)]), st.booleans(), st.sampled_from(WINDOWS),
       st.integers(0, 2**16))  # fmt: skip
def test_matches_varlen_attention_on_the_gathered_rows(layout, heads, causal, window, seed):
    """float64 (the reference path): out, lse, dq and dkv equal those of varlen_attention on
    ``kv[rows]``, the gradient taken back through the row gather by autograd."""
    q, kv, rows, seg = _kv_case(layout, heads, 8, torch.float64, seed)
    dout, dlse = _cotangents(q, seed)
    got = _run_kv(varlen_attention_kv, q, kv, rows, seg, causal, window, dout, dlse)
    want = _run_kv(_gathered(custom_ops.varlen_attention), q, kv, rows, seg, causal, window, dout, dlse)
    out, lse, (dq, dkv) = got
    out_w, lse_w, (dq_w, dkv_w) = want
    assert torch.allclose(out, out_w, rtol=0, atol=1e-12) and torch.equal(torch.isfinite(lse), torch.isfinite(lse_w))
    finite = torch.isfinite(lse_w)
    assert torch.allclose(lse[finite], lse_w[finite], rtol=0, atol=1e-12)
    assert torch.allclose(dq, dq_w, rtol=0, atol=1e-12)
    assert torch.allclose(dkv, dkv_w, rtol=0, atol=1e-12)


@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (False, (2, 1))])
def test_gradcheck(causal, window):
    layout = ([0, 5], [4, 5], [-1, 2], [0, 0], [6, 6], 11, 7)
    q, kv, rows, seg = _kv_case(layout, (2, 1), 4, torch.float64, 3)
    q.requires_grad_(), kv.requires_grad_()

    def f(q, kv):
        out, lse = varlen_attention_kv(q, kv, rows, *seg, causal=causal, window=window)
        return out, torch.where(torch.isfinite(lse), lse, 0.0)  # -inf rows have no gradient

    assert torch.autograd.gradcheck(f, (q, kv))


def _opcheck_samples():
    layout = ([0, 9, 20], [8, 11, 4], [0, 3, 11], [0, 4, 4], [5, 14, 14], 24, 18)
    q, kv, rows, seg = _kv_case(layout, (4, 2), 8, torch.float32, 0)
    yield (q, kv, rows, *seg), {}
    yield (q.double(), kv.double(), rows, *[s.long() for s in seg]), {"causal": False, "window_left": 2}
    yield (q[:0], kv, rows, *[s[:0] for s in seg]), {}  # Tq = 0, S = 0
    yield (q, kv[:0], rows[:0], *seg), {"scale": 0.5}  # Tk = 0: every row sees nothing
    yield (q.clone().requires_grad_(), kv.clone().requires_grad_(), rows.int(), *seg), {"window_left": 3}


def test_opcheck():
    """The attention ops with the key-row map: the forward (kv in k, v None) returns kv[rows]
    for its backward, whose dk/dv op takes those rows and the map."""
    for (q, kv, rows, *seg), kwargs in _opcheck_samples():
        with_rows = dict(kwargs, key_rows=rows)
        torch.library.opcheck(torch.ops.cp_ops.varlen_attention.default, (q, kv, None, *seg), with_rows)
        q, kv = q.detach(), kv.detach()
        out, lse, kv_rows = torch.ops.cp_ops.varlen_attention(q, kv, None, *seg, **with_rows)
        assert torch.equal(kv_rows, kv[rows])
        dout, dlse = torch.randn_like(out), torch.randn_like(lse)
        torch.library.opcheck(
            torch.ops.cp_ops.varlen_attention_backward_dkdv.default,
            (dout, dlse, q, kv_rows, None, out, lse, *seg),
            with_rows,
        )


def test_bad_input():
    layout = ([0], [4], [0], [0], [4], 4, 4)
    q, kv, rows, seg = _kv_case(layout, (2, 1), 4, torch.float32, 0)
    with pytest.raises(ValueError, match=r"kv must be \[Tk, 2\*Hkv, D\]"):
        varlen_attention_kv(q, kv[:, :1], rows, *seg)
    with pytest.raises(ValueError, match="key_rows has 3 entries but kv has 4 rows"):
        varlen_attention_kv(q, kv, rows[:3], *seg)
    with pytest.raises(TypeError, match="key_rows"):
        varlen_attention_kv(q, kv, rows.float(), *seg)
    with pytest.raises(TypeError, match="window must be a pair"):
        varlen_attention_kv(q, kv, rows, *seg, window=3)
    with pytest.raises(ValueError, match="with key_rows, k holds K's and V's heads .* v must be None"):
        torch.ops.cp_ops.varlen_attention(q, kv, kv, *seg, key_rows=rows)
    with pytest.raises(ValueError, match="v is None: give v, or key_rows"):
        torch.ops.cp_ops.varlen_attention(q, kv, None, *seg)


# --- the Triton kernels (CPU tensors, TRITON_INTERPRET=1) ---------------------------------------


def _kernel_vs_reference(q, kv, rows, seg, causal, window, seed=0):
    dout, dlse = _cotangents(q, seed)
    with poisoned_allocations():
        got = _run_kv(varlen_attention_kv, q, kv, rows, seg, causal, window, dout, dlse)
    want = _run_kv(_gathered(varlen_attention_reference), q.double(), kv.double(), rows, seg, causal, window, dout,
                   dlse)  # fmt: skip
    hkv = kv.shape[1] // 2
    tol = _score_tolerance(q, kv[:, :hkv], None)
    # dkv's K and V halves are checked as varlen_attention's dk and dv are: each against itself
    split = [(o, l, [g[0], g[1][:, :hkv], g[1][:, hkv:]]) for o, l, g in (got, want)]
    _assert_agree(split[0], split[1], tol)
    return got


@pytest.mark.interpret
@settings(max_examples=examples(12))
@given(segment_layouts(max_segs=3, max_q=20, max_k=24), st.sampled_from([(2, 1), (3, 1)]), st.booleans(),
       st.sampled_from(WINDOWS), st.integers(0, 2**16))  # fmt: skip
def test_kernel_matches_reference(layout, heads, causal, window, seed):
    q, kv, rows, seg = _kv_case(layout, heads, 16, torch.float32, seed)
    _kernel_vs_reference(q, kv, rows, seg, causal, window, seed)


@pytest.mark.interpret
@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (False, (9, 12))])
def test_kernel_all_gather_cp_rank_order(causal, window):
    """All-gather CP at W = 2: two sequences' four chunks each as segments over the gathered
    keys in rank order, read through the layout's own row map; the dk/dv kernel's rows through
    the map are bit for bit varlen_attention's dk and dv on the rows in sequence order."""
    cup = torch.tensor([0, 64, 96])
    rows = rank_to_seq_index(cup, 2, 96)
    c0, c1 = 16, 8
    layout = (
        [0, 16, 32, 48, 64, 72, 80, 88], [c0] * 4 + [c1] * 4, [0, 3 * c0, c0, 2 * c0, 0, 3 * c1, c1, 2 * c1],
        [0] * 4 + [64] * 4, [64] * 4 + [32] * 4, 96, 96,
    )  # fmt: skip
    q, k, v, seg = _tensors(layout, (2, 1), 16, torch.float32)
    kv = torch.empty((96, 2, 16))
    kv[rows] = torch.cat([k, v], dim=1)
    dkv = _kernel_vs_reference(q, kv, rows, seg, causal, window)[2][1]
    dout, dlse = _cotangents(q, 0)
    scale = resolve_scale(None, 16)
    out, lse = launch.forward(q, k, v, seg, causal, *window, scale, ATTENTION_SETTINGS)
    dlse = torch.where(torch.isfinite(lse), dlse, 0.0).float()
    dk, dv, _ = launch.backward_dkdv(dout.float(), dlse, q, k, v, out, lse, seg, causal, *window, scale)
    assert torch.equal(dkv[rows], torch.cat([dk, dv], dim=1))


def test_rows_of_a_permutation_cover_every_gradient_row():
    """Every row of dkv is written (the kernel's output is not zero-filled): a row no segment
    reads gets zeros, not what the allocation held."""
    layout = ([0], [3], [0], [2], [3], 3, 9)
    q, kv, rows, seg = _kv_case(layout, (1, 1), 4, torch.float32, 1)
    with poisoned_allocations():
        _, _, (_, dkv) = _run_kv(varlen_attention_kv, q, kv, rows, seg, True, (-1, -1), *_cotangents(q, 1))
    read = rows[2:5]
    untouched = torch.ones(9, dtype=torch.bool)
    untouched[read] = False
    assert torch.isfinite(dkv).all() and (dkv[untouched] == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("d,heads", [(128, (8, 8)), (256, (16, 2))])
def test_gpu_kernels_are_varlen_attention_on_the_gathered_rows(d, heads):
    """bf16 on the GPU (TMA loads, dk and dv in two programs at D = 256): out, lse and dq
    equal varlen_attention's on ``kv[rows]``, and dkv through the row map is its dk and dv
    bit for bit (the same kernels, sums in the same order; only the stores' rows differ)."""
    cup = torch.tensor([0, 1024, 1536, 2048])
    rows = rank_to_seq_index(cup, 4, 2048).cuda()
    lens = [1000, 300, 512]
    layout = ([0, 1024, 1536], lens, [0] * 3, [0, 1024, 1536], lens, 2048, 2048)
    q, k, v, seg = _tensors(layout, heads, d, torch.bfloat16, seed=4)
    q, k, v, seg = q.cuda(), k.cuda(), v.cuda(), [t.cuda() for t in seg]
    kv = torch.empty((2048, 2 * heads[1], d), dtype=q.dtype, device="cuda")
    kv[rows] = torch.cat([k, v], dim=1)
    dout = torch.randn_like(q)
    qa, kva = q.clone().requires_grad_(), kv.clone().requires_grad_()
    out, lse = varlen_attention_kv(qa, kva, rows, *seg)
    out.backward(dout)
    qb, kb, vb = (t.clone().requires_grad_() for t in (q, k, v))
    out_b, lse_b = custom_ops.varlen_attention(qb, kb, vb, *seg)
    out_b.backward(dout)
    assert torch.equal(out, out_b) and torch.equal(lse, lse_b) and torch.equal(qa.grad, qb.grad)
    assert torch.equal(kva.grad[rows], torch.cat([kb.grad, vb.grad], dim=1))
