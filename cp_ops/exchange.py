"""The CP <-> head-parallel exchange as graph nodes, for work that overlaps the all-to-all.

:func:`custom_ops.thd_cp2hp` and :func:`custom_ops.thd_hp2cp` are ops: one node each, the
all-to-all inside. The forms here run the same passes as separate nodes around one
differentiable exchange in two halves (issue, wait), with caller work between the halves, in
the forward and the backward pass (docs/design.md section 2, "CP exchanges"). Under
``torch.compile``, :data:`cp_ops.COMPILE_OPTIONS` keeps that work between them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

from custom_ops import (
    check_cp2hp,
    check_hp2cp,
    check_index_tensor,
    group_rank,
    overlapped_exchange,
    resolve_group,
    sections_to_rank_blocks,
    thd_cp2hp,
    thd_rank_to_seq_order,
    thd_seq_to_rank_order,
)

__all__ = ["thd_cp2hp_overlap", "thd_cp2hp_blocks", "thd_hp2cp_blocks"]

T = TypeVar("T")


def _check_send_blocks(send: torch.Tensor, cu_seqlens_padded: torch.Tensor, world: int) -> None:
    if not isinstance(send, torch.Tensor):
        raise TypeError(f"send must be a torch.Tensor, got {type(send).__name__}")
    if send.dim() < 3 or send.shape[0] != world:
        raise ValueError(
            f"send must be [W, T/W, ..., F/W] with W = {world} (the CP group size) blocks, got shape "
            f"{tuple(send.shape)}"
        )
    check_index_tensor("cu_seqlens_padded", cu_seqlens_padded, send.device)
    if send.shape[1] % 2:
        raise ValueError(
            f"send has {send.shape[1]} rows a block; a local shard has T/W rows, two chunks per sequence, "
            "so an even number"
        )


def thd_cp2hp_blocks(
    send: torch.Tensor,
    cu_seqlens_padded: torch.Tensor,
    group,
    overlap: Callable[[], T] | None = None,
    *,
    seq_order: bool = True,
) -> tuple[torch.Tensor, T | None]:
    """:func:`custom_ops.thd_cp2hp` from a send buffer the caller has laid out, with ``overlap()``
    run while the all-to-all is in flight (as in :func:`thd_cp2hp_overlap`).

    send ``[W, T/W, ..., F/W]``: block d holds rank d's slice of every section of this rank's
    rows (``sections_to_rank_blocks(x_cp, sections, W)``). Returns ``(x_hp [T, ..., F/W],
    overlap())`` (``None`` for no ``overlap``), x_hp in sequence order, or with
    ``seq_order=False`` in rank order as received (sequence row g at row
    ``rank_to_seq_index(cu_seqlens_padded, W, T)[g]``). Differentiable; send's gradient comes
    back in the block layout. ``group=None``: ``x_hp = send[0]``. Raises ``ValueError`` or
    ``TypeError`` for a send buffer of the wrong shape or type.
    """
    group_name, world = resolve_group(group)
    _check_send_blocks(send, cu_seqlens_padded, world)
    if group_name is None:
        return send[0], (overlap() if overlap is not None else None)
    recv, extra = overlapped_exchange(send.flatten(0, 1), group_name, world, overlap)  # rank order
    if not seq_order:
        return recv, extra
    return thd_rank_to_seq_order(recv, cu_seqlens_padded, world), extra


def thd_cp2hp_overlap(
    x_cp: torch.Tensor, cu_seqlens_padded: torch.Tensor, sections: Sequence[int], group, overlap: Callable[[], T]
) -> tuple[torch.Tensor, T]:
    """:func:`custom_ops.thd_cp2hp`, running ``overlap()`` (work that does not need x_hp) while
    the all-to-all is in flight: ``(x_hp, overlap())``.

    Same arguments, values and gradients as :func:`custom_ops.thd_cp2hp`, as three graph nodes
    (the send buffer, the exchange's two halves, the reorder) with ``overlap()`` between the
    halves; in the backward pass the backward of ``overlap``'s work runs during the gradient's
    exchange (docs/design.md section 2). Under ``torch.compile`` the overlap needs
    :data:`cp_ops.COMPILE_OPTIONS`.
    """
    group_name, world = resolve_group(group)
    sections = [int(s) for s in sections]
    if group_name is None:
        return thd_cp2hp(x_cp, cu_seqlens_padded, sections, None), overlap()
    check_cp2hp(x_cp, cu_seqlens_padded, sections, world)
    send = sections_to_rank_blocks(x_cp, sections, world)  # [W, T/W, ..., F/W]
    return thd_cp2hp_blocks(send, cu_seqlens_padded, group, overlap)


def thd_hp2cp_blocks(
    y_hp: torch.Tensor,
    cu_seqlens_padded: torch.Tensor,
    group,
    overlap: Callable[[torch.Tensor], T] | None = None,
) -> tuple[torch.Tensor, T | None]:
    """:func:`custom_ops.thd_hp2cp` without its last pass, with ``overlap(own)`` run while the
    all-to-all is in flight.

    y_hp ``[T, ..., F/W]`` in sequence order. Returns ``(blocks [W, T/W, ..., F/W],
    overlap(own))``: block s holds rank s's features of this rank's rows
    (``rank_blocks_to_sections(blocks, sections, W)`` is :func:`custom_ops.thd_hp2cp`'s
    result); ``own`` is ``blocks[rank]``, taken from the send buffer since it never leaves the
    rank. Differentiable, through ``own`` too. ``group=None``: ``blocks = y_hp[None]``,
    ``own = y_hp``.
    """
    group_name, world = resolve_group(group)
    check_hp2cp(y_hp, cu_seqlens_padded, None, world)
    if group_name is None:
        return y_hp.unsqueeze(0), (overlap(y_hp) if overlap is not None else None)
    send = thd_seq_to_rank_order(y_hp, cu_seqlens_padded, world)  # [T, ..., F/W], rank order
    own = send.unflatten(0, (world, send.shape[0] // world))[group_rank(group)]
    recv, extra = overlapped_exchange(send, group_name, world, None if overlap is None else lambda: overlap(own))
    return recv.unflatten(0, (world, recv.shape[0] // world)), extra
