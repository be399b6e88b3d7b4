"""The THD layout with load-balanced CP sharding: construction, validation, (un)sharding.

A batch is B sequences packed along dim 0 of a ``[T, ...]`` tensor.

- ``cu_seqlens`` (int32, ``[B+1]``): cumulative real lengths ``L_i``.
- ``cu_seqlens_padded`` (int32, ``[B+1]``): cumulative padded lengths
  ``P_i = ceil(L_i / 2W) * 2W``. Sequence i occupies rows
  ``[cup[i], cup[i+1])``, real tokens first, padding at its tail; ``T = cup[B]``.
- Each padded sequence is cut into 2W chunks of ``c_i = P_i / 2W`` rows. Rank r
  holds, for every sequence in order, chunk ``r`` then chunk ``2W-1-r``, so each
  rank gets the same causal work. Its local tensor has ``T/W`` rows and local
  offsets ``cup / W``.

The helpers here are for data preparation: they may sync with the host
(``validate_*`` read values on purpose). The ops in ``custom_ops`` never do.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

import custom_ops
from custom_ops._common import check_cp_size, check_index_tensor
from custom_ops.thd_reorder.reference import rank_to_seq_index, seq_to_rank_index

__all__ = [
    "pad_cu_seqlens",
    "validate_thd",
    "validate_offsets",
    "local_cu_seqlens",
    "local_positions",
    "shard_thd",
    "unshard_thd",
    "pack",
    "seq_to_rank_index",
    "rank_to_seq_index",
]


def pad_cu_seqlens(
    seqlens: Sequence[int] | torch.Tensor, cp_size: int, *, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cu_seqlens, cu_seqlens_padded)`` (int32) for real lengths ``seqlens``.

    ``P_i = ceil(L_i / (2*cp_size)) * 2*cp_size``; zero-length sequences stay zero.
    """
    check_cp_size(cp_size)
    if isinstance(seqlens, torch.Tensor):
        device = seqlens.device if device is None else device
        lens = seqlens.to(torch.int64).flatten()
    else:
        lens = torch.tensor(list(seqlens), dtype=torch.int64)
    if lens.numel() and int(lens.min()) < 0:
        i = int(torch.nonzero(lens < 0)[0])
        raise ValueError(f"seqlens: sequence {i} has negative length {int(lens[i])}")
    block = 2 * cp_size
    padded = (lens + block - 1) // block * block
    zero = lens.new_zeros(1)
    cu = torch.cat([zero, lens.cumsum(0)]).to(torch.int32)
    cup = torch.cat([zero, padded.cumsum(0)]).to(torch.int32)
    return cu.to(device), cup.to(device)


def _first_bad(mask: torch.Tensor) -> int | None:
    idx = torch.nonzero(mask)
    return int(idx[0]) if idx.numel() else None


def _check_cumulative(name: str, cu: torch.Tensor) -> None:
    if int(cu[0]) != 0:
        raise ValueError(f"{name} must start at 0, got {int(cu[0])}")
    bad = _first_bad(cu[1:] < cu[:-1])
    if bad is not None:
        raise ValueError(
            f"{name} must be non-decreasing: sequence {bad} has {name}[{bad}] = {int(cu[bad])} > "
            f"{name}[{bad + 1}] = {int(cu[bad + 1])}"
        )


def validate_thd(
    cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor, cp_size: int, num_rows: int | None = None
) -> None:
    """Raise ``ValueError`` (naming the argument and sequence) unless the layout is valid.

    Checks: int32/int64 1-D tensors of one length on one device; both start at
    0 and are non-decreasing; every padded length is a multiple of 2*cp_size
    and at least the real length; ``cu_seqlens_padded[-1] == num_rows`` if
    given. Reads values, so call it where data is prepared, not in a compiled step.
    """
    check_cp_size(cp_size)
    check_index_tensor("cu_seqlens_padded", cu_seqlens_padded, cu_seqlens_padded.device)
    check_index_tensor("cu_seqlens", cu_seqlens, cu_seqlens_padded.device)
    if cu_seqlens.shape != cu_seqlens_padded.shape:
        raise ValueError(
            f"cu_seqlens and cu_seqlens_padded must have one length (B+1), got {cu_seqlens.shape[0]} "
            f"and {cu_seqlens_padded.shape[0]}"
        )
    cu, cup = cu_seqlens.to(torch.int64), cu_seqlens_padded.to(torch.int64)
    _check_cumulative("cu_seqlens", cu)
    _check_cumulative("cu_seqlens_padded", cup)
    lens, padded = cu.diff(), cup.diff()
    block = 2 * cp_size
    bad = _first_bad(padded % block != 0)
    if bad is not None:
        raise ValueError(
            f"cu_seqlens_padded: sequence {bad} has padded length {int(padded[bad])}, "
            f"not a multiple of 2*cp_size = {block}"
        )
    bad = _first_bad(lens > padded)
    if bad is not None:
        raise ValueError(
            f"cu_seqlens: sequence {bad} has real length {int(lens[bad])} > padded length {int(padded[bad])}"
        )
    if num_rows is not None and int(cup[-1]) != num_rows:
        raise ValueError(f"cu_seqlens_padded[-1] = {int(cup[-1])} but the tensor has {num_rows} rows")


