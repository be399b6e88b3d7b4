"""The strategies that run a :class:`cp_ops.gdn.GatedDeltaNet` over a CP group of W ranks
(docs/design.md section 4): by heads, every token of the batch for 1/W of the heads between two
all-to-alls (:class:`SectionExchange`, :class:`FusedExchange`; :class:`SingleDevice` at W = 1),
or by chunk states on the dual-chunk layout (:class:`StatePassing`, section 4.3), where each
rank runs the delta rule on its own chunks and the ranks exchange per-chunk state maps, not
activations, so W is not bound to the key heads. The layer imports this module, not the other
way round: a strategy's ``layer`` is that GatedDeltaNet, typed as the module it is."""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import torch
import torch.nn as nn

from cp_ops.exchange import thd_cp2hp_blocks, thd_cp2hp_overlap, thd_hp2cp_blocks
from custom_ops import (
    all_gather_rows,
    causal_conv1d_gather,
    chunk_gated_delta_rule_dual_chunks,
    chunk_rows,
    group_rank,
    local_chunk_bounds,
    rank_to_seq_index,
    resolve_group,
    thd_hp2cp,
)

__all__ = [
    "GDNContextParallel",
    "SingleDevice",
    "SectionExchange",
    "FusedExchange",
    "StatePassing",
    "default_context_parallel",
    "chunk_gated_delta_rule_cp_states",
]


