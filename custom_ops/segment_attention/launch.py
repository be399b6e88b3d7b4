"""Launchers of the segment-attention kernels (docs/design.md section 5): the tables a launch
needs, its configuration and descriptors, and the kernel launches of the forward
(:func:`forward`) and the backward (:func:`backward`: :func:`backward_dkdv`, then
:func:`backward_dq`).

Both launchers take an :class:`~custom_ops.segment_attention.configs.AttentionSettings` as
``settings``: the ops pass :data:`~custom_ops.segment_attention.configs.ATTENTION_SETTINGS`,
the default, and a benchmark or a test passes others to time or check the kernels under
other launch choices. Their inputs are what the ops' bodies pass: checked, the scale resolved,
fp16/bf16/fp32 tensors on CUDA or on the CPU under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import functools
import math

import torch

from custom_ops.runtime.launch import launch_direct, triton_interpreting
from custom_ops.runtime.precompile import cuda_index
from custom_ops.runtime.tiles import cdiv
from custom_ops.runtime.words import unit_last_stride
from custom_ops.thd.validation import Segments
from custom_ops.segment_attention.configs import (
    ATTENTION_SETTINGS,
    DELTA_BLOCK,
    DELTA_WARPS,
    KEY_TILE_BLOCK,
    TABLE_BLOCK,
    TABLE_WARPS,
    WORK_BUCKETS,
    AttentionSettings,
    has_tma_config,
    kernel_config,
)
from custom_ops.segment_attention.kernels.backward import (
    varlen_attn_bwd_delta_kernel,
    varlen_attn_bwd_dkdv_kernel,
    varlen_attn_bwd_dq_kernel,
)
from custom_ops.segment_attention.kernels.forward import varlen_attn_fwd_kernel
from custom_ops.segment_attention.kernels.schedule import key_tile_segments_kernel, segment_tables_kernel

_LOG2E = 1.4426950408889634


def segment_tables(
    seg: Segments, num_q_rows: int, num_k_rows: int, tile: int, key_tile: int, num_tiles: int, causal: bool, left: int,
    right: int, by_work: bool, chunk: int = TABLE_BLOCK,
):
    """``((q_start, q_len, q_pos, k_start, k_len), tile_seg, tile_row)``, int32 on the device,
    from one launch of :func:`segment_tables_kernel`: the segment tables clamped into the
    tensors (an invalid layout gives wrong rows but never an out-of-bounds access; validate
    with validate_varlen_segments), and for the ``num_tiles`` programs of a forward or dq grid
    with query tiles of ``tile`` rows and key tiles of ``key_tile``, in launch order, each one's
    segment (``len(q_start)`` past the last query tile) and query tile within it, counted from
    where the segment's tiles end (``_query_tile_rows``). The segments
    run heaviest first (by the visible keys of their last query tile under the mask) where
    ``by_work``, else last to first; each segment's tiles last to first. ``chunk``: the table
    kernel's BLOCK. Sized from shapes only."""
    seg = [t.contiguous() for t in seg]  # the kernel reads them with unit stride
    n_seg = seg[0].shape[0]
    dev = seg[0].device
    tab = torch.empty((5, n_seg), dtype=torch.int32, device=dev)
    cum = torch.empty(n_seg, dtype=torch.int32, device=dev)  # scratch: the kernel reads it back
    tiles = torch.empty((5, num_tiles), dtype=torch.int32, device=dev)
    launch_direct(
        segment_tables_kernel, (1,),
        *seg, tab, cum, tiles, n_seg, num_q_rows, num_k_rows, num_tiles, left, right, tile, key_tile,
        CAUSAL=causal, BY_WORK=by_work, BLOCK=chunk, BUCKETS=WORK_BUCKETS, num_warps=TABLE_WARPS,
    )  # fmt: skip
    return tab.unbind(0), tiles[0], tiles[1]


