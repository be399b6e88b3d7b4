"""All-gather CP attention and the gated Attention layer agree with attention on the global batch.

The oracle is ``ag_thd_attention_reference``: ``varlen_attention_reference`` over
whole sequences (``q_pos = 0``, ``q_len = k_len = L_i``) on the global sequence-order
tensors; each rank compares
its shard of the oracle's output and gradients (dk, dv: its shard of the global
dk, dv, which the reduce-scatter must produce). Every row is compared, padding
included (zero output, zero gradient on both sides).

Tolerances: float64 everywhere. The CP path evaluates the same softmax over the
same keys as the oracle, only summed in another order (gathered keys, dk/dv
reduced over ranks), so it agrees to rounding: 1e-10 (TOLERANCE[float64]) for the
op; 1e-7 for the layer, as for the GDN layer, since the projections' parameter
gradients are summed over ranks in a different order and norms/rotary add ops.

Spawns are the main cost, so each spawned test runs every case of its W in one go.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

import cp_ops
import custom_ops
from cp_ops import Attention, pad_cu_seqlens, shard_thd
from cp_ops.modules import apply_rotary
from custom_ops import ag_thd_attention, ag_thd_attention_reference, ag_thd_segments
from custom_ops.testing import TOLERANCE, random_seqlens, rel_error, thd_layouts
from custom_ops.valid_tokens.reference import valid_token_mask
from tests._dist import collective_windows, run_ranks

TOL = TOLERANCE[torch.float64]
HIDDEN = 24

# (seqlens, (Hq, Hkv), D, causal, window): zero-length and length-1 sequences, GQA, windows
# left only (causal), left+right (non-causal), and a sequence that leaves whole chunks empty
CASES = [
    ([9, 0, 1, 23, 6], (4, 2), 8, True, (-1, -1)),
    ([9, 0, 1, 23, 6], (2, 2), 8, False, (-1, -1)),
    ([17, 1, 0, 30], (6, 2), 4, True, (5, -1)),
    ([17, 1, 0, 30], (3, 1), 4, False, (4, 2)),
    ([2, 33], (2, 1), 6, True, (-1, -1)),
    ([0], (2, 1), 4, True, (-1, -1)),  # nothing real at all
]


def _global_case(seqlens, heads, head_dim, world, seed):
    """Global sequence-order q, k, v and an output cotangent (float64, fresh random data)."""
    gen = torch.Generator().manual_seed(seed)
    cu, cup = pad_cu_seqlens(seqlens, world)
    rows = int(cup[-1])
    hq, hkv = heads

    def rand(h):
        return torch.randn(rows, h, head_dim, dtype=torch.float64, generator=gen)

    return cu, cup, rand(hq), rand(hkv), rand(hkv), rand(hq)


def _reference(q, k, v, dout, cu, cup, causal, window):
    """Attention of every sequence over itself, on the global tensors: (out, dq, dk, dv)."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = ag_thd_attention_reference(q, k, v, cu, cup, causal=causal, window=window)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _cp_run(fn, q_cp, k_cp, v_cp, dout_cp, cu, cup, causal, window, **kwargs):
    q_cp, k_cp, v_cp = (t.clone().requires_grad_() for t in (q_cp, k_cp, v_cp))
    out = fn(q_cp, k_cp, v_cp, cu, cup, causal=causal, window=window, **kwargs)
    out.backward(dout_cp)
    return out.detach(), q_cp.grad, k_cp.grad, v_cp.grad


def _assert_close(got, want, tol, what):
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        err = rel_error(a, b)
        assert err < tol, f"{what}: {name} rel_error {err:.3g}"


# --- the segment tables, single process (every rank and W, no collective) ---------------------------


@given(thd_layouts(max_seqs=5, max_len=30, cp_sizes=(1, 2, 3, 4)), st.booleans(), st.sampled_from(
    [(-1, -1), (3, -1), (2, 1), (0, 0), (-1, 2)]))  # fmt: skip
