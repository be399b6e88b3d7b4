"""Segment attention over one K/V tensor read through a row map: the attention of all-gather CP
(docs/design.md section 4.2) on the gathered K/V as the all-gather delivers it, in rank order.

``torch.ops.cp_ops.varlen_attention_kv(q, kv, key_rows, *segments, ...)`` is
:func:`~custom_ops.varlen_attention` with ``k = kv[key_rows, :Hkv]`` and
``v = kv[key_rows, Hkv:]``; the gathered ``kv[key_rows]`` is its third output, which the
backward reads. Its gradient comes back in ``kv``'s row order in one tensor: the dk/dv kernel
stores row b's gradients at row ``key_rows[b]``
(``varlen_attention_kv_backward_dkdv``), so neither a reorder nor a concatenation of dk and dv
runs between the kernel and the reduce-scatter. dq is ``varlen_attention_backward_dq``'s. Both
ops are pieces of ``ag_thd_attention``, not API of their own.
"""

from __future__ import annotations

import torch

from custom_ops.runtime import precompile
from custom_ops.runtime.gather import gather_rows, launch_gather_rows
from custom_ops.runtime.registration import NAMESPACE, kernel_op
from custom_ops.segment_attention.configs import ATTENTION_SETTINGS
from custom_ops.segment_attention.launch import backward_dkv_rows, backward_dq, forward
from custom_ops.thd.checks import check_index_tensor
from custom_ops.thd.validation import Segments
from custom_ops.segment_attention.op import (
    _check,
    _use_kernel,
    _varlen_attention_backward_dq,
    attend,
    attend_fake,
    cotangents,
    dkdv_reference,
    window_pair,
)
from custom_ops.segment_attention.reference import resolve_scale

__all__ = ["varlen_attention_kv"]


def _check_kv(kv, key_rows) -> None:
    if not isinstance(kv, torch.Tensor):
        raise TypeError(f"kv must be a torch.Tensor, got {type(kv).__name__}")
    if kv.dim() != 3 or kv.shape[1] % 2:
        raise ValueError(f"kv must be [Tk, 2*Hkv, D] (K's heads, then V's), got shape {tuple(kv.shape)}")
    check_index_tensor("key_rows", key_rows, kv.device, min_numel=0)
    if key_rows.shape[0] != kv.shape[0]:
        raise ValueError(f"key_rows has {key_rows.shape[0]} entries but kv has {kv.shape[0]} rows; give one per row")


