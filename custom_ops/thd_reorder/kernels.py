"""Triton kernel for the THD reorders: a row gather whose index map is computed on the device.

The kernel evaluates :mod:`custom_ops.thd.index`'s maps (``seq_to_rank_index``,
``rank_to_seq_index``) per row, in closed form; everything on the host takes them from there.
"""

import triton
import triton.language as tl

from custom_ops.runtime.triton_utils import search_sorted_right


@triton.jit
def thd_reorder_kernel(
    x_ptr,
    out_ptr,
    cu_ptr,  # cu_seqlens_padded, [n_seq + 1]
    n_seq,
    num_rows,  # T
    cols,  # words per row
    cp_size,
    TO_RANK: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """``out[row] = x[src(row)]`` for BLOCK_R output rows and BLOCK_D words.

    TO_RANK (sequence -> rank order), for rank-order row y = r*(T/W) + l:
        i: cup[i] <= l*W < cup[i+1]; c = (cup[i+1]-cup[i]) / 2W; x = l - cup[i]/W
        src = cup[i] + (x < c ? r*c + x : (2W-1-r)*c + x - c)
    else (rank -> sequence order), for sequence-order row g:
        i: cup[i] <= g < cup[i+1]; p = g - cup[i]; j = p / c
        src = r(j)*(T/W) + cup[i]/W + (p - j*c) + (j >= W ? c : 0),  r(j) = j < W ? j : 2W-1-j
    The source row is clamped into [0, T) so an invalid layout can never read
    out of bounds (validate layouts with cp_ops.validate_thd).
    """
    pid_r = tl.program_id(0)
    pid_d = tl.program_id(1)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < num_rows
    rows_per_rank = num_rows // cp_size
    if TO_RANK:
        rank = rows // rows_per_rank
        local = rows - rank * rows_per_rank
        key = local * cp_size
    else:
        key = rows
    i = search_sorted_right(cu_ptr, n_seq, key)
    i = tl.minimum(tl.maximum(i, 0), n_seq - 1)
    start = tl.load(cu_ptr + i, mask=row_ok, other=0)
    end = tl.load(cu_ptr + i + 1, mask=row_ok, other=0)
    c = (end - start) // (2 * cp_size)
    if TO_RANK:
        x = local - start // cp_size
        first = x < c
        j = tl.where(first, rank, 2 * cp_size - 1 - rank)
        src = start + j * c + tl.where(first, x, x - c)
    else:
        pos = rows - start
        j = pos // tl.maximum(c, 1)
        second = j >= cp_size
        rank = tl.where(second, 2 * cp_size - 1 - j, j)
        src = rank * rows_per_rank + start // cp_size + pos - j * c + tl.where(second, c, 0)
    src = tl.minimum(tl.maximum(src, 0), num_rows - 1).to(tl.int64)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = row_ok[:, None] & (offs_d < cols)[None, :]
    vals = tl.load(x_ptr + src[:, None] * cols + offs_d[None, :], mask=mask)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * cols + offs_d[None, :], vals, mask=mask)
