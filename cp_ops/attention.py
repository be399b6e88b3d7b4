"""The gated attention layer over packed THD shards, with all-gather context parallelism.

Its attention is :func:`custom_ops.ag_thd_attention` (docs/design.md section 4.2): each rank
gathers the K and V of the whole batch and attends with its own query rows.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from cp_ops.inputs import check_hidden_states, check_layout_tensors
from cp_ops.modules import RMSNorm, apply_rotary
from custom_ops import ag_thd_attention, group_rank, resolve_group
from custom_ops.thd_index import local_positions
from custom_ops.validation import checked

__all__ = [
    "Attention",
    "RMSNorm",
    "apply_rotary",
]


# --- the layer ------------------------------------------------------------------------------------


class Attention(nn.Module):
    """Gated softmax attention (Qwen3-Next's attention block) over packed THD sequences, with CP.

    Per token ``x [hidden]``, ``Hq = num_heads``, ``Hkv = num_kv_heads``, ``D = head_dim``::

        q, gate = q_proj(x)              gated: per head, D query features then D gate features
        k, v = k_proj(x), v_proj(x)      [Hkv, D] each
        q, k = q_norm(q), k_norm(k)      qk_norm: per-head zero-centred RMSNorm (cp_ops.modules)
        q, k = rope(q), rope(k)          rotate-half on the first R = int(D * partial_rotary_factor)
                                         features (frequencies over R), at each token's sequence
                                         position; the other D - R features passed through
        o = ag_thd_attention(q, k, v)    causal / window as configured, scale D ** -0.5
        out = o_proj(o * sigmoid(gate))  gated; o_proj(o) otherwise

    Parameters (no biases): ``q_proj.weight [Hq*D*(2 if gated else 1), hidden]``
    (rows grouped per head: head h's D query rows, then its D gate rows, as
    Qwen3-Next lays them out), ``k_proj.weight``, ``v_proj.weight [Hkv*D, hidden]``,
    ``o_proj.weight [hidden, Hq*D]``, and with qk_norm ``q_norm.weight``,
    ``k_norm.weight [D]`` (zeros at init: the scale is ``1 + weight``).

    Qwen3-Next's attention is this layer with ``partial_rotary_factor=0.25`` (64 of
    its 256 features rotated, inverse frequencies ``rope_theta ** (-2m / 64)``) and
    ``rope_theta`` from the checkpoint's config (``config.rope_parameters["rope_theta"]``):
    the rotary embedding of transformers' ``Qwen3NextRotaryEmbedding`` and
    ``apply_rotary_pos_emb`` (see :func:`apply_rotary`).

    ``forward(x, cu_seqlens, cu_seqlens_padded, group=None)``: x ``[T/W, hidden]``,
    this rank's THD shard (the whole batch when group is None), with the *global*
    layout. Positions come from ``local_positions(cu_seqlens_padded, W, rank, T/W)``
    on the device. Returns ``[T/W, hidden]``; padding rows are zero. Attention is
    sequence-parallel, so any W works (no head divisibility). Parameter gradients
    are this rank's contribution: sum them over the CP group to get the
    single-device gradients. ``head_groups``: passed to :func:`ag_thd_attention`
    (the K/V exchange in that many pipelined pieces; a divisor of Hkv).
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
        _, world = resolve_group(group)
        check_hidden_states(self, x, self.hidden_size)
        check_layout_tensors(x, cu_seqlens, cu_seqlens_padded)
        rank = group_rank(group)
        rows = x.shape[0]
        cu_seqlens = checked("thd", cu_seqlens, (cu_seqlens_padded,), world, rows * world)
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