def test_segments_give_global_attention(layout, causal, window):
    """For every rank r: varlen_attention(shard_r(q), global k, v, ag_thd_segments(r)) equals
    shard_r of the global attention. This is the op after its all-gather and reorder."""
    world, seqlens = layout
    cu, cup, q, k, v, _ = _global_case(seqlens, (4, 2), 4, world, seed=len(seqlens))
    want = ag_thd_attention_reference(q, k, v, cu, cup, causal=causal, window=window)
    for rank in range(world):
        seg = ag_thd_segments(cu, cup, world, rank, causal, window[1])
        custom_ops.validate_varlen_segments(*seg, q.shape[0] // world, q.shape[0])
        got, _ = custom_ops.varlen_attention(shard_thd(q, cup, world, rank), k, v, *seg, causal=causal, window=window)
        assert rel_error(got, shard_thd(want, cup, world, rank)) < TOL


def test_segment_formulas():
    """The tables spelled out for one layout: W = 2, rank 1, lengths 5 and 8 (padded 8 and 8, c = 2)."""
    cu, cup = torch.tensor([0, 5, 13]), torch.tensor([0, 8, 16])
    q_start, q_len, q_pos, k_start, k_len = ag_thd_segments(cu, cup, 2, 1, causal=True, window_right=-1)
    # rank 1 holds chunks 1 and 2 of each sequence; local offsets cup / 2 = 0, 4
    assert q_start.tolist() == [0, 2, 4, 6]
    assert q_len.tolist() == [2, 1, 2, 2]  # sequence 0 has 5 real tokens: chunk 2 holds only row 4
    assert q_pos.tolist() == [2, 4, 2, 4]
    assert k_start.tolist() == [0, 0, 8, 8]
    assert k_len.tolist() == [4, 5, 4, 6]  # min(L, (j+1)*c)
    assert ag_thd_segments(cu, cup, 2, 1, causal=True, window_right=3)[4].tolist() == [5, 5, 7, 8]
    assert ag_thd_segments(cu, cup, 2, 1, causal=False)[4].tolist() == [5, 5, 8, 8]


@pytest.mark.interpret
@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (False, (4, 2))])
def test_kernels_with_ag_segments(causal, window, poison_empty):
    """The Triton kernels (interpreted) on every rank's tables at W = 2, float32, fwd and bwd.

    K and V are head slices of one gathered tensor, as in the op; dk, dv are summed over
    the ranks (what the reduce-scatter does) and compared with the global gradients.
    """
    world = 2
    cu, cup, q, k, v, dout = _global_case([9, 0, 1, 13], (2, 1), 16, world, seed=5)
    want = _reference(q, k, v, dout, cu, cup, causal, window)
    kv = torch.cat([k, v], dim=1).float().requires_grad_()
    for rank in range(world):
        seg = ag_thd_segments(cu, cup, world, rank, causal, window[1])
        q_cp = shard_thd(q, cup, world, rank).float().requires_grad_()
        out, _ = custom_ops.varlen_attention(q_cp, kv[:, :1], kv[:, 1:], *seg, causal=causal, window=window)
        out.backward(shard_thd(dout, cup, world, rank).float())
        tol = TOLERANCE[torch.float32]
        assert rel_error(out.detach(), shard_thd(want[0], cup, world, rank)) < tol
        assert rel_error(q_cp.grad, shard_thd(want[1], cup, world, rank)) < tol
    assert rel_error(kv.grad[:, :1], want[2]) < TOLERANCE[torch.float32]
    assert rel_error(kv.grad[:, 1:], want[3]) < TOLERANCE[torch.float32]


# --- no group (W = 1), in process -------------------------------------------------------------------


@pytest.mark.parametrize("launches", [1, 2])
def test_no_group_is_varlen_attention(launches):
    for i, (seqlens, heads, d, causal, window) in enumerate(CASES):
        cu, cup, q, k, v, dout = _global_case(seqlens, heads, d, 1, seed=i)
        got = _cp_run(ag_thd_attention, q, k, v, dout, cu, cup, causal, window, launches=launches)
        _assert_close(got, _reference(q, k, v, dout, cu, cup, causal, window), TOL, f"case {i}")
        assert not got[0][~valid_token_mask(cup, cu, q.shape[0])].any()  # padding rows are zero


