"""Gated DeltaNet layer (Qwen3-Next's linear-attention block) on packed THD sequences."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from cp_ops.exchange import thd_cp2hp_blocks, thd_cp2hp_overlap, thd_hp2cp_blocks
from cp_ops.inputs import check_hidden_states, check_layout_tensors
from cp_ops.modules import GatedRMSNorm, l2norm
from custom_ops import (
    causal_conv1d,
    causal_conv1d_gather,
    chunk_gated_delta_rule,
    group_rank,
    resolve_group,
    thd_hp2cp,
)
from custom_ops.thd_index import rank_to_seq_index
from custom_ops.validation import checked


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet over packed sequences ``[T, hidden]`` (THD, padding at each sequence's tail).

    Per token, with ``G = Hv / Hk`` value heads per key head::

        q, k, v, z, b, a = in_proj(x)                 widths Hk*dk, Hk*dk, Hv*dv, Hv*dv, Hv, Hv
        q, k, v = silu(causal_conv1d([q k v]))          depthwise, kernel K, per sequence
        q, k = l2norm(q), l2norm(k)                     per key head
        g = -exp(A_log) * softplus(a + dt_bias)         fp32, per value head
        beta = sigmoid(b)                               fp32
        o = chunk_gated_delta_rule(q, k, v, g, beta)    value head h reads key head h // G
        out = out_proj(rmsnorm(o) * norm.weight * silu(z))   norm per value head (size dv)

    Parameters (names and init as Qwen3-Next's ``Qwen3NextGatedDeltaNet``):
    ``in_proj`` (one Linear, no bias, output sections in the order above),
    ``conv1d`` (depthwise ``nn.Conv1d`` over the ``2*Hk*dk + Hv*dv`` q,k,v channels,
    no bias), ``A_log`` (``log U(0, 16)``), ``dt_bias`` (ones), ``norm.weight``
    (ones, size dv), ``out_proj`` (Linear, no bias).

    Qwen3-Next checkpoints: ``in_proj_qkvz.weight [2*Hk*dk + 2*Hv*dv, hidden]`` is laid
    out per key head: viewed as ``[Hk, 2*dk + 2*G*dv, hidden]``, block j holds q_j
    (dk rows), k_j (dk), the v rows of value heads ``j*G .. j*G+G-1`` (G*dv), then
    their z rows (G*dv). ``in_proj_ba.weight [2*Hv, hidden]`` viewed as
    ``[Hk, 2*G, hidden]``: block j holds b then a of value heads ``j*G ..``. Taking
    each section out of every block and concatenating in head order gives this
    module's ``in_proj`` sections. ``conv1d.weight`` (channels q | k | v, head-major),
    ``A_log``, ``dt_bias``, ``norm.weight`` and ``out_proj.weight`` map one to one.
    :func:`from_qwen3_next_state_dict` does this; the layout is taken from the
    Hugging Face implementation's ``fix_query_key_value_ordering`` (and agrees with
    other public ports of it); the test builds a state dict that way, but no
    released checkpoint was loaded here.

    ``forward(x, cu_seqlens_padded, group=None)``: x ``[T, hidden]`` in sequence
    order, ``cu_seqlens_padded [B+1]`` with ``cu[-1] = T``. Both the conv and the
    recurrence are causal and padding sits at each sequence's tail, so the real
    tokens' outputs do not depend on the padding. ``group=None`` runs the whole
    batch on this device. With context parallelism (W ranks, x the local shard
    ``[T/W, hidden]``): ``in_proj`` on the local rows, then ``thd_cp2hp`` of the
    q, k, v, b, a sections (:meth:`exchanged_sections`: this rank's 1/W of their
    heads, all tokens) ``-> head_parallel_core(proj_hp, cu, r*Hk/W, Hk/W) ->
    thd_hp2cp`` of the delta-rule output, then the gated norm with the local z and
    ``out_proj``; it needs ``Hk % W == 0`` (hence ``Hv % W == 0``). Under
    ``torch.compile`` the layouts on both sides of the exchanges are fused into their
    neighbours (:attr:`fused_layouts`): ``in_proj`` writes the all-to-all's send buffer
    itself, the conv reads the received rows where they are, in the all-to-all's rank
    order (:func:`custom_ops.causal_conv1d_gather`), and the gated norm reads the
    received blocks in place. The gate z
    never leaves its rank: the gated norm is per token and head, so it runs after
    the all-to-all back, on the local rows, and ``thd_cp2hp`` carries
    ``2*Hk*dk + Hv*dv + 2*Hv`` features instead of ``2*Hk*dk + 2*Hv*dv + 2*Hv``
    (a third less at Qwen3-Next's shapes).
    """

    #: The layouts of the CP exchanges. True: fused into their neighbours (in_proj writes the
    #: all-to-all's send buffer as W GEMMs, the conv reads the received rows in rank order, the
    #: gated norm reads the received blocks in place: :func:`cp_ops.thd_cp2hp_blocks`,
    #: :func:`custom_ops.causal_conv1d_gather`, :func:`cp_ops.thd_hp2cp_blocks`). False: section-layout
    #: tensors through :func:`cp_ops.thd_cp2hp_overlap` and :func:`cp_ops.thd_hp2cp`, a layout
    #: kernel on each side of each exchange. None (the default): fused under ``torch.compile``,
    #: where Inductor folds the layouts into the GEMM outputs and the norm's kernels, and
    #: sections in eager mode, where the stacked GEMM outputs and the norm on strided blocks
    #: would be copies of their own. Same values either way.
    fused_layouts: bool | None = None

    def __init__(
        self,
        hidden_size: int,
        num_k_heads: int,
        num_v_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        conv_kernel_size: int = 4,
        norm_eps: float = 1e-6,
    ):
        super().__init__()
        if num_v_heads % num_k_heads != 0:
            raise ValueError(f"num_v_heads = {num_v_heads} must be a multiple of num_k_heads = {num_k_heads}")
        self.hidden_size = hidden_size
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.conv_kernel_size = conv_kernel_size
        self.key_dim, self.value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.in_proj = nn.Linear(hidden_size, sum(self.sections()), bias=False)
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, conv_kernel_size, groups=self.conv_dim, padding=conv_kernel_size - 1, bias=False
        )
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads))
        self.A_log = nn.Parameter(torch.log(torch.empty(num_v_heads).uniform_(0, 16)))
        self.norm = GatedRMSNorm(head_v_dim, eps=norm_eps)
        self.out_proj = nn.Linear(self.value_dim, hidden_size, bias=False)

    def sections(self, cp_size: int = 1) -> list[int]:
        """Widths of the in_proj output sections q, k, v, z, b, a (per rank when ``cp_size > 1``)."""
        hk, hv = self.num_k_heads // cp_size, self.num_v_heads // cp_size
        dk, dv = self.head_k_dim, self.head_v_dim
        return [hk * dk, hk * dk, hv * dv, hv * dv, hv, hv]

    def exchanged_sections(self, cp_size: int = 1) -> list[int]:
        """Widths of the sections q, k, v, b, a that ``thd_cp2hp`` carries (per rank when
        ``cp_size > 1``): :meth:`sections` without z, which stays on its rank."""
        q, k, v, _, b, a = self.sections(cp_size)
        return [q, k, v, b, a]

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``in_proj(x)`` as ``(qkvba [R, 2*Hk*dk + Hv*dv + 2*Hv], z [R, Hv*dv])``.

        Two GEMMs on row blocks of ``in_proj.weight`` (the q, k, v rows with the b, a
        rows; then the z rows), so the sections that travel through ``thd_cp2hp`` come
        out contiguous: the concatenation copies weight rows, not activations.
        """
        return self._project_qkvba(x), self._project_z(x)

    def project_send_blocks(self, x: torch.Tensor, cp_size: int) -> torch.Tensor:
        """The q, k, v, b, a projections in ``thd_cp2hp``'s send layout ``[W, R, F/W]``.

        Block d holds rank d's slice of each of the five sections, what
        ``sections_to_rank_blocks(project(x)[0], exchanged_sections(), W)`` returns, but
        computed as W GEMMs on row blocks of ``in_proj.weight`` (regrouped: a copy of
        weight rows). Compiled, Inductor writes each GEMM straight into its block of the
        send buffer, so no pass over the activations lays it out; the backward sums W
        GEMMs for the input gradient.
        """
        w = self.in_proj.weight
        q, k, v, _, b, a = torch.split(w, self.sections())
        blocks = torch.cat([s.view(cp_size, s.shape[0] // cp_size, w.shape[1]) for s in (q, k, v, b, a)], dim=1)
        return torch.stack([F.linear(x, blocks[d]) for d in range(cp_size)])

    def _project_qkvba(self, x: torch.Tensor) -> torch.Tensor:
        w = self.in_proj.weight
        return F.linear(x, torch.cat([w[: self.conv_dim], w[self.conv_dim + self.value_dim :]]))

    def _project_z(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.in_proj.weight[self.conv_dim : self.conv_dim + self.value_dim])

    def forward(self, x: torch.Tensor, cu_seqlens_padded: torch.Tensor, group=None) -> torch.Tensor:
        """x ``[T/W, hidden]`` (this rank's THD shard; the whole batch when ``group`` is None)
        -> ``[T/W, hidden]``. ``cu_seqlens_padded`` is the *global* layout.

        With a group of W ranks: the q, k, v, b, a projections of the local tokens, one
        exchange to all tokens and this rank's 1/W of the heads (with the z projection
        computed while it is in flight), the head-parallel core, one exchange of its
        output back to the local tokens, the gated norm with the local z, ``out_proj``.
        With fused layouts (:attr:`fused_layouts`; under ``torch.compile`` by default)
        the projections come out in the all-to-all's send layout
        (:meth:`project_send_blocks`, :func:`cp_ops.thd_cp2hp_blocks`), the conv reads the
        received rows in rank order through a row map (:func:`custom_ops.causal_conv1d_gather`,
        its backward writes their gradient back the same way), and the gated norm reads the
        received blocks where they are (:func:`cp_ops.thd_hp2cp_blocks`);
        ``out_proj`` runs per block, the rank's own block (its heads of its own rows)
        while the exchange back is in flight. The result equals the section form's to
        rounding (out_proj's sum over heads is grouped differently).
        Under ``torch.compile``, pass ``options=cp_ops.COMPILE_OPTIONS`` to keep the
        overlap. Parameter gradients are this rank's contribution; sum them over the
        CP group (as data parallelism does) to get the single-device gradients.
        """
        world = self._cp_size(group)
        check_hidden_states(self, x, self.hidden_size)
        check_layout_tensors(x, None, cu_seqlens_padded)
        rows, hv, dv = x.shape[0], self.num_v_heads, self.head_v_dim
        cu_seqlens_padded = checked("padded", cu_seqlens_padded, (), world, rows * world)
        if world == 1:
            qkvba, z = self.project(x)
            o = self.head_parallel_core(qkvba, cu_seqlens_padded, 0, self.num_k_heads)
            return self._gate_and_project_out(o, z)
        heads, rank = self.num_k_heads // world, group_rank(group)
        head_start = rank * heads
        fused = torch.compiler.is_compiling() if self.fused_layouts is None else self.fused_layouts
        # the z projection runs while q, k, v, b, a are exchanged (and its backward while their
        # gradients are)
        if not fused:
            qkvba_hp, z = thd_cp2hp_overlap(
                self._project_qkvba(x), cu_seqlens_padded, self.exchanged_sections(), group, lambda: self._project_z(x)
            )
            o_hp = self.head_parallel_core(qkvba_hp, cu_seqlens_padded, head_start, heads)
            o = thd_hp2cp(o_hp, cu_seqlens_padded, [o_hp.shape[-1]], group)
            return self._gate_and_project_out(o, z)
        # received in rank order and left there: the conv reads its rows through the map to
        # sequence order and writes their gradient back the same way (no reorder either way)
        qkvba_hp, z = thd_cp2hp_blocks(
            self.project_send_blocks(x, world), cu_seqlens_padded, group, lambda: self._project_z(x), seq_order=False
        )
        rows_hp = rank_to_seq_index(cu_seqlens_padded, world, qkvba_hp.shape[0])
        o_hp = self.head_parallel_core(qkvba_hp, cu_seqlens_padded, head_start, heads, rows_hp)
        # out_proj is a sum over the value heads, so it splits by the blocks of the exchange
        # back: this rank's heads of its own rows (which never leave it) are normed and
        # projected while the other blocks are in flight, each other block when it is in
        # (the norm reads the received block where it is)
        width = hv // world * dv
        z_blocks = z.view(rows, world, width)

        def project_block(o_block: torch.Tensor, s: int) -> torch.Tensor:  # rank s's heads -> [rows, hidden]
            cols = slice(s * width, (s + 1) * width)  # out_proj's input columns come in rank blocks too
            return self._gate_and_project_out(o_block, z_blocks[:, s], cols)

        o_blocks, out = thd_hp2cp_blocks(o_hp, cu_seqlens_padded, group, lambda own: project_block(own, rank))
        for s in range(world):
            if s != rank:
                out = out + project_block(o_blocks[s], s)
        return out

    def _gate_and_project_out(self, o: torch.Tensor, z: torch.Tensor, cols: slice = slice(None)) -> torch.Tensor:
        """``out_proj(norm(o, z))`` on section-layout rows ``o``, ``z [R, H*dv]``: all value
        heads, or the heads of out_proj's input columns ``cols`` (their part of the sum)."""
        rows, dv = o.shape[0], self.head_v_dim
        heads = o.shape[-1] // dv  # given, not -1: rows may be 0
        gated = self.norm(o.view(rows, heads, dv), z.view(rows, heads, dv)).reshape(rows, heads * dv)
        if cols == slice(None):
            return self.out_proj(gated)
        return F.linear(gated, self.out_proj.weight[:, cols])  # part of out_proj (it has no bias)

    def _cp_size(self, group) -> int:
        _, world = resolve_group(group)
        if self.num_k_heads % world or self.num_v_heads % world:
            raise ValueError(
                f"num_k_heads = {self.num_k_heads} and num_v_heads = {self.num_v_heads} must be divisible by "
                f"the CP size {world}"
            )
        return world

    def head_parallel_core(
        self,
        proj_hp: torch.Tensor,
        cu_seqlens: torch.Tensor,
        k_head_start: int,
        num_k_heads: int,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """conv -> l2norm -> gates -> delta rule for one range of heads, all tokens.

        proj_hp ``[T, F_r]``: the q, k, v, b, a sections restricted to key heads
        ``[k_head_start, k_head_start + num_k_heads)`` and their value heads
        ``[G*k_head_start, G*(k_head_start + num_k_heads))`` (what ``thd_cp2hp``
        returns with :meth:`exchanged_sections`), in sequence order, or with ``rows``
        (a permutation, ``[T]``) sequence row t at its row ``rows[t]``: the conv then
        gathers them (:func:`custom_ops.causal_conv1d_gather`). Returns the delta-rule
        output ``[T, Hv_r * dv]`` of those value heads, in sequence order; the gated norm
        comes after.
        """
        num_rows = proj_hp.shape[0]
        group = self.num_v_heads // self.num_k_heads
        dk, dv = self.head_k_dim, self.head_v_dim
        hk, hv = num_k_heads, num_k_heads * group
        v_start = k_head_start * group
        qk_w, v_w = hk * dk, hv * dv
        conv_w = 2 * qk_w + v_w
        if proj_hp.shape[-1] != conv_w + 2 * hv:
            raise ValueError(f"proj_hp has {proj_hp.shape[-1]} features, expected {conv_w + 2 * hv} for {hk} key heads")

        # the conv channels of this head range: q, k and v blocks of the full conv weight
        weight = self.conv1d.weight[:, 0, :]
        k0, v0 = k_head_start * dk, v_start * dv
        conv_weight = torch.cat(
            [
                weight[k0 : k0 + qk_w],
                weight[self.key_dim + k0 : self.key_dim + k0 + qk_w],
                weight[2 * self.key_dim + v0 : 2 * self.key_dim + v0 + v_w],
            ]
        )
        if rows is None:
            # a column slice of proj: the conv reads it strided, no copy
            mixed = causal_conv1d(proj_hp[:, :conv_w], conv_weight, None, cu_seqlens, "silu")
            ba = proj_hp[:, conv_w:]
        else:
            mixed, ba = causal_conv1d_gather(proj_hp, rows, conv_weight, None, cu_seqlens, "silu")
        q = l2norm(mixed[:, :qk_w].reshape(num_rows, hk, dk))
        k = l2norm(mixed[:, qk_w : 2 * qk_w].reshape(num_rows, hk, dk))
        v = mixed[:, 2 * qk_w :].reshape(num_rows, hv, dv)
        b, a = ba[:, :hv], ba[:, hv:]

        wide = torch.promote_types(proj_hp.dtype, torch.float32)
        a_log = self.A_log[v_start : v_start + hv].to(wide)
        dt_bias = self.dt_bias[v_start : v_start + hv].to(wide)
        g = -a_log.exp() * F.softplus(a.to(wide) + dt_bias)
        beta = torch.sigmoid(b.to(wide))

        return chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens).reshape(num_rows, v_w)


def from_qwen3_next_state_dict(
    sd: dict[str, torch.Tensor], num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int
) -> dict[str, torch.Tensor]:
    """A :class:`GatedDeltaNet` state dict from one Qwen3-Next GatedDeltaNet layer's tensors.

    ``sd`` holds ``in_proj_qkvz.weight``, ``in_proj_ba.weight``, ``conv1d.weight``,
    ``A_log``, ``dt_bias``, ``norm.weight``, ``out_proj.weight`` (prefix stripped).
    The per-key-head blocks of the two projections are regrouped into this module's
    section layout (see the class docstring); the rest is copied.
    """
    hk, dk, dv = num_k_heads, head_k_dim, head_v_dim
    group = num_v_heads // hk
    qkvz = sd["in_proj_qkvz.weight"]
    hidden = qkvz.shape[-1]
    blocks = qkvz.reshape(hk, 2 * dk + 2 * group * dv, hidden)
    q, k, v, z = torch.split(blocks, [dk, dk, group * dv, group * dv], dim=1)
    b, a = torch.split(sd["in_proj_ba.weight"].reshape(hk, 2 * group, hidden), [group, group], dim=1)
    in_proj = torch.cat([t.reshape(-1, hidden) for t in (q, k, v, z, b, a)])
    out = {"in_proj.weight": in_proj}
    for name in ("conv1d.weight", "A_log", "dt_bias", "norm.weight", "out_proj.weight"):
        out[name] = sd[name]
    return out


__all__ = ["GatedDeltaNet", "from_qwen3_next_state_dict"]