def key_tile_segments(ql, ks, kl, block: int, num_tiles: int, num_k_rows: int):
    """``(order, first, last)`` for the dk/dv kernel, int32 on the device and sized from shapes:
    one launch of :func:`key_tile_segments_kernel`, which defines them
    (:func:`custom_ops.segment_attention.reference.key_tile_segments_reference` computes the
    same with a dozen torch ops). Disjoint and identical key ranges (self-attention, all-gather
    CP) make ``order[first[t]:last[t]]`` exactly the segments that reach key tile t; other
    overlaps may add some that miss it, which the kernel skips (a few scalar loads each: one
    wide key range that spans many short ones makes every tile under it scan all of them)."""
    n_seg = ql.shape[0]
    order = torch.empty(n_seg, dtype=torch.int32, device=ql.device)
    first = torch.empty(num_tiles, dtype=torch.int32, device=ql.device)
    last = torch.empty(num_tiles, dtype=torch.int32, device=ql.device)
    order_programs = cdiv(n_seg, KEY_TILE_BLOCK)
    launch_direct(
        key_tile_segments_kernel, (order_programs + cdiv(num_tiles, KEY_TILE_BLOCK),),
        ql, ks, kl, order, first, last, n_seg, num_tiles, num_k_rows, block, order_programs, BLOCK=KEY_TILE_BLOCK,
    )  # fmt: skip
    return order, first, last


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


def tma_usable(
    kernel: str, head_dim: int, block_d: int, *tensors: torch.Tensor, settings: AttentionSettings = ATTENTION_SETTINGS
) -> bool:
    """Whether ``kernel`` loads its streamed tiles (``tensors``) through TMA descriptors:
    enabled (``settings.tma``), a TMA config for the head dim, 2-byte elements, D a
    power of two (the tile is exactly one head wide), a GPU with TMA (sm_90 and later; the
    interpreter runs descriptors too), and the layout of :func:`_tma_layout_ok`."""
    t = tensors[0]
    if not settings.tma or block_d != head_dim or t.element_size() != 2:
        return False
    if not has_tma_config(kernel, block_d):
        return False
    index = cuda_index(t)
    if index is not None:
        if not _device_has_tma(index):
            return False
    elif not triton_interpreting():
        return False
    return all(_tma_layout_ok(x, head_dim) for x in tensors)


# The tile dimension of each kernel's streamed rows: key rows in the forward and dq, query rows in dk/dv.
_STREAMED_ROWS = {"fwd": "BLOCK_N", "bwd_dq": "BLOCK_N", "bwd_dkdv": "BLOCK_M"}


def _launch_config(kernel: str, settings: AttentionSettings, head_dim: int, block_d: int, *streamed: torch.Tensor):
    """``(config, descriptors)`` for launching ``kernel``: the TMA config and host descriptors of
    the ``streamed`` tensors (as ``[rows, heads * D]``, one tile of streamed rows by ``block_d``)
    where :func:`tma_usable`, else the pointer-load config and Nones (the kernel's
    ``settings.config`` in place of the tables' where set)."""
    tma = tma_usable(kernel, head_dim, block_d, *streamed, settings=settings)
    override = settings.kernel(kernel).config
    cfg = kernel_config(kernel, block_d, triton_interpreting(), streamed[0].element_size(), tma, override)
    if not tma:
        return cfg, (None,) * len(streamed)
    from triton.tools.tensor_descriptor import TensorDescriptor

    box = [cfg[_STREAMED_ROWS[kernel]], block_d]
    return cfg, tuple(TensorDescriptor.from_tensor(t.view(t.shape[0], -1), box) for t in streamed)


def _head_group(kernel: str, settings: AttentionSettings, num_kv_heads: int, per_kv_head: int) -> int:
    """The HEAD_GROUP launch constant of ``kernel``: the largest count of kv heads dividing
    both its ``settings`` head group and ``num_kv_heads``, as grid parts, of which each kv head
    has ``per_kv_head`` (its query heads in the forward and dq, PARTS in dk/dv)."""
    return math.gcd(settings.kernel(kernel).head_group, num_kv_heads) * per_kv_head


def _has_window(left: int, right: int, settings: AttentionSettings) -> bool:
    """The kernels' WINDOW: whether the mask has a window side (compiled out of the elementwise
    mask without one; two specializations per kernel, not one per window), or
    ``settings.window_terms_always``."""
    return settings.window_terms_always or left >= 0 or right >= 0


