"""Torch references for the THD reorder ops.

Rank order is the concatenation of the W local shards, rank 0 first. Rank r
holds, for every sequence i in order, chunk r then chunk 2W-1-r of its padded
rows, each chunk ``c_i = P_i / (2W)`` rows long (see docs/design.md section 1).

``thd_*_reference`` are vectorised (no host sync) and are what the ops run on
CPU. ``thd_*_loop`` spell the definition out as a Python loop over (rank,
sequence): an independent oracle for tests and the baseline in the benchmark.
"""

import torch


def seq_to_rank_index(cu_seqlens_padded: torch.Tensor, cp_size: int, num_rows: int) -> torch.Tensor:
    """``idx[y]`` = the sequence-order row that rank-order row ``y`` holds (int64, ``[num_rows]``).

    For rank-order row y: rank ``r = y // (T/W)``, local row ``l = y mod (T/W)``,
    sequence i with ``cup[i]/W <= l < cup[i+1]/W``, local offset ``x = l - cup[i]/W``,
    chunk ``j = r if x < c_i else 2W-1-r`` and source row
    ``cup[i] + j*c_i + (x mod c_i)``.
    """
    cup = cu_seqlens_padded.to(torch.int64)
    w = cp_size
    y = torch.arange(num_rows, device=cup.device, dtype=torch.int64)
    if num_rows == 0:
        return y
    rows_per_rank = num_rows // w
    r = y // rows_per_rank
    local = y - r * rows_per_rank
    # cup entries are multiples of W, so cup[i]/W <= local  <=>  cup[i] <= local*W
    last_seq = max(cup.numel() - 2, 0)
    i = (torch.searchsorted(cup, local * w, right=True) - 1).clamp(0, last_seq)
    start, end = cup[i], cup[(i + 1).clamp(max=cup.numel() - 1)]
    c = (end - start) // (2 * w)
    x = local - start // w
    first = x < c
    j = torch.where(first, r, 2 * w - 1 - r)
    return start + j * c + torch.where(first, x, x - c)


def rank_to_seq_index(cu_seqlens_padded: torch.Tensor, cp_size: int, num_rows: int) -> torch.Tensor:
    """``idx[g]`` = the rank-order row holding sequence-order row ``g``: the inverse of
    :func:`seq_to_rank_index`, built by scattering (the kernel uses a closed formula)."""
    fwd = seq_to_rank_index(cu_seqlens_padded, cp_size, num_rows)
    inv = torch.empty_like(fwd)
    inv[fwd] = torch.arange(num_rows, device=fwd.device, dtype=fwd.dtype)
    return inv


def thd_seq_to_rank_order_reference(x: torch.Tensor, cu_seqlens_padded: torch.Tensor, cp_size: int) -> torch.Tensor:
    return x.index_select(0, seq_to_rank_index(cu_seqlens_padded, cp_size, x.shape[0]))


def thd_rank_to_seq_order_reference(x: torch.Tensor, cu_seqlens_padded: torch.Tensor, cp_size: int) -> torch.Tensor:
    return x.index_select(0, rank_to_seq_index(cu_seqlens_padded, cp_size, x.shape[0]))


def _chunks(cu_seqlens_padded: torch.Tensor, cp_size: int):
    """(rank, global start, length) of every chunk, in rank order."""
    cup = cu_seqlens_padded.tolist()
    w = cp_size
    for r in range(w):
        for i in range(len(cup) - 1):
            c = (cup[i + 1] - cup[i]) // (2 * w)
            for j in (r, 2 * w - 1 - r):
                yield r, cup[i] + j * c, c


def thd_seq_to_rank_order_loop(x: torch.Tensor, cu_seqlens_padded: torch.Tensor, cp_size: int) -> torch.Tensor:
    """The definition as a loop over (rank, sequence, chunk); syncs with the host."""
    parts = [x[s : s + c] for _, s, c in _chunks(cu_seqlens_padded, cp_size)]
    return torch.cat(parts) if parts else x[:0].clone()


def thd_rank_to_seq_order_loop(x: torch.Tensor, cu_seqlens_padded: torch.Tensor, cp_size: int) -> torch.Tensor:
    """The inverse, as a loop writing each chunk back to its place; syncs with the host."""
    out = torch.empty_like(x)
    row = 0
    for _, s, c in _chunks(cu_seqlens_padded, cp_size):
        out[s : s + c] = x[row : row + c]
        row += c
    return out
