"""Triton kernel of the ``fa4`` attention backend (:mod:`custom_ops.ag_attention.fa4`): zeroes the
rows that none of a tensor's FlashAttention 4 calls covers, so that the backend writes a padded
layout's padding rows without zero-filling whole tensors first."""

import triton
import triton.language as tl

from custom_ops.runtime.triton_utils import search_sorted_right


@triton.jit
def zero_uncovered_rows_kernel(x_ptr, cu_ptr, used_ptr, calls, batch, num_rows, cols,
                               BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    """Row g of ``x [num_rows, cols]`` is covered by call c iff, for i the last sequence with
    ``cu[c, i] <= g``, ``g < cu[c, i] + used[c, i]`` (``cu [calls, batch + 1]``, ``used [calls,
    batch]``); rows no call covers are set to 0, the others are neither read nor written."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    covered = rows >= num_rows
    for c in range(calls):
        i = search_sorted_right(cu_ptr + c * (batch + 1), batch, rows)
        found = i >= 0
        i = tl.maximum(i, 0)
        start = tl.load(cu_ptr + c * (batch + 1) + i, mask=found, other=0)
        used = tl.load(used_ptr + c * batch + i, mask=found, other=0)
        covered = covered | (found & (rows < start + used))
    zero = ~covered
    # most blocks lie inside covered ranges: they store nothing
    if tl.max(zero.to(tl.int32), axis=0) > 0:
        offs = rows.to(tl.int64)[:, None] * cols
        for start in range(0, cols, BLOCK_D):
            offs_d = start + tl.arange(0, BLOCK_D)
            mask = zero[:, None] & (offs_d < cols)[None, :]
            tl.store(x_ptr + offs + offs_d[None, :], tl.zeros([BLOCK_R, BLOCK_D], x_ptr.dtype.element_ty), mask=mask)
