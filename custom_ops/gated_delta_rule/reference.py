"""Torch references of the chunked gated delta rule on packed (THD) sequences (the recurrence
in FLA's convention: docs/design.md section 2, "Gated DeltaNet core").

``chunk_gated_delta_rule_reference`` and ``chunk_gated_delta_rule_with_state_reference`` are
what the ops run on CPU, with the ops' signatures: no host syncs, float32 compute (float64 for
float64 inputs), differentiable by torch autograd; ``chunk_gated_delta_rule_reference_backward``
and ``chunk_gated_delta_rule_with_state_reference_backward`` their closed-form reverse scans.
``chunk_gated_delta_rule_loop`` and ``chunk_gated_delta_rule_with_state_loop`` spell the
definition out per sequence in float64, independent oracles for the tests.
"""

from __future__ import annotations

import torch

from custom_ops.runtime.dtypes import accumulation_dtype
from custom_ops.thd.index import row_positions


def state_dtype(q: torch.Tensor) -> torch.dtype:
    """The dtype the references compute in and the recurrent states have: float64 for float64
    inputs, else float32."""
    return accumulation_dtype(q.dtype)


def _row_sequences(cu_seqlens: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(seq, starts, ends)`` for every row, on the device: the row's sequence (rows past
    ``cu[-1]`` get B, an extra sequence of zero initial state, as in :func:`row_positions`),
    whether it starts its sequence and whether it is its sequence's last row."""
    cu = cu_seqlens.to(torch.int64)
    num_seqs = cu.numel() - 1
    t = torch.arange(num_rows, device=cu.device, dtype=torch.int64)
    seq = (torch.searchsorted(cu, t, right=True) - 1).clamp(min=0, max=max(num_seqs, 0))
    starts = row_positions(cu_seqlens, num_rows) == 0
    bounds = torch.cat([cu, cu.new_full((1,), num_rows)])
    ends = t + 1 == bounds[seq + 1]
    return seq, starts, ends


def _padded_states(state: torch.Tensor | None, num_seqs: int, shape, dtype, device) -> torch.Tensor:
    """``[B+1, Hv, dk, dv]``: ``state`` (zeros where None) and a zero state for the rows past ``cu[-1]``."""
    zeros = torch.zeros(num_seqs + 1 if state is None else 1, *shape, dtype=dtype, device=device)
    return zeros if state is None else torch.cat([state.to(dtype), zeros])


def chunk_gated_delta_rule_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Gated delta rule over packed sequences: a sequential scan over all T rows.

    q, k ``[T, Hk, dk]``; v ``[T, Hv, dv]``; g (log decay) and beta ``[T, Hv]``;
    Hv a multiple of Hk. Returns o ``[T, Hv, dv]`` in q's dtype. The state is
    zeroed at every row that starts a sequence (a mask built on the device from
    ``cu_seqlens``), so one pass of T steps serves every packing without reading
    lengths on the host. O(T) Python steps: meant for CPU tests, not speed.
    """
    return chunk_gated_delta_rule_with_state_reference(q, k, v, g, beta, cu_seqlens, scale)[0]


def chunk_gated_delta_rule_with_state_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`chunk_gated_delta_rule_reference` from a state per sequence: ``(o, final_state)``.

    ``initial_state`` ``[B, Hv, dk, dv]`` (:func:`state_dtype` of q; None: zeros) is the state
    before each sequence's first row; ``final_state`` (same shape and dtype) the state after its
    last row, the initial state for a zero-length sequence. Both found on the device: every
    row's state is kept (memory ``T*Hv*dk*dv``, as autograd keeps them anyway).
    """
    dtype = state_dtype(q)
    num_rows, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    num_seqs = cu_seqlens.shape[0] - 1
    group = hv // hk
    if scale is None:
        scale = dk**-0.5
    seq, starts, _ = _row_sequences(cu_seqlens, num_rows)
    first = _padded_states(initial_state, num_seqs, (hv, dk, dv), dtype, q.device)
    # value head h reads key head h // group
    qh = q.to(dtype).repeat_interleave(group, dim=1) * scale
    kh = k.to(dtype).repeat_interleave(group, dim=1)
    vc, decay, bc = v.to(dtype), g.to(dtype).exp(), beta.to(dtype)
    state = torch.zeros(hv, dk, dv, dtype=dtype, device=q.device)
    states, outs = [], []
    for t in range(num_rows):
        state = torch.where(starts[t], first.index_select(0, seq[t : t + 1])[0], state) * decay[t, :, None, None]
        pred = torch.einsum("hkv,hk->hv", state, kh[t])
        delta = bc[t, :, None] * (vc[t] - pred)
        state = state + kh[t, :, :, None] * delta[:, None, :]
        states.append(state)
        outs.append(torch.einsum("hkv,hk->hv", state, qh[t]))
    o = torch.stack(outs) if outs else vc.clone()  # T = 0: empty, still in the graph
    # sequence i ends in row cu[i+1] - 1 of the states after the B initial ones, or (empty) in its own
    cu = cu_seqlens.to(torch.int64).clamp(0, num_rows)
    own = torch.arange(num_seqs, device=q.device, dtype=torch.int64)
    last = torch.where(cu[1:] > cu[:-1], num_seqs + cu[1:] - 1, own)
    bank = torch.cat([first[:num_seqs], *(s[None] for s in states)])
    return o.to(q.dtype), bank.index_select(0, last)


