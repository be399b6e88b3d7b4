"""The demo's model: a Qwen3-Next-style hybrid stack built from the CP layers of :mod:`cp_ops`.

An embedding, ``cfg.blocks`` blocks of::

    x = x + GatedDeltaNet(RMSNorm(x))      cp_ops.GatedDeltaNet (all-to-all CP)
    x = x + MLP(RMSNorm(x))                SwiGLU
    x = x + Attention(RMSNorm(x))          cp_ops.Attention, gated (all-gather CP)
    x = x + MLP(RMSNorm(x))

then a final RMSNorm and an LM head over a small vocabulary; ``forward`` returns the
summed next-token cross-entropy of this rank's targets, without the whole logits.

The GatedDeltaNet layers start from FLA's decay init (``dt_bias`` the inverse softplus
of dt log-uniform in [1e-3, 0.1]) instead of Qwen3-Next's ``dt_bias = 1``: with ``A``
up to 16 the latter decays the state to almost nothing at every token, so each head's
delta-rule output is a multiple of its own token's value, the gated RMSNorm divides that
multiple out, and the gradients of q, k and beta are zero in exact arithmetic; computed,
they are rounding noise, and no two runs' step-1 gradients agree (docs/benchmarks.md's history,
section "Why the check compares with the same mode, and the decay init").
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

import cp_ops
from cp_ops.modules import RMSNorm
from custom_ops import linear_cross_entropy

__all__ = ["IGNORE_INDEX", "MLP", "HybridBlock", "HybridLM", "fla_dt_bias_"]

# the label of rows without a target: padding, and the last token of each sequence
IGNORE_INDEX = -100


def fla_dt_bias_(dt_bias: torch.Tensor, dt_min: float = 1e-3, dt_max: float = 0.1) -> torch.Tensor:
    """FLA's (and Mamba2's) decay init, in place: ``softplus(dt_bias) = dt``, dt log-uniform in
    ``[dt_min, dt_max]`` (floored at 1e-4). Uses the global RNG."""
    with torch.no_grad():
        u = torch.rand(dt_bias.shape, dtype=torch.float64)
        dt = torch.exp(u * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)).clamp(min=1e-4)
        dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
    return dt_bias


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))`` (gate and up as one Linear), no biases."""

    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.gate_up = nn.Linear(hidden, 2 * inner, bias=False)
        self.down = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class HybridBlock(nn.Module):
    """GDN -> MLP -> gated attention -> MLP, each pre-normed (RMSNorm) with a residual."""

    def __init__(self, cfg: argparse.Namespace):
        super().__init__()
        h = cfg.hidden
        self.gdn_norm, self.mlp1_norm, self.attn_norm, self.mlp2_norm = (RMSNorm(h) for _ in range(4))
        self.gdn = cp_ops.GatedDeltaNet(
            h, cfg.gdn_k_heads, cfg.gdn_v_heads, cfg.gdn_head_dim, cfg.gdn_head_dim
        )
        fla_dt_bias_(self.gdn.dt_bias)  # see the module docstring
        self.mlp1 = MLP(h, cfg.mlp)
        self.attn = cp_ops.Attention(h, cfg.attn_heads, cfg.attn_kv_heads, cfg.attn_head_dim, gated=True)
        self.mlp2 = MLP(h, cfg.mlp)

    def forward(self, x, cu_seqlens, cu_seqlens_padded, group=None):
        x = x + self.gdn(self.gdn_norm(x), cu_seqlens_padded, group=group)
        x = x + self.mlp1(self.mlp1_norm(x))
        x = x + self.attn(self.attn_norm(x), cu_seqlens, cu_seqlens_padded, group=group)
        return x + self.mlp2(self.mlp2_norm(x))


class HybridLM(nn.Module):
    """Embedding -> HybridBlocks -> RMSNorm -> LM head; ``forward`` returns the summed token loss.

    ``cfg`` carries the sizes (``vocab``, ``hidden``, ``blocks``, ``mlp``, ``gdn_k_heads``,
    ``gdn_v_heads``, ``gdn_head_dim``, ``attn_heads``, ``attn_kv_heads``, ``attn_head_dim``),
    as :func:`cp_ops.demo.cli.parse_args` returns them.

    ``forward(tokens, labels, cu_seqlens, cu_seqlens_padded, group=None)``: tokens and
    labels ``[T/W]`` (this rank's shard; the whole batch when group is None), labels
    ``IGNORE_INDEX`` where there is no target (padding, the last token of a sequence).
    Returns the float32 sum of the cross-entropy over the local targets (0-d).
    """

    def __init__(self, cfg: argparse.Namespace):
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        nn.init.normal_(self.embed.weight, std=0.02)
        self.blocks = nn.ModuleList(HybridBlock(cfg) for _ in range(cfg.blocks))
        self.norm = RMSNorm(cfg.hidden)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)

    def forward(self, tokens, labels, cu_seqlens, cu_seqlens_padded, group=None):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, cu_seqlens, cu_seqlens_padded, group=group)
        return self.loss(x, labels)

    def loss(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The float32 sum of the cross-entropy of the LM head's logits over the targets, computed
        in row chunks without the whole logits (``custom_ops.linear_cross_entropy``)."""
        return linear_cross_entropy(self.norm(x), self.lm_head.weight, labels, IGNORE_INDEX, "sum")
