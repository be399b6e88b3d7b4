"""Triton kernel for the valid-token copy."""

import triton
import triton.language as tl

from custom_ops.runtime.triton_utils import search_sorted_right


@triton.jit
def thd_copy_valid_tokens_kernel(
    dst_ptr,
    src_ptr,
    out_ptr,  # == dst_ptr for the in-place variant
    offsets_ptr,  # [>= n_seq]
    cu_ptr,  # cu_seqlens, [n_seq + 1]
    n_seq,
    num_rows,
    cols,
    IN_PLACE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Row g is valid iff, for i the last segment with offsets[i] <= g,
    g < offsets[i] + cu[i+1] - cu[i]. Valid rows come from src, others from dst.

    Every element is read from exactly one of src/dst, so the functional form
    moves T rows in and T rows out, like a copy. IN_PLACE reads and writes the
    valid rows only.
    """
    pid_r = tl.program_id(0)
    pid_d = tl.program_id(1)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < num_rows
    i = search_sorted_right(offsets_ptr, n_seq, rows)
    found = row_ok & (i >= 0)
    i = tl.maximum(i, 0)
    start = tl.load(offsets_ptr + i, mask=found, other=0)
    length = tl.load(cu_ptr + i + 1, mask=found, other=0) - tl.load(cu_ptr + i, mask=found, other=0)
    valid = found & (rows < start + length)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = (offs_d < cols)[None, :]
    offs = rows.to(tl.int64)[:, None] * cols + offs_d[None, :]
    from_src = tl.load(src_ptr + offs, mask=valid[:, None] & col_ok)
    if IN_PLACE:
        tl.store(out_ptr + offs, from_src, mask=valid[:, None] & col_ok)
    else:
        keep = row_ok & (~valid)
        from_dst = tl.load(dst_ptr + offs, mask=keep[:, None] & col_ok)
        tl.store(out_ptr + offs, tl.where(valid[:, None], from_src, from_dst), mask=row_ok[:, None] & col_ok)
