"""Triton kernels of the depthwise causal conv1d over packed sequences (``custom_ops.causal_conv1d``),
for kernel widths K <= 4 (:data:`MAX_TAPS`).

Both kernels tile rows x channels over a grid sized from shapes only; each row finds its
sequence by a binary search in ``cu_seqlens`` (rows past ``cu[-1]`` start a sequence of
their own there, as in :func:`custom_ops.gdn.reference.row_positions`). The conv is
memory-bound: every tile of x a tap needs (rows shifted by -3 .. 3) is loaded once per
program into registers, from one pointer tile plus a row offset, and the taps combine
those registers.

The backward is one pass: it recomputes the pre-activation of rows ``t .. t+K-1`` from the
x tiles in registers (no pre-activation tensor goes through memory), and writes ``dx``
plus per-program partial sums of ``dweight`` and ``dbias`` (float32, summed by the caller:
deterministic, no atomics).
"""

import triton
import triton.language as tl

from custom_ops._triton_utils import search_sorted_right

MAX_TAPS = 4
# (BLOCK_T, BLOCK_C, num_warps) of the forward; (BLOCK_T, BLOCK_C, TILES, num_warps) of the
# backward, whose programs each run TILES row tiles (fewer dweight partials to sum)
FWD_CONFIG = (16, 256, 4)
BWD_CONFIG = (16, 128, 8, 4)


@triton.jit
def _sequence_bounds(cu_ptr, n_bounds, rows, row_ok, num_rows):
    """``(lo, hi)``: the rows of each row's sequence, ``cu[i] <= row < cu[i+1]``, clipped to
    ``[0, num_rows)``; rows at or past ``cu[-1]`` (entry ``n_bounds - 1``) run from there to
    ``num_rows``."""
    i = search_sorted_right(cu_ptr, n_bounds, rows)
    i = tl.minimum(tl.maximum(i, 0), n_bounds - 1)
    start = tl.load(cu_ptr + i, mask=row_ok, other=0)
    last = i >= n_bounds - 1
    end = tl.load(cu_ptr + i + 1, mask=row_ok & (~last), other=0)
    end = tl.where(last, num_rows, end)
    return tl.maximum(start, 0), tl.minimum(end, num_rows)


