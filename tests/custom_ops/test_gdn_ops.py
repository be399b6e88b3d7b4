"""causal_conv1d / chunk_gated_delta_rule: reference, opcheck, gradients, compile, kernel paths."""

import contextlib
import importlib.util
import itertools

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

import custom_ops
from custom_ops.conv1d.reference import (
    causal_conv1d_loop,
    causal_conv1d_reference,
    causal_conv1d_reference_backward,
)
from custom_ops.gated_delta_rule import backends
from custom_ops.gated_delta_rule import op as gdn_op
from custom_ops.fla.adapter import fla_varlen_indices
from custom_ops.gated_delta_rule.reference import (
    chunk_gated_delta_rule_loop,
    chunk_gated_delta_rule_reference,
    chunk_gated_delta_rule_reference_backward,
    chunk_gated_delta_rule_with_state_loop,
    chunk_gated_delta_rule_with_state_reference,
    chunk_gated_delta_rule_with_state_reference_backward,
)
from custom_ops.testing import (
    TOLERANCE,
    first_autotune_config,
    gdn_layouts,
    poisoned_allocations,
    random_tensor,
    rel_error,
)

# GPU tests of FLA's kernels: skipped where fla-core is not installed, as on a bare GPU image
needs_fla = pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="needs fla-core")


@pytest.fixture(params=["fla", "flashqla"])
def cuda_backend(request):
    """Each CUDA backend of the delta rule in turn (FlashQLA skipped where it cannot run), with
    compiled graphs dropped before and after, since a graph keeps the backend it was traced with."""
    if request.param == "flashqla":
        probe = torch.empty(0, 1, 128, device="cuda", dtype=torch.bfloat16)
        reason = backends.flash_qla_unfit(probe, probe)
        if reason is not None:
            pytest.skip(reason)
    torch._dynamo.reset()
    backends.set_backend(request.param)
    yield request.param
    backends.set_backend(None)
    torch._dynamo.reset()


def _cu(seqlens, dtype=torch.int32, device="cpu"):
    return torch.tensor([0] + list(itertools.accumulate(seqlens)), dtype=dtype, device=device)


def _conv_case(seqlens, channels, kernel, dtype, bias=True, device="cpu"):
    cu = _cu(seqlens, device=device)
    x = random_tensor((int(cu[-1]), channels), dtype, device)
    weight = random_tensor((channels, kernel), dtype, device) / kernel**0.5
    b = random_tensor((channels,), dtype, device) if bias else None
    return x, weight, b, cu


def _conv1d_per_sequence(x, weight, bias, cu_seqlens, activation):
    """The float64 oracle that shares no code with the op, its reference or its loop: torch's
    depthwise ``F.conv1d`` (cross-correlation, K-1 zeros padded on the left) on each sequence
    alone, cut to the sequence's length."""
    x64, channels, taps = x.double(), weight.shape[0], weight.shape[1]
    out = torch.zeros_like(x64)
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end == start:
            continue
        seq = x64[start:end].t()[None]  # [1, C, L]
        b64 = None if bias is None else bias.double()
        y = F.conv1d(seq, weight.double()[:, None, :], b64, padding=taps - 1, groups=channels)[0, :, : end - start]
        out[start:end] = F.silu(y.t()) if activation in ("silu", "swish") else y.t()
    return out


def _gdn_case(seqlens, hk, group, dk, dv, dtype, device="cpu"):
    """Inputs in the ranges the layer produces: unit-norm keys, beta in (0, 1), decays in (0, 1)."""
    cu = _cu(seqlens, device=device)
    t, hv = int(cu[-1]), hk * group
    gate_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    q = random_tensor((t, hk, dk), dtype, device)
    k = F.normalize(random_tensor((t, hk, dk), torch.float32, device), dim=-1).to(dtype)
    v = random_tensor((t, hv, dv), dtype, device)
    g = F.logsigmoid(random_tensor((t, hv), gate_dtype, device) + 2.0)
    beta = torch.sigmoid(random_tensor((t, hv), gate_dtype, device))
    return q, k, v, g, beta, cu


def _states(num_seqs, hv, dk, dv, dtype, device="cpu"):
    """Per-sequence states of unit scale in the state dtype (float64 for float64 inputs)."""
    return random_tensor((num_seqs, hv, dk, dv), torch.float64 if dtype == torch.float64 else torch.float32, device)


def _split(seqlens, cuts):
    """Rows of the heads (the first ``cuts[i]`` rows of sequence i) and of the tails (the rest),
    each packed in sequence order, with their ``cu_seqlens``."""
    cu = _cu(seqlens).tolist()
    heads = [r for i, c in enumerate(cuts) for r in range(cu[i], cu[i] + c)]
    tails = [r for i, c in enumerate(cuts) for r in range(cu[i] + c, cu[i + 1])]
    return (
        torch.tensor(heads, dtype=torch.int64), _cu(cuts),
        torch.tensor(tails, dtype=torch.int64), _cu([n - c for n, c in zip(seqlens, cuts)]),
    )  # fmt: skip


# --- agreement with the definitions -----------------------------------------------------------


@given(
    gdn_layouts(),
    st.sampled_from([1, 3, 8]),
    st.sampled_from([1, 2, 4]),
    st.booleans(),
    st.sampled_from(["silu", None, "identity"]),
)
def test_conv_matches_conv1d_per_sequence(seqlens, channels, kernel, bias, activation):
    """The op (on the CPU: its reference) and the loop oracle against F.conv1d per sequence."""
    x, w, b, cu = _conv_case(seqlens, channels, kernel, torch.float64, bias)
    expected = _conv1d_per_sequence(x, w, b, cu, activation)
    assert rel_error(custom_ops.causal_conv1d(x, w, b, cu, activation), expected) < TOLERANCE[torch.float64]
    assert rel_error(causal_conv1d_loop(x, w, b, cu, activation), expected) < TOLERANCE[torch.float64]
    # the float32 path computes in float32
    y32 = custom_ops.causal_conv1d(x.float(), w.float(), None if b is None else b.float(), cu, activation)
    assert y32.dtype == torch.float32
    assert rel_error(y32, expected) < TOLERANCE[torch.float32]


@given(
    gdn_layouts(),
    st.sampled_from([(1, 1), (2, 1), (1, 2), (2, 2)]),
    st.sampled_from([(3, 2), (8, 5)]),
    st.sampled_from([None, 0.3]),
)
def test_delta_rule_matches_loop(seqlens, heads, dims, scale):
    (hk, group), (dk, dv) = heads, dims
    q, k, v, g, beta, cu = _gdn_case(seqlens, hk, group, dk, dv, torch.float64)
    expected = chunk_gated_delta_rule_loop(q, k, v, g, beta, cu, scale)
    out = custom_ops.chunk_gated_delta_rule(q, k, v, g, beta, cu, scale)
    assert out.shape == v.shape
    assert rel_error(out, expected) < TOLERANCE[torch.float64]
    assert rel_error(chunk_gated_delta_rule_reference(q, k, v, g, beta, cu, scale), expected) < TOLERANCE[torch.float64]


