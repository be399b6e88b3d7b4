"""The fused CP <-> head-parallel all-to-all, as torch.library ops (docs/design.md section 2).

``thd_cp2hp`` turns rank r's shard ``x_cp [T/W, ..., F]`` into ``x_hp [T, ..., F/W]`` (every
row of the batch in sequence order, rank r's slice of every feature section) in three passes:
the section permutation written straight into the rank-major send layout, one all-to-all of
equal splits, and the rank -> sequence reorder (docs/design.md section 4.1). ``thd_hp2cp``
runs them backwards; each is the other's gradient. No host reads of tensor values.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from custom_ops.sections.op import (
    check_sections,
    permute_sections,
    rank_blocks_to_sections,
    sections_to_rank_blocks,
    unpermute_sections,
)
from custom_ops.runtime.collectives import all_to_all_rows
from custom_ops.runtime.groups import check_group_size, resolve_group
from custom_ops.runtime.registration import NAMESPACE, kernel_op
from custom_ops.thd.checks import check_index_tensor
from custom_ops.thd.index import padding_multiple
from custom_ops.thd_reorder.op import thd_rank_to_seq_order, thd_seq_to_rank_order

__all__ = ["thd_cp2hp", "thd_hp2cp", "check_cp2hp", "check_hp2cp"]


def check_cp2hp(x_cp: torch.Tensor, cu_seqlens_padded: torch.Tensor, sections, world: int) -> None:
    """The free checks of :func:`thd_cp2hp`'s input, a local shard with its last dim in sections."""
    if not isinstance(x_cp, torch.Tensor):
        raise TypeError(f"x_cp must be a torch.Tensor, got {type(x_cp).__name__}")
    if x_cp.dim() < 2:
        raise ValueError(f"x_cp must be [T/W, ..., F] (rows, then features last), got shape {tuple(x_cp.shape)}")
    check_index_tensor("cu_seqlens_padded", cu_seqlens_padded, x_cp.device)
    if x_cp.shape[0] % 2:
        raise ValueError(
            f"x_cp has {x_cp.shape[0]} rows; a local shard has T/W rows, two chunks per sequence, "
            "so an even number"
        )
    check_sections("x_cp", x_cp.shape[-1], sections, world, world="the CP group size")


def check_hp2cp(y_hp: torch.Tensor, cu_seqlens_padded: torch.Tensor, sections, world: int) -> None:
    """The free checks of :func:`thd_hp2cp`'s input, all T rows in sequence order; ``sections``
    None checks no sections (the received blocks keep the features as they are)."""
    if not isinstance(y_hp, torch.Tensor):
        raise TypeError(f"y_hp must be a torch.Tensor, got {type(y_hp).__name__}")
    if y_hp.dim() < 2:
        raise ValueError(f"y_hp must be [T, ..., F/W] (rows, then features last), got shape {tuple(y_hp.shape)}")
    check_index_tensor("cu_seqlens_padded", cu_seqlens_padded, y_hp.device)
    if y_hp.shape[0] % padding_multiple(world):
        raise ValueError(
            f"y_hp has {y_hp.shape[0]} rows, not a multiple of 2*W = {padding_multiple(world)} for a CP group of "
            f"{world} ranks; y_hp must hold all T rows of the batch (is the group the one the layout was built for?)"
        )
    if sections is not None:
        check_sections("y_hp", y_hp.shape[-1], sections, 1)


@kernel_op(f"{NAMESPACE}::thd_cp2hp", mutates_args=())
def _thd_cp2hp(
    x_cp: torch.Tensor, cu_seqlens_padded: torch.Tensor, sections: list[int], group_name: str, cp_size: int
) -> torch.Tensor:
    world = check_group_size(group_name, cp_size)
    check_cp2hp(x_cp, cu_seqlens_padded, sections, world)
    send = sections_to_rank_blocks(x_cp, sections, world)  # [W, T/W, ..., F/W]
    recv = all_to_all_rows(send.flatten(0, 1), group_name, world)  # [T, ..., F/W], rank order
    return thd_rank_to_seq_order(recv, cu_seqlens_padded, world)


