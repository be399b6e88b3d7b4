"""The SwiGLU MLP over row tiles, saving only its input: ``down(silu(gate(x)) * up(x))``, Qwen3-Next's
MLP, with at most one tile's ``[rows, I]`` intermediates alive at a time, forward and backward
(docs/design.md section 2, "Tiled MLP").

``torch.ops.cp_ops.swiglu_mlp_forward`` is an opaque custom op that computes each tile's output and
keeps nothing of it; autograd saves x and the weights. Its backward, ``swiglu_mlp_backward``,
recomputes each tile's gate and up projections and returns the gradients of x and of the three
weights, the weights' accumulated over the tiles in float32 (float64 for float64). So a long
sequence holds ``[N, H]`` for the MLP, not four ``[N, I]`` tensors: at Qwen3-Next's widths (H 2048,
I 5632) 4 KB a token in bf16 against 49. The price is the gate and up GEMMs once more in the
backward. The public ``swiglu_mlp`` is a composite over the forward op (any leading dims).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from custom_ops.runtime.dtypes import accumulation_dtype
from custom_ops.runtime.registration import NAMESPACE, composite_op, opaque_op
from custom_ops.runtime.tiles import rows_within

__all__ = ["swiglu_mlp", "default_tile_rows"]

# intermediate entries per tile by default: a bf16 [rows, I] tensor of 64 MiB
TILE_ELEMENTS = 2**25


def default_tile_rows(intermediate_size: int) -> int:
    """Rows per tile when none are given: ``TILE_ELEMENTS / intermediate_size``, a multiple of 64
    where that is at least 64 (:func:`~custom_ops.runtime.tiles.rows_within`)."""
    return rows_within(TILE_ELEMENTS, intermediate_size)


def _check(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, tile_rows,
           rows: bool = True) -> None:  # fmt: skip
    """The ops' argument checks; ``rows``: x is ``[N, H]`` (the forward and backward ops), else ``[..., H]``."""
    for name, t in (("x", x), ("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if x.dim() < 1 or (rows and x.dim() != 2):
        raise ValueError(f"x must be {'[N, H]' if rows else '[..., H]'}, got shape {tuple(x.shape)}")
    hidden, inter = x.shape[-1], w_gate.shape[0] if w_gate.dim() else 0
    shapes = [tuple(t.shape) for t in (w_gate, w_up, w_down)]
    if shapes != [(inter, hidden), (inter, hidden), (hidden, inter)]:
        raise ValueError(f"w_gate and w_up must be [I, H] and w_down [H, I] with H = {hidden} (x's last dim), got "
                         f"{shapes}")  # fmt: skip
    if not x.dtype.is_floating_point or any(t.dtype != x.dtype for t in (w_gate, w_up, w_down)):
        raise TypeError(f"x and the weights must share one floating dtype, got {x.dtype}, {w_gate.dtype}, "
                        f"{w_up.dtype}, {w_down.dtype}")  # fmt: skip
    if any(t.device != x.device for t in (w_gate, w_up, w_down)):
        raise ValueError("x and the weights must be on one device")
    if tile_rows is not None and tile_rows < 1:
        raise ValueError(f"tile_rows must be at least 1, got {tile_rows}")


@opaque_op(f"{NAMESPACE}::swiglu_mlp_forward", mutates_args=())
def swiglu_mlp_forward(
    x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, tile_rows: int
) -> torch.Tensor:
    """``down(silu(gate(x)) * up(x))`` of ``x [N, H]`` (``[N, H]``, x's dtype), ``tile_rows`` rows
    at a time; nothing of a tile is kept."""
    _check(x, w_gate, w_up, w_down, tile_rows)
    out = x.new_empty(x.shape[0], w_down.shape[0])
    for start in range(0, x.shape[0], tile_rows):
        rows = x[start : start + tile_rows]
        torch.mm(F.silu(rows @ w_gate.T) * (rows @ w_up.T), w_down.T, out=out[start : start + tile_rows])
    return out


@swiglu_mlp_forward.register_fake
def _(x, w_gate, w_up, w_down, tile_rows):
    _check(x, w_gate, w_up, w_down, tile_rows)
    return x.new_empty(x.shape[0], w_down.shape[0])


@opaque_op(f"{NAMESPACE}::swiglu_mlp_backward", mutates_args=())
def swiglu_mlp_backward(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    tile_rows: int,
    grad_x: bool,
    grad_weights: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(d x, d w_gate, d w_up, d w_down)`` of :func:`swiglu_mlp_forward` for ``grad_out [N, H]``,
    each tile's projections recomputed; the weights' summed over the tiles in float32 (float64 for
    float64) and returned in their dtype. An unrequested gradient is an empty tensor."""
    _check(x, w_gate, w_up, w_down, tile_rows)
    acc = accumulation_dtype(x.dtype)
    d_x = torch.empty_like(x) if grad_x else x.new_empty(0)
    d_w = [torch.zeros(w.shape, dtype=acc, device=w.device) for w in (w_gate, w_up, w_down)] if grad_weights else []
    for start in range(0, x.shape[0], tile_rows):
        rows, d_out = x[start : start + tile_rows], grad_out[start : start + tile_rows]
        gate, up = rows @ w_gate.T, rows @ w_up.T
        act = F.silu(gate)
        d_hidden = d_out @ w_down  # [rows, I]
        # silu'(g) = s (1 + g (1 - s)), s = sigmoid(g): in the accumulation dtype, then x's
        gate_acc = gate.to(acc)
        sig = torch.sigmoid(gate_acc)
        d_gate = (d_hidden.to(acc) * up.to(acc) * sig * (1 + gate_acc * (1 - sig))).to(x.dtype)
        d_up = d_hidden * act
        if grad_x:
            torch.mm(d_gate, w_gate, out=d_x[start : start + tile_rows]).addmm_(d_up, w_up)
        if grad_weights:
            for d, a, b in zip(d_w, (d_gate, d_up, d_out), (rows, rows, act * up)):
                d.add_((a.T @ b).to(acc))
    if not grad_weights:
        return d_x, x.new_empty(0), x.new_empty(0), x.new_empty(0)
    return (d_x, *(d.to(x.dtype) for d in d_w))


@swiglu_mlp_backward.register_fake
def _(grad_out, x, w_gate, w_up, w_down, tile_rows, grad_x, grad_weights):
    _check(x, w_gate, w_up, w_down, tile_rows)
    d_x = x.new_empty(x.shape) if grad_x else x.new_empty(0)
    if not grad_weights:
        return d_x, x.new_empty(0), x.new_empty(0), x.new_empty(0)
    return d_x, w_gate.new_empty(w_gate.shape), w_up.new_empty(w_up.shape), w_down.new_empty(w_down.shape)


def _setup_context(ctx, inputs, output):
    x, w_gate, w_up, w_down, tile_rows = inputs
    ctx.save_for_backward(x, w_gate, w_up, w_down)
    ctx.tile_rows = tile_rows


def _backward(ctx, grad_out):
    x, w_gate, w_up, w_down = ctx.saved_tensors
    grad_x, grad_weights = ctx.needs_input_grad[0], any(ctx.needs_input_grad[1:4])
    d_x, *d_w = torch.ops.cp_ops.swiglu_mlp_backward(
        grad_out.contiguous(), x, w_gate, w_up, w_down, ctx.tile_rows, grad_x, grad_weights
    )
    d_w = d_w if grad_weights else [None] * 3
    return d_x if grad_x else None, *d_w, None


swiglu_mlp_forward.register_autograd(_backward, setup_context=_setup_context)


# The public op, a composite: autograd and tracing see swiglu_mlp_forward (its fake and backward).
@composite_op(
    f"{NAMESPACE}::swiglu_mlp",
    "(Tensor x, Tensor w_gate, Tensor w_up, Tensor w_down, int? tile_rows=None) -> Tensor",
)
def _swiglu_mlp_composite(x, w_gate, w_up, w_down, tile_rows=None):
    device = x.device.type if isinstance(x, torch.Tensor) else "cpu"
    if torch.is_autocast_enabled(device):  # as nn.Linear under autocast: the GEMMs in its dtype
        dtype = torch.get_autocast_dtype(device)
        x, w_gate, w_up, w_down = (t.to(dtype) if isinstance(t, torch.Tensor) else t for t in (x, w_gate, w_up, w_down))
    _check(x, w_gate, w_up, w_down, tile_rows, rows=False)
    rows = x.reshape(-1, x.shape[-1])
    out = torch.ops.cp_ops.swiglu_mlp_forward(rows, w_gate, w_up, w_down, tile_rows or default_tile_rows(w_gate.shape[0]))
    return out.reshape(*x.shape[:-1], w_down.shape[0])


def swiglu_mlp(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    tile_rows: Optional[int] = None,
) -> torch.Tensor:
    """``down(silu(gate(x)) * up(x))`` of ``x [..., H]`` with bias-free ``nn.Linear`` weights
    (``w_gate``, ``w_up`` ``[I, H]``, ``w_down`` ``[H, I]``), ``tile_rows`` rows at a time (default
    :func:`default_tile_rows`), saving only x for the backward: the MLP of transformers'
    ``Qwen3NextMLP`` (``hidden_act`` silu) at a long sequence's memory; under autocast in its dtype.
    Differentiable in x and the weights. Raises ``TypeError`` / ``ValueError`` on mismatched shapes,
    dtypes or devices."""
    return torch.ops.cp_ops.swiglu_mlp(x, w_gate, w_up, w_down, tile_rows)
