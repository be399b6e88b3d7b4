"""Shared pieces of the GPU benchmarks: timing, environment header, table formatting."""

from __future__ import annotations

import datetime
import platform
import socket
import statistics

import torch
import triton


def median_ms(fn, warmup_ms: int = 50, rep_ms: int = 300) -> float:
    """Median time of ``fn()`` in ms, timed with CUDA events after warm-up (triton.testing.do_bench)."""
    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def median_ms_counted(fn, warmup: int = 5, runs: int = 30) -> float:
    """Median of exactly ``runs`` CUDA-event timings of ``fn()`` after ``warmup`` calls.

    For code with collectives: every rank must call ``fn`` the same number of times,
    which a time-budgeted loop (do_bench) does not promise.
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def max_over_ranks(value: float) -> float:
    """The largest ``value`` over the default process group (a step is as slow as its slowest rank)."""
    import torch.distributed as dist

    t = torch.tensor([value], device="cuda", dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def environment() -> str:
    """One line naming the device, software versions and date, for the head of every table."""
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    return (
        f"{dev}, torch {torch.__version__}, triton {triton.__version__}, "
        f"CUDA {torch.version.cuda}, {datetime.date.today().isoformat()}"
    )


def markdown_table(header: list[str], rows: list[list]) -> str:
    def fmt(v):
        return f"{v:.3f}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)
