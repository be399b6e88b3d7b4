"""Run the GPU tests and benchmarks in one call and print a short table last.

    python benchmarks/gpu_suite.py [PART ...] [--world W [W ...]] [--out DIR] [--timeout S] [--quick]

PARTS (default: every part that fits the visible GPUs) are the keys of :data:`PARTS`; a
multi-rank part runs once per CP size W (``--world``; default every visible GPU, the NCCL
tests at each of 2, 4, 8 that fits), named PART-wW. Logs and JSON results go to --out
(default $OUT or ./gpu-results); docs/benchmarks.md says what to do with them. ``--quick`` runs
the parts of :data:`QUICK_ARGS` at their smallest case (results in DIR/quick, not for the docs):
a check that every part runs to the end at each W within one machine's time.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bench(module: str, *args: str) -> list[str]:
    """``python -m benchmarks.MODULE ARGS --out {out}``: a benchmark part's command."""
    return [sys.executable, "-m", f"benchmarks.{module}", *args, "--out", "{out}"]


# multi-rank parts (2 or more GPUs): {world} is the CP size, {name} the part's name with it (a2a-w8)
PARTS = {
    "tests-1gpu": (1, [sys.executable, "-m", "pytest", "-m", "gpu and not dist", "-q", "-p", "no:cacheprovider"]),
    "layout": (1, _bench("bench_thd_layout")),
    "attention": (1, _bench("bench_attention", "kernel")),
    "attention-tune": (1, [sys.executable, "-m", "benchmarks.bench_attention", "tune"]),
    "attention-profile": (1, _bench("bench_attention", "kernel", "--profile")),
    "attention-qwen": (1, _bench("bench_attention", "kernel", "--gqa", "8", "--head-dims", "256")),
    # each all-gather CP rank's attention kernels against one GPU's, W = 2, 4 and 8 on one GPU
    "attention-ranks": (1, _bench("bench_attention", "ranks", "--gqa", "8", "--head-dim", "256")),
    "gdn": (1, _bench("bench_gdn", "--kernel-time", "--rank-share", "2", "4")),
    # the GDN core by kernel backend (FLA's, FlashQLA's where installed), and the layer with each
    "gdn-core": (1, _bench("bench_gdn", "--core")),
    "gdn-backends": (1, _bench("bench_gdn", "--tokens", "131072", "--seqs", "8", "--backends", "fla", "flashqla")),
    "conv": (1, _bench("bench_gdn", "--conv")),
    "conv-gather": (1, _bench("bench_gdn", "--conv", "--gather")),
    # the demo's results (every parameter's step-1 error among them) as {out}/{name}.json
    "demo": (1, [sys.executable, "-m", "cp_ops", "demo", "--cp-size", "1", "--json", "{out}/{name}.json"]),
    "cold-start": (1, _bench("bench_host", "--cold-start")),
    # the causal-LM loss: unfused, ours, Liger-Kernel's, cut-cross-entropy's (those installed)
    "loss": (1, _bench("bench_loss")),
    "a2a": (2, _bench("bench_cp2hp", "--world", "{world}", "--profile")),
    "ag-attention": (2, _bench("bench_attention", "cp", "--world", "{world}")),
    "gdn-cp": (2, _bench("bench_gdn", "--cp", "{world}", "--profile")),
    "gdn-cp-graphs": (2, _bench("bench_gdn", "--cp", "{world}", "--compiled-only", "--cudagraphs", "--profile")),
    # one GPU, by heads, by chunk states and FLA's own CP in one run
    "gdn-cp-states": (2, _bench("bench_gdn", "--cp", "{world}", "--compiled-only", "--states", "--fla-cp", "--seqs", "8",
                                "64", "--tokens", "32768", "131072")),
    # NCCL's peer-to-peer and shared-memory transports off: a slow link between the ranks
    "gdn-cp-states-slow-link": (
        2,
        ["env", "NCCL_P2P_DISABLE=1", "NCCL_SHM_DISABLE=1",
         *_bench("bench_gdn", "--cp", "{world}", "--compiled-only", "--states", "--seqs", "8", "64")],
    ),  # fmt: skip
    "ag-attention-graphs": (2, _bench("bench_attention", "cp", "--world", "{world}", "--cudagraphs", "--profile")),
    "ag-attention-qwen": (
        2,
        _bench("bench_attention", "cp", "--world", "{world}", "--gqa", "8", "--head-dim", "256", "--head-groups", "2",
               "--cudagraphs", "--profile"),
    ),  # fmt: skip
    "demo-cp": (2, [sys.executable, "-m", "cp_ops", "demo", "--cp-size", "{world}", "--json", "{out}/{name}.json"]),
    "train": (2, _bench("bench_train", "--worlds", "1,{world}")),
    "train-curves": (4, _bench("bench_train", "--curves")),
    "train-replay": (2, _bench("bench_train", "--replay", "{world}")),
    # transformers' Trainer with CP (examples/sft_qwen3_next_trainer.py) beside the recipe, one GPU and W
    "train-trainer": (2, _bench("bench_trainer", "--worlds", "1,{world}")),
    # where the step's time goes, one GPU against W, without CUDA graphs (the profiler sees each kernel)
    "train-profile": (2, _bench("bench_train", "--worlds", "1,{world}", "--tokens", "32768", "--graphs", "off",
                                "--steps", "8", "--warmup", "3", "--profile")),
    "tests-dist": (
        2,
        [sys.executable, "-m", "pytest", "tests/cp_ops/test_gpu_multi_rank.py", "tests/cp_ops/test_attention_fa4.py",
         "tests/test_bench_fla_baseline.py", "-m", "gpu and dist", "-k", "W{world}", "-q", "-p", "no:cacheprovider"],
    ),  # fmt: skip
}
# parts that need longer than the default --timeout: seconds, used where --timeout is shorter
# (tests-dist: a dozen NCCL tests, each spawning its ranks, about 100 s apiece on cold caches)
PART_TIMEOUTS = {"cold-start": 1800, "train": 1800, "train-trainer": 1800, "train-curves": 900, "tests-dist": 1800}
TEST_WORLDS = (2, 4, 8)
# --quick: arguments appended to a part's command (later options replace earlier ones), the
# smallest case of each part that has sizes; the others run as they are
QUICK_ARGS = {
    "ag-attention": ["--tokens", "32768"],
    "ag-attention-graphs": ["--tokens", "32768"],
    "ag-attention-qwen": ["--tokens", "32768"],
    "gdn-cp": ["--tokens", "32768", "--seqs", "8"],
    "gdn-cp-graphs": ["--tokens", "32768", "--seqs", "8"],
    "gdn-cp-states": ["--tokens", "32768", "--seqs", "8"],
    "gdn-cp-states-slow-link": ["--tokens", "32768", "--seqs", "8"],
    "demo-cp": ["--steps", "3"],
    "train": ["--tokens", "32768", "--graphs", "on", "--steps", "6", "--warmup", "2"],
    "train-curves": ["--steps", "6"],
    "train-replay": ["--steps", "4"],
    "train-trainer": ["--steps", "6", "--warmup", "2"],
    "train-profile": ["--steps", "5", "--warmup", "2"],
}


