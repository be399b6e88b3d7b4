"""Property tests of the CP pieces on drawn layouts: all-gather CP attention, the row all-gather
and reduce-scatter, both CP layers and (at W = 5-7) the all-to-all, on gloo ranks, against oracles that never run the CP path.

Oracles: all-gather CP attention against :func:`dense_attention`, every sequence's softmax
attention written out over its own keys (float64, autograd for the gradients), which shares no
code with the op or with ``ag_thd_attention_reference``; the collectives against the
concatenation / sum of the shards; the layers against the same layer run on one process
(``group=None``), whose own formulas are checked elsewhere (``test_attention.py``,
``test_gdn_cp.py``, ``test_transformers.py``). The op's backward at W > 1 is also checked
against its own forward by central differences along a random direction of the global inputs
(a gradcheck of the whole CP function: all-gather, reorder, attention, reduce-scatter).

Spawning ranks costs seconds each, so hypothesis draws the cases in the parent and one spawn
checks them all: the ranks build a subgroup of ranks ``[0, W)`` for every W up to the spawn's
size, and a case of CP size W runs on the first W ranks. A failing case is named in the
assertion message and printed with it to the captured stderr by the rank that failed (its repr
rebuilds it); rerun it alone with ``run_ranks(W, _check_cases, [case])`` from this module.

Tolerances: float64, so the CP path agrees with the oracle to rounding: 1e-10 for the op
(TOLERANCE[float64]), 1e-7 for the layers (parameter gradients summed over ranks in another
order, norms and rotary in between), 1e-6 for the central differences (step 1e-6: truncation
about 1e-12, rounding about 1e-10 relative). The collectives move integer-valued data, so
every sum is exact in any order and the comparisons are exact.
"""

from __future__ import annotations

import sys
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

import cp_ops

import custom_ops
from cp_ops import Attention, GatedDeltaNet, shard_thd
from cp_ops.gdn_strategies import FusedExchange, SectionExchange, StatePassing
from custom_ops import ag_thd_attention
from custom_ops.testing import (
    MEMORY_LAYOUTS,
    TOLERANCE,
    as_memory_layout,
    attention_masks,
    first_autotune_config,
    gqa_heads,
    index_dtypes,
    poisoned_allocations,
    rel_error,
    thd_layouts,
    thd_packing,
    thd_packings,
    trailing_shapes,
)
from tests._dist import run_ranks

TOL = TOLERANCE[torch.float64]
LAYER_TOL = 1e-7
GDN_MODES = {"sections": SectionExchange, "fused": FusedExchange, "states": StatePassing}