@given(gdn_layouts(), st.sampled_from([(1, 1), (1, 2), (2, 2)]), st.sampled_from([(3, 2), (8, 5)]), st.booleans())
def test_delta_rule_with_state_matches_loop(seqlens, heads, dims, given_state):
    """Outputs and final states from given (or zero) initial states against the float64 loop."""
    (hk, group), (dk, dv) = heads, dims
    q, k, v, g, beta, cu = _gdn_case(seqlens, hk, group, dk, dv, torch.float64)
    h0 = _states(len(seqlens), hk * group, dk, dv, torch.float64) if given_state else None
    o_e, final_e = chunk_gated_delta_rule_with_state_loop(q, k, v, g, beta, cu, 0.4, h0)
    for fn in (custom_ops.chunk_gated_delta_rule_with_state, chunk_gated_delta_rule_with_state_reference):
        o, final = fn(q, k, v, g, beta, cu, 0.4, h0)
        assert o.shape == v.shape and final.shape == (len(seqlens), hk * group, dk, dv)
        assert final.dtype == torch.float64
        assert rel_error(o, o_e) < TOLERANCE[torch.float64]
        assert rel_error(final, final_e) < TOLERANCE[torch.float64]
    # a zero-length sequence passes its initial state through
    for i, n in enumerate(seqlens):
        if n == 0:
            assert torch.equal(final[i], torch.zeros_like(final[i]) if h0 is None else h0[i])
    # float32 inputs: float32 states, computed in float32
    o32, final32 = custom_ops.chunk_gated_delta_rule_with_state(
        *(t.float() for t in (q, k, v, g, beta)), cu, 0.4, None if h0 is None else h0.float()
    )
    assert o32.dtype == final32.dtype == torch.float32
    assert rel_error(o32, o_e) < TOLERANCE[torch.float32] and rel_error(final32, final_e) < TOLERANCE[torch.float32]


@given(gdn_layouts(max_seqs=5, max_len=12), st.sampled_from([(1, 1), (2, 2)]), st.data())
def test_chained_pieces_equal_the_whole(seqlens, heads, data):
    """The property a state-passing CP mode rests on: every sequence cut at any point into a
    head and a tail (either may be empty), the heads packed and run from the initial states,
    the tails packed and run from the heads' final states, give the whole sequences' outputs
    and final states, and the same gradients of a loss over both, initial states included
    (float64: to rounding)."""
    hk, group = heads
    cuts = [data.draw(st.integers(0, n)) for n in seqlens]
    q, k, v, g, beta, cu = _gdn_case(seqlens, hk, group, 4, 3, torch.float64)
    h0 = _states(len(seqlens), hk * group, 4, 3, torch.float64)
    w_o, w_final = random_tensor(v.shape, torch.float64), random_tensor(h0.shape, torch.float64)
    heads_rows, cu_heads, tails_rows, cu_tails = _split(seqlens, cuts)

    def whole(q, k, v, g, beta, h0):
        return custom_ops.chunk_gated_delta_rule_with_state(q, k, v, g, beta, cu, None, h0)

    def chained(q, k, v, g, beta, h0):
        o_heads, mid = custom_ops.chunk_gated_delta_rule_with_state(
            *(t[heads_rows] for t in (q, k, v, g, beta)), cu_heads, None, h0
        )
        o_tails, final = custom_ops.chunk_gated_delta_rule_with_state(
            *(t[tails_rows] for t in (q, k, v, g, beta)), cu_tails, None, mid
        )
        o = torch.zeros_like(v).index_copy(0, heads_rows, o_heads).index_copy(0, tails_rows, o_tails)
        return o, final

    runs = []
    for fn in (whole, chained):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, g, beta, h0)]
        o, final = fn(*leaves)
        loss = (o * w_o).sum() + (final * w_final).sum()
        runs.append([o, final, *torch.autograd.grad(loss, leaves, allow_unused=True, materialize_grads=True)])
    names = ("o", "final", "dq", "dk", "dv", "dg", "dbeta", "dh0")
    for name, a, e in zip(names, *runs):
        assert rel_error(a, e) < TOLERANCE[torch.float64], name


def test_no_initial_state_is_a_zero_state():
    q, k, v, g, beta, cu = _gdn_case([6, 0, 1, 9], 1, 2, 4, 3, torch.float64)
    o_none, final_none = custom_ops.chunk_gated_delta_rule_with_state(q, k, v, g, beta, cu)
    zero = torch.zeros_like(final_none)
    o_zero, final_zero = custom_ops.chunk_gated_delta_rule_with_state(q, k, v, g, beta, cu, None, zero)
    assert torch.equal(o_none, o_zero) and torch.equal(final_none, final_zero)
    assert torch.equal(o_none, custom_ops.chunk_gated_delta_rule(q, k, v, g, beta, cu))
    assert torch.equal(o_none, chunk_gated_delta_rule_reference(q, k, v, g, beta, cu))


def test_delta_rule_convention_is_flas():
    """The loop oracle equals FLA's own naive recurrence (float32) sequence by sequence, GVA
    spelled out there by repeating key heads: the CUDA path computes the same function."""
    from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule

    seqlens = [9, 1, 14]
    q, k, v, g, beta, cu = _gdn_case(seqlens, 2, 2, 8, 5, torch.float32)
    ours = chunk_gated_delta_rule_loop(q, k, v, g, beta, cu)
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        rep = lambda t: t[None, s:e].repeat_interleave(2, dim=2)  # noqa: E731
        theirs, _ = naive_recurrent_gated_delta_rule(rep(q), rep(k), v[None, s:e], beta[None, s:e], g[None, s:e])
        assert rel_error(theirs[0], ours[s:e]) < TOLERANCE[torch.float32]


def test_state_convention_is_flas():
    """With initial states, the loop oracle's outputs and final states (``[Hv, dk, dv]`` per
    sequence) equal FLA's naive recurrence's, the layout FLA's kernels take and give."""
    from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule

    seqlens = [9, 0, 1, 14]
    q, k, v, g, beta, cu = _gdn_case(seqlens, 2, 2, 8, 5, torch.float32)
    h0 = _states(len(seqlens), 4, 8, 5, torch.float32)
    ours, final = chunk_gated_delta_rule_with_state_loop(q, k, v, g, beta, cu, None, h0)
    for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        rep = lambda t: t[None, s:e].repeat_interleave(2, dim=2)  # noqa: E731
        theirs, theirs_final = naive_recurrent_gated_delta_rule(
            rep(q), rep(k), v[None, s:e], beta[None, s:e], g[None, s:e],
            initial_state=h0[i : i + 1], output_final_state=True,
        )  # fmt: skip
        assert rel_error(theirs[0], ours[s:e]) < TOLERANCE[torch.float32]
        assert rel_error(theirs_final[0], final[i]) < TOLERANCE[torch.float32]


def test_packing_is_per_sequence():
    # each sequence alone gives the rows it gets packed: the state and the conv history reset
    seqlens = [7, 0, 1, 11]
    q, k, v, g, beta, cu = _gdn_case(seqlens, 1, 2, 4, 3, torch.float64)
    x, w, b, _ = _conv_case(seqlens, 5, 4, torch.float64)
    o = custom_ops.chunk_gated_delta_rule(q, k, v, g, beta, cu)
    y = custom_ops.causal_conv1d(x, w, b, cu)
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        one = torch.tensor([0, e - s], dtype=torch.int32)
        alone = custom_ops.chunk_gated_delta_rule(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], one)
        assert rel_error(o[s:e], alone) < TOLERANCE[torch.float64]
        assert rel_error(y[s:e], custom_ops.causal_conv1d(x[s:e], w, b, one)) < TOLERANCE[torch.float64]


def test_torch_ops_namespace_is_the_same_op():
    q, k, v, g, beta, cu = _gdn_case([5, 3], 1, 2, 4, 3, torch.float32)
    assert torch.equal(
        torch.ops.cp_ops.chunk_gated_delta_rule(q, k, v, g, beta, cu), custom_ops.chunk_gated_delta_rule(q, k, v, g, beta, cu)
    )
    x, w, b, cu = _conv_case([5, 3], 4, 4, torch.float32)
    assert torch.equal(torch.ops.cp_ops.causal_conv1d(x, w, b, cu), custom_ops.causal_conv1d(x, w, b, cu))


