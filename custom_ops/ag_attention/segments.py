"""The segment tables of all-gather CP attention: a rank's local chunks as ``varlen_attention``
segments over the gathered, sequence-order keys (docs/design.md section 4)."""

from __future__ import annotations

import torch

from custom_ops.thd.index import chunk_rows, local_chunks, local_offsets, valid_rows


def _chunk_segments(cu_seqlens, cu_seqlens_padded, cp_size: int, chunk, second: bool, causal: bool, right):
    """The five ``[B]`` segment columns of chunk ``chunk`` (an int or a 0-d tensor), the first
    or second local chunk."""
    cu = cu_seqlens.to(torch.int64)
    cup = cu_seqlens_padded.to(torch.int64)
    lens = cu[1:] - cu[:-1]
    start = cup[:-1]
    c = chunk_rows(cup, cp_size)
    first_row = local_offsets(start, cp_size)
    q_start = first_row + c if second else first_row
    q_len = valid_rows(lens, c, chunk)
    q_pos = chunk * c
    if causal:
        # a query in chunk j sits at a position < (j+1)*c, so later keys are masked by causality
        # (and right is irrelevant under causality, kept to follow the formula in docs/design.md section 4)
        k_len = torch.minimum(lens, (chunk + 1) * c + max(right, 0))
    else:
        k_len = lens
    return q_start, q_len, q_pos, start, k_len


def ag_thd_segments(
    cu_seqlens: torch.Tensor,
    cu_seqlens_padded: torch.Tensor,
    cp_size: int,
    rank: int | torch.Tensor,
    causal: bool = True,
    window_right: int = -1,
    chunks: tuple[int, ...] = (0, 1),
) -> tuple[torch.Tensor, ...]:
    """``(q_start, q_len, q_pos, k_start, k_len)`` (int32) of rank ``rank``'s local chunks.

    Query rows index the local shard ``[T/W, ...]``; key rows the gathered, sequence-order
    ``[T, ...]``. ``chunks=(0, 1)`` gives both local chunks of every sequence (``[2B]`` each,
    interleaved: sequence 0 chunk r, sequence 0 chunk 2W-1-r, sequence 1 ...); ``(0,)`` or
    ``(1,)`` only the first or second (``[B]``). Chunk j of sequence i (``L_i`` real tokens,
    ``c_i`` rows a chunk) has ``q_pos = j*c_i``, ``k_start = cup[i]``, ``k_len = L_i`` (causal:
    at most ``(j+1)*c_i + max(right, 0)``), its real rows as queries (the formulas:
    docs/design.md section 4). Built on the device, no host sync; ``rank`` an int or a 0-d
    integer tensor on the device.
    """
    ids = local_chunks(rank, cp_size)
    cols = [
        _chunk_segments(cu_seqlens, cu_seqlens_padded, cp_size, ids[h], h == 1, causal, window_right) for h in chunks
    ]
    return tuple(torch.stack(parts, dim=1).flatten().to(torch.int32) for parts in zip(*cols))