@triton.jit
def _rows(base, d: tl.constexpr, stride, rows, lo, hi, col_ok, NEEDED: tl.constexpr):
    """The tile of rows ``rows + d`` (float32), zero where that row is outside ``[lo, hi)``
    (another sequence) or when the tap is not NEEDED."""
    if NEEDED:
        r = rows + d
        ok = (r >= lo) & (r < hi)
        return tl.load(base + d * stride, mask=ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
    else:
        return tl.zeros(base.shape, dtype=tl.float32)


@triton.jit
def _pick(i: tl.constexpr, a, b, c, d, e, f, g):
    """Entry i of (a, ..., g), chosen at compile time."""
    if i == 0:
        out = a
    elif i == 1:
        out = b
    elif i == 2:
        out = c
    elif i == 3:
        out = d
    elif i == 4:
        out = e
    elif i == 5:
        out = f
    else:
        out = g
    return out


@triton.jit
def _weight(w_ptr, cols, col_ok, K: tl.constexpr, k: tl.constexpr):
    """Column k of weight ``[C, K]`` as float32 (zero for k >= K)."""
    if k < K:
        return tl.load(w_ptr + cols * K + k, mask=col_ok, other=0.0).to(tl.float32)
    else:
        return tl.zeros(cols.shape, dtype=tl.float32)


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
    lo, hi = _sequence_bounds(cu_ptr, n_bounds, rows, row_ok, num_rows)
    hi = tl.where(row_ok, hi, 0)  # rows past the tensor load nothing
    base = x_ptr + rows.to(tl.int64)[:, None] * stride_x + cols[None, :]
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    for j in tl.static_range(K):  # tap j looks j rows back
        acc += _rows(base, -j, stride_x, rows, lo, hi, col_ok, True) * _weight(w_ptr, cols, col_ok, K, K - 1 - j)[None, :]
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
    dw_ptr,  # [programs along T, C, 4] float32 partial sums
    db_ptr,  # [programs along T, C] float32 partial sums
    cu_ptr,
    n_bounds,
    num_rows,
    channels,
    stride_x,
    stride_dy,
    K: tl.constexpr,
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
    w0, w1, w2, w3 = (_weight(w_ptr, cols, col_ok, K, 0), _weight(w_ptr, cols, col_ok, K, 1),
                      _weight(w_ptr, cols, col_ok, K, 2), _weight(w_ptr, cols, col_ok, K, 3))  # fmt: skip
    bias = tl.zeros((BLOCK_C,), dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    dw0 = tl.zeros((BLOCK_C,), dtype=tl.float32)
    dw1 = tl.zeros((BLOCK_C,), dtype=tl.float32)
    dw2 = tl.zeros((BLOCK_C,), dtype=tl.float32)
    dw3 = tl.zeros((BLOCK_C,), dtype=tl.float32)
    db = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for tile in range(TILES):
        rows = (pid_t * TILES + tile) * BLOCK_T + tl.arange(0, BLOCK_T)
        row_ok = rows < num_rows
        lo, hi = _sequence_bounds(cu_ptr, n_bounds, rows, row_ok, num_rows)
        hi = tl.where(row_ok, hi, 0)
        rows64 = rows.to(tl.int64)[:, None]
        xb = x_ptr + rows64 * stride_x + cols[None, :]
        dyb = dy_ptr + rows64 * stride_dy + cols[None, :]
        # x rows t-3 .. t+3 and dy rows t .. t+3, each loaded once
        xm3 = _rows(xb, -3, stride_x, rows, lo, hi, col_ok, K > 3)
        xm2 = _rows(xb, -2, stride_x, rows, lo, hi, col_ok, K > 2)
        xm1 = _rows(xb, -1, stride_x, rows, lo, hi, col_ok, K > 1)
        x0 = _rows(xb, 0, stride_x, rows, lo, hi, col_ok, True)
        xp1 = _rows(xb, 1, stride_x, rows, lo, hi, col_ok, K > 1)
        xp2 = _rows(xb, 2, stride_x, rows, lo, hi, col_ok, K > 2)
        xp3 = _rows(xb, 3, stride_x, rows, lo, hi, col_ok, K > 3)
        dx = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
        for s in tl.static_range(K):  # dpre of row t+s reaches dx[t] through tap s
            pre = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32) + bias[None, :]
            for j in tl.static_range(K):
                pre += _pick(s - j + 3, xm3, xm2, xm1, x0, xp1, xp2, xp3) * _pick(K - 1 - j, w0, w1, w2, w3, w3, w3, w3)[None, :]
            dpre = _rows(dyb, s, stride_dy, rows, lo, hi, col_ok, True)
            if SILU:
                sig = tl.sigmoid(pre)
                dpre = dpre * sig * (1.0 + pre * (1.0 - sig))
            dx += dpre * _pick(K - 1 - s, w0, w1, w2, w3, w3, w3, w3)[None, :]
            if s == 0:  # this program's own rows: their dweight and dbias terms
                db += tl.sum(dpre, 0)
                # weight column k pairs with x[t - (K-1-k)]: tile k - K + 4 of (xm3 .. xp3)
                dw0 += tl.sum(dpre * _pick(4 - K, xm3, xm2, xm1, x0, xp1, xp2, xp3), 0)
                if K > 1:
                    dw1 += tl.sum(dpre * _pick(5 - K, xm3, xm2, xm1, x0, xp1, xp2, xp3), 0)
                if K > 2:
                    dw2 += tl.sum(dpre * _pick(6 - K, xm3, xm2, xm1, x0, xp1, xp2, xp3), 0)
                if K > 3:
                    dw3 += tl.sum(dpre * _pick(7 - K, xm3, xm2, xm1, x0, xp1, xp2, xp3), 0)
        mask = row_ok[:, None] & col_ok[None, :]
        tl.store(dx_ptr + rows64 * channels + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
    part = dw_ptr + pid_t.to(tl.int64) * channels * 4 + cols * 4
    tl.store(part, dw0, mask=col_ok)
    tl.store(part + 1, dw1, mask=col_ok)
    tl.store(part + 2, dw2, mask=col_ok)
    tl.store(part + 3, dw3, mask=col_ok)
    tl.store(db_ptr + pid_t.to(tl.int64) * channels + cols, db, mask=col_ok)