def test_fla_chunk_indices_are_flas_plus_empty_tail():
    """The sync-free chunk indices: FLA's own rows first, then rows of the appended empty sequence."""
    from fla.ops.utils.index import prepare_chunk_indices

    for seqlens in ([0], [1], [64], [65, 0, 3], [130, 1, 0, 64, 63], [0, 0, 200]):
        cu = _cu(seqlens)
        t = int(cu[-1])
        cu_ext, idx = fla_varlen_indices(cu, t)
        theirs = prepare_chunk_indices(cu, 64)
        assert idx.shape == (t // 64 + len(seqlens), 2) and idx.dtype == cu.dtype
        assert torch.equal(cu_ext, torch.cat([cu, cu[-1:]]))
        assert torch.equal(idx[: theirs.shape[0]], theirs)
        assert (idx[theirs.shape[0] :] == torch.tensor([len(seqlens), 0], dtype=cu.dtype)).all()


def test_fla_calls_keep_nothing_alive():
    """Inside a call into FLA its tensor cache is off (and restored after): a ``cu_seqlens`` built
    for the call, and what FLA derives from it, die with the call (CUDA graphs refuse pool memory
    that outlives a graph's outputs)."""
    import weakref

    import fla.utils
    from fla.ops.utils.index import prepare_chunk_offsets

    from custom_ops.fla.adapter import fla_call

    before = fla.utils.FLA_DISABLE_TENSOR_CACHE
    for uncached in (False, True):
        cu = _cu([5, 0, 70])
        with fla_call(cu.device) if uncached else contextlib.nullcontext():
            offsets = prepare_chunk_offsets(cu, 64)
        assert offsets.tolist() == [0, 1, 1, 3]
        alive = weakref.ref(cu)
        del cu, offsets
        assert (alive() is None) == uncached  # FLA's own cache keeps its key alive
        assert fla.utils.FLA_DISABLE_TENSOR_CACHE == before


# --- opcheck ----------------------------------------------------------------------------------


def _conv_samples():
    x, w, b, cu = _conv_case([7, 0, 1, 12], 6, 4, torch.float32)
    yield x, w, b, cu, "silu"
    yield x.double(), w.double(), None, cu.long(), None
    yield x[:0], w, b, torch.zeros(1, dtype=torch.int32), "silu"  # T = 0, B = 0
    wide = random_tensor((x.shape[0], 15), torch.float32)
    yield wide[:, 3:9], w, b, cu, "identity"  # a column slice, as the layer passes it
    yield x.clone().requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_(), cu, "silu"


def _gdn_samples():
    q, k, v, g, beta, cu = _gdn_case([6, 0, 1, 9], 1, 2, 4, 3, torch.float32)
    yield q, k, v, g, beta, cu, None
    yield q.double(), k.double(), v.double(), g.double(), beta.double(), cu.long(), 0.5
    yield q[:0], k[:0], v[:0], g[:0], beta[:0], torch.zeros(1, dtype=torch.int32), None
    yield tuple(t.clone().requires_grad_() for t in (q, k, v, g, beta)) + (cu, None)


def test_opcheck_causal_conv1d():
    for args in _conv_samples():
        torch.library.opcheck(custom_ops.causal_conv1d, args)
    x, w, b, cu = _conv_case([5, 4], 3, 4, torch.float32)
    torch.library.opcheck(torch.ops.cp_ops.causal_conv1d_backward.default, (torch.randn_like(x), x, w, b, cu, "silu"))


def _flat_fla_indices(cu, num_rows):
    """What the GDN forward op returns for its backward: FLA's cu_seqlens and flat chunk indices."""
    fla_cu, chunk_indices = fla_varlen_indices(cu, num_rows)
    return fla_cu, chunk_indices.view(-1)


def test_opcheck_chunk_gated_delta_rule():
    for args in _gdn_samples():
        *tensors, scale = args
        torch.library.opcheck(torch.ops.cp_ops.chunk_gated_delta_rule.default, (*tensors, scale))
        torch.library.opcheck(torch.ops.cp_ops.chunk_gated_delta_rule_forward.default, (*tensors, scale))
    q, k, v, g, beta, cu = _gdn_case([5, 4], 1, 2, 4, 3, torch.float32)
    aux = q.new_empty(0)
    torch.library.opcheck(
        torch.ops.cp_ops.chunk_gated_delta_rule_backward.default,
        (torch.randn_like(v), q, k, v, g, beta, cu, *_flat_fla_indices(cu, q.shape[0]), aux.float(), aux, None),
    )


def test_opcheck_chunk_gated_delta_rule_with_state():
    """The public stateful op, and the forward and backward ops with a state in or out."""
    for *tensors, scale in _gdn_samples():
        q, v, cu = tensors[0], tensors[2], tensors[5]
        h0 = _states(cu.shape[0] - 1, v.shape[1], q.shape[2], v.shape[2], q.dtype).requires_grad_(q.requires_grad)
        for state in (None, h0):
            torch.library.opcheck(torch.ops.cp_ops.chunk_gated_delta_rule_with_state.default, (*tensors, scale, state))
            torch.library.opcheck(
                torch.ops.cp_ops.chunk_gated_delta_rule_forward.default, (*tensors, scale, state, True)
            )
    q, k, v, g, beta, cu = _gdn_case([5, 0, 4], 1, 2, 4, 3, torch.float32)
    h0, dht = _states(3, 2, 4, 3, torch.float32), _states(3, 2, 4, 3, torch.float32)
    aux = q.new_empty(0)
    for state, grad_final in ((h0, dht), (None, dht), (h0, None)):
        torch.library.opcheck(
            torch.ops.cp_ops.chunk_gated_delta_rule_backward.default,
            (torch.randn_like(v), q, k, v, g, beta, cu, *_flat_fla_indices(cu, q.shape[0]), aux.float(), aux, None,
             state, grad_final),
        )  # fmt: skip


def test_gdn_forward_returns_the_fla_indices_and_backward_refuses_others():
    q, k, v, g, beta, cu = _gdn_case([5, 4], 1, 2, 4, 3, torch.float32)
    *_, fla_cu, chunk_indices = torch.ops.cp_ops.chunk_gated_delta_rule_forward(q, k, v, g, beta, cu)
    expected = fla_varlen_indices(cu, q.shape[0])
    assert torch.equal(fla_cu, expected[0]) and torch.equal(chunk_indices, expected[1].view(-1))
    other = fla_varlen_indices(cu[:2], q.shape[0])
    aux = q.new_empty(0)
    with pytest.raises(ValueError, match="fla_varlen_indices"):
        torch.ops.cp_ops.chunk_gated_delta_rule_backward(
            torch.randn_like(v), q, k, v, g, beta, cu, other[0], other[1].view(-1), aux.float(), aux
        )


# --- gradients --------------------------------------------------------------------------------


@pytest.mark.parametrize("seqlens", [[3, 0, 2], [1, 4]])
def test_gradcheck_conv(seqlens):
    x, w, b, cu = _conv_case(seqlens, 3, 3, torch.float64)
    for activation in ("silu", None):
        for fn in (custom_ops.causal_conv1d, causal_conv1d_reference):
            args = tuple(t.clone().requires_grad_() for t in (x, w, b))
            assert torch.autograd.gradcheck(lambda x, w, b, fn=fn: fn(x, w, b, cu, activation), args)
        assert torch.autograd.gradcheck(
            lambda x, w: custom_ops.causal_conv1d(x, w, None, cu, activation), (x.clone().requires_grad_(), w.clone().requires_grad_())
        )


@pytest.mark.parametrize("seqlens,group", [([3, 0, 2], 2), ([1, 4], 1)])
def test_gradcheck_delta_rule(seqlens, group):
    q, k, v, g, beta, cu = _gdn_case(seqlens, 1, group, 3, 2, torch.float64)
    for fn in (custom_ops.chunk_gated_delta_rule, chunk_gated_delta_rule_reference):
        args = tuple(t.clone().requires_grad_() for t in (q, k, v, g, beta))
        assert torch.autograd.gradcheck(lambda *a, fn=fn: fn(*a, cu, 0.6), args)


@pytest.mark.parametrize("seqlens,group", [([3, 0, 2], 2), ([1, 4], 1)])
def test_gradcheck_delta_rule_with_state(seqlens, group):
    """Gradients to the inputs and the initial states, from the outputs and the final states."""
    q, k, v, g, beta, cu = _gdn_case(seqlens, 1, group, 3, 2, torch.float64)
    h0 = _states(len(seqlens), group, 3, 2, torch.float64)
    for fn in (custom_ops.chunk_gated_delta_rule_with_state, chunk_gated_delta_rule_with_state_reference):
        args = tuple(t.clone().requires_grad_() for t in (q, k, v, g, beta, h0))
        assert torch.autograd.gradcheck(lambda *a, fn=fn: fn(*a[:5], cu, 0.6, a[5]), args)
    # no initial state: the final state's gradient still reaches the inputs
    args = tuple(t.clone().requires_grad_() for t in (q, k, v, g, beta))
    assert torch.autograd.gradcheck(lambda *a: custom_ops.chunk_gated_delta_rule_with_state(*a, cu)[1], args)


@given(gdn_layouts(max_seqs=3, max_len=10), st.sampled_from([(1, 2), (2, 1)]), st.booleans())
def test_state_backward_matches_autograd_of_reference(seqlens, heads, given_state):
    """The reverse scan with states (the op's CPU backward) equals autograd through the reference."""
    hk, group = heads
    q, k, v, g, beta, cu = _gdn_case(seqlens, hk, group, 4, 3, torch.float64)
    h0 = _states(len(seqlens), hk * group, 4, 3, torch.float64) if given_state else None
    leaves = [t.clone().requires_grad_() for t in (q, k, v, g, beta) + ((h0,) if given_state else ())]
    o, final = chunk_gated_delta_rule_with_state_reference(*leaves[:5], cu, None, *leaves[5:])
    grad_o, grad_final = torch.randn_like(o), torch.randn_like(final)
    # with no initial state and no rows the final state is a constant zero
    outputs, grads = zip(*[(t, d) for t, d in ((o, grad_o), (final, grad_final)) if t.requires_grad])
    expected = torch.autograd.grad(outputs, leaves, grads, allow_unused=True, materialize_grads=True)
    got = chunk_gated_delta_rule_with_state_reference_backward(grad_o, grad_final, q, k, v, g, beta, cu, None, h0)
    assert len(got) == 6 and (given_state or got[5].numel() == 0)
    for a, e in zip(got, expected):
        assert rel_error(a, e) < TOLERANCE[torch.float64]


@given(gdn_layouts(max_seqs=3, max_len=10), st.sampled_from([(1, 2), (2, 1)]))
def test_backward_matches_autograd_of_reference(seqlens, heads):
    """The hand-written reverse passes (the ops' CPU backward) equal autograd through the references."""
    hk, group = heads
    q, k, v, g, beta, cu = _gdn_case(seqlens, hk, group, 4, 3, torch.float64)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, g, beta)]
    o = chunk_gated_delta_rule_reference(*leaves, cu)
    grad_o = torch.randn_like(o)
    expected = torch.autograd.grad(o, leaves, grad_o, allow_unused=True, materialize_grads=True)
    got = chunk_gated_delta_rule_reference_backward(grad_o, q, k, v, g, beta, cu)
    for a, e in zip(got, expected):
        assert rel_error(a, e) < TOLERANCE[torch.float64]

    x, w, b, _ = _conv_case(seqlens, 3, 4, torch.float64)
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    y = causal_conv1d_reference(*leaves, cu)
    grad_y = torch.randn_like(y)
    expected = torch.autograd.grad(y, leaves, grad_y, allow_unused=True, materialize_grads=True)
    for a, e in zip(causal_conv1d_reference_backward(grad_y, x, w, b, cu), expected):
        assert rel_error(a, e) < TOLERANCE[torch.float64]


