"""Triton kernels of the segment matmul: rows grouped into segments, a matrix per segment and
head. The forward visits each row tile once and the segments it spans; the weight gradient
sums each segment's rows in one program (no atomics: deterministic). The products run on tensor
cores at ``PRECISION`` (``tl.dot``'s input precision: ``tf32``, exact for 16-bit operands, or
``tf32x3``, about float32's, where an operand is float32), accumulated in float32."""

import triton
import triton.language as tl

from custom_ops.runtime.triton_utils import search_sorted_right


@triton.jit(do_not_specialize=["num_rows", "num_segments"])
def segment_matmul_kernel(
    X,  # [R, H, K]
    W,  # [S, H, K, N]
    CU,  # [S+1] segment bounds, non-decreasing
    Y,  # [R, H, N] out
    num_rows,
    num_segments,
    stride_xr,
    stride_xh,
    stride_ws,
    stride_wh,
    stride_wk,
    stride_yr,
    stride_yh,
    K: tl.constexpr,
    N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One tile of BLOCK_M rows x one head x BLOCK_N columns: ``y[r] = x[r] @ w[seg(r)]`` summed
    over the segments the tile's rows fall in (most tiles: one); rows in no segment get 0."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    h = tl.program_id(1)
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    row_ok = rows < num_rows
    x = tl.load(
        X + rows[:, None].to(tl.int64) * stride_xr + h * stride_xh + offs_k[None, :],
        mask=row_ok[:, None] & (offs_k < K)[None, :],
        other=0.0,
    ).to(tl.float32)
    seg = search_sorted_right(CU, num_segments + 1, rows)  # -1 before cu[0], num_segments from cu[S] on
    seg = tl.where(row_ok, seg, num_segments)
    lo = tl.maximum(tl.min(seg, axis=0), 0)
    hi = tl.minimum(tl.max(seg, axis=0), num_segments - 1)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    w_mask = (offs_k < K)[:, None] & (cols < N)[None, :]
    for s in range(lo, hi + 1):
        w = tl.load(
            W + s * stride_ws + h * stride_wh + offs_k[:, None] * stride_wk + cols[None, :],  # w < 2**31 entries
            mask=w_mask,
            other=0.0,
        ).to(tl.float32)
        xs = tl.where((seg == s)[:, None], x, 0.0)
        acc += tl.dot(xs, w, input_precision=PRECISION)
    tl.store(
        Y + rows[:, None].to(tl.int64) * stride_yr + h * stride_yh + cols[None, :],
        acc.to(Y.dtype.element_ty),
        mask=row_ok[:, None] & (cols < N)[None, :],
    )


@triton.jit(do_not_specialize=["num_rows"])
def segment_matmul_weight_grad_kernel(
    X,  # [R, H, K]
    DY,  # [R, H, N]
    CU,  # [S+1]
    DW,  # [S, H, K, N] out, float32
    num_rows,
    stride_xr,
    stride_xh,
    stride_dyr,
    stride_dyh,
    stride_ws,
    stride_wh,
    stride_wk,
    K: tl.constexpr,
    N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One segment x one head x BLOCK_N columns: ``dw[s] = sum_r x[r]^T dy[r]`` over the
    segment's rows, in BLOCK_M-row steps, summed in registers and stored once."""
    s = tl.program_id(0)
    h = tl.program_id(1)
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # clamped into the rows: bounds past them read nothing
    start = tl.minimum(tl.maximum(tl.load(CU + s), 0), num_rows)
    end = tl.minimum(tl.load(CU + s + 1), num_rows)
    acc = tl.zeros([BLOCK_K, BLOCK_N], dtype=tl.float32)
    for r0 in range(start, end, BLOCK_M):
        rows = r0 + tl.arange(0, BLOCK_M)
        row_ok = rows < end
        x = tl.load(
            X + rows[:, None].to(tl.int64) * stride_xr + h * stride_xh + offs_k[None, :],
            mask=row_ok[:, None] & (offs_k < K)[None, :],
            other=0.0,
        ).to(tl.float32)
        dy = tl.load(
            DY + rows[:, None].to(tl.int64) * stride_dyr + h * stride_dyh + cols[None, :],
            mask=row_ok[:, None] & (cols < N)[None, :],
            other=0.0,
        ).to(tl.float32)
        acc += tl.dot(tl.trans(x), dy, input_precision=PRECISION)
    tl.store(
        DW + s.to(tl.int64) * stride_ws + h * stride_wh + offs_k[:, None] * stride_wk + cols[None, :],
        acc,
        mask=(offs_k < K)[:, None] & (cols < N)[None, :],
    )
