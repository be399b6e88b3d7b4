"""Shared pieces of the GPU benchmarks: step timelines, spawning ranks, compile settings
(timing: :mod:`benchmarks.timing`; results: :mod:`benchmarks.runner`)."""

from __future__ import annotations

import contextlib
import os

import torch

from benchmarks.timing import host_issue_ms, repeat


# Kernel classes of a training step, by kernel name (first match wins); the rest is "other".
# Inductor names a kernel after the ops it fuses, custom ops included (the fusion around a
# conv's backward is "triton_poi_fused_..._causal_conv1d_gather_backward_..."), so its
# kernels are told by their prefix before any other class's key.
INDUCTOR_PREFIXES = ("triton_poi_", "triton_per_", "triton_red_", "triton_tem_")
KERNEL_CLASSES = (
    ("collectives", ("nccl",)),
    ("GEMMs", ("gemm", "cutlass", "xmma", "nvjet", "cublas")),
    ("our conv kernels", ("cp_causal_conv1d",)),
    ("FLA", ("chunk_", "causal_conv1d", "solve_tril", "merge_16x16", "recompute_w_u", "prepare_wy", "l2norm")),
    ("our layout kernels", ("permute_sections", "thd_reorder", "thd_copy_valid", "gather_rows")),
    ("our attention kernels", ("varlen_attn",)),
    ("Inductor-fused", ("triton_",)),
)


def kernel_class(name: str) -> str:
    """The :data:`KERNEL_CLASSES` class of a kernel name ("other" when none matches)."""
    low = name.lower()
    if low.startswith(INDUCTOR_PREFIXES):
        return "Inductor-fused"
    for label, keys in KERNEL_CLASSES:
        if any(key in low for key in keys):
            return label
    return "other"


def covered_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def timeline_summary(kernels: list[tuple[str, float, float]], runs: int) -> dict[str, float]:
    """Per-step figures in ms from the ``(name, start_us, end_us)`` of every kernel of ``runs`` steps.

    ``wall``: first kernel start to last kernel end; ``GPU busy``: time some kernel runs;
    ``compute busy``: time some non-collective kernel runs; ``idle`` = wall - GPU busy
    (the GPU waits for the host); ``collectives only`` = busy - compute busy (a collective
    runs and nothing else: communication not hidden); then the summed kernel time of each
    :data:`KERNEL_CLASSES` class (classes may overlap in time: collectives on their own stream).
    """
    if not kernels:
        raise ValueError("no kernels were recorded")
    wall = max(e for _, _, e in kernels) - min(s for _, s, _ in kernels)
    busy = covered_us([(s, e) for _, s, e in kernels])
    compute = covered_us([(s, e) for n, s, e in kernels if kernel_class(n) != "collectives"])
    out = {"wall": wall, "GPU busy": busy, "idle": wall - busy, "compute busy": compute,
           "collectives only": busy - compute}  # fmt: skip
    for label in [c for c, _ in KERNEL_CLASSES] + ["other"]:
        out[label] = sum(e - s for n, s, e in kernels if kernel_class(n) == label)
    return {k: v / runs / 1e3 for k, v in out.items()}


def collective_waits(timelines: list[list[tuple[str, float, float]]], runs: int) -> list[float] | None:
    """Each rank's time in its collectives beyond the fastest rank's, in ms per step, from every
    rank's ``(name, start_us, end_us)`` timeline of ``runs`` steps: a collective's kernel runs until
    the last rank has joined, so the excess over the fastest rank is waiting for a peer (host lag
    or more work on another rank), not transfer. The k-th collective kernel of a name on every
    rank is one collective; None when the ranks ran different collectives."""
    per_rank = []  # {collective kernel name: its calls' durations in order}, a dict per rank
    for kernels in timelines:
        calls: dict[str, list[float]] = {}
        for name, start, end in sorted(kernels, key=lambda k: k[1]):
            if kernel_class(name) == "collectives":
                calls.setdefault(name, []).append(end - start)
        per_rank.append(calls)
    counts = [{name: len(d) for name, d in calls.items()} for calls in per_rank]
    if any(c != counts[0] for c in counts):
        return None
    waits = [0.0] * len(timelines)
    for name in counts[0]:
        for durations in zip(*(calls[name] for calls in per_rank)):
            fastest = min(durations)
            for r, d in enumerate(durations):
                waits[r] += d - fastest
    return [w / runs / 1e3 for w in waits]