# --- compile ----------------------------------------------------------------------------------


def test_compiled_fullgraph_forward_backward():
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")

    def core(x, w, b, q, k, v, g, beta, cu):
        y = torch.ops.cp_ops.causal_conv1d(x, w, b, cu, "silu")
        o = torch.ops.cp_ops.chunk_gated_delta_rule(q * y[:, :1, None], k, v, g, beta, cu, None)
        return o.square().sum() + y.sum()

    compiled = torch.compile(core, backend=counter, fullgraph=True, dynamic=True)
    # no row count or len(cu_seqlens) equals a feature dim: duck sizing would tie them
    for seqlens in ([5, 9, 2, 0, 7, 1, 3], [17, 0, 3, 4, 1, 2, 6, 5, 1]):
        x, w, b, cu = _conv_case(seqlens, 6, 4, torch.float64)
        q, k, v, g, beta, _ = _gdn_case(seqlens, 1, 2, 3, 5, torch.float64)
        inputs = [t.clone().requires_grad_() for t in (x, w, b, q, k, v, g, beta)]
        eager_inputs = [t.clone().requires_grad_() for t in (x, w, b, q, k, v, g, beta)]
        loss = compiled(*inputs, cu)
        loss.backward()
        eager = core(*eager_inputs, cu)
        eager.backward()
        assert rel_error(loss, eager) < TOLERANCE[torch.float64]
        for a, e in zip(inputs, eager_inputs):
            assert rel_error(a.grad, e.grad) < TOLERANCE[torch.float64]
    assert counter.frame_count == 1


def test_compiled_with_state_fullgraph_forward_backward():
    """The stateful op chained over two packed pieces, forward and backward, in one graph with no
    breaks and no recompile for a second packing; equal to the same code eagerly."""
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    counter = CompileCounterWithBackend("aot_eager")

    def chained(heads, tails, h0, cu_heads, cu_tails):
        o_heads, mid = torch.ops.cp_ops.chunk_gated_delta_rule_with_state(*heads, cu_heads, None, h0)
        o_tails, final = torch.ops.cp_ops.chunk_gated_delta_rule_with_state(*tails, cu_tails, None, mid)
        return o_heads.square().sum() + o_tails.square().sum() + final.square().sum()

    compiled = torch.compile(chained, backend=counter, fullgraph=True, dynamic=True)
    # no row count or len(cu_seqlens) equals a feature dim: duck sizing would tie them
    packings = (([5, 0, 1, 7, 2, 9, 1], [3, 0, 6, 0, 8, 1, 2]), ([9, 1, 0, 2, 6, 1, 3], [4, 2, 0, 7, 1, 0, 5]))
    for heads, tails in packings:
        head_case, tail_case = (_gdn_case(lens, 1, 2, 3, 5, torch.float64)[:5] for lens in (heads, tails))
        h0 = _states(len(heads), 2, 3, 5, torch.float64)
        runs = []
        for fn in (compiled, chained):
            leaves = [t.clone().requires_grad_() for t in (*head_case, *tail_case, h0)]
            loss = fn(leaves[:5], leaves[5:10], leaves[10], _cu(heads), _cu(tails))
            runs.append([loss, *torch.autograd.grad(loss, leaves)])
        for a, e in zip(*runs):
            assert rel_error(a, e) < TOLERANCE[torch.float64]
    assert counter.frame_count == 1
    assert sum(counters["graph_break"].values()) == 0


# --- kernel paths -----------------------------------------------------------------------------


@pytest.mark.interpret
@given(
    gdn_layouts(max_seqs=5, max_len=80),
    st.sampled_from([1, 5, 40]),
    st.sampled_from([1, 2, 3, 4, 5]),
    st.booleans(),
    st.sampled_from(["silu", None]),
    st.sampled_from([torch.int32, torch.int64]),
)
def test_conv_kernels_match_reference(seqlens, channels, kernel, bias, activation, index_dtype):
    """The conv kernels in Triton's interpreter against the float64 reference, forward and every
    gradient: x a column slice of a wider tensor (as the layer passes it), row and channel
    counts that are no multiple of the blocks (8 rows and 16 channels in the interpreter),
    empty and one-row sequences; ours up to 4 taps, FLA's beyond (driven with the sync-free
    chunk indices)."""
    x, w, b, cu = _conv_case(seqlens, channels, kernel, torch.float32, bias)
    cu = cu.to(index_dtype)
    x = torch.cat([random_tensor((x.shape[0], 3), torch.float32), x], 1)[:, 3:]  # row stride C + 3
    grad_y = random_tensor(x.shape, torch.float32)
    with first_autotune_config(), poisoned_allocations():
        y = custom_ops.causal_conv1d(x, w, b, cu, activation)
        grads = torch.ops.cp_ops.causal_conv1d_backward(grad_y, x, w, b, cu, activation)
    b64 = None if b is None else b.double()
    assert rel_error(y, causal_conv1d_loop(x.double(), w.double(), b64, cu, activation)) < TOLERANCE[torch.float32]
    dx, dw, db = causal_conv1d_reference_backward(grad_y.double(), x.double(), w.double(), b64, cu, activation)
    assert rel_error(grads[0], dx) < TOLERANCE[torch.float32]
    # dw and db are sums over all T rows of unit-scale terms, which may cancel: float32 error
    # grows with T, a missing or doubled term would be of order one
    for a, e in zip(grads[1:], (dw, db)):
        torch.testing.assert_close(a.double(), e, rtol=1e-5, atol=1e-6 * max(x.shape[0], 1))


