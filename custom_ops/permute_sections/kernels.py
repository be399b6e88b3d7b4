"""Triton kernel for the head-section permutation: a column gather/scatter whose column map is
computed in the kernel from the section boundaries (compile-time constants)."""

import triton
import triton.language as tl


@triton.jit
def permute_sections_kernel(
    plain_ptr,  # [R, F] words, F = cp_size * LOFF[-1]
    blocked_ptr,  # rank blocks: element (d, r, j) at d * blocked_stride_d + r * blocked_stride_r + j
    num_rows,  # R
    cp_size,
    blocked_stride_d,
    blocked_stride_r,
    LOFF: tl.constexpr,  # tuple: cumulative local section widths (in words), LOFF[0] = 0
    TO_BLOCKS: tl.constexpr,  # True: plain -> blocked (permute); False: blocked -> plain
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Moves a ``[BLOCK_R, BLOCK_C]`` tile between the plain and the rank-blocked layout.

    Plain column c lies in section b when ``W*LOFF[b] <= c < W*LOFF[b+1]``; with
    ``w_b = LOFF[b+1] - LOFF[b]`` (the local width) and ``u = c - W*LOFF[b]`` it belongs to
    rank ``d = u // w_b`` at column ``j = LOFF[b] + u mod w_b`` of that rank's block:
        TO_BLOCKS:      blocked[d, r, j] = plain[r, c]
        not TO_BLOCKS:  plain[r, c] = blocked[d, r, j]
    The tile is indexed by plain columns in both directions, so the plain side is
    read or written contiguously and the blocked side in runs of w_b words.
    The section loop is unrolled at compile time (a handful of sections), so the
    divisions are by constants and no boundary table is loaded.
    """
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    num_cols = LOFF[len(LOFF) - 1] * cp_size
    d = tl.zeros_like(cols)
    j = tl.zeros_like(cols)
    for b in tl.static_range(len(LOFF) - 1):
        if LOFF[b + 1] > LOFF[b]:  # zero-width sections own no column
            lo = LOFF[b] * cp_size
            u = cols - lo
            in_b = (u >= 0) & (u < (LOFF[b + 1] - LOFF[b]) * cp_size)
            d_b = u // (LOFF[b + 1] - LOFF[b])
            d = tl.where(in_b, d_b, d)
            j = tl.where(in_b, LOFF[b] + u - d_b * (LOFF[b + 1] - LOFF[b]), j)
    mask = (rows < num_rows)[:, None] & (cols < num_cols)[None, :]
    rows64 = rows.to(tl.int64)
    plain_offs = rows64[:, None] * num_cols + cols[None, :]
    blocked_offs = d.to(tl.int64)[None, :] * blocked_stride_d + rows64[:, None] * blocked_stride_r + j[None, :]
    if TO_BLOCKS:
        vals = tl.load(plain_ptr + plain_offs, mask=mask)
        tl.store(blocked_ptr + blocked_offs, vals, mask=mask)
    else:
        vals = tl.load(blocked_ptr + blocked_offs, mask=mask)
        tl.store(plain_ptr + plain_offs, vals, mask=mask)
