"""Views that let one row-moving kernel move every dtype bit-exactly: tensors as words of their
element size, and tensors as row-major matrices."""

from __future__ import annotations

import math

import torch

# Integer types used to move elements bit-exactly, whatever their dtype.
_WORD_DTYPES = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


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


def unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its last dim contiguous, any other strides: a copy only where that stride is
    not 1. Kernels that take row (and head) strides read views (column slices of a wider
    tensor, head slices of a gathered one) in place this way, where ``.contiguous()`` would
    copy them."""
    return t if t.stride(-1) == 1 else t.contiguous()
