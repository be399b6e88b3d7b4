"""Torch reference of the tiled SwiGLU MLP op: the MLP as transformers' Qwen3-Next writes it, every
intermediate of every row alive at once (the definition the op is tested against)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def swiglu_mlp_reference(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    tile_rows: Optional[int] = None,
) -> torch.Tensor:
    """``down(silu(gate(x)) * up(x))`` with bias-free ``nn.Linear`` weights (``w_gate``, ``w_up``
    ``[I, H]``, ``w_down`` ``[H, I]``), each step rounded to x's dtype. ``tile_rows`` is not used."""
    return F.linear(F.silu(F.linear(x, w_gate)) * F.linear(x, w_up), w_down)
