"""varlen_attention: loop definition, opcheck, gradients, compile, Triton kernels, bad input.

Tolerances: results are compared by rel_error against float64 computations; the
bound is TOLERANCE of the dtype the op computes in (fp32 accumulation for fp32
inputs; float64 paths agree to rounding).
"""

import dataclasses
import inspect

import pytest
import torch
import torch.nn.functional as F
import triton
from hypothesis import example, given, settings
from hypothesis import strategies as st

import custom_ops
from custom_ops.segment_attention import configs, launch
from custom_ops.segment_attention.configs import ATTENTION_SETTINGS
from custom_ops.testing import TOLERANCE, kernel_constexprs, poisoned_allocations, random_tensor, rel_error
from custom_ops.thd.validation import Segments
from custom_ops.thd.validation import validate_varlen_segments
from custom_ops.segment_attention.kernels.backward import (
    varlen_attn_bwd_dkdv_kernel,
    varlen_attn_bwd_dq_kernel,
)
from custom_ops.segment_attention.kernels.forward import varlen_attn_fwd_kernel
from custom_ops.segment_attention.kernels.schedule import key_tile_segments_kernel, segment_tables_kernel
from custom_ops.segment_attention.reference import (
    _expand_kv,
    _group_sum,
    _scores,
    resolve_scale,
    varlen_attention_loop,
    varlen_attention_reference,
    visibility_mask,
)
from tests._profiles import examples, fast_tier_takes

WINDOWS = [(-1, -1), (3, -1), (2, 1), (0, 0), (-1, 2), (5, 5)]
# causal without a window, and a two-sided window without causality
CAUSAL_AND_WINDOW = [(True, (-1, -1)), (False, (7, 3))]
HEADS = [(1, 1), (2, 1), (4, 2), (3, 3), (6, 2)]


@st.composite
def segment_layouts(draw, max_segs=4, max_q=12, max_k=14):
    """(q_start, q_len, q_pos, k_start, k_len, Tq, Tk) as lists: gaps (rows in no segment),
    empty segments, q_pos = 0 / bottom-right / arbitrary, key ranges shared with the previous
    segment (two query segments over one key range, as all-gather CP runs them)."""
    n = draw(st.integers(0, max_segs))
    qs, ql, qp, ks, kl = [], [], [], [], []
    row, key = draw(st.sampled_from([0, 0, 2])), 0
    for _ in range(n):
        q_len = draw(st.one_of(st.just(0), st.just(1), st.integers(0, max_q)))
        if kl and draw(st.booleans()):
            k_start, k_len = ks[-1], kl[-1]
        else:
            key += draw(st.sampled_from([0, 0, 1, 3]))
            k_start, k_len = key, draw(st.one_of(st.just(0), st.just(1), st.integers(0, max_k)))
            key += k_len
        mode = draw(st.sampled_from(["zero", "bottom_right", "offset"]))
        q_pos = {"zero": 0, "bottom_right": k_len - q_len}.get(mode) if mode != "offset" else None
        if q_pos is None:
            q_pos = draw(st.integers(-3, max_k + 3))
        qs.append(row), ql.append(q_len), qp.append(q_pos), ks.append(k_start), kl.append(k_len)
        row += q_len + draw(st.sampled_from([0, 0, 1, 2]))
    return qs, ql, qp, ks, kl, row + draw(st.sampled_from([0, 1])), key + draw(st.sampled_from([0, 2]))


def _tensors(layout, heads, d, dtype, index_dtype=torch.int32, seed=0):
    qs, ql, qp, ks, kl, tq, tk = layout
    hq, hkv = heads
    gen = torch.Generator().manual_seed(seed)
    q = random_tensor((tq, hq, d), dtype, generator=gen)
    k = random_tensor((tk, hkv, d), dtype, generator=gen)
    v = random_tensor((tk, hkv, d), dtype, generator=gen)
    seg = [torch.tensor(x, dtype=index_dtype) for x in (qs, ql, qp, ks, kl)]
    return q, k, v, seg


def _cotangents(q, seed):
    """Random cotangents for out ``[Tq, Hq, D]`` and lse ``[Hq, Tq]`` (lse is differentiable)."""
    gen = torch.Generator().manual_seed(seed)
    dout = torch.randn(q.shape, generator=gen, dtype=torch.float64)
    dlse = torch.randn((q.shape[1], q.shape[0]), generator=gen, dtype=torch.float64)
    return dout, dlse


def _loss(out, lse, dout, dlse):
    finite = torch.isfinite(lse.detach())
    return (out.double() * dout).sum() + (lse.double()[finite] * dlse[finite]).sum()


def _run(fn, q, k, v, seg, causal, window, dout, dlse, scale=None):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = fn(q, k, v, *seg, causal=causal, window=window, scale=scale)
    loss = _loss(out, lse, dout, dlse)
    if not loss.requires_grad:  # the loop oracle with no visible key anywhere builds no graph
        return out.detach(), lse.detach(), [torch.zeros_like(t) for t in (q, k, v)]
    grads = torch.autograd.grad(loss, (q, k, v), allow_unused=True)
    grads = [torch.zeros_like(t) if g is None else g for g, t in zip(grads, (q, k, v))]
    return out.detach(), lse.detach(), grads


def _assert_agree(got, want, tol, sizes=None):
    """``got`` against ``want`` to ``tol``; each gradient relative to itself or, where ``sizes``
    (:func:`_gradient_sizes`) is given, to its entry there."""
    out, lse, grads = got
    out_w, lse_w, grads_w = want
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    finite = torch.isfinite(lse_w)
    assert torch.equal(torch.isfinite(lse), finite), "rows with no visible key must have lse = -inf"
    assert (lse[~finite] == float("-inf")).all()
    assert rel_error(out, out_w) <= tol
    assert rel_error(lse[finite], lse_w[finite]) <= tol
    for name, g, gw, size in zip("qkv", grads, grads_w, sizes or grads_w):
        err = rel_error(g, gw)
        if sizes is not None:  # or within tol of the terms it sums, where they cancel
            err = min(err, float((g.double() - gw.double()).norm()) / max(float(size.norm()), 1e-300))
        assert err <= tol, f"d{name}: {err}"


def _gradient_sizes(q, k, v, seg, causal, window, dout, dlse):
    """``(dq, dk, dv)`` of the closed form with every term taken positive, in float64: the size
    rounding scales with. ``dS = P (dP - delta)`` cancels where a row's ``dP`` and ``delta`` agree
    (a row with one visible key: ``dS = P dlse`` exactly), so a float32 gradient keeps its digits
    relative to these terms, not to its own, possibly much smaller, size."""
    q, k, v = (t.double() for t in (q, k, v))
    hq, hkv = q.shape[1], k.shape[1]
    out, lse = varlen_attention_reference(q, k, v, *seg, causal=causal, window=window)
    scale = resolve_scale(None, q.shape[-1])
    visible = visibility_mask(Segments(*seg), q.shape[0], k.shape[0], causal, *window)
    lse_safe = torch.where(torch.isfinite(lse), lse, 0.0)
    p = torch.exp(torch.where(visible[None], _scores(q, k, scale), float("-inf")) - lse_safe[..., None])
    do = dout.abs().permute(1, 0, 2)
    terms = (dout.abs() * out.abs()).sum(-1).transpose(0, 1) + torch.where(torch.isfinite(lse), dlse.abs(), 0.0)
    ds = p * (do @ _expand_kv(v.abs(), hq).transpose(1, 2) + terms[..., None])
    dq = (ds @ _expand_kv(k.abs(), hq)).permute(1, 0, 2) * scale
    dk = _group_sum(ds.transpose(1, 2) @ q.abs().permute(1, 0, 2), hkv) * scale
    return dq, dk, _group_sum(p.transpose(1, 2) @ do, hkv)


# --- agreement with the definition -------------------------------------------------------------


