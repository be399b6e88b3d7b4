"""CP <-> head-parallel conversion on W GPUs (NCCL): the fused one-all-to-all ops against the
per-sequence, per-section scheme and against a bare all-to-all of the same bytes.

    python -m benchmarks.bench_cp2hp [--world W] [--profile] [--out DIR]    # spawns W NCCL ranks
    python -m benchmarks.bench_cp2hp --smoke       # 2 gloo ranks on the CPU, tiny shapes

Results (benchmarks/runner.py): ``cp2hp-wW`` (``cp2hp-smoke-wW``); W must divide every
section. ``--profile`` adds rank 0's kernels of one bare all-to-all, cp2hp and hp2cp.
docs/benchmarks.md says what each column measures.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

import cp_ops

import custom_ops
from benchmarks.baselines import cp2hp_per_sequence, hp2cp_per_sequence
from benchmarks.common import default_world, max_over_ranks, spawn_ranks
from benchmarks.runner import Result, add_out_argument, checks_off, emit, environment
from benchmarks.timing import kernel_breakdown, median_ms_counted
from cp_ops import pad_cu_seqlens

SECTIONS = [2048, 2048, 4096, 4096, 32, 32]  # Qwen3-Next GDN: q, k, v, z, b, a
SHAPES = [(32768, 8), (32768, 64), (131072, 128)]  # (T, number of sequences)
# --smoke: the same code path on 2 gloo ranks, at sizes a CPU runs in seconds
SMOKE_SECTIONS = [16, 16, 32, 32, 4, 4]
SMOKE_SHAPES = [(256, 4), (512, 8)]


def _worker(rank: int, world: int, device, out: str | None, smoke: bool, profile: bool = False) -> None:
    group = dist.group.WORLD
    sections, shapes = (SMOKE_SECTIONS, SMOKE_SHAPES) if smoke else (SECTIONS, SHAPES)
    warmup, runs, seq_warmup, seq_runs = (1, 3, 1, 2) if smoke else (5, 30, 2, 10)

    def timed(fn, per_sequence=False):
        counts = (seq_warmup, seq_runs) if per_sequence else (warmup, runs)
        return max_over_ranks(median_ms_counted(fn, *counts, device))

    rows, kernels = [], []
    features = sum(sections)
    local_sections = [s // world for s in sections]
    for total, num_seqs in shapes:
        _, cup = pad_cu_seqlens([total // num_seqs] * num_seqs, world, device=device)
        rows_global = int(cup[-1])
        gen = torch.Generator(device=device).manual_seed(rank)
        x_cp = torch.randn(rows_global // world, features, device=device, generator=gen).to(torch.bfloat16)
        flat = torch.randn(rows_global, features // world, device=device, generator=gen).to(torch.bfloat16)
        flat_out = torch.empty_like(flat)

        x_hp = custom_ops.thd_cp2hp(x_cp, cup, sections, group)
        if not torch.equal(cp2hp_per_sequence(x_cp, cup, sections, group), x_hp):
            raise AssertionError(f"per-sequence baseline and thd_cp2hp disagree at T={total}, B={num_seqs}")
        if not torch.equal(custom_ops.thd_hp2cp(x_hp, cup, local_sections, group), x_cp):
            raise AssertionError(f"thd_hp2cp(thd_cp2hp(x)) != x at T={total}, B={num_seqs}")
        if not torch.equal(hp2cp_per_sequence(x_hp, cup, local_sections, group), x_cp):
            raise AssertionError(f"per-sequence hp2cp and thd_hp2cp disagree at T={total}, B={num_seqs}")

        t_bare = timed(lambda: dist.all_to_all_single(flat_out, flat, group=group))
        block = rows_global // world
        peers = [0 if d == rank else block for d in range(world)]
        flat_peers, peers_out = flat[: block * (world - 1)], flat_out[: block * (world - 1)]
        t_peers = timed(lambda: dist.all_to_all_single(peers_out, flat_peers, peers, peers, group=group))
        t_cp2hp = timed(lambda: custom_ops.thd_cp2hp(x_cp, cup, sections, group))
        t_hp2cp = timed(lambda: custom_ops.thd_hp2cp(x_hp, cup, local_sections, group))
        t_seq = timed(lambda: cp2hp_per_sequence(x_cp, cup, sections, group), per_sequence=True)
        t_seq_back = timed(lambda: hp2cp_per_sequence(x_hp, cup, local_sections, group), per_sequence=True)
        if profile:  # every rank profiles (the calls meet in the all-to-all); rank 0 reports
            for name, fn in (
                ("bare a2a", lambda: dist.all_to_all_single(flat_out, flat, group=group)),
                ("cp2hp", lambda: custom_ops.thd_cp2hp(x_cp, cup, sections, group)),
                ("hp2cp", lambda: custom_ops.thd_hp2cp(x_hp, cup, local_sections, group)),
            ):
                parts = kernel_breakdown(fn, runs=5, warmup=1, device=device)
                listed = "; ".join(f"{k[:50]} {ms:.3f}" for k, ms in parts[:6])
                kernels.append([total, num_seqs, name, sum(ms for _, ms in parts), listed])
        mb = x_cp.numel() * x_cp.element_size() / 2**20
        rows.append([total, num_seqs, mb, t_bare, t_peers, t_cp2hp, t_hp2cp, t_seq, t_seq_back, t_cp2hp / t_bare,
                     t_seq / t_cp2hp])  # fmt: skip
        del x_cp, flat, flat_out, x_hp
        torch.cuda.empty_cache()
    if rank == 0:
        env = environment(world)
        name = f"cp2hp{'-smoke' if smoke else ''}-w{world}"
        notes = (f"sections {sections} bf16, equal-length sequences; times in ms (median of {runs} runs, "
                 f"{seq_runs} for per-seq; max over ranks)")  # fmt: skip
        columns = ["T", "seqs", "MiB/rank", "bare a2a", "bare a2a, no self block", "cp2hp", "hp2cp",
                   "per-seq cp2hp", "per-seq hp2cp", "cp2hp / bare", "per-seq / cp2hp"]  # fmt: skip
        formats = {"MiB/rank": "{:.0f}", "cp2hp / bare": "{:.2f}", "per-seq / cp2hp": "{:.1f}"}
        results = [Result("cp2hp", f"Fused CP <-> head-parallel all-to-all, W = {world}", columns, rows, notes,
                          env, name=name, formats=formats)]  # fmt: skip
        if kernels:
            results.append(Result(
                "cp2hp", f"Kernels of one call on rank 0, W = {world}",
                ["T", "seqs", "op", "kernels ms", "slowest kernels (ms)"], kernels,
                "device ms, mean of 5 calls; slowest first", env, name=f"{name}-kernels",
            ))  # fmt: skip
        emit(results, out)


def main() -> None:
    checks_off()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, help="ranks, one GPU each (default: every visible GPU, at least 2)")
    parser.add_argument("--smoke", action="store_true", help="2 gloo ranks on the CPU, tiny shapes, few runs")
    add_out_argument(parser)
    parser.add_argument("--profile", action="store_true", help="also list the kernels of each op per shape")
    args = parser.parse_args()
    world = args.world or (2 if args.smoke else default_world())
    bad = [s for s in (SMOKE_SECTIONS if args.smoke else SECTIONS) if s % world]
    if bad:
        raise SystemExit(f"--world {world} must divide every section width, not {bad}")
    spawn_ranks(_worker, world, args.out, args.smoke, args.profile, device="cpu" if args.smoke else "cuda")


if __name__ == "__main__":
    main()
