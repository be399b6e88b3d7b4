"""Process-group handling, functional-collective shims and the fused CP <-> head-parallel all-to-all.

Groups cross op boundaries as a group name string (traceable, hashable); the
Python entry points take a ``ProcessGroup``, a 1-D ``DeviceMesh`` or ``None``
(no context parallelism) and resolve it with :func:`resolve_group`.

CP -> head parallel (``thd_cp2hp``), on rank r of a CP group of size W:
the local shard ``x_cp [T/W, ..., F]`` (rows of every sequence's chunks r and
2W-1-r) becomes ``x_hp [T, ..., F/W]``: every row of the batch, in sequence
order, with rank r's slice of every feature section. In three passes:

1. send ``[W, T/W, ..., F/W]``: block d holds rank d's slice of every section of
   the local rows (the section permutation, written straight into the rank-major
   send layout by one kernel; no separate transpose).
2. one all-to-all of equal splits: block d goes to rank d; what arrives is
   ``[T, ..., F/W]`` in rank order (rank 0's rows first).
3. rank order -> sequence order (``thd_rank_to_seq_order``), index map on the device.

``thd_hp2cp`` runs the same passes backwards, and each is the other's gradient.
All sequences and sections travel in the one all-to-all; nothing reads tensor
values on the host, so one compiled graph serves every packing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import custom_ops
from custom_ops._common import NAMESPACE, check_index_tensor, kernel_op
from custom_ops.permute_sections.op import check_sections, rank_blocks_to_sections, sections_to_rank_blocks
from custom_ops.permute_sections.reference import permute_sections_reference, unpermute_sections_reference

__all__ = [
    "resolve_group",
    "group_size",
    "all_gather_rows",
    "reduce_scatter_rows",
    "all_to_all_rows",
    "thd_cp2hp",
    "thd_cp2hp_overlap",
    "thd_cp2hp_blocks",
    "thd_hp2cp_blocks",
    "COMPILE_OPTIONS",
    "thd_hp2cp",
    "thd_cp2hp_reference",
    "thd_hp2cp_reference",
]

T = TypeVar("T")

# --- shims over names that moved between torch releases ----------------------------------------

# Newer releases call the autograd-aware gather / reduce-scatter *_single_autograd and keep the
# *_tensor_autograd names as deprecated aliases; older ones only have the latter.
_all_gather_autograd = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
_reduce_scatter_autograd = (
    getattr(funcol, "reduce_scatter_single_autograd", None) or funcol.reduce_scatter_tensor_autograd
)


def group_size(group_name: str) -> int:
    """The number of ranks in the process group registered under ``group_name``."""
    by_name = getattr(dist.distributed_c10d, "_get_group_size_by_name", None)
    if by_name is not None:
        return by_name(group_name)
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name).size()


def _group_name(pg: dist.ProcessGroup) -> str:
    name = getattr(pg, "group_name", None)
    return name if name is not None else dist.distributed_c10d._get_process_group_name(pg)


def resolve_group(group) -> tuple[str | None, int]:
    """``(group_name, world_size)`` for a ``ProcessGroup``, a 1-D ``DeviceMesh`` or ``None``.

    ``None`` means no context parallelism: ``(None, 1)``.
    """
    if group is None:
        return None, 1
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(
                f"group: a DeviceMesh must be 1-D (the CP dimension), got {group.ndim}-D; pass mesh['cp'] or similar"
            )
        group = group.get_group()
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a ProcessGroup, a 1-D DeviceMesh or None, got {type(group).__name__}")
    return _group_name(group), group.size()


def group_rank(group) -> int:
    """This process's rank in a ``ProcessGroup`` or 1-D ``DeviceMesh`` (0 for ``None``).

    ``ProcessGroup.rank()`` is a constant to dynamo, so this costs nothing under compile.
    """
    if group is None:
        return 0
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(group, DeviceMesh):
        group = group.get_group()
    return group.rank()


def all_gather_rows(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """``[R, ...]`` on each of W ranks -> ``[W*R, ...]``, rank 0's rows first (rank order).

    Differentiable: the gradient is the reduce-scatter (sum) of the output gradient.
    In eager mode the result may be an ``AsyncCollectiveTensor`` that waits on first use.
    """
    return _all_gather_autograd(x.contiguous(), 0, group_name)


def reduce_scatter_rows(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """``[W*R, ...]`` on each of W ranks -> ``[R, ...]``: rank r gets the sum over ranks of rows
    ``[r*R, (r+1)*R)``. Differentiable: the gradient is the all-gather of the output gradient."""
    return _reduce_scatter_autograd(x.contiguous(), "sum", 0, group_name)


def _start_all_to_all(x: torch.Tensor, group_name: str, world: int) -> torch.Tensor:
    """Issue the all-to-all of :func:`all_to_all_rows` and return its output still in flight:
    read it only after ``torch.ops._c10d_functional.wait_tensor``."""
    rows = x.shape[0] // world
    splits = [rows] * world
    return torch.ops._c10d_functional.all_to_all_single(x.contiguous(), splits, splits, group_name)


def all_to_all_rows(x: torch.Tensor, group_name: str, world: int) -> torch.Tensor:
    """``[W*R, ...]`` -> ``[W*R, ...]``: rows ``[d*R, (d+1)*R)`` go to rank d; the result holds
    rank s's block for this rank at rows ``[s*R, (s+1)*R)``. Not differentiable by itself;
    meant for op bodies, which own their autograd. Blocks until the data has arrived
    (on CUDA: until the exchange is ordered on the current stream)."""
    return torch.ops._c10d_functional.wait_tensor(_start_all_to_all(x, group_name, world))


class _ExchangeStart(torch.autograd.Function):
    """The first half of a differentiable :func:`all_to_all_rows`: issues the exchange and
    returns its output in flight. Its backward waits for the gradient's exchange, which
    :class:`_ExchangeWait`'s backward issued, so in the backward pass too the work recorded
    between the two halves (whatever autograd runs between their nodes) can overlap it."""

    @staticmethod
    def forward(ctx, send, group_name, world):
        ctx.group_name, ctx.world = group_name, world
        return _start_all_to_all(send, group_name, world)

    @staticmethod
    def backward(ctx, grad):
        return torch.ops._c10d_functional.wait_tensor(grad), None, None


class _ExchangeWait(torch.autograd.Function):
    """The second half: waits for the exchange :class:`_ExchangeStart` issued; its backward
    issues the exchange of the gradient (an all-to-all of equal blocks is its own adjoint)."""

    @staticmethod
    def forward(ctx, recv, group_name, world):
        ctx.group_name, ctx.world = group_name, world
        return torch.ops._c10d_functional.wait_tensor(recv)

    @staticmethod
    def backward(ctx, grad):
        return _start_all_to_all(grad, ctx.group_name, ctx.world), None, None


# --- the ops --------------------------------------------------------------------------------------


def _check_cp2hp(x_cp: torch.Tensor, cu_seqlens_padded: torch.Tensor, sections, world: int) -> None:
    if not isinstance(x_cp, torch.Tensor):
        raise TypeError(f"x_cp must be a torch.Tensor, got {type(x_cp).__name__}")
    if x_cp.dim() < 2:
        raise ValueError(f"x_cp must be [T/W, ..., F] (rows, then features last), got shape {tuple(x_cp.shape)}")
    check_index_tensor("cu_seqlens_padded", cu_seqlens_padded, x_cp.device)
    if x_cp.shape[0] % 2:
        raise ValueError(
            f"x_cp has {x_cp.shape[0]} rows; a local shard has T/W rows, two chunks per sequence, "
            "so an even number"
        )
    check_sections("x_cp", x_cp.shape[-1], sections, world, world="the CP group size")


def _check_hp2cp(y_hp: torch.Tensor, cu_seqlens_padded: torch.Tensor, sections, world: int) -> None:
    if not isinstance(y_hp, torch.Tensor):
        raise TypeError(f"y_hp must be a torch.Tensor, got {type(y_hp).__name__}")
    if y_hp.dim() < 2:
        raise ValueError(f"y_hp must be [T, ..., F/W] (rows, then features last), got shape {tuple(y_hp.shape)}")
    check_index_tensor("cu_seqlens_padded", cu_seqlens_padded, y_hp.device)
    if y_hp.shape[0] % (2 * world):
        raise ValueError(
            f"y_hp has {y_hp.shape[0]} rows, not a multiple of 2*W = {2 * world} for a CP group of {world} "
            "ranks; y_hp must hold all T rows of the batch (is the group the one the layout was built for?)"
        )
    if sections is not None:  # None: no sections to check (the blocks keep the features as they are)
        check_sections("y_hp", y_hp.shape[-1], sections, 1)


def _group_world(group_name: str, cp_size: int) -> int:
    """The group's size, which must equal ``cp_size``. cp_size is in the ops' schemas so that a
    compiled graph's cache key holds it: group names repeat across runs of different sizes."""
    world = group_size(group_name)
    if world != cp_size:
        raise ValueError(f"cp_size = {cp_size} but the process group {group_name!r} has {world} ranks")
    return world


