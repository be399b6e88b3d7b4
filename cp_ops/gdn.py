"""Gated DeltaNet layer (Qwen3-Next's linear-attention block) on packed THD sequences; the
strategies that run it over a CP group are :mod:`cp_ops.gdn_strategies` (docs/design.md section 4)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from cp_ops.gdn_strategies import GDNContextParallel, default_context_parallel
from cp_ops.inputs import check_hidden_states, check_layout_tensors
from cp_ops.modules import GatedRMSNorm
from custom_ops import causal_conv1d_gather, checked, chunk_gated_delta_rule, resolve_group

__all__ = ["GatedDeltaNet", "from_qwen3_next_state_dict"]


class GatedDeltaNet(nn.Module):
    """Qwen3-Next's Gated DeltaNet over packed sequences ``[T, hidden]`` (THD, padding at each
    sequence's tail), with ``G = Hv / Hk`` value heads per key head::

        q, k, v, z, b, a = in_proj(x)                   widths Hk*dk, Hk*dk, Hv*dv, Hv*dv, Hv, Hv
        q, k, v = silu(causal_conv1d([q k v]));  q, k = l2norm(q), l2norm(k)
        g = -exp(A_log) * softplus(a + dt_bias);  beta = sigmoid(b)          fp32
        o = chunk_gated_delta_rule(q, k, v, g, beta)      value head h reads key head h // G
        out = out_proj(rmsnorm(o) * norm.weight * silu(z))

    Parameter names and init as ``Qwen3NextGatedDeltaNet`` (:func:`from_qwen3_next_state_dict`
    converts its checkpoints). ``context_parallel``: how the layer runs over a CP group
    (:class:`GDNContextParallel`); None: :func:`default_context_parallel`.
    """

    #: How the layer runs over a CP group; None: :func:`default_context_parallel`.
    context_parallel: GDNContextParallel | None = None

    def __init__(
        self,
        hidden_size: int,
        num_k_heads: int,
        num_v_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        conv_kernel_size: int = 4,
        norm_eps: float = 1e-6,
        context_parallel: GDNContextParallel | None = None,
    ):
        """A layer of ``hidden_size`` features: ``num_k_heads`` key heads of ``head_k_dim`` and
        ``num_v_heads`` value heads (a multiple of ``num_k_heads``) of ``head_v_dim``, a causal conv
        of ``conv_kernel_size`` taps, the gated RMS norm's ``norm_eps``, and ``context_parallel``
        (how it runs over a CP group; None: the default for the group's size). Raises
        ``ValueError`` for heads that do not fit."""
        super().__init__()
        if num_v_heads % num_k_heads != 0:
            raise ValueError(f"num_v_heads = {num_v_heads} must be a multiple of num_k_heads = {num_k_heads}")
        self.hidden_size = hidden_size
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.conv_kernel_size = conv_kernel_size
        self.key_dim, self.value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.context_parallel = context_parallel
        self.in_proj = nn.Linear(hidden_size, sum(self._sections()), bias=False)
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, conv_kernel_size, groups=self.conv_dim, padding=conv_kernel_size - 1, bias=False
        )
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads))
        self.A_log = nn.Parameter(torch.log(torch.empty(num_v_heads).uniform_(0, 16)))
        self.norm = GatedRMSNorm(head_v_dim, eps=norm_eps)
        self.out_proj = nn.Linear(self.value_dim, hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cu_seqlens_padded: torch.Tensor, group=None) -> torch.Tensor:
        """x ``[T/W, hidden]``, this rank's THD shard (the whole batch when ``group`` is None),
        -> ``[T/W, hidden]``; ``cu_seqlens_padded [B+1]`` is the global layout (``cu[-1] = T``).
        ``group``: a ``ProcessGroup``, a 1-D ``DeviceMesh`` or None. Differentiable in x and
        the parameters; parameter gradients are this rank's share (sum them over the group).
        Raises ``ValueError`` when the strategy cannot run over W ranks (``Hk % W``) or x's shape
        does not fit, ``TypeError`` for x's type, dtype or device. Compile with
        ``options=cp_ops.COMPILE_OPTIONS``.
        """
        world = resolve_group(group)[1]
        cp = default_context_parallel(world) if world == 1 or self.context_parallel is None else self.context_parallel
        cp.check(self, world)
        check_hidden_states(self, x, self.hidden_size)
        check_layout_tensors(x, None, cu_seqlens_padded)
        cu_seqlens_padded = checked("padded_shard", cu_seqlens_padded, (), world, x.shape[0], entry=True)
        h, z = cp.exchange_in(self, x, cu_seqlens_padded, group)
        o = cp.mix(self, h, cu_seqlens_padded, group)
        return cp.exchange_out(self, o, z, cu_seqlens_padded, group)

    def _sections(self, cp_size: int = 1) -> list[int]:
        """Widths of the in_proj output sections q, k, v, z, b, a (per rank when ``cp_size > 1``)."""
        hk, hv = self.num_k_heads // cp_size, self.num_v_heads // cp_size
        dk, dv = self.head_k_dim, self.head_v_dim
        return [hk * dk, hk * dk, hv * dv, hv * dv, hv, hv]

    def _exchanged_sections(self, cp_size: int = 1) -> list[int]:
        """:meth:`_sections` without z (which stays on its rank): q, k, v, b, a."""
        q, k, v, _, b, a = self._sections(cp_size)
        return [q, k, v, b, a]

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``in_proj(x)`` as ``(qkvba [R, 2*Hk*dk + Hv*dv + 2*Hv], z [R, Hv*dv])``, both contiguous."""
        return self._project_qkvba(x), self._project_z(x)

    def _project_qkvba(self, x: torch.Tensor) -> torch.Tensor:
        """The q, k, v, b, a sections of ``in_proj(x)``: one GEMM on their weight rows."""
        w = self.in_proj.weight
        return F.linear(x, torch.cat([w[: self.conv_dim], w[self.conv_dim + self.value_dim :]]))

    def _project_z(self, x: torch.Tensor) -> torch.Tensor:
        """The z section of ``in_proj(x)``, ``[R, Hv*dv]``."""
        return F.linear(x, self.in_proj.weight[self.conv_dim : self.conv_dim + self.value_dim])

    def _project_send_blocks(self, x: torch.Tensor, cp_size: int) -> torch.Tensor:
        """``sections_to_rank_blocks(project(x)[0], exchanged_sections(), W)``, ``[W, R, F/W]``,
        computed as W GEMMs on regrouped weight rows (block d: rank d's slice of each section)."""
        w = self.in_proj.weight
        q, k, v, _, b, a = torch.split(w, self._sections())
        blocks = torch.cat([s.view(cp_size, s.shape[0] // cp_size, w.shape[1]) for s in (q, k, v, b, a)], dim=1)
        return torch.stack([F.linear(x, blocks[d]) for d in range(cp_size)])

    def _project_out(self, o: torch.Tensor, z: torch.Tensor, cols: slice = slice(None)) -> torch.Tensor:
        """``out_proj(norm(o, z))`` for section-layout rows ``o``, ``z [R, H*dv]``: all value heads,
        or the heads of out_proj's input columns ``cols`` (their part of the sum)."""
        rows, dv = o.shape[0], self.head_v_dim
        heads = o.shape[-1] // dv  # given, not -1: rows may be 0
        gated = self.norm(o.view(rows, heads, dv), z.view(rows, heads, dv)).reshape(rows, heads * dv)
        if cols == slice(None):
            return self.out_proj(gated)
        return F.linear(gated, self.out_proj.weight[:, cols])  # part of out_proj (it has no bias)

    def _head_parallel_core(
        self,
        proj_hp: torch.Tensor,
        cu_seqlens: torch.Tensor,
        k_head_start: int,
        num_k_heads: int,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Conv, l2norm, gates and delta rule for key heads ``[k_head_start, k_head_start +
        num_k_heads)`` and their value heads, on all tokens. proj_hp ``[T, F_r]``: the q, k, v,
        b, a sections of those heads (widths :meth:`_exchanged_sections` / W) in sequence order,
        or, with ``rows [T]``, sequence row t at row ``rows[t]``. Returns ``[T, Hv_r * dv]`` in
        sequence order. Raises ``ValueError`` when F_r does not fit the head range.
        """
        num_rows = proj_hp.shape[0]
        hk, hv = num_k_heads, num_k_heads * (self.num_v_heads // self.num_k_heads)
        conv_w = 2 * hk * self.head_k_dim + hv * self.head_v_dim
        if proj_hp.shape[-1] != conv_w + 2 * hv:
            raise ValueError(f"proj_hp has {proj_hp.shape[-1]} features, expected {conv_w + 2 * hv} for {hk} key heads")
        conv_weight = self._conv_weight(k_head_start, num_k_heads)
        # one op for both column ranges, its backward writing proj_hp's whole gradient; q, k
        # l2-normalised there, and q, k, v each in contiguous memory that the delta rule reads in place
        dk = self.head_k_dim
        qk, v, ba = causal_conv1d_gather(proj_hp, rows, conv_weight, None, cu_seqlens, "silu", 2 * hk * dk, dk, 2)
        q, k, v, g, beta = self._delta_rule_inputs(qk[0], qk[1], v, ba, k_head_start, num_k_heads)
        return chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens).reshape(num_rows, hv * self.head_v_dim)

    def _conv_weight(self, k_head_start: int, num_k_heads: int) -> torch.Tensor:
        """The conv's ``[C, K]`` weight rows of key heads ``[k_head_start, +num_k_heads)`` and
        their value heads: their q, k and v channels, in that order."""
        weight = self.conv1d.weight[:, 0, :]
        dk, dv, v_per_k = self.head_k_dim, self.head_v_dim, self.num_v_heads // self.num_k_heads
        k0, qk_w = k_head_start * dk, num_k_heads * dk
        v0, v_w = k_head_start * v_per_k * dv, num_k_heads * v_per_k * dv
        return torch.cat(
            [
                weight[k0 : k0 + qk_w],
                weight[self.key_dim + k0 : self.key_dim + k0 + qk_w],
                weight[2 * self.key_dim + v0 : 2 * self.key_dim + v0 + v_w],
            ]
        )

    def _delta_rule_inputs(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ba: torch.Tensor, k_head_start: int,
        num_k_heads: int,
    ) -> tuple[torch.Tensor, ...]:  # fmt: skip
        """``(q, k, v, g, beta)`` of :func:`custom_ops.chunk_gated_delta_rule` from the conv's outputs
        ``q, k [T, Hk_r*dk]`` (l2-normalised per head by the conv op), ``v [T, Hv_r*dv]`` and the
        b, a sections ``ba [T, 2*Hv_r]`` of key heads ``[k_head_start, +num_k_heads)``: the heads
        as views, the gates in float32 (or wider)."""
        num_rows, dk, dv = q.shape[0], self.head_k_dim, self.head_v_dim
        v_per_k = self.num_v_heads // self.num_k_heads
        hk, hv, v_start = num_k_heads, num_k_heads * v_per_k, k_head_start * v_per_k
        q, k, v = q.view(num_rows, hk, dk), k.view(num_rows, hk, dk), v.view(num_rows, hv, dv)
        b, a = ba[:, :hv], ba[:, hv:]
        wide = torch.promote_types(ba.dtype, torch.float32)
        a_log = self.A_log[v_start : v_start + hv].to(wide)
        dt_bias = self.dt_bias[v_start : v_start + hv].to(wide)
        g = -a_log.exp() * F.softplus(a.to(wide) + dt_bias)
        return q, k, v, g, torch.sigmoid(b.to(wide))


def from_qwen3_next_state_dict(
    sd: dict[str, torch.Tensor], num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int
) -> dict[str, torch.Tensor]:
    """A :class:`GatedDeltaNet` state dict from one Qwen3-Next GatedDeltaNet layer's tensors
    (prefix stripped): ``in_proj_qkvz.weight`` and ``in_proj_ba.weight``, regrouped from per
    key head blocks into ``in_proj``'s sections (docs/design.md section 4), and ``conv1d.weight``,
    ``A_log``, ``dt_bias``, ``norm.weight``, ``out_proj.weight``, copied."""
    hk, dk, dv = num_k_heads, head_k_dim, head_v_dim
    v_per_k = num_v_heads // hk
    qkvz = sd["in_proj_qkvz.weight"]
    hidden = qkvz.shape[-1]
    blocks = qkvz.reshape(hk, 2 * dk + 2 * v_per_k * dv, hidden)
    q, k, v, z = torch.split(blocks, [dk, dk, v_per_k * dv, v_per_k * dv], dim=1)
    b, a = torch.split(sd["in_proj_ba.weight"].reshape(hk, 2 * v_per_k, hidden), [v_per_k, v_per_k], dim=1)
    in_proj = torch.cat([t.reshape(-1, hidden) for t in (q, k, v, z, b, a)])
    out = {"in_proj.weight": in_proj}
    for name in ("conv1d.weight", "A_log", "dt_bias", "norm.weight", "out_proj.weight"):
        out[name] = sd[name]
    return out
