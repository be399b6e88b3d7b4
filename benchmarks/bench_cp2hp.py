"""CP <-> head-parallel conversion on 2 GPUs (NCCL): the fused one-all-to-all ops against the
per-sequence, per-section scheme and against a bare all-to-all of the same bytes.

For each shape (Qwen3-Next GDN in_proj sections, bf16, W = 2):
  bare     dist.all_to_all_single on an already-contiguous [T, F/W] send buffer: the floor
  cp2hp    cp_ops.thd_cp2hp (section permutation fused into the send buffer, one
           all-to-all, rank -> sequence order on the receive side)
  hp2cp    cp_ops.thd_hp2cp, the inverse
  per-seq  one all-to-all per sequence and per section, eager (cp2hp_per_sequence below)
Each time is the median over many runs after warm-up, timed with CUDA events, and the
maximum of that median over the ranks (the slower rank sets the pace).

    python benchmarks/bench_cp2hp.py

spawns one process per GPU itself (2 GPUs) and prints a markdown table; it writes no files.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import cp_ops  # noqa: E402
from benchmarks.common import free_port, max_over_ranks, median_ms_counted  # noqa: E402
from cp_ops import pad_cu_seqlens  # noqa: E402

SECTIONS = [2048, 2048, 4096, 4096, 32, 32]  # Qwen3-Next GDN: q, k, v, z, b, a
SHAPES = [(32768, 8), (32768, 64), (131072, 128)]  # (T, number of sequences)
WORLD = 2


def cp2hp_per_sequence(x_cp: torch.Tensor, cu_seqlens_padded: torch.Tensor, sections, group) -> torch.Tensor:
    """The baseline: ``thd_cp2hp`` with one all-to-all per sequence and per section (eager).

    For each sequence i (local rows ``[cup[i]/W, cup[i+1]/W)``: chunks r and 2W-1-r) and each
    section: split the section's columns into W slices, all-to-all them, and put the received
    chunks back in sequence order. Reads the layout on the host (``.tolist()``).
    Returns what ``thd_cp2hp`` returns: ``[T, ..., F/W]``, sequence order.
    """
    world = group.size()
    cup = cu_seqlens_padded.tolist()
    offsets = [sum(sections[:b]) for b in range(len(sections))]
    seqs = []
    for i in range(len(cup) - 1):
        rows = x_cp[cup[i] // world : cup[i + 1] // world]  # [2c, ..., F]
        c = (cup[i + 1] - cup[i]) // (2 * world)
        if c == 0:
            continue
        parts = []
        for off, width in zip(offsets, sections):
            local = width // world
            if local == 0:  # nothing to exchange for an empty section
                parts.append(rows.new_empty((2 * world * c,) + tuple(rows.shape[1:-1]) + (0,)))
                continue
            send = rows[..., off : off + width].unflatten(-1, (world, local)).movedim(-2, 0).contiguous()
            recv = torch.empty_like(send)  # [W, 2c, ..., local]: recv[d] = rank d's two chunks
            dist.all_to_all_single(recv, send, group=group)
            chunks = [None] * (2 * world)
            for d in range(world):
                chunks[d], chunks[2 * world - 1 - d] = recv[d, :c], recv[d, c:]
            parts.append(torch.cat(chunks))
        seqs.append(torch.cat(parts, dim=-1))
    if not seqs:
        return x_cp.new_empty((x_cp.shape[0] * world,) + tuple(x_cp.shape[1:-1]) + (x_cp.shape[-1] // world,))
    return torch.cat(seqs)






def _timed(fn, warmup: int = 5, runs: int = 30) -> float:
    return median_ms_counted(fn, warmup, runs)


def _worker(rank: int, world: int, port: int, out: str | None) -> None:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    group = dist.group.WORLD
    rows = []
    try:
        features = sum(SECTIONS)
        local_sections = [s // world for s in SECTIONS]
        for total, num_seqs in SHAPES:
            _, cup = pad_cu_seqlens([total // num_seqs] * num_seqs, world, device="cuda")
            gen = torch.Generator(device="cuda").manual_seed(rank)
            x_cp = torch.randn(total // world, features, device="cuda", generator=gen).to(torch.bfloat16)
            flat = torch.randn(total, features // world, device="cuda", generator=gen).to(torch.bfloat16)
            flat_out = torch.empty_like(flat)

            x_hp = cp_ops.thd_cp2hp(x_cp, cup, SECTIONS, group)
            if not torch.equal(cp2hp_per_sequence(x_cp, cup, SECTIONS, group), x_hp):
                raise AssertionError(f"per-sequence baseline and thd_cp2hp disagree at T={total}, B={num_seqs}")
            if not torch.equal(cp_ops.thd_hp2cp(x_hp, cup, local_sections, group), x_cp):
                raise AssertionError(f"thd_hp2cp(thd_cp2hp(x)) != x at T={total}, B={num_seqs}")

            t_bare = max_over_ranks(_timed(lambda: dist.all_to_all_single(flat_out, flat, group=group)))
            t_cp2hp = max_over_ranks(_timed(lambda: cp_ops.thd_cp2hp(x_cp, cup, SECTIONS, group)))
            t_hp2cp = max_over_ranks(_timed(lambda: cp_ops.thd_hp2cp(x_hp, cup, local_sections, group)))
            t_seq = max_over_ranks(
                _timed(lambda: cp2hp_per_sequence(x_cp, cup, SECTIONS, group), warmup=2, runs=10)
            )
            mb = x_cp.numel() * x_cp.element_size() / 2**20
            rows.append((total, num_seqs, mb, t_bare, t_cp2hp, t_hp2cp, t_seq, t_cp2hp / t_bare, t_seq / t_cp2hp))
            del x_cp, flat, flat_out, x_hp
            torch.cuda.empty_cache()
        if rank == 0:
            import triton

            lines = [
                f"{torch.cuda.get_device_name()} x {world}, torch {torch.__version__}, triton {triton.__version__}, "
                f"CUDA {torch.version.cuda}, {datetime.date.today().isoformat()}",
                f"sections {SECTIONS} bf16, equal-length sequences; times in ms (median, max over ranks)\n",
                "| T | seqs | MiB/rank | bare a2a | cp2hp | hp2cp | per-seq | cp2hp / bare | per-seq / cp2hp |",
                "|---|---|---|---|---|---|---|---|---|",
            ]
            lines += ["| {} | {} | {:.0f} | {:.3f} | {:.3f} | {:.3f} | {:.3f} | {:.2f} | {:.1f} |".format(*r) for r in rows]
            print("\n".join(lines))
            if out:
                with open(out, "w") as f:
                    f.write("\n".join(lines) + "\n")
    finally:
        dist.destroy_process_group()




def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the table to this markdown file")
    args = parser.parse_args()
    if torch.cuda.device_count() < WORLD:
        raise SystemExit(f"needs {WORLD} GPUs, found {torch.cuda.device_count()}")
    # set here as well so the spawned workers inherit them before any NCCL initialisation
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    torch.multiprocessing.spawn(_worker, args=(WORLD, free_port(), args.out), nprocs=WORLD, join=True)


if __name__ == "__main__":
    main()
