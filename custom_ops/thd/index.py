"""The index maps of the THD layout with dual-chunk CP sharding, in torch (docs/design.md section 1).

Every padded sequence i (``P_i = cup[i+1] - cup[i]`` rows, a multiple of ``2W``) is cut into
``2W`` chunks of ``c_i = P_i / 2W`` rows; rank r holds, for every sequence in order, chunk r and
then chunk ``2W-1-r``, so sequence i starts at row ``cup[i] / W`` of every rank's shard. The
functions here are the one torch-side statement of that rule: the reorder ops' references, the
layout helpers, the attention segment tables and the GDN layer's row map derive from them. The
reorder kernel evaluates the same formulas on the device (``custom_ops/thd_reorder/kernels.py``).

All but :func:`chunk_spans` are vectorised torch, computed on the index tensor's device with no
host sync, so they may run inside compiled code.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from custom_ops.thd.checks import layout_index_error

__all__ = [
    "padding_multiple",
    "local_chunks",
    "local_offsets",
    "chunk_rows",
    "local_chunk_bounds",
    "valid_rows",
    "local_positions",
    "shard_rows",
    "seq_to_rank_index",
    "rank_to_seq_index",
    "chunk_spans",
    "row_positions",
]


def padding_multiple(cp_size: int) -> int:
    """What every padded length is a multiple of: ``2W``, two chunks per rank."""
    return 2 * cp_size


def local_chunks(rank, cp_size: int) -> tuple:
    """The chunks rank ``rank`` (an int or an integer tensor) holds of every sequence, in the order
    of its shard: ``(rank, 2W-1-rank)``."""
    return rank, 2 * cp_size - 1 - rank


def local_offsets(offsets: torch.Tensor, cp_size: int) -> torch.Tensor:
    """Global sequence starts (``cup`` or a part of it) as rows of every rank's shard: ``cup / W``."""
    return torch.div(offsets, cp_size, rounding_mode="floor")


def chunk_rows(cu_seqlens_padded: torch.Tensor, cp_size: int) -> torch.Tensor:
    """``c_i = P_i / 2W``, the rows of each chunk of every sequence (``[B]``, cup's dtype)."""
    return (cu_seqlens_padded[1:] - cu_seqlens_padded[:-1]) // padding_multiple(cp_size)


def local_chunk_bounds(cu_seqlens_padded: torch.Tensor, cp_size: int) -> torch.Tensor:
    """``[2B+1]`` bounds of every rank's chunks among its rows (cup's dtype): chunk ``r``, then
    ``2W-1-r``, of each sequence, ``c_i`` rows each (the same bounds on every rank)."""
    chunk = chunk_rows(cu_seqlens_padded, cp_size).repeat_interleave(2)
    return torch.nn.functional.pad(torch.cumsum(chunk, 0), (1, 0)).to(cu_seqlens_padded.dtype)


def valid_rows(seqlens: torch.Tensor, chunk_len: torch.Tensor, chunk) -> torch.Tensor:
    """The real rows of chunk ``chunk`` (an int or a 0-d tensor) of every sequence:
    ``clamp(L_i - chunk*c_i, 0, c_i)``."""
    return torch.minimum((seqlens - chunk * chunk_len).clamp(min=0), chunk_len)


def _locate(cup: torch.Tensor, cp_size: int, local: torch.Tensor):
    """For shard rows ``local``: the sequence-order start of their sequence, its chunk length, and
    their offset among the sequence's shard rows (``x = local - cup[i]/W``). ``cup`` int64."""
    last_seq = max(cup.numel() - 2, 0)
    # cup entries are multiples of W, so cup[i]/W <= local  <=>  cup[i] <= local*W
    i = (torch.searchsorted(cup, local * cp_size, right=True) - 1).clamp(0, last_seq)
    start, end = cup[i], cup[(i + 1).clamp(max=cup.numel() - 1)]
    c = (end - start) // padding_multiple(cp_size)
    return start, c, local - start // cp_size


def _position(chunk_len: torch.Tensor, x: torch.Tensor, rank, cp_size: int) -> torch.Tensor:
    """The position in its sequence of shard row x (of ``2c`` rows) of rank ``rank``: in chunk
    ``j = rank if x < c else 2W-1-rank``, at ``j*c + (x mod c)``."""
    first = x < chunk_len
    return torch.where(first, rank * chunk_len + x, (2 * cp_size - 1 - rank) * chunk_len + x - chunk_len)


