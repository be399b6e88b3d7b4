"""All-gather context-parallel attention on packed THD shards (docs/design.md section 4.2).

:func:`ag_thd_attention` gives rank r's local query rows (chunks r and 2W-1-r of every
sequence) exactly what attention over the whole sequence gives: K and V all-gathered in one
collective, then one segment-attention launch with two segments per sequence
(:func:`custom_ops.ag_thd_segments`) over the gathered rows read in sequence order
(``varlen_attention`` with a key-row map). The backward is autograd through those pieces: the dk/dv kernel
writes the gradients in rank order, then a reduce-scatter. A composite op, so the rank is read at run time
(``group_rank_tensor``) and the CP size is an argument (docs/design.md section 3).
``launches=2`` and ``head_groups=G`` are the variants of section 4.2. On CUDA the attention may
run FlashAttention 4's kernels instead (:mod:`custom_ops.ag_attention.backends`, chosen when traced;
:mod:`custom_ops.ag_attention.fa4`): then the gathered K/V are put in sequence order first.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from custom_ops.ag_attention import backends
from custom_ops.ag_attention.fa4 import fa4_attention, fa4_tables
from custom_ops.ag_attention.segments import ag_thd_segments
from custom_ops.runtime.collectives import all_gather_rows
from custom_ops.runtime.groups import check_group_size, resolve_group
from custom_ops.runtime.registration import NAMESPACE, composite_op, opaque_op
from custom_ops.segment_attention.op import check_gqa_heads, varlen_attention, varlen_attention_kv, window_pair
from custom_ops.thd.checked_mode import call_checked
from custom_ops.thd.checks import check_index_tensor
from custom_ops.thd.index import rank_to_seq_index
from custom_ops.thd.validation import checked
from custom_ops.valid_tokens.op import thd_copy_valid_tokens

__all__ = ["ag_thd_attention", "group_rank_tensor"]


def _check(q, k, v, cu_seqlens, cu_seqlens_padded, launches, head_groups) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(f"{name} must be a local shard [T/W, heads, head_dim], got shape {tuple(t.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"q has {q.shape[0]} rows but k and v have {k.shape[0]}; all are the same local shard")
    check_index_tensor("cu_seqlens", cu_seqlens, q.device)
    check_index_tensor("cu_seqlens_padded", cu_seqlens_padded, q.device)
    if cu_seqlens.shape[0] != cu_seqlens_padded.shape[0]:
        raise ValueError(
            f"cu_seqlens has {cu_seqlens.shape[0]} entries and cu_seqlens_padded {cu_seqlens_padded.shape[0]}; "
            "both are [B+1]"
        )
    if launches not in (1, 2):
        raise ValueError(f"launches must be 1 or 2, got {launches!r}")
    check_gqa_heads(q, k)  # here too: head groups split the query heads by the kv heads
    if not isinstance(head_groups, int) or head_groups < 1 or k.shape[1] % head_groups:
        raise ValueError(f"head_groups must be a positive divisor of Hkv = {k.shape[1]}, got {head_groups!r}")


# The rank is read at run time, by an opaque op, not baked into the traced graph. The composite
# op below decomposes during AOT tracing, after the compile caches have keyed the graph on its
# arguments (which name the group, identical on every rank); a rank folded in as a constant
# would let one rank load another rank's cached graph and attend with its segment tables.
@opaque_op(f"{NAMESPACE}::group_rank_tensor", mutates_args=())
def group_rank_tensor(like: torch.Tensor, group_name: str) -> torch.Tensor:
    """This process's rank in the group ``group_name``: a 0-d int64 tensor on ``like``'s device.

    ``like`` only places the result (and, as an input, keeps compilers from folding the op).
    """
    rank = dist.distributed_c10d._resolve_process_group(group_name).rank()
    return torch.full((), rank, dtype=torch.int64, device=like.device)


@group_rank_tensor.register_fake
def _(like, group_name):
    return like.new_empty((), dtype=torch.int64)


def _ag_thd_attention(q, k, v, cu_seqlens, cu_seqlens_padded, causal, window_left, window_right, scale, group_name,
                      cp_size=1, launches=1, head_groups=1, backend=None):  # fmt: skip
    """The decomposition: per head group one collective, one reorder and one (or two)
    segment-attention launches (or FlashAttention 4's calls); the groups' outputs concatenated
    over heads. ``backend``: ``segment`` or ``fa4``; None resolves it (:func:`backends.resolve`)."""
    _check(q, k, v, cu_seqlens, cu_seqlens_padded, launches, head_groups)
    cu_seqlens = checked("thd_shard", cu_seqlens, (cu_seqlens_padded,), cp_size, q.shape[0])
    window = (window_left, window_right)
    if backend is None:
        backend = backends.resolve(q, k, causal, window)
    if group_name is None:
        if cp_size != 1:
            raise ValueError(f"cp_size = {cp_size} needs a process group (group_name is None)")
        world, rank = 1, 0
    else:
        world, rank = check_group_size(group_name, cp_size), group_rank_tensor(cu_seqlens_padded, group_name)
    if backend == "fa4":
        return _fa4_ag_attention(q, k, v, cu_seqlens, cu_seqlens_padded, causal, window_left, scale, group_name,
                                 world, rank, head_groups)  # fmt: skip
    counts = None  # bound on both paths: Dynamo, tracing this function, reads the closure's cells
    if launches == 1:
        segs = [ag_thd_segments(cu_seqlens, cu_seqlens_padded, world, rank, causal, window_right)]
    else:
        segs = [ag_thd_segments(cu_seqlens, cu_seqlens_padded, world, rank, causal, window_right, chunks=(h,))
                for h in (0, 1)]  # fmt: skip
        # rows [q_start, q_start + q_len) of the second chunks come from the second launch;
        # copy_valid_tokens wants them as (offsets [B], cumulative lengths [B+1])
        counts = torch.cat([segs[1][1].new_zeros(1), torch.cumsum(segs[1][1], 0, dtype=torch.int32)])

    def merged(outs):
        return outs[0] if launches == 1 else thd_copy_valid_tokens(outs[0], outs[1], segs[1][0], counts)

    if group_name is None:  # W = 1: rank order is sequence order, nothing to gather
        return merged([varlen_attention(q, k, v, *s, causal=causal, window=window, scale=scale)[0] for s in segs])
    # the rank-order row of every sequence-order key row: the attention reads the gathered K/V
    # through it, and its dk/dv kernel writes the gradients back through it, in rank order
    key_rows = rank_to_seq_index(cu_seqlens_padded, world, q.shape[0] * world)

    def attend(q_g, kv):
        return merged([varlen_attention_kv(q_g, kv, key_rows, *s, causal=causal, window=window, scale=scale)[0]
                       for s in segs])  # fmt: skip

    return _per_head_group(q, k, v, head_groups, group_name, attend)


def _per_head_group(q, k, v, head_groups, group_name, attend):
    """``attend(q_g, kv_g)`` for each of ``head_groups`` groups of kv heads and their query heads,
    kv_g ``[W*T, 2*Hkv/G, D]`` the group's K and V all-gathered in rank order; the groups' outputs
    concatenated over heads."""
    hkv, hq = k.shape[1] // head_groups, q.shape[1] // head_groups
    outs = []
    for g in range(head_groups):
        kv_heads = slice(g * hkv, (g + 1) * hkv)
        # K and V travel together: one all-gather forward, one reduce-scatter backward per group;
        # a group's attention needs only its own gather, so it runs while the next group's travels
        kv = all_gather_rows(torch.cat([k[:, kv_heads], v[:, kv_heads]], dim=1), group_name)
        outs.append(attend(q[:, g * hq : (g + 1) * hq], kv))
    return outs[0] if head_groups == 1 else torch.cat(outs, dim=1)


def _fa4_ag_attention(q, k, v, cu_seqlens, cu_seqlens_padded, causal, window_left, scale, group_name, world, rank,
                      head_groups):  # fmt: skip
    """The FlashAttention 4 form of the decomposition: per head group the same collective, its K/V
    put in sequence order (an index_select, whose backward scatters dk/dv back to rank order before
    the reduce-scatter), then the calls of :func:`fa4_tables`."""
    tables = fa4_tables(cu_seqlens, cu_seqlens_padded, world, rank, causal)
    if group_name is None:  # W = 1: rank order is sequence order
        return fa4_attention(q, k, v, tables, causal, window_left, scale)
    key_rows = rank_to_seq_index(cu_seqlens_padded, world, q.shape[0] * world)

    def attend(q_g, kv):
        kv, hkv = kv.index_select(0, key_rows), kv.shape[1] // 2
        return fa4_attention(q_g, kv[:, :hkv], kv[:, hkv:], tables, causal, window_left, scale)

    return _per_head_group(q, k, v, head_groups, group_name, attend)


# CompositeImplicitAutograd: the op is its decomposition, so autograd, fake tensors and
# torch.compile see all_gather / varlen_attention (with a key-row map or without), each with its
# own fake and backward; nothing here needs a fake or an autograd formula of its own. cp_size is
# in the schema (checked against the group) so that a compiled graph's cache key holds it:
# group names repeat across runs of different sizes.
@composite_op(
    f"{NAMESPACE}::ag_thd_attention",
    "(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens, Tensor cu_seqlens_padded, bool causal=True, "
    "SymInt window_left=-1, SymInt window_right=-1, float? scale=None, str? group_name=None, int cp_size=1, "
    "int head_groups=1) -> Tensor",
)
def _ag_thd_attention_composite(q, k, v, cu_seqlens, cu_seqlens_padded, causal=True, window_left=-1, window_right=-1,
                                scale=None, group_name=None, cp_size=1, head_groups=1):  # fmt: skip
    return _ag_thd_attention(
        q, k, v, cu_seqlens, cu_seqlens_padded, causal, window_left, window_right, scale, group_name, cp_size,
        head_groups=head_groups,
    )


def ag_thd_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cu_seqlens_padded: torch.Tensor,
    *,
    causal: bool = True,
    window: tuple[int, int] = (-1, -1),
    scale: float | None = None,
    group=None,
    launches: int = 1,
    head_groups: int = 1,
) -> torch.Tensor:
    """All-gather CP attention on this rank's THD shard: ``out [T/W, Hq, D]``.

    q ``[T/W, Hq, D]``, k, v ``[T/W, Hkv, D]`` (``Hq % Hkv == 0``): rank r's local rows
    (chunks r and 2W-1-r of every sequence). cu_seqlens, cu_seqlens_padded ``[B+1]``: the
    global layout (padded lengths multiples of 2W). Each local row gets the attention over
    the visible keys of its whole sequence: causal, ``window = (left, right)`` (-1 =
    unbounded), scale defaults to ``D ** -0.5``; padding rows and rows that see no key give
    zeros. group: a ``ProcessGroup``, a 1-D ``DeviceMesh``, or None (W = 1). Differentiable
    in q, k, v (dk, dv: this rank's shard, reduce-scattered). ``launches=2`` and
    ``head_groups=G`` (a divisor of Hkv) change the schedule, not the result (docs/design.md
    section 4.2). Also ``torch.ops.cp_ops.ag_thd_attention`` (section 2, "Contracts").
    """
    group_name, world = resolve_group(group)
    left, right = window_pair(window)
    if launches == 1:
        return call_checked(
            torch.ops.cp_ops.ag_thd_attention,
            q, k, v, cu_seqlens, cu_seqlens_padded, causal, left, right, scale, group_name, world, head_groups,
        )  # fmt: skip
    return call_checked(
        _ag_thd_attention,
        q, k, v, cu_seqlens, cu_seqlens_padded, causal, left, right, scale, group_name, world, launches, head_groups,
    )  # fmt: skip
