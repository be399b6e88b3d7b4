"""benchmarks.common.kernel_ms: the profiler's summed op time, on the CPU (self CPU time)."""

import torch

from benchmarks.common import kernel_ms


def test_kernel_ms_counts_the_work_of_one_call():
    a = torch.randn(768, 768)
    one = kernel_ms(lambda: a @ a, runs=3, warmup=1, device="cpu")
    four = kernel_ms(lambda: [a @ a for _ in range(4)], runs=3, warmup=1, device="cpu")
    assert 0 < one < four
