"""Shared pieces of the GPU benchmarks: timing, spawning ranks, environment header, table formatting."""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import time

import torch
import triton

from cp_ops._local_ranks import leave_local_rank, local_rendezvous


def median_ms(fn, warmup_ms: int = 50, rep_ms: int = 300) -> float:
    """Median time of ``fn()`` in ms, timed with CUDA events after warm-up (triton.testing.do_bench)."""
    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def median_ms_counted(fn, warmup: int = 5, runs: int = 30, device: torch.device | str = "cuda") -> float:
    """Median of exactly ``runs`` timings of ``fn()`` in ms, after ``warmup`` calls.

    For code with collectives: every rank must call ``fn`` the same number of times,
    which a time-budgeted loop (do_bench) does not promise. On CUDA each run is timed
    with CUDA events; on the CPU (the gloo smoke runs) with the wall clock, the work
    being synchronous there.
    """
    cuda = torch.device(device).type == "cuda"
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    times = []
    for _ in range(runs):
        if not cuda:
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def kernel_breakdown(
    fn, runs: int = 5, warmup: int = 2, device: torch.device | str = "cuda"
) -> list[tuple[str, float]]:
    """``(name, ms)`` of every kernel one ``fn()`` launches, slowest first: the profiler's self
    device time per event name, divided by ``runs`` (on the CPU: self CPU time of the ops).
    Kernels that wait for other ranks (collectives) count their waiting as device time."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.device(device).type == "cuda"
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(runs):
            fn()
        if cuda:
            torch.cuda.synchronize()
    rows = [
        (e.key, (e.self_device_time_total if cuda else e.self_cpu_time_total) / runs / 1e3) for e in prof.key_averages()
    ]
    return sorted((r for r in rows if r[1] > 0), key=lambda r: -r[1])


def kernel_ms(fn, runs: int = 5, warmup: int = 2, device: torch.device | str = "cuda") -> float:
    """Device time of the kernels one ``fn()`` launches, in ms (:func:`kernel_breakdown`, summed).

    Against a wall-clock time of the same ``fn`` it tells whether the GPU or the host is the
    limit: a step whose kernels take far less than its wall time waits on the host (Python,
    launches, small setup ops).
    """
    return sum(ms for _, ms in kernel_breakdown(fn, runs, warmup, device))


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
    ("our layout kernels", ("permute_sections", "thd_reorder", "thd_copy_valid")),
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


def kernel_totals(kernels: list[tuple[str, float, float]], runs: int) -> dict[str, float]:
    """``{name: ms per step}`` from the ``(name, start_us, end_us)`` of every kernel of ``runs``
    steps: each kernel name's summed time, slowest first."""
    totals: dict[str, float] = {}
    for name, start, end in kernels:
        totals[name] = totals.get(name, 0.0) + (end - start) / runs / 1e3
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def profile_kernels(fn, runs: int = 5, warmup: int = 2) -> list[tuple[str, float, float]]:
    """``(name, start_us, end_us)`` of every GPU kernel, copy and memset of ``runs`` calls of
    ``fn()`` on the current CUDA device (torch.profiler).

    With collectives every rank of the group must call it (the same number of calls)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            fn()
        torch.cuda.synchronize()
    return [
        (e.name, e.time_range.start, e.time_range.end)
        for e in prof.events()
        # kernels, copies and memsets; not the ranges of annotations projected onto the GPU
        if e.device_type == DeviceType.CUDA and not e.is_user_annotation and e.time_range.end > e.time_range.start
    ]


def host_issue_ms(fn, runs: int = 10, warmup: int = 2) -> float:
    """Median host time to issue one ``fn()`` on an idle GPU, in ms (no synchronisation inside
    the timed span). A step whose host time reaches its GPU time is limited by the host.

    With collectives every rank of the group must call it (the same number of calls)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def profile_timeline(fn, runs: int = 5, warmup: int = 2, per_kernel: dict | None = None) -> dict[str, float]:
    """:func:`timeline_summary` of :func:`profile_kernels` (``runs`` calls of ``fn()``); with
    ``per_kernel`` (a dict), also fills it with the same steps' :func:`kernel_totals`."""
    kernels = profile_kernels(fn, runs, warmup)
    if per_kernel is not None:
        per_kernel.update(kernel_totals(kernels, runs))
    return timeline_summary(kernels, runs)


