"""Argument checks every op body and fake runs: types, shapes, dtypes and devices, free and done at
trace time under ``torch.compile``. Checks of values need a host sync and are in
:mod:`custom_ops.thd.validation`."""

from __future__ import annotations

import torch

_INDEX_DTYPES = (torch.int32, torch.int64)


def check_index_tensor(name: str, t: torch.Tensor, device: torch.device, min_numel: int = 1) -> None:
    """A 1-D int32/int64 tensor on ``device`` with at least ``min_numel`` entries."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _INDEX_DTYPES:
        raise TypeError(f"{name} must be int32 or int64, got {t.dtype}")
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    if t.numel() < min_numel:
        raise ValueError(f"{name} must have at least {min_numel} entries, got {t.numel()}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but the data is on {device}; put them on one device")


def check_cp_size(cp_size: int) -> None:
    """Raise ``TypeError`` unless ``cp_size`` is an int (a ``SymInt`` under tracing, never a
    bool) and ``ValueError`` unless it is at least 1."""
    # SymInt: dynamo turns an int that changes between calls into a symbol (automatic dynamic)
    if isinstance(cp_size, bool) or not isinstance(cp_size, (int, torch.SymInt)):
        raise TypeError(f"cp_size must be an int, got {type(cp_size).__name__}")
    if cp_size < 1:
        raise ValueError(f"cp_size must be >= 1, got {cp_size}")


def check_rows(name: str, x: torch.Tensor) -> None:
    """``x`` is a tensor with a leading token dimension."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 1:
        raise ValueError(f"{name} must have a leading token dimension, got a 0-d tensor")


def layout_index_error(error: IndexError) -> ValueError:
    """What a torch reference raises for an index out of range, ``error``: only a layout that does
    not fit its tensor makes one, and the checked mode names which argument and sequence."""
    return ValueError(
        f"the layout does not fit the tensor ({error}); with the checked mode on (CP_OPS_CHECKS=1 or "
        "custom_ops.set_checks(True)) the op names the argument and the sequence at fault"
    )
