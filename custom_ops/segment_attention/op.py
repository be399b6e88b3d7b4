"""Segment ("varlen") attention as torch.library ops: forward, backward, fake, autograd.

``torch.ops.cp_ops.varlen_attention`` returns ``(out, lse, kv_rows)``, the window as two ints;
``custom_ops.varlen_attention`` returns ``(out, lse)``, the window a pair. With a key-row map
``key_rows`` the op reads K and V from one tensor ``kv [Tk, 2*Hkv, D]`` through it, all-gather
CP's gathered K/V in rank order (:func:`varlen_attention_kv`), returns ``kv_rows = kv[key_rows]``
for its backward (empty without a map) and gets kv's gradient back in kv's row order, one tensor.
The backward is two ops, ``varlen_attention_backward_dkdv`` (dk, dv and the rows' delta; dkv
with a map) and ``varlen_attention_backward_dq``, in that order, so that a collective on dk and
dv can overlap the dq kernel (docs/design.md section 4.2). All are opaque custom ops
(``kernel_op(opaque=True)``, section 2) launching through launch.py with ``ATTENTION_SETTINGS``.
"""

from __future__ import annotations

from typing import Optional

import torch

from custom_ops.runtime import precompile
from custom_ops.thd.checks import check_index_tensor
from custom_ops.runtime.gather import gather_rows, launch_gather_rows
from custom_ops.runtime.launch import use_triton
from custom_ops.runtime.registration import NAMESPACE, kernel_op
from custom_ops.thd.validation import Segments, checked
from custom_ops.segment_attention.configs import ATTENTION_SETTINGS
from custom_ops.segment_attention.launch import backward, backward_dkdv, backward_dkv_rows, backward_dq, forward
from custom_ops.segment_attention.reference import (
    _attention,
    backward_delta_reference,
    lse_dtype,
    resolve_scale,
    varlen_attention_backward_reference,
)

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_MAX_KERNEL_HEAD_DIM = 256


def check_gqa_heads(q: torch.Tensor, k: torch.Tensor) -> None:
    """q ``[T, Hq, D]`` and k ``[T, Hkv, D]`` pair up for GQA: ``Hkv >= 1`` divides ``Hq``."""
    if k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
        raise ValueError(
            f"the query heads ({q.shape[1]}) must be a multiple of the kv heads ({k.shape[1]}) for GQA"
        )


def _check(q, k, v, index_tensors, causal, window_left, window_right) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(f"{name} must be 3-D [tokens, heads, head_dim], got shape {tuple(t.shape)}")
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {t.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k and v must have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"q and k must have one head_dim, got {q.shape[2]} and {k.shape[2]}")
    check_gqa_heads(q, k)
    if q.shape[2] == 0:
        raise ValueError("head_dim must be at least 1")
    for name, t in zip(Segments._fields, index_tensors):
        check_index_tensor(name, t, q.device, min_numel=0)
    n_seg = index_tensors[0].shape[0]
    for name, t in zip(Segments._fields[1:], index_tensors[1:]):
        if t.shape[0] != n_seg:
            raise ValueError(f"{name} has {t.shape[0]} entries but q_start has {n_seg}; give one entry per segment")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    for name, w in (("window_left", window_left), ("window_right", window_right)):
        if isinstance(w, bool) or not isinstance(w, (int, torch.SymInt)):
            raise TypeError(f"{name} must be an int, got {type(w).__name__}")
        if w < -1:
            raise ValueError(f"{name} must be >= 0, or -1 for unbounded; got {w}")


def _check_keys(k, v, key_rows) -> None:
    """``k`` and ``v`` apart (``key_rows`` None), or ``k`` = kv ``[Tk, 2*Hkv, D]`` (K's heads,
    then V's) with ``v`` None and a row map ``key_rows`` int ``[Tk]``."""
    if key_rows is None:
        if v is None:
            raise ValueError("v is None: give v, or key_rows with k holding K's and V's heads [Tk, 2*Hkv, D]")
        return
    if v is not None:
        raise ValueError("with key_rows, k holds K's and V's heads [Tk, 2*Hkv, D] and v must be None")
    if not isinstance(k, torch.Tensor):
        raise TypeError(f"kv must be a torch.Tensor, got {type(k).__name__}")
    if k.dim() != 3 or k.shape[1] % 2:
        raise ValueError(f"kv must be [Tk, 2*Hkv, D] (K's heads, then V's), got shape {tuple(k.shape)}")
    check_index_tensor("key_rows", key_rows, k.device, min_numel=0)
    if key_rows.shape[0] != k.shape[0]:
        raise ValueError(f"key_rows has {key_rows.shape[0]} entries but kv has {k.shape[0]} rows; give one per row")


