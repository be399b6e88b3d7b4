"""Triton kernels of the depthwise causal conv1d over packed sequences (``custom_ops.causal_conv1d``).

Both kernels tile rows x channels over a grid sized from shapes only; each row finds its
sequence by a binary search in ``cu_seqlens`` (rows past ``cu[-1]`` start a sequence of
their own there, as in :func:`custom_ops.gdn.reference.row_positions`). The conv is
memory-bound, so each kernel reads its inputs from memory once and writes its outputs
once; the K shifted views a tap needs are re-read from the tile just loaded (L1/L2).

The backward is one pass: it recomputes the pre-activation of rows ``t .. t+K-1`` from x
in registers (no pre-activation tensor goes through memory), and writes ``dx`` plus
per-program partial sums of ``dweight`` and ``dbias`` (float32, summed by the caller:
deterministic, no atomics).
"""

import triton
import triton.language as tl

from custom_ops._triton_utils import search_sorted_right

# (BLOCK_T, BLOCK_C, num_warps) of the forward; (BLOCK_T, BLOCK_C, TILES, num_warps) of the
# backward, whose programs each run TILES row tiles (fewer dweight partials to sum)
FWD_CONFIG = (64, 128, 8)
BWD_CONFIG = (32, 128, 8, 8)


@triton.jit
def _sequence_bounds(cu_ptr, n_bounds, rows, row_ok, num_rows):
    """``(start, end)`` of each row's sequence: ``cu[i] <= row < cu[i+1]``; rows at or past
    ``cu[-1]`` (entry ``n_bounds - 1``) run from there to ``num_rows``."""
    i = search_sorted_right(cu_ptr, n_bounds, rows)
    i = tl.minimum(tl.maximum(i, 0), n_bounds - 1)
    start = tl.load(cu_ptr + i, mask=row_ok, other=0)
    last = i >= n_bounds - 1
    end = tl.load(cu_ptr + i + 1, mask=row_ok & (~last), other=0)
    end = tl.where(last, num_rows, end)
    return start, end


@triton.jit
def cp_causal_conv1d_fwd_kernel(
    x_ptr,
    w_ptr,  # [C, K], contiguous
    b_ptr,  # [C] or a dummy (HAS_BIAS False)
    y_ptr,  # [T, C], contiguous
    cu_ptr,
    n_bounds,  # entries of cu_seqlens, B + 1
    num_rows,
    channels,
    stride_x,  # x's row stride (its channel stride is 1)
    K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """``y[t, c] = act(b[c] + sum_j w[c, K-1-j] * x[t-j, c])``, x rows before the sequence start as zero."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    row_ok, col_ok = rows < num_rows, cols < channels
    start, _ = _sequence_bounds(cu_ptr, n_bounds, rows, row_ok, num_rows)
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for j in tl.static_range(K):  # tap j looks j rows back
        src = rows - j
        ok = row_ok & (src >= start) & (src >= 0)
        xv = tl.load(x_ptr + src.to(tl.int64)[:, None] * stride_x + cols[None, :], mask=ok[:, None] & col_ok[None, :],
                     other=0.0)  # fmt: skip
        wv = tl.load(w_ptr + cols * K + (K - 1 - j), mask=col_ok, other=0.0)
        acc += xv.to(tl.float32) * wv.to(tl.float32)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if SILU:
        acc = acc * tl.sigmoid(acc)
    mask = row_ok[:, None] & col_ok[None, :]
    tl.store(y_ptr + rows.to(tl.int64)[:, None] * channels + cols[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def cp_causal_conv1d_bwd_kernel(
    x_ptr,
    w_ptr,  # [C, K], contiguous
    b_ptr,  # [C] or a dummy (HAS_BIAS False)
    dy_ptr,
    dx_ptr,  # [T, C], contiguous
    dw_ptr,  # [programs along T, C, KP] float32 partial sums
    db_ptr,  # [programs along T, C] float32 partial sums
    cu_ptr,
    n_bounds,
    num_rows,
    channels,
    stride_x,
    stride_dy,
    K: tl.constexpr,
    KP: tl.constexpr,  # K rounded up to a power of two
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
    TILES: tl.constexpr,
):
    """With ``dpre = dy * act'(pre)``: ``dx[t] = sum_s w[:, K-1-s] * dpre[t+s]`` over the rows
    ``t+s`` of t's sequence; ``dw[:, K-1-j] = sum_t dpre[t] * x[t-j]`` and ``db = sum_t dpre[t]``
    over this program's rows (its partial sums)."""
    pid_t, pid_c = tl.program_id(0), tl.program_id(1)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < channels
    taps = tl.arange(0, KP)
    if HAS_BIAS:
        bias = tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    dw_acc = tl.zeros((BLOCK_C, KP), dtype=tl.float32)
    db_acc = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for tile in range(TILES):
        rows = (pid_t * TILES + tile) * BLOCK_T + tl.arange(0, BLOCK_T)
        row_ok = rows < num_rows
        start, end = _sequence_bounds(cu_ptr, n_bounds, rows, row_ok, num_rows)
        dx_acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
        for s in tl.static_range(K):  # dpre of row t+s reaches dx[t] through tap s
            u = rows + s
            u_ok = row_ok & (u < end) & (u < num_rows)
            pre = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
            if HAS_BIAS:
                pre += bias[None, :]
            for j in tl.static_range(K):
                src = u - j
                ok = u_ok & (src >= start) & (src >= 0)
                xv = tl.load(x_ptr + src.to(tl.int64)[:, None] * stride_x + cols[None, :],
                             mask=ok[:, None] & col_ok[None, :], other=0.0)  # fmt: skip
                wv = tl.load(w_ptr + cols * K + (K - 1 - j), mask=col_ok, other=0.0)
                pre += xv.to(tl.float32) * wv.to(tl.float32)[None, :]
            dpre = tl.load(dy_ptr + u.to(tl.int64)[:, None] * stride_dy + cols[None, :],
                           mask=u_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)  # fmt: skip
            if SILU:
                sig = tl.sigmoid(pre)
                dpre = dpre * sig * (1.0 + pre * (1.0 - sig))
            ws = tl.load(w_ptr + cols * K + (K - 1 - s), mask=col_ok, other=0.0).to(tl.float32)
            dx_acc += dpre * ws[None, :]
            if s == 0:  # this program's own rows: their dweight and dbias terms
                db_acc += tl.sum(dpre, 0)
                for j in tl.static_range(K):
                    src = rows - j
                    ok = row_ok & (src >= start) & (src >= 0)
                    xv = tl.load(x_ptr + src.to(tl.int64)[:, None] * stride_x + cols[None, :],
                                 mask=ok[:, None] & col_ok[None, :], other=0.0)  # fmt: skip
                    part = tl.sum(dpre * xv.to(tl.float32), 0)
                    dw_acc += tl.where(taps[None, :] == K - 1 - j, part[:, None], 0.0)
        mask = row_ok[:, None] & col_ok[None, :]
        tl.store(dx_ptr + rows.to(tl.int64)[:, None] * channels + cols[None, :], dx_acc.to(dx_ptr.dtype.element_ty),
                 mask=mask)  # fmt: skip
    dw_base = dw_ptr + pid_t.to(tl.int64) * channels * KP
    tl.store(dw_base + cols[:, None] * KP + taps[None, :], dw_acc, mask=col_ok[:, None])
    tl.store(db_ptr + pid_t.to(tl.int64) * channels + cols, db_acc, mask=col_ok)