def _opcheck_samples():
    cu, cup, q, k, v, _ = _global_case([9, 0, 1, 5], (4, 2), 8, 1, seed=0)
    yield (q, k, v, cu, cup), {}
    yield (q.float(), k.float(), v.float(), cu.long(), cup.long()), {"causal": False, "window_left": 2, "window_right": 1}
    yield (q, k, v, cu, cup, True, 3, -1, 0.5, None), {}
    yield (q[:0], k[:0], v[:0], cu[:1], cup[:1]), {}  # no sequences, T = 0
    yield (q.clone().requires_grad_(), k.clone().requires_grad_(), v.clone().requires_grad_(), cu, cup), {}


def test_opcheck():
    for args, kwargs in _opcheck_samples():
        torch.library.opcheck(torch.ops.cp_ops.ag_thd_attention.default, args, kwargs)


def test_bad_input():
    cu, cup, q, k, v, _ = _global_case([4, 3], (2, 1), 4, 1, seed=0)
    with pytest.raises(ValueError, match="q has 8 rows but k and v have 7"):
        ag_thd_attention(q, k[:-1], v[:-1], cu, cup)
    with pytest.raises(ValueError, match="both are \\[B\\+1\\]"):
        ag_thd_attention(q, k, v, cu[:-1], cup)
    with pytest.raises(ValueError, match="launches must be 1 or 2"):
        ag_thd_attention(q, k, v, cu, cup, launches=3)
    for groups in (0, 2):  # Hkv = 1
        with pytest.raises(ValueError, match="head_groups must be a positive divisor of Hkv = 1"):
            ag_thd_attention(q, k, v, cu, cup, head_groups=groups)
    with pytest.raises(ValueError, match="head_groups must be a positive divisor of num_kv_heads = 2"):
        Attention(HIDDEN, 4, 2, 8, head_groups=3)
    for factor in (0.1, 0.375, 1.5, 0.0):  # 0, 3 (odd), 12 (> head_dim) and 0 features rotated
        with pytest.raises(ValueError, match=f"partial_rotary_factor = {factor} with head_dim = 8 rotates"):
            Attention(HIDDEN, 4, 2, 8, partial_rotary_factor=factor)
    with pytest.raises(ValueError, match=r"rotary_dim must be even and in \(0, 4\] for x of shape \(8, 2, 4\), got 6"):
        apply_rotary(q, torch.arange(8), 10000.0, 6)
    with pytest.raises(ValueError, match="query heads \\(1\\) must be a multiple of the kv heads \\(2\\)"):
        ag_thd_attention(q[:, :1], torch.cat([k, k], 1), torch.cat([v, v], 1), cu, cup)
    with pytest.raises(ValueError, match="must be a multiple of the kv heads \\(0\\)"):  # no kv heads
        ag_thd_attention(q, k[:, :0], v[:, :0], cu, cup)
    with pytest.raises(TypeError, match="window must be a pair"):
        ag_thd_attention(q, k, v, cu, cup, window=3)


# --- the layer, in process ----------------------------------------------------------------------------


def _layer(heads, seed=0, **kwargs):
    """An Attention layer with every parameter random (norm weights too: zeros would hide their grads)."""
    torch.manual_seed(seed)
    layer = Attention(HIDDEN, *heads, 8, **kwargs).double()
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * (HIDDEN**-0.5 if p.dim() == 2 else 0.3))
    return layer


def _sequence_positions(cu, cup):
    """Every row's position in its sequence, padding rows included, from a loop over sequences."""
    pos = torch.zeros(int(cup[-1]), dtype=torch.float64)
    for start, end in zip(cup[:-1].tolist(), cup[1:].tolist()):
        pos[start:end] = torch.arange(end - start, dtype=torch.float64)
    return pos


def _rope_formula(t, pos, theta, rotary_dim):
    """Partial rotary embedding written out: feature pairs (m, m + R/2) of the first R features
    turned by pos * theta^(-2m/R), the rest left as they are."""
    half = rotary_dim // 2
    out = t.clone()
    for m in range(half):
        ang = (pos * theta ** (-2 * m / rotary_dim))[:, None]
        a, b = t[..., m], t[..., m + half]
        out[..., m] = a * ang.cos() - b * ang.sin()
        out[..., m + half] = b * ang.cos() + a * ang.sin()
    return out