def _gather_case(seqlens, channels, kernel, extra, dtype, bias=True, index_dtype=torch.int64, seed=0, permuted=True):
    """A conv case whose rows sit permuted in a wider x ``[T, C + extra]``: ``(x, rows, w, b, cu)``
    with ``x[rows[t]]`` holding sequence row t; ``permuted=False``: in sequence order, rows None."""
    xs, w, b, cu = _conv_case(seqlens, channels, kernel, dtype, bias)
    t = xs.shape[0]
    x = torch.cat([xs, random_tensor((t, extra), dtype)], 1)
    if not permuted:
        return x, None, w, b, cu
    rows = torch.randperm(t, generator=torch.Generator().manual_seed(seed)).to(index_dtype)
    return x[torch.argsort(rows)], rows, w, b, cu


def _blocks(y, parts):
    """``y [T, n]`` as ``[parts, T, n/parts]``, the layout of causal_conv1d_gather's first output."""
    return torch.stack(y.chunk(parts, dim=1)) if parts > 0 and y.shape[1] else y.new_zeros(parts, y.shape[0], 0)


def _unblocks(blocks):
    return torch.cat(list(blocks), dim=1)


def _gather_expected(grad_y, grad_rest, x, rows, w, b, cu, activation, split=0, norm_dim=0):
    """The float64 oracle: the conv of x's rows in the order ``rows`` (its first ``split`` columns
    l2-normalised over groups of ``norm_dim``, eps 1e-6) and its gradients, through the gather's
    own backward (autograd of ``x[rows]``)."""
    leaves = [None if t is None else t.detach().double().requires_grad_() for t in (x, w, b)]
    xs = leaves[0] if rows is None else leaves[0][rows]
    channels = w.shape[0]
    y = causal_conv1d_loop(xs[:, :channels], leaves[1], leaves[2], cu, activation)
    if norm_dim:
        groups = y[:, :split].unflatten(1, (-1, norm_dim))
        normed = groups / (groups.square().sum(-1, keepdim=True) + 1e-6).sqrt()
        y = torch.cat([normed.flatten(1), y[:, split:]], 1)
    rest = xs[:, channels:]
    if y.requires_grad:  # the loop oracle builds no graph over zero rows
        torch.autograd.backward([y, rest], [grad_y.double(), grad_rest.double()])
    grads = [None if t is None else (torch.zeros_like(t) if t.grad is None else t.grad) for t in leaves]
    return y.detach(), rest.detach(), grads


@pytest.mark.interpret
@given(
    gdn_layouts(max_seqs=4, max_len=60),
    st.sampled_from([1, 5, 40]),
    st.sampled_from([1, 3, 4, 5]),
    st.sampled_from([0, 2, 7]),
    st.sampled_from([0.0, 0.5, 1.0]),
    st.sampled_from([0, 4, 8, 6]),
    st.sampled_from([1, 2]),
    st.booleans(),
    st.sampled_from([torch.int32, torch.int64, None]),
    st.integers(0, 2**16),
)
def test_conv_gather_kernels_match_reference(
    seqlens, channels, kernel, extra, cut, norm_dim, parts, bias, index_dtype, seed
):
    """causal_conv1d_gather in Triton's interpreter: x's rows permuted (every carried tap row and
    every dx row goes through the map, across 8-row blocks) or, with rows None (index_dtype
    None), in sequence order, extra columns after the conv's (returned in sequence order;
    their gradient written back through the map, or in place), y cut at a column inside a channel
    block or at either end, its first part l2-normalised by the kernels (groups of 4, 8) or after
    them (6) and in one or two column blocks, forward and every gradient against the float64
    oracle; 5 taps take FLA's kernels."""
    permuted = index_dtype is not None
    x, rows, w, b, cu = _gather_case(seqlens, channels, kernel, extra, torch.float32, bias, index_dtype, seed, permuted)
    unit = parts * max(norm_dim, 1)
    split = int(cut * channels) // unit * unit
    grad_y = random_tensor((x.shape[0], channels), torch.float32)
    grad_rest = random_tensor((x.shape[0], extra), torch.float32)
    with first_autotune_config(), poisoned_allocations():
        head, tail, rest = custom_ops.causal_conv1d_gather(x, rows, w, b, cu, "silu", split, norm_dim, parts)
        grads = torch.ops.cp_ops.causal_conv1d_gather_backward(
            _blocks(grad_y[:, :split], parts), grad_y[:, split:], grad_rest, x, rows, w, b, cu, "silu", norm_dim
        )
    y_e, rest_e, (dx, dw, db) = _gather_expected(grad_y, grad_rest, x, rows, w, b, cu, "silu", split, norm_dim)
    assert head.shape == (parts, x.shape[0], split // parts) and tail.shape[1] == channels - split
    assert rel_error(torch.cat([_unblocks(head), tail], 1), y_e) < TOLERANCE[torch.float32]
    assert torch.equal(rest, x[:, channels:] if rows is None else x[rows.long(), channels:])
    assert rel_error(grads[0], dx) < TOLERANCE[torch.float32]
    for a, e in zip(grads[1:], (dw, db)):
        if e is not None:
            torch.testing.assert_close(a.double(), e, rtol=1e-5, atol=1e-6 * max(x.shape[0], 1))


@pytest.mark.parametrize("permuted", [True, False], ids=["rows", "rows_none"])
def test_conv_gather_reference_and_autograd(permuted):
    """The CPU path against F.conv1d of the gathered rows and the float64 loop oracle, through
    autograd (gradcheck in float64), and opcheck of both ops; x's rows permuted or, with rows
    None, in sequence order; y whole and cut in two."""
    x, rows, w, b, cu = _gather_case([7, 0, 1, 12], 5, 4, 3, torch.float64, permuted=permuted)
    empty, y, rest = custom_ops.causal_conv1d_gather(x, rows, w, b, cu, "silu")
    assert empty.shape == (1, x.shape[0], 0)
    # on the CPU the op runs its reference: compare both with oracles that share no code with it
    channels = w.shape[0]
    gathered = x.clone() if rows is None else torch.stack([x[int(r)] for r in rows])
    assert rel_error(y, _conv1d_per_sequence(gathered[:, :channels], w, b, cu, "silu")) < TOLERANCE[torch.float64]
    assert torch.equal(rest, gathered[:, channels:])
    assert rel_error(y, _gather_expected(y, rest, x, rows, w, b, cu, "silu")[0]) < TOLERANCE[torch.float64]
    head, tail, _ = custom_ops.causal_conv1d_gather(x, rows, w, b, cu, "silu", 2)
    assert torch.equal(head[0], y[:, :2]) and torch.equal(tail, y[:, 2:])
    normed, _, _ = custom_ops.causal_conv1d_gather(x, rows, w, b, cu, "silu", 4, 2, 2)
    expected = _gather_expected(y, rest, x, rows, w, b, cu, "silu", 4, 2)[0]
    assert rel_error(_unblocks(normed), expected[:, :4]) < TOLERANCE[torch.float64]
    args = tuple(t.clone().requires_grad_() for t in (x, w, b))
    for cut in ((0, 0, 1), (2, 0, 1), (4, 2, 1), (4, 2, 2)):
        assert torch.autograd.gradcheck(
            lambda x, w, b: custom_ops.causal_conv1d_gather(x, rows, w, b, cu, "silu", *cut), args
        )
    torch.library.opcheck(custom_ops.causal_conv1d_gather, (x.float(), rows, w.float(), None, cu, "silu", 2))
    torch.library.opcheck(custom_ops.causal_conv1d_gather, (x.float(), rows, w.float(), None, cu, "silu", 4, 2, 2))
    torch.library.opcheck(custom_ops.causal_conv1d_gather, (*args[:1], rows, *args[1:], cu.int(), None))
    no_rows = None if rows is None else rows[:0]
    torch.library.opcheck(custom_ops.causal_conv1d_gather, (x[:0], no_rows, w, b, cu[:1] * 0, "silu"))
    torch.library.opcheck(
        torch.ops.cp_ops.causal_conv1d_gather_backward.default,
        (torch.randn_like(y[None, :, :2]), torch.randn_like(y[:, 2:]), torch.randn_like(rest), x, rows, w, b, cu,
         "silu"),
    )
    with pytest.raises(ValueError, match="C <= F"):
        custom_ops.causal_conv1d_gather(x[:, :4], rows, w, b, cu, "silu")
    for split in (-1, channels + 1):
        with pytest.raises(ValueError, match="split must be in"):
            custom_ops.causal_conv1d_gather(x, rows, w, b, cu, "silu", split)
    for norm_dim in (-2, 3, 4):
        with pytest.raises(ValueError, match="norm_dim must be 0 or divide split / parts"):
            custom_ops.causal_conv1d_gather(x, rows, w, b, cu, "silu", 4, norm_dim, 2)
    for parts in (0, 3):
        with pytest.raises(ValueError, match="parts must be positive and divide split"):
            custom_ops.causal_conv1d_gather(x, rows, w, b, cu, "silu", 4, 0, parts)
    if rows is not None:
        with pytest.raises(ValueError, match="rows must be \\[T\\]"):
            custom_ops.causal_conv1d_gather(x, rows[1:], w, b, cu, "silu")
        with pytest.raises(TypeError):
            custom_ops.causal_conv1d_gather(x, rows.float(), w, b, cu, "silu")


@pytest.mark.parametrize("kind", ["fwd", "bwd"])
@pytest.mark.parametrize("row_map", [None, "*i32", "*i64"])
@pytest.mark.parametrize("norm_dim", [0, 128])
def test_conv_kernels_compile_for_hopper(kind, row_map, norm_dim):
    """The interpreter runs the kernels as Python, where a construct the GPU compiler refuses
    passes (a function returning int32 on one path and int64 on the other did): compile both
    for sm_90 with their CUDA configs, without and with a row map of either index dtype, and
    with y cut in two, the first part l2-normalised over groups of 128 in two blocks (the GDN
    layer's form)."""
    pytest.importorskip("triton.backends.nvidia")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from custom_ops.conv1d import kernels
    from custom_ops.conv1d.op import CONV_SETTINGS

    kernel = kernels.cp_causal_conv1d_fwd_kernel if kind == "fwd" else kernels.cp_causal_conv1d_bwd_kernel
    rows, block_c, warps, stages = CONV_SETTINGS.config(kind, on_gpu=True)
    constants = dict(K=4, HAS_BIAS=False, SILU=True, ROWS=rows, BLOCK_C=block_c, GATHER=row_map is not None,
                     SPLIT=norm_dim > 0, NORM_DIM=norm_dim, PARTS=2 if norm_dim else 1)  # fmt: skip
    pointers = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "y_ptr": "*bf16", "y2_ptr": "*bf16",
                "dy_ptr": "*bf16", "dy2_ptr": "*bf16", "dx_ptr": "*bf16", "dw_ptr": "*fp32", "db_ptr": "*fp32",
                "pos_ptr": "*i32", "map_ptr": row_map or "*i32", "norm_eps": "fp32"}  # fmt: skip
    names = kernel.arg_names
    signature = {n: "constexpr" if n in constants else pointers.get(n, "i32") for n in names}
    source = ASTSource(fn=kernel, signature=signature, constexprs={(names.index(k),): v for k, v in constants.items()})
    try:
        options = dict(num_warps=warps, num_stages=stages)
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    except (ImportError, TypeError, AttributeError) as e:  # compile API of another triton release
        pytest.skip(f"cannot compile for sm_90 with triton {triton.__version__}: {e}")
    assert "ld.global" in compiled.asm["ptx"]


