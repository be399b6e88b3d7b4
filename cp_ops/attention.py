"""All-gather context-parallel attention on packed THD shards, and a gated attention layer.

On rank r of a CP group of W ranks, the local shard holds, for every sequence i,
chunks ``r`` and ``2W-1-r`` (``c_i = P_i / 2W`` rows each) of its padded length
``P_i`` (docs/design.md section 1). :func:`ag_thd_attention` computes, for those local
query rows, exactly what attention over the whole sequence computes:

1. all-gather K and V in one collective (``[T/W, 2*Hkv, D]`` -> ``[T, 2*Hkv, D]``,
   rank order; its gradient is one reduce-scatter),
2. ``thd_rank_to_seq_order``: rank order -> sequence order (gradient: the inverse),
3. one ``varlen_attention`` launch with two segments per sequence. For chunk
   ``j`` in ``(r, 2W-1-r)`` of sequence i (``L_i`` real tokens)::

       q_start = cup[i] / W  (+ c_i for the second chunk)   local rows
       q_len   = clamp(L_i - j*c_i, 0, c_i)                  real tokens of the chunk
       q_pos   = j*c_i                                       position of its first row
       k_start = cup[i]                                      sequence order, gathered
       k_len   = min(L_i, (j+1)*c_i + max(right, 0))         causal: keys past the chunk are masked anyway
               = L_i                                         non-causal

   so query a of the chunk (position ``j*c_i + a``) sees key b of its sequence
   under the usual causal / window rules, and padding rows (in no segment)
   come back as zeros.

The segment tables are built on the device from ``cu_seqlens`` and
``cu_seqlens_padded`` with vectorised torch ops and the rank as a Python int: no
host sync, so the whole forward and backward compile with ``fullgraph=True`` and
one graph serves every packing. The backward is autograd through the pieces:
``varlen_attention``'s backward (dq on the local rows; dk, dv on the gathered
sequence-order keys), ``thd_seq_to_rank_order``, then the reduce-scatter.

The op is a composite: it decomposes into those pieces when traced, which happens
after torch.compile's caches have keyed the graph on the op's arguments. So nothing
the decomposition reads may differ between processes that share a cache: the rank
is read at run time (``group_rank_tensor``, a 0-d device tensor), never folded into
the graph. The CP size W sets shapes and must be known when tracing. The group name
does not encode it (the default group is called "0" whatever its size), so W is an
argument of the op (``cp_size``, checked against the group) and so part of the key.

``launches=2`` runs TransformerEngine's form instead: one ``varlen_attention``
launch per local chunk (segments of chunk r, then of chunk 2W-1-r), the second
chunk's rows copied into the first output with ``thd_copy_valid_tokens``. Same
result; kept so the two can be timed against each other.

``head_groups=G`` pipelines the exchange: steps 1-3 run per group of Hkv/G KV heads
(and their Hq/G query heads), G all-gathers in all, so the attention of group g needs
only the g-th gather and runs while the later ones travel; in the backward (groups in
reverse order) a group's reduce-scatter runs while the next group's gradients are
computed. Only the first gather and the last reduce-scatter have no attention beside
them, 1/G of the bytes each. Under torch.compile this needs ``cp_ops.COMPILE_OPTIONS``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

import custom_ops
from cp_ops.comm import all_gather_rows, group_rank, group_size, resolve_group
from cp_ops.inputs import check_hidden_states, check_layout_tensors
from cp_ops.layout import local_positions
from custom_ops._common import NAMESPACE, check_index_tensor
from custom_ops.validation import checked
from custom_ops.varlen_attention.op import check_gqa_heads

__all__ = [
    "ag_thd_attention",
    "ag_thd_attention_reference",
    "ag_thd_segments",     "group_rank_tensor",
    "Attention",
    "RMSNorm",
    "apply_rotary",
]


# --- segment tables -------------------------------------------------------------------------------


def _chunk_segments(cu_seqlens, cu_seqlens_padded, cp_size: int, chunk, second: bool, causal: bool, right):
    """The five ``[B]`` segment columns of chunk ``chunk`` (an int or a 0-d tensor), the first
    or second local chunk."""
    cu = cu_seqlens.to(torch.int64)
    cup = cu_seqlens_padded.to(torch.int64)
    lens = cu[1:] - cu[:-1]
    start = cup[:-1]
    c = (cup[1:] - start) // (2 * cp_size)
    first_row = torch.div(start, cp_size, rounding_mode="floor")
    q_start = first_row + c if second else first_row
    q_len = torch.minimum((lens - chunk * c).clamp(min=0), c)
    q_pos = chunk * c
    if causal:
        # a query in chunk j sits at a position < (j+1)*c, so later keys are masked by causality
        # (and right is irrelevant under causality, kept to follow the formula in docs/design.md section 4)
        k_len = torch.minimum(lens, (chunk + 1) * c + max(right, 0))
    else:
        k_len = lens
    return q_start, q_len, q_pos, start, k_len


def ag_thd_segments(
    cu_seqlens: torch.Tensor,
    cu_seqlens_padded: torch.Tensor,
    cp_size: int,
    rank: int | torch.Tensor,
    causal: bool = True,
    window_right: int = -1,
    chunks: tuple[int, ...] = (0, 1),
) -> tuple[torch.Tensor, ...]:
    """``(q_start, q_len, q_pos, k_start, k_len)`` (int32) of rank ``rank``'s local chunks.

    Query rows index the local shard ``[T/W, ...]``; key rows the gathered,
    sequence-order ``[T, ...]``. ``chunks=(0, 1)`` gives both local chunks of every
    sequence (``[2B]`` each, interleaved: sequence 0 chunk r, sequence 0 chunk
    2W-1-r, sequence 1 ...); ``(0,)`` or ``(1,)`` only the first or second (``[B]``).
    Formulas in the module docstring. Built on the device, no host sync; ``rank`` may be
    an int or a 0-d integer tensor on the device.
    """
    ids = (rank, 2 * cp_size - 1 - rank)
    cols = [
        _chunk_segments(cu_seqlens, cu_seqlens_padded, cp_size, ids[h], h == 1, causal, window_right) for h in chunks
    ]
    return tuple(torch.stack(parts, dim=1).flatten().to(torch.int32) for parts in zip(*cols))


# --- the op ---------------------------------------------------------------------------------------


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
@torch.library.custom_op(f"{NAMESPACE}::group_rank_tensor", mutates_args=())
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
                      cp_size=1, launches=1, head_groups=1):  # fmt: skip
    """The decomposition: per head group one collective, one reorder and one (or two)
    segment-attention launches; the groups' outputs concatenated over heads."""
    _check(q, k, v, cu_seqlens, cu_seqlens_padded, launches, head_groups)
    cu_seqlens = checked("thd", cu_seqlens, (cu_seqlens_padded,), cp_size, q.shape[0] * cp_size)
    window = (window_left, window_right)
    if group_name is None:
        if cp_size != 1:
            raise ValueError(f"cp_size = {cp_size} needs a process group (group_name is None)")
        world, rank = 1, 0
    else:
        world, rank = group_size(group_name), group_rank_tensor(cu_seqlens_padded, group_name)
        if world != cp_size:
            raise ValueError(f"cp_size = {cp_size} but the process group {group_name!r} has {world} ranks")
    if launches == 1:
        segs = [ag_thd_segments(cu_seqlens, cu_seqlens_padded, world, rank, causal, window_right)]
    else:
        segs = [ag_thd_segments(cu_seqlens, cu_seqlens_padded, world, rank, causal, window_right, chunks=(h,))
                for h in (0, 1)]  # fmt: skip
        # rows [q_start, q_start + q_len) of the second chunks come from the second launch;
        # copy_valid_tokens wants them as (offsets [B], cumulative lengths [B+1])
        counts = torch.cat([segs[1][1].new_zeros(1), torch.cumsum(segs[1][1], 0, dtype=torch.int32)])

    def attend(q_, k_seq, v_seq):
        outs = [custom_ops.varlen_attention(q_, k_seq, v_seq, *s, causal=causal, window=window, scale=scale)[0]
                for s in segs]  # fmt: skip
        if launches == 1:
            return outs[0]
        return custom_ops.thd_copy_valid_tokens(outs[0], outs[1], segs[1][0], counts)

    if group_name is None:
        return attend(q, k, v)  # W = 1: rank order is sequence order, nothing to gather
    hkv, hq = k.shape[1] // head_groups, q.shape[1] // head_groups
    outs = []
    for g in range(head_groups):
        kv_heads = slice(g * hkv, (g + 1) * hkv)
        # K and V travel together: one all-gather forward, one reduce-scatter backward per group;
        # a group's attention needs only its own gather, so it runs while the next group's travels
        kv = all_gather_rows(torch.cat([k[:, kv_heads], v[:, kv_heads]], dim=1), group_name)  # rank order
        kv = custom_ops.thd_rank_to_seq_order(kv, cu_seqlens_padded, world)
        outs.append(attend(q[:, g * hq : (g + 1) * hq], kv[:, :hkv], kv[:, hkv:]))
    return outs[0] if head_groups == 1 else torch.cat(outs, dim=1)