def max_over_ranks(value: float) -> float:
    """The largest ``value`` over the default process group (a step is as slow as its slowest rank)."""
    import torch.distributed as dist

    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor([value], device=device, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


# What keeps a rank waiting, from a profile (timeline_summary plus "host issue", host_issue_ms):
# its host (idle), a peer or the network (collectives only), and its host's time to issue a step
RANK_WAIT_KEYS = ("idle", "collectives only", "host issue")


def rank_waits(profile: dict[str, float], device) -> list[dict[str, float]]:
    """The :data:`RANK_WAIT_KEYS` of ``profile`` from every rank of the default process group,
    by rank. Every rank must call it."""
    import torch.distributed as dist

    mine = torch.tensor([profile[k] for k in RANK_WAIT_KEYS], dtype=torch.float64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    return [dict(zip(RANK_WAIT_KEYS, t.tolist())) for t in gathered]


def nccl_cta_groups(max_ctas) -> dict:
    """A group of every rank of the default group per cap on NCCL's CTAs, ``{cap: group}``.

    NCCL runs a collective as CTAs (thread blocks) that hold their SMs while it lasts, so
    the kernels it overlaps run on the rest of the GPU; a lower cap leaves them more SMs and
    moves the bytes over fewer. Cap 0 is the default group (NCCL's own choice); a cap n > 0
    is a new group whose communicator is created with ``maxCTAs = n`` (NCCL's config, through
    ``ProcessGroupNCCL.Options().config.max_ctas``; NCCL applies it to point-to-point
    channels as well, so to all-to-alls). Every rank must call it, with the same caps.
    """
    import torch.distributed as dist

    groups = {}
    for cap in max_ctas:
        if cap < 0:
            raise ValueError(f"an NCCL CTA cap is 0 (NCCL's default) or positive, got {cap}")
        if cap == 0:
            groups[cap] = dist.group.WORLD
            continue
        if dist.get_backend() != "nccl":
            raise ValueError(f"a CTA cap needs NCCL, the default group runs {dist.get_backend()}")
        options = dist.ProcessGroupNCCL.Options()
        options.config.max_ctas = cap
        groups[cap] = dist.new_group(pg_options=options)
    return groups


def cta_label(cap: int) -> str:
    """How tables name an NCCL CTA cap of :func:`nccl_cta_groups`."""
    return "NCCL CTAs: default" if cap == 0 else f"NCCL CTAs <= {cap}"


def raise_recompile_limit(n: int) -> None:
    """Let torch.compile keep at least ``n`` graphs per function (a benchmark compiles one
    function for several forms, shapes and grad modes; past the limit dynamo runs it eagerly)."""
    for name in ("recompile_limit", "cache_size_limit"):  # the name changed across torch versions
        try:
            setattr(torch._dynamo.config, name, max(n, getattr(torch._dynamo.config, name)))
        except AttributeError:
            pass


def default_world() -> int:
    """The CP size a multi-rank benchmark uses unless told: every visible GPU, at least 2."""
    return max(2, torch.cuda.device_count())


def spawn_ranks(worker, world: int, *args, device: str = "cuda") -> None:
    """Run ``worker(rank, world, init_method, *args)`` in ``world`` processes and wait for all.

    ``device="cuda"`` needs ``world`` visible GPUs (one per rank, NCCL); ``"cpu"`` runs gloo.
    A worker that returns ends its process with :func:`cp_ops._local_ranks.leave_local_rank`.
    """
    if device == "cuda" and torch.cuda.device_count() < world:
        raise SystemExit(f"needs {world} GPUs, found {torch.cuda.device_count()}")
    if world < 2:
        raise SystemExit(f"a multi-rank run needs at least 2 ranks, got {world}")
    # set here as well so the spawned workers inherit them before any NCCL initialisation
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    with local_rendezvous() as init_method:
        torch.multiprocessing.spawn(_run_worker, args=(worker, world, init_method, *args), nprocs=world, join=True)


def add_nccl_cta_argument(parser) -> None:
    """The ``--nccl-max-ctas`` option of the multi-rank benchmarks (:func:`nccl_cta_groups`);
    check what it parsed with :func:`check_nccl_cta_argument`."""
    parser.add_argument("--nccl-max-ctas", type=int, nargs="+", default=[0], metavar="N",
                        help="time the compiled CP forms on a group per cap on NCCL's CTAs (0: NCCL's default; "
                        "default: 0 only), in the same run")  # fmt: skip


def check_nccl_cta_argument(caps: list[int], smoke: bool) -> None:
    """Refuse repeated caps, and caps in a ``--smoke`` run (gloo has no CTAs), before any rank starts."""
    if len(set(caps)) != len(caps):
        raise SystemExit(f"--nccl-max-ctas repeats a cap: {caps}")
    if smoke and caps != [0]:
        raise SystemExit("--nccl-max-ctas needs NCCL, not --smoke")


def _run_worker(rank: int, worker, *args) -> None:
    worker(rank, *args)
    leave_local_rank()  # reached only when the worker succeeded (it has left its group)


def environment(world: int | None = None) -> str:
    """One line naming the device, software versions and date, for the head of every table;
    with ``world``, also the number of ranks and of visible GPUs."""
    cuda = torch.cuda.is_available()
    dev = torch.cuda.get_device_name() if cuda else platform.processor() or "cpu"
    line = (
        f"{dev}, torch {torch.__version__}, triton {triton.__version__}, "
        f"CUDA {torch.version.cuda}, {datetime.date.today().isoformat()}"
    )
    if world is not None:
        import torch.distributed as dist

        backend = dist.get_backend() if dist.is_initialized() else ("nccl" if cuda else "gloo")
        line += f"; W = {world} ranks ({backend.upper()}), {torch.cuda.device_count()} GPU(s) visible"
    return line


def markdown_table(header: list[str], rows: list[list]) -> str:
    def fmt(v):
        return f"{v:.3f}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)