@given(thd_layouts(max_seqs=4, max_len=30, cp_sizes=(1, 2, 3, 4)), st.sampled_from([0.25, 0.5, 1.0]))
def test_rotary_on_every_shard_matches_the_formula(layout, factor):
    """apply_rotary on rank r's shard at local_positions equals rank r's shard of the formula
    applied at the global sequence positions: partial widths and the CP positions together."""
    world, seqlens = layout
    cu, cup = pad_cu_seqlens(seqlens, world)
    x = torch.randn(int(cup[-1]), 3, 16, dtype=torch.float64)
    rotary_dim = int(16 * factor)
    want = _rope_formula(x, _sequence_positions(cu, cup), 500.0, rotary_dim)
    for rank in range(world):
        local = shard_thd(x, cup, world, rank)
        pos = custom_ops.local_positions(cup, world, rank, local.shape[0])
        got = apply_rotary(local, pos, 500.0, rotary_dim)
        assert rel_error(got, shard_thd(want, cup, world, rank)) < TOL, f"rank {rank}"
        assert torch.equal(got[..., rotary_dim:], local[..., rotary_dim:])  # passed through untouched


@given(thd_layouts(max_seqs=4, max_len=20, cp_sizes=(1, 2, 3)), st.sampled_from([0.25, 0.5, 1.0]))
def test_layer_matches_its_formula(layout, factor):
    """The layer on one device, written out with the global reference (the docstring's formula),
    rotating the first int(8 * factor) of the 8 features of each head."""
    _, seqlens = layout
    layer = _layer((4, 2), partial_rotary_factor=factor, rope_theta=300.0)
    cu, cup = pad_cu_seqlens(seqlens, layout[0])
    x = torch.randn(int(cup[-1]), HIDDEN, dtype=torch.float64)
    rows, d = x.shape[0], 8
    qg = layer.q_proj(x).view(rows, 4, 2 * d)
    q, gate = qg[..., :d], qg[..., d:]
    k, v = layer.k_proj(x).view(rows, 2, d), layer.v_proj(x).view(rows, 2, d)

    def norm(t, w):
        return t / (t.square().mean(-1, keepdim=True) + 1e-6).sqrt() * (1 + w)

    pos = _sequence_positions(cu, cup)
    q = _rope_formula(norm(q, layer.q_norm.weight), pos, 300.0, int(d * factor))
    k = _rope_formula(norm(k, layer.k_norm.weight), pos, 300.0, int(d * factor))
    o = ag_thd_attention_reference(q, k, v, cu, cup)
    want = layer.o_proj((o * torch.sigmoid(gate)).reshape(rows, 4 * d))
    assert rel_error(layer(x, cu, cup).detach(), want.detach()) < TOL