def chunk_gated_delta_rule_loop(q, k, v, g, beta, cu_seqlens, scale=None):
    """The recurrence per sequence and value head, in float64 (see the module docstring)."""
    return chunk_gated_delta_rule_with_state_loop(q, k, v, g, beta, cu_seqlens, scale)[0]


def chunk_gated_delta_rule_with_state_loop(q, k, v, g, beta, cu_seqlens, scale=None, initial_state=None):
    """``(o, final_state)`` of the recurrence per sequence and value head from ``initial_state``
    (None: zeros), in float64."""
    q64, k64, v64, g64, b64 = (t.double() for t in (q, k, v, g, beta))
    hk, dk = q.shape[1], q.shape[2]
    hv, dv = v.shape[1], v.shape[2]
    if scale is None:
        scale = dk**-0.5
    cu = cu_seqlens.tolist()
    out = torch.zeros(q.shape[0], hv, dv, dtype=torch.float64)
    final = torch.zeros(len(cu) - 1, hv, dk, dv, dtype=torch.float64)
    for i, (start, end) in enumerate(zip(cu[:-1], cu[1:])):
        for h in range(hv):
            kh = h // (hv // hk)
            state = torch.zeros(dk, dv, dtype=torch.float64) if initial_state is None else initial_state[i, h].double()
            for t in range(start, end):
                state = state * torch.exp(g64[t, h])
                residual = v64[t, h] - state.t() @ k64[t, kh]
                state = state + torch.outer(k64[t, kh], b64[t, h] * residual)
                out[t, h] = scale * (state.t() @ q64[t, kh])
            final[i, h] = state
    return out, final


