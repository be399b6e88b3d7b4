"""Run the GPU tests and benchmarks in one call and print a short table last.

    python benchmarks/gpu_suite.py [PART ...] [--world W [W ...]] [--out DIR] [--timeout S]

PARTS (default: every part that fits the visible GPUs):
  tests-1gpu      pytest -m "gpu and not dist" (kernels against their references on CUDA)
  layout          python -m benchmarks.bench_thd_layout
  attention       python -m benchmarks.bench_varlen_attention       (if present)
  attention-tune  the same with --tune: kernel configs
  attention-profile  the same with --profile: CUDA time per kernel
  attention-qwen  the same at Qwen3-Next's attention heads: H = 16, Hkv = 2, D = 256
  gdn             benchmarks/bench_gdn.py: the layer on one GPU, T = 32768 and 65536, with kernel
                  times and the pieces one rank runs at W = 2 and 4
  conv            benchmarks/bench_gdn.py --conv: the conv kernels against FLA's
  conv-gather     the same with --gather: the conv on rows in rank order against reorder + conv
  demo            python -m cp_ops demo --cp-size 1 (the hybrid stack on one GPU)
  cold-start      benchmarks/bench_host.py --cold-start: the demo and a GDN layer in fresh processes on
                  empty caches, then warm (time to the end of step 1, compile, steady step)
  a2a             benchmarks/bench_cp2hp.py --world W --profile        multi-rank, >= 2 GPUs
  ag-attention    benchmarks/bench_ag_attention.py --world W           multi-rank, >= 2 GPUs
  gdn-cp          benchmarks/bench_gdn.py --cp W --profile              multi-rank, >= 2 GPUs
  gdn-cp-graphs   the same, compiled rows only, with CUDA graphs        multi-rank, >= 2 GPUs
  ag-attention-graphs  bench_ag_attention.py --cudagraphs --profile     multi-rank, >= 2 GPUs
  ag-attention-qwen    the same at Qwen3-Next's attention heads: Hkv = 2 (--gqa 8), D = 256
  demo-cp         python -m cp_ops demo --cp-size W                     multi-rank, >= 2 GPUs
  train           benchmarks/bench_train.py --worlds 1,W: the training recipe's step, W = 1 and W,
                  32768 and 131072 tokens, CUDA graphs off and on         multi-rank, >= 2 GPUs
  train-curves    benchmarks/bench_train.py --curves: loss curves on 1 GPU, (dp 1, cp 4),
                  (dp 2, cp 2), and the resume from the middle checkpoint        4 GPUs
  tests-dist      pytest -m "gpu and dist" -k W<W> (NCCL tests at W)   multi-rank, >= 2 GPUs
                  ("tests-2gpu" is accepted as its old name)

A part runs for --timeout seconds at most, or for its own limit in PART_TIMEOUTS where that
is longer (cold-start runs several fresh processes that each compile from nothing).

Multi-rank parts run once per CP size W, each run with its own timeout and named
PART-wW in the summary and logs (a2a-w8.log, ...). The sizes are
--world's; without it, the benchmarks run at W = every visible GPU and tests-dist at
each of 2, 4, 8 that fits. For a scaling series on an 8-GPU host:
``a2a gdn-cp --world 2 4 8`` (parts before --world). Sizes above the visible GPU count
are reported as skipped.

Logs go to --out (default $OUT or ./gpu-results), and so do the benchmarks' results as
JSON files (benchmarks/runner.py: one file per table, named after the benchmark, e.g.
layout.json, cp2hp-w8.json). Copy those to benchmarks/results/ and run
``python -m benchmarks.report`` to render docs/benchmarks.md's tables from them, and
``python -m benchmarks.plots`` for the pictures. The benchmarks run as modules of the
repository's root (``python -m benchmarks.NAME``, with the root on PYTHONPATH), so the
package need not be installed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PARTS = {
    "tests-1gpu": (1, [sys.executable, "-m", "pytest", "-m", "gpu and not dist", "-q", "-p", "no:cacheprovider"]),
    "layout": (1, [sys.executable, "-m", "benchmarks.bench_thd_layout", "--out", "{out}"]),
    "attention": (1, [sys.executable, "-m", "benchmarks.bench_varlen_attention", "--out", "{out}"]),
    "attention-tune": (1, [sys.executable, "-m", "benchmarks.bench_varlen_attention", "--tune"]),
    "attention-profile": (1, [sys.executable, "-m", "benchmarks.bench_varlen_attention", "--profile", "--out", "{out}"]),
    "attention-qwen": (
        1,
        [sys.executable, "-m", "benchmarks.bench_varlen_attention", "--gqa", "8", "--head-dims", "256", "--out", "{out}"],
    ),
    "gdn": (
        1,
        [sys.executable, "-m", "benchmarks.bench_gdn", "--kernel-time", "--rank-share", "2", "4", "--out", "{out}"],
    ),
    "conv": (1, [sys.executable, "-m", "benchmarks.bench_gdn", "--conv", "--out", "{out}"]),
    "conv-gather": (1, [sys.executable, "-m", "benchmarks.bench_gdn", "--conv", "--gather", "--out", "{out}"]),
    "demo": (1, [sys.executable, "-m", "cp_ops", "demo", "--cp-size", "1"]),
    "cold-start": (1, [sys.executable, "-m", "benchmarks.bench_host", "--cold-start", "--out", "{out}"]),
    # multi-rank: {world} is the CP size, {name} the part's name with it (a2a-w8)
    "a2a": (
        2,
        [sys.executable, "-m", "benchmarks.bench_cp2hp", "--world", "{world}", "--profile", "--out", "{out}"],
    ),
    "ag-attention": (
        2,
        [sys.executable, "-m", "benchmarks.bench_ag_attention", "--world", "{world}", "--out", "{out}"],
    ),
    "gdn-cp": (
        2,
        [sys.executable, "-m", "benchmarks.bench_gdn", "--cp", "{world}", "--profile", "--out", "{out}"],
    ),
    "gdn-cp-graphs": (
        2,
        [sys.executable, "-m", "benchmarks.bench_gdn", "--cp", "{world}", "--compiled-only", "--cudagraphs", "--profile",
         "--out", "{out}"],
    ),  # fmt: skip
    "ag-attention-graphs": (
        2,
        [sys.executable, "-m", "benchmarks.bench_ag_attention", "--world", "{world}", "--cudagraphs", "--profile",
         "--out", "{out}"],
    ),  # fmt: skip
    "ag-attention-qwen": (
        2,
        [sys.executable, "-m", "benchmarks.bench_ag_attention", "--world", "{world}", "--gqa", "8", "--head-dim", "256",
         "--head-groups", "2", "--cudagraphs", "--profile", "--out", "{out}"],
    ),  # fmt: skip
    "demo-cp": (2, [sys.executable, "-m", "cp_ops", "demo", "--cp-size", "{world}"]),
    "train": (2, [sys.executable, "-m", "benchmarks.bench_train", "--worlds", "1,{world}", "--out", "{out}"]),
    "train-curves": (4, [sys.executable, "-m", "benchmarks.bench_train", "--curves", "--out", "{out}"]),
    "tests-dist": (
        2,
        [sys.executable, "-m", "pytest", "tests/cp_ops/test_gpu_multi_rank.py", "-m", "gpu and dist", "-k",
         "W{world}", "-q", "-p", "no:cacheprovider"],
    ),  # fmt: skip
}
ALIASES = {"tests-2gpu": "tests-dist"}
# parts that need longer than the default --timeout: seconds, used where --timeout is shorter
PART_TIMEOUTS = {"cold-start": 1800, "train": 1800, "train-curves": 900}
TEST_WORLDS = (2, 4, 8)


def _module_file(template: list[str]) -> str | None:
    """The file of the benchmark module a part runs (``-m benchmarks.X``), None for other commands."""
    if template[1] == "-m" and template[2].startswith("benchmarks."):
        return template[2].replace(".", "/") + ".py"
    return None


def runs_of(part: str, worlds: list[int] | None, gpus: int) -> list[tuple[str, int, int | None]]:
    """``(name, GPUs needed, W)`` for each run of ``part``: one for a one-GPU part, one per W otherwise."""
    need, template = PARTS[part]
    if need < 2 or "{world}" not in template:  # a fixed number of GPUs
        return [(part, need, None)]
    if worlds is None:
        worlds = ([w for w in TEST_WORLDS if w <= gpus] or [2]) if part == "tests-dist" else [max(2, gpus)]
    return [(f"{part}-w{w}", w, w) for w in worlds]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("parts", nargs="*", help="parts to run")
    parser.add_argument("--world", type=int, nargs="+", help="CP sizes for the multi-rank parts")
    parser.add_argument("--out", default=os.environ.get("OUT", os.path.join(ROOT, "gpu-results")))
    parser.add_argument("--timeout", type=int, default=420, help="seconds per part (per run of a multi-rank part)")
    args = parser.parse_args()
    parts = [ALIASES.get(p, p) for p in args.parts]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        parser.error(f"unknown parts {unknown}; choose from {list(PARTS)}")
    os.makedirs(args.out, exist_ok=True)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    # Most of a cold run is Triton compiling and FLA autotuning the same kernels in every part
    # and every rank process; keep the autotuning results on disk so later processes reuse them.
    os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    import torch

    gpus = torch.cuda.device_count()
    names = [torch.cuda.get_device_name(i) for i in range(gpus)]
    print(f"{gpus} GPU(s): {names}, torch {torch.__version__}", flush=True)
    parts = parts or [p for p, (need, _) in PARTS.items() if need <= gpus]
    summary = []
    for part in parts:
        _, template = PARTS[part]
        script = _module_file(template)
        for name, need, world in runs_of(part, args.world, gpus):
            if script and not os.path.exists(os.path.join(ROOT, script)):
                summary.append((name, "absent", 0.0, ""))
                continue
            if need > gpus:
                summary.append((name, f"needs {need} GPUs", 0.0, ""))
                continue
            cmd = [c.format(out=args.out, world=world, name=name) for c in template]
            print(f"\n===== {name}: {' '.join(cmd)}", flush=True)
            start = time.time()
            with open(os.path.join(args.out, f"{name}.log"), "w") as log:
                try:
                    proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                          timeout=max(args.timeout, PART_TIMEOUTS.get(part, 0)))  # fmt: skip
                    output, status = proc.stdout, "ok" if proc.returncode == 0 else f"rc={proc.returncode}"
                except subprocess.TimeoutExpired as e:
                    output = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
                    status = "timeout"
                log.write(output)
            print(output[-6000:], flush=True)
            last = [line for line in output.strip().splitlines() if line.strip()][-1:] or [""]
            summary.append((name, status, time.time() - start, last[0][:110]))
    print("\n| part | status | seconds | last line |\n|---|---|---|---|")
    for name, status, secs, last in summary:
        print(f"| {name} | {status} | {secs:.0f} | {last} |")


if __name__ == "__main__":
    main()
