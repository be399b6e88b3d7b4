"""All-gather CP attention on 2 GPUs (NCCL) against segment attention on one GPU.

For packed documents of mixed lengths (benchmarks/bench_varlen_attention.packed_lengths)
totalling 32768 and 65536 real tokens globally, bf16, causal, H = 16 query heads
(Hkv = H / --gqa), D = 128:

  1 GPU      custom_ops.varlen_attention over the whole global batch (q_pos = 0 segments),
             timed on rank 0 while rank 1 waits
  W=2 1L     cp_ops.ag_thd_attention on each rank's shard, one launch (both local chunks)
  W=2 2L     the same with launches=2 (one launch per local chunk + thd_copy_valid_tokens)
  all-gather the K,V all-gather alone (the communication part of the forward)

Forward (no autograd) and forward+backward times are medians over many runs timed
with CUDA events, after warm-up, with a fixed run count on every rank (the ranks
meet in every all-gather), and the maximum of that median over the ranks. Scaling
efficiency = T_1 / (W * T_W): 1.0 when W GPUs run W times faster than one.
Before timing, each CP form is checked against the one-GPU result (bf16 rel_error).

    python benchmarks/bench_ag_attention.py [--gqa 1] [--out FILE]

spawns one process per GPU itself (2 GPUs), prints a markdown table and, with
--out, writes it to FILE as well.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import custom_ops  # noqa: E402
from benchmarks.bench_varlen_attention import packed_lengths  # noqa: E402
from benchmarks.common import environment, free_port, max_over_ranks, median_ms_counted  # noqa: E402
from cp_ops import ag_thd_attention, all_gather_rows, pad_cu_seqlens, resolve_group, shard_thd  # noqa: E402
from custom_ops.testing import TOLERANCE, rel_error  # noqa: E402

WORLD = 2
TOTALS = (32768, 65536)
HEADS, HEAD_DIM = 16, 128
DTYPE = torch.bfloat16






def _fwd_and_step(fn, q, k, v, dout):
    """Two closures: the forward alone, and forward + backward to q, k, v."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]

    def fwd():
        with torch.no_grad():
            fn(q, k, v)

    def step():
        torch.autograd.grad(fn(*leaves), leaves, dout)

    return fwd, step


def _timed(fn, warmup: int = 5, runs: int = 40) -> float:
    return median_ms_counted(fn, warmup, runs)


def _worker(rank: int, world: int, port: int, gqa: int, out: str | None) -> None:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    group = dist.group.WORLD
    group_name, _ = resolve_group(group)
    kv_heads = HEADS // gqa
    rows = []
    try:
        for total in TOTALS:
            lens = packed_lengths(total)
            cu, cup = pad_cu_seqlens(lens, world, device="cuda")
            num_rows = int(cup[-1])
            gen = torch.Generator(device="cuda").manual_seed(0)  # one global batch on every rank

            def rand(h):
                return torch.randn(num_rows, h, HEAD_DIM, device="cuda", generator=gen).to(DTYPE)

            q, k, v, dout = rand(HEADS), rand(kv_heads), rand(kv_heads), rand(HEADS)
            lengths, starts = cu[1:] - cu[:-1], cup[:-1]
            seg = (starts, lengths, torch.zeros_like(lengths), starts, lengths)

            def one_gpu(q_, k_, v_):
                return custom_ops.varlen_attention(q_, k_, v_, *seg, causal=True)[0]

            local = [shard_thd(t, cup, world, rank) for t in (q, k, v, dout)]

            def cp_fn(launches):
                def fn(q_, k_, v_):
                    return ag_thd_attention(q_, k_, v_, cu, cup, causal=True, group=group, launches=launches)

                return fn

            with torch.no_grad():
                want = shard_thd(one_gpu(q, k, v), cup, world, rank)
                for launches in (1, 2):
                    err = rel_error(cp_fn(launches)(*local[:3]), want)
                    if err > TOLERANCE[DTYPE]:
                        raise AssertionError(f"T={total} launches={launches}: rel_error {err:.3g} against one GPU")

            # one GPU: rank 0 alone; the other rank waits at the barrier
            t1 = [0.0, 0.0]
            if rank == 0:
                fwd, step = _fwd_and_step(one_gpu, q, k, v, dout)
                t1 = [_timed(fwd), _timed(step)]
            dist.barrier()
            del q, k, v, dout
            torch.cuda.empty_cache()

            times = {}
            for launches in (1, 2):
                fwd, step = _fwd_and_step(cp_fn(launches), *local)
                times[launches] = [max_over_ranks(_timed(fwd)), max_over_ranks(_timed(step))]
            kv_cp = torch.cat([local[1], local[2]], dim=1)

            def gather():
                gathered = all_gather_rows(kv_cp, group_name)
                # eager functional collectives return a tensor that waits on first use: wait here,
                # so the end event is recorded after the transfer
                if isinstance(gathered, funcol.AsyncCollectiveTensor):
                    gathered.wait()

            t_ag = max_over_ranks(_timed(gather))
            for label, idx in (("fwd", 0), ("fwd+bwd", 1)):
                w1, w2 = times[1][idx], times[2][idx]
                rows.append((total, len(lens), label, t1[idx], w1, w2, t1[idx] / (world * w1),
                             t1[idx] / (world * w2), w2 / w1, t_ag if idx == 0 else float("nan")))  # fmt: skip
            del local, kv_cp
            torch.cuda.empty_cache()

        if rank == 0:
            lines = [
                f"{environment()}, {world} GPUs (NCCL)",
                f"ag_thd_attention, {str(DTYPE).removeprefix('torch.')}, causal, H = {HEADS}, Hkv = {kv_heads}, "
                f"D = {HEAD_DIM}; T = real tokens of the global batch (packed documents); times in ms, median "
                "over 40 runs, max over ranks; eff = T_1 / (W * T_W)\n",
                "| T | docs | pass | 1 GPU | W=2 1 launch | W=2 2 launches | eff 1L | eff 2L | 2L / 1L | KV all-gather |",
                "|---|---|---|---|---|---|---|---|---|---|",
            ]
            for r in rows:
                ag = "" if r[9] != r[9] else f"{r[9]:.3f}"
                lines.append(
                    f"| {r[0]} | {r[1]} | {r[2]} | {r[3]:.3f} | {r[4]:.3f} | {r[5]:.3f} | {r[6]:.2f} | {r[7]:.2f} "
                    f"| {r[8]:.2f} | {ag} |"
                )
            print("\n".join(lines))
            if out:
                with open(out, "w") as f:
                    f.write("\n".join(lines) + "\n")
    finally:
        dist.destroy_process_group()




def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gqa", type=int, default=1, help="query heads per kv head (Hkv = 16 / gqa)")
    parser.add_argument("--out", help="also write the table to this markdown file")
    args = parser.parse_args()
    if HEADS % args.gqa:
        raise SystemExit(f"--gqa must divide {HEADS}")
    if torch.cuda.device_count() < WORLD:
        raise SystemExit(f"needs {WORLD} GPUs, found {torch.cuda.device_count()}")
    # set here as well so the spawned workers inherit them before any NCCL initialisation
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    torch.multiprocessing.spawn(_worker, args=(WORLD, free_port(), args.gqa, args.out), nprocs=WORLD, join=True)


if __name__ == "__main__":
    main()