def kernel_totals(kernels: list[tuple[str, float, float]], runs: int) -> dict[str, float]:
    """``{name: ms per step}`` from the ``(name, start_us, end_us)`` of every kernel of ``runs``
    steps: each kernel name's summed time, slowest first."""
    totals: dict[str, float] = {}
    for name, start, end in kernels:
        totals[name] = totals.get(name, 0.0) + (end - start) / runs / 1e3
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def profile_kernels(fn, runs: int = 5, warmup: int = 2) -> tuple[list[tuple[str, float, float]], int]:
    """``(kernels, calls)``: ``(name, start_us, end_us)`` of every GPU kernel, copy and memset of
    ``calls`` calls of ``fn()`` on the current CUDA device (torch.profiler). ``runs + 1`` calls are
    profiled and the first is left out (``calls = runs``) unless the calls launch different kernels.

    With collectives every rank of the group must call it (the same number of calls)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    repeat(fn, warmup)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        repeat(fn, runs + 1)
    kernels = [
        (e.name, e.time_range.start, e.time_range.end)
        for e in prof.events()
        # kernels, copies and memsets; not the ranges of annotations projected onto the GPU
        if e.device_type == DeviceType.CUDA and not e.is_user_annotation and e.time_range.end > e.time_range.start
    ]
    return first_call_left_out(kernels, runs + 1)


def first_call_left_out(kernels: list[tuple[str, float, float]], calls: int) -> tuple[list, int]:
    """``(kernels, calls)`` without the first call's kernels, where every call launched as many.

    The profiler's first activity buffer stalls the host for milliseconds inside the first profiled
    call, which a timeline would count as idle GPU time. Calls that launched different numbers of
    kernels cannot be told apart: all are kept, and a line says so."""
    kernels = sorted(kernels, key=lambda k: k[1])
    per_call, extra = divmod(len(kernels), calls)
    if extra or calls < 2:
        why = "not as many in each" if extra else "no other call to keep"
        print(f"  profile: {len(kernels)} kernels in {calls} calls, {why}: all kept, "
              "the first call's profiler stall included", flush=True)  # fmt: skip
        return kernels, calls
    return kernels[per_call:], calls - 1


def named_kernels_ms(kernels: list[tuple[str, float, float]], calls: int, name: str) -> float:
    """The summed time per call, in ms, of the kernels whose name holds ``name`` (lower case), from
    the ``(name, start_us, end_us)`` of :func:`profile_kernels`."""
    return sum(e - s for n, s, e in kernels if name in n.lower()) / calls / 1e3


def profile_step(step, device=None, named=(), runs: int = 5) -> dict[str, float]:
    """Where a step's time goes, in ms per step: :func:`timeline_summary` of ``runs`` calls of
    ``step()``, the summed time of the kernels whose name holds each of ``named`` (``NAME kernels``),
    the host's time to issue it (``host issue``, :func:`host_issue_ms`) and, with ``device`` (a
    multi-rank step: every rank must call it), every rank's :data:`RANK_KEYS` (``rank R: KEY``).
    Prints the largest kernels of the class "other"."""
    kernels, calls = profile_kernels(step, runs)
    out = timeline_summary(kernels, calls)
    for name in named:
        out[f"{name} kernels"] = named_kernels_ms(kernels, calls, name)
    top = [(n, t) for n, t in kernel_totals(kernels, calls).items() if kernel_class(n) == "other"][:6]
    print("  largest 'other' kernels (ms per step): " + "; ".join(f"{n[:70]} {t:.3f}" for n, t in top), flush=True)
    out["host issue"] = host_issue_ms(step)
    if device is not None:
        for r, figures in enumerate(rank_figures(out, device)):
            out.update({f"rank {r}: {k}": v for k, v in figures.items()})
    return out


def max_over_ranks(value: float) -> float:
    """The largest ``value`` over the default process group (a step is as slow as its slowest rank)."""
    import torch.distributed as dist

    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor([value], device=device, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


# Each rank's own figures from a profile (timeline_summary plus "host issue", host_issue_ms): its
# compute, against the other ranks' (the load balance); what keeps it waiting: its host (idle), a
# peer or the network (collectives only); and its host's time to issue a step
RANK_KEYS = ("compute busy", "idle", "collectives only", "host issue")


def rank_figures(profile: dict[str, float], device) -> list[dict[str, float]]:
    """The :data:`RANK_KEYS` of ``profile`` from every rank of the default process group, by rank.
    Every rank must call it."""
    import torch.distributed as dist

    mine = torch.tensor([profile[k] for k in RANK_KEYS], dtype=torch.float64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    return [dict(zip(RANK_KEYS, t.tolist())) for t in gathered]


def recompile_limit(n: int):
    """A context in which torch.compile keeps at least ``n`` graphs per function, as a benchmark
    compiles one function for several forms and shapes (each known name of the option, which
    changed across torch versions)."""
    config = torch._dynamo.config
    names = [name for name in ("recompile_limit", "cache_size_limit") if hasattr(config, name)]
    if not names:
        return contextlib.nullcontext()
    return config.patch({name: max(n, getattr(config, name)) for name in names})


def default_world() -> int:
    """The CP size a multi-rank benchmark uses unless told: every visible GPU, at least 2."""
    return max(2, torch.cuda.device_count())


def spawn_ranks(worker, world: int, *args, device: str = "cuda", keep_group: bool = False) -> None:
    """Run ``worker(rank, world, device, *args)`` in ``world`` processes and wait for all; each
    rank has joined the group (:func:`cp_ops.local_ranks.init_local_rank`) and computes on ``device``.

    ``device="cuda"`` needs ``world`` visible GPUs (one per rank, NCCL); ``"cpu"`` runs gloo.
    After the worker returns, every rank waits for the others, leaves the group (not with
    ``keep_group``) and ends its process with :func:`cp_ops.local_ranks.leave_local_rank`.
    """
    if device == "cuda" and torch.cuda.device_count() < world:
        raise SystemExit(f"needs {world} GPUs, found {torch.cuda.device_count()}")
    if world < 2:
        raise SystemExit(f"a multi-rank run needs at least 2 ranks, got {world}")
    # set here as well so the spawned workers inherit them before any NCCL initialisation
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    from cp_ops.local_ranks import local_rendezvous

    with local_rendezvous() as init_method:
        torch.multiprocessing.spawn(_run_worker, args=(worker, world, init_method, device, keep_group, *args),
                                    nprocs=world, join=True)  # fmt: skip


def _run_worker(rank: int, worker, world: int, init_method: str, device: str, keep_group: bool, *args) -> None:
    import torch.distributed as dist

    from cp_ops.local_ranks import init_local_rank, leave_local_rank

    dev = init_local_rank(rank, world, init_method, device)
    try:
        # the compiled forms are closures of one function: one graph per form, group, shape and grad mode
        with recompile_limit(64):
            worker(rank, world, dev, *args)
        # no rank tears down before all are done (gloo can abort a rank whose peer left first), as in tests/_dist.py
        dist.barrier()
    finally:
        # with CUDA graphs that captured NCCL work, a run hung after its table at the end
        # (barrier or teardown, not narrowed down); the process ends with os._exit either way
        if not keep_group:
            dist.destroy_process_group()
    leave_local_rank()  # reached only when the worker succeeded (it has left its group)
