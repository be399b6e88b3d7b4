"""The gated delta rule of one rank's rows of the dual-chunk layout, with the recurrence's state
passed between ranks as per-chunk affine maps (docs/design.md section 4.3, "GatedDeltaNet by
chunk states"): :func:`state_maps`, and :func:`chunk_gated_delta_rule_dual_chunks`, the core of
``cp_ops.StatePassing``.

The forward runs one map pass per chunk (values ``[v | 0]`` from ``[0 | I]``), all-gathers the
maps, composes each sequence's incoming states and corrects the rows by one segment matmul. The
backward does not differentiate that pass: it all-gathers each chunk's state gradient from its
own rows with its map, composes them backwards into each own chunk's final-state gradient, and
runs one backward of the delta rule at width ``dv`` from the composed incoming states.
"""

from __future__ import annotations

import torch

from custom_ops.gated_delta_rule import backends
from custom_ops.gated_delta_rule.op import MAX_HEAD_DIM, chunk_gated_delta_rule_with_state
from custom_ops.gated_delta_rule.reference import state_dtype
from custom_ops.grouped_matmul.op import segment_matmul
from custom_ops.runtime.collectives import all_gather_rows
from custom_ops.runtime.groups import group_rank, resolve_group

__all__ = ["chunk_gated_delta_rule_dual_chunks", "state_maps"]


def _map_calls(q: torch.Tensor, v: torch.Tensor, num_seqs: int) -> list[tuple[torch.Tensor, torch.Tensor, str]]:
    """``(values, initial_state, backend)`` of the map pass's calls: ``[v | 0]`` from ``[0 | I]`` in
    one, or ``v`` from zeros and ``0`` from ``I`` in two, where ``dv + dk`` exceeds the kernels' head
    dim or both calls take FlashQLA (whose kernels take ``dv = 128`` only; the backward then runs
    its kernels too, from the first call's saved tensors)."""
    (num_rows, hv, dv), dk = v.shape, q.shape[-1]
    zeros = v.new_zeros(num_rows, hv, dk)
    identity = torch.eye(dk, dtype=state_dtype(q), device=q.device).expand(num_seqs, hv, dk, dk)
    start_zero, split = identity.new_zeros(num_seqs, hv, dk, dv), (backends.resolve(q, v), backends.resolve(q, zeros))
    if dv + dk > MAX_HEAD_DIM or split == ("flashqla", "flashqla"):
        return [(v, start_zero, split[0]), (zeros, identity.contiguous(), split[1])]
    values = torch.cat([v, zeros], -1)
    return [(values, torch.cat([start_zero, identity], -1), backends.resolve(q, values))]


def state_maps(q, k, v, g, beta, cu_seqlens, scale=None) -> torch.Tensor:
    """Each sequence's state map ``S_out = M S_in + S``, as ``[B, Hv, dk, dv + dk]`` = ``[S | M]``
    (:func:`custom_ops.state_dtype`): S runs the sequence from a zero state, M (``dk x dk``, the
    product of its rows' ``exp(g) (I - beta k k^T)``) from the identity with v = 0. Arguments as
    :func:`custom_ops.chunk_gated_delta_rule`; differentiable."""
    calls = _map_calls(q, v, cu_seqlens.shape[0] - 1)
    finals = [chunk_gated_delta_rule_with_state(q, k, u, g, beta, cu_seqlens, scale, h)[1] for u, h, _ in calls]
    return torch.cat(finals, -1)


def _compose(per_chunk: torch.Tensor, dv: int, world: int, rank: int, backward: bool) -> torch.Tensor:
    """Each of this rank's chunks' ``[B, Hv, dk, dv]`` state, stacked ``[2B, ...]`` (chunk ``r``,
    then ``2W-1-r``, of each sequence) from every chunk's ``[X | M]`` (``per_chunk [W, B, 2, Hv,
    dk, dv + dk]``, as gathered). Forward (X = S): the incoming states, ``H_0 = 0``, ``H_{c+1} =
    M_c H_c + S_c``. Backward (X = the state gradient from chunk c's own rows): the final states'
    gradients, ``G_{2W} = 0``, ``G_c = X_c + M_c^T G_{c+1}``, chunk c's being ``G_{c+1}``."""
    state = per_chunk.new_zeros(per_chunk.shape[1], *per_chunk.shape[3:-1], dv)
    own, found = (rank, 2 * world - 1 - rank), {}
    order = range(2 * world - 1, -1, -1) if backward else range(2 * world)
    for c in order:
        if c in own:
            found[c] = state
        m = per_chunk[min(c, 2 * world - 1 - c), :, int(c >= world)]
        transition = m[..., dv:].transpose(-1, -2) if backward else m[..., dv:]
        state = torch.matmul(transition, state) + m[..., :dv]
    return torch.stack([found[own[0]], found[own[1]]], 1).flatten(0, 1)