@given(
    segment_layouts(),
    st.sampled_from(HEADS),
    st.booleans(),
    st.sampled_from(WINDOWS),
    st.sampled_from([torch.int32, torch.int64]),
    st.integers(0, 2**16),
)
# one key seen by one query row: dS = P dlse exactly, which float32 gets by cancellation
@example(([0], [1], [0], [0], [1], 3, 1), (1, 1), False, (-1, -1), torch.int32, 893)
def test_matches_loop_definition(layout, heads, causal, window, index_dtype, seed):
    """Forward and gradients (through out and lse) of the reference (torch autograd) and of
    the op (its closed-form backward), in float64 and float32, against the loop oracle."""
    q, k, v, seg = _tensors(layout, heads, 8, torch.float64, index_dtype, seed)
    dout, dlse = _cotangents(q, seed + 1)
    want = _run(varlen_attention_loop, q, k, v, seg, causal, window, dout, dlse)
    _assert_agree(_run(varlen_attention_reference, q, k, v, seg, causal, window, dout, dlse), want, TOLERANCE[torch.float64])
    sizes = _gradient_sizes(q, k, v, seg, causal, window, dout, dlse)
    for dtype in (torch.float64, torch.float32):
        got = _run(custom_ops.varlen_attention, q.to(dtype), k.to(dtype), v.to(dtype), seg, causal, window, dout, dlse)
        assert got[0].dtype == dtype
        _assert_agree(got, want, TOLERANCE[dtype], sizes)


def test_torch_ops_namespace_is_the_same_op():
    q, k, v, seg = _tensors(([0, 7], [5, 9], [0, 2], [0, 4], [6, 11], 16, 15), (4, 2), 8, torch.float32)
    a = torch.ops.cp_ops.varlen_attention(q, k, v, *seg, False, 3, 1, 0.3)
    b = custom_ops.varlen_attention(q, k, v, *seg, causal=False, window=(3, 1), scale=0.3)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert inspect.signature(custom_ops.varlen_attention) == inspect.signature(varlen_attention_reference)
    schema = torch.ops.cp_ops.varlen_attention.default._schema
    assert [a.name for a in schema.arguments][-5:] == ["causal", "window_left", "window_right", "scale", "key_rows"]
    assert a[2].numel() == 0  # kv_rows: empty without a key-row map


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)])
def test_dense_segments_match_sdpa(causal, heads):
    """Two packed documents with q_pos = 0 are SDPA over each (top-left alignment), GQA included."""
    lens = [13, 22]
    q, k, v, seg = _tensors(([0, 13], lens, [0, 0], [0, 13], lens, 35, 35), heads, 16, torch.float64)
    out, lse = custom_ops.varlen_attention(q, k, v, *seg, causal=causal, scale=0.2)
    group = heads[0] // heads[1]
    for s, n in zip((0, 13), lens):
        qd, kd, vd = (t[s : s + n].transpose(0, 1) for t in (q, k, v))
        ref = F.scaled_dot_product_attention(qd, kd, vd, is_causal=causal, scale=0.2, enable_gqa=group > 1)
        assert rel_error(out[s : s + n], ref.transpose(0, 1)) <= TOLERANCE[torch.float64]
        scores = (qd @ kd.repeat_interleave(group, 0).transpose(1, 2)) * 0.2
        if causal:
            scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        assert rel_error(lse[:, s : s + n], torch.logsumexp(scores, -1)) <= TOLERANCE[torch.float64]


def test_all_gather_cp_chunks_match_full_causal_attention():
    """Rank 0 of W = 2 holds chunks 0 and 3 of a 32-row sequence: two query segments (q_pos 0
    and 24) over the one gathered key range give the full causal attention's rows, and their
    dk, dv are the full attention's gradients when only those rows carry a cotangent."""
    n, c = 32, 8
    q_full, k, v, _ = _tensors(([], [], [], [], [], n, n), (2, 2), 8, torch.float64)
    rows = torch.cat([torch.arange(0, c), torch.arange(3 * c, 4 * c)])
    seg = [torch.tensor(x) for x in ([0, c], [c, c], [0, 3 * c], [0, 0], [n, n])]
    dout = torch.randn(2 * c, 2, 8, dtype=torch.float64)
    got = _run(custom_ops.varlen_attention, q_full[rows], k, v, seg, True, (-1, -1), dout, torch.zeros(2, 2 * c))

    qf, kf, vf = (t.detach().clone().requires_grad_() for t in (q_full, k, v))
    full = F.scaled_dot_product_attention(qf.transpose(0, 1), kf.transpose(0, 1), vf.transpose(0, 1), is_causal=True)
    full = full.transpose(0, 1)
    dq, dk, dv = torch.autograd.grad((full[rows] * dout).sum(), (qf, kf, vf))
    tol = TOLERANCE[torch.float64]
    assert rel_error(got[0], full[rows].detach()) <= tol
    assert rel_error(got[2][0], dq[rows]) <= tol
    assert rel_error(got[2][1], dk) <= tol and rel_error(got[2][2], dv) <= tol


def test_bottom_right_alignment_is_the_tail_of_full_attention():
    """q_pos = k_len - q_len: the last q_len rows of causal self-attention over k_len rows."""
    n, m = 23, 9
    q_full, k, v, _ = _tensors(([], [], [], [], [], n, n), (2, 1), 8, torch.float64)
    seg = [torch.tensor([x]) for x in (0, m, n - m, 0, n)]
    out, _ = custom_ops.varlen_attention(q_full[n - m :], k, v, *seg, causal=True, window=(4, -1))
    full, _ = varlen_attention_loop(q_full, k, v, *[torch.tensor([x]) for x in (0, n, 0, 0, n)], window=(4, -1))
    assert rel_error(out, full[n - m :]) <= TOLERANCE[torch.float64]


def _empty_rows_case(dtype):
    # segment 0: causal with q_pos = -2 -> its first two rows see no key; rows 6, 7 in no segment;
    # segment 1 has k_len = 0; segment 2 has q_len = 0; segment 3 window (0, 0) with q_pos past its keys
    layout = ([0, 8, 11, 11], [6, 3, 0, 5], [-2, 0, 0, 4], [0, 6, 6, 6], [6, 0, 5, 3], 18, 9)
    return _tensors(layout, (2, 1), 16, dtype)


def _check_empty_rows(out, lse, grads):
    no_key = torch.tensor([0, 1, 6, 7, 8, 9, 10, 16, 17])
    assert (out[no_key] == 0).all() and (lse[:, no_key] == float("-inf")).all()
    assert (grads[0][no_key] == 0).all()
    assert all(torch.isfinite(g).all() for g in grads)
    assert (out[2:6].abs() > 0).any() and torch.isfinite(lse[:, 2:6]).all()


def test_rows_without_keys_are_zero_and_never_nan():
    q, k, v, seg = _empty_rows_case(torch.float32)
    dout, dlse = _cotangents(q, 3)
    got = _run(custom_ops.varlen_attention, q, k, v, seg, True, (-1, -1), dout, dlse)
    _check_empty_rows(*got)
    _assert_agree(got, _run(varlen_attention_loop, q, k, v, seg, True, (-1, -1), dout, dlse), TOLERANCE[torch.float32])


# --- opcheck ----------------------------------------------------------------------------------


def _opcheck_samples():
    layout = ([0, 9, 20], [8, 11, 4], [0, 3, 11], [0, 4, 4], [5, 14, 14], 24, 18)
    q, k, v, seg = _tensors(layout, (4, 2), 8, torch.float32)
    yield (q, k, v, *seg), {}
    yield (q.double(), k.double(), v.double(), *[s.long() for s in seg]), {"causal": False, "window_left": 2, "window_right": 1}
    yield (q[:0], k, v, *[s[:0] for s in seg]), {}  # Tq = 0, S = 0
    yield (q, k[:0], v[:0], *seg), {"scale": 0.5}  # Tk = 0: every row sees nothing
    big = random_tensor((24, 8, 8), torch.float32)
    yield (big[:, ::2], k.transpose(0, 1).contiguous().transpose(0, 1), v, *seg), {"window_left": 0}  # strided
    yield (q.clone().requires_grad_(), k.clone().requires_grad_(), v.clone().requires_grad_(), *seg), {"window_left": 3}


