"""benchmarks.common.kernel_ms and kernel_breakdown: the profiler's op times, on the CPU (self CPU time)."""

import torch

from benchmarks.common import kernel_breakdown, kernel_ms


def test_kernel_ms_counts_the_work_of_one_call():
    a = torch.randn(768, 768)
    one = kernel_ms(lambda: a @ a, runs=3, warmup=1, device="cpu")
    four = kernel_ms(lambda: [a @ a for _ in range(4)], runs=3, warmup=1, device="cpu")
    assert 0 < one < four


def test_kernel_breakdown_names_the_ops():
    a = torch.randn(256, 256)
    rows = kernel_breakdown(lambda: (a @ a).relu(), runs=2, warmup=1, device="cpu")
    names = [name for name, _ in rows]
    assert any("mm" in n for n in names) and any("relu" in n for n in names)
    assert all(ms > 0 for _, ms in rows) and [ms for _, ms in rows] == sorted((ms for _, ms in rows), reverse=True)
