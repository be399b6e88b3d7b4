"""Shared pieces of the GPU benchmarks: timing, environment header, table formatting."""

from __future__ import annotations

import datetime
import platform

import torch
import triton


def median_ms(fn, warmup_ms: int = 50, rep_ms: int = 300) -> float:
    """Median time of ``fn()`` in ms, timed with CUDA events after warm-up (triton.testing.do_bench)."""
    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


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
