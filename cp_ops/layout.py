"""Preparing data in the THD layout with load-balanced CP sharding (docs/design.md section 1):
construction and (un)sharding, over the index maps and checks of :mod:`custom_ops.thd`.

A batch is B sequences packed along dim 0 of ``[T, ...]``; ``cu_seqlens`` and
``cu_seqlens_padded`` (int32, ``[B+1]``) are the cumulative real and padded lengths
(``P_i = ceil(L_i / 2W) * 2W``, padding at each sequence's tail). Rank r holds chunks ``r`` and
``2W-1-r`` of the 2W chunks of every sequence: ``T/W`` rows. These helpers prepare data: they
read values on the host and raise ``ValueError``, naming the argument and the sequence, for a
layout they would turn into wrong rows.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch

from custom_ops import (
    check_cp_size,
    check_index_tensor,
    local_offsets,
    padding_multiple,
    shard_rows,
    thd_rank_to_seq_order,
    validate_padded,
)

__all__ = [
    "pad_cu_seqlens",
    "local_cu_seqlens",
    "shard_thd",
    "unshard_thd",
    "pack",
    "static_seqlens",
    "static_num_tokens",
]


_INT32_MAX = torch.iinfo(torch.int32).max
_INTEGER_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def pad_cu_seqlens(
    seqlens: Sequence[int] | torch.Tensor, cp_size: int, *, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cu_seqlens, cu_seqlens_padded)`` (int32) for real lengths ``seqlens``.

    ``P_i = ceil(L_i / (2*cp_size)) * 2*cp_size``; zero-length sequences stay zero. Raises
    ``ValueError`` for negative lengths and for totals past int32 (the index dtype that
    flash-attention style kernels take): split such a batch.
    """
    check_cp_size(cp_size)
    if isinstance(seqlens, torch.Tensor):
        device = seqlens.device if device is None else device
        if seqlens.dim() != 1 or seqlens.dtype not in _INTEGER_DTYPES:
            raise ValueError(f"seqlens must be a 1-D integer tensor, got shape {tuple(seqlens.shape)} {seqlens.dtype}")
        lens = seqlens.to(torch.int64)
    else:
        values = []
        for i, n in enumerate(seqlens):
            try:
                if isinstance(n, bool):
                    raise TypeError
                values.append(operator.index(n))
            except TypeError:
                raise ValueError(f"seqlens: sequence {i} has length {n!r}, not an int") from None
        lens = torch.tensor(values, dtype=torch.int64)
    if lens.numel() and int(lens.min()) < 0:
        i = int(torch.nonzero(lens < 0)[0])
        raise ValueError(f"seqlens: sequence {i} has negative length {int(lens[i])}")
    block = padding_multiple(cp_size)
    padded = (lens + block - 1) // block * block
    zero = lens.new_zeros(1)
    cu = torch.cat([zero, lens.cumsum(0)])
    cup = torch.cat([zero, padded.cumsum(0)])
    if int(cup[-1]) > _INT32_MAX:
        i = int(torch.nonzero(cup > _INT32_MAX)[0]) - 1
        raise ValueError(
            f"seqlens: the padded lengths add up to {int(cup[-1])} rows, past int32 ({_INT32_MAX}) from "
            f"sequence {i} on; split the batch"
        )
    return cu.to(torch.int32).to(device), cup.to(torch.int32).to(device)


def local_cu_seqlens(cu_seqlens_padded: torch.Tensor, cp_size: int) -> torch.Tensor:
    """Offsets of the sequences in every rank's local shard: ``cu_seqlens_padded / cp_size``.

    Validates ``cu_seqlens_padded`` (:func:`custom_ops.validate_padded`), so reads values.
    """
    validate_padded(cu_seqlens_padded, cp_size)
    return local_offsets(cu_seqlens_padded, cp_size)