@pytest.mark.interpret
@given(
    st.lists(st.one_of(st.just(0), st.integers(1, 9)), min_size=1, max_size=12),
    st.integers(0, 5),
    st.sampled_from([torch.int32, torch.int64]),
)
def test_conv_positions_kernel_matches_reference(seqlens, extra_rows, index_dtype):
    """The positions kernel against the reference's row positions capped at MAX_TAPS: zero-length
    sequences, rows past ``cu[-1]``, layouts spanning several of the kernel's blocks."""
    from custom_ops.conv1d import op as conv
    from custom_ops.conv1d.kernels import MAX_TAPS
    from custom_ops.thd.index import row_positions

    cu = _cu([s * 150 for s in seqlens], dtype=index_dtype)  # up to 16200 rows: up to 16 blocks
    num_rows = int(cu[-1]) + extra_rows
    pos = conv._conv_positions(cu, num_rows)
    assert pos.dtype == torch.int32
    assert torch.equal(pos, row_positions(cu, num_rows).clamp(max=MAX_TAPS).int())


def test_conv_positions_kernel_compiles_for_hopper():
    pytest.importorskip("triton.backends.nvidia")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from custom_ops.conv1d.kernels import MAX_TAPS, POSITIONS_BLOCK, conv_positions_kernel

    constants = dict(CAP=MAX_TAPS, BLOCK=POSITIONS_BLOCK)
    names = conv_positions_kernel.arg_names
    types = {"cu_ptr": "*i32", "pos_ptr": "*i32"}
    signature = {n: "constexpr" if n in constants else types.get(n, "i32") for n in names}
    source = ASTSource(
        fn=conv_positions_kernel, signature=signature, constexprs={(names.index(k),): v for k, v in constants.items()}
    )
    try:
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
    except (ImportError, TypeError, AttributeError) as e:  # compile API of another triton release
        pytest.skip(f"cannot compile for sm_90 with triton {triton.__version__}: {e}")
    assert "st.global" in compiled.asm["ptx"]


@pytest.mark.interpret
@given(
    st.lists(st.one_of(st.just(0), st.integers(1, 200)), max_size=300),
    st.integers(-40, 130),
    st.sampled_from([torch.int32, torch.int64]),
    st.data(),
)
def test_fla_chunk_indices_kernel_matches_reference(seqlens, extra_rows, index_dtype, data):
    """The chunk-index kernel against the torch reference: empty sequences, several of the
    kernel's sequence blocks and row blocks, rows past ``cu[-1]`` and ``cu[-1]`` past the rows,
    and an invalid layout with a step down (an empty sequence to both)."""
    from custom_ops.fla.adapter import fla_varlen_indices_reference

    cu = _cu(seqlens, dtype=index_dtype)
    if len(seqlens) > 1 and data.draw(st.booleans()):
        cu[data.draw(st.integers(1, len(seqlens)))] -= data.draw(st.integers(1, 60))
    num_rows = max(int(cu[-1]) + extra_rows, 0)
    cu_ext, chunk_indices = fla_varlen_indices(cu, num_rows)
    expected = fla_varlen_indices_reference(cu, num_rows)
    assert cu_ext.dtype == chunk_indices.dtype == index_dtype
    assert torch.equal(cu_ext, expected[0])
    assert torch.equal(chunk_indices, expected[1])