def test_layer_matches_transformers_qwen3_next_attention():
    """Qwen3NextAttention's weights loaded into Attention(partial_rotary_factor=0.25, rope_theta
    from its config) give its output, float64, every sequence run alone through transformers.

    transformers computes the rotary angles in float32 whatever the dtype; the cos / sin given
    to it here are its formula (``Qwen3NextRotaryEmbedding``) evaluated in float64, so the two
    agree to float64 rounding, not float32 angles. Its q/k RMSNorm runs in float32 (``x.float()``
    in ``Qwen3NextRMSNorm``; ours in float64), which leaves differences of about 1e-7: the bound
    is 1e-6 rather than 1e-10."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextAttention

    theta, head_dim = 1e6, 16
    config = transformers.Qwen3NextConfig(
        hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
        rope_parameters={"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": 0.25},
        attn_implementation="eager", num_hidden_layers=1, layer_types=["full_attention"],
    )  # fmt: skip
    torch.manual_seed(4)
    theirs = Qwen3NextAttention(config, layer_idx=0).double()
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn_like(p) * (HIDDEN**-0.5 if p.dim() == 2 else 0.3))
    ours = Attention(HIDDEN, 4, 2, head_dim, rope_theta=theta, partial_rotary_factor=0.25,
                     norm_eps=config.rms_norm_eps).double()  # fmt: skip
    ours.load_state_dict(theirs.state_dict())  # the same names and layouts

    rotary_dim = int(head_dim * config.rope_parameters["partial_rotary_factor"])
    inv_freq = 1.0 / theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    seqlens = [1, 9, 0, 70]
    cu, cup = pad_cu_seqlens(seqlens, 1)
    x = torch.randn(int(cup[-1]), HIDDEN, dtype=torch.float64)
    got = ours(x, cu, cup)
    for length, start in zip(seqlens, cup[:-1].tolist()):
        if length == 0:
            continue
        freqs = torch.arange(length, dtype=torch.float64)[None, :, None] * inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)
        causal = torch.full((length, length), float("-inf"), dtype=torch.float64).triu(1)[None, None]
        want, _ = theirs(x[None, start : start + length], (emb.cos(), emb.sin()), attention_mask=causal)
        assert rel_error(got[start : start + length], want[0]) < 1e-6, f"sequence of {length}"


# --- spawned: the collective, the reorder and their gradients ------------------------------------------


def _op_rank(rank, world):
    group = dist.group.WORLD
    for i, (seqlens, heads, d, causal, window) in enumerate(CASES):
        cu, cup, q, k, v, dout = _global_case(seqlens, heads, d, world, seed=i)
        want = [shard_thd(t, cup, world, rank) for t in _reference(q, k, v, dout, cu, cup, causal, window)]
        q_cp, k_cp, v_cp, dout_cp = (shard_thd(t, cup, world, rank) for t in (q, k, v, dout))
        got = _cp_run(ag_thd_attention, q_cp, k_cp, v_cp, dout_cp, cu, cup, causal, window, group=group)
        _assert_close(got, want, TOL, f"W={world} rank {rank} case {i}")
        two = _cp_run(ag_thd_attention, q_cp, k_cp, v_cp, dout_cp, cu, cup, causal, window, group=group, launches=2)
        _assert_close(two, got, TOL, f"launches=2 W={world} rank {rank} case {i}")
        if heads[1] % 2 == 0:  # the KV heads in two groups, one all-gather each; both forms
            for launches in (1, 2):
                split = _cp_run(ag_thd_attention, q_cp, k_cp, v_cp, dout_cp, cu, cup, causal, window, group=group,
                                launches=launches, head_groups=2)  # fmt: skip
                _assert_close(split, got, TOL, f"head_groups=2 launches={launches} W={world} rank {rank} case {i}")

    group_name, _ = custom_ops.resolve_group(group)
    rank_t = torch.ops.cp_ops.group_rank_tensor(torch.zeros(3, dtype=torch.int32), group_name)
    assert rank_t.dtype == torch.int64 and rank_t.shape == () and int(rank_t) == rank
    torch.library.opcheck(torch.ops.cp_ops.group_rank_tensor.default, (torch.zeros(3), group_name))
    # W is an argument of the op (compiled graphs are keyed on it); it must be the group's size
    seqlens, heads, d, causal, window = CASES[0]
    cu, cup, q, k, v, _ = _global_case(seqlens, heads, d, world, seed=0)
    q_cp, k_cp, v_cp = (shard_thd(t, cup, world, rank) for t in (q, k, v))
    with pytest.raises(ValueError, match=f"cp_size = {world + 1} but the process group"):
        torch.ops.cp_ops.ag_thd_attention(q_cp, k_cp, v_cp, cu, cup, causal, -1, -1, None, group_name, world + 1)

    if world == 2:  # a 1-D DeviceMesh is accepted as the group
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,))
        seqlens, heads, d, causal, window = CASES[0]
        cu, cup, q, k, v, dout = _global_case(seqlens, heads, d, world, seed=0)
        q_cp, k_cp, v_cp, dout_cp = (shard_thd(t, cup, world, rank) for t in (q, k, v, dout))
        want = _cp_run(ag_thd_attention, q_cp, k_cp, v_cp, dout_cp, cu, cup, causal, window, group=group)
        _assert_close(_cp_run(ag_thd_attention, q_cp, k_cp, v_cp, dout_cp, cu, cup, causal, window, group=mesh),
                      want, TOL, "DeviceMesh")  # fmt: skip

    if world in (2, 3):
        _layer_rank(rank, world, group, compiled=False)


def _compiled_rank(rank, world):
    group = dist.group.WORLD
    _compiled_op_rank(rank, world, group)
    _pipelined_rank(rank, world, group)
    _layer_rank(rank, world, group, compiled=True)


def _compiled_op_rank(rank, world, group):
    """fullgraph, dynamic shapes: two packings of different T and B, one graph, fwd and bwd."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    # aot_eager: dynamo and AOT autograd (what fullgraph and dynamic shapes are about); the layer
    # test below compiles the same op with Inductor
    counter = CompileCounterWithBackend("aot_eager")

    def step(q, k, v, cu, cup):
        return ag_thd_attention(q * 2, k, v, cu, cup, causal=True, window=(7, -1), group=group).sin()

    compiled = torch.compile(step, backend=counter, fullgraph=True, dynamic=True)
    # row counts, B+1 and head counts all differ (duck sizing would tie equal sizes)
    for i, seqlens in enumerate(([9, 0, 1, 23, 6], [31, 2, 0, 5, 1, 17])):
        cu, cup, q, k, v, dout = _global_case(seqlens, (4, 2), 8, world, seed=10 + i)
        q_cp, k_cp, v_cp, dout_cp = (shard_thd(t, cup, world, rank) for t in (q, k, v, dout))
        got = _cp_run(lambda *a, **kw: compiled(*a[:5]), q_cp, k_cp, v_cp, dout_cp, cu, cup, True, (7, -1))
        want = _cp_run(lambda *a, **kw: step(*a[:5]), q_cp, k_cp, v_cp, dout_cp, cu, cup, True, (7, -1))
        _assert_close(got, want, TOL, f"compiled rank {rank} layout {i}")
    assert counter.frame_count == 1

    # Compile caches key a graph on what dynamo sees, the same on every rank; so the graphs
    # handed to the compiler must be the same on every rank too (the rank is read at run time).
    codes = _aot_graph_codes(step, q_cp, k_cp, v_cp, dout_cp, cu, cup)
    everyone = [None] * world
    dist.all_gather_object(everyone, codes)
    assert len(codes) == 2 and all(c == codes for c in everyone), "the compiled graphs differ between ranks"