def test_opcheck():
    for args, kwargs in _opcheck_samples():
        torch.library.opcheck(torch.ops.cp_ops.varlen_attention.default, args, kwargs)


def test_opcheck_backward():
    for args, kwargs in _opcheck_samples():
        q, k, v, *seg = (a.detach() if a.is_floating_point() else a for a in args)
        out, lse, _ = torch.ops.cp_ops.varlen_attention(q, k, v, *seg, **kwargs)
        dout, dlse = torch.randn_like(out), torch.randn_like(lse)
        torch.library.opcheck(
            torch.ops.cp_ops.varlen_attention_backward_dkdv.default, (dout, dlse, q, k, v, out, lse, *seg), kwargs
        )
        delta = torch.ops.cp_ops.varlen_attention_backward_dkdv(dout, dlse, q, k, v, out, lse, *seg, **kwargs)[2]
        torch.library.opcheck(
            torch.ops.cp_ops.varlen_attention_backward_dq.default, (dout, q, k, v, lse, delta, *seg), kwargs
        )


# --- gradients --------------------------------------------------------------------------------


@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (False, (2, 1)), (True, (0, 0))])
def test_gradcheck(causal, window):
    # two query segments sharing keys, a row in no segment, a row with no visible key (q_pos = -1)
    layout = ([0, 5], [4, 5], [-1, 2], [0, 0], [6, 6], 11, 7)
    q, k, v, seg = _tensors(layout, (2, 1), 4, torch.float64)
    for t in (q, k, v):
        t.requires_grad_()

    for fn in (custom_ops.varlen_attention, varlen_attention_reference):

        def f(q, k, v, fn=fn):
            out, lse = fn(q, k, v, *seg, causal=causal, window=window)
            return out, torch.where(torch.isfinite(lse), lse, 0.0)  # -inf rows have no gradient

        assert torch.autograd.gradcheck(f, (q, k, v))


# --- compile ----------------------------------------------------------------------------------


def test_compiled_fullgraph_dynamic_no_recompile():
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")

    def step(q, k, v, q_start, q_len, q_pos, k_start, k_len):
        out, lse, _ = torch.ops.cp_ops.varlen_attention(q * 2, k, v, q_start, q_len, q_pos, k_start, k_len, True, 6, -1)
        return out.sin(), lse

    compiled = torch.compile(step, backend=counter, fullgraph=True, dynamic=True)
    # S, Tq, Tk differ from each other and from the head counts / head_dim (duck sizing),
    # and none is 0 or 1 (specialised)
    layouts = [
        ([0, 12, 20], [10, 8, 9], [0, 3, 0], [0, 12, 12], [11, 15, 15], 29, 37),
        ([0, 5, 11, 30, 41], [5, 6, 19, 11, 9], [0, 0, 2, 0, 5], [0, 5, 11, 33, 33], [5, 6, 22, 14, 14], 50, 47),
        ([3, 20, 27], [17, 7, 14], [0, 0, 9], [0, 17, 17], [17, 20, 20], 43, 39),
    ]
    for i, layout in enumerate(layouts):
        q, k, v, seg = _tensors(layout, (4, 2), 16, torch.float32, seed=i)
        dout, dlse = _cotangents(q, i)

        def run(fn):
            qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
            out, lse = fn(qq, kk, vv, *seg)
            grads = torch.autograd.grad(_loss(out, lse, dout, dlse), (qq, kk, vv))
            return out.detach(), lse.detach(), grads

        _assert_agree(run(compiled), run(step), TOLERANCE[torch.float32])
    assert counter.frame_count == 1


# --- the Triton kernels (CPU tensors, TRITON_INTERPRET=1) ---------------------------------------


def _score_tolerance(q, k, scale):
    """The float32 bound for inputs whose scores reach ``|s|``: a float32 score carries an error
    of about ``|s| * eps``, which becomes the same relative error in its softmax weight, so the
    bound grows with the largest score (``TOLERANCE`` holds for scores of order 1)."""
    if q.shape[0] == 0 or k.shape[0] == 0:
        return TOLERANCE[torch.float32]
    bound = abs(scale if scale is not None else q.shape[-1] ** -0.5)
    largest = bound * (q.abs().amax(dim=(0, 1)) @ k.abs().amax(dim=(0, 1))).item()
    return max(TOLERANCE[torch.float32], torch.finfo(torch.float32).eps * largest)


def _run_launchers(q, k, v, seg, causal, window, dout, dlse, settings, scale=None):
    """What :func:`_run` gives for the kernels, by the launchers under ``settings``: the forward,
    then the backward with the cotangents autograd passes it for :func:`_loss`."""
    scale = resolve_scale(scale, q.shape[2])
    left, right = window
    out, lse = launch.forward(q, k, v, seg, causal, left, right, scale, settings=settings)
    dlse = torch.where(torch.isfinite(lse), dlse, 0.0).to(lse.dtype)
    grads = launch.backward(dout.to(out.dtype), dlse, q, k, v, out, lse, seg, causal, left, right, scale, settings)
    return out, lse, list(grads)


def _kernel_vs_reference(q, k, v, seg, causal, window, seed=0, scale=None, settings=None):
    """The kernels against the float64 reference: through the op (its default settings), or
    with ``settings`` through the launchers."""
    dout, dlse = _cotangents(q, seed)
    with poisoned_allocations():
        if settings is None:
            got = _run(custom_ops.varlen_attention, q, k, v, seg, causal, window, dout, dlse, scale)
        else:
            got = _run_launchers(q, k, v, seg, causal, window, dout, dlse, settings, scale)
    want = _run(
        varlen_attention_reference, q.double(), k.double(), v.double(), seg, causal, window, dout, dlse, scale
    )
    _assert_agree(got, want, _score_tolerance(q, k, scale))
    return got


@pytest.mark.interpret
@settings(max_examples=examples(15))
@given(
    segment_layouts(max_segs=3, max_q=20, max_k=24),
    st.sampled_from([(2, 1), (2, 2), (3, 1)]),
    st.booleans(),
    st.sampled_from(WINDOWS),
    st.integers(0, 2**16),
)
def test_kernel_matches_reference(layout, heads, causal, window, seed):
    q, k, v, seg = _tensors(layout, heads, 16, torch.float32, seed=seed)
    _kernel_vs_reference(q, k, v, seg, causal, window, seed)


@pytest.mark.interpret
@pytest.mark.parametrize("scale", fast_tier_takes([-0.7, 0.0, 1.3], -0.7))
def test_kernel_any_scale(scale):
    """The scale is any float: negative flips which key dominates, zero gives the mean of
    the visible values. Masked and unmasked tiles, causal and a two-sided window."""
    layout = ([0, 20], [20, 17], [0, 5], [0, 0], [24, 24], 37, 24)
    q, k, v, seg = _tensors(layout, (2, 1), 16, torch.float32, seed=3)
    for causal, window in ((True, (-1, -1)), (False, (6, 3))):
        _kernel_vs_reference(q, k, v, seg, causal, window, scale=scale)


@pytest.mark.interpret
@pytest.mark.parametrize("growth", [pytest.param(0.5, marks=pytest.mark.slow), 40.0])  # 40: every tile rescales
def test_kernel_forward_running_max_grows(growth):
    """The forward's running max grows from one key tile to the next by ``growth`` per key
    row (scores up to ~1000 in the last tile at 40, so a missed or stale rescale of the
    accumulator overflows exp2), in the masked and the unmasked loops; a positive and a
    negative scale (the negative one makes the first keys dominate). Scores that large carry
    float32 rounding of ~1e-4 relative each, so the bound follows them (``_score_tolerance``)."""
    layout = ([0, 48], [48, 30], [0, 20], [0, 0], [64, 64], 78, 64)
    q, k, v, seg = _tensors(layout, (2, 1), 16, torch.float32, seed=5)
    q = q.abs()  # every score grows with its key's factor
    k = k.abs() * (1 + growth * torch.arange(64, dtype=torch.float32) / 16)[:, None, None]
    for scale in (0.25, -0.25):
        for causal, window in ((True, (-1, -1)), (False, (20, 5))):
            _kernel_vs_reference(q, k, v, seg, causal, window, scale=scale)