def test_fla_chunk_indices_kernel_compiles_for_hopper():
    pytest.importorskip("triton.backends.nvidia")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from custom_ops.fla.adapter import INDICES_BLOCK, INDICES_SEQ_BLOCK, fla_chunk_indices_kernel

    constants = dict(CHUNK=64, BLOCK=INDICES_BLOCK, SEQ_BLOCK=INDICES_SEQ_BLOCK)
    names = fla_chunk_indices_kernel.arg_names
    types = {"cu_ptr": "*i32", "cu_ext_ptr": "*i32", "idx_ptr": "*i32"}
    signature = {n: "constexpr" if n in constants else types.get(n, "i32") for n in names}
    source = ASTSource(
        fn=fla_chunk_indices_kernel, signature=signature,
        constexprs={(names.index(k),): v for k, v in constants.items()},
    )  # fmt: skip
    try:
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
    except (ImportError, TypeError, AttributeError) as e:  # compile API of another triton release
        pytest.skip(f"cannot compile for sm_90 with triton {triton.__version__}: {e}")
    assert "st.global" in compiled.asm["ptx"]


@pytest.mark.interpret
def test_conv_kernels_rows_past_the_layout():
    """Rows past ``cu[-1]`` (outside the op's contract) start a sequence of their own there, as in
    the reference. Called as ``torch.ops.cp_ops``, which eager checks leave alone (an eager call of
    ``custom_ops.causal_conv1d`` refuses the layout)."""
    x, w, b, cu = _conv_case([9, 0, 20], 7, 4, torch.float32)
    x = torch.cat([x, random_tensor((11, 7), torch.float32)])
    grad_y = random_tensor(x.shape, torch.float32)
    with pytest.raises(ValueError, match="cu_seqlens\\[-1\\] = 29 but the tensor has 40 rows"):
        custom_ops.causal_conv1d(x, w, b, cu, "silu")
    y = torch.ops.cp_ops.causal_conv1d(x, w, b, cu, "silu")
    assert rel_error(y, causal_conv1d_reference(x, w, b, cu, "silu")) < TOLERANCE[torch.float32]
    grads = torch.ops.cp_ops.causal_conv1d_backward(grad_y, x, w, b, cu, "silu")
    for a, e in zip(grads, causal_conv1d_reference_backward(grad_y, x, w, b, cu, "silu")):
        assert rel_error(a, e) < TOLERANCE[torch.float32]


@pytest.mark.gpu
@needs_fla
@pytest.mark.parametrize("seqlens", [[300, 0, 1, 200, 64], [1000, 24]])
def test_cuda_kernels_match_reference_bf16(seqlens, cuda_backend):
    """The CUDA kernels (each backend's delta rule, our conv) in bf16 against the float64
    reference: forward and every gradient.

    Tolerances are error-RMS ratios: 1e-2 is bf16's bound in the table (inputs rounded to
    bf16 plus a recurrence accumulated in fp32 inside chunks of 64).
    """
    dev, bf16 = "cuda", torch.bfloat16
    q, k, v, g, beta, cu = _gdn_case(seqlens, 2, 2, 128, 128, bf16, dev)
    x, w, b, _ = _conv_case(seqlens, 96, 4, bf16, device=dev)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, g, beta, x, w, b)]
    o = custom_ops.chunk_gated_delta_rule(*leaves[:5], cu)
    y = custom_ops.causal_conv1d(*leaves[5:], cu, "silu")
    grad_o, grad_y = torch.randn_like(o), torch.randn_like(y)
    torch.autograd.backward([o, y], [grad_o, grad_y])

    ref = [t.detach().double().cpu().requires_grad_() for t in (q, k, v, g, beta, x, w, b)]
    cu_cpu = cu.cpu()
    o_ref = chunk_gated_delta_rule_reference(*ref[:5], cu_cpu)
    y_ref = causal_conv1d_reference(*ref[5:], cu_cpu, "silu")
    torch.autograd.backward([o_ref, y_ref], [grad_o.double().cpu(), grad_y.double().cpu()])
    assert rel_error(o.cpu(), o_ref) < 5e-3
    assert rel_error(y.cpu(), y_ref) < 5e-3
    for name, a, e in zip(("q", "k", "v", "g", "beta", "x", "w", "b"), leaves, ref):
        assert rel_error(a.grad.cpu(), e.grad) < 1e-2, name


@pytest.mark.gpu
@needs_fla
@pytest.mark.parametrize("seqlens", [[300, 0, 1, 200, 64], [1000, 24]])
def test_cuda_delta_rule_with_state_matches_reference_bf16(seqlens, cuda_backend):
    """Each backend's kernels from initial states in bf16 (states float32) against the float64 reference:
    outputs, final states and every gradient, the initial states' included, from a loss over
    both outputs. Tolerances as for the stateless op, except the gates' and betas' gradients:
    through a final state's gradient they sum products of bf16-stored states over dk x dv
    entries, and FLA's own tests of this kernel bound them at 2e-2 (measured up to 3e-2 for a
    one-token sequence's gate alone, 8e-3 over this case's tokens)."""
    dev, bf16 = "cuda", torch.bfloat16
    q, k, v, g, beta, cu = _gdn_case(seqlens, 2, 2, 128, 128, bf16, dev)
    h0 = _states(len(seqlens), 4, 128, 128, torch.float32, dev)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, g, beta, h0)]
    o, final = custom_ops.chunk_gated_delta_rule_with_state(*leaves[:5], cu, None, leaves[5])
    assert final.dtype == torch.float32 and final.shape == h0.shape
    grad_o, grad_final = torch.randn_like(o), torch.randn_like(final)
    torch.autograd.backward([o, final], [grad_o, grad_final])

    ref = [t.detach().double().cpu().requires_grad_() for t in (q, k, v, g, beta, h0)]
    o_ref, final_ref = chunk_gated_delta_rule_with_state_reference(*ref[:5], cu.cpu(), None, ref[5])
    torch.autograd.backward([o_ref, final_ref], [grad_o.double().cpu(), grad_final.double().cpu()])
    assert rel_error(o.cpu(), o_ref) < 5e-3
    assert rel_error(final.cpu(), final_ref) < 5e-3
    for name, a, e in zip(("q", "k", "v", "g", "beta", "h0"), leaves, ref):
        assert rel_error(a.grad.cpu(), e.grad) < (2e-2 if name in ("g", "beta") else 1e-2), name


@pytest.mark.gpu
@pytest.mark.parametrize("permuted", [True, False], ids=["rows", "rows_none"])
@pytest.mark.parametrize("kernel", [4, pytest.param(5, marks=needs_fla)])
@pytest.mark.parametrize("norm_dim", [0, 8])
def test_cuda_conv_gather_matches_reference_bf16(norm_dim, kernel, permuted):
    """causal_conv1d_gather on CUDA in bf16 (our kernels through the row map, or in order with
    rows None; FLA's on the gathered rows at 5 taps), y cut inside a channel block, its first part
    in two blocks, l2-normalised or not, against the float64 oracle: forward and every gradient."""
    x, rows, w, b, cu = _gather_case([300, 0, 1, 200, 64], 96, kernel, 9, torch.float32, seed=1, permuted=permuted)
    grad_y, grad_rest = random_tensor((x.shape[0], 96), torch.float32), random_tensor((x.shape[0], 9), torch.float32)
    dev, bf16 = "cuda", torch.bfloat16
    leaves = [t.to(dev, bf16).requires_grad_() for t in (x, w, b)]
    rows_dev = None if rows is None else rows.to(dev)
    head, tail, rest = custom_ops.causal_conv1d_gather(
        leaves[0], rows_dev, leaves[1], leaves[2], cu.to(dev), "silu", 48, norm_dim, 2
    )
    dy = grad_y.to(dev, bf16)
    torch.autograd.backward([head, tail, rest], [_blocks(dy[:, :48], 2), dy[:, 48:], grad_rest.to(dev, bf16)])
    bf = [t.to(bf16).double() for t in (grad_y, grad_rest, x, w, b)]
    y_e, rest_e, grads_e = _gather_expected(*bf[:3], rows, *bf[3:], cu, "silu", 48, norm_dim)
    assert rel_error(torch.cat([_unblocks(head), tail], 1).cpu(), y_e) < 5e-3
    assert torch.equal(rest.cpu().double(), rest_e)
    for name, a, e in zip("xwb", leaves, grads_e):
        assert rel_error(a.grad.cpu(), e) < 1e-2, name