def _pipelined_rank(rank, world, group):
    """head_groups = 2 under Inductor with cp_ops.COMPILE_OPTIONS on gloo: the first group's
    attention runs while the second all-gather is in flight, the second gather issued only after
    the first one's wait (on the CPU the scheduling pass keeps one functional all-gather in flight,
    cp_ops.scheduling._serial_on_cpu; on CUDA both are issued first, test_comm.py); backward, the
    second group's gradients are computed while the first group's reduce-scatter is in flight.
    Values and gradients as the eager op with one group."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    seqlens, heads, d, causal, window = CASES[0]
    cu, cup, q, k, v, dout = _global_case(seqlens, heads, d, world, seed=0)
    local = [shard_thd(t, cup, world, rank) for t in (q, k, v, dout)]
    want = _cp_run(ag_thd_attention, *local, cu, cup, causal, window, group=group)

    def op(q_, k_, v_, cu_, cup_, causal, window):
        return ag_thd_attention(q_, k_, v_, cu_, cup_, causal=causal, window=window, group=group, head_groups=2)

    compiled = torch.compile(op, fullgraph=True, options=cp_ops.COMPILE_OPTIONS)
    got, codes = run_and_get_code(lambda: _cp_run(compiled, *local, cu, cup, causal, window))
    _assert_close(got, want, TOL, f"compiled head_groups=2 rank {rank}")
    forward, backward = codes
    # attention: the reference's GEMMs (bmm), or the opaque segment-attention op
    attention = re.compile(r"bmm\(|varlen_attention")
    first, second = collective_windows(forward, "all_gather_into_tensor")
    issues = re.findall(r"= torch\.ops\._c10d_functional\.all_gather_into_tensor\.default\(", first)
    assert len(issues) == 1, "a second all-gather issued while the first is in flight on the CPU"
    assert attention.search(second), "no attention while the second all-gather is in flight"
    first, second = collective_windows(backward, "reduce_scatter_tensor")
    assert attention.search(first), "no gradient computed while the first reduce-scatter is in flight"


def _aot_graph_codes(step, q, k, v, dout, cu, cup):
    """The Python code of the forward and backward graphs AOT autograd passes to the compiler."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    codes = []

    def keep(gm, _):
        codes.append(gm.code)
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    compiled = torch.compile(step, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep), fullgraph=True)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    compiled(q, k, v, cu, cup).backward(dout)
    return codes


