"""Torch references for the THD reorder ops.

Rank order is the concatenation of the W local shards, rank 0 first. Rank r
holds, for every sequence i in order, chunk r then chunk 2W-1-r of its padded
rows, each chunk ``c_i = P_i / (2W)`` rows long (see docs/design.md section 1);
the index maps are :mod:`custom_ops.thd.index`'s.

``thd_*_reference`` are vectorised (no host sync) and are what the ops run on
CPU. ``thd_*_loop`` spell the definition out as a Python loop over (rank,
sequence): an independent oracle for tests and the baseline in the benchmark.
"""

import torch

from custom_ops.runtime.words import index_select_any
from custom_ops.thd.index import chunk_spans, rank_to_seq_index, seq_to_rank_index


def thd_seq_to_rank_order_reference(x: torch.Tensor, cu_seqlens_padded: torch.Tensor, cp_size: int) -> torch.Tensor:
    """:func:`custom_ops.thd_seq_to_rank_order` in torch ops (one ``index_select`` of the rows).

    x: ``[T, ...]`` any dtype, ``T = cu_seqlens_padded[-1]``; returns ``[T, ...]`` in CP rank
    order. Differentiable through ``index_select``; no argument checks, no host sync.
    """
    return index_select_any(x, 0, seq_to_rank_index(cu_seqlens_padded, cp_size, x.shape[0]))


def thd_rank_to_seq_order_reference(x: torch.Tensor, cu_seqlens_padded: torch.Tensor, cp_size: int) -> torch.Tensor:
    """:func:`custom_ops.thd_rank_to_seq_order` in torch ops (one ``index_select`` of the rows).

    x: ``[T, ...]`` in CP rank order; returns ``[T, ...]`` in sequence order. Differentiable
    through ``index_select``; no argument checks, no host sync.
    """
    return index_select_any(x, 0, rank_to_seq_index(cu_seqlens_padded, cp_size, x.shape[0]))


def thd_seq_to_rank_order_loop(x: torch.Tensor, cu_seqlens_padded: torch.Tensor, cp_size: int) -> torch.Tensor:
    """The definition as a loop over (rank, sequence, chunk); syncs with the host."""
    parts = [x[s : s + c] for _, s, c in chunk_spans(cu_seqlens_padded, cp_size)]
    return torch.cat(parts) if parts else x[:0].clone()


def thd_rank_to_seq_order_loop(x: torch.Tensor, cu_seqlens_padded: torch.Tensor, cp_size: int) -> torch.Tensor:
    """The inverse, as a loop writing each chunk back to its place; syncs with the host."""
    out = torch.empty_like(x)
    row = 0
    for _, s, c in chunk_spans(cu_seqlens_padded, cp_size):
        out[s : s + c] = x[row : row + c]
        row += c
    return out