def _halves(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    hkv = kv.shape[1] // 2
    return kv[:, :hkv], kv[:, hkv:]


def _read_keys(q, k, v, key_rows, gather) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(k, v, kv_rows)`` the attention reads: ``k`` and ``v`` and an empty ``kv_rows``, or
    the halves of ``kv_rows = gather(kv, key_rows)`` (checked: :func:`_check_keys`)."""
    _check_keys(k, v, key_rows)
    if key_rows is None:
        return k, v, q.new_empty(0)
    kv_rows = gather(k, key_rows)
    return (*_halves(kv_rows), kv_rows)


def _use_kernel(q: torch.Tensor) -> bool:
    """The Triton path serves fp16/bf16/fp32; float64 (tests, gradcheck) runs the reference."""
    if not use_triton(q) or q.dtype == torch.float64:
        return False
    if q.shape[2] > _MAX_KERNEL_HEAD_DIM:
        raise ValueError(f"the Triton kernel supports head_dim <= {_MAX_KERNEL_HEAD_DIM}, got {q.shape[2]}")
    return True


@kernel_op(f"{NAMESPACE}::varlen_attention", mutates_args=(), opaque=True)
def _varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: Optional[torch.Tensor],
    q_start: torch.Tensor,
    q_len: torch.Tensor,
    q_pos: torch.Tensor,
    k_start: torch.Tensor,
    k_len: torch.Tensor,
    causal: bool = True,
    window_left: int = -1,
    window_right: int = -1,
    scale: float | None = None,
    key_rows: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out, lse, kv_rows)``: :func:`varlen_attention` with the window as two ints and an
    empty ``kv_rows``; with ``key_rows`` (int ``[Tk]``, a permutation of kv's rows, unchecked
    like the segments) and ``v`` None, :func:`varlen_attention_kv` of ``kv = k``, with
    ``kv_rows = kv[key_rows]``. Differentiable in q, k, v through out and lse; ``kv_rows`` is
    not differentiable."""
    k, v, kv_rows = _read_keys(q, k, v, key_rows, gather_rows)
    seg = Segments(q_start, q_len, q_pos, k_start, k_len)
    return (*attend(q, k, v, seg, causal, window_left, window_right, scale), kv_rows)


def attend(q, k, v, seg: Segments, causal, window_left, window_right, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward of the attention ops: checked, by the kernel or the reference."""
    _check(q, k, v, seg, causal, window_left, window_right)
    seg = seg._replace(q_start=checked("segments", seg.q_start, seg[1:], q.shape[0], k.shape[0]))
    scale = resolve_scale(scale, q.shape[2])
    if not _use_kernel(q):
        out, lse = _attention(q, k, v, seg, causal, window_left, window_right, scale)
        return out.contiguous(), lse.contiguous()  # the fake's layout
    return forward(q, k, v, seg, causal, window_left, window_right, scale, ATTENTION_SETTINGS)


def attend_fake(q, k, v, seg: Segments, causal, window_left, window_right) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward's outputs as a fake gives them, after the real op's checks."""
    _check(q, k, v, seg, causal, window_left, window_right)
    _use_kernel(q)  # same head_dim error as the real op
    return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=lse_dtype(q.dtype))


def dkdv_reference(dout, dlse, q, k, v, out, lse, seg: Segments, causal, left, right, scale):
    """``(dk, dv, delta)`` by the torch reference: the dk/dv backward ops' path off the kernels."""
    delta = backward_delta_reference(dout, out, dlse)
    _, dk, dv = varlen_attention_backward_reference(
        dout, dlse, q, k, v, out, lse, seg, causal, left, right, scale, delta
    )
    return dk, dv, delta


def _precompile(q, k, v, key_rows, seg, causal, left, right, scale) -> None:
    """Start compiling the forward's and the backward's kernels for these arguments (the fake
    tensors of a graph being traced) in the background (:mod:`custom_ops.runtime.precompile`); the
    backward for a contiguous ``dout`` and no ``dlse``, as the layers produce them. With a
    key-row map: the row gather's, the forward's, the dk/dv (with the map) and the dq kernels."""
    if q.dtype == torch.float64 or type(left) is not int or type(right) is not int:
        return

    def launchers(mq, mk, mv, mrows, *mseg):
        s = resolve_scale(scale, mq.shape[2])
        mseg = Segments(*mseg)
        if mrows is not None:
            mk, mv = _halves(launch_gather_rows(mk, mrows))
        out, lse = forward(mq, mk, mv, mseg, causal, left, right, s, ATTENTION_SETTINGS)
        dout, dlse = torch.empty_like(out), torch.empty_like(lse)
        if mrows is None:
            backward(dout, dlse, mq, mk, mv, out, lse, mseg, causal, left, right, s, ATTENTION_SETTINGS)
            return
        _, delta = backward_dkv_rows(dout, dlse, mq, mk, mv, out, lse, mseg, causal, left, right, s, mrows,
                                     ATTENTION_SETTINGS)  # fmt: skip
        backward_dq(dout, mq, mk, mv, lse, delta, mseg, causal, left, right, s, ATTENTION_SETTINGS)

    precompile.schedule("varlen_attention", launchers, q, k, v, key_rows, *seg, args=(causal, left, right))


@_varlen_attention.register_fake
def _(q, k, v, q_start, q_len, q_pos, k_start, k_len, causal=True, window_left=-1, window_right=-1, scale=None,
      key_rows=None):  # fmt: skip
    keys, values, kv_rows = _read_keys(q, k, v, key_rows, lambda kv, _: kv.new_empty(kv.shape))
    seg = Segments(q_start, q_len, q_pos, k_start, k_len)
    outputs = attend_fake(q, keys, values, seg, causal, window_left, window_right)
    _precompile(q, k, v, key_rows, seg, causal, window_left, window_right, scale)
    return (*outputs, kv_rows)


@kernel_op(f"{NAMESPACE}::varlen_attention_backward_dkdv", mutates_args=(), opaque=True)
def _varlen_attention_backward_dkdv(
    dout: torch.Tensor,
    dlse: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: Optional[torch.Tensor],
    out: torch.Tensor,
    lse: torch.Tensor,
    q_start: torch.Tensor,
    q_len: torch.Tensor,
    q_pos: torch.Tensor,
    k_start: torch.Tensor,
    k_len: torch.Tensor,
    causal: bool = True,
    window_left: int = -1,
    window_right: int = -1,
    scale: float | None = None,
    key_rows: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dk, dv, delta)`` of :func:`varlen_attention` given ``dout [Tq, Hq, D]`` and
    ``dlse [Hq, Tq]`` and the saved ``out`` and ``lse``; ``delta [Hq, Tq]`` (lse's dtype) is
    what ``varlen_attention_backward_dq`` takes. With ``key_rows``, ``k`` is the forward's
    ``kv_rows`` (``v`` None) and the result ``(dkv, empty, delta)``: dkv ``[Tk, 2*Hkv, D]`` in
    kv's row order, the gradient of key row b at row ``key_rows[b]``. Not differentiable itself."""
    keys, values, _ = _read_keys(q, k, v, key_rows, lambda kv_rows, _: kv_rows)
    seg = Segments(q_start, q_len, q_pos, k_start, k_len)
    _check(q, keys, values, seg, causal, window_left, window_right)
    scale = resolve_scale(scale, q.shape[2])
    mask = (causal, window_left, window_right, scale)
    if not _use_kernel(q):
        dk, dv, delta = dkdv_reference(dout, dlse, q, keys, values, out, lse, seg, *mask)
        if key_rows is None:
            return dk.contiguous(), dv.contiguous(), delta.contiguous()
        dkv = torch.empty_like(k).index_copy_(0, key_rows.long(), torch.cat([dk, dv], dim=1))
        return dkv, k.new_empty(0), delta.contiguous()
    if key_rows is None:
        return backward_dkdv(dout, dlse, q, k, v, out, lse, seg, *mask, ATTENTION_SETTINGS)
    dkv, delta = backward_dkv_rows(dout, dlse, q, keys, values, out, lse, seg, *mask, key_rows, ATTENTION_SETTINGS)
    return dkv, k.new_empty(0), delta


@_varlen_attention_backward_dkdv.register_fake
def _(dout, dlse, q, k, v, out, lse, q_start, q_len, q_pos, k_start, k_len, causal=True, window_left=-1,
      window_right=-1, scale=None, key_rows=None):  # fmt: skip
    keys, values, _ = _read_keys(q, k, v, key_rows, lambda kv_rows, _: kv_rows)
    _check(q, keys, values, Segments(q_start, q_len, q_pos, k_start, k_len), causal, window_left, window_right)
    dv = k.new_empty(0) if key_rows is not None else v.new_empty(v.shape)
    return k.new_empty(k.shape), dv, lse.new_empty(lse.shape)


@kernel_op(f"{NAMESPACE}::varlen_attention_backward_dq", mutates_args=(), opaque=True)
def _varlen_attention_backward_dq(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    q_start: torch.Tensor,
    q_len: torch.Tensor,
    q_pos: torch.Tensor,
    k_start: torch.Tensor,
    k_len: torch.Tensor,
    causal: bool = True,
    window_left: int = -1,
    window_right: int = -1,
    scale: float | None = None,
) -> torch.Tensor:
    """``dq`` of :func:`varlen_attention` given ``dout``, the saved ``lse`` and
    ``varlen_attention_backward_dkdv``'s ``delta``. Not differentiable itself."""
    seg = Segments(q_start, q_len, q_pos, k_start, k_len)
    _check(q, k, v, seg, causal, window_left, window_right)
    scale = resolve_scale(scale, q.shape[2])
    if not _use_kernel(q):
        dq, _, _ = varlen_attention_backward_reference(
            dout, None, q, k, v, None, lse, seg, causal, window_left, window_right, scale, delta
        )
        return dq.contiguous()
    return backward_dq(dout, q, k, v, lse, delta, seg, causal, window_left, window_right, scale, ATTENTION_SETTINGS)


@_varlen_attention_backward_dq.register_fake
def _(dout, q, k, v, lse, delta, q_start, q_len, q_pos, k_start, k_len, causal=True, window_left=-1, window_right=-1,
      scale=None):  # fmt: skip
    _check(q, k, v, Segments(q_start, q_len, q_pos, k_start, k_len), causal, window_left, window_right)
    return q.new_empty(q.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, *seg, causal, window_left, window_right, scale, key_rows = inputs
    out, lse, kv_rows = output
    ctx.mark_non_differentiable(kv_rows)
    keys = (k, v) if key_rows is None else (kv_rows, None)  # the gathered rows, not the gather's input
    ctx.save_for_backward(q, *keys, key_rows, out, lse, *seg)
    ctx.args = (causal, window_left, window_right, scale)


def cotangents(dout, dlse, out, lse) -> tuple[torch.Tensor, torch.Tensor]:
    """The backward's ``(dout, dlse)``, zeros for the one autograd passes as None (an output
    that the loss does not use)."""
    return (torch.zeros_like(out) if dout is None else dout), (torch.zeros_like(lse) if dlse is None else dlse)


def _backward(ctx, dout, dlse, _):
    q, k, v, key_rows, out, lse, *seg = ctx.saved_tensors
    dout, dlse = cotangents(dout, dlse, out, lse)
    # dk and dv (dkv) first: a collective on them (CP's reduce-scatter) can then run beside the dq kernel
    dk, dv, delta = _varlen_attention_backward_dkdv(dout, dlse, q, k, v, out, lse, *seg, *ctx.args, key_rows)
    keys = (k, v) if key_rows is None else _halves(k)
    dq = _varlen_attention_backward_dq(dout, q, *keys, lse, delta, *seg, *ctx.args)
    return (dq, dk, None if key_rows is not None else dv) + (None,) * (len(Segments._fields) + len(ctx.args) + 1)


_varlen_attention.register_autograd(_backward, setup_context=_setup_context)


def window_pair(window) -> tuple[int, int]:
    """``(left, right)`` of a ``window`` argument, a pair; raises TypeError for anything else."""
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise TypeError(f"window must be a pair (left, right) of ints, got {window!r}")
    return window[0], window[1]


def varlen_attention(
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
    """Attention over S segments in one launch: ``(out [Tq, Hq, D], lse [Hq, Tq])``.

    q ``[Tq, Hq, D]``; k, v ``[Tk, Hkv, D]``, ``Hq % Hkv == 0``; the five index tensors
    (int32/int64, ``[S]``) give segment s its query rows ``[q_start, q_start + q_len)`` at
    positions ``q_pos + a`` and key rows ``[k_start, k_start + k_len)`` at positions
    ``0 .. k_len - 1``, masked by ``causal`` and ``window = (left, right)`` (-1 unbounded;
    the mask: docs/design.md section 5). ``scale`` defaults to ``D ** -0.5``. out in q's
    dtype, lse float32 (float64 for float64); rows that see no key get 0 and -inf.
    Query segments disjoint, key ranges may overlap; values unchecked (no host sync):
    :func:`custom_ops.thd.validation.validate_varlen_segments`. Differentiable in q, k, v,
    through out and lse. fp16/bf16/fp32 run the Triton kernels (head_dim <= 256), float64
    the torch reference (docs/design.md section 2). Raises on bad shapes, dtypes, windows.
    """
    left, right = window_pair(window)
    out, lse, _ = _varlen_attention(q, k, v, q_start, q_len, q_pos, k_start, k_len, causal, left, right, scale)
    return out, lse


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
    ``torch.ops.cp_ops.varlen_attention`` with the key-row map, kv ``[Tk, 2*Hkv, D]`` (K's heads,
    then V's), the window as a pair; differentiable in q and kv, kv's gradient in its own row
    order. A piece of ``ag_thd_attention``, not API of its own."""
    left, right = window_pair(window)
    out, lse, _ = _varlen_attention(
        q, kv, None, q_start, q_len, q_pos, k_start, k_len, causal, left, right, scale, key_rows
    )
    return out, lse