def _layer_rank(rank, world, group, compiled):
    """CP layer vs the same layer on one rank: outputs, input grads, parameter grads summed over ranks."""
    configs = (((4, 2), {"partial_rotary_factor": 0.25}),
               ((3, 3), {"gated": False, "qk_norm": False, "causal": False, "window": (3, 2)}))  # fmt: skip
    for heads, kwargs in configs:
        if compiled and heads != (4, 2):
            continue  # one compiled configuration keeps the compile time down
        if compiled:  # compiled as recommended, the K/V exchange in two pipelined pieces
            kwargs = {**kwargs, "head_groups": 2}
        layer = _layer(heads, **kwargs)
        cu, cup = pad_cu_seqlens([9, 0, 1, 23, 6], world)
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(int(cup[-1]), HIDDEN, dtype=torch.float64, generator=gen)
        grad_out = torch.randn(x.shape, dtype=torch.float64, generator=gen)

        x_ref = x.clone().requires_grad_()
        out_ref = layer(x_ref, cu, cup)
        out_ref.backward(grad_out)
        ref_grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
        layer.zero_grad()

        x_cp = shard_thd(x, cup, world, rank).requires_grad_()
        fn = torch.compile(layer, fullgraph=True, options=cp_ops.COMPILE_OPTIONS) if compiled else layer
        out_cp = fn(x_cp, cu, cup, group=group)
        out_cp.backward(shard_thd(grad_out, cup, world, rank))

        what = f"layer W={world} rank {rank} {kwargs} compiled={compiled}"
        assert rel_error(out_cp, shard_thd(out_ref, cup, world, rank)) < 1e-7, what
        assert rel_error(x_cp.grad, shard_thd(x_ref.grad, cup, world, rank)) < 1e-7, what
        for name, p in layer.named_parameters():
            dist.all_reduce(p.grad)
            assert rel_error(p.grad, ref_grads[name]) < 1e-7, f"{what}: {name}"


@pytest.mark.dist
@pytest.mark.parametrize("world", [1, 2, 3, pytest.param(4, marks=pytest.mark.slow)])  # W = 8: test_eight_ranks.py
def test_ag_attention_matches_global(world):
    """Every case on W gloo ranks, launches 1 and 2 (and the layer at W = 2 and 3, a DeviceMesh
    as the group at W = 2)."""
    run_ranks(world, _op_rank)


# The fast tier compiles the op with Inductor on one rank (test_op_contracts.py) and the layer at
# W = 2 inside the whole model through AOTAutograd (test_transformers.py).
@pytest.mark.slow
@pytest.mark.dist
def test_ag_attention_matches_global_compiled_w2():
    """W = 2: the op and the layer under torch.compile(fullgraph=True) (the eager cases: the test
    above, which test-opaque, selecting compiled tests, does not run again)."""
    run_ranks(2, _compiled_rank)


def test_random_layouts_through_the_op_in_process():
    """A few random packings at W = 1 through the op (fast; the spawned tests use fixed ones)."""
    gen = torch.Generator().manual_seed(3)
    for i in range(4):
        seqlens = random_seqlens(4, 20, gen)
        cu, cup, q, k, v, dout = _global_case(seqlens, (2, 1), 4, 1, seed=20 + i)
        got = _cp_run(ag_thd_attention, q, k, v, dout, cu, cup, True, (-1, -1))
        _assert_close(got, _reference(q, k, v, dout, cu, cup, True, (-1, -1)), TOL, f"seqlens {seqlens}")


def test_layer_errors_name_the_users_input():
    layer = cp_ops.Attention(32, 4, 2, 8)
    cu, cup = cp_ops.pad_cu_seqlens([5, 7], 1)
    with pytest.raises(ValueError, match="x must be \\[T/W, hidden\\] = \\[T/W, 32\\], got shape \\(1, 14, 32\\); packed"):
        layer(torch.randn(1, 14, 32), cu, cup)
    with pytest.raises(ValueError, match="x must be \\[T/W, 32\\] \\(hidden_size\\), got shape \\(14, 48\\)"):
        layer(torch.randn(14, 48), cu, cup)
    with pytest.raises(ValueError, match="cu_seqlens has 2 entries and cu_seqlens_padded 3"):
        layer(torch.randn(14, 32), cu[:2], cup)
    with pytest.raises(TypeError, match="cu_seqlens must be int32 or int64"):
        layer(torch.randn(14, 32), cu.float(), cup)
