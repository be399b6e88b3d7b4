"""Shared helpers for the op modules: argument checks, dispatch, word views.

Every op in this package checks shapes, dtypes and devices (free, and done at
trace time under ``torch.compile``). Checks of *values* (monotone cu_seqlens,
divisibility by 2*cp_size, ...) need a host sync, so they live in
:mod:`custom_ops.validation`, run where data is prepared or in the checked mode.
Ops register through :mod:`custom_ops.registration` and launch kernels through
:mod:`custom_ops.launch`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from custom_ops import env

NAMESPACE = "cp_ops"

_INDEX_DTYPES = (torch.int32, torch.int64)


# Host arithmetic for grids and tiles. Triton's own ``triton.cdiv`` and
# ``triton.next_power_of_2`` are constexpr functions, which unwrap their arguments at every
# host call and cost microseconds each.
def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of 2 >= n, for n >= 1 (0 for 0, as Triton's)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0

# Integer types used to move elements bit-exactly, whatever their dtype.
_WORD_DTYPES = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def triton_interpreting() -> bool:
    """True when Triton runs kernels on CPU tensors (TRITON_INTERPRET=1)."""
    return env.triton_interpret()


def use_triton(t: torch.Tensor) -> bool:
    """Whether an op body launches its Triton kernel for tensors on ``t``'s device.

    CUDA tensors always do. CPU tensors run the torch reference, except under
    ``TRITON_INTERPRET=1``, where the kernels run in Triton's interpreter (how
    the kernels are tested on machines without a GPU). The answer depends on the
    device only, so it is a trace-time constant under ``torch.compile``.
    """
    return t.is_cuda or (t.device.type == "cpu" and triton_interpreting())


def unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its last dim contiguous, any other strides: a copy only where that stride is
    not 1. Kernels that take row (and head) strides read views (column slices of a wider
    tensor, head slices of a gathered one) in place this way, where ``.contiguous()`` would
    copy them."""
    return t if t.stride(-1) == 1 else t.contiguous()


def check_index_tensor(name: str, t: torch.Tensor, device: torch.device, min_numel: int = 1) -> None:
    """A 1-D int32/int64 tensor on ``device`` with at least ``min_numel`` entries."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _INDEX_DTYPES:
        raise TypeError(f"{name} must be int32 or int64, got {t.dtype}")
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    if t.numel() < min_numel:
        raise ValueError(f"{name} must have at least {min_numel} entries, got {t.numel()}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but the data is on {device}; put them on one device")


def check_cp_size(cp_size: int) -> None:
    """Raise ``TypeError`` unless ``cp_size`` is an int (a ``SymInt`` under tracing, never a
    bool) and ``ValueError`` unless it is at least 1."""
    # SymInt: dynamo turns an int that changes between calls into a symbol (automatic dynamic)
    if isinstance(cp_size, bool) or not isinstance(cp_size, (int, torch.SymInt)):
        raise TypeError(f"cp_size must be an int, got {type(cp_size).__name__}")
    if cp_size < 1:
        raise ValueError(f"cp_size must be >= 1, got {cp_size}")


def check_rows(name: str, x: torch.Tensor) -> None:
    """``x`` is a tensor with a leading token dimension."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 1:
        raise ValueError(f"{name} must have a leading token dimension, got a 0-d tensor")


# dtypes Triton loads and stores as themselves; moving them is bit-exact
_NATIVE_DTYPES = frozenset((
    torch.float16, torch.bfloat16, torch.float32, torch.float64,
    torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8,
))  # fmt: skip


def word_dtype(dtype: torch.dtype) -> tuple[torch.dtype, int]:
    """(dtype a row-moving kernel uses for ``dtype``, words per element).

    Standard dtypes move as themselves. Others (float8, bool, complex, ...) move as
    integers of their element size, 16-byte elements as two int64 words, so every
    dtype is moved bit-exactly. Only those take a dtype view: Inductor cannot always
    lower a dtype view of an intermediate that feeds a user kernel.
    """
    if dtype in _NATIVE_DTYPES:
        return dtype, 1
    size = torch.empty((), dtype=dtype).element_size()
    if size in _WORD_DTYPES:
        return _WORD_DTYPES[size], 1
    return torch.int64, size // 8