@_thd_cp2hp.register_fake
def _(x_cp, cu_seqlens_padded, sections, group_name, cp_size):
    world = check_group_size(group_name, cp_size)
    check_cp2hp(x_cp, cu_seqlens_padded, sections, world)
    return x_cp.new_empty((x_cp.shape[0] * world,) + tuple(x_cp.shape[1:-1]) + (x_cp.shape[-1] // world,))


@kernel_op(f"{NAMESPACE}::thd_hp2cp", mutates_args=())
def _thd_hp2cp(
    y_hp: torch.Tensor, cu_seqlens_padded: torch.Tensor, sections: list[int], group_name: str, cp_size: int
) -> torch.Tensor:
    world = check_group_size(group_name, cp_size)
    check_hp2cp(y_hp, cu_seqlens_padded, sections, world)
    send = thd_seq_to_rank_order(y_hp, cu_seqlens_padded, world)  # [T, ..., F/W], rank order
    recv = all_to_all_rows(send, group_name, world)  # block d: rank d's features of the local rows
    blocks = recv.unflatten(0, (world, recv.shape[0] // world))  # [W, T/W, ..., F/W]
    return rank_blocks_to_sections(blocks, [s * world for s in sections], world)


@_thd_hp2cp.register_fake
def _(y_hp, cu_seqlens_padded, sections, group_name, cp_size):
    world = check_group_size(group_name, cp_size)
    check_hp2cp(y_hp, cu_seqlens_padded, sections, world)
    return y_hp.new_empty((y_hp.shape[0] // world,) + tuple(y_hp.shape[1:-1]) + (y_hp.shape[-1] * world,))


def _setup_context(ctx, inputs, output):
    _, ctx.cu_seqlens_padded, ctx.sections, ctx.group_name, ctx.world = inputs


def _cp2hp_backward(ctx, grad):
    local = [s // ctx.world for s in ctx.sections]
    return _thd_hp2cp(grad, ctx.cu_seqlens_padded, local, ctx.group_name, ctx.world), None, None, None, None


def _hp2cp_backward(ctx, grad):
    full = [s * ctx.world for s in ctx.sections]
    return _thd_cp2hp(grad, ctx.cu_seqlens_padded, full, ctx.group_name, ctx.world), None, None, None, None


_thd_cp2hp.register_autograd(_cp2hp_backward, setup_context=_setup_context)
_thd_hp2cp.register_autograd(_hp2cp_backward, setup_context=_setup_context)


# --- Python entry points ----------------------------------------------------------------------------


def thd_cp2hp(
    x_cp: torch.Tensor, cu_seqlens_padded: torch.Tensor, sections: Sequence[int], group=None
) -> torch.Tensor:
    """Context parallel -> head parallel, with one all-to-all for all sequences and sections.

    x_cp ``[T/W, ..., F]``: this rank's THD shard (docs/design.md section 1), its last dim
    sections of widths ``sections`` (each divisible by W); cu_seqlens_padded ``[B+1]``, the
    global padded offsets (``T = cu_seqlens_padded[-1]``); group a ``ProcessGroup``, 1-D
    ``DeviceMesh`` or ``None`` (W = 1: a copy). Returns ``x_hp [T, ..., F/W]`` in sequence
    order with this rank's slice (width ``s/W``) of every section, in section order:
    ``permute_sections(x, sections, W)[..., r*F/W:(r+1)*F/W]`` of the global sequence-order
    ``x``. Differentiable; the gradient is :func:`thd_hp2cp`. Also
    ``torch.ops.cp_ops.thd_cp2hp(x_cp, cu_seqlens_padded, sections, group_name, cp_size)``.
    """
    group_name, world = resolve_group(group)
    sections = [int(s) for s in sections]
    if group_name is None:
        check_cp2hp(x_cp, cu_seqlens_padded, sections, world)
        return permute_sections(x_cp, sections, 1)
    return _thd_cp2hp(x_cp, cu_seqlens_padded, sections, group_name, world)


def thd_hp2cp(
    y_hp: torch.Tensor, cu_seqlens_padded: torch.Tensor, sections: Sequence[int], group=None
) -> torch.Tensor:
    """Head parallel -> context parallel: the inverse of :func:`thd_cp2hp`.

    y_hp: ``[T, ..., F/W]`` in sequence order, features = this rank's slice of every
    section; ``sections`` are the *local* widths (global width / W).
    Returns this rank's THD shard ``[T/W, ..., F]`` with the sections whole again.
    Differentiable; the gradient is :func:`thd_cp2hp`.
    Also ``torch.ops.cp_ops.thd_hp2cp(y_hp, cu_seqlens_padded, sections, group_name, cp_size)``.
    """
    group_name, world = resolve_group(group)
    sections = [int(s) for s in sections]
    if group_name is None:
        check_hp2cp(y_hp, cu_seqlens_padded, sections, world)
        return unpermute_sections(y_hp, sections, 1)
    return _thd_hp2cp(y_hp, cu_seqlens_padded, sections, group_name, world)
