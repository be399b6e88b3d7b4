"""Segment ("varlen") attention as torch.library ops: forward, backward, fake, autograd.

``torch.ops.cp_ops.varlen_attention(Tensor q, Tensor k, Tensor v, Tensor q_start,
Tensor q_len, Tensor q_pos, Tensor k_start, Tensor k_len, bool causal=True,
SymInt window_left=-1, SymInt window_right=-1, float? scale=None) -> (Tensor, Tensor)``
returns ``(out, lse)``.

``custom_ops.varlen_attention`` is the same op with ``window=(left, right)``.
The backward is its own op, ``torch.ops.cp_ops.varlen_attention_backward``.

Both register as opaque custom ops (``kernel_op(opaque=True)``): on Hopper their kernels
read K/V (q/dout in dk/dv) through host TMA descriptors, which torch cannot capture when it
traces a ``triton_op``'s body. Their bodies therefore only ever see real tensors and launch
the kernels directly, without ``wrap_triton`` (whose tracing machinery, run in eager mode
too, cost more host time per launch than some of these kernels take on the GPU).
"""

from __future__ import annotations

import functools
import math

import torch

from custom_ops._common import (
    NAMESPACE,
    cdiv,
    check_index_tensor,
    kernel_op,
    launch_direct,
    triton_interpreting,
    unit_last_stride,
    use_triton,
)
from custom_ops.varlen_attention import kernels
from custom_ops.varlen_attention.kernels import (
    TABLE_BLOCK,
    WORK_BUCKETS,
    has_tma_config,
    kernel_config,
    segment_tables_kernel,
    varlen_attn_bwd_dkdv_kernel,
    varlen_attn_bwd_dq_kernel,
    varlen_attn_fwd_kernel,
)
from custom_ops.varlen_attention.reference import (
    _attention,
    lse_dtype,
    resolve_scale,
    varlen_attention_backward_reference,
)
from custom_ops.validation import checked

_INDEX_NAMES = ("q_start", "q_len", "q_pos", "k_start", "k_len")
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_MAX_KERNEL_HEAD_DIM = 256
_LOG2E = 1.4426950408889634


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
    for name, t in zip(_INDEX_NAMES, index_tensors):
        check_index_tensor(name, t, q.device, min_numel=0)
    n_seg = index_tensors[0].shape[0]
    for name, t in zip(_INDEX_NAMES[1:], index_tensors[1:]):
        if t.shape[0] != n_seg:
            raise ValueError(f"{name} has {t.shape[0]} entries but q_start has {n_seg}; give one entry per segment")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    for name, w in (("window_left", window_left), ("window_right", window_right)):
        if isinstance(w, bool) or not isinstance(w, (int, torch.SymInt)):
            raise TypeError(f"{name} must be an int, got {type(w).__name__}")
        if w < -1:
            raise ValueError(f"{name} must be >= 0, or -1 for unbounded; got {w}")


def _use_kernel(q: torch.Tensor) -> bool:
    """The Triton path serves fp16/bf16/fp32; float64 (tests, gradcheck) runs the reference."""
    if not use_triton(q) or q.dtype == torch.float64:
        return False
    if q.shape[2] > _MAX_KERNEL_HEAD_DIM:
        raise ValueError(f"the Triton kernel supports head_dim <= {_MAX_KERNEL_HEAD_DIM}, got {q.shape[2]}")
    return True


