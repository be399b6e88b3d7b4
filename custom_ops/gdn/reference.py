"""Torch references for the Gated DeltaNet core ops on packed (THD) sequences.

Two kinds of function live here:

* ``*_reference``: what the ops run on CPU, with the ops' signatures. They are
  written without host syncs (no ``.tolist()``, ``.item()``, no branches on
  values): sequence boundaries become masks computed on the device from
  ``cu_seqlens``. They compute in float32 (float64 for float64 inputs) and are
  differentiable by torch autograd, which is how the CPU backward is obtained.
* ``*_loop``: the definitions spelled out as plain per-sequence Python loops in
  float64 (``.tolist()`` allowed): independent oracles for the tests.

Conventions (those of flash-linear-attention, so the CUDA path that wraps its
kernels computes the same function):

causal_conv1d, per sequence with zero history before its first row::

    y[t, c] = act( bias[c] + sum_{j=0}^{K-1} weight[c, K-1-j] * x[t-j, c] )

(``weight[:, K-1]`` multiplies the current row; ``x[t-j]`` is zero before the
sequence start). This is ``nn.Conv1d(groups=C, padding=K-1)`` cut to the first
T outputs, with the Conv1d weight ``[C, 1, K]`` squeezed to ``[C, K]``.

chunk_gated_delta_rule, per sequence with zero initial state ``S [dk, dv]`` per
value head h (key head ``h // (Hv/Hk)``)::

    S   = exp(g_t) * S
    S   = S + k_t (beta_t * (v_t - S^T k_t))^T
    o_t = scale * S^T q_t
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_ACTIVATIONS = (None, "identity", "silu", "swish")


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def row_positions(cu_seqlens: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Position of every packed row inside its sequence (int64 ``[num_rows]``), on the device.

    Row t belongs to the sequence i with ``cu[i] <= t < cu[i+1]`` (zero-length
    sequences are skipped by the right-sided search); its position is
    ``t - cu[i]``. Rows past ``cu[-1]`` count as continuing the last sequence.
    """
    cu = cu_seqlens.to(torch.int64)
    t = torch.arange(num_rows, device=cu.device, dtype=torch.int64)
    seq = (torch.searchsorted(cu, t, right=True) - 1).clamp(min=0, max=max(cu.numel() - 1, 0))
    return t - cu[seq]