def forward(q, k, v, seg: Segments, causal, left, right, scale, settings: AttentionSettings = ATTENTION_SETTINGS):
    """``(out, lse)`` of segment attention by the forward kernel under ``settings``: q
    ``[Tq, Hq, D]``, k and v ``[Tk, Hkv, D]``, ``seg`` the five segment tensors, ``causal``, the
    window ``(left, right)``, ``scale`` a float (see ``custom_ops.varlen_attention``)."""
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
    cfg, descriptors = _launch_config("fwd", settings, d, block_d, k, v)
    num_tiles = cdiv(tq, cfg["BLOCK_M"]) + n_seg
    (qs, ql, qp, ks, kl), tile_seg, tile_row = segment_tables(
        seg, tq, k.shape[0], cfg["BLOCK_M"], cfg["BLOCK_N"], num_tiles, causal, left, right, settings.fwd.by_work
    )
    launch_direct(
        varlen_attn_fwd_kernel, (num_tiles * hq,),
        q, k, v, out, lse, *descriptors,
        qs, ql, qp, ks, kl, tile_seg, tile_row, n_seg,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), lse.stride(0),
        hq // hkv, hq, scale * _LOG2E, left, right,
        CAUSAL=causal, WINDOW=_has_window(left, right, settings), HEAD_DIM=d, BLOCK_D=block_d,
        HEAD_GROUP=_head_group("fwd", settings, hkv, hq // hkv), **cfg,
    )  # fmt: skip
    return out, lse


def clamped_segments(seg: Segments, num_q_rows: int, num_k_rows: int, causal, left: int, right: int, by_work) -> tuple:
    """The five segment columns clamped into the tensors, int32: :func:`segment_tables` for a
    launch that needs no query-tile order (one launch of the table kernel; ``by_work`` as
    another launch's, so that no other variant of it compiles)."""
    tab, _, _ = segment_tables(seg, num_q_rows, num_k_rows, 1, 1, 1, causal, left, right, by_work)
    return tab


def backward_dkdv(
    dout, dlse, q, k, v, out, lse, seg: Segments, causal, left, right, scale, settings: AttentionSettings = ATTENTION_SETTINGS
):
    """``(dk, dv, delta)`` by the delta pass and the dk/dv kernel under ``settings``, given
    ``dout [Tq, Hq, D]`` and ``dlse [Hq, Tq]`` and the forward's ``out`` and ``lse``; ``delta
    [Hq, Tq]`` float32 is what :func:`backward_dq` takes. The other arguments as
    :func:`forward`'s."""
    # one program per key tile of the key tensor: it writes every row, so no zero fill
    dk, dv = torch.empty(k.shape, dtype=k.dtype, device=k.device), torch.empty(v.shape, dtype=v.dtype, device=v.device)
    delta = _backward_dkdv_into(dk, dv, None, dout, dlse, q, k, v, out, lse, seg, causal, left, right, scale, settings)
    return dk, dv, delta


def backward_dkv_rows(
    dout, dlse, q, k, v, out, lse, seg: Segments, causal, left, right, scale, out_rows,
    settings: AttentionSettings = ATTENTION_SETTINGS,
):  # fmt: skip
    """``(dkv, delta)``: :func:`backward_dkdv` with dk and dv in one ``[Tk, 2*Hkv, D]`` tensor
    (dk's heads, then dv's) and key row b's gradients at row ``out_rows[b]`` (``out_rows``: int
    ``[Tk]``, a permutation of the key rows; all-gather CP's rank order, docs/design.md section
    4.2). The reorder and the concatenation come with the kernel's stores."""
    tk, hkv, d = k.shape
    dkv = torch.empty((tk, 2 * hkv, d), dtype=k.dtype, device=k.device)
    delta = _backward_dkdv_into(
        dkv[:, :hkv], dkv[:, hkv:], out_rows.contiguous(), dout, dlse, q, k, v, out, lse, seg, causal, left, right,
        scale, settings,
    )  # fmt: skip
    return dkv, delta