def _gathered(x: torch.Tensor, group_name: str | None, world: int) -> torch.Tensor:
    """``x [2B, ...]`` of every rank, ``[W, B, 2, ...]`` (rank-major, as :func:`all_gather_rows`)."""
    gathered = all_gather_rows(x, group_name) if world > 1 else x
    return gathered.view(world, -1, 2, *x.shape[1:])


def _halves(parts: list[torch.Tensor], dv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Columns ``[:dv]`` and ``[dv:]`` of the map pass's outputs, from its two calls or its one (the
    second half a copy, so that saving it does not keep the first alive)."""
    return tuple(parts) if len(parts) == 2 else (parts[0][..., :dv], parts[0][..., dv:].contiguous())


class _DualChunks(torch.autograd.Function):
    """:func:`chunk_gated_delta_rule_dual_chunks`: the forward and backward of the module docstring."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, local_cu, group_name, world, rank, scale):
        num_seqs, dv = local_cu.shape[0] - 1, v.shape[-1]
        runs = []
        for values, start, backend in _map_calls(q, v, num_seqs):
            runs.append((backend, torch.ops.cp_ops.chunk_gated_delta_rule_forward(
                q, k, values, g, beta, local_cu, scale, start, True, backend
            )))  # fmt: skip
        ctx.backend, (_, _, g_cum, A, fla_cu, chunk_indices) = runs[0]  # the backward's: the first call's
        # [o^0 | scale P_t^T q_t] [T/W, Hv, dv+dk] and [S | M] [2B, Hv, dk, dv+dk], by columns
        outs, finals = ([out[i] for _, out in runs] for i in (0, 1))
        o_zero, q_map = _halves(outs, dv)
        maps = torch.cat(finals, -1) if len(finals) > 1 else finals[0]
        incoming = _compose(_gathered(maps, group_name, world), dv, world, rank, backward=False)
        ctx.scale, ctx.group_name, ctx.world, ctx.rank = scale, group_name, world, rank
        transitions = _halves(finals, dv)[1]
        ctx.save_for_backward(q, k, v, g, beta, local_cu, fla_cu, chunk_indices, g_cum, A, q_map, transitions, incoming)
        # each row from its chunk's incoming state: o = o^0 + H^T (scale P_t^T q_t), no second pass
        return o_zero + segment_matmul(q_map, incoming, local_cu)

    @staticmethod
    def backward(ctx, grad_o):
        q, k, v, g, beta, local_cu, fla_cu, chunk_indices, g_cum, A, q_map, transitions, incoming = ctx.saved_tensors
        dv = v.shape[-1]
        # the state gradient from a chunk's own rows: sum over them of (scale P_t^T q_t) do_t^T
        own = torch.ops.cp_ops.segment_matmul_weight_grad(q_map, grad_o, local_cu).to(transitions.dtype)
        gathered = _gathered(torch.cat([own, transitions], -1), ctx.group_name, ctx.world)
        final_grad = _compose(gathered, dv, ctx.world, ctx.rank, backward=True)
        dq, dk, dv_, dg, dbeta, _ = torch.ops.cp_ops.chunk_gated_delta_rule_backward(
            grad_o, q, k, v, g, beta, local_cu, fla_cu, chunk_indices, g_cum, A, ctx.scale, incoming, final_grad,
            ctx.backend,
        )  # fmt: skip
        return dq, dk, dv_, dg, dbeta, None, None, None, None, None


def chunk_gated_delta_rule_dual_chunks(q, k, v, g, beta, local_cu, group=None, scale=None) -> torch.Tensor:
    """:func:`custom_ops.chunk_gated_delta_rule` of this rank's rows ``[T/W, ...]`` in the
    dual-chunk layout, whose chunks ``local_cu [2B+1]`` bounds (chunk ``r``, then ``2W-1-r``, of
    each sequence), across the ranks of ``group``: o ``[T/W, Hv, dv]``, equal to the sequence-order
    result's rows of this rank. Differentiable in q, k, v, g, beta (docs/design.md section 4.3)."""
    name, world = resolve_group(group)
    return _DualChunks.apply(q, k, v, g, beta, local_cu, name, world, group_rank(group), scale)
