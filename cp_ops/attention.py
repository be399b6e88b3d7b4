"""The gated attention layer over packed THD shards, with all-gather context parallelism.

Its attention is :func:`custom_ops.ag_thd_attention` (docs/design.md section 4.2): each rank
gathers the K and V of the whole batch and attends with its own query rows.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from cp_ops.inputs import check_hidden_states, check_layout_tensors
from cp_ops.modules import RMSNorm, apply_rotary
from custom_ops import ag_thd_attention, checked, group_rank, local_positions, resolve_group

__all__ = ["Attention"]


# --- the layer ------------------------------------------------------------------------------------


class Attention(nn.Module):
    """Gated softmax attention (Qwen3-Next's attention block) over packed THD sequences, with
    all-gather CP (docs/design.md section 4.2). ``Hq = num_heads``, ``Hkv = num_kv_heads``,
    ``D = head_dim``; per token::

        q, gate = q_proj(x);  k, v = k_proj(x), v_proj(x)     q_proj rows per head: D query, D gate
        q, k = rope(q_norm(q)), rope(k_norm(k))                rotary on int(D * partial_rotary_factor)
        out = o_proj(ag_thd_attention(q, k, v) * sigmoid(gate))   the gate only if gated

    Qwen3-Next's attention: ``partial_rotary_factor=0.25`` and the checkpoint's ``rope_theta``.
    ``head_groups``: the K/V exchange in that many pipelined pieces (a divisor of Hkv).
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        gated: bool = True,
        rope_theta: float = 10000.0,
        partial_rotary_factor: float = 1.0,
        qk_norm: bool = True,
        norm_eps: float = 1e-6,
        causal: bool = True,
        window: tuple[int, int] = (-1, -1),
        head_groups: int = 1,
    ):
        """A layer of ``hidden_size`` features: ``num_heads`` query heads and ``num_kv_heads``
        key/value heads (a divisor of ``num_heads``) of ``head_dim``. ``gated``: the output gate;
        ``rope_theta`` and ``partial_rotary_factor``: the rotary embedding; ``qk_norm``: RMS norms
        (``norm_eps``) on q and k; ``causal`` and ``window = (left, right)`` (-1: unbounded): the
        keys a query sees; ``head_groups``: the pieces of the K/V exchange. Raises ``ValueError``
        for heads that do not fit."""
        super().__init__()
        if head_groups < 1 or num_kv_heads % head_groups:
            raise ValueError(f"head_groups must be a positive divisor of num_kv_heads = {num_kv_heads}, "
                             f"got {head_groups}")  # fmt: skip
        self.head_groups = head_groups
        if num_kv_heads < 1 or num_heads % num_kv_heads:
            raise ValueError(f"num_heads = {num_heads} must be a multiple of num_kv_heads = {num_kv_heads}")
        rotary_dim = int(head_dim * partial_rotary_factor)
        if not 0 < partial_rotary_factor <= 1 or rotary_dim < 2 or rotary_dim % 2:
            raise ValueError(
                f"partial_rotary_factor = {partial_rotary_factor} with head_dim = {head_dim} rotates "
                f"int(head_dim * partial_rotary_factor) = {rotary_dim} features; the factor must be in (0, 1] "
                "and the rotated width even and at least 2"
            )
        self.hidden_size = hidden_size
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.gated, self.rope_theta, self.causal = gated, rope_theta, causal
        self.partial_rotary_factor, self.rotary_dim = partial_rotary_factor, rotary_dim
        self.window = (int(window[0]), int(window[1]))
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim * (2 if gated else 1), bias=False)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)
        self.q_norm = RMSNorm(head_dim, norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, norm_eps) if qk_norm else None

    def forward(
        self, x: torch.Tensor, cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor, group=None
    ) -> torch.Tensor:
        """x ``[T/W, hidden]``, this rank's THD shard (the whole batch when ``group`` is None),
        -> ``[T/W, hidden]``, padding rows zero; ``cu_seqlens`` and ``cu_seqlens_padded [B+1]`` are
        the global layout. Any W works. Differentiable in x and the parameters; parameter
        gradients are this rank's share (sum them over the group). Raises ``ValueError`` or
        ``TypeError`` when x or the layout tensors do not fit the layer.
        """
        _, world = resolve_group(group)
        check_hidden_states(self, x, self.hidden_size)
        check_layout_tensors(x, cu_seqlens, cu_seqlens_padded)
        rank = group_rank(group)
        rows = x.shape[0]
        cu_seqlens = checked("thd_shard", cu_seqlens, (cu_seqlens_padded,), world, rows, entry=True)
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        q = self.q_proj(x).view(rows, hq, 2 * d if self.gated else d)  # sizes given, not -1: rows may be 0
        gate = None
        if self.gated:
            q, gate = q[..., :d], q[..., d:]
        k = self.k_proj(x).view(rows, hkv, d)
        v = self.v_proj(x).view(rows, hkv, d)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        positions = local_positions(cu_seqlens_padded, world, rank, rows)
        q = apply_rotary(q, positions, self.rope_theta, self.rotary_dim)
        k = apply_rotary(k, positions, self.rope_theta, self.rotary_dim)
        o = ag_thd_attention(
            q, k, v, cu_seqlens, cu_seqlens_padded, causal=self.causal, window=self.window, group=group,
            head_groups=self.head_groups,
        )
        if gate is not None:
            o = o * torch.sigmoid(gate)
        return self.o_proj(o.reshape(rows, hq * d))
