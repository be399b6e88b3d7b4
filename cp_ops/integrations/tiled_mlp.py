"""SwiGLU MLPs of a model over row tiles (:func:`custom_ops.swiglu_mlp`): for long sequences, where
an MLP's ``[N, I]`` intermediates outweigh the rest of a layer's activations.

::

    apply_tiled_mlp(model)   # in place: every SwiGLU MLP saves only its input for the backward

An MLP is a module with bias-free ``nn.Linear`` ``gate_proj``, ``up_proj`` and ``down_proj`` and an
``act_fn`` that computes SiLU: transformers' Qwen3-Next MLPs (the dense ones and the mixtures'
shared experts), Llama's and Qwen's alike. Their parameters, names and outputs stay the same.
"""

from __future__ import annotations

import types
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from custom_ops import swiglu_mlp

__all__ = ["apply_tiled_mlp"]

# where an act_fn is checked to compute SiLU
_PROBE = torch.linspace(-6.0, 6.0, 25, dtype=torch.float64)


def _is_swiglu(module: nn.Module) -> bool:
    projections = [getattr(module, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
    return all(isinstance(p, nn.Linear) for p in projections) and callable(getattr(module, "act_fn", None))


def _check(name: str, module: nn.Module) -> None:
    if any(getattr(module, p).bias is not None for p in ("gate_proj", "up_proj", "down_proj")):
        raise ValueError(f"{name}: the tiled MLP takes bias-free projections")
    with torch.no_grad():
        silu = torch.allclose(module.act_fn(_PROBE), F.silu(_PROBE))
    if not silu:
        raise ValueError(f"{name}: the tiled MLP computes SiLU, got act_fn {type(module.act_fn).__name__}")


def _tiled_forward(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return swiglu_mlp(x, module.gate_proj.weight, module.up_proj.weight, module.down_proj.weight,
                      module.cp_ops_tile_rows)  # fmt: skip


def apply_tiled_mlp(model: nn.Module, tile_rows: Optional[int] = None) -> nn.Module:
    """Run every SwiGLU MLP of ``model`` (module docstring) through :func:`custom_ops.swiglu_mlp`,
    ``tile_rows`` rows at a time (None: :func:`custom_ops.default_tile_rows`); in place, returns
    ``model``; calling it again sets another tile size. Raises ``ValueError`` for a model without
    such an MLP, or one with biases or another activation, before changing anything."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if tile_rows is not None and tile_rows < 1:
        raise ValueError(f"tile_rows must be None or at least 1, got {tile_rows}")
    mlps = [(name or "model", m) for name, m in model.named_modules() if _is_swiglu(m)]
    if not mlps:
        raise ValueError(f"model ({type(model).__name__}) has no SwiGLU MLP (gate_proj, up_proj, down_proj, act_fn)")
    for name, module in mlps:
        _check(name, module)
    for _, module in mlps:
        module.cp_ops_tile_rows = tile_rows
        module.forward = types.MethodType(_tiled_forward, module)
    return model