def to_words(x2: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A contiguous 2-D tensor viewed in its :func:`word_dtype`, and the words per element."""
    dtype, k = word_dtype(x2.dtype)
    return (x2 if dtype == x2.dtype else x2.view(dtype)), k


def from_words(words: torch.Tensor, dtype: torch.dtype, shape) -> torch.Tensor:
    """The inverse of :func:`to_words`: ``words`` seen as ``dtype`` with ``shape``."""
    return (words if words.dtype == dtype else words.view(dtype)).view(shape)


def index_select_any(x: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:
    """``x.index_select(dim, index)`` for every dtype: the unsigned integers past uint8, whose CPU
    ``index_select`` lacks kernels in some layouts, move as their :func:`word_dtype` (same bits)."""
    if x.dtype in _NATIVE_DTYPES or x.dtype == torch.bool or x.dtype.is_floating_point or x.dtype.is_complex:
        return x.index_select(dim, index)
    return x.view(word_dtype(x.dtype)[0]).index_select(dim, index).view(x.dtype)


def dense(x: torch.Tensor) -> torch.Tensor:
    """``x`` contiguous with a last stride of 1, which a view in another dtype needs: torch calls
    a tensor of at most one element contiguous whatever its strides, and such a one is copied."""
    x = x.contiguous()
    if x.dim() and x.stride(-1) != 1:
        x = x.new_empty(x.shape).copy_(x)
    return x


def as_words(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a contiguous ``[T, D']`` matrix a row-moving kernel can load and store."""
    x = dense(x)
    return to_words(x.reshape(x.shape[0], math.prod(x.shape[1:])))[0]


def row_matrix(x: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """``(m, rows, cols)``: ``x`` as the row-major ``[T, cols]`` matrix a row-moving kernel loads
    and stores. For the dtypes Triton moves as themselves, ``m`` is ``x`` made contiguous, in
    its own shape: a kernel addresses it by rows and columns, and no view is made (each costs
    host time at every call). For the others, the view in words of :func:`as_words` (cols in
    words). :func:`from_row_matrix` turns a kernel's output of the same form back."""
    x = x.contiguous()
    if x.dtype in _NATIVE_DTYPES:
        rows = x.shape[0]
        return x, rows, (x.numel() // rows if rows else math.prod(x.shape[1:]))
    words = as_words(x)
    return words, words.shape[0], words.shape[1]


def from_row_matrix(m: torch.Tensor, dtype: torch.dtype, shape) -> torch.Tensor:
    """A kernel's output ``m``, of ``dtype`` already (as :func:`row_matrix` passes the dtypes Triton
    moves as themselves) or in words (:func:`to_words`), as ``dtype`` with ``shape``: ``m`` itself
    where it has both already, else a view."""
    return m if m.dtype == dtype and m.shape == shape else from_words(m, dtype, shape)


@dataclass(frozen=True)
class RowTile:
    """Tile shape of the row-moving kernels (reorder, valid-token copy): a program moves whole
    rows of up to ``max_row_bytes`` bytes, about ``tile_bytes`` in all, with ``num_warps``."""

    tile_bytes: int = 16384
    max_row_bytes: int = 8192
    num_warps: int = 4


# The tile the ops launch with; a benchmark sweeps others by passing them to :func:`row_tile`.
# The defaults were picked on an H100 (docs/benchmarks.md, section "THD layout ops").
ROW_TILE = RowTile()


def row_tile(cols: int, word_bytes: int, tile: RowTile = ROW_TILE) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_D, num_warps) for a row-moving kernel over ``[T, cols]`` words.

    A program moves BLOCK_R whole rows of up to ``tile.max_row_bytes`` bytes, about
    ``tile.tile_bytes`` in all; wider rows are split over a second grid axis.
    """
    if type(cols) is int:  # not a SymInt of a traced graph: the answer is cached
        return _cached_row_tile(cols, word_bytes, tile)
    return _row_tile(cols, word_bytes, tile)


@functools.lru_cache(maxsize=1024)
def _cached_row_tile(cols: int, word_bytes: int, tile: RowTile) -> tuple[int, int, int]:
    return _row_tile(cols, word_bytes, tile)


def _row_tile(cols, word_bytes: int, tile: RowTile) -> tuple[int, int, int]:
    block_d = max(1, min(next_power_of_2(max(cols, 1)), tile.max_row_bytes // word_bytes))
    block_r = max(1, min(64, tile.tile_bytes // (block_d * word_bytes)))
    return block_r, block_d, tile.num_warps
