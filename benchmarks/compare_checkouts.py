"""Time the segment-attention kernels of two checkouts of this repository, in alternating processes.

    git worktree add /tmp/base b0c5e11
    python benchmarks/compare_checkouts.py /tmp/base . --head-dims 128 64 --rounds 3

For changes the benchmark's variants cannot switch off in one process (the ops of two
checkouts register under the same names, so a process holds one checkout). Each round runs
one process per checkout, in turn; each times, on the packed and dense cases of its own
``benchmarks/bench_varlen_attention.py`` (bf16, causal, 16 heads), the forward op (the median
of three do_bench medians) and the backward's dq and dk/dv kernels (profiler, 20 calls).
Prints the medians over rounds and the speedup of the second checkout against the first.
Both checkouts need ``packed_lengths`` and ``op_inputs`` in that script (since 2026-11-25).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CASES = ("packed 32k", "dense B8 x 4096")
KINDS = ("fwd", "dq", "dkdv")


def child(tree: str, head_dims: list[int]) -> None:
    """Time ``tree``'s kernels; one JSON line per (head dim, case)."""
    sys.path.insert(0, tree)
    import torch
    import triton

    from benchmarks import bench_varlen_attention as bench
    from benchmarks.common import kernel_breakdown

    if not torch.cuda.is_available():
        raise SystemExit("this comparison needs a CUDA device")
    if not bench.custom_ops.__file__.startswith(os.path.join(tree, "")):
        raise SystemExit(f"imported {bench.custom_ops.__file__}, not the checkout {tree}")
    for d in head_dims:
        for case, lens in zip(CASES, (bench.packed_lengths(), [4096] * 8)):
            q, k, v, seg, out, lse, dout, dlse = bench.op_inputs(lens, d, 1, torch.device("cuda"))

            def fwd():
                return torch.ops.cp_ops.varlen_attention(q, k, v, *seg, True)

            def bwd():
                return torch.ops.cp_ops.varlen_attention_backward(dout, dlse, q, k, v, out, lse, *seg, True)

            fwd(), bwd()  # compile outside the timing
            ms = {"fwd": statistics.median(
                triton.testing.do_bench(fwd, warmup=10, rep=200, return_mode="median") for _ in range(3)
            )}  # fmt: skip
            for name, t in kernel_breakdown(bwd, runs=20):
                for kind in KINDS[1:]:
                    if f"bwd_{kind}_kernel" in name:
                        ms[kind] = ms.get(kind, 0.0) + t
            print("TIMES", json.dumps({"d": d, "case": case, **ms}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("base", help="the checkout to compare against")
    parser.add_argument("new", help="the checkout to time against it")
    parser.add_argument("--head-dims", type=int, nargs="+", default=[128, 64])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    trees = [os.path.abspath(args.base), os.path.abspath(args.new)]
    if args.child:
        return child(trees[0], args.head_dims)
    times: dict = {}
    for _ in range(args.rounds):
        for i, tree in enumerate(trees):
            cmd = [sys.executable, os.path.abspath(__file__), tree, tree, "--child", "--head-dims"]
            run = subprocess.run(cmd + [str(d) for d in args.head_dims], capture_output=True, text=True)
            if run.returncode:
                raise SystemExit(f"{tree}: exit {run.returncode}\n{run.stderr[-3000:]}")
            for line in run.stdout.splitlines():
                if line.startswith("TIMES "):
                    r = json.loads(line[6:])
                    for kind in KINDS:
                        times.setdefault((r["d"], r["case"], kind, i), []).append(r[kind])
    print(f"base {trees[0]}, new {trees[1]}; medians of {args.rounds} rounds (ms), in brackets base / new")
    print()
    print("| case | D | fwd base / new | dq base / new | dk/dv base / new |")
    print("| --- | --- | --- | --- | --- |")
    for d in args.head_dims:
        for case in CASES:
            cells = []
            for kind in KINDS:
                base, new = (statistics.median(times[(d, case, kind, i)]) for i in (0, 1))
                cells.append(f"{base:.3f} / {new:.3f} ({base / new:.3f})")
            print(f"| {case} | {d} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