torch.library.define(
    f"{NAMESPACE}::ag_thd_attention",
    "(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens, Tensor cu_seqlens_padded, bool causal=True, "
    "SymInt window_left=-1, SymInt window_right=-1, float? scale=None, str? group_name=None, int cp_size=1, "
    "int head_groups=1) -> Tensor",
)


# CompositeImplicitAutograd: the op is its decomposition, so autograd, fake tensors and
# torch.compile see all_gather / thd_rank_to_seq_order / varlen_attention, each with its own
# fake and backward; nothing here needs a fake or an autograd formula of its own. cp_size is
# in the schema (checked against the group) so that a compiled graph's cache key holds it:
# group names repeat across runs of different sizes.
@torch.library.impl(f"{NAMESPACE}::ag_thd_attention", "CompositeImplicitAutograd")
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

    q ``[T/W, Hq, D]``, k, v ``[T/W, Hkv, D]`` (``Hq % Hkv == 0``, GQA): rank r's
    local rows (chunks r and 2W-1-r of every sequence). cu_seqlens, cu_seqlens_padded
    ``[B+1]``: the *global* layout (``T = cu_seqlens_padded[-1]``, padded lengths
    multiples of 2W). For local row t at position ``p`` of sequence i (one of its
    ``L_i`` real tokens), with ``s_b = scale * <q_t, k_b>`` over the keys b of
    sequence i (sequence positions ``0 .. L_i - 1``) that are visible::

        out_t = sum_b softmax_b(s_b) v_b
        visible: b <= p (causal), p - b <= left (left >= 0), b - p <= right (right >= 0)

    ``window = (left, right)``, -1 = unbounded; scale defaults to ``D ** -0.5``.
    Padding rows, and rows that see no key, come back as zeros. group: a
    ``ProcessGroup``, a 1-D ``DeviceMesh``, or None (W = 1: plain varlen attention
    over the packed batch, no collective). Differentiable in q, k, v: the
    gradients of k and v are this rank's shard of the global ones (reduce-scattered).
    ``launches=2``: one launch per local chunk (TransformerEngine's form), same result.
    ``head_groups=G`` (a divisor of Hkv): the KV heads in G groups, each gathered by its
    own all-gather and attended by its own launch(es), so each group's attention runs
    while later groups' K/V travel (and, backward, each group's reduce-scatter while
    the next group's gradients are computed); same result. Ignored when group is None.

    Also ``torch.ops.cp_ops.ag_thd_attention(q, k, v, cu_seqlens, cu_seqlens_padded,
    causal, window_left, window_right, scale, group_name, cp_size, head_groups)`` (the
    one-launch form).
    """
    group_name, world = resolve_group(group)
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise TypeError(f"window must be a pair (left, right) of ints, got {window!r}")
    if launches == 1:
        return torch.ops.cp_ops.ag_thd_attention(
            q, k, v, cu_seqlens, cu_seqlens_padded, causal, window[0], window[1], scale, group_name, world, head_groups
        )
    return _ag_thd_attention(
        q, k, v, cu_seqlens, cu_seqlens_padded, causal, window[0], window[1], scale, group_name, world, launches,
        head_groups,
    )


def ag_thd_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cu_seqlens_padded: torch.Tensor,
    *,
    causal: bool = True,
    window: tuple[int, int] = (-1, -1),
    scale: float | None = None,
) -> torch.Tensor:
    """The single-process oracle: every sequence's attention over itself, on the *global*
    sequence-order q ``[T, Hq, D]``, k, v ``[T, Hkv, D]``; returns ``[T, Hq, D]``.

    Rank r's :func:`ag_thd_attention` output is ``shard_thd(this, cu_seqlens_padded, W, r)``
    (and so are its gradients, dk and dv included). Segments ``q_start = k_start = cup[i]``,
    ``q_len = k_len = L_i``, ``q_pos = 0`` through the dense
    ``custom_ops.varlen_attention_reference``; padding rows are zero. Differentiable.
    """
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    starts = cu_seqlens_padded[:-1]
    return custom_ops.varlen_attention_reference(
        q, k, v, starts, lens, torch.zeros_like(lens), starts, lens, causal, window, scale
    )[0]


# --- the layer ------------------------------------------------------------------------------------


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


class Attention(nn.Module):
    """Gated softmax attention (Qwen3-Next's attention block) over packed THD sequences, with CP.

    Per token ``x [hidden]``, ``Hq = num_heads``, ``Hkv = num_kv_heads``, ``D = head_dim``::

        q, gate = q_proj(x)              gated: per head, D query features then D gate features
        k, v = k_proj(x), v_proj(x)      [Hkv, D] each
        q, k = q_norm(q), k_norm(k)      qk_norm: per-head zero-centred RMSNorm (RMSNorm above)
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
