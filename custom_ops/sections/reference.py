"""Torch references for the head-section permutation.

The last dim of ``x [..., F]`` is a concatenation of sections of widths
``s_0, ..., s_{n-1}`` (``sum s_b = F``, each divisible by W). Rank d's slice of
section b is its ``d``-th contiguous piece of width ``w_b = s_b / W``. The
permuted layout puts rank 0's slices of every section (in section order) first,
then rank 1's, ...: output block d (width ``F/W``) is what rank d owns after a
CP -> head-parallel all-to-all. With ``o_b = sum_{a<b} s_a`` and
``l_b = sum_{a<b} w_b``, output column ``d*F/W + l_b + t`` (``0 <= t < w_b``)
holds input column ``o_b + d*w_b + t``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from custom_ops.runtime.words import index_select_any


def section_index(sections: Sequence[int], cp_size: int, device: torch.device | str | None = None) -> torch.Tensor:
    """``idx [F]`` (int64) with ``permute_sections(x)[..., p] = x[..., idx[p]]``.

    Built from the Python section widths (no tensor values are read).
    """
    widths = torch.tensor([int(s) // cp_size for s in sections], dtype=torch.int64, device=device)
    local_width = int(sum(sections)) // cp_size
    num_cols = local_width * cp_size
    p = torch.arange(num_cols, dtype=torch.int64, device=device)
    if num_cols == 0:
        return p
    d, j = p // local_width, p % local_width  # rank block, column within it
    local_off = torch.cumsum(widths, 0) - widths  # l_b
    b = torch.searchsorted(local_off, j, right=True) - 1  # zero-width sections resolve to the next one
    return cp_size * local_off[b] + d * widths[b] + (j - local_off[b])


def permute_sections_reference(x: torch.Tensor, sections: Sequence[int], cp_size: int) -> torch.Tensor:
    """:func:`custom_ops.permute_sections` in torch ops: ``x[..., idx]`` with ``idx`` from
    :func:`section_index`.

    x: ``[..., F]`` any dtype, ``sections`` widths each divisible by ``cp_size`` and summing to
    F; returns ``[..., F]``. Differentiable through ``index_select``.
    """
    return index_select_any(x, -1, section_index(sections, cp_size, x.device))


def unpermute_sections_reference(x: torch.Tensor, sections: Sequence[int], cp_size: int) -> torch.Tensor:
    """:func:`custom_ops.unpermute_sections` in torch ops, the inverse of
    :func:`permute_sections_reference`: ``[..., F]`` -> ``[..., F]``, differentiable."""
    # the inverse permutation of a permutation index is its argsort
    return index_select_any(x, -1, torch.argsort(section_index(sections, cp_size, x.device)))


def permute_sections_loop(x: torch.Tensor, sections: Sequence[int], cp_size: int) -> torch.Tensor:
    """The definition spelled out as slices (an independent oracle for tests)."""
    offsets = [sum(sections[:b]) for b in range(len(sections))]
    parts = [
        x[..., o + d * (s // cp_size) : o + (d + 1) * (s // cp_size)]
        for d in range(cp_size)
        for o, s in zip(offsets, sections)
    ]
    return torch.cat(parts, dim=-1) if parts else x.clone()
