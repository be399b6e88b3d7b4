"""Checks of what a user passes to the layers, with errors in the user's terms.

Shapes, dtypes and devices are checked on every call (free, and done while tracing under
``torch.compile``); layout values only in the checked mode (:mod:`custom_ops.thd.validation`).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from custom_ops import check_index_tensor


def check_hidden_states(layer: nn.Module, x: torch.Tensor, hidden_size: int) -> None:
    """``x`` is this rank's packed shard ``[T/W, hidden_size]`` of the layer's dtype and device."""
    name = type(layer).__name__
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        hint = (
            f"; packed batches have no batch dimension: pass x.view(-1, {hidden_size}) with the batch's "
            "cumulative lengths"
            if x.dim() == 3
            else ""
        )
        raise ValueError(f"{name}: x must be [T/W, hidden] = [T/W, {hidden_size}], got shape {tuple(x.shape)}{hint}")
    if x.shape[1] != hidden_size:
        raise ValueError(f"{name}: x must be [T/W, {hidden_size}] (hidden_size), got shape {tuple(x.shape)}")
    weight = next(layer.parameters(), None)
    if weight is not None and (x.dtype != weight.dtype or x.device != weight.device):
        raise TypeError(
            f"{name}: x is {x.dtype} on {x.device} but the layer's parameters are {weight.dtype} on "
            f"{weight.device}; convert one of them"
        )


def check_layout_tensors(x: torch.Tensor, cu_seqlens: torch.Tensor | None, cu_seqlens_padded: torch.Tensor) -> None:
    """The cumulative lengths are 1-D int32/int64 tensors on x's device, of one length."""
    check_index_tensor("cu_seqlens_padded", cu_seqlens_padded, x.device)
    if cu_seqlens is None:
        return
    check_index_tensor("cu_seqlens", cu_seqlens, x.device)
    if cu_seqlens.shape != cu_seqlens_padded.shape:
        raise ValueError(
            f"cu_seqlens has {cu_seqlens.shape[0]} entries and cu_seqlens_padded {cu_seqlens_padded.shape[0]}; "
            "both are [B+1] over the same sequences"
        )