@pytest.mark.interpret
@pytest.mark.parametrize(
    "causal,window",
    fast_tier_takes(
        [(True, (-1, -1)), (False, (-1, -1)), (True, (20, -1)), (False, (9, 12))], (True, (-1, -1)), (False, (9, 12))
    ),
)
def test_kernel_all_gather_cp_layout(causal, window):
    """Long segments (unmasked key/query tiles between the boundary tiles), all four chunks of
    a W = 2 split as segments over one shared key range (more dk/dv work items than programs)."""
    n, c = 64, 16
    layout = ([0, 16, 32, 48], [c] * 4, [0, 3 * c, c, 2 * c], [0] * 4, [n] * 4, n, n)
    q, k, v, seg = _tensors(layout, (2, 1), 16, torch.float32)
    _kernel_vs_reference(q, k, v, seg, causal, window)


@pytest.mark.interpret
@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (False, (5, 3))])
def test_kernel_reads_strided_rows_and_heads_in_place(causal, window, monkeypatch):
    """q every other head of a wider tensor, k and v head slices of one [T, 2*Hkv, D] tensor
    (as in all-gather CP): the kernels read them with their strides, without copying them, and
    agree with the reference, values and gradients."""
    layout = ([0, 20], [20, 17], [0, 5], [0, 0], [24, 24], 37, 24)
    gen = torch.Generator().manual_seed(4)
    wide_q = random_tensor((37, 4, 16), torch.float32, generator=gen)
    kv = random_tensor((24, 2, 16), torch.float32, generator=gen)
    seg = [torch.tensor(x, dtype=torch.int32) for x in layout[:5]]
    dout, dlse = _cotangents(wide_q[:, ::2], 4)

    def run(fn, wq, wkv):
        wq, wkv = wq.detach().clone().requires_grad_(), wkv.detach().clone().requires_grad_()
        out, lse = fn(wq[:, ::2], wkv[:, :1], wkv[:, 1:], *seg, causal=causal, window=window)
        grads = torch.autograd.grad(_loss(out, lse, dout, dlse), (wq, wkv))
        return out.detach(), lse.detach(), list(grads)

    copied = []
    contiguous = torch.Tensor.contiguous

    def spy(self, *args, **kwargs):
        if self.dim() == 3 and not self.is_contiguous():
            copied.append(tuple(self.shape))
        return contiguous(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "contiguous", spy)
    got = run(custom_ops.varlen_attention, wide_q, kv)
    monkeypatch.undo()
    assert not copied, copied
    want = run(varlen_attention_reference, wide_q.double(), kv.double())
    _assert_agree(got, want, TOLERANCE[torch.float32])


def _tile_boundary_layout():
    """Sixteen segments over one shared 96-row key range, q_pos = 16..31, q_len = 33..48 in
    scrambled order: every residue modulo the 16-row interpreter tiles."""
    n_seg = 16
    lens = [33 + (7 * s) % 16 for s in range(n_seg)]
    starts = [sum(lens[:s]) for s in range(n_seg)]
    return (starts, lens, [16 + s for s in range(n_seg)], [0] * n_seg, [96] * n_seg, sum(lens), 96)


@pytest.mark.interpret
@pytest.mark.parametrize(
    "causal,window,k_rows",
    # (21, 25): left + right = 14 mod 16 puts the unmasked range's end on a tile edge
    fast_tier_takes(
        [(*cw, k) for cw in ((True, (-1, -1)), (True, (29, -1)), (False, (19, 22)), (False, (21, 25)))
         for k in (True, False)],
        (True, (-1, -1), True),
        (False, (21, 25), False),
    ),
)
def test_kernel_tile_boundaries_at_every_offset(causal, window, k_rows):
    """Both ways of loading K tiles in the forward (K_ROWS), and sixteen segments over one shared 96-row key range with q_pos = 16..31 and q_len = 33..48
    in scrambled order: every residue of the query positions and of the last tile's row count
    modulo the 16-row tiles, and windows wider than two tiles. An off-by-one in any loop-phase
    bound (a boundary tile run without its mask, or a visible tile skipped) changes a result."""
    q, k, v, seg = _tensors(_tile_boundary_layout(), (1, 1), 16, torch.float32)
    settings = ATTENTION_SETTINGS.with_kernel("fwd", config=dict(configs.INTERPRET_CONFIGS["fwd"], K_ROWS=k_rows))
    _kernel_vs_reference(q, k, v, seg, causal, window, settings=settings)


@pytest.mark.interpret
def test_kernel_causal_tiles_moved_onto_the_key_grid_or_not():
    """32-row query tiles (forward and dq) over 16-row key tiles, causal: a segment's tiles end
    on the key-tile grid where its partial tile has the rows to spare, else at its end
    (``_tiles_end``). Thirty-two segments over one 96-row key range, q_len = 17..48 and
    q_pos = 0..31 in scrambled order: both cases at every residue of the length and position."""
    n_seg = 32
    lens = [17 + (11 * s) % n_seg for s in range(n_seg)]
    starts = [sum(lens[:s]) for s in range(n_seg)]
    layout = (starts, lens, [(5 * s) % n_seg for s in range(n_seg)], [0] * n_seg, [96] * n_seg, sum(lens), 96)
    q, k, v, seg = _tensors(layout, (2, 1), 16, torch.float32)
    tiles = dict(BLOCK_M=32, BLOCK_N=16, num_warps=1, num_stages=1)
    settings = ATTENTION_SETTINGS.with_kernel("fwd", config=tiles).with_kernel("bwd_dq", config=tiles)
    _kernel_vs_reference(q, k, v, seg, True, (-1, -1), settings=settings)


@pytest.mark.interpret
def test_kernel_padded_head_dim_and_other_tiles():
    """head_dim 24 (a padded 32-wide tile), GQA group 3, and asymmetric tile sizes."""
    settings = ATTENTION_SETTINGS
    for name in ("fwd", "bwd_dq"):
        settings = settings.with_kernel(name, config=dict(BLOCK_M=32, BLOCK_N=16, num_warps=1, num_stages=1))
    settings = settings.with_kernel("bwd_dkdv", config=dict(BLOCK_M=16, BLOCK_N=32, num_warps=1, num_stages=1))
    layout = ([0, 37], [35, 12], [4, 0], [0, 41], [41, 12], 50, 53)
    q, k, v, seg = _tensors(layout, (3, 1), 24, torch.float32)
    _kernel_vs_reference(q, k, v, seg, True, (17, 2), settings=settings)


@pytest.mark.interpret
@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), pytest.param(False, (7, 3), marks=pytest.mark.slow)])
def test_kernel_launch_order_changes_no_bit(causal, window):
    """The launch order (segments heaviest first or last to first, ``by_work``; heads grouped by
    ``head_group``) changes which program computes a tile, never how: the results are identical
    bit for bit, and every tile is taken once (a tile skipped or done twice would show
    against the reference). Segments with 0-50 queries over a grid padded past the last
    tile; 4 query heads over 2 kv heads, run in groups of one and of both kv heads (an entry
    of 3 takes the largest count dividing it and 2: one)."""
    layout = ([0, 50, 50, 51], [50, 0, 1, 33], [0, 3, 0, 10], [0, 50, 50, 60], [50, 10, 1, 40], 84, 100)
    q, k, v, seg = _tensors(layout, (4, 2), 16, torch.float32)
    got = _kernel_vs_reference(q, k, v, seg, causal, window)
    dout, dlse = _cotangents(q, 0)
    orders = [("by_work", False)] + [("head_group", g) for g in (1, 2, 3)]
    for key, value in orders:
        settings = ATTENTION_SETTINGS.with_every_kernel(**{key: value})
        out, lse, grads = _run_launchers(q, k, v, seg, causal, window, dout, dlse, settings)
        for a, b in zip([*got[:2], *got[2]], [out, lse, *grads]):
            assert torch.equal(a, b), (key, value)