def _segment_tables(
    seg, num_q_rows: int, num_k_rows: int, kernel: str, cfg: dict, num_tiles: int, causal: bool, left: int,
    right: int, chunk: int = TABLE_BLOCK,
):
    """``((q_start, q_len, q_pos, k_start, k_len), tile_seg, tile_row)``, int32 on the device,
    from one launch of :func:`segment_tables_kernel`: the segment tables clamped into the
    tensors (an invalid layout gives wrong rows but never an out-of-bounds access; validate
    with validate_varlen_segments), and for the ``num_tiles`` programs of a forward or dq grid
    (``kernel``) with ``cfg``'s tiles, in launch order, each one's segment (``len(q_start)``
    past the last query tile) and query tile within it. The segments run heaviest first (by
    the visible keys of their last query tile under the mask) where
    ``kernels.SEGMENTS_BY_WORK[kernel]``, else last to first; each segment's tiles last to
    first. Sized from shapes only."""
    seg = [t.contiguous() for t in seg]  # the kernel reads them with unit stride
    n_seg = seg[0].shape[0]
    dev = seg[0].device
    tab = torch.empty((5, n_seg), dtype=torch.int32, device=dev)
    cum = torch.empty(n_seg, dtype=torch.int32, device=dev)  # scratch: the kernel reads it back
    tiles = torch.empty((5, num_tiles), dtype=torch.int32, device=dev)
    launch_direct(
        segment_tables_kernel, (1,),
        *seg, tab, cum, tiles, n_seg, num_q_rows, num_k_rows, num_tiles, left, right,
        CAUSAL=causal, TILE=cfg["BLOCK_M"], KEY_TILE=cfg["BLOCK_N"], BY_WORK=kernels.SEGMENTS_BY_WORK[kernel],
        BLOCK=chunk, BUCKETS=WORK_BUCKETS, num_warps=4,
    )  # fmt: skip
    return tab.unbind(0), tiles[0], tiles[1]


