"""benchmarks.timing and benchmarks.common: the profiler's op times on the CPU (self CPU time), and the
step-timeline arithmetic."""

import pytest
import torch

from benchmarks.common import covered_us, first_call_left_out, kernel_class, kernel_totals, timeline_summary
from benchmarks.timing import kernel_breakdown, kernel_ms


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


def test_covered_us_merges_overlaps_and_keeps_gaps():
    assert covered_us([]) == 0
    assert covered_us([(0, 10), (5, 12), (20, 25), (21, 22)]) == 17
    assert covered_us([(20, 25), (0, 10)]) == 15


def test_first_call_left_out_drops_the_earliest_calls_kernels(capsys):
    # three calls of two kernels each, listed out of order; the first call's second kernel
    # starts late (the profiler's host stall), after a long gap
    calls = [[("a", 0, 1), ("b", 50, 51)], [("a", 52, 53), ("b", 54, 55)], [("a", 56, 57), ("b", 58, 59)]]
    kernels = [k for call in reversed(calls) for k in call]
    kept, n = first_call_left_out(kernels, 3)
    assert n == 2 and kept == calls[1] + calls[2]
    # 1 us between the kernels of a call and between calls: 3 us of idle in 2 calls, where
    # all three calls would count the first call's 49 us gap
    assert timeline_summary(kept, n)["idle"] == pytest.approx(1.5e-3)
    assert timeline_summary(kernels, 3)["idle"] == pytest.approx(53e-3 / 3)
    assert capsys.readouterr().out == ""


def test_first_call_left_out_keeps_calls_of_different_kernels(capsys):
    kernels = [("a", 0, 1), ("b", 2, 3), ("a", 4, 5)]
    kept, n = first_call_left_out(kernels, 2)
    assert n == 2 and kept == kernels
    assert "not as many in each" in capsys.readouterr().out


def test_kernel_class_by_name():
    assert kernel_class("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)") == "collectives"
    assert kernel_class("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64") == "GEMMs"
    assert kernel_class("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN") == "GEMMs"
    assert kernel_class("chunk_gated_delta_rule_fwd_kernel_h_blockdim64") == "FLA"
    assert kernel_class("causal_conv1d_fwd_kernel") == "FLA"
    assert kernel_class("thd_reorder_kernel") == "our layout kernels"
    assert kernel_class("gather_rows_kernel") == "our layout kernels"
    assert kernel_class("varlen_attn_fwd_kernel") == "our attention kernels"
    assert kernel_class("triton_per_fused_add_mul_0") == "Inductor-fused"
    # Inductor's kernels carry the names of the ops they fuse, custom ops' included
    assert kernel_class("triton_poi_fused__to_copy_add_causal_conv1d_gather_backward_expand_mul_0") == "Inductor-fused"
    assert kernel_class("triton_red_fused_chunk_gated_delta_rule_backward_sum_3") == "Inductor-fused"
    assert kernel_class("triton_poi_fused_add_thd_reorder_view_5") == "Inductor-fused"
    assert kernel_class("cp_causal_conv1d_bwd_kernel") == "our conv kernels"
    assert kernel_class("Memcpy DtoD (Device -> Device)") == "other"


def test_timeline_summary_splits_wall_time():
    # two steps (us): compute 0-40 and 60-100; a collective 30-70 overlaps both; a gap 100-150
    kernels = [
        ("sm90_xmma_gemm", 0, 40),
        ("ncclDevKernel_AllToAll", 30, 70),
        ("triton_poi_fused_0", 60, 100),
        ("sm90_xmma_gemm", 150, 200),
    ]
    out = timeline_summary(kernels, runs=2)
    assert out["wall"] == pytest.approx(0.1)  # 200 us over 2 steps, in ms
    assert out["GPU busy"] == pytest.approx(0.075)  # 0-100 and 150-200
    assert out["idle"] == pytest.approx(0.025)
    assert out["compute busy"] == pytest.approx(0.065)  # 0-40, 60-100, 150-200
    assert out["collectives only"] == pytest.approx(0.01)  # 40-60
    assert out["GEMMs"] == pytest.approx(0.045) and out["collectives"] == pytest.approx(0.02)
    assert out["Inductor-fused"] == pytest.approx(0.02) and out["other"] == 0
    with pytest.raises(ValueError, match="no kernels"):
        timeline_summary([], runs=1)


def test_kernel_totals_sums_each_name_per_step_slowest_first():
    kernels = [("gemm", 0, 40), ("nccl", 30, 70), ("gemm", 150, 200), ("triton_poi", 60, 70)]
    out = kernel_totals(kernels, runs=2)
    assert list(out) == ["gemm", "nccl", "triton_poi"]
    assert out["gemm"] == pytest.approx(0.045) and out["nccl"] == pytest.approx(0.02)
    assert out["triton_poi"] == pytest.approx(0.005)


@pytest.mark.gpu
def test_profile_step_on_the_gpu():
    from benchmarks.common import KERNEL_CLASSES, profile_step

    a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    out = profile_step(lambda: (a @ a).relu_(), named=["nccl"], runs=3)
    assert out["host issue"] > 0 and out["nccl kernels"] == 0
    assert out["GEMMs"] > 0 and out["collectives"] == 0 and out["collectives only"] == 0
    assert 0 < out["GPU busy"] <= out["wall"] and out["idle"] >= 0
    assert out["compute busy"] == pytest.approx(out["GPU busy"])
    # nothing overlaps on one stream: the classes add up to the busy time
    classes = sum(out[c] for c, _ in KERNEL_CLASSES) + out["other"]
    assert classes == pytest.approx(out["GPU busy"], rel=1e-6)
