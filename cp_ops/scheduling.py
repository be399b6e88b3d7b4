"""The Inductor scheduling pass of ``COMPILE_OPTIONS``: collectives issued early, waits late.

Overlap written in the code (work recorded between an exchange and its wait) does not survive
Inductor's default scheduling, whose peak-memory reordering moves each wait up to its
collective. :data:`COMPILE_OPTIONS` installs :func:`issue_early_wait_late` instead
(docs/design.md section 3).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["COMPILE_OPTIONS", "issue_early_wait_late"]


# Work is weighed as FLOPs plus this many FLOPs per byte a node moves, about the ratio of bf16
# tensor-core throughput to memory bandwidth on H100 / H200: only ratios between work items matter.
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
    never has in flight beside another collective: several at once corrupt gloo's heap
    (docs/design.md section 4.2). CUDA graphs keep their overlap."""
    node = getattr(snode, "node", None)
    kernel = getattr(node, "op_overload", None)
    if kernel is not torch.ops._c10d_functional.all_gather_into_tensor.default:
        return False
    device = node.get_device()
    return device is not None and device.type == "cpu"


def issue_early_wait_late(
    snodes: list,
    *,
    node_work: Callable[[Any], float] = _node_work,
    exchange_bytes: Callable[[Any], float] = _exchange_bytes,
    is_collective: Callable[[Any], bool] | None = None,
    is_wait: Callable[[Any], bool] | None = None,
) -> list:
    """An Inductor scheduling pass: collectives as early as their inputs allow, waits as late as
    their work allows, and work no collective needs ("fillers") spread over the exchange windows.

    A list scheduler over the nodes' data dependencies: of the ready nodes, first a collective
    or a node some collective needs (collectives in graph order, several may be in flight),
    then, while an exchange is in flight, fillers up to its share of the work (in proportion to
    its bytes; a filler at the latest in the window after the one it became ready in), then its
    wait. ``node_work`` and ``exchange_bytes`` weigh nodes and exchanges; ``is_collective`` and
    ``is_wait`` tell them apart (Inductor's ``contains_collective`` / ``contains_wait`` by
    default). Returns the nodes in their new order; raises ``RuntimeError`` if a dependency is
    unmet. The reasoning: docs/design.md sections 3 and 4.1.
    """
    import heapq
    import sys
    from collections import defaultdict

    if is_collective is None or is_wait is None:
        from torch._inductor.comms import contains_collective, contains_wait

        is_collective = contains_collective if is_collective is None else is_collective
        is_wait = contains_wait if is_wait is None else is_wait

    index = {id(s): i for i, s in enumerate(snodes)}
    fused = {}  # operation and buffer names -> the (possibly fused) node
    for s in snodes:
        for name in (*s.get_operation_names(), *s.get_buffer_names(), s.get_name()):
            fused[name] = s
    comms = [s for s in snodes if is_collective(s)]
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
        if is_wait(w):
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
        if first_comm[id(s)] == sys.maxsize and not is_wait(s)
    }
    sizes = [exchange_bytes(s) for s in comms]
    last = len(comms) - 1
    work = {}

    def cost(s):
        if id(s) not in work:
            work[id(s)] = node_work(s)
        return work[id(s)]

    main, filler, wait_q = [], [], []  # heaps; indices are unique, so no two nodes are compared
    in_flight = []  # exchanges issued, not yet waited for, in issue order
    issued = 0
    window = {}  # exchange index -> [filler work placed while it was in flight, its share]

    def push(s):
        if is_wait(s):
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


# Inductor options that keep work recorded between an exchange and its wait overlapped under
# torch.compile; the fusion threshold stops kernels that share only a small read (a norm weight)
# from being fused across a wait (docs/design.md sections 3 and 4.1).
COMPILE_OPTIONS = {
    "reorder_for_compute_comm_overlap": True,
    "reorder_for_compute_comm_overlap_passes": [issue_early_wait_late],
    "score_fusion_memory_threshold": 1 << 16,
}