@pytest.mark.interpret
@pytest.mark.parametrize("causal", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_kernel_window_terms_change_no_bit(causal):
    """Launches without a window compile the window's mask terms out (WINDOW off); with them
    compiled in (``window_terms_always``), every term is true there: the results are the same
    bits."""
    layout = ([0, 50, 50, 51], [50, 0, 1, 33], [0, 3, 0, 10], [0, 50, 50, 60], [50, 10, 1, 40], 84, 100)
    q, k, v, seg = _tensors(layout, (2, 1), 16, torch.float32)
    got = _kernel_vs_reference(q, k, v, seg, causal, (-1, -1))
    dout, dlse = _cotangents(q, 0)
    settings = dataclasses.replace(ATTENTION_SETTINGS, window_terms_always=True)
    out, lse, grads = _run_launchers(q, k, v, seg, causal, (-1, -1), dout, dlse, settings)
    for a, b in zip([*got[:2], *got[2]], [out, lse, *grads]):
        assert torch.equal(a, b)


@pytest.mark.interpret
@pytest.mark.parametrize(
    "head_dim,causal,window",
    fast_tier_takes(
        [(d, *cw) for d in (16, 24) for cw in CAUSAL_AND_WINDOW], (16, True, (-1, -1)), (24, False, (7, 3))
    ),
)
def test_kernel_dkdv_in_two_programs(head_dim, causal, window):
    """dk/dv with two programs per key tile and kv head (PARTS = 2: one writes dv, the other
    dk), head_dim 24 padded to a 32-wide tile included: against the float64 reference, and
    bit for bit against one program per tile (each entry is the same sum in the same order),
    on segments of 0-50 queries over crossing key ranges, GQA group 2."""
    layout = ([0, 50, 50, 51], [50, 0, 1, 33], [0, 3, 0, 10], [0, 50, 50, 60], [50, 10, 1, 40], 84, 100)
    q, k, v, seg = _tensors(layout, (2, 1), head_dim, torch.float32)
    whole = _kernel_vs_reference(q, k, v, seg, causal, window)
    split = ATTENTION_SETTINGS.with_kernel("bwd_dkdv", config=dict(configs.INTERPRET_CONFIGS["bwd_dkdv"], PARTS=2))
    got = _kernel_vs_reference(q, k, v, seg, causal, window, settings=split)
    for a, b in zip(whole[2][1:], got[2][1:]):  # dk, dv
        assert torch.equal(a, b)


@st.composite
def crossing_key_ranges(draw, max_segs=5, max_rows=40):
    """Segments whose key ranges start anywhere, in any order: nested, partly overlapping,
    identical and disjoint ranges, empty ones, and key rows no segment reads."""
    tk = draw(st.integers(1, max_rows))
    n = draw(st.integers(1, max_segs))
    qs, ql, qp, ks, kl, row = [], [], [], [], [], 0
    for _ in range(n):
        k_start = draw(st.integers(0, tk - 1))
        k_len = draw(st.integers(0, tk - k_start))
        q_len = draw(st.integers(0, 20))
        qs.append(row), ql.append(q_len), ks.append(k_start), kl.append(k_len)
        qp.append(draw(st.integers(-2, k_len + 2)))
        row += q_len
    return qs, ql, qp, ks, kl, row, tk


@pytest.mark.interpret
@settings(max_examples=examples(12))
@given(crossing_key_ranges(), st.sampled_from([(2, 1), (1, 1)]), st.booleans(), st.sampled_from(WINDOWS))
def test_kernel_crossing_key_ranges(layout, heads, causal, window):
    """dk/dv runs one program per key tile over every segment that reaches it: key ranges
    that cross each other and tile edges, in scrambled order, sum into the right rows, and
    rows no segment reads get zero gradients (the outputs start unwritten and poisoned)."""
    q, k, v, seg = _tensors(layout, heads, 16, torch.float32, seed=len(layout[0]))
    _kernel_vs_reference(q, k, v, seg, causal, window)


@pytest.mark.interpret
@pytest.mark.parametrize(
    "heads,causal,window",
    fast_tier_takes(
        [(h, *cw) for h in ((2, 1), (3, 3)) for cw in (*CAUSAL_AND_WINDOW, (True, (5, -1)))],
        ((2, 1), True, (5, -1)), ((3, 3), False, (7, 3)),
    ),
)
def test_kernel_tma_loads_match_pointer_loads(heads, causal, window):
    """With TMA descriptors (2-byte elements, heads adjacent: the H100 path; fp16 here, as the
    interpreter computes bf16 dots wrongly) the kernels read whole tiles,
    rows of other segments included, and zero those rows in the masked tiles; the pointer
    loads never read them. The two must give the same bits, on segments of 0-50 queries over
    crossing key ranges, with NaN in every row no segment covers (a row read and not zeroed
    would turn P = 0 into NaN), and agree with the float64 reference."""
    layout = ([0, 50, 50, 51, 90], [50, 0, 1, 33, 6], [0, 3, 0, 10, 2], [0, 50, 50, 60, 104],
              [50, 10, 1, 40, 3], 100, 110)  # fmt: skip
    q, k, v, seg = _tensors(layout, heads, 16, torch.float16)
    q[84:90], q[96:] = float("nan"), float("nan")  # query rows in no segment
    k[100:104], v[100:104], k[107:], v[107:] = (float("nan"),) * 4  # key rows no segment reads
    assert launch.tma_usable("fwd", 16, 16, k, v) and launch.tma_usable("bwd_dkdv", 16, 16, q, q)
    pointer_loads = dataclasses.replace(ATTENTION_SETTINGS, tma=False)
    assert not launch.tma_usable("fwd", 16, 16, k, v, settings=pointer_loads)
    dout, dlse = _cotangents(q, 0)
    dout[84:90], dout[96:] = float("nan"), float("nan")
    runs = []
    for settings in (ATTENTION_SETTINGS, pointer_loads):
        with poisoned_allocations():
            runs.append(_run_launchers(q, k, v, seg, causal, window, dout, dlse, settings))
    (out, lse, grads), (out_p, lse_p, grads_p) = runs
    rows = torch.cat([torch.arange(0, 84), torch.arange(90, 96)])
    for a, b in [(out, out_p), (lse, lse_p), *zip(grads, grads_p)]:
        assert torch.equal(a, b)
    assert torch.isfinite(out).all() and torch.isfinite(grads[1]).all() and torch.isfinite(grads[2]).all()
    assert torch.isfinite(grads[0][rows]).all()
    clean = [t.double().nan_to_num(0.0) for t in (q, k, v)]
    want = _run(varlen_attention_reference, *clean, seg, causal, window, dout.nan_to_num(0.0), dlse)
    got = (out.double(), lse, [g.double() for g in grads])
    _assert_agree(got, want, TOLERANCE[torch.float16])


@pytest.mark.interpret
def test_kernel_rows_without_keys():
    q, k, v, seg = _empty_rows_case(torch.float32)
    _check_empty_rows(*_kernel_vs_reference(q, k, v, seg, True, (-1, -1)))


def _bucket(work: torch.Tensor) -> torch.Tensor:
    """The launch-order bucket of a segment's work w: 8 * floor(log2(w + 1)) plus the three bits
    after the leading one (w < 2**24), at most configs.WORK_BUCKETS - 1."""
    w = work.to(torch.int64) + 1
    exp = torch.floor(torch.log2(w.double())).long()
    top = (w << 3) >> exp  # the leading one and the three bits after it: 8 .. 15
    return torch.clamp(exp * 8 + top - 8, max=configs.WORK_BUCKETS - 1)


def _tables_oracle(seg, num_q_rows, num_k_rows, block, key_block, num_tiles, causal, left, right, by_work):
    """What the segment-table kernel computes, by a loop over the segments: the clamped tables,
    the (segment, tile within it counted from where its tiles end) of the grid's first
    ``num_tiles`` tiles in segment order, each segment's tiles last to first, then put in launch
    order: with ``by_work`` sorted stably by the bucket of the key tiles that the segment's last
    query tile sees, heaviest first;
    otherwise reversed. Returns the tables, the segment of every program (``len(q_start)``
    past the last tile) and the tile within its segment of every program that has one."""
    q_start, q_len, q_pos, k_start, k_len = (t.long() for t in seg)
    qs = q_start.clamp(0, num_q_rows)
    ql = torch.minimum(q_len.clamp(min=0), num_q_rows - qs)
    ks = k_start.clamp(0, num_k_rows)
    kl = torch.minimum(k_len.clamp(min=0), num_k_rows - ks)
    qp = q_pos.int().tolist()  # the kernel keeps positions as int32
    n = len(ql)

    def tiles_end(s):  # causal, no left window: the end moved onto the key-tile grid if the partial tile allows
        stop = qp[s] + int(ql[s])
        pad, spare = -stop % key_block, -int(ql[s]) % block
        return int(ql[s]) + (pad if causal and left < 0 and ql[s] > 0 and stop > 0 and pad <= spare else 0)

    def work(s):  # key tiles visible to the query positions [pos_lo, pos_hi] of the segment's last tile
        pos_lo, pos_hi = qp[s] + max(tiles_end(s) - block, 0), qp[s] + int(ql[s]) - 1
        hi = int(kl[s])
        if causal:
            hi = min(hi, pos_hi + 1)
        if right >= 0:
            hi = min(hi, pos_hi + right + 1)
        lo = max(pos_lo - left, 0) if left >= 0 else 0
        return -(-max(hi - lo, 0) // key_block)

    # (segment, tile) in segment order; tiles count from the segment's end, and tile 0 goes
    # first in launch order: last to first
    tiles, buckets = [], []
    for s in range(n):
        count = -(-int(ql[s]) // block)
        bucket = int(_bucket(torch.tensor(work(s)))) if count else 0
        for j in range(count):
            tiles.append((s, j if by_work else count - 1 - j))
            buckets.append(bucket)
    tiles, buckets = tiles[:num_tiles], buckets[:num_tiles]
    if by_work:
        order = sorted(range(len(tiles)), key=lambda i: -buckets[i])  # stable
    else:
        order = range(len(tiles) - 1, -1, -1)
    tile_seg = [tiles[i][0] for i in order] + [n] * (num_tiles - len(tiles))
    tile_row = [tiles[i][1] for i in order]
    as_int = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    return [x.int() for x in (qs, ql, q_pos, ks, kl)], as_int(tile_seg), as_int(tile_row)


@st.composite
def raw_segment_tables(draw):
    """Segment tables as a caller may pass them, invalid ones included: negative and oversized
    starts and lengths, int32 or int64, up to 40 segments (several chunks of 16); positions and
    masks for the launch order; tile counts below, at and above what the segments need."""
    n = draw(st.integers(0, 40))
    tq, tk = draw(st.integers(0, 300)), draw(st.integers(0, 300))
    ints = st.integers(-20, 320)
    dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    seg = [torch.tensor(draw(st.lists(ints, min_size=n, max_size=n)), dtype=dtype) for _ in range(5)]
    mask = dict(
        causal=draw(st.booleans()),
        left=draw(st.sampled_from([-1, 0, 5, 100])),
        right=draw(st.sampled_from([-1, 0, 7])),
        by_work=draw(st.booleans()),
    )
    block, key_block = draw(st.sampled_from([1, 16, 64])), draw(st.sampled_from([1, 16, 32]))
    return seg, tq, tk, block, key_block, draw(st.integers(0, 60)), mask


@pytest.mark.interpret
@settings(max_examples=examples(30))
@given(raw_segment_tables())
def test_segment_table_kernel_matches_torch(case):
    """One launch builds the clamped tables and the tile table in launch order (heaviest
    segments first, or last to first) as the oracle does; chunks of 16 segments make the
    running count cross chunk boundaries, and so do the sort's running counts (up to 60 tiles)."""
    seg, tq, tk, block, key_block, num_tiles, mask = case
    with poisoned_allocations():
        tables, tile_seg, tile_row = launch.segment_tables(
            seg, tq, tk, block, key_block, num_tiles, mask["causal"], mask["left"], mask["right"], mask["by_work"],
            chunk=16,
        )
    want_tables, want_seg, want_row = _tables_oracle(seg, tq, tk, block, key_block, num_tiles, **mask)
    for got, want in zip(tables, want_tables):
        assert torch.equal(got, want)
    assert torch.equal(tile_seg, want_seg)
    n_live = len(want_row)  # the rows of tiles past the last segment's are not read
    assert torch.equal(tile_row[:n_live], want_row)


@st.composite
def key_tile_cases(draw):
    """Segment tables as the backward builds them (clamped into the tensors): up to 150
    segments (several programs of 64), dead ones (no query or no key rows) among them, key
    ranges disjoint, identical (all-gather CP) or overlapping, in any order; key tiles of 1 to
    64 rows over up to 600 key rows (up to 600 tiles)."""
    n = draw(st.integers(1, 150))
    tk = draw(st.integers(1, 600))
    kind = draw(st.sampled_from(["disjoint", "identical", "random"]))
    lens = draw(st.lists(st.integers(0, 12), min_size=n, max_size=n))
    if kind == "disjoint":
        starts, pos = [], 0
        for length in lens:
            starts.append(min(pos, tk))
            pos += length
    elif kind == "identical":
        starts = [0] * n
    else:
        starts = draw(st.lists(st.integers(0, tk), min_size=n, max_size=n))
    kl = [max(0, min(length, tk - s)) for s, length in zip(starts, lens)]
    ql = draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
    block = draw(st.sampled_from([1, 16, 64]))
    as_int = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    return as_int(ql), as_int(starts), as_int(kl), block, -(-tk // block), tk


@pytest.mark.interpret
@settings(max_examples=examples(30))
@given(key_tile_cases())
def test_key_tile_kernel_matches_torch(case):
    """The dk/dv kernel's tables from one launch equal the torch definition's: the stable order
    by key start with dead segments last, and each key tile's slice of it."""
    from custom_ops.segment_attention.reference import key_tile_segments_reference

    ql, ks, kl, block, num_tiles, tk = case
    with poisoned_allocations():
        got = launch.key_tile_segments(ql, ks, kl, block, num_tiles, tk)
    for g, want in zip(got, key_tile_segments_reference(ql, ks, kl, block, num_tiles, tk)):
        assert g.dtype == torch.int32
        assert torch.equal(g, want)


def test_launch_settings_are_immutable():
    """The tuned tables are read-only, settings are frozen values (other settings are new
    instances passed to the launchers), and the launchers default to the settings the ops use."""
    with pytest.raises(TypeError):
        configs.CONFIGS["fwd"][64] = {}
    with pytest.raises(TypeError):
        configs.TMA_CONFIGS["fwd"][64]["BLOCK_M"] = 16
    with pytest.raises(dataclasses.FrozenInstanceError):
        ATTENTION_SETTINGS.tma = False
    with pytest.raises(dataclasses.FrozenInstanceError):
        ATTENTION_SETTINGS.fwd.head_group = 4
    tiles = dict(BLOCK_M=32, BLOCK_N=16, num_warps=1, num_stages=1)
    changed = ATTENTION_SETTINGS.with_kernel("bwd_dq", config=tiles, head_group=4)
    tiles["BLOCK_M"] = 64  # the settings keep their own copy
    assert changed.bwd_dq.config["BLOCK_M"] == 32 and changed.bwd_dq.head_group == 4
    assert changed.fwd == ATTENTION_SETTINGS.fwd and ATTENTION_SETTINGS.bwd_dq.config is None
    assert configs.kernel_config("bwd_dq", 64, False, override=changed.bwd_dq.config) == dict(changed.bwd_dq.config)
    every = ATTENTION_SETTINGS.with_every_kernel(head_group=1)
    assert all(every.kernel(name).head_group == 1 for name in configs.KERNELS)
    for fn in (launch.forward, launch.backward, launch.tma_usable):
        assert inspect.signature(fn).parameters["settings"].default is ATTENTION_SETTINGS
    with pytest.raises(ValueError, match="unknown kernel"):
        ATTENTION_SETTINGS.kernel("bwd")


def test_work_bucket_oracle():
    """The oracle's bucket: eight per doubling of w + 1, exact at the edges."""
    w = torch.tensor([0, 1, 2, 3, 6, 7, 8, 15, 16, 17, 2**15 - 1, 2**20])
    assert _bucket(w).tolist() == [0, 8, 12, 16, 22, 24, 25, 32, 32, 33, 120, 127]


# --- the kernels on a GPU ------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d,heads", [(128, (8, 8)), (64, (8, 2)), (256, (16, 2))])
def test_gpu_kernel_matches_sdpa(dtype, d, heads):
    """Packed causal documents of mixed lengths (tile-edge and odd lengths), out and
    gradients against SDPA per document in the same dtype, GQA included (D = 256 with 16
    query heads on 2 kv heads: Qwen3-Next's attention)."""
    lens = [1, 63, 64, 65, 300, 1000, 129]
    starts = [sum(lens[:i]) for i in range(len(lens))]
    total = sum(lens)
    layout = (starts, lens, [0] * len(lens), starts, lens, total, total)
    q, k, v, seg = _tensors(layout, heads, d, dtype, seed=1)
    q, k, v, seg = q.cuda(), k.cuda(), v.cuda(), [t.cuda() for t in seg]
    dout = torch.randn_like(q)
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    out, _ = custom_ops.varlen_attention(qq, kk, vv, *seg, causal=True)
    out.backward(dout)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref = []
    for s, n in zip(starts, lens):
        qd, kd, vd = (t[s : s + n].transpose(0, 1) for t in (qr, kr, vr))
        ref.append(F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=True).transpose(0, 1))
    ref = torch.cat(ref)
    ref.backward(dout)
    assert rel_error(out, ref) <= TOLERANCE[dtype]
    for name, g, gr in zip("qkv", (qq.grad, kk.grad, vv.grad), (qr.grad, kr.grad, vr.grad)):
        assert rel_error(g, gr) <= TOLERANCE[dtype], f"d{name}: {rel_error(g, gr)}"


@pytest.mark.gpu
@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (False, (40, 17))])
def test_gpu_kernel_crossing_key_ranges(causal, window):
    """Key ranges crossing each other and the 64-row key tiles, shared ranges as all-gather
    CP has them, key rows nobody reads: bf16 kernel against the float64 reference."""
    layout = (
        [0, 100, 190, 400, 420],
        [100, 90, 210, 20, 77],
        [0, 50, 30, 300, 0],
        [0, 37, 37, 130, 500],
        [150, 260, 260, 333, 0],
        497,
        600,
    )
    q, k, v, seg = _tensors(layout, (4, 2), 128, torch.bfloat16, seed=2)
    dout, dlse = _cotangents(q, 2)
    got = _run(
        custom_ops.varlen_attention, q.cuda(), k.cuda(), v.cuda(), [t.cuda() for t in seg], causal, window,
        dout.cuda(), dlse.cuda(),
    )  # fmt: skip
    want = _run(varlen_attention_reference, q.double(), k.double(), v.double(), seg, causal, window, dout, dlse)
    got = (got[0].cpu(), got[1].cpu(), [g.cpu() for g in got[2]])
    _assert_agree(got, want, TOLERANCE[torch.bfloat16])
    assert (got[2][1][463:] == 0).all() and (got[2][2][463:] == 0).all(), "rows no segment reads"


# --- validation and bad input -------------------------------------------------------------------


def test_validate_varlen_segments():
    t = lambda *x: torch.tensor(x)  # noqa: E731
    validate_varlen_segments(t(0, 5, 5), t(5, 0, 3), t(0, 0, 2), t(0, 0, 0), t(5, 5, 5), 8, 5)
    with pytest.raises(ValueError, match="segments 0 and 1 overlap"):
        validate_varlen_segments(t(0, 4), t(5, 3), t(0, 0), t(0, 0), t(5, 5), 8, 5)
    with pytest.raises(ValueError, match="query rows \\[6, 9\\) are not inside"):
        validate_varlen_segments(t(0, 6), t(5, 3), t(0, 0), t(0, 0), t(5, 5), 8, 5)
    with pytest.raises(ValueError, match="key rows"):
        validate_varlen_segments(t(0), t(5), t(0), t(2), t(5), 8, 5)
    with pytest.raises(ValueError, match="must be >= 0"):
        validate_varlen_segments(t(0), t(-1), t(0), t(0), t(5), 8, 5)


def test_bad_input():
    q, k, v, seg = _tensors(([0, 6], [6, 4], [0, 0], [0, 6], [6, 4], 10, 10), (4, 2), 8, torch.float32)
    op = custom_ops.varlen_attention
    with pytest.raises(ValueError, match="q must be 3-D"):
        op(q[0], k, v, *seg)
    with pytest.raises(ValueError, match="multiple of the kv heads"):
        op(q[:, :3], k, v, *seg)
    with pytest.raises(ValueError, match="one head_dim"):
        op(q[..., :4], k, v, *seg)
    with pytest.raises(ValueError, match="k and v must have one shape"):
        op(q, k, v[:5], *seg)
    with pytest.raises(TypeError, match="one dtype"):
        op(q, k.double(), v, *seg)
    with pytest.raises(TypeError, match="q must be float16"):
        op(q.long(), k.long(), v.long(), *seg)
    with pytest.raises(ValueError, match="one device"):
        op(q, k.to("meta"), v, *seg)
    with pytest.raises(TypeError, match="q_len must be int32 or int64"):
        op(q, k, v, seg[0], seg[1].float(), *seg[2:])
    with pytest.raises(ValueError, match="k_len has 1 entries but q_start has 2"):
        op(q, k, v, *seg[:4], seg[4][:1])
    with pytest.raises(ValueError, match="q_pos must be 1-D"):
        op(q, k, v, *seg[:2], seg[2][None], *seg[3:])
    with pytest.raises(ValueError, match="k_start is on meta"):
        op(q, k, v, *seg[:3], seg[3].to("meta"), seg[4])
    with pytest.raises(ValueError, match="window_left must be >= 0, or -1"):
        op(q, k, v, *seg, window=(-2, 0))
    with pytest.raises(TypeError, match="window must be a pair"):
        op(q, k, v, *seg, window=3)


# --- code generation for Hopper (compiled here, no GPU needed) ------------------------------------


class _Stopped(Exception):
    """Raised by the first compile stage after the one a test reads, with that stage's output."""

    def __init__(self, ir, metadata: dict):
        super().__init__()
        self.ir, self.metadata = ir, metadata


def _compile_through(source, target, options: dict, last: str):
    """``triton.compile`` stopped after stage ``last`` ("ttir", "ttgir", "llir", "ptx"): an object
    with ``.asm[last]`` and ``.metadata`` as the stages up to ``last`` set it (``shared`` from
    "llir" on). The stages after it (LLVM's code generation, ptxas) are most of a compile's time.
    Where triton has no stage hook, or no stage ``last``, the whole compile."""
    from types import SimpleNamespace

    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if not hasattr(runtime, "add_stages_inspection_hook"):
        return triton.compile(source, target=target, options=options)

    def stop(ir, metadata):
        raise _Stopped(ir, metadata)

    def hook(*args):
        if not args:  # compile's call for its cache key: the stopped compile keyed apart
            return f"-through-{last}", last
        stages = next(a for a in args if isinstance(a, dict))  # (backend,) stages, options, ...
        names = list(stages)
        for name in names[names.index(last) + 1 :] if last in names else ():
            stages[name] = stop

    previous, runtime.add_stages_inspection_hook = runtime.add_stages_inspection_hook, hook
    try:
        return triton.compile(source, target=target, options=options)
    except _Stopped as stopped:
        return SimpleNamespace(asm={last: str(stopped.ir)}, metadata=SimpleNamespace(**stopped.metadata))
    finally:
        runtime.add_stages_inspection_hook = previous


def _compile_for_sm90(
    kernel, config: dict, head_dim: int = 128, float_type: str = "fp32", element: str = "*bf16", through: str = "ptx"
):  # fmt: skip
    """Compile ``kernel`` for sm_90 with ``config`` as the launcher would (q/k/v/o tensors of
    ``element``, int32 tables, 16-byte-aligned pointers and strides, float scalars of
    ``float_type``; with ``TMA`` in the config, tensor descriptors of the launcher's tiles,
    else None) up to stage ``through`` (:func:`_compile_through`), and return the compiled kernel
    (``.asm[through]``; ``.metadata.shared`` from "llir" on)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    config = dict(config)
    options = {"num_warps": config.pop("num_warps"), "num_stages": config.pop("num_stages")}
    constants = kernel_constexprs(kernel, dict(CAUSAL=True, HEAD_DIM=head_dim, BLOCK_D=head_dim, **config))
    # the descriptors' tiles: key rows in the forward and dq (desc_k, desc_v), query rows in dk/dv
    desc_rows = {"desc_k": "BLOCK_N", "desc_v": "BLOCK_N", "desc_q": "BLOCK_M", "desc_do": "BLOCK_M"}
    signature = {}
    for name in kernel.arg_names:
        if name in desc_rows:
            if config.get("TMA"):
                signature[name] = f"tensordesc<{element[1:]}[{config[desc_rows[name]]}, {head_dim}]>"
            else:
                signature[name], constants[name] = "constexpr", None
        elif name in constants:
            signature[name] = "constexpr"
        elif name in ("Q", "K", "V", "O", "DO", "DQ", "DK", "DV"):
            signature[name] = element
        elif name in ("LSE", "DLSE", "DELTA"):
            signature[name] = "*fp32"
        elif name.endswith("_ptr"):
            signature[name] = "*i32"
        elif name.endswith("scale"):
            signature[name] = float_type
        else:
            signature[name] = "i32"
    names = kernel.arg_names
    aligned = {
        (i,): [["tt.divisibility", 16]]
        for i, n in enumerate(names)
        if signature[n].startswith("*") or n.startswith("stride")
    }
    source = ASTSource(
        fn=kernel,
        signature=signature,
        constexprs={(names.index(k),): v for k, v in constants.items() if k in names},
        attrs=aligned,
    )
    return _compile_through(source, GPUTarget("cuda", 90, 32), options, through)


_KERNELS = {
    "fwd": varlen_attn_fwd_kernel,
    "bwd_dq": varlen_attn_bwd_dq_kernel,
    "bwd_dkdv": varlen_attn_bwd_dkdv_kernel,
}


@pytest.mark.parametrize("window", [False, True])
@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("kind", list(_KERNELS))
def test_key_and_query_loops_pipeline_on_hopper(kind, tma, window):
    """The inner loops must be software-pipelined (async copies into shared memory: cp.async
    with pointer loads, TMA copies with descriptors), with the window's mask terms compiled
    in and without (``WINDOW``, the causal launches).

    A loop in the kernel before them (an in-kernel binary search for the tile's
    segment) once stopped Triton from pipelining the forward's key loops: no async
    copy in the TTGIR, and a forward at a third of its speed on an H100. This
    compiles the kernels for sm_90 with their H100 launch configs, on the CPU.
    """
    pytest.importorskip("triton.backends.nvidia")
    config = dict(configs.kernel_config(kind, 128, interpreting=False, tma=tma), WINDOW=window)
    try:
        ttgir = _compile_for_sm90(_KERNELS[kind], config, through="ttgir").asm["ttgir"]
    except (ImportError, TypeError, AttributeError) as e:  # compile API of another triton release
        pytest.skip(f"cannot compile for sm_90 with triton {triton.__version__}: {e}")
    assert "ttng.warp_group_dot" in ttgir, "no wgmma: the dots are not on Hopper's matrix path"
    # three loop phases (masked, unmasked, masked), each with at least its K (or Q) tile async
    copy = "async_tma_copy_global_to_local" if tma else "async_copy_global_to_local"
    assert ttgir.count(copy) >= 6, "the inner loops are not pipelined"


@pytest.mark.parametrize("by_work", [True, False])
def test_segment_table_kernel_compiles_for_hopper(by_work):
    """The table kernel runs only in the interpreter on CPU machines: compile it for sm_90 with
    the launch parameters of the op, so a construct the GPU compiler refuses fails here."""
    pytest.importorskip("triton.backends.nvidia")
    config = dict(
        BY_WORK=by_work, BLOCK=configs.TABLE_BLOCK, BUCKETS=configs.WORK_BUCKETS,
        num_warps=configs.TABLE_WARPS, num_stages=1,
    )  # fmt: skip
    try:
        compiled = _compile_for_sm90(segment_tables_kernel, config, through="ttir")
    except (ImportError, TypeError, AttributeError) as e:  # compile API of another triton release
        pytest.skip(f"cannot compile for sm_90 with triton {triton.__version__}: {e}")
    assert "tt.scan" in compiled.asm["ttir"]  # the running tile count is a scan, not a serial loop


def test_key_tile_kernel_compiles_for_hopper():
    pytest.importorskip("triton.backends.nvidia")
    config = dict(BLOCK=configs.KEY_TILE_BLOCK, num_warps=4, num_stages=1)
    try:
        compiled = _compile_for_sm90(key_tile_segments_kernel, config)
    except (ImportError, TypeError, AttributeError) as e:  # compile API of another triton release
        pytest.skip(f"cannot compile for sm_90 with triton {triton.__version__}: {e}")
    assert "st.global" in compiled.asm["ptx"]


@pytest.mark.parametrize("kind", list(_KERNELS))
def test_kernels_take_fp64_scales(kind):
    """Inductor's launcher can pass the float arguments as fp64 scalars; the kernels must
    still compile (they cast them to fp32; an fp64 scale once made the forward's
    loop-carried accumulator change type and fail to compile under torch.compile)."""
    pytest.importorskip("triton.backends.nvidia")
    config = configs.kernel_config(kind, 64, interpreting=False)
    try:
        ttgir = _compile_for_sm90(_KERNELS[kind], config, head_dim=64, float_type="fp64", through="ttgir").asm["ttgir"]
    except (ImportError, TypeError, AttributeError) as e:  # compile API of another triton release
        pytest.skip(f"cannot compile for sm_90 with triton {triton.__version__}: {e}")
    assert "ttng.warp_group_dot" in ttgir


# The most dynamic shared memory one block may use on an H100 / H200 (227 KiB).
HOPPER_MAX_SHARED = 232448


@pytest.mark.parametrize(
    "head_dim,element,tma",
    # TMA: 2-byte elements only; 64 (the smallest tiles) and D = 128's bf16 configs in the slow tier
    fast_tier_takes(
        [(d, e, t) for d in (64, 128, 256) for e, t in (("*bf16", False), ("*fp32", False), ("*bf16", True))],
        (128, "*fp32", False), (256, "*bf16", False), (256, "*fp32", False), (256, "*bf16", True),
    ),
)
@pytest.mark.parametrize("kind", list(_KERNELS))
def test_launch_configs_fit_hopper_shared_memory(kind, head_dim, element, tma):
    """Every launch config the op picks fits an SM's shared memory, 2- and 4-byte inputs, with
    pointer and TMA loads. (The bf16-tuned D = 128 forward once asked 256 KiB for float32 and
    failed to launch.)"""
    pytest.importorskip("triton.backends.nvidia")
    if tma and not configs.has_tma_config(kind, head_dim):
        pytest.skip(f"no TMA config for {kind} at D = {head_dim}: the pointer loads serve it")
    size = int(element[-2:]) // 8
    config = configs.kernel_config(kind, head_dim, interpreting=False, element_size=size, tma=tma)
    try:
        compiled = _compile_for_sm90(_KERNELS[kind], config, head_dim=head_dim, element=element, through="llir")
    except (ImportError, TypeError, AttributeError) as e:  # compile API of another triton release
        pytest.skip(f"cannot compile for sm_90 with triton {triton.__version__}: {e}")
    assert compiled.metadata.shared <= HOPPER_MAX_SHARED, (config, compiled.metadata.shared)
