"""Torch references of the chunked gated delta rule on packed (THD) sequences (the recurrence
in FLA's convention: docs/design.md section 2, "Gated DeltaNet core").

``chunk_gated_delta_rule_reference`` is what the op runs on CPU, with the op's signature: no
host syncs, float32 compute (float64 for float64 inputs), differentiable by torch autograd;
``chunk_gated_delta_rule_reference_backward`` its closed-form reverse scan.
``chunk_gated_delta_rule_loop`` spells the definition out per sequence in float64, an
independent oracle for the tests.
"""

from __future__ import annotations

import torch

from custom_ops.runtime.thd_index import row_positions


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


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
    dtype = _compute_dtype(q)
    num_rows, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    group = hv // hk
    if scale is None:
        scale = dk**-0.5
    starts = row_positions(cu_seqlens, num_rows) == 0
    # value head h reads key head h // group
    qh = q.to(dtype).repeat_interleave(group, dim=1) * scale
    kh = k.to(dtype).repeat_interleave(group, dim=1)
    vc, decay, bc = v.to(dtype), g.to(dtype).exp(), beta.to(dtype)
    state = torch.zeros(hv, dk, dv, dtype=dtype, device=q.device)
    outs = []
    for t in range(num_rows):
        state = torch.where(starts[t], 0.0, state) * decay[t, :, None, None]
        pred = torch.einsum("hkv,hk->hv", state, kh[t])
        delta = bc[t, :, None] * (vc[t] - pred)
        state = state + kh[t, :, :, None] * delta[:, None, :]
        outs.append(torch.einsum("hkv,hk->hv", state, qh[t]))
    o = torch.stack(outs) if outs else vc.clone()  # T = 0: empty, still in the graph
    return o.to(q.dtype)


def chunk_gated_delta_rule_loop(q, k, v, g, beta, cu_seqlens, scale=None):
    """The recurrence per sequence and value head, in float64 (see the module docstring)."""
    q64, k64, v64, g64, b64 = (t.double() for t in (q, k, v, g, beta))
    hk, dk = q.shape[1], q.shape[2]
    hv, dv = v.shape[1], v.shape[2]
    if scale is None:
        scale = dk**-0.5
    out = torch.zeros(q.shape[0], hv, dv, dtype=torch.float64)
    cu = cu_seqlens.tolist()
    for start, end in zip(cu[:-1], cu[1:]):
        for h in range(hv):
            kh = h // (hv // hk)
            state = torch.zeros(dk, dv, dtype=torch.float64)
            for t in range(start, end):
                state = state * torch.exp(g64[t, h])
                residual = v64[t, h] - state.t() @ k64[t, kh]
                state = state + torch.outer(k64[t, kh], b64[t, h] * residual)
                out[t, h] = scale * (state.t() @ q64[t, kh])
    return out


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
    dtype = _compute_dtype(q)
    num_rows, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    group = hv // hk
    if scale is None:
        scale = dk**-0.5
    keep = (row_positions(cu_seqlens, num_rows) != 0).to(dtype)
    qh = q.to(dtype).repeat_interleave(group, dim=1)
    kh = k.to(dtype).repeat_interleave(group, dim=1)
    vc, bc, do = v.to(dtype), beta.to(dtype), grad_o.to(dtype)
    decay = g.to(dtype).exp() * keep[:, None]  # m_t a_t, [T, Hv]
    zero = torch.zeros(hv, dk, dv, dtype=dtype, device=q.device)
    states, residuals = [zero], []
    for t in range(num_rows):
        prior = states[-1] * decay[t, :, None, None]
        residual = vc[t] - torch.einsum("hkv,hk->hv", prior, kh[t])
        residuals.append(residual)
        states.append(prior + kh[t, :, :, None] * (bc[t, :, None] * residual)[:, None, :])
    dq = torch.zeros_like(qh)
    dkh = torch.zeros_like(kh)
    dvc = torch.zeros_like(vc)
    dg = torch.zeros(num_rows, hv, dtype=dtype, device=q.device)
    dbeta = torch.zeros_like(dg)
    ds = zero
    for t in reversed(range(num_rows)):
        prev, cur, residual = states[t], states[t + 1], residuals[t]
        prior = prev * decay[t, :, None, None]
        ds = ds + scale * qh[t, :, :, None] * do[t, :, None, :]
        dq[t] = scale * torch.einsum("hkv,hv->hk", cur, do[t])
        dd = torch.einsum("hkv,hk->hv", ds, kh[t])
        dp = -bc[t, :, None] * dd
        dkh[t] = torch.einsum("hkv,hv->hk", ds, bc[t, :, None] * residual) + torch.einsum("hkv,hv->hk", prior, dp)
        dvc[t] = bc[t, :, None] * dd
        dbeta[t] = (dd * residual).sum(-1)
        dprior = ds + kh[t, :, :, None] * dp[:, None, :]
        dg[t] = decay[t] * (dprior * prev).sum((-2, -1))
        ds = dprior * decay[t, :, None, None]
    dq = dq.view(num_rows, hk, group, dk).sum(2)
    dk_out = dkh.view(num_rows, hk, group, dk).sum(2)
    return dq.to(q.dtype), dk_out.to(k.dtype), dvc.to(v.dtype), dg.to(g.dtype), dbeta.to(beta.dtype)