def _activate(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation in ("silu", "swish"):
        return F.silu(y)
    return y


def check_activation(activation) -> None:
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation must be one of {_ACTIVATIONS}, got {activation!r}")


def causal_conv1d_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Depthwise causal conv1d per packed sequence (see the module docstring).

    x ``[T, C]``, weight ``[C, K]``, bias ``[C]`` or None, cu_seqlens ``[B+1]``.
    Returns ``[T, C]`` in x's dtype. Tap j (looking j rows back) is masked where
    the row's position in its sequence is below j: the zero history.
    """
    check_activation(activation)
    dtype = _compute_dtype(x)
    num_rows, kernel = x.shape[0], weight.shape[1]
    pos = row_positions(cu_seqlens, num_rows)
    xc, wc = x.to(dtype), weight.to(dtype)
    y = torch.zeros_like(xc)
    for j in range(kernel):
        shifted = F.pad(xc, (0, 0, j, 0))[:num_rows]  # shifted[t] = x[t - j]
        visible = (pos >= j).unsqueeze(-1)
        y = y + torch.where(visible, shifted, 0.0) * wc[:, kernel - 1 - j]
    if bias is not None:
        y = y + bias.to(dtype)
    return _activate(y, activation).to(x.dtype)


def causal_conv1d_gather_reference(
    x: torch.Tensor,
    rows: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(causal_conv1d_reference(x[rows, :C], ...), x[rows, C:])`` with ``C = weight.shape[0]``:
    the conv of x's rows taken in the order ``rows`` and the rest of those rows."""
    xs = x.index_select(0, rows)
    channels = weight.shape[0]
    y = causal_conv1d_reference(xs[:, :channels], weight, bias, cu_seqlens, activation)
    return y, xs[:, channels:].clone(memory_format=torch.contiguous_format)  # new memory, even when empty


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


# --- independent float64 oracles (host loops) -----------------------------------------------


def causal_conv1d_loop(x, weight, bias, cu_seqlens, activation="silu"):
    """The conv definition as loops over sequences, rows and taps, in float64."""
    x64, w64 = x.double(), weight.double()
    kernel = w64.shape[1]
    out = torch.zeros_like(x64)
    cu = cu_seqlens.tolist()
    for start, end in zip(cu[:-1], cu[1:]):
        for t in range(start, end):
            acc = bias.double().clone() if bias is not None else torch.zeros_like(x64[0])
            for j in range(kernel):
                if t - j >= start:
                    acc = acc + w64[:, kernel - 1 - j] * x64[t - j]
            out[t] = F.silu(acc) if activation in ("silu", "swish") else acc
    return out


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


# --- hand-derived backward passes (what the ops' CPU backward runs) -------------------------
#
# A custom op's body runs with the autograd dispatch keys excluded, so the CPU backward
# cannot differentiate the references with torch autograd; these reverse passes are the
# chain rule written out, and the tests check them against autograd through the references.


def causal_conv1d_reference_backward(
    grad_y: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx ``[T, C]``, dweight ``[C, K]``, dbias ``[C]``) of :func:`causal_conv1d_reference`.

    With ``pre`` the conv before the activation and ``dpre = dy * act'(pre)``:
    ``dx[s] = sum_j [pos(s+j) >= j] dpre[s+j] w[:, K-1-j]``,
    ``dw[:, K-1-j] = sum_t [pos(t) >= j] dpre[t] x[t-j]``, ``db = sum_t dpre[t]``.
    dbias is returned (as the sum) even when bias is None.
    """
    dtype = _compute_dtype(x)
    num_rows, kernel = x.shape[0], weight.shape[1]
    pos = row_positions(cu_seqlens, num_rows)
    xc, wc, dy = x.to(dtype), weight.to(dtype), grad_y.to(dtype)
    taps = []
    pre = torch.zeros_like(xc)
    for j in range(kernel):
        visible = (pos >= j).unsqueeze(-1)
        shifted = torch.where(visible, F.pad(xc, (0, 0, j, 0))[:num_rows], 0.0)
        taps.append((visible, shifted))
        pre = pre + shifted * wc[:, kernel - 1 - j]
    if bias is not None:
        pre = pre + bias.to(dtype)
    if activation in ("silu", "swish"):
        sig = torch.sigmoid(pre)
        dpre = dy * sig * (1 + pre * (1 - sig))
    else:
        dpre = dy
    dx = torch.zeros_like(xc)
    dw = torch.zeros_like(wc)
    for j, (visible, shifted) in enumerate(taps):
        masked = torch.where(visible, dpre, 0.0)
        dx = dx + F.pad(masked, (0, 0, 0, j))[j:] * wc[:, kernel - 1 - j]  # row s gets dpre[s + j]
        dw[:, kernel - 1 - j] = (masked * shifted).sum(0)
    db = dpre.sum(0)
    return dx.to(x.dtype), dw.to(weight.dtype), db.to(bias.dtype if bias is not None else weight.dtype)


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

    Per value head, with ``m_t`` = 0 at a sequence start (else 1), ``a_t = exp(g_t)``::

        P_t = m_t a_t S_{t-1};  p_t = P_t^T k_t;  d_t = beta_t (v_t - p_t)
        S_t = P_t + k_t d_t^T;  o_t = scale S_t^T q_t

    the reverse pass carries ``dS`` (gradient of S_t from later rows):
    ``dS += scale q_t do_t^T``, ``dq_t = scale S_t do_t``, ``dd = dS^T k_t``,
    ``dk_t = dS d_t + P_t dp`` with ``dp = -beta_t dd``, ``dv_t = beta_t dd``,
    ``dbeta_t = dd . (v_t - p_t)``, ``dP = dS + k_t dp^T``,
    ``dg_t = m_t a_t <dP, S_{t-1}>`` and ``dS <- m_t a_t dP``. The forward is rerun to
    keep every S_t (memory ``T*Hv*dk*dv``: fine for CPU tests). Key-head gradients
    are summed over the value heads that share the key head.
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