def _backward_dkdv_into(dk, dv, out_rows, dout, dlse, q, k, v, out, lse, seg, causal, left, right, scale, settings):
    """The delta pass and the dk/dv kernel writing into ``dk`` and ``dv`` (one row stride; with
    ``out_rows``, key row b at row ``out_rows[b]``); returns delta."""
    tq, hq, d = q.shape
    tk, hkv, _ = k.shape
    n_seg = seg[0].shape[0]
    delta = torch.zeros((hq, tq), dtype=torch.float32, device=q.device)
    if n_seg == 0 or tq == 0 or hq == 0 or tk == 0:
        dk.zero_()
        dv.zero_()
        return delta
    q, k, v, out, dout = (unit_last_stride(t) for t in (q, k, v, out, dout))
    lse = lse.contiguous()
    dlse = dlse.to(torch.float32).contiguous()
    block_d = _block_d(d)
    launch_direct(
        varlen_attn_bwd_delta_kernel, (cdiv(tq, DELTA_BLOCK), hq),
        out, dout, dlse, delta, tq, out.stride(0), out.stride(1), dout.stride(0), dout.stride(1), delta.stride(0),
        HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=DELTA_BLOCK, num_warps=DELTA_WARPS,
    )  # fmt: skip

    qs, ql, qp, ks, kl = clamped_segments(seg, tq, tk, causal, left, right, settings.bwd_dq.by_work)
    cfg, descriptors = _launch_config("bwd_dkdv", settings, d, block_d, q, dout)
    num_tiles = cdiv(tk, cfg["BLOCK_N"])
    order, first, last = key_tile_segments(ql, ks, kl, cfg["BLOCK_N"], num_tiles, tk)
    launch_direct(
        varlen_attn_bwd_dkdv_kernel, (num_tiles * hkv * cfg.get("PARTS", 1),),
        q, k, v, dout, lse, delta, dk, dv, *descriptors,
        qs, ql, qp, ks, kl, order, first, last, out_rows, tk,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        dout.stride(0), dout.stride(1), dk.stride(0), dk.stride(1), lse.stride(0),
        hq // hkv, hkv, scale, scale * _LOG2E, left, right,
        CAUSAL=causal, WINDOW=_has_window(left, right, settings), HEAD_DIM=d, BLOCK_D=block_d,
        HEAD_GROUP=_head_group("bwd_dkdv", settings, hkv, cfg.get("PARTS", 1)), ROW_MAP=out_rows is not None,
        **cfg,
    )  # fmt: skip
    return delta


def backward_dq(
    dout, q, k, v, lse, delta, seg: Segments, causal, left, right, scale, settings: AttentionSettings = ATTENTION_SETTINGS
):
    """``dq`` by the dq kernel under ``settings``, given ``dout``, the forward's ``lse`` and
    :func:`backward_dkdv`'s ``delta``; the other arguments as :func:`forward`'s."""
    tq, hq, d = q.shape
    tk, hkv, _ = k.shape
    n_seg = seg[0].shape[0]
    dq = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    if n_seg == 0 or tq == 0 or hq == 0 or tk == 0:
        return dq
    q, k, v, dout = (unit_last_stride(t) for t in (q, k, v, dout))
    lse, delta = lse.contiguous(), delta.contiguous()
    block_d = _block_d(d)
    cfg, descriptors = _launch_config("bwd_dq", settings, d, block_d, k, v)
    num_tiles = cdiv(tq, cfg["BLOCK_M"]) + n_seg
    (qs, ql, qp, ks, kl), tile_seg, tile_row = segment_tables(
        seg, tq, tk, cfg["BLOCK_M"], cfg["BLOCK_N"], num_tiles, causal, left, right, settings.bwd_dq.by_work
    )
    launch_direct(
        varlen_attn_bwd_dq_kernel, (num_tiles * hq,),
        q, k, v, dout, lse, delta, dq, *descriptors,
        qs, ql, qp, ks, kl, tile_seg, tile_row, n_seg,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        dout.stride(0), dout.stride(1), dq.stride(0), dq.stride(1), lse.stride(0),
        hq // hkv, hq, scale, scale * _LOG2E, left, right,
        CAUSAL=causal, WINDOW=_has_window(left, right, settings), HEAD_DIM=d, BLOCK_D=block_d,
        HEAD_GROUP=_head_group("bwd_dq", settings, hkv, hq // hkv), **cfg,
    )  # fmt: skip
    return dq


def backward(
    dout, dlse, q, k, v, out, lse, seg: Segments, causal, left, right, scale, settings: AttentionSettings = ATTENTION_SETTINGS
):
    """``(dq, dk, dv)``: :func:`backward_dkdv` then :func:`backward_dq`, the arguments as theirs."""
    dk, dv, delta = backward_dkdv(dout, dlse, q, k, v, out, lse, seg, causal, left, right, scale, settings)
    dq = backward_dq(dout, q, k, v, lse, delta, seg, causal, left, right, scale, settings)
    return dq, dk, dv