@kernel_op(f"{NAMESPACE}::thd_cp2hp", mutates_args=())
def _thd_cp2hp(
    x_cp: torch.Tensor, cu_seqlens_padded: torch.Tensor, sections: list[int], group_name: str, cp_size: int
) -> torch.Tensor:
    world = _group_world(group_name, cp_size)
    _check_cp2hp(x_cp, cu_seqlens_padded, sections, world)
    send = sections_to_rank_blocks(x_cp, sections, world)  # [W, T/W, ..., F/W]
    recv = all_to_all_rows(send.flatten(0, 1), group_name, world)  # [T, ..., F/W], rank order
    return custom_ops.thd_rank_to_seq_order(recv, cu_seqlens_padded, world)


@_thd_cp2hp.register_fake
def _(x_cp, cu_seqlens_padded, sections, group_name, cp_size):
    world = _group_world(group_name, cp_size)
    _check_cp2hp(x_cp, cu_seqlens_padded, sections, world)
    return x_cp.new_empty((x_cp.shape[0] * world,) + tuple(x_cp.shape[1:-1]) + (x_cp.shape[-1] // world,))


@kernel_op(f"{NAMESPACE}::thd_hp2cp", mutates_args=())
def _thd_hp2cp(
    y_hp: torch.Tensor, cu_seqlens_padded: torch.Tensor, sections: list[int], group_name: str, cp_size: int
) -> torch.Tensor:
    world = _group_world(group_name, cp_size)
    _check_hp2cp(y_hp, cu_seqlens_padded, sections, world)
    send = custom_ops.thd_seq_to_rank_order(y_hp, cu_seqlens_padded, world)  # [T, ..., F/W], rank order
    recv = all_to_all_rows(send, group_name, world)  # block d: rank d's features of the local rows
    blocks = recv.unflatten(0, (world, recv.shape[0] // world))  # [W, T/W, ..., F/W]
    return rank_blocks_to_sections(blocks, [s * world for s in sections], world)


@_thd_hp2cp.register_fake
def _(y_hp, cu_seqlens_padded, sections, group_name, cp_size):
    world = _group_world(group_name, cp_size)
    _check_hp2cp(y_hp, cu_seqlens_padded, sections, world)
    return y_hp.new_empty((y_hp.shape[0] // world,) + tuple(y_hp.shape[1:-1]) + (y_hp.shape[-1] * world,))


def _setup_context(ctx, inputs, output):
    _, ctx.cu_seqlens_padded, ctx.sections, ctx.group_name, ctx.world = inputs


def _cp2hp_backward(ctx, grad):
    local = [s // ctx.world for s in ctx.sections]
    return _thd_hp2cp(grad, ctx.cu_seqlens_padded, local, ctx.group_name, ctx.world), None, None, None, None


def _hp2cp_backward(ctx, grad):
    full = [s * ctx.world for s in ctx.sections]
    return _thd_cp2hp(grad, ctx.cu_seqlens_padded, full, ctx.group_name, ctx.world), None, None, None, None


_thd_cp2hp.register_autograd(_cp2hp_backward, setup_context=_setup_context)
_thd_hp2cp.register_autograd(_hp2cp_backward, setup_context=_setup_context)


# --- Python entry points ----------------------------------------------------------------------------


def thd_cp2hp(
    x_cp: torch.Tensor, cu_seqlens_padded: torch.Tensor, sections: Sequence[int], group=None
) -> torch.Tensor:
    """Context parallel -> head parallel, with one all-to-all for all sequences and sections.

    x_cp: ``[T/W, ..., F]`` this rank's THD shard (see docs/design.md section 1); its last dim
    is a concatenation of sections of widths ``sections`` (each divisible by W).
    cu_seqlens_padded: ``[B+1]`` global padded offsets (``T = cu_seqlens_padded[-1]``).
    group: ``ProcessGroup``, 1-D ``DeviceMesh``, or ``None`` (no CP: W = 1 and the
    result is a copy of ``x_cp``, the section permutation being the identity).

    Returns ``x_hp [T, ..., F/W]`` in sequence order; its features are this rank's
    contiguous slice (width ``s/W``) of every section, in section order. Equal to
    ``permute_sections(x, sections, W)[..., r*F/W:(r+1)*F/W]`` for the global
    sequence-order ``x``. Differentiable; the gradient is :func:`thd_hp2cp`.
    Also ``torch.ops.cp_ops.thd_cp2hp(x_cp, cu_seqlens_padded, sections, group_name, cp_size)``.
    """
    group_name, world = resolve_group(group)
    sections = [int(s) for s in sections]
    if group_name is None:
        _check_cp2hp(x_cp, cu_seqlens_padded, sections, world)
        return custom_ops.permute_sections(x_cp, sections, 1)
    return _thd_cp2hp(x_cp, cu_seqlens_padded, sections, group_name, world)


def _check_send_blocks(send: torch.Tensor, cu_seqlens_padded: torch.Tensor, world: int) -> None:
    if not isinstance(send, torch.Tensor):
        raise TypeError(f"send must be a torch.Tensor, got {type(send).__name__}")
    if send.dim() < 3 or send.shape[0] != world:
        raise ValueError(
            f"send must be [W, T/W, ..., F/W] with W = {world} (the CP group size) blocks, got shape "
            f"{tuple(send.shape)}"
        )
    check_index_tensor("cu_seqlens_padded", cu_seqlens_padded, send.device)
    if send.shape[1] % 2:
        raise ValueError(
            f"send has {send.shape[1]} rows a block; a local shard has T/W rows, two chunks per sequence, "
            "so an even number"
        )


def _overlapped_exchange(
    send: torch.Tensor, group_name: str, world: int, overlap: Callable[[], T] | None
) -> tuple[torch.Tensor, T | None]:
    """One differentiable all-to-all of ``send`` (``[W*R, ...]``) with ``overlap()`` run while it is
    in flight, in the forward pass and (for the work autograd runs between the two halves) in
    the backward pass."""
    recv = _ExchangeStart.apply(send, group_name, world)
    extra = overlap() if overlap is not None else None
    return _ExchangeWait.apply(recv, group_name, world), extra


def thd_cp2hp_blocks(
    send: torch.Tensor,
    cu_seqlens_padded: torch.Tensor,
    group,
    overlap: Callable[[], T] | None = None,
    *,
    seq_order: bool = True,
) -> tuple[torch.Tensor, T | None]:
    """:func:`thd_cp2hp` from a send buffer the caller has already laid out.

    send: ``[W, T/W, ..., F/W]``; block d holds rank d's slice of every section of this
    rank's local rows, what ``sections_to_rank_blocks(x_cp, sections, W)`` returns (a
    producer can write this layout itself: :class:`cp_ops.GatedDeltaNet` computes it as
    W GEMMs on row blocks of its projection weight, so no pass over the activations
    builds it). Returns ``(x_hp, overlap())`` (``None`` for no ``overlap``): ``x_hp
    [T, ..., F/W]`` in sequence order, as :func:`thd_cp2hp` returns it, with ``overlap()``
    run while the all-to-all is in flight (see :func:`thd_cp2hp_overlap`). Differentiable;
    the gradient of ``send`` comes back in the same block layout. ``group=None``: W = 1,
    ``x_hp = send[0]``. ``seq_order=False`` skips the last pass: ``x_hp`` is then in rank
    order, as received (sequence row g at row ``rank_to_seq_index(cu_seqlens_padded, W, T)[g]``
    of it), for a consumer that reads its rows through that map
    (:func:`custom_ops.causal_conv1d_gather`).
    """
    group_name, world = resolve_group(group)
    _check_send_blocks(send, cu_seqlens_padded, world)
    if group_name is None:
        return send[0], (overlap() if overlap is not None else None)
    recv, extra = _overlapped_exchange(send.flatten(0, 1), group_name, world, overlap)  # rank order
    if not seq_order:
        return recv, extra
    return custom_ops.thd_rank_to_seq_order(recv, cu_seqlens_padded, world), extra


def thd_cp2hp_overlap(
    x_cp: torch.Tensor, cu_seqlens_padded: torch.Tensor, sections: Sequence[int], group, overlap: Callable[[], T]
) -> tuple[torch.Tensor, T]:
    """:func:`thd_cp2hp`, running ``overlap()`` while the all-to-all is in flight.

    Returns ``(x_hp, overlap())``. ``overlap`` is work that does not need ``x_hp``.
    The conversion runs as three graph nodes instead of one op:
    ``sections_to_rank_blocks`` (the send buffer), one all-to-all issued before
    ``overlap()`` and waited for after it, and ``thd_rank_to_seq_order``
    (:func:`thd_cp2hp_blocks`). Same values and gradients as :func:`thd_cp2hp`,
    still one all-to-all per direction. In the backward pass the gradient's
    exchange is issued where the wait was and waited for where the exchange was
    issued, so the backward of ``overlap``'s work runs during it too.

    Eager on CUDA, the overlap happens as written (NCCL runs on its own stream).
    Under ``torch.compile``, Inductor's peak-memory reordering moves the wait up to
    the exchange; compile with :data:`COMPILE_OPTIONS` to keep the overlap.
    """
    group_name, world = resolve_group(group)
    sections = [int(s) for s in sections]
    if group_name is None:
        return thd_cp2hp(x_cp, cu_seqlens_padded, sections, None), overlap()
    _check_cp2hp(x_cp, cu_seqlens_padded, sections, world)
    send = custom_ops.sections_to_rank_blocks(x_cp, sections, world)  # [W, T/W, ..., F/W]
    return thd_cp2hp_blocks(send, cu_seqlens_padded, group, overlap)


def thd_hp2cp_blocks(
    y_hp: torch.Tensor,
    cu_seqlens_padded: torch.Tensor,
    group,
    overlap: Callable[[torch.Tensor], T] | None = None,
) -> tuple[torch.Tensor, T | None]:
    """:func:`thd_hp2cp` without its last pass: the received blocks as they arrive.

    y_hp: ``[T, ..., F/W]`` in sequence order, as for :func:`thd_hp2cp`. Returns
    ``(blocks, overlap(own))``: ``blocks [W, T/W, ..., F/W]``, block s holding rank s's
    features (its slice of every section) of this rank's local rows, so that
    ``rank_blocks_to_sections(blocks, sections, W)`` is :func:`thd_hp2cp`'s result. A
    consumer that reads the blocks where they are saves that pass:
    :class:`cp_ops.GatedDeltaNet` runs its gated norm on them and writes the norm's
    output in the section layout. The exchange runs as two graph nodes with
    ``overlap(own)`` between them, as in :func:`thd_cp2hp_blocks`; ``own`` is this
    rank's block (``blocks[rank]``, the part of the result that never leaves the rank)
    taken from the send buffer, so work on it can run while the other blocks are in
    flight. Differentiable (through ``own`` too). ``group=None``: W = 1,
    ``blocks = y_hp[None]`` and ``own = y_hp``.
    """
    group_name, world = resolve_group(group)
    _check_hp2cp(y_hp, cu_seqlens_padded, None, world)
    if group_name is None:
        return y_hp.unsqueeze(0), (overlap(y_hp) if overlap is not None else None)
    send = custom_ops.thd_seq_to_rank_order(y_hp, cu_seqlens_padded, world)  # [T, ..., F/W], rank order
    own = send.unflatten(0, (world, send.shape[0] // world))[group_rank(group)]
    recv, extra = _overlapped_exchange(send, group_name, world, None if overlap is None else lambda: overlap(own))
    return recv.unflatten(0, (world, recv.shape[0] // world)), extra


# Work is weighed as FLOPs plus this many FLOPs per byte a node reads and writes: about the ratio
# of bf16 tensor-core throughput to memory bandwidth on H100 / H200 (docs/benchmarks.md, section
# "Work spread over every exchange window; out_proj per received block").
# Only the ratio between the work items matters (which ones share a window), never a clock.
_FLOPS_PER_BYTE = 250


def _node_work(snode) -> float:
    """What a scheduler node costs, in FLOPs with memory traffic converted (0 where unknown)."""
    try:
        flops = snode.estimate_flops() or 0
    except Exception:  # nodes without an origin node, ops the FLOP counter does not know
        flops = 0
    try:
        nbytes = snode.get_read_write_buffers_sizes() or 0
    except Exception:
        nbytes = 0
    return float(flops) + _FLOPS_PER_BYTE * float(nbytes)


def _exchange_bytes(snode) -> float:
    """The bytes a collective node sends (its inputs); 1 where they cannot be read, so that
    windows then weigh alike."""
    try:
        from torch._inductor.comm_analysis import get_collective_input_size_bytes

        return float(get_collective_input_size_bytes(snode.node)) or 1.0
    except Exception:
        return 1.0


def _serial_on_cpu(snode) -> bool:
    """Whether ``snode`` is a functional all-gather on the CPU, which :func:`issue_early_wait_late`
    never has in flight beside another collective. With gloo, two or more
    ``_c10d_functional.all_gather_into_tensor`` in flight at once corrupted the heap (torch
    2.13: ``malloc(): unaligned tcache chunk``, or a segfault, within a few hundred steps of
    four in flight on two ranks); ``all_to_all_single`` and ``reduce_scatter_tensor`` in
    flight four at a time, and ``dist.all_gather_into_tensor(async_op=True)``, did not in
    thousands. CUDA graphs keep their overlap: this only holds back CPU (gloo) graphs."""
    node = getattr(snode, "node", None)
    kernel = getattr(node, "op_overload", None)
    if kernel is not torch.ops._c10d_functional.all_gather_into_tensor.default:
        return False
    device = node.get_device()
    return device is not None and device.type == "cpu"


def issue_early_wait_late(snodes: list) -> list:
    """An Inductor scheduling pass: collectives as early as their inputs allow, waits as late as
    their work allows, and work no collective needs spread over the exchange windows.

    A list scheduler over the nodes' data dependencies. Of the nodes whose inputs are ready:

    1. first a collective or a node some collective needs (the earliest collective first;
       collectives in their graph order, one may be issued while others are in flight);
    2. then, while an exchange is in flight, *filler* work (nodes no collective needs, such as
       weight-gradient GEMMs) up to that exchange's share, then its wait;
    3. with no exchange in flight, fillers in their original order.

    A filler runs in the window of the exchange in flight (or next) when it became ready, or
    in the window after: never later, so that work is not deferred across a model's layers,
    holding its inputs. An exchange's share of the ready fillers is each filler's work in
    proportion to the exchange's bytes among those of the windows the filler may still use.
    Fillers that will become ready during the window (their waits are done) count too. A
    window takes fillers (earliest last window first, then in graph order) while each brings
    the work placed in it nearer to its share; a filler in its last window runs there
    whatever the share. Placing every filler in the first window, as a greedy scheduler
    does, left later ones empty: the GDN layer's backward pass ran its independent GEMMs
    (out_proj's weight gradient, the z projection's gradients) during the small exchange of
    the output gradient, and the larger exchange of the q, k, v, b, a gradients after it ran
    alone. Work is weighed by :func:`_node_work`, exchanges by their bytes; neither needs a
    clock, only a ratio.

    Inductor's ``raise_comms`` and ``sink_waits`` passes together rank criterion 1 the other
    way round: a wait that a later collective needs goes ahead of work no collective needs,
    so with two exchanges in a graph (the layer's ``thd_cp2hp_blocks`` and
    ``thd_hp2cp_blocks``) the first wait went ahead of the z projection recorded between
    that exchange and its wait.
    """
    import heapq
    import sys
    from collections import defaultdict

    from torch._inductor.comms import contains_collective, contains_wait

    index = {id(s): i for i, s in enumerate(snodes)}
    fused = {}  # operation and buffer names -> the (possibly fused) node
    for s in snodes:
        for name in (*s.get_operation_names(), *s.get_buffer_names(), s.get_name()):
            fused[name] = s
    comms = [s for s in snodes if contains_collective(s)]
    comm_of = {id(s): i for i, s in enumerate(comms)}
    first_comm = {id(s): sys.maxsize for s in snodes}  # the earliest collective the node is needed by
    for i, s in enumerate(comms):
        first_comm[id(s)] = i
        for name in s.ancestors:
            anc = fused[name]
            first_comm[id(anc)] = min(first_comm[id(anc)], i)
    unmet = {id(s): {dep.name for dep in s.unmet_dependencies} for s in snodes}
    # Inductor orders collectives by a fake dependency of each on the one before it; after
    # buffer renaming that points at the earlier collective's *wait*, so no collective could be
    # issued while another is in flight. Keep the issue order, not the wait: each collective
    # after the previous one. Except next to a functional all-gather on the CPU, which keeps
    # the wait (:func:`_serial_on_cpu`).
    for prev, s in zip(comms, comms[1:]):
        if _serial_on_cpu(prev) or _serial_on_cpu(s):
            continue
        unmet[id(s)] = {dep.name for dep in s.unmet_dependencies if not getattr(dep, "is_fake", False)}
        unmet[id(s)].add(next(iter(prev.get_buffer_names())))
    users = defaultdict(list)
    for s in snodes:
        for name in unmet[id(s)]:
            users[name].append(s)
    wait_of = {}  # wait node -> the index of the collective it waits for
    for w in snodes:
        if contains_wait(w):
            found = [comm_of[id(fused[n])] for n in unmet[id(w)] if id(fused.get(n)) in comm_of]
            wait_of[id(w)] = min(found) if found else len(comms) - 1

    after_wait = {}  # the latest exchange whose wait a node is downstream of (-1: none), in one pass
    for s in snodes:  # (the nodes come in a valid order: producers first)
        ups = (after_wait.get(id(fused.get(n)), -1) for n in unmet[id(s)])
        after_wait[id(s)] = max(wait_of.get(id(s), -1), *ups, -1)
    # fillers not ready yet, with the latest wait they are downstream of
    unready = {
        id(s): (s, after_wait[id(s)])
        for s in snodes
        if first_comm[id(s)] == sys.maxsize and not contains_wait(s)
    }
    sizes = [_exchange_bytes(s) for s in comms]
    last = len(comms) - 1
    work = {}

    def cost(s):
        if id(s) not in work:
            work[id(s)] = _node_work(s)
        return work[id(s)]

    main, filler, wait_q = [], [], []  # heaps; indices are unique, so no two nodes are compared
    in_flight = []  # exchanges issued, not yet waited for, in issue order
    issued = 0
    window = {}  # exchange index -> [filler work placed while it was in flight, its share]

    def push(s):
        if contains_wait(s):
            heapq.heappush(wait_q, (wait_of[id(s)], index[id(s)], s))
        elif first_comm[id(s)] == sys.maxsize:  # a filler; the window it may wait for at the latest
            unready.pop(id(s))
            deadline = (in_flight[0] if in_flight else issued) + 1
            heapq.heappush(filler, (deadline, index[id(s)], s))
        else:
            heapq.heappush(main, (first_comm[id(s)], index[id(s)], s))

    def open_window(c):
        def part(f, deadline):  # f's work in proportion to the bytes of the windows it may use
            return cost(f) * sizes[c] / sum(sizes[c : max(c, min(deadline, last)) + 1])

        share = sum(part(f, deadline) for deadline, _, f in filler)
        # fillers that will be ready during this window (their waits are done): they may wait
        # for the next one
        share += sum(part(f, c + 1) for f, after in unready.values() if after < c)
        window[c] = [0.0, share]

    for s in snodes:
        if not unmet[id(s)]:
            push(s)
    order = []
    while main or filler or wait_q:
        if main:
            s = heapq.heappop(main)[-1]
        elif filler and (
            not in_flight
            or not wait_q
            or filler[0][0] <= in_flight[0]  # the filler's last window
            # the window's share: take the filler if that leaves the placed work nearer to it
            or window[in_flight[0]][0] + cost(filler[0][-1]) / 2 <= window[in_flight[0]][1]
        ):
            s = heapq.heappop(filler)[-1]
            if in_flight:
                window[in_flight[0]][0] += cost(s)
        else:
            s = heapq.heappop(wait_q)[-1]
            if wait_of[id(s)] in in_flight:
                in_flight.remove(wait_of[id(s)])
        if id(s) in comm_of:
            in_flight.append(comm_of[id(s)])
            issued += 1
            open_window(comm_of[id(s)])
        order.append(s)
        for name in s.get_buffer_names():
            for user in users[name]:
                deps = unmet[id(user)]
                if name in deps:
                    deps.discard(name)
                    if not deps:
                        push(user)
    if len(order) != len(snodes):
        raise RuntimeError(f"issue_early_wait_late scheduled {len(order)} of {len(snodes)} nodes: a dependency is unmet")
    return order


# Inductor options that keep the exchanges of thd_cp2hp_blocks / thd_hp2cp_blocks overlapped under
# torch.compile: without them, the peak-memory reordering moves each wait up to its exchange,
# before the work recorded in between. Horizontal fusion (two kernels with no data between them
# made one because they read some of the same data) needs a shared read of 64 KiB here instead
# of 10 bytes: the gated norm of the GDN layer's own block, computed before the exchange back
# completes, shares only the norm's weight with the norm of the received blocks, and fused with
# it, it waited for the exchange. Checked on the code Inductor generates (tests/cp_ops/
# test_comm.py, test_gdn_cp.py). Pass as torch.compile(model, options=COMPILE_OPTIONS); they
# apply to that compile only.
COMPILE_OPTIONS = {
    "reorder_for_compute_comm_overlap": True,
    "reorder_for_compute_comm_overlap_passes": [issue_early_wait_late],
    "score_fusion_memory_threshold": 1 << 16,
}


def thd_hp2cp(
    y_hp: torch.Tensor, cu_seqlens_padded: torch.Tensor, sections: Sequence[int], group=None
) -> torch.Tensor:
    """Head parallel -> context parallel: the inverse of :func:`thd_cp2hp`.

    y_hp: ``[T, ..., F/W]`` in sequence order, features = this rank's slice of every
    section; ``sections`` are the *local* widths (global width / W).
    Returns this rank's THD shard ``[T/W, ..., F]`` with the sections whole again.
    Differentiable; the gradient is :func:`thd_cp2hp`.
    Also ``torch.ops.cp_ops.thd_hp2cp(y_hp, cu_seqlens_padded, sections, group_name, cp_size)``.
    """
    group_name, world = resolve_group(group)
    sections = [int(s) for s in sections]
    if group_name is None:
        _check_hp2cp(y_hp, cu_seqlens_padded, sections, world)
        return custom_ops.unpermute_sections(y_hp, sections, 1)
    return _thd_hp2cp(y_hp, cu_seqlens_padded, sections, group_name, world)


# --- single-process references (test oracles) ----------------------------------------------------


def thd_cp2hp_reference(x: torch.Tensor, sections: Sequence[int], cp_size: int, rank: int) -> torch.Tensor:
    """What :func:`thd_cp2hp` returns on ``rank``, from the global sequence-order ``x [T, ..., F]``."""
    local = x.shape[-1] // cp_size
    return permute_sections_reference(x, list(sections), cp_size)[..., rank * local : (rank + 1) * local]


def thd_hp2cp_reference(
    y_hp_all: Sequence[torch.Tensor], cu_seqlens_padded: torch.Tensor, sections: Sequence[int], cp_size: int, rank: int
) -> torch.Tensor:
    """What :func:`thd_hp2cp` returns on ``rank``, from every rank's ``y_hp [T, ..., F/W]``
    (rank 0 first; ``sections`` are the local widths)."""
    from cp_ops.layout import shard_thd

    full = unpermute_sections_reference(torch.cat(list(y_hp_all), dim=-1), [s * cp_size for s in sections], cp_size)
    return shard_thd(full, cu_seqlens_padded, cp_size, rank)