class GDNContextParallel:
    """How a :class:`cp_ops.gdn.GatedDeltaNet` runs over a CP group of W ranks; the layer's
    forward is ``h, z = exchange_in(layer, x, cu, group)``, ``o = mix(layer, h, cu, group)``,
    ``exchange_out(layer, o, z, cu, group)``. ``x`` and the result are this rank's rows
    ``[T/W, hidden]``; ``h`` and ``o`` are in whatever layout the strategy's mix reads and
    writes; ``z`` is the gate projection, which stays on its rank. Every step is
    differentiable. Subclasses: :class:`SingleDevice`, :class:`SectionExchange`,
    :class:`FusedExchange` (by heads), :class:`StatePassing` (by chunk states).
    """

    def check(self, layer: nn.Module, world: int) -> None:
        """Raises ``ValueError`` if the layer cannot run this way over ``world`` ranks."""

    def exchange_in(
        self, layer: nn.Module, x: torch.Tensor, cu_seqlens_padded: torch.Tensor, group
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``in_proj`` of the local rows, brought to the mix's layout: ``(h, z [T/W, Hv*dv])``."""
        raise NotImplementedError

    def mix(self, layer: nn.Module, h: torch.Tensor, cu_seqlens_padded: torch.Tensor, group) -> torch.Tensor:
        """Conv, gates and delta rule on ``h``: the delta-rule output ``o``."""
        raise NotImplementedError

    def exchange_out(
        self, layer: nn.Module, o: torch.Tensor, z: torch.Tensor, cu_seqlens_padded: torch.Tensor, group
    ) -> torch.Tensor:
        """``o`` back to the local rows, gated by ``z``, through ``out_proj``: ``[T/W, hidden]``."""
        raise NotImplementedError


class _HeadParallel(GDNContextParallel):
    """The mix on every token of the batch for this rank's 1/W of the heads."""

    def check(self, layer: nn.Module, world: int) -> None:
        if layer.num_k_heads % world or layer.num_v_heads % world:
            raise ValueError(
                f"num_k_heads = {layer.num_k_heads} and num_v_heads = {layer.num_v_heads} must be divisible by "
                f"the CP size {world} to split the heads over the ranks; "
                "GatedDeltaNet(..., context_parallel=cp_ops.StatePassing()) runs at any CP size"
            )

    @staticmethod
    def key_heads(layer: nn.Module, group) -> tuple[int, int]:
        """``(first, count)``: the key heads this rank mixes."""
        heads = layer.num_k_heads // resolve_group(group)[1]
        return group_rank(group) * heads, heads


class SingleDevice(GDNContextParallel):
    """The whole batch on this device, all heads: what the layer runs whenever W = 1."""

    def check(self, layer: nn.Module, world: int) -> None:
        if world != 1:
            raise ValueError(f"SingleDevice runs without CP, but the group has {world} ranks")

    def exchange_in(self, layer, x, cu_seqlens_padded, group):
        return layer._project(x)

    def mix(self, layer, h, cu_seqlens_padded, group):
        return layer._head_parallel_core(h, cu_seqlens_padded, 0, layer.num_k_heads)

    def exchange_out(self, layer, o, z, cu_seqlens_padded, group):
        return layer._project_out(o, z)


class SectionExchange(_HeadParallel):
    """Head parallel over section-layout tensors: :func:`cp_ops.thd_cp2hp_overlap` in,
    :func:`cp_ops.thd_hp2cp` out, a layout pass on each side of each all-to-all. The eager
    default for W > 1."""

    def exchange_in(self, layer, x, cu_seqlens_padded, group):
        # the z projection runs while q, k, v, b, a travel (and its backward while their gradients do)
        overlap = partial(layer._project_z, x)
        return thd_cp2hp_overlap(layer._project_qkvba(x), cu_seqlens_padded, layer._exchanged_sections(), group, overlap)

    def mix(self, layer, h, cu_seqlens_padded, group):
        return layer._head_parallel_core(h, cu_seqlens_padded, *self.key_heads(layer, group))

    def exchange_out(self, layer, o, z, cu_seqlens_padded, group):
        return layer._project_out(thd_hp2cp(o, cu_seqlens_padded, [o.shape[-1]], group), z)


class FusedExchange(_HeadParallel):
    """Head parallel with the layouts folded into the neighbours of the all-to-alls: in_proj
    writes the send buffer, the conv reads the received rows in rank order, the gated norm
    reads the received blocks in place. The compiled default for W > 1; equal to
    :class:`SectionExchange` to rounding (out_proj's sum over heads is grouped by rank)."""

    def exchange_in(self, layer, x, cu_seqlens_padded, group):
        send = layer._project_send_blocks(x, resolve_group(group)[1])
        overlap = partial(layer._project_z, x)
        return thd_cp2hp_blocks(send, cu_seqlens_padded, group, overlap, seq_order=False)

    def mix(self, layer, h, cu_seqlens_padded, group):
        rows = rank_to_seq_index(cu_seqlens_padded, resolve_group(group)[1], h.shape[0])
        return layer._head_parallel_core(h, cu_seqlens_padded, *self.key_heads(layer, group), rows)

    def exchange_out(self, layer, o, z, cu_seqlens_padded, group):
        # out_proj sums over value heads, so it splits by the blocks of the exchange back: this
        # rank's own block is projected while the others are in flight
        world, rank = resolve_group(group)[1], group_rank(group)
        width = layer.num_v_heads // world * layer.head_v_dim
        z_blocks = z.view(z.shape[0], world, width)

        def block(s: int) -> dict:  # rank s's value heads: its z columns and out_proj's input columns
            return {"z": z_blocks[:, s], "cols": slice(s * width, (s + 1) * width)}

        o_blocks, out = thd_hp2cp_blocks(o, cu_seqlens_padded, group, partial(layer._project_out, **block(rank)))
        for s in range(world):
            if s != rank:
                out = out + layer._project_out(o_blocks[s], **block(s))
        return out


def default_context_parallel(world: int) -> GDNContextParallel:
    """:class:`SingleDevice` for W = 1, else :class:`FusedExchange` under ``torch.compile`` and
    :class:`SectionExchange` eagerly (where the fused layouts would be copies of their own)."""
    if world == 1:
        return _SINGLE_DEVICE
    return _FUSED_EXCHANGE if torch.compiler.is_compiling() else _SECTION_EXCHANGE


_SINGLE_DEVICE, _SECTION_EXCHANGE, _FUSED_EXCHANGE = SingleDevice(), SectionExchange(), FusedExchange()



class StatePassing(GDNContextParallel):
    """Chunk-state passing: the conv and the delta rule on this rank's own rows, for every head.

    ``exchange_in``: in_proj, and each chunk's conv halo (the ``K-1`` rows before it, from the
    ranks that hold them: one all-gather of every chunk's last ``K-1`` rows). ``mix``: the conv
    on the rows with their halos, then :func:`chunk_gated_delta_rule_cp_states`. ``exchange_out``:
    out_proj on the local rows. Any W; per rank and layer it gathers ``W * 2B`` state maps of
    ``Hv * dk * (dk + dv)`` floats (docs/design.md section 4.3 compares the modes).
    """

    def exchange_in(self, layer: nn.Module, x, cu_seqlens_padded, group):
        qkvba, z = layer._project(x)
        name, world = resolve_group(group)
        chunks = _Chunks.of(cu_seqlens_padded, world, group_rank(group), x.shape[0], layer.conv_kernel_size - 1)
        conv_in = qkvba[:, : layer.conv_dim]
        return (_with_halos(conv_in, chunks, name, world), qkvba[:, layer.conv_dim :], chunks), z

    def mix(self, layer: nn.Module, h, cu_seqlens_padded, group):
        extended, ba, chunks = h
        weight = layer._conv_weight(0, layer.num_k_heads)
        # q, k normalised and q, k, v each contiguous (as the head-parallel layer takes them), then the halos dropped
        qk, v, _ = causal_conv1d_gather(
            extended, None, weight, None, chunks.extended_cu, "silu", 2 * layer.key_dim, layer.head_k_dim, 2
        )
        q, k, v = (t.index_select(0, chunks.rows) for t in (qk[0], qk[1], v))
        q, k, v, g, beta = layer._delta_rule_inputs(q, k, v, ba, 0, layer.num_k_heads)
        o = chunk_gated_delta_rule_dual_chunks(q, k, v, g, beta, chunks.local_cu, group)
        return o.flatten(1)

    def exchange_out(self, layer: nn.Module, o, z, cu_seqlens_padded, group):
        return layer._project_out(o, z)


class _Chunks(NamedTuple):
    """Index maps of this rank's rows: ``local_cu [2B+1]`` bounds its chunks (chunk ``r``, then
    ``2W-1-r``, of each sequence); with halos of ``K-1`` rows before each chunk, the chunk rows
    sit at ``rows [R]`` and the halos at ``halo_rows [2B*(K-1)]`` of ``extended_cu[-1]`` rows,
    the halo rows read the all-gathered chunk tails at ``halo_source`` where ``halo_valid``."""

    local_cu: torch.Tensor
    extended_cu: torch.Tensor
    rows: torch.Tensor
    halo_rows: torch.Tensor
    halo_source: torch.Tensor
    halo_valid: torch.Tensor
    taps: int

    @staticmethod
    def of(cu_seqlens_padded: torch.Tensor, world: int, rank: int, num_rows: int, halo: int) -> _Chunks:
        cup = cu_seqlens_padded
        chunk = chunk_rows(cup, world).long()  # [B]
        num_seqs = chunk.shape[0]
        local_cu = local_chunk_bounds(cup, world).long()
        ids = torch.arange(2 * num_seqs + 1, device=cup.device)
        extended_cu = local_cu + ids * halo
        row = torch.arange(num_rows, device=cup.device)
        # local_cu[0] = 0 <= row: the chunks ending at or before row, plus one. Searched whole,
        # not as local_cu[1:]: Inductor 2.11 cannot lower searchsorted over a slice
        rows = row + torch.searchsorted(local_cu, row, right=True) * halo
        offset = torch.arange(halo, device=cup.device)
        halo_rows = (extended_cu[:-1, None] + offset).reshape(-1)
        # halo row i of chunk c of sequence b is its sequence's row p = c*len - halo + i, which sits
        # in an earlier chunk c2 within its last `halo` rows: tail row halo - (c2 + 1)*len + p
        slot = torch.arange(2 * num_seqs, device=cup.device) % 2
        own = rank + slot * (2 * world - 1 - 2 * rank)  # [2B]: chunk r, then 2W-1-r
        length = chunk.repeat_interleave(2)[:, None]
        p = own[:, None] * length - halo + offset
        valid = p >= 0
        c2 = torch.div(p.clamp(min=0), length.clamp(min=1), rounding_mode="floor")
        tail = halo - (c2 + 1) * length + p
        owner, slot = torch.minimum(c2, 2 * world - 1 - c2), (c2 >= world).long()
        seq = torch.arange(num_seqs, device=cup.device).repeat_interleave(2)[:, None]
        source = ((owner * 2 * num_seqs + 2 * seq + slot) * halo + tail).clamp(min=0)
        return _Chunks(local_cu.to(cup.dtype), extended_cu.to(cup.dtype), rows, halo_rows, source.reshape(-1),
                       valid.reshape(-1, 1), halo)  # fmt: skip


def _with_halos(conv_in: torch.Tensor, chunks: _Chunks, group_name: str | None, world: int) -> torch.Tensor:
    """``conv_in [R, C]`` with each chunk's ``K-1`` preceding rows of its sequence (zeros before
    its start) inserted before it: ``[R + 2B*(K-1), C]``, laid out by ``chunks.extended_cu``."""
    halo, num_rows = chunks.taps, conv_in.shape[0]
    ends = chunks.local_cu[1:].long()[:, None]
    tail_rows = ends - halo + torch.arange(halo, device=conv_in.device)  # each chunk's last `halo` rows
    in_chunk = (tail_rows >= chunks.local_cu[:-1].long()[:, None]).reshape(-1, 1)
    if num_rows == 0:  # only empty sequences: no row to take (index_select needs one)
        picked = conv_in.new_zeros(tail_rows.numel(), conv_in.shape[1])
    else:
        picked = conv_in.index_select(0, tail_rows.reshape(-1).clamp(0, num_rows - 1))
    tails = torch.where(in_chunk, picked, torch.zeros_like(picked))
    gathered = all_gather_rows(tails, group_name) if world > 1 else tails
    halos = torch.where(chunks.halo_valid, gathered.index_select(0, chunks.halo_source), torch.zeros_like(tails))
    extended = conv_in.new_zeros(num_rows + halos.shape[0], conv_in.shape[1])
    return extended.index_copy(0, torch.cat([chunks.rows, chunks.halo_rows]), torch.cat([conv_in, halos]))


def chunk_gated_delta_rule_cp_states(q, k, v, g, beta, cu_seqlens_padded, group, scale=None) -> torch.Tensor:
    """:func:`custom_ops.chunk_gated_delta_rule` of this rank's rows in the dual-chunk layout
    (``[T/W, ...]``; ``cu_seqlens_padded`` global), by :func:`custom_ops.chunk_gated_delta_rule_dual_chunks`
    over its chunks: o ``[T/W, Hv, dv]``, equal to the sequence-order result's rows of this rank;
    differentiable in q, k, v, g, beta."""
    local_cu = local_chunk_bounds(cu_seqlens_padded, resolve_group(group)[1])
    return chunk_gated_delta_rule_dual_chunks(q, k, v, g, beta, local_cu, group, scale)