def local_positions(cu_seqlens_padded: torch.Tensor, cp_size: int, rank: int, num_local_rows: int) -> torch.Tensor:
    """Position within its sequence of every row of rank ``rank``'s shard (int64, ``[T/W]``).

    Local row x of sequence i (``0 <= x < 2c_i``) sits at ``j*c_i + (x mod c_i)`` with
    ``j = rank`` if ``x < c_i`` else ``2W-1-rank``. With ``cp_size = 1`` this is the plain
    position ``row - cu_seqlens_padded[i]``. Usable inside compiled code (the rotary positions
    of the attention layer).
    """
    cup = cu_seqlens_padded.to(torch.int64)
    local = torch.arange(num_local_rows, device=cup.device, dtype=torch.int64)
    _, c, x = _locate(cup, cp_size, local)
    return _position(c, x, rank, cp_size)


def shard_rows(cu_seqlens_padded: torch.Tensor, cp_size: int, rank: int, num_local_rows: int) -> torch.Tensor:
    """The sequence-order rows rank ``rank``'s shard holds, in shard order (int64, ``[T/W]``):
    ``cup[i]`` plus :func:`local_positions`."""
    cup = cu_seqlens_padded.to(torch.int64)
    local = torch.arange(num_local_rows, device=cup.device, dtype=torch.int64)
    start, c, x = _locate(cup, cp_size, local)
    return start + _position(c, x, rank, cp_size)


def seq_to_rank_index(cu_seqlens_padded: torch.Tensor, cp_size: int, num_rows: int) -> torch.Tensor:
    """``idx[y]`` = the sequence-order row that rank-order row ``y`` holds (int64, ``[num_rows]``).

    Rank-order row y is row ``l = y mod (T/W)`` of rank ``r = y // (T/W)``'s shard:
    :func:`shard_rows` of every rank, concatenated.
    """
    cup = cu_seqlens_padded.to(torch.int64)
    y = torch.arange(num_rows, device=cup.device, dtype=torch.int64)
    if num_rows == 0:
        return y
    rows_per_rank = num_rows // cp_size
    r = y // rows_per_rank
    start, c, x = _locate(cup, cp_size, y - r * rows_per_rank)
    return start + _position(c, x, r, cp_size)


def rank_to_seq_index(cu_seqlens_padded: torch.Tensor, cp_size: int, num_rows: int) -> torch.Tensor:
    """``idx[g]`` = the rank-order row holding sequence-order row ``g``: the inverse of
    :func:`seq_to_rank_index`, built by scattering (the kernel uses a closed formula)."""
    fwd = seq_to_rank_index(cu_seqlens_padded, cp_size, num_rows)
    inv = torch.empty_like(fwd)
    try:
        inv[fwd] = torch.arange(num_rows, device=fwd.device, dtype=fwd.dtype)
    except IndexError as e:
        raise layout_index_error(e) from e
    return inv


def chunk_spans(cu_seqlens_padded: torch.Tensor, cp_size: int) -> Iterator[tuple[int, int, int]]:
    """``(rank, global start, length)`` of every chunk, in rank order: the definition as a loop
    over (rank, sequence, chunk). Reads the offsets on the host."""
    cup = cu_seqlens_padded.tolist()
    for r in range(cp_size):
        for i in range(len(cup) - 1):
            c = (cup[i + 1] - cup[i]) // padding_multiple(cp_size)
            for j in local_chunks(r, cp_size):
                yield r, cup[i] + j * c, c


def row_positions(cu_seqlens: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Position of every packed row inside its sequence (int64 ``[num_rows]``), on the device.

    Row t belongs to the sequence i with ``cu[i] <= t < cu[i+1]`` (zero-length
    sequences are skipped by the right-sided search); its position is
    ``t - cu[i]``. Rows past ``cu[-1]`` count as continuing the last sequence.
    """
    cu = cu_seqlens.to(torch.int64)
    t = torch.arange(num_rows, device=cu.device, dtype=torch.int64)
    seq = (torch.searchsorted(cu, t, right=True) - 1).clamp(min=0, max=max(cu.numel() - 1, 0))
    return t - cu[seq]
