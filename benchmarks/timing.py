"""Timing of one callable: do_bench medians, counted medians for code with collectives, the
profiler's kernel time, and the host's time to issue a call.

Imports nothing of the library, so any checkout's benchmark child can use it.
"""

from __future__ import annotations

import statistics
import time

import torch
import triton


def median_ms(fn, warmup_ms: int = 50, rep_ms: int = 300) -> float:
    """Median time of ``fn()`` in ms, timed with CUDA events after warm-up (triton.testing.do_bench)."""
    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def repeat(fn, calls: int, cuda: bool = True) -> None:
    """``calls`` calls of ``fn()``, then (on CUDA) a wait for the GPU: warm-up, or the calls a profile records."""
    for _ in range(calls):
        fn()
    if cuda:
        torch.cuda.synchronize()


def median_ms_counted(fn, warmup: int = 5, runs: int = 30, device: torch.device | str = "cuda") -> float:
    """Median of exactly ``runs`` timings of ``fn()`` in ms, after ``warmup`` calls.

    For code with collectives: every rank must call ``fn`` the same number of times,
    which a time-budgeted loop (do_bench) does not promise. On CUDA each run is timed
    with CUDA events; on the CPU (the gloo smoke runs) with the wall clock, the work
    being synchronous there.
    """
    cuda = torch.device(device).type == "cuda"
    repeat(fn, warmup, cuda)
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
    repeat(fn, warmup, cuda)
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        repeat(fn, runs, cuda)
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


def host_issue_ms(fn, runs: int = 10, warmup: int = 2) -> float:
    """Median host time to issue one ``fn()`` on an idle GPU, in ms (no synchronisation inside
    the timed span). A step whose host time reaches its GPU time is limited by the host.

    With collectives every rank of the group must call it (the same number of calls)."""
    repeat(fn, warmup)
    times = []
    for _ in range(runs):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)