def chunk_gated_delta_rule_reference_backward(
    grad_o: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dg, dbeta) of :func:`chunk_gated_delta_rule_reference`, by a reverse scan.

    Shapes and dtypes as the forward's inputs (``grad_o`` as its output). The reverse pass
    carries the state's gradient ``dS`` down each sequence and value head (the scan:
    docs/design.md section 2, "Gated DeltaNet core"); the forward is rerun to keep every
    state (memory ``T*Hv*dk*dv``: fine for CPU tests). Key-head gradients are summed over
    the value heads that share the key head.
    """
    return chunk_gated_delta_rule_with_state_reference_backward(grad_o, None, q, k, v, g, beta, cu_seqlens, scale)[:5]


def chunk_gated_delta_rule_with_state_reference_backward(
    grad_o: torch.Tensor,
    grad_final_state: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dg, dbeta, d_initial_state) of :func:`chunk_gated_delta_rule_with_state_reference`.

    The reverse scan of :func:`chunk_gated_delta_rule_reference_backward`, with
    ``grad_final_state`` (None: zeros) added to ``dS`` at each sequence's last row and
    ``dS`` before a sequence's first row, the decayed ``exp(g) dP``, its initial state's
    gradient (``grad_final_state`` itself for a zero-length sequence). ``d_initial_state``
    is empty where ``initial_state`` is None.
    """
    dtype = state_dtype(q)
    num_rows, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    num_seqs = cu_seqlens.shape[0] - 1
    group = hv // hk
    if scale is None:
        scale = dk**-0.5
    seq, starts, ends = _row_sequences(cu_seqlens, num_rows)
    first = _padded_states(initial_state, num_seqs, (hv, dk, dv), dtype, q.device)
    last_grad = _padded_states(grad_final_state, num_seqs, (hv, dk, dv), dtype, q.device)
    qh = q.to(dtype).repeat_interleave(group, dim=1)
    kh = k.to(dtype).repeat_interleave(group, dim=1)
    vc, bc, do = v.to(dtype), beta.to(dtype), grad_o.to(dtype)
    decay = g.to(dtype).exp()  # a_t, [T, Hv]
    zero = torch.zeros(hv, dk, dv, dtype=dtype, device=q.device)
    prevs, states, residuals = [], [], []
    state = zero
    for t in range(num_rows):
        prev = torch.where(starts[t], first.index_select(0, seq[t : t + 1])[0], state)
        prior = prev * decay[t, :, None, None]
        residual = vc[t] - torch.einsum("hkv,hk->hv", prior, kh[t])
        state = prior + kh[t, :, :, None] * (bc[t, :, None] * residual)[:, None, :]
        prevs.append(prev)
        states.append(state)
        residuals.append(residual)
    dq = torch.zeros_like(qh)
    dkh = torch.zeros_like(kh)
    dvc = torch.zeros_like(vc)
    dg = torch.zeros(num_rows, hv, dtype=dtype, device=q.device)
    dbeta = torch.zeros_like(dg)
    dfirst = torch.zeros_like(first)
    ds = zero
    for t in reversed(range(num_rows)):
        prev, cur, residual = prevs[t], states[t], residuals[t]
        prior = prev * decay[t, :, None, None]
        ds = ds + torch.where(ends[t], last_grad.index_select(0, seq[t : t + 1])[0], zero)
        ds = ds + scale * qh[t, :, :, None] * do[t, :, None, :]
        dq[t] = scale * torch.einsum("hkv,hv->hk", cur, do[t])
        dd = torch.einsum("hkv,hk->hv", ds, kh[t])
        dp = -bc[t, :, None] * dd
        dkh[t] = torch.einsum("hkv,hv->hk", ds, bc[t, :, None] * residual) + torch.einsum("hkv,hv->hk", prior, dp)
        dvc[t] = bc[t, :, None] * dd
        dbeta[t] = (dd * residual).sum(-1)
        dprior = ds + kh[t, :, :, None] * dp[:, None, :]
        dg[t] = decay[t] * (dprior * prev).sum((-2, -1))
        dprev = dprior * decay[t, :, None, None]
        # the state before a sequence's first row is its initial state, not the row above's
        dfirst.index_add_(0, seq[t : t + 1], torch.where(starts[t], dprev, zero)[None])
        ds = torch.where(starts[t], zero, dprev)
    dq = dq.view(num_rows, hk, group, dk).sum(2)
    dk_out = dkh.view(num_rows, hk, group, dk).sum(2)
    grads = (dq.to(q.dtype), dk_out.to(k.dtype), dvc.to(v.dtype), dg.to(g.dtype), dbeta.to(beta.dtype))
    if initial_state is None:
        return (*grads, q.new_empty(0, dtype=dtype))
    cu = cu_seqlens.to(torch.int64)
    empty = (cu[1:] <= cu[:-1])[:, None, None, None]
    return (*grads, torch.where(empty, last_grad[:num_seqs], dfirst[:num_seqs]).to(initial_state.dtype))