def dense_attention(q, k, v, cu_seqlens, cu_seqlens_padded, causal=True, window=(-1, -1), scale=None):
    """Softmax attention of every sequence over its own real tokens, on global sequence-order
    ``q [T, Hq, D]``, ``k, v [T, Hkv, D]``, as dense matrices per sequence; padding rows zero.
    Query a sees key b iff ``b <= a`` (causal), ``a - b <= left``, ``b - a <= right``
    (bounds >= 0). Differentiable."""
    hq, hkv, d = q.shape[1], k.shape[1], q.shape[2]
    scale = d**-0.5 if scale is None else scale
    left, right = window
    out = q * 0  # padding rows: zero (and part of the graph when there is no sequence)
    for i in range(cu_seqlens.shape[0] - 1):
        start, n = int(cu_seqlens_padded[i]), int(cu_seqlens[i + 1] - cu_seqlens[i])
        if n == 0:
            continue
        qs = q[start : start + n]
        ks = k[start : start + n].repeat_interleave(hq // hkv, dim=1)
        vs = v[start : start + n].repeat_interleave(hq // hkv, dim=1)
        scores = torch.einsum("ahd,bhd->hab", qs, ks) * scale
        a, b = torch.arange(n)[:, None], torch.arange(n)[None, :]
        mask = torch.ones(n, n, dtype=torch.bool)
        if causal:
            mask &= b <= a
        if left >= 0:
            mask &= a - b <= left
        if right >= 0:
            mask &= b - a <= right
        # a row with no visible key gives zeros (uniform weights over nothing, times the mask)
        filled = scores.masked_fill(~mask, float("-inf")).masked_fill(~mask.any(-1, keepdim=True), 0.0)
        weights = torch.softmax(filled, dim=-1) * mask
        out = out.index_put((torch.arange(start, start + n),), torch.einsum("hab,bhd->ahd", weights, vs))
    return out


def _attention_tensors(packing, heads, head_dim, seed):
    """Global q, k, v and an output cotangent, float64, from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    hq, hkv = heads

    def rand(h):
        return torch.randn(packing.num_rows, h, head_dim, dtype=torch.float64, generator=gen)

    return rand(hq), rand(hkv), rand(hkv), rand(hq)


def _oracle(q, k, v, dout, packing, causal, window, scale=None):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = dense_attention(*leaves, packing.cu_seqlens, packing.cu_seqlens_padded, causal, window, scale)
    grads = torch.autograd.grad(out, leaves, dout, allow_unused=True, materialize_grads=True)
    return [out.detach(), *grads]


def _assert_close(got, want, tol, what):
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        err = rel_error(a, b)
        assert err < tol, f"{what}: {name} rel_error {err:.3g}"


# --- one process (W = 1, no group) -------------------------------------------------------------------


@given(
    thd_packings(max_seqs=5, max_len=24, cp_sizes=(1,)), gqa_heads(), st.sampled_from([1, 4, 8]), attention_masks(),
    st.sampled_from([1, 2]), st.sampled_from([None, 0.3]), st.data(),
)  # fmt: skip
def test_op_without_group_matches_dense_attention(packing, heads, head_dim, mask, launches, scale, data):
    """W = 1: values and gradients against the dense oracle, with no sequences, empty and
    one-token ones, GQA / MQA, causal or not with any window, int32 or int64 indices, and q, k,
    v in any memory layout."""
    causal, window = mask
    q, k, v, dout = _attention_tensors(packing, heads, head_dim, seed=len(packing.seqlens))
    views = [data.draw(st.sampled_from(MEMORY_LAYOUTS), label=f"{n} memory layout") for n in "qkv"]
    leaves = [as_memory_layout(t, m).requires_grad_() for t, m in zip((q, k, v), views)]
    out = ag_thd_attention(*leaves, packing.cu_seqlens, packing.cu_seqlens_padded, causal=causal, window=window,
                           scale=scale, launches=launches)  # fmt: skip
    out.backward(dout)
    got = [out.detach()] + [t.grad for t in leaves]
    _assert_close(got, _oracle(q, k, v, dout, packing, causal, window, scale), TOL, "no group")


@settings(max_examples=6)
@given(thd_packings(max_seqs=3, max_len=6, cp_sizes=(1,), min_seqs=1), gqa_heads(2, 2), attention_masks(3))
def test_op_without_group_gradcheck(packing, heads, mask):
    """torch.autograd.gradcheck (float64) of the op's backward on small drawn layouts."""
    causal, window = mask
    q, k, v, _ = _attention_tensors(packing, heads, 2, seed=1)
    cu, cup = packing.cu_seqlens, packing.cu_seqlens_padded
    assert torch.autograd.gradcheck(
        lambda q, k, v: ag_thd_attention(q, k, v, cu, cup, causal=causal, window=window),
        tuple(t.requires_grad_() for t in (q, k, v)),
    )


def test_dense_attention_is_softmax_attention():
    """The oracle itself on one sequence against a formula spelled out per query and key."""
    packing = thd_packing(1, [5])
    q, k, v, _ = _attention_tensors(packing, (2, 1), 3, seed=0)
    out = dense_attention(q, k, v, packing.cu_seqlens, packing.cu_seqlens_padded, causal=True, window=(1, -1))
    for h in range(2):
        for a in range(5):
            keys = [b for b in range(5) if b <= a and a - b <= 1]
            s = torch.stack([(q[a, h] * k[b, 0]).sum() * 3**-0.5 for b in keys])
            want = (torch.softmax(s, 0)[:, None] * v[keys, 0]).sum(0)
            assert torch.allclose(out[a, h], want, rtol=1e-12, atol=1e-12)


# --- cases drawn in the parent, checked on gloo ranks ----------------------------------------------


class AttentionCase(NamedTuple):
    cp_size: int
    seqlens: list
    index_dtype: torch.dtype
    heads: tuple
    head_dim: int
    causal: bool
    window: tuple
    launches: int
    head_groups: int
    seed: int


class CollectiveCase(NamedTuple):
    cp_size: int
    rows: int  # per rank
    trailing: tuple
    dtype: torch.dtype
    layout: str  # memory layout of each rank's input
    seed: int


class AllToAllCase(NamedTuple):
    cp_size: int
    case: tuple  # test_comm's case: (seqlens, section multiples, middle shape, dtype, seed)


class LayerCase(NamedTuple):
    kind: str  # "attention" or "gdn"
    cp_size: int
    seqlens: list
    config: dict
    seed: int


@st.composite
def attention_cases(draw, cp_sizes):
    cp_size, seqlens = draw(thd_layouts(max_seqs=5, max_len=30, cp_sizes=cp_sizes, min_seqs=0), label="layout")
    hq, hkv = draw(gqa_heads())
    causal, window = draw(attention_masks())
    groups = draw(st.sampled_from([g for g in range(1, hkv + 1) if hkv % g == 0]))
    return AttentionCase(cp_size, seqlens, draw(index_dtypes()), (hq, hkv), draw(st.sampled_from([2, 4, 8])), causal,
                         window, draw(st.sampled_from([1, 2])), groups, draw(st.integers(0, 2**31 - 1)))  # fmt: skip


@st.composite
def collective_cases(draw, cp_sizes):
    return CollectiveCase(
        draw(st.sampled_from(cp_sizes)), draw(st.integers(0, 5)), draw(trailing_shapes()),
        draw(st.sampled_from([torch.float64, torch.float32, torch.int64])), draw(st.sampled_from(MEMORY_LAYOUTS)),
        draw(st.integers(0, 2**31 - 1)),
    )  # fmt: skip


@st.composite
def layer_cases(draw, cp_sizes):
    cp_size, seqlens = draw(thd_layouts(max_seqs=4, max_len=20, cp_sizes=cp_sizes, min_seqs=0), label="layout")
    seed = draw(st.integers(0, 2**31 - 1))
    if draw(st.booleans()):
        hq, hkv = draw(gqa_heads())
        causal, window = draw(attention_masks())
        config = dict(
            num_heads=hq, num_kv_heads=hkv, gated=draw(st.booleans()), qk_norm=draw(st.booleans()), causal=causal,
            window=window, partial_rotary_factor=draw(st.sampled_from([0.5, 1.0])),
            head_groups=draw(st.sampled_from([g for g in range(1, hkv + 1) if hkv % g == 0])),
        )  # fmt: skip
        return LayerCase("attention", cp_size, seqlens, config, seed)
    mode = draw(st.sampled_from(sorted(GDN_MODES)))
    # by heads, the heads split over the ranks; by chunk states, any number of them
    hk = draw(st.integers(1, 3)) if mode == "states" else cp_size * draw(st.integers(1, 2))
    config = dict(num_k_heads=hk, num_v_heads=hk * draw(st.integers(1, 2)),
                  conv_kernel_size=draw(st.sampled_from([2, 4])), mode=mode)  # fmt: skip
    return LayerCase("gdn", cp_size, seqlens, config, seed)


def _size(case) -> int:
    if isinstance(case, CollectiveCase):
        return case.rows * (1 + sum(case.trailing))
    if isinstance(case, AllToAllCase):
        return sum(case.case[0]) * sum(case.case[1])
    return sum(case.seqlens) + len(case.seqlens)


def draw_cases(strategy, n: int, spread: int = 8) -> list:
    """``n`` of the first ``n * spread`` examples of ``strategy`` that hypothesis generates
    under the active profile: the first (the simplest: no sequences, one head, ...), then the
    largest ones of each CP size in turn. Hypothesis starts with simple examples, so its first
    n alone would be mostly empty batches."""
    if n == 0:
        return []
    drawn = []

    @settings(max_examples=n * spread, database=None)
    @given(strategy)
    def collect(case):
        drawn.append(case)

    collect()
    by_size = {}
    for case in sorted(drawn[1:], key=_size, reverse=True):
        by_size.setdefault(case.cp_size, []).append(case)
    cases = drawn[:1]
    while len(cases) < n and any(by_size.values()):
        for w in sorted(by_size):
            if by_size[w] and len(cases) < n:
                cases.append(by_size[w].pop(0))
    return cases


def _check_attention(case: AttentionCase, group, rank):
    packing = thd_packing(case.cp_size, case.seqlens, case.index_dtype)
    cup, w = packing.cu_seqlens_padded, case.cp_size
    q, k, v, dout = _attention_tensors(packing, case.heads, case.head_dim, case.seed)
    want = [shard_thd(t, cup, w, rank) for t in _oracle(q, k, v, dout, packing, case.causal, case.window)]
    local = [shard_thd(t, cup, w, rank) for t in (q, k, v)]

    def op(q_, k_, v_):
        return ag_thd_attention(q_, k_, v_, packing.cu_seqlens, cup, causal=case.causal, window=case.window,
                                group=group, launches=case.launches, head_groups=case.head_groups)  # fmt: skip

    leaves = [t.clone().requires_grad_() for t in local]
    out = op(*leaves)
    out.backward(shard_thd(dout, cup, w, rank))
    _assert_close([out.detach()] + [t.grad for t in leaves], want, TOL, f"{case} rank {rank}")

    # central differences of <dout, out> summed over ranks, along a random global direction
    gen = torch.Generator().manual_seed(case.seed + 1)
    dirs = [shard_thd(torch.randn(t.shape, dtype=torch.float64, generator=gen), cup, w, rank) for t in (q, k, v)]
    dout_local = shard_thd(dout, cup, w, rank)
    eps = 1e-6

    def loss(sign):
        with torch.no_grad():
            value = (op(*[t + sign * eps * d for t, d in zip(local, dirs)]) * dout_local).sum().reshape(1)
        dist.all_reduce(value, group=group)
        return value

    numeric = (loss(1) - loss(-1)) / (2 * eps)
    analytic = sum((g * d).sum() for g, d in zip([t.grad for t in leaves], dirs)).reshape(1)
    dist.all_reduce(analytic, group=group)
    assert torch.allclose(numeric, analytic, rtol=1e-6, atol=1e-8), f"{case} rank {rank}: {numeric} vs {analytic}"


def _check_collectives(case: CollectiveCase, group, rank):
    name, w = custom_ops.resolve_group(group)
    gen = torch.Generator().manual_seed(case.seed)

    def ints(shape):  # integer-valued, so sums over ranks are exact in any order
        return torch.randint(-1000, 1000, shape, generator=gen).to(case.dtype)

    shards = [ints((case.rows,) + case.trailing) for _ in range(w)]
    fulls = [ints((w * case.rows,) + case.trailing) for _ in range(w)]
    grad_gathered = [ints((w * case.rows,) + case.trailing) for _ in range(w)]
    grad_scattered = [ints((case.rows,) + case.trailing) for _ in range(w)]
    differentiable = case.dtype.is_floating_point
    what = f"{case} rank {rank}"

    mine = as_memory_layout(shards[rank], case.layout).requires_grad_(differentiable)
    gathered = custom_ops.all_gather_rows(mine, name)
    assert torch.equal(gathered, torch.cat(shards)), what
    full = as_memory_layout(fulls[rank], case.layout).requires_grad_(differentiable)
    scattered = custom_ops.reduce_scatter_rows(full, name)
    assert torch.equal(scattered, sum(fulls)[rank * case.rows : (rank + 1) * case.rows]), what
    if differentiable:  # each one's gradient is the other applied to the output gradient
        gathered.backward(grad_gathered[rank])
        assert torch.equal(mine.grad, sum(grad_gathered)[rank * case.rows : (rank + 1) * case.rows]), what
        scattered.backward(grad_scattered[rank])
        assert torch.equal(full.grad, torch.cat(grad_scattered)), what


def _random_parameters(layer):
    """Every parameter random (zero-initialised norm weights would hide their gradients)."""
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * (p.shape[-1] ** -0.5 if p.dim() >= 2 else 0.3))
    return layer


def _layer(case: LayerCase, hidden=12):
    torch.manual_seed(case.seed)
    config = dict(case.config)
    if case.kind == "attention":
        return _random_parameters(Attention(hidden, head_dim=4, **config).double())
    mode = config.pop("mode")
    layer = GatedDeltaNet(hidden, head_k_dim=4, head_v_dim=3, **config).double()
    with torch.no_grad():  # A_log as initialised (decays in (0, 1)); the others random
        a_log = layer.A_log.clone()
        _random_parameters(layer).A_log.copy_(a_log)
    layer.context_parallel = GDN_MODES[mode]()
    return layer


def _run_layer(layer, kind, x, packing, group):
    if kind == "attention":
        return layer(x, packing.cu_seqlens, packing.cu_seqlens_padded, group=group)
    return layer(x, packing.cu_seqlens_padded, group=group)


def _check_layer(case: LayerCase, group, rank):
    packing = thd_packing(case.cp_size, case.seqlens)
    cup, w = packing.cu_seqlens_padded, case.cp_size
    layer = _layer(case)
    gen = torch.Generator().manual_seed(case.seed)
    x = torch.randn(packing.num_rows, 12, dtype=torch.float64, generator=gen)
    grad_out = torch.randn(x.shape, dtype=torch.float64, generator=gen)

    x_ref = x.clone().requires_grad_()
    out_ref = _run_layer(layer, case.kind, x_ref, packing, None)
    out_ref.backward(grad_out)
    ref_grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    layer.zero_grad()

    x_cp = shard_thd(x, cup, w, rank).requires_grad_()
    out_cp = _run_layer(layer, case.kind, x_cp, packing, group)
    out_cp.backward(shard_thd(grad_out, cup, w, rank))
    what = f"{case} rank {rank}"
    assert rel_error(out_cp.detach(), shard_thd(out_ref.detach(), cup, w, rank)) < LAYER_TOL, what
    assert rel_error(x_cp.grad, shard_thd(x_ref.grad, cup, w, rank)) < LAYER_TOL, what
    # a gradient that is zero in exact arithmetic (one-token sequences: q_proj's, the softmax over
    # one key having no slope) is rounding noise on both sides: measured against the largest one
    floor = 1e-3 * max(float(g.norm()) for g in ref_grads.values())
    for name, p in layer.named_parameters():
        dist.all_reduce(p.grad, group=group)
        ref = ref_grads[name]
        err = float((p.grad - ref).norm()) / max(float(ref.norm()), floor, 1e-300)
        assert err < LAYER_TOL, f"{what}: {name} error {err:.3g}"


def _check_all_to_all(case: AllToAllCase, group, rank):
    from tests.cp_ops.test_comm import _check_cases as check_exchange

    check_exchange(rank, case.cp_size, [case.case], group)


_CHECKS = {
    AttentionCase: _check_attention,
    CollectiveCase: _check_collectives,
    LayerCase: _check_layer,
    AllToAllCase: _check_all_to_all,
}


def _run_case(checks, case, group, rank):
    """``checks[type(case)](case, group, rank)``; a failure is also printed with its case to
    stderr (pytest shows it): the spawn reports the first rank to exit, which may be a peer whose
    collective broke off when the failing rank left."""
    try:
        checks[type(case)](case, group, rank)
    except BaseException as e:
        print(f"rank {rank} failed on {case!r}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        raise


def _check_cases(rank, world, cases):
    # every rank takes part in creating every group, in one order; a case of size W runs on [0, W)
    groups = {w: dist.new_group(list(range(w))) for w in range(1, world + 1)}
    for case in cases:
        if rank < case.cp_size:
            _run_case(_CHECKS, case, groups[case.cp_size], rank)


def all_to_all_cases(cp_size):
    """thd_cp2hp / thd_hp2cp cases of test_comm.py (which spawns W = 1-4 and 8) at ``cp_size``."""
    from tests.cp_ops.test_comm import _case

    return st.builds(AllToAllCase, st.just(cp_size), _case())


def _cases(cp_sizes, attention: int, collectives: int, layers: int, exchanges: int, exchange_sizes=(5, 6, 7)):
    """Drawn cases of each kind; ``exchanges`` all-to-all cases at each of ``exchange_sizes``."""
    cases = (
        draw_cases(attention_cases(cp_sizes), attention)
        + draw_cases(collective_cases(cp_sizes), collectives)
        + draw_cases(layer_cases(cp_sizes), layers)
    )
    for w in exchange_sizes:  # the simplest (one empty sequence) left out: test_comm.py has it
        cases += draw_cases(all_to_all_cases(w), exchanges + 1)[1:]
    return cases


# cases a wide run once failed on, kept in the default tier
FOUND = [
    # one-token sequences: q_proj's gradient is zero in exact arithmetic, rounding noise here
    LayerCase("attention", 4, [1, 1, 1], {"num_heads": 2, "num_kv_heads": 1, "gated": False, "qk_norm": True,
                                           "causal": True, "window": (-1, -1), "partial_rotary_factor": 1.0,
                                           "head_groups": 1}, seed=467),
]  # fmt: skip


@pytest.mark.dist
def test_cp_pieces_match_their_oracles():
    """W = 1-7 (W = 1 through a group of one rank: the collectives and the reorder run)."""
    cases = _cases(tuple(range(1, 8)), attention=10, collectives=7, layers=7, exchanges=1) + FOUND
    assert {c.cp_size for c in cases} == set(range(1, 8))
    run_ranks(7, _check_cases, cases)


@pytest.mark.dist
@pytest.mark.slow
def test_cp_pieces_match_their_oracles_wide():
    """W = 1-8, many more cases; the all-to-all at W = 5-7."""
    cases = _cases(tuple(range(1, 9)), attention=80, collectives=40, layers=40, exchanges=10)
    assert {c.cp_size for c in cases} == set(range(1, 9))
    run_ranks(8, _check_cases, cases)


# --- float32 on gloo ranks with the Triton kernels in the interpreter (TRITON_INTERPRET=1) ----------
#
# float64 takes the torch references inside the ops, so the tests above never run a kernel inside
# CP. In float32 under TRITON_INTERPRET=1 (inherited by the spawned ranks) the segment-attention,
# reorder, valid-token copy, section and conv kernels run, in the op and in both layers, with
# fresh memory poisoned. The oracle is float64 (the dense attention; the layer on one process in
# float64, from the same parameters); float32 rounding bounds the error: 1e-5 relative
# (TOLERANCE[float32]) for the op, 1e-4 for the layers' outputs and input gradients, whose
# backward runs the gated delta rule's recurrence over whole sequences (a wide run drew an
# input gradient at 1.2e-5; a wrong row or head is an error of order one).

F32_LAYER_TOL = 1e-4


def _check_attention_float32(case: AttentionCase, group, rank):
    packing = thd_packing(case.cp_size, case.seqlens, case.index_dtype)
    cup, w = packing.cu_seqlens_padded, case.cp_size
    q, k, v, dout = (t.float().double() for t in _attention_tensors(packing, case.heads, case.head_dim, case.seed))
    want = [shard_thd(t, cup, w, rank) for t in _oracle(q, k, v, dout, packing, case.causal, case.window)]
    leaves = [shard_thd(t, cup, w, rank).float().requires_grad_() for t in (q, k, v)]
    out = ag_thd_attention(*leaves, packing.cu_seqlens, cup, causal=case.causal, window=case.window, group=group,
                           launches=case.launches, head_groups=case.head_groups)  # fmt: skip
    out.backward(shard_thd(dout, cup, w, rank).float())
    _assert_close([out.detach()] + [t.grad for t in leaves], want, TOLERANCE[torch.float32], f"{case} rank {rank}")


def _check_layer_float32(case: LayerCase, group, rank):
    import copy

    packing = thd_packing(case.cp_size, case.seqlens)
    cup, w = packing.cu_seqlens_padded, case.cp_size
    layer = _layer(case)
    layer32 = copy.deepcopy(layer).float()
    gen = torch.Generator().manual_seed(case.seed)
    x = torch.randn(packing.num_rows, 12, dtype=torch.float64, generator=gen).float().double()
    grad_out = torch.randn(x.shape, dtype=torch.float64, generator=gen).float().double()

    x_ref = x.clone().requires_grad_()
    out_ref = _run_layer(layer, case.kind, x_ref, packing, None)
    out_ref.backward(grad_out)

    x_cp = shard_thd(x, cup, w, rank).float().requires_grad_()
    out_cp = _run_layer(layer32, case.kind, x_cp, packing, group)
    out_cp.backward(shard_thd(grad_out, cup, w, rank).float())
    what = f"float32 {case} rank {rank}"
    assert rel_error(out_cp.detach(), shard_thd(out_ref.detach(), cup, w, rank)) < F32_LAYER_TOL, what
    assert rel_error(x_cp.grad, shard_thd(x_ref.grad, cup, w, rank)) < F32_LAYER_TOL, what
    # parameter gradients are sums over all T rows whose terms may cancel (dt_bias, A_log: one
    # number per head), so each is measured against the largest gradient's scale where its own is
    # small, as in float64 (_check_layer), at 1e-2 of it: a gradient that is zero in exact
    # arithmetic (q's, under a window of one key) is float32 rounding, about 1e-7 of that scale;
    # a missing or doubled term is still an error of order one against its own size
    ref_grads = {name: p.grad for name, p in layer.named_parameters()}
    floor = 1e-2 * max(float(g.norm()) for g in ref_grads.values())
    for name, p in layer32.named_parameters():
        dist.all_reduce(p.grad, group=group)
        ref = ref_grads[name]
        err = float((p.grad.double() - ref).norm()) / max(float(ref.norm()), floor, 1e-300)
        assert err < F32_LAYER_TOL, f"{what}: {name} error {err:.3g}"


_FLOAT32_CHECKS = {AttentionCase: _check_attention_float32, LayerCase: _check_layer_float32}


def _check_cases_float32(rank, world, cases):
    groups = {w: dist.new_group(list(range(w))) for w in range(1, world + 1)}
    with poisoned_allocations(), first_autotune_config():
        for case in cases:
            if rank < case.cp_size:
                _run_case(_FLOAT32_CHECKS, case, groups[case.cp_size], rank)


def _float32_cases(cp_sizes, attention, layers, max_len=12):
    """Op cases and ``layers`` cases of each layer, sequences cut to ``max_len`` (the interpreter
    is slow)."""
    cases = draw_cases(attention_cases(cp_sizes), attention)
    for kind in ("attention", "gdn"):
        cases += draw_cases(layer_cases(cp_sizes).filter(lambda c, kind=kind: c.kind == kind), layers)
    return [c._replace(seqlens=[min(n, max_len) for n in c.seqlens]) for c in cases]


@pytest.mark.dist
@pytest.mark.interpret
def test_float32_kernels_inside_cp_match_float64_oracles():
    """W = 2: the op and both layers (each at least once) in float32 with the kernels interpreted."""
    run_ranks(2, _check_cases_float32, _float32_cases((2,), attention=1, layers=0) + FOUND_FLOAT32)


# cases drawn runs once failed on, kept in the default tier: a wide run's (its input gradient at
# 1.2e-5), and a window of one key, where q's gradient is zero and float32 gives rounding only
FOUND_FLOAT32 = [
    LayerCase("gdn", 2, [1, 15, 15], {"num_k_heads": 4, "num_v_heads": 4, "conv_kernel_size": 2,
                                      "mode": "sections"}, seed=0),
    LayerCase("attention", 2, [12, 4, 4], {"num_heads": 3, "num_kv_heads": 3, "gated": False, "qk_norm": True,
                                           "causal": True, "window": (0, -1), "partial_rotary_factor": 0.5,
                                           "head_groups": 1}, seed=1012645),
]  # fmt: skip


@pytest.mark.dist
@pytest.mark.interpret
@pytest.mark.slow
def test_float32_kernels_inside_cp_match_float64_oracles_wide():
    run_ranks(4, _check_cases_float32, _float32_cases((1, 2, 3, 4), attention=16, layers=8, max_len=24))
