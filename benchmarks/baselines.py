"""Baselines the fused ops replace, shared by the benchmarks that time against them: the
CP <-> head-parallel conversions as one all-to-all per sequence and per section (eager), and
FLA's own CP of the GatedDeltaNet layer (:func:`fla_cp_layer_step`)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def cp2hp_per_sequence(x_cp: torch.Tensor, cu_seqlens_padded: torch.Tensor, sections, group) -> torch.Tensor:
    """The baseline: ``thd_cp2hp`` with one all-to-all per sequence and per section (eager).

    For each sequence i (local rows ``[cup[i]/W, cup[i+1]/W)``: chunks r and 2W-1-r) and each
    section: split the section's columns into W slices, all-to-all them, and put the received
    chunks back in sequence order. Reads the layout on the host (``.tolist()``).
    Returns what ``thd_cp2hp`` returns: ``[T, ..., F/W]``, sequence order.
    """
    world = group.size()
    cup = cu_seqlens_padded.tolist()
    offsets = [sum(sections[:b]) for b in range(len(sections))]
    seqs = []
    for i in range(len(cup) - 1):
        rows = x_cp[cup[i] // world : cup[i + 1] // world]  # [2c, ..., F]
        c = (cup[i + 1] - cup[i]) // (2 * world)
        if c == 0:
            continue
        parts = []
        for off, width in zip(offsets, sections):
            local = width // world
            if local == 0:  # nothing to exchange for an empty section
                parts.append(rows.new_empty((2 * world * c,) + tuple(rows.shape[1:-1]) + (0,)))
                continue
            send = rows[..., off : off + width].unflatten(-1, (world, local)).movedim(-2, 0).contiguous()
            recv = torch.empty_like(send)  # [W, 2c, ..., local]: recv[d] = rank d's two chunks
            dist.all_to_all_single(recv, send, group=group)
            chunks = [None] * (2 * world)
            for d in range(world):
                chunks[d], chunks[2 * world - 1 - d] = recv[d, :c], recv[d, c:]
            parts.append(torch.cat(chunks))
        seqs.append(torch.cat(parts, dim=-1))
    if not seqs:
        return x_cp.new_empty((x_cp.shape[0] * world,) + tuple(x_cp.shape[1:-1]) + (x_cp.shape[-1] // world,))
    return torch.cat(seqs)


def hp2cp_per_sequence(y_hp: torch.Tensor, cu_seqlens_padded: torch.Tensor, sections, group) -> torch.Tensor:
    """The baseline inverse: ``thd_hp2cp`` with one all-to-all per sequence and per section (eager).

    ``y_hp [T, ..., F/W]`` in sequence order holds this rank's slice of every section;
    ``sections`` are the local widths. For each sequence i (global rows ``[cup[i], cup[i+1])``,
    chunks of c rows) and each section: block d of the send buffer is the section's columns
    of chunks d and 2W-1-d (rank d's local rows); after the all-to-all, block s holds rank
    s's slice of the section for this rank's two chunks, and the W slices side by side are
    the whole section. Reads the layout on the host (``.tolist()``).
    Returns what ``thd_hp2cp`` returns: this rank's shard ``[T/W, ..., W*sum(sections)]``.
    """
    world = group.size()
    cup = cu_seqlens_padded.tolist()
    offsets = [sum(sections[:b]) for b in range(len(sections))]
    seqs = []
    for i in range(len(cup) - 1):
        c = (cup[i + 1] - cup[i]) // (2 * world)
        if c == 0:
            continue
        chunks = y_hp[cup[i] : cup[i + 1]].unflatten(0, (2 * world, c))  # [2W, c, ..., F/W]
        parts = []
        for off, local in zip(offsets, sections):
            if local == 0:  # nothing to exchange for an empty section
                parts.append(y_hp.new_empty((2 * c,) + tuple(y_hp.shape[1:-1]) + (0,)))
                continue
            cols = chunks[..., off : off + local]
            send = torch.stack([torch.cat([cols[d], cols[2 * world - 1 - d]]) for d in range(world)])
            recv = torch.empty_like(send)  # [W, 2c, ..., local]: recv[s] = rank s's slice of my rows
            dist.all_to_all_single(recv, send, group=group)
            parts.append(recv.movedim(0, -2).flatten(-2))  # [2c, ..., W*local], rank 0's slice first
        seqs.append(torch.cat(parts, dim=-1))
    if not seqs:
        return y_hp.new_empty((y_hp.shape[0] // world,) + tuple(y_hp.shape[1:-1]) + (y_hp.shape[-1] * world,))
    return torch.cat(seqs)


def fla_cp_layer_step(layer, cu_seqlens: torch.Tensor, group=None):
    """``step(x) -> y``: ``layer`` (a ``cp_ops.GatedDeltaNet``, its weights and its projections,
    gates and gated norm) with the conv and the delta rule of FLA's own CP (fla-core's
    ``fla.ops.cp``, eager, CUDA only): rank r of ``group`` holds rows ``[r T/W, (r+1) T/W)`` of
    the packed stream ``cu_seqlens`` in sequence order (FLA's contiguous layout; ``T % W == 0``),
    a sequence cut between ranks gets its conv halo and its incoming state from the ranks before.
    ``group`` None: FLA's kernels on one GPU, the whole stream. FLA builds its context on the host
    (``cu_seqlens`` read once, here); l2norm of q and k in FLA's kernel."""
    from fla.modules.causal_conv1d.ops import causal_conv1d
    from fla.ops.cp import build_cp_context
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    context = None if group is None else build_cp_context(cu_seqlens, group, conv1d_kernel_size=layer.conv_kernel_size)
    cu = cu_seqlens.long() if context is None else context.cu_seqlens  # FLA's varlen indices are int64
    hk, width = layer.num_k_heads, layer.num_k_heads * layer.head_k_dim
    weight = layer._conv_weight(0, hk)

    def step(x: torch.Tensor) -> torch.Tensor:
        qkvba, z = layer._project(x)
        mixed, _ = causal_conv1d(qkvba[None, :, : layer.conv_dim], weight, None, activation="silu", cu_seqlens=cu,
                                 cp_context=context)  # fmt: skip
        q, k, v = mixed[0].split([width, width, layer.value_dim], dim=-1)
        q, k, v, g, beta = layer._delta_rule_inputs(q, k, v, qkvba[:, layer.conv_dim :], 0, hk)
        o, _ = chunk_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None], cu_seqlens=cu,
                                      cp_context=context, use_qk_l2norm_in_kernel=True)  # fmt: skip
        return layer._project_out(o[0].reshape(x.shape[0], layer.value_dim), z)

    return step