def _halves(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    hkv = kv.shape[1] // 2
    return kv[:, :hkv], kv[:, hkv:]


@kernel_op(f"{NAMESPACE}::varlen_attention_kv", mutates_args=(), opaque=True)
def _varlen_attention_kv(
    q: torch.Tensor,
    kv: torch.Tensor,
    key_rows: torch.Tensor,
    q_start: torch.Tensor,
    q_len: torch.Tensor,
    q_pos: torch.Tensor,
    k_start: torch.Tensor,
    k_len: torch.Tensor,
    causal: bool = True,
    window_left: int = -1,
    window_right: int = -1,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out, lse, kv[key_rows])``: ``varlen_attention`` of q over the keys and values
    ``kv[key_rows]`` (kv ``[Tk, 2*Hkv, D]``, K's heads then V's; key_rows int ``[Tk]``, a
    permutation of kv's rows, unchecked like the segments). Differentiable in q and kv through
    out and lse; the third output is not differentiable."""
    _check_kv(kv, key_rows)
    kv_rows = gather_rows(kv, key_rows)
    seg = Segments(q_start, q_len, q_pos, k_start, k_len)
    out, lse = attend(q, *_halves(kv_rows), seg, causal, window_left, window_right, scale)
    return out, lse, kv_rows


def _precompile(q, kv, key_rows, seg, causal, left, right, scale) -> None:
    """Start compiling the row gather's, the forward's, the dk/dv (with its row map) and the dq
    kernels for these arguments in the background, as ``varlen_attention``'s fake does for its own."""
    if q.dtype == torch.float64 or type(left) is not int or type(right) is not int:
        return

    def launchers(mq, mkv, mrows, *mseg):
        s = resolve_scale(scale, mq.shape[2])
        mseg = Segments(*mseg)
        k, v = _halves(launch_gather_rows(mkv, mrows))
        out, lse = forward(mq, k, v, mseg, causal, left, right, s, ATTENTION_SETTINGS)
        dout, dlse = torch.empty_like(out), torch.empty_like(lse)
        _, delta = backward_dkv_rows(
            dout, dlse, mq, k, v, out, lse, mseg, causal, left, right, s, mrows, ATTENTION_SETTINGS
        )
        backward_dq(dout, mq, k, v, lse, delta, mseg, causal, left, right, s, ATTENTION_SETTINGS)

    precompile.schedule("varlen_attention_kv", launchers, q, kv, key_rows, *seg, args=(causal, left, right))


@_varlen_attention_kv.register_fake
def _(q, kv, key_rows, q_start, q_len, q_pos, k_start, k_len, causal=True, window_left=-1, window_right=-1,
      scale=None):  # fmt: skip
    _check_kv(kv, key_rows)
    kv_rows = kv.new_empty(kv.shape)
    seg = Segments(q_start, q_len, q_pos, k_start, k_len)
    out, lse = attend_fake(q, *_halves(kv_rows), seg, causal, window_left, window_right)
    _precompile(q, kv, key_rows, seg, causal, window_left, window_right, scale)
    return out, lse, kv_rows


@kernel_op(f"{NAMESPACE}::varlen_attention_kv_backward_dkdv", mutates_args=(), opaque=True)
def _varlen_attention_kv_backward_dkdv(
    dout: torch.Tensor,
    dlse: torch.Tensor,
    q: torch.Tensor,
    kv_rows: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    key_rows: torch.Tensor,
    q_start: torch.Tensor,
    q_len: torch.Tensor,
    q_pos: torch.Tensor,
    k_start: torch.Tensor,
    k_len: torch.Tensor,
    causal: bool = True,
    window_left: int = -1,
    window_right: int = -1,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dkv, delta)`` of ``varlen_attention_kv`` given its saved ``kv[key_rows]`` (as
    ``kv_rows``), ``out`` and ``lse``: dkv ``[Tk, 2*Hkv, D]`` in kv's row order (the gradient of
    key row b at row ``key_rows[b]``), delta as ``varlen_attention_backward_dkdv``'s. Not
    differentiable itself."""
    _check_kv(kv_rows, key_rows)
    k, v = _halves(kv_rows)
    seg = Segments(q_start, q_len, q_pos, k_start, k_len)
    _check(q, k, v, seg, causal, window_left, window_right)
    scale = resolve_scale(scale, q.shape[2])
    if not _use_kernel(q):
        dk, dv, delta = dkdv_reference(dout, dlse, q, k, v, out, lse, seg, causal, window_left, window_right, scale)
        dkv = torch.empty_like(kv_rows).index_copy_(0, key_rows.long(), torch.cat([dk, dv], dim=1))
        return dkv, delta.contiguous()
    return backward_dkv_rows(
        dout, dlse, q, k, v, out, lse, seg, causal, window_left, window_right, scale, key_rows, ATTENTION_SETTINGS
    )


@_varlen_attention_kv_backward_dkdv.register_fake
def _(dout, dlse, q, kv_rows, out, lse, key_rows, q_start, q_len, q_pos, k_start, k_len, causal=True, window_left=-1,
      window_right=-1, scale=None):  # fmt: skip
    _check_kv(kv_rows, key_rows)
    _check(q, *_halves(kv_rows), Segments(q_start, q_len, q_pos, k_start, k_len), causal, window_left, window_right)
    return kv_rows.new_empty(kv_rows.shape), lse.new_empty(lse.shape)


def _setup_context(ctx, inputs, output):
    q, _, key_rows, *seg, causal, window_left, window_right, scale = inputs
    out, lse, kv_rows = output
    ctx.mark_non_differentiable(kv_rows)
    ctx.save_for_backward(q, kv_rows, key_rows, out, lse, *seg)
    ctx.args = (causal, window_left, window_right, scale)


def _backward(ctx, dout, dlse, _):
    q, kv_rows, key_rows, out, lse, *seg = ctx.saved_tensors
    dout, dlse = cotangents(dout, dlse, out, lse)
    # dkv first: the reduce-scatter of CP runs beside the dq kernel
    dkv, delta = _varlen_attention_kv_backward_dkdv(dout, dlse, q, kv_rows, out, lse, key_rows, *seg, *ctx.args)
    dq = _varlen_attention_backward_dq(dout, q, *_halves(kv_rows), lse, delta, *seg, *ctx.args)
    return (dq, dkv, None) + (None,) * (len(Segments._fields) + len(ctx.args))


_varlen_attention_kv.register_autograd(_backward, setup_context=_setup_context)


def varlen_attention_kv(
    q: torch.Tensor,
    kv: torch.Tensor,
    key_rows: torch.Tensor,
    q_start: torch.Tensor,
    q_len: torch.Tensor,
    q_pos: torch.Tensor,
    k_start: torch.Tensor,
    k_len: torch.Tensor,
    causal: bool = True,
    window: tuple[int, int] = (-1, -1),
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of ``varlen_attention(q, kv[key_rows, :Hkv], kv[key_rows, Hkv:], ...)``:
    ``torch.ops.cp_ops.varlen_attention_kv`` without its third output, the window as a pair."""
    left, right = window_pair(window)
    out, lse, _ = _varlen_attention_kv(q, kv, key_rows, q_start, q_len, q_pos, k_start, k_len, causal, left, right, scale)
    return out, lse
