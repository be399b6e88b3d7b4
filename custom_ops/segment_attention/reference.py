"""Torch references for segment ("varlen") attention: the mask and the softmax of
docs/design.md section 5, over ``Segments`` (query rows at ``q_pos + a``, key rows at ``b``).

:func:`varlen_attention_reference` (dense ``[Hq, Tq, Tk]`` masked softmax, no host sync) is
what the op runs on CPU and :func:`varlen_attention_backward_reference` the closed-form
gradient of its CPU backward; :func:`varlen_attention_loop` spells the definition out as a
Python loop over segments and heads in float64, an independent oracle for tests and
benchmarks. Rows that see no key, and rows in no segment, get ``out = 0``, ``lse = -inf``.
"""

from __future__ import annotations

import torch

from custom_ops.runtime.dtypes import accumulation_dtype
from custom_ops.thd.validation import Segments


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """lse is float32, except for float64 inputs (float64, so gradcheck sees exact values)."""
    return accumulation_dtype(dtype)


def resolve_scale(scale: float | None, head_dim: int) -> float:
    """``scale``, or ``head_dim ** -0.5``; a plain float (a symbolic head_dim specialises)."""
    return float(head_dim) ** -0.5 if scale is None else float(scale)


def visibility_mask(
    seg: Segments,
    num_q_rows: int,
    num_k_rows: int,
    causal: bool,
    window_left: int,
    window_right: int,
) -> torch.Tensor:
    """``[Tq, Tk]`` bool: query row t may attend to key row u.

    Each query row's segment comes from a dense ``[Tq, S]`` membership test (no
    sorting assumed, empty segments anywhere); rows in no segment see nothing.
    """
    q_start, q_len, q_pos, k_start, k_len = seg
    device = q_start.device
    rows = torch.arange(num_q_rows, device=device, dtype=torch.int64)
    cols = torch.arange(num_k_rows, device=device, dtype=torch.int64)
    n_seg = q_start.shape[0]
    if n_seg == 0 or num_q_rows == 0:
        return torch.zeros(num_q_rows, num_k_rows, dtype=torch.bool, device=device)
    qs, ql, qp = q_start.long(), q_len.long(), q_pos.long()
    ks, kl = k_start.long(), k_len.long()
    member = (rows[:, None] >= qs[None, :]) & (rows[:, None] < (qs + ql)[None, :])  # [Tq, S]
    in_seg = member.any(dim=1)
    seg = member.to(torch.int8).argmax(dim=1)  # the segment holding each row (0 when none)
    pos = (qp[seg] + rows - qs[seg])[:, None]  # [Tq, 1]
    b = cols[None, :] - ks[seg][:, None]  # key position within the row's segment, [Tq, Tk]
    visible = in_seg[:, None] & (b >= 0) & (b < kl[seg][:, None])
    if causal:
        visible = visible & (b <= pos)
    if window_left >= 0:
        visible = visible & (pos - b <= window_left)
    if window_right >= 0:
        visible = visible & (b - pos <= window_right)
    return visible


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """``[Hq, Tq, Tk]`` scaled scores in the compute dtype; GQA without copying k."""
    tq, hq, d = q.shape
    tk, hkv, _ = k.shape
    dt = accumulation_dtype(q.dtype)
    q4 = q.to(dt).reshape(tq, hkv, hq // hkv, d)
    s = torch.einsum("tkgd,ukd->kgtu", q4, k.to(dt)) * scale
    return s.reshape(hq, tq, tk)


def _group_sum(x: torch.Tensor, hkv: int) -> torch.Tensor:
    """``[Hq, T, D] -> [T, Hkv, D]``: sum over the query heads of each kv group."""
    hq, t, d = x.shape
    return x.reshape(hkv, hq // hkv, t, d).sum(dim=1).permute(1, 0, 2)


def _expand_kv(x: torch.Tensor, hq: int) -> torch.Tensor:
    """``[T, Hkv, D] -> [Hq, T, D]``: each query head's kv head (h // group)."""
    t, hkv, d = x.shape
    return x.permute(1, 0, 2)[:, None].expand(hkv, hq // hkv, t, d).reshape(hq, t, d)


def _attention(q, k, v, seg: Segments, causal, window_left, window_right, scale):
    scale = resolve_scale(scale, q.shape[-1])
    visible = visibility_mask(seg, q.shape[0], k.shape[0], causal, window_left, window_right)
    s = _scores(q, k, scale)
    any_visible = visible.any(dim=1)  # [Tq]
    # Rows with no visible key get finite dummy scores so neither the softmax nor
    # its gradient sees (-inf) - (-inf); their p is then zeroed by the mask.
    fill = torch.where(any_visible, float("-inf"), 0.0).to(s.dtype)[None, :, None]
    s_safe = torch.where(visible[None], s, fill)
    lse_safe = torch.logsumexp(s_safe, dim=-1)  # [Hq, Tq]
    p = torch.exp(s_safe - lse_safe[..., None]) * visible[None]
    out = torch.einsum("htu,hud->thd", p, _expand_kv(v.to(s.dtype), q.shape[1]))
    lse = torch.where(any_visible[None], lse_safe, float("-inf"))
    return out.to(q.dtype), lse.to(lse_dtype(q.dtype))


def varlen_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_start: torch.Tensor,
    q_len: torch.Tensor,
    q_pos: torch.Tensor,
    k_start: torch.Tensor,
    k_len: torch.Tensor,
    causal: bool = True,
    window: tuple[int, int] = (-1, -1),
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Segment attention as a dense masked softmax: ``(out [Tq, Hq, D], lse [Hq, Tq])``.

    Same contract as :func:`custom_ops.varlen_attention` (see the module
    docstring). Memory is ``O(Hq * Tq * Tk)``: for CPU-sized inputs and as an
    oracle. Differentiable by torch autograd in q, k, v (rows with no visible
    key get zero gradient, never NaN).
    """
    return _attention(q, k, v, Segments(q_start, q_len, q_pos, k_start, k_len), causal, window[0], window[1], scale)


def backward_delta_reference(dout: torch.Tensor, out: torch.Tensor, dlse: torch.Tensor) -> torch.Tensor:
    """``delta [Hq, Tq] = <dout, out> - dlse`` per row and head, in lse's dtype: the term both
    gradients subtract from dP."""
    dt = lse_dtype(out.dtype)
    return (dout.to(dt) * out.to(dt)).sum(-1).transpose(0, 1) - dlse.to(dt)


def varlen_attention_backward_reference(
    dout: torch.Tensor,
    dlse: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    seg: Segments,
    causal: bool,
    window_left: int,
    window_right: int,
    scale: float | None,
    delta: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Closed-form gradients ``(dq, dk, dv)`` from the saved ``out`` and ``lse``; ``delta``
    (:func:`backward_delta_reference`) in place of ``dout``, ``out`` and ``dlse``'s where given.

    With ``P_ab = exp(s_ab - lse_a)`` on visible pairs (0 elsewhere) and
    ``delta_a = <dout_a, out_a> - dlse_a``:

        dv_b = sum_a P_ab dout_a
        dS_ab = P_ab (<dout_a, v_b> - delta_a)
        dq_a = scale * sum_b dS_ab k_b,   dk_b = scale * sum_a dS_ab q_a

    (the ``dlse`` term: d lse_a / d s_ab = P_ab). dk and dv sum over the query
    heads of each kv group and over every segment whose key range holds the row.
    """
    scale = resolve_scale(scale, q.shape[-1])
    hq, hkv = q.shape[1], k.shape[1]
    visible = visibility_mask(seg, q.shape[0], k.shape[0], causal, window_left, window_right)
    s = _scores(q, k, scale)
    dt = s.dtype
    lse_c = lse.to(dt)
    lse_safe = torch.where(torch.isfinite(lse_c), lse_c, 0.0)
    p = torch.exp(torch.where(visible[None], s, float("-inf")) - lse_safe[..., None])  # [Hq, Tq, Tk]
    do = dout.to(dt).permute(1, 0, 2)  # [Hq, Tq, D]
    delta = backward_delta_reference(dout, out, dlse) if delta is None else delta
    delta = delta.to(dt)
    ke, ve = _expand_kv(k.to(dt), hq), _expand_kv(v.to(dt), hq)  # [Hq, Tk, D]
    dv = _group_sum(p.transpose(1, 2) @ do, hkv)
    ds = p * (do @ ve.transpose(1, 2) - delta[..., None])
    dq = (ds @ ke).permute(1, 0, 2) * scale
    dk = _group_sum(ds.transpose(1, 2) @ q.to(dt).permute(1, 0, 2), hkv) * scale
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def varlen_attention_loop(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_start: torch.Tensor,
    q_len: torch.Tensor,
    q_pos: torch.Tensor,
    k_start: torch.Tensor,
    k_len: torch.Tensor,
    causal: bool = True,
    window: tuple[int, int] = (-1, -1),
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition as a Python loop over (segment, head), in float64; syncs with the host.

    Returns float64 ``(out, lse)``; differentiable by autograd in q, k, v.
    """
    tq, hq, d = q.shape
    group = hq // k.shape[1]
    scale = resolve_scale(scale, d)
    left, right = window
    q64, k64, v64 = q.double(), k.double(), v.double()
    out = torch.zeros(tq, hq, d, dtype=torch.float64)
    lse = torch.full((hq, tq), float("-inf"), dtype=torch.float64)
    for qs, ql, qp, ks, kl in zip(q_start.tolist(), q_len.tolist(), q_pos.tolist(), k_start.tolist(), k_len.tolist()):
        if ql <= 0:
            continue
        pos = torch.arange(ql)[:, None] + qp
        b = torch.arange(max(kl, 0))[None, :]
        seen = torch.ones(ql, max(kl, 0), dtype=torch.bool)
        if causal:
            seen &= b <= pos
        if left >= 0:
            seen &= pos - b <= left
        if right >= 0:
            seen &= b - pos <= right
        rows = seen.any(dim=1)
        if not rows.any():
            continue
        for h in range(hq):
            qh = q64[qs : qs + ql, h][rows]
            kh, vh = k64[ks : ks + kl, h // group], v64[ks : ks + kl, h // group]
            scores = (qh @ kh.T * scale).masked_fill(~seen[rows], float("-inf"))
            row_lse = torch.logsumexp(scores, dim=1)
            idx = torch.arange(qs, qs + ql)[rows]
            out[idx, h] = torch.softmax(scores, dim=1) @ vh
            lse[h, idx] = row_lse
    return out, lse


def key_tile_segments_reference(ql, ks, kl, block: int, num_tiles: int, num_k_rows: int):
    """``(order, first, last)`` of the dk/dv kernel's key tiles in torch ops, the definition
    ``custom_ops.segment_attention.kernels.schedule.key_tile_segments_kernel`` is tested against.

    ``order``: the segments sorted by key start (stable), those with no query or no key last
    (and in no tile's slice). Key tile t (rows ``[t*block, (t+1)*block)``) can only be
    reached by ``order[first[t]:last[t]]``: ``last[t]`` counts the sorted segments that
    start before the tile ends, ``first[t]`` those whose running maximum of key ends is
    at or before the tile's start (so they and every segment before them end there).
    """
    live = (ql > 0) & (kl > 0)
    start = torch.where(live, ks, num_k_rows + block)  # past every tile's end
    end = torch.where(live, ks + kl, 0)
    order = torch.argsort(start, stable=True)
    reach = torch.cummax(end[order], 0).values.contiguous()
    tile_start = torch.arange(num_tiles, dtype=torch.int32, device=ks.device) * block
    first = torch.searchsorted(reach, tile_start, right=True, out_int32=True)
    last = torch.searchsorted(start[order].contiguous(), tile_start + block, out_int32=True)
    return order.int(), first, last