def _key_tile_segments(qs, ql, ks, kl, block: int, num_tiles: int, num_k_rows: int):
    """``(order, first, last)`` for the dk/dv kernel, on the device and sized from shapes.

    ``order``: the segments sorted by key start, those with no query or no key last
    (and in no tile's slice). Key tile t (rows ``[t*block, (t+1)*block)``) can only be
    reached by ``order[first[t]:last[t]]``: ``last[t]`` counts the sorted segments that
    start before the tile ends, ``first[t]`` those whose running maximum of key ends is
    at or before the tile's start (so they and every segment before them end there).
    Disjoint and identical key ranges (self-attention, all-gather CP) make the slice
    exactly the segments that reach the tile; other overlaps may add some that
    miss it, which the kernel skips (a few scalar loads each: one wide key range
    that spans many short ones makes every tile under it scan all of them).
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


def _block_d(head_dim) -> int:
    """The power-of-two head-dim tile (>= 16). Plain comparisons, so a symbolic
    head_dim under torch.compile specialises instead of failing."""
    block = 16
    while block < head_dim:
        block *= 2
    return block


@functools.lru_cache(maxsize=None)
def _device_has_tma(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def _tma_layout_ok(t: torch.Tensor, head_dim: int) -> bool:
    """Whether a host TMA descriptor can read ``t`` ([rows, heads, head_dim]) as the 2-D view
    ``[rows, heads * head_dim]``: heads adjacent, rows apart and 16-byte aligned, start 16-byte
    aligned. The ops register as opaque custom ops (``kernel_op(opaque=True)``), so ``t`` is a
    real tensor."""
    size = t.element_size()
    if t.shape[0] == 0 or t.stride(2) != 1 or (t.shape[1] > 1 and t.stride(1) != head_dim):
        return False
    if t.shape[0] > 1 and t.stride(0) < t.shape[1] * head_dim:  # rows overlap (e.g. expanded)
        return False
    return (t.stride(0) * size) % 16 == 0 and t.data_ptr() % 16 == 0


def tma_usable(kernel: str, head_dim: int, block_d: int, *tensors: torch.Tensor) -> bool:
    """Whether ``kernel`` loads its streamed tiles (``tensors``) through TMA descriptors:
    enabled (``kernels.TMA_ENABLED``), a TMA config for the head dim, 2-byte elements, D a
    power of two (the tile is exactly one head wide), a GPU with TMA (sm_90 and later; the
    interpreter runs descriptors too), and the layout of :func:`_tma_layout_ok`."""
    t = tensors[0]
    if not kernels.TMA_ENABLED or block_d != head_dim or t.element_size() != 2:
        return False
    if not has_tma_config(kernel, block_d):
        return False
    if t.device.type == "cuda":
        if not _device_has_tma(t.device.index if t.device.index is not None else torch.cuda.current_device()):
            return False
    elif not triton_interpreting():
        return False
    return all(_tma_layout_ok(x, head_dim) for x in tensors)


# The tile dimension of each kernel's streamed rows: key rows in the forward and dq, query rows in dk/dv.
_STREAMED_ROWS = {"fwd": "BLOCK_N", "bwd_dq": "BLOCK_N", "bwd_dkdv": "BLOCK_M"}


def _launch_config(kernel: str, head_dim: int, block_d: int, *streamed: torch.Tensor):
    """``(config, descriptors)`` for launching ``kernel``: the TMA config and host descriptors of
    the ``streamed`` tensors (as ``[rows, heads * D]``, one tile of streamed rows by ``block_d``)
    where :func:`tma_usable`, else the pointer-load config and Nones."""
    tma = tma_usable(kernel, head_dim, block_d, *streamed)
    cfg = kernel_config(kernel, block_d, triton_interpreting(), streamed[0].element_size(), tma)
    if not tma:
        return cfg, (None,) * len(streamed)
    from triton.tools.tensor_descriptor import TensorDescriptor

    box = [cfg[_STREAMED_ROWS[kernel]], block_d]
    return cfg, tuple(TensorDescriptor.from_tensor(t.view(t.shape[0], -1), box) for t in streamed)


def _head_group(kernel: str, num_kv_heads: int, per_kv_head: int) -> int:
    """The HEAD_GROUP launch constant of ``kernel``: the largest count of kv heads dividing
    both ``kernels.HEAD_GROUP[kernel]`` and ``num_kv_heads``, as grid parts, of which each kv
    head has ``per_kv_head`` (its query heads in the forward and dq, PARTS in dk/dv)."""
    return math.gcd(kernels.HEAD_GROUP[kernel], num_kv_heads) * per_kv_head


def _has_window(left: int, right: int) -> bool:
    """The kernels' WINDOW: whether the mask has a window side (compiled out of the elementwise
    mask without one; two specializations per kernel, not one per window)."""
    return left >= 0 or right >= 0


def _forward_kernel(q, k, v, seg, causal, left, right, scale):
    tq, hq, d = q.shape
    hkv = k.shape[1]
    n_seg = seg[0].shape[0]
    # rows in no segment are never visited by a program: they stay out = 0, lse = -inf
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.full((hq, tq), float("-inf"), dtype=torch.float32, device=q.device)
    if n_seg == 0 or tq == 0 or hq == 0:
        return out, lse
    q, k, v = unit_last_stride(q), unit_last_stride(k), unit_last_stride(v)
    block_d = _block_d(d)
    cfg, descriptors = _launch_config("fwd", d, block_d, k, v)
    num_tiles = cdiv(tq, cfg["BLOCK_M"]) + n_seg
    (qs, ql, qp, ks, kl), tile_seg, tile_row = _segment_tables(
        seg, tq, k.shape[0], "fwd", cfg, num_tiles, causal, left, right
    )
    launch_direct(
        varlen_attn_fwd_kernel, (num_tiles * hq,),
        q, k, v, out, lse, *descriptors,
        qs, ql, qp, ks, kl, tile_seg, tile_row, n_seg,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), lse.stride(0),
        hq // hkv, hq, scale * _LOG2E, left, right,
        CAUSAL=causal, WINDOW=_has_window(left, right), HEAD_DIM=d, BLOCK_D=block_d,
        HEAD_GROUP=_head_group("fwd", hkv, hq // hkv), **cfg,
    )  # fmt: skip
    return out, lse


def _backward_kernel(dout, dlse, q, k, v, out, lse, seg, causal, left, right, scale):
    tq, hq, d = q.shape
    tk, hkv, _ = k.shape
    n_seg = seg[0].shape[0]
    dq = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    if n_seg == 0 or tq == 0 or hq == 0 or tk == 0:
        return dq, torch.zeros_like(k), torch.zeros_like(v)
    q, k, v, out, dout = (unit_last_stride(t) for t in (q, k, v, out, dout))
    lse = lse.contiguous()
    dlse = dlse.to(torch.float32).contiguous()
    block_d = _block_d(d)

    # written by the dq kernel for the rows of every segment, read by the dk/dv kernel after it
    delta = torch.empty((hq, tq), dtype=torch.float32, device=q.device)
    cfg, descriptors = _launch_config("bwd_dq", d, block_d, k, v)
    num_tiles = cdiv(tq, cfg["BLOCK_M"]) + n_seg
    (qs, ql, qp, ks, kl), tile_seg, tile_row = _segment_tables(
        seg, tq, tk, "bwd_dq", cfg, num_tiles, causal, left, right
    )
    launch_direct(
        varlen_attn_bwd_dq_kernel, (num_tiles * hq,),
        q, k, v, out, dout, lse, dlse, delta, dq, *descriptors,
        qs, ql, qp, ks, kl, tile_seg, tile_row, n_seg,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), dout.stride(0), dout.stride(1), dq.stride(0), dq.stride(1), lse.stride(0),
        hq // hkv, hq, scale, scale * _LOG2E, left, right,
        CAUSAL=causal, WINDOW=_has_window(left, right), HEAD_DIM=d, BLOCK_D=block_d,
        HEAD_GROUP=_head_group("bwd_dq", hkv, hq // hkv), **cfg,
    )  # fmt: skip

    cfg, descriptors = _launch_config("bwd_dkdv", d, block_d, q, dout)
    # one program per key tile of the key tensor: it writes every row, so no zero fill
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    num_tiles = cdiv(tk, cfg["BLOCK_N"])
    order, first, last = _key_tile_segments(qs, ql, ks, kl, cfg["BLOCK_N"], num_tiles, tk)
    launch_direct(
        varlen_attn_bwd_dkdv_kernel, (num_tiles * hkv * cfg.get("PARTS", 1),),
        q, k, v, dout, lse, delta, dk, dv, *descriptors,
        qs, ql, qp, ks, kl, order, first, last, tk,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        dout.stride(0), dout.stride(1), dk.stride(0), dk.stride(1), lse.stride(0),
        hq // hkv, hkv, scale, scale * _LOG2E, left, right,
        CAUSAL=causal, WINDOW=_has_window(left, right), HEAD_DIM=d, BLOCK_D=block_d,
        HEAD_GROUP=_head_group("bwd_dkdv", hkv, cfg.get("PARTS", 1)),
        **cfg,
    )  # fmt: skip
    return dq, dk, dv


@kernel_op(f"{NAMESPACE}::varlen_attention", mutates_args=(), opaque=True)
def _varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
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
    """``torch.ops.cp_ops.varlen_attention``: :func:`varlen_attention` with the window as two ints."""
    _check(q, k, v, (q_start, q_len, q_pos, k_start, k_len), causal, window_left, window_right)
    q_start = checked("segments", q_start, (q_len, q_pos, k_start, k_len), q.shape[0], k.shape[0])
    seg = (q_start, q_len, q_pos, k_start, k_len)
    scale = resolve_scale(scale, q.shape[2])
    if not _use_kernel(q):
        out, lse = _attention(q, k, v, *seg, causal, window_left, window_right, scale)
        return out.contiguous(), lse.contiguous()  # the fake's layout
    return _forward_kernel(q, k, v, seg, causal, window_left, window_right, scale)


@_varlen_attention.register_fake
def _(q, k, v, q_start, q_len, q_pos, k_start, k_len, causal=True, window_left=-1, window_right=-1, scale=None):
    _check(q, k, v, (q_start, q_len, q_pos, k_start, k_len), causal, window_left, window_right)
    _use_kernel(q)  # same head_dim error as the real op
    return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=lse_dtype(q.dtype))


@kernel_op(f"{NAMESPACE}::varlen_attention_backward", mutates_args=(), opaque=True)
def _varlen_attention_backward(
    dout: torch.Tensor,
    dlse: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of :func:`varlen_attention` given ``dout [Tq, Hq, D]`` and
    ``dlse [Hq, Tq]`` and the saved ``out`` and ``lse``. Not differentiable itself."""
    seg = (q_start, q_len, q_pos, k_start, k_len)
    _check(q, k, v, seg, causal, window_left, window_right)
    scale = resolve_scale(scale, q.shape[2])
    if not _use_kernel(q):
        grads = varlen_attention_backward_reference(
            dout, dlse, q, k, v, out, lse, *seg, causal, window_left, window_right, scale
        )
        return tuple(g.contiguous() for g in grads)
    return _backward_kernel(dout, dlse, q, k, v, out, lse, seg, causal, window_left, window_right, scale)