@pytest.mark.gpu
@needs_fla
def test_gdn_ops_under_cuda_graphs(cuda_backend):
    """The conv and the delta rule, forward and backward, compiled with CUDA graphs (Inductor's
    cudagraph trees): they run (neither backend reads the host or keeps anything in the graphs'
    pool) and, replayed on new data, agree with the same ops eagerly."""
    dev, bf16 = "cuda", torch.bfloat16
    seqlens = [300, 0, 1, 200, 64]
    _, _, _, _, _, cu = _gdn_case(seqlens, 2, 2, 128, 128, bf16, dev)

    def step(q, k, v, g, beta, x, w, b):
        o = custom_ops.chunk_gated_delta_rule(q, k, v, g, beta, cu)
        return o.float().square().sum() + custom_ops.causal_conv1d(x, w, b, cu, "silu").float().square().sum()

    compiled = torch.compile(step, fullgraph=True, options={"triton.cudagraphs": True})
    for seed in range(3):  # record, then replays on fresh data
        torch.manual_seed(seed)
        q, k, v, g, beta, _ = _gdn_case(seqlens, 2, 2, 128, 128, bf16, dev)
        x, w, b, _ = _conv_case(seqlens, 96, 4, bf16, device=dev)
        runs = []
        for fn in (compiled, step):
            leaves = [t.clone().requires_grad_() for t in (q, k, v, g, beta, x, w, b)]
            loss = fn(*leaves)
            loss.backward()
            runs.append([loss.detach().clone()] + [t.grad.clone() for t in leaves])
        for name, a, e in zip(("loss", "q", "k", "v", "g", "beta", "x", "w", "b"), *runs):
            assert rel_error(a, e) < 1e-3, (seed, name)


@pytest.mark.gpu
@needs_fla
@pytest.mark.parametrize("hk, group", [(2, 2), (1, 1), (3, 2)])
def test_cuda_backends_agree_bf16(hk, group):
    """FlashQLA's kernels against FLA's, bf16, from initial states: outputs, final states and
    every gradient, on sequences of 0 and 1 rows, below a chunk, on chunk bounds, and one longer
    than a quarter of the batch (a rank's share at W = 4)."""
    probe = torch.empty(0, 1, 128, device="cuda", dtype=torch.bfloat16)
    if (reason := backends.flash_qla_unfit(probe, probe)) is not None:
        pytest.skip(reason)
    seqlens = [0, 1, 37, 64, 65, 2100, 130, 0, 700]
    q, k, v, g, beta, cu = _gdn_case(seqlens, hk, group, 128, 128, torch.bfloat16, "cuda")
    h0 = _states(len(seqlens), hk * group, 128, 128, torch.float32, "cuda")
    grad_o, grad_final = torch.randn_like(v), torch.randn_like(h0)
    runs = {}
    for backend in ("fla", "flashqla"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, g, beta, h0)]
        o, final, *_ = torch.ops.cp_ops.chunk_gated_delta_rule_forward(
            *leaves[:5], cu, None, leaves[5], True, backend
        )
        torch.autograd.backward([o, final], [grad_o, grad_final])
        runs[backend] = [o, final] + [t.grad for t in leaves]
    for name, a, e in zip(("o", "final", "q", "k", "v", "g", "beta", "h0"), runs["flashqla"], runs["fla"]):
        assert rel_error(a, e) < (5e-3 if name in ("o", "final") else 2e-2), name


@pytest.mark.gpu
@needs_fla
def test_cuda_backend_is_chosen_when_traced(monkeypatch, cuda_backend):
    """A compiled graph keeps the backend it was traced with: set another afterwards, and the
    graph still launches the first one's kernels, forward and backward."""
    calls = []

    def counted(fn, name, kind):
        def call(*args, **kwargs):
            calls.append((name, kind))
            return fn(*args, **kwargs)

        return call

    for table, kind in ((gdn_op._KERNEL_FORWARD, "fwd"), (gdn_op._KERNEL_BACKWARD, "bwd")):
        for name, fn in list(table.items()):
            monkeypatch.setitem(table, name, counted(fn, name, kind))
    q, k, v, g, beta, cu = _gdn_case([300, 0, 1, 200], 2, 2, 128, 128, torch.bfloat16, "cuda")
    compiled = torch.compile(lambda *t: custom_ops.chunk_gated_delta_rule(*t, cu).float().sum(), fullgraph=True)
    other = "fla" if cuda_backend == "flashqla" else "flashqla"
    for asked in (cuda_backend, other):
        backends.set_backend(asked)
        leaves = [t.clone().requires_grad_() for t in (q, k, v, g, beta)]
        compiled(*leaves).backward()
    assert calls == [(cuda_backend, "fwd"), (cuda_backend, "bwd")] * 2


# --- bad input --------------------------------------------------------------------------------


def test_bad_input():
    q, k, v, g, beta, cu = _gdn_case([4, 4], 2, 2, 4, 3, torch.float32)
    with pytest.raises(ValueError, match="multiple of the key heads"):
        custom_ops.chunk_gated_delta_rule(q, k, v[:, :3], g[:, :3], beta[:, :3], cu)
    with pytest.raises(ValueError, match="one shape"):
        custom_ops.chunk_gated_delta_rule(q, k[:, :1], v, g, beta, cu)
    with pytest.raises(TypeError, match="cu_seqlens must be int32 or int64"):
        custom_ops.chunk_gated_delta_rule(q, k, v, g, beta, cu.float())
    x, w, b, cu = _conv_case([4, 4], 3, 4, torch.float32)
    with pytest.raises(ValueError, match="activation must be"):
        custom_ops.causal_conv1d(x, w, b, cu, "relu")
    with pytest.raises(ValueError, match="weight must be"):
        custom_ops.causal_conv1d(x, w[:2], b, cu)


def test_bad_state():
    q, k, v, g, beta, cu = _gdn_case([4, 0, 4], 2, 2, 4, 3, torch.float32)
    h0 = _states(3, 4, 4, 3, torch.float32)
    shape_error = r"initial_state must be \[B, Hv, dk, dv\] = \[3, 4, 4, 3\], got shape \(2, 4, 4, 3\)"
    with pytest.raises(ValueError, match=shape_error):
        custom_ops.chunk_gated_delta_rule_with_state(q, k, v, g, beta, cu, None, h0[:2])
    with pytest.raises(ValueError, match="initial_state must be"):
        custom_ops.chunk_gated_delta_rule_with_state(q, k, v, g, beta, cu, None, h0.transpose(2, 3))
    for dtype in (torch.float64, torch.bfloat16):
        with pytest.raises(TypeError, match=f"initial_state must be torch.float32 for q of torch.float32, got {dtype}"):
            custom_ops.chunk_gated_delta_rule_with_state(q, k, v, g, beta, cu, None, h0.to(dtype))
    with pytest.raises(TypeError, match="initial_state must be torch.float64 for q of torch.float64"):
        custom_ops.chunk_gated_delta_rule_with_state(*(t.double() for t in (q, k, v, g, beta)), cu, None, h0)
    with pytest.raises(ValueError, match="initial_state is on meta but q is on cpu"):
        custom_ops.chunk_gated_delta_rule_with_state(q, k, v, g, beta, cu, None, h0.to("meta"))
    aux = q.new_empty(0)
    with pytest.raises(ValueError, match="grad_final_state must be"):
        torch.ops.cp_ops.chunk_gated_delta_rule_backward(
            torch.randn_like(v), q, k, v, g, beta, cu, *_flat_fla_indices(cu, q.shape[0]), aux.float(), aux, None,
            h0, h0[:, :2],
        )  # fmt: skip
