"""The per-token pieces both layers build on: their normalisations and the rotary embedding.

:func:`l2norm` and :class:`GatedRMSNorm` are the GDN layer's (its q/k normalisation and its
gated output norm), :class:`RMSNorm` and :func:`apply_rotary` the attention layer's (its q/k
norm and positions). Each computes in at least float32 and returns its input's dtype, as
Qwen3-Next's modules do.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from custom_ops import L2NORM_EPS

__all__ = ["GatedRMSNorm", "RMSNorm", "apply_rotary", "l2norm"]


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim, computed in at least float32."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    return (xf * torch.rsqrt(xf.square().sum(-1, keepdim=True) + eps)).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """``rmsnorm(o) * weight * silu(z)`` over the last dim (size ``dim``), as Qwen3-Next's gated norm.

    The normalisation runs in at least float32, is cast back before the weight,
    and the gate multiplies in float32 again; the result has o's dtype.
    """

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        wide = torch.promote_types(o.dtype, torch.float32)
        of = o.to(wide)
        normed = (of * torch.rsqrt(of.square().mean(-1, keepdim=True) + self.eps)).to(o.dtype)
        return ((self.weight * normed).to(wide) * F.silu(z.to(wide))).to(o.dtype)


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm over the last dim: ``x / sqrt(mean(x^2) + eps) * (1 + weight)``.

    Qwen3-Next's form (weight initialised to zeros, so the initial scale is 1);
    computed in at least float32 and cast back to x's dtype.
    """

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = torch.promote_types(x.dtype, torch.float32)
        xf = x.to(wide)
        normed = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.to(wide))).to(x.dtype)


def apply_rotary(
    x: torch.Tensor, positions: torch.Tensor, theta: float, rotary_dim: int | None = None
) -> torch.Tensor:
    """Rotary position embedding, rotate-half convention, on the first ``rotary_dim`` features.

    x ``[T, H, D]``, positions ``[T]`` (integer), ``rotary_dim`` R (even, ``0 < R <= D``;
    None: all D). With ``f_m = theta ** (-2m / R)`` for ``m < R/2`` and the first R
    features of x split in halves ``[x1, x2]``::

        out = [x1 cos - x2 sin, x2 cos + x1 sin, x[..., R:]],   angle = position * f_m

    the last ``D - R`` features passed through (transformers' partial rotary embedding,
    ``R = int(head_dim * partial_rotary_factor)``). Angles and products in at least
    float32; the result has x's dtype.
    """
    d = x.shape[-1]
    rd = d if rotary_dim is None else rotary_dim
    if rd % 2 or not 0 < rd <= d:
        raise ValueError(f"rotary_dim must be even and in (0, {d}] for x of shape {tuple(x.shape)}, got {rd}")
    wide = torch.promote_types(x.dtype, torch.float32)
    inv_freq = theta ** (-torch.arange(0, rd, 2, device=x.device, dtype=wide) / rd)
    angle = positions.to(wide)[:, None] * inv_freq[None, :]  # [T, R/2]
    cos, sin = angle.cos()[:, None, :], angle.sin()[:, None, :]
    x1, x2 = x[..., :rd].to(wide).chunk(2, dim=-1)
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
    return rotated if rd == d else torch.cat([rotated, x[..., rd:]], dim=-1)