@_varlen_attention_backward.register_fake
def _(dout, dlse, q, k, v, out, lse, q_start, q_len, q_pos, k_start, k_len, causal=True, window_left=-1,
      window_right=-1, scale=None):  # fmt: skip
    _check(q, k, v, (q_start, q_len, q_pos, k_start, k_len), causal, window_left, window_right)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, q_start, q_len, q_pos, k_start, k_len, causal, window_left, window_right, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, q_start, q_len, q_pos, k_start, k_len)
    ctx.args = (causal, window_left, window_right, scale)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, *seg = ctx.saved_tensors
    if dlse is None:
        dlse = torch.zeros_like(lse)
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = _varlen_attention_backward(dout, dlse, q, k, v, out, lse, *seg, *ctx.args)
    return (dq, dk, dv) + (None,) * 9


_varlen_attention.register_autograd(_backward, setup_context=_setup_context)


def _window(window) -> tuple[int, int]:
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

    q: ``[Tq, Hq, D]``; k, v: ``[Tk, Hkv, D]`` with ``Hq % Hkv == 0`` (query head h
    reads kv head ``h // (Hq / Hkv)``). The five index tensors (int32 or int64,
    ``[S]`` each) describe segment s: query rows ``[q_start, q_start + q_len)`` at
    positions ``q_pos + a``; key rows ``[k_start, k_start + k_len)`` at positions
    ``b = 0 .. k_len - 1``. Query a sees key b iff ``b < k_len`` and
    ``b <= pos(a)`` (causal) and ``pos(a) - b <= left`` (left >= 0) and
    ``b - pos(a) <= right`` (right >= 0), ``window = (left, right)``, -1 = unbounded.
    With ``s_ab = scale * <q_a, k_b>`` (scale defaults to ``D ** -0.5``):

        lse_a = log sum_{b visible} exp(s_ab)
        out_a = sum_{b visible} exp(s_ab - lse_a) v_b

    out has q's dtype; lse is float32 (float64 for float64 inputs). Query rows
    with no visible key, and rows in no segment, get ``out = 0``, ``lse = -inf``
    and zero gradient. Query segments must be disjoint (sorting not required);
    key ranges may overlap (dk, dv sum over every segment). Values are not
    checked here (no host sync): see :func:`validate_varlen_segments`.

    ``q_pos = 0`` is plain varlen attention, ``q_pos = k_len - q_len`` bottom-right
    alignment. Differentiable in q, k, v, including through lse. On CUDA (and on
    CPU under TRITON_INTERPRET=1) fp16/bf16/fp32 run the Triton kernels
    (head_dim <= 256; fp32 products use Triton's default TF32 on the GPU, with
    fp32 accumulation); otherwise the dense torch reference runs.
    """
    left, right = _window(window)
    return _varlen_attention(q, k, v, q_start, q_len, q_pos, k_start, k_len, causal, left, right, scale)


def validate_varlen_segments(
    q_start: torch.Tensor,
    q_len: torch.Tensor,
    q_pos: torch.Tensor,
    k_start: torch.Tensor,
    k_len: torch.Tensor,
    num_q_rows: int,
    num_k_rows: int,
) -> None:
    """Check segment tables on the host (syncs; call it where batches are built).

    Raises ValueError unless lengths are >= 0, every query range lies in
    ``[0, num_q_rows)`` and every key range in ``[0, num_k_rows)``, and the
    non-empty query ranges are pairwise disjoint.
    """
    tables = {name: t.tolist() for name, t in zip(_INDEX_NAMES, (q_start, q_len, q_pos, k_start, k_len))}
    n = len(tables["q_start"])
    if any(len(t) != n for t in tables.values()):
        raise ValueError("the five segment tensors must have one length")
    spans = []
    for s in range(n):
        qs, ql, ks, kl = tables["q_start"][s], tables["q_len"][s], tables["k_start"][s], tables["k_len"][s]
        if ql < 0 or kl < 0:
            raise ValueError(f"segment {s}: q_len = {ql} and k_len = {kl} must be >= 0")
        if qs < 0 or qs + ql > num_q_rows:
            raise ValueError(f"segment {s}: query rows [{qs}, {qs + ql}) are not inside [0, {num_q_rows})")
        if ks < 0 or ks + kl > num_k_rows:
            raise ValueError(f"segment {s}: key rows [{ks}, {ks + kl}) are not inside [0, {num_k_rows})")
        if ql > 0:
            spans.append((qs, qs + ql, s))
    spans.sort()
    for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
        if start < end:
            raise ValueError(f"the query rows of segments {a} and {b} overlap")