def _module_file(template: list[str]) -> str | None:
    """The file of the benchmark module a part runs (``-m benchmarks.X``), None for other commands."""
    if template[1] == "-m" and template[2].startswith("benchmarks."):
        return template[2].replace(".", "/") + ".py"
    return None


def runs_of(part: str, worlds: list[int] | None, gpus: int) -> list[tuple[str, int, int | None]]:
    """``(name, GPUs needed, W)`` for each run of ``part``: one for a one-GPU part, one per W otherwise."""
    need, template = PARTS[part]
    if need < 2 or not any("{world}" in arg for arg in template):  # a fixed number of GPUs
        return [(part, need, None)]
    if worlds is None:
        worlds = ([w for w in TEST_WORLDS if w <= gpus] or [2]) if part == "tests-dist" else [max(2, gpus)]
    return [(f"{part}-w{w}", w, w) for w in worlds]


def part_command(part: str, out: str, world: int | None, name: str, quick: bool = False) -> list[str]:
    """The command of one run of ``part`` (``world``: its CP size, None for a one-GPU part)."""
    _, template = PARTS[part]
    return [c.format(out=out, world=world, name=name) for c in template] + (QUICK_ARGS.get(part, []) if quick else [])


def child_pythonpath(existing: str | None) -> str:
    """The parts' PYTHONPATH: the repository's root, so that the parts run this checkout's library
    whatever is installed, before ``existing``."""
    return os.pathsep.join(p for p in (ROOT, existing) if p)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("parts", nargs="*", help=f"parts to run, of: {' '.join(PARTS)}")
    parser.add_argument("--world", type=int, nargs="+", help="CP sizes for the multi-rank parts")
    parser.add_argument("--out", default=os.environ.get("OUT", os.path.join(ROOT, "gpu-results")))
    parser.add_argument("--timeout", type=int, default=420, help="seconds per part (per run of a multi-rank part)")
    parser.add_argument("--quick", action="store_true",
                        help="each part at its smallest case (QUICK_ARGS), results in OUT/quick")
    args = parser.parse_args()
    parts = args.parts
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        parser.error(f"unknown parts {unknown}; choose from {list(PARTS)}")
    if args.quick:
        args.out = os.path.join(args.out, "quick")
    os.makedirs(args.out, exist_ok=True)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    # Most of a cold run is Triton compiling and FLA autotuning the same kernels in every part
    # and every rank process; keep the autotuning results on disk so later processes reuse them.
    os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")
    os.environ["PYTHONPATH"] = child_pythonpath(os.environ.get("PYTHONPATH"))
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
            cmd = part_command(part, args.out, world, name, args.quick)
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