def shard_thd(x: torch.Tensor, cu_seqlens_padded: torch.Tensor, cp_size: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s local shard ``[T/W, ...]`` of a sequence-order tensor ``[T, ...]``.

    Validates ``cu_seqlens_padded`` against x (``cu_seqlens_padded[-1] == T``; reads values).
    """
    check_cp_size(cp_size)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < cp_size:
        raise ValueError(f"rank must be in [0, {cp_size}), got {rank!r}")
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        raise ValueError(f"x must be a tensor [T, ...] in sequence order, got {type(x).__name__}")
    check_index_tensor("cu_seqlens_padded", cu_seqlens_padded, x.device)
    num_rows = x.shape[0]
    validate_padded(cu_seqlens_padded, cp_size, num_rows)
    return x.index_select(0, shard_rows(cu_seqlens_padded, cp_size, rank, num_rows // cp_size))


def unshard_thd(shards: Sequence[torch.Tensor], cu_seqlens_padded: torch.Tensor, cp_size: int) -> torch.Tensor:
    """The sequence-order tensor ``[T, ...]`` from the W local shards, rank 0 first.

    Validates ``cu_seqlens_padded`` against the shards (``cu_seqlens_padded[-1] == W * T/W``).
    """
    check_cp_size(cp_size)
    if isinstance(shards, torch.Tensor):
        raise ValueError("shards must be a sequence of the W local tensors, got one tensor")
    if len(shards) != cp_size:
        raise ValueError(f"expected {cp_size} shards (one per rank), got {len(shards)}")
    first = shards[0]
    for r, t in enumerate(shards):
        if not isinstance(t, torch.Tensor) or t.dim() < 1:
            raise ValueError(f"shard {r} must be a tensor [T/W, ...], got {type(t).__name__}")
        if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
            raise ValueError(
                f"shard {r} is {tuple(t.shape)} {t.dtype} on {t.device}; every shard must be "
                f"{tuple(first.shape)} {first.dtype} on {first.device} (T/W rows each)"
            )
    check_index_tensor("cu_seqlens_padded", cu_seqlens_padded, first.device)
    validate_padded(cu_seqlens_padded, cp_size, cp_size * first.shape[0])
    return thd_rank_to_seq_order(torch.cat(list(shards)), cu_seqlens_padded, cp_size)


def pack(
    tensors: Sequence[torch.Tensor], cp_size: int, *, padding_value: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pack sequences ``[L_i, ...]`` (one trailing shape) into THD.

    Returns ``(x [T, ...], cu_seqlens, cu_seqlens_padded)``: each sequence's real
    tokens then ``padding_value`` up to its padded length. The index tensors are
    int32 on the tensors' device.
    """
    if isinstance(tensors, torch.Tensor):
        raise ValueError(
            f"tensors must be a list of sequences [L_i, ...], got one tensor of shape {tuple(tensors.shape)} "
            "(wrap it in a list to pack it as one sequence)"
        )
    if len(tensors) == 0:
        raise ValueError("pack needs at least one tensor")
    first = tensors[0]
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"tensor {i} is a {type(t).__name__}, not a torch.Tensor")
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


def static_num_tokens(real_tokens: int, max_sequences: int, cp_size: int) -> int:
    """The fewest rows that hold any batch of at most ``max_sequences`` sequences and
    ``real_tokens`` real tokens once each is padded to a multiple of ``2 * cp_size``
    (each sequence adds at most ``2 * cp_size - 1`` rows of padding)."""
    check_cp_size(cp_size)
    if real_tokens < 0 or max_sequences < 1:
        raise ValueError(f"need real_tokens >= 0 and max_sequences >= 1, got {real_tokens} and {max_sequences}")
    block = padding_multiple(cp_size)
    return -(-(real_tokens + max_sequences * (block - 1)) // block) * block


def static_seqlens(
    seqlens: Sequence[int], cp_size: int, num_tokens: int | None = None, max_sequences: int | None = None
) -> list[int]:
    """Lengths that give a batch of ``seqlens`` a static shape: zero-length sequences up to
    ``max_sequences`` sequences, then (with ``num_tokens``) one more sequence that fills the packed
    batch up to exactly ``num_tokens`` rows (a multiple of ``2 * cp_size``; the caller masks its
    labels). Every batch then packs to ``[num_tokens]`` rows and ``cu_seqlens`` of
    ``max_sequences + 2`` entries (``+ 1`` without ``num_tokens``). Raises ``ValueError`` when the
    batch has more sequences than ``max_sequences`` or needs more rows than ``num_tokens``.
    """
    check_cp_size(cp_size)
    lens = [operator.index(n) for n in seqlens]
    if max_sequences is not None:
        if len(lens) > max_sequences:
            raise ValueError(
                f"the batch has {len(lens)} sequences, more than the static maximum max_sequences = {max_sequences}"
            )
        lens += [0] * (max_sequences - len(lens))
    if num_tokens is None:
        return lens
    block = padding_multiple(cp_size)
    if num_tokens < 0 or num_tokens % block:
        raise ValueError(f"num_tokens = {num_tokens} must be a multiple of 2 * cp_size = {block}")
    rows = int(pad_cu_seqlens(lens, cp_size)[1][-1])
    if rows > num_tokens:
        raise ValueError(
            f"the batch needs {rows} rows ({sum(lens)} tokens, each sequence padded to a multiple of {block}), "
            f"more than the static num_tokens = {num_tokens}"
        )
    return lens + [num_tokens - rows]
