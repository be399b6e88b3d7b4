"""Triton kernel for the head-section permutation: each program moves contiguous runs (one
rank's slice of a section) between the plain and the rank-blocked layout."""

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
    BLOCKS: tl.constexpr,  # tuple: column tile (a power of 2) of each section
    TO_BLOCKS: tl.constexpr,  # True: plain -> blocked (permute); False: blocked -> plain
    BLOCK_R: tl.constexpr,
):
    """Moves rows ``[BLOCK_R * pid0, +BLOCK_R)`` of rank ``d = pid1``'s slice of every section:
    column tile ``pid2`` of each section that has that many tiles (``BLOCKS[b]`` words each).

    Section b has local width ``w_b = LOFF[b+1] - LOFF[b]``; rank d's slice of it is plain
    columns ``[W*LOFF[b] + d*w_b, +w_b)`` and columns ``[LOFF[b], LOFF[b+1])`` of block d:
        TO_BLOCKS:      blocked[d, r, LOFF[b] + j] = plain[r, W*LOFF[b] + d*w_b + j]
        not TO_BLOCKS:  the reverse.
    Both sides of every tile are contiguous runs, so loads and stores vectorise (with
    a per-column map computed in the kernel the compiler cannot prove the blocked side
    contiguous and stores scalars; docs/benchmarks.md, section "Fused CP <-> head-parallel
    all-to-all"). The section loop is unrolled at compile time.
    """
    pid_r = tl.program_id(0)
    d = tl.program_id(1)
    pid_c = tl.program_id(2)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = (rows < num_rows)[:, None]
    rows64 = rows.to(tl.int64)
    plain_row = rows64[:, None] * (LOFF[len(LOFF) - 1] * cp_size)
    blocked_row = d.to(tl.int64) * blocked_stride_d + rows64[:, None] * blocked_stride_r
    for b in tl.static_range(len(LOFF) - 1):
        width = LOFF[b + 1] - LOFF[b]
        if width > 0:  # zero-width sections own no column
            if pid_c * BLOCKS[b] < width:
                cols = pid_c * BLOCKS[b] + tl.arange(0, BLOCKS[b])
                mask = row_ok & (cols < width)[None, :]
                plain_offs = plain_row + (LOFF[b] * cp_size + d * width) + cols[None, :]
                blocked_offs = blocked_row + LOFF[b] + cols[None, :]
                if TO_BLOCKS:
                    vals = tl.load(plain_ptr + plain_offs, mask=mask)
                    tl.store(blocked_ptr + blocked_offs, vals, mask=mask)
                else:
                    vals = tl.load(blocked_ptr + blocked_offs, mask=mask)
                    tl.store(plain_ptr + plain_offs, vals, mask=mask)
