"""Single-process references (test oracles) of the CP <-> head-parallel all-to-all ops."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from custom_ops.sections.reference import permute_sections_reference, unpermute_sections_reference
from custom_ops.thd.index import shard_rows


def thd_cp2hp_reference(x: torch.Tensor, sections: Sequence[int], cp_size: int, rank: int) -> torch.Tensor:
    """What :func:`custom_ops.thd_cp2hp` returns on ``rank``, from the global sequence-order
    ``x [T, ..., F]``."""
    local = x.shape[-1] // cp_size
    return permute_sections_reference(x, list(sections), cp_size)[..., rank * local : (rank + 1) * local]


def thd_hp2cp_reference(
    y_hp_all: Sequence[torch.Tensor], cu_seqlens_padded: torch.Tensor, sections: Sequence[int], cp_size: int, rank: int
) -> torch.Tensor:
    """What :func:`custom_ops.thd_hp2cp` returns on ``rank``, from every rank's ``y_hp [T, ..., F/W]``
    (rank 0 first; ``sections`` are the local widths)."""
    full = unpermute_sections_reference(torch.cat(list(y_hp_all), dim=-1), [s * cp_size for s in sections], cp_size)
    return full.index_select(0, shard_rows(cu_seqlens_padded, cp_size, rank, full.shape[0] // cp_size))
