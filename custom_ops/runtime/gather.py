"""Row gather by an index map on the device: ``x[rows]`` as one row-moving Triton kernel.

Used where an op gathers whole rows by a map it is given (``varlen_attention`` with a key-row map): the rows move
as contiguous words, as the THD reorder kernel moves them, where ``index_select`` addresses every
element on its own.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from custom_ops.runtime.launch import launch_rows, use_triton
from custom_ops.runtime.tiles import ROW_SETTINGS
from custom_ops.runtime.words import from_row_matrix, index_select_any, row_matrix
from custom_ops.thd.checks import layout_index_error

__all__ = ["gather_rows", "launch_gather_rows"]


@triton.jit
def gather_rows_kernel(
    x_ptr,
    out_ptr,
    rows_ptr,  # [num_rows] int32/int64: the source row of every output row
    num_rows,
    cols,  # words per row
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """``out[r] = x[rows[r]]`` for BLOCK_R output rows and BLOCK_D words; the source row clamped
    into ``[0, num_rows)``, so that a bad map never reads out of bounds."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = r < num_rows
    src = tl.load(rows_ptr + r, mask=row_ok, other=0).to(tl.int64)
    src = tl.minimum(tl.maximum(src, 0), num_rows - 1)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = row_ok[:, None] & (offs_d < cols)[None, :]
    vals = tl.load(x_ptr + src[:, None] * cols + offs_d[None, :], mask=mask)
    tl.store(out_ptr + r.to(tl.int64)[:, None] * cols + offs_d[None, :], vals, mask=mask)


def gather_rows(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``x[rows]`` for ``x [T, ...]`` and ``rows`` (int, ``[T]``, values in ``[0, T)``; a
    permutation where it is a reorder): the Triton kernel where the package runs Triton, else
    ``index_select``."""
    if not use_triton(x):
        try:
            return index_select_any(x, 0, rows)
        except IndexError as e:
            raise layout_index_error(e) from e
    return launch_gather_rows(x, rows)


def launch_gather_rows(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """:func:`gather_rows` by the kernel, whatever the device (meta tensors precompile it)."""
    src, num_rows, cols = row_matrix(x)
    out = torch.empty_like(src)
    if num_rows > 0 and cols > 0:
        launch_rows(gather_rows_kernel, ROW_SETTINGS, num_rows, cols, src.element_size(), src, out, rows.contiguous(),
                    num_rows, cols)  # fmt: skip
    return from_row_matrix(out, x.dtype, x.shape)
