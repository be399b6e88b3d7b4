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
    """:func:`custom_ops.thd_cp2hp` from a send buffer the caller has already laid out.

    send: ``[W, T/W, ..., F/W]``; block d holds rank d's slice of every section of this
    rank's local rows, what ``sections_to_rank_blocks(x_cp, sections, W)`` returns (a
    producer can write this layout itself: :class:`cp_ops.GatedDeltaNet` computes it as
    W GEMMs on row blocks of its projection weight, so no pass over the activations
    builds it). Returns ``(x_hp, overlap())`` (``None`` for no ``overlap``): ``x_hp
    [T, ..., F/W]`` in sequence order, as :func:`thd_cp2hp` returns it, with ``overlap()``
    run while the all-to-all is in flight (see :func:`thd_cp2hp_overlap`). Differentiable;
    the gradient of ``send`` comes back in the same block layout. ``group=None``: W = 1,
    ``x_hp = send[0]``. ``seq_order=False`` skips the last pass: ``x_hp`` is then in rank
    order, as received (sequence row g at row ``rank_to_seq_index(cu_seqlens_padded, W, T)[g]``
    of it), for a consumer that reads its rows through that map
    (:func:`custom_ops.causal_conv1d_gather`).
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
    """:func:`custom_ops.thd_cp2hp`, running ``overlap()`` while the all-to-all is in flight.

    Returns ``(x_hp, overlap())``. ``overlap`` is work that does not need ``x_hp``.
    The conversion runs as three graph nodes instead of one op:
    ``sections_to_rank_blocks`` (the send buffer), one all-to-all issued before
    ``overlap()`` and waited for after it, and ``thd_rank_to_seq_order``
    (:func:`thd_cp2hp_blocks`). Same values and gradients as :func:`thd_cp2hp`,
    still one all-to-all per direction. In the backward pass the gradient's
    exchange is issued where the wait was and waited for where the exchange was
    issued, so the backward of ``overlap``'s work runs during it too.

    Eager on CUDA, the overlap happens as written (NCCL runs on its own stream).
    Under ``torch.compile``, Inductor's peak-memory reordering moves the wait up to
    the exchange; compile with :data:`cp_ops.COMPILE_OPTIONS` to keep the overlap.
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
    """:func:`custom_ops.thd_hp2cp` without its last pass: the received blocks as they arrive.

    y_hp: ``[T, ..., F/W]`` in sequence order, as for :func:`custom_ops.thd_hp2cp`. Returns
    ``(blocks, overlap(own))``: ``blocks [W, T/W, ..., F/W]``, block s holding rank s's
    features (its slice of every section) of this rank's local rows, so that
    ``rank_blocks_to_sections(blocks, sections, W)`` is :func:`custom_ops.thd_hp2cp`'s result. A
    consumer that reads the blocks where they are saves that pass:
    :class:`cp_ops.GatedDeltaNet` runs its gated norm on them and writes the norm's
    output in the section layout. The exchange runs as two graph nodes with
    ``overlap(own)`` between them, as in :func:`thd_cp2hp_blocks`; ``own`` is this
    rank's block (``blocks[rank]``, the part of the result that never leaves the rank)
    taken from the send buffer, so work on it can run while the other blocks are in
    flight. Differentiable (through ``own`` too). ``group=None``: W = 1,
    ``blocks = y_hp[None]`` and ``own = y_hp``.
    """
    group_name, world = resolve_group(group)
    check_hp2cp(y_hp, cu_seqlens_padded, None, world)
    if group_name is None:
        return y_hp.unsqueeze(0), (overlap(y_hp) if overlap is not None else None)
    send = thd_seq_to_rank_order(y_hp, cu_seqlens_padded, world)  # [T, ..., F/W], rank order
    own = send.unflatten(0, (world, send.shape[0] // world))[group_rank(group)]
    recv, extra = overlapped_exchange(send, group_name, world, None if overlap is None else lambda: overlap(own))
    return recv.unflatten(0, (world, recv.shape[0] // world)), extra