def validate_offsets(offsets: torch.Tensor, cu_seqlens: torch.Tensor, num_rows: int) -> None:
    """Raise ``ValueError`` unless the segments ``[offsets[i], offsets[i] + L_i)`` of
    :func:`custom_ops.thd_copy_valid_tokens` are sorted, disjoint and inside ``num_rows`` rows."""
    check_index_tensor("cu_seqlens", cu_seqlens, cu_seqlens.device)
    check_index_tensor("offsets", offsets, cu_seqlens.device, min_numel=0)
    n_seq = cu_seqlens.shape[0] - 1
    if offsets.shape[0] not in (n_seq, n_seq + 1):
        raise ValueError(f"offsets must have B or B+1 entries for B = {n_seq}, got {offsets.shape[0]}")
    cu = cu_seqlens.to(torch.int64)
    _check_cumulative("cu_seqlens", cu)
    starts = offsets[:n_seq].to(torch.int64)
    ends = starts + cu.diff()
    bad = _first_bad(starts < 0)
    if bad is not None:
        raise ValueError(f"offsets: sequence {bad} starts at negative row {int(starts[bad])}")
    bad = _first_bad(starts[1:] < ends[:-1])
    if bad is not None:
        raise ValueError(
            f"offsets: sequence {bad + 1} starts at row {int(starts[bad + 1])}, inside sequence {bad} "
            f"(rows {int(starts[bad])}..{int(ends[bad]) - 1}); segments must be sorted and disjoint"
        )
    bad = _first_bad(ends > num_rows)
    if bad is not None:
        raise ValueError(f"offsets: sequence {bad} ends at row {int(ends[bad])}, past the {num_rows} rows")


def local_cu_seqlens(cu_seqlens_padded: torch.Tensor, cp_size: int) -> torch.Tensor:
    """Offsets of the sequences in every rank's local shard: ``cu_seqlens_padded / cp_size``."""
    check_cp_size(cp_size)
    return torch.div(cu_seqlens_padded, cp_size, rounding_mode="floor")


def local_positions(cu_seqlens_padded: torch.Tensor, cp_size: int, rank: int, num_local_rows: int) -> torch.Tensor:
    """Position within its sequence of every row of rank ``rank``'s shard (int64, ``[T/W]``).

    Local row x of sequence i (``0 <= x < 2c_i``) sits at ``j*c_i + (x mod c_i)`` with
    ``j = rank`` if ``x < c_i`` else ``2W-1-rank``. With ``cp_size = 1`` this is the
    plain position ``row - cu_seqlens_padded[i]``. Computed on the device, no host sync
    (usable inside compiled code, e.g. for rotary embeddings).
    """
    cup = cu_seqlens_padded.to(torch.int64)
    w = cp_size
    local = torch.arange(num_local_rows, device=cup.device, dtype=torch.int64)
    last_seq = max(cup.numel() - 2, 0)
    i = (torch.searchsorted(cup, local * w, right=True) - 1).clamp(0, last_seq)
    start, end = cup[i], cup[(i + 1).clamp(max=cup.numel() - 1)]
    c = (end - start) // (2 * w)
    x = local - start // w
    first = x < c
    return torch.where(first, rank * c + x, (2 * w - 1 - rank) * c + x - c)


def shard_thd(x: torch.Tensor, cu_seqlens_padded: torch.Tensor, cp_size: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s local shard ``[T/W, ...]`` of a sequence-order tensor ``[T, ...]``."""
    check_cp_size(cp_size)
    if not 0 <= rank < cp_size:
        raise ValueError(f"rank must be in [0, {cp_size}), got {rank}")
    check_index_tensor("cu_seqlens_padded", cu_seqlens_padded, x.device)
    num_rows = x.shape[0]
    if num_rows % (2 * cp_size):
        raise ValueError(f"x has {num_rows} rows, not a multiple of 2*cp_size = {2 * cp_size}")
    per_rank = num_rows // cp_size
    idx = seq_to_rank_index(cu_seqlens_padded, cp_size, num_rows)[rank * per_rank : (rank + 1) * per_rank]
    return x.index_select(0, idx)


def unshard_thd(shards: Sequence[torch.Tensor], cu_seqlens_padded: torch.Tensor, cp_size: int) -> torch.Tensor:
    """The sequence-order tensor ``[T, ...]`` from the W local shards, rank 0 first."""
    check_cp_size(cp_size)
    if len(shards) != cp_size:
        raise ValueError(f"expected {cp_size} shards (one per rank), got {len(shards)}")
    rows = {s.shape[0] for s in shards}
    if len(rows) != 1:
        raise ValueError(f"all shards must have T/W rows, got row counts {sorted(rows)}")
    return custom_ops.thd_rank_to_seq_order(torch.cat(list(shards)), cu_seqlens_padded, cp_size)


def pack(
    tensors: Sequence[torch.Tensor], cp_size: int, *, padding_value: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pack sequences ``[L_i, ...]`` (one trailing shape) into THD.

    Returns ``(x [T, ...], cu_seqlens, cu_seqlens_padded)``: each sequence's real
    tokens then ``padding_value`` up to its padded length. The index tensors are
    int32 on the tensors' device.
    """
    if len(tensors) == 0:
        raise ValueError("pack needs at least one tensor")
    first = tensors[0]
    for i, t in enumerate(tensors):
        if t.dim() < 1 or t.shape[1:] != first.shape[1:] or t.dtype != first.dtype or t.device != first.device:
            raise ValueError(
                f"tensor {i} has shape {tuple(t.shape)}, {t.dtype} on {t.device}; every tensor must be "
                f"[L_i, {', '.join(map(str, first.shape[1:]))}] {first.dtype} on {first.device}"
            )
    cu, cup = pad_cu_seqlens([t.shape[0] for t in tensors], cp_size, device=first.device)
    out = first.new_full((int(cup[-1]),) + tuple(first.shape[1:]), padding_value)
    for t, start in zip(tensors, cup.tolist()):
        out[start : start + t.shape[0]] = t
    return out, cu, cup
