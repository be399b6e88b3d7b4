"""Training-step benchmark of examples/train_qwen3_next.py (slice4: four Qwen3-Next-80B-width
layers), CP over W = 1, 2, 4 GPUs of one host at fixed global tokens (strong scaling).

    python -m benchmarks.bench_train                          # W = 1, 2, 4; 32768 and 131072 tokens; graphs off / on
    python -m benchmarks.bench_train --smoke                  # tiny preset, CPU, W = 1, 2, 3 steps

Every run is the recipe itself, started with torchrun (``--dp 1 --cp W --compile``, one run
with ``--cuda-graphs`` and one without), under a timeout, and read back from its ``--log-json``:
the median over the steps after ``--warmup`` of step time (wall, synchronised), host time (until
the step is issued) and GPU time (CUDA events), tokens/s, MFU; the peak memory (max over ranks),
the first step's time (compilation included) and the recompiles after it. Scaling efficiency
is T1 / (W x TW), with T1 measured in the same invocation. The table goes to
``benchmarks/results/train-<preset>.json`` (``--out``); a run that fails or times out is a row
with its status and no numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.runner import RESULTS_DIR, ROOT, Result, environment

SCRIPT = ROOT / "examples" / "train_qwen3_next.py"
COLUMNS = ["tokens", "graphs", "W", "dp", "cp", "step ms", "tokens/s", "scaling", "host ms", "GPU ms",
           "peak GiB", "first step s", "MFU", "recompiles", "status"]  # fmt: skip
FORMATS = {"tokens": "{:d}", "W": "{:d}", "dp": "{:d}", "cp": "{:d}", "step ms": "{:.1f}", "tokens/s": "{:.0f}",
           "scaling": "{:.2f}", "host ms": "{:.1f}", "GPU ms": "{:.1f}", "peak GiB": "{:.1f}",
           "first step s": "{:.1f}", "MFU": "{:.3f}", "recompiles": "{:d}"}  # fmt: skip


def median_of(steps: list[dict], key: str):
    values = [s[key] for s in steps if s.get(key) is not None]
    return statistics.median(values) if values else None


def summarise(log: dict, warmup: int) -> dict:
    """The row's numbers from one run's ``--log-json``."""
    steps = log["steps"][warmup:] or log["steps"][-1:]
    return {
        "step ms": median_of(steps, "step_ms"), "tokens/s": median_of(steps, "tokens_per_s"),
        "host ms": median_of(steps, "host_ms"), "GPU ms": median_of(steps, "gpu_ms"),
        "peak GiB": max(s["peak_mem_gib"] for s in log["steps"]), "MFU": median_of(steps, "mfu"),
        "first step s": log["steps"][0]["step_ms"] / 1e3, "recompiles": log.get("recompiles"),
    }  # fmt: skip


def run_one(world: int, tokens: int, graphs: bool, args: argparse.Namespace, tmp: Path) -> dict:
    """One torchrun of the recipe; its row (``status`` "ok", "failed (rc N)" or "timeout")."""
    log = tmp / f"w{world}-t{tokens}-g{int(graphs)}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world), str(SCRIPT),
           "--preset", args.preset, "--dp", "1", "--cp", str(world), "--tokens-per-step", str(tokens),
           "--steps", str(args.steps), "--max-seqs", str(args.max_seqs), "--log-json", str(log), "--no-progress",
           *(["--compile"] if args.compile else []), *(["--cuda-graphs"] if graphs else []), *args.extra]  # fmt: skip
    row = {"tokens": tokens, "graphs": "on" if graphs else "off", "W": world, "dp": 1, "cp": world}
    print(f"[bench_train] W={world} tokens={tokens} graphs={row['graphs']}: {' '.join(cmd[2:])}", flush=True)
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, timeout=args.timeout, capture_output=True, text=True)
        status = "ok" if proc.returncode == 0 and log.exists() else f"failed (rc {proc.returncode})"
        if status != "ok":
            print(proc.stdout[-2000:] + proc.stderr[-4000:], flush=True)
    except subprocess.TimeoutExpired:
        status = "timeout"
    if status == "ok":
        row.update(summarise(json.loads(log.read_text()), args.warmup))
    row["status"] = status
    numbers = f": step {row['step ms']:.1f} ms, {row['tokens/s']:.0f} tokens/s, peak {row['peak GiB']:.1f} GiB"
    print(f"[bench_train]   {status} in {time.perf_counter() - start:.0f} s" + (numbers if status == "ok" else ""),
          flush=True)  # fmt: skip
    return row


def main(argv: list[str] | None = None) -> Result:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worlds", default="1,2,4", help="CP sizes W (one GPU per rank)")
    p.add_argument("--tokens", default="32768,131072", help="global real tokens per step")
    p.add_argument("--graphs", choices=("off", "on", "both"), default="both", help="runs with --cuda-graphs")
    p.add_argument("--preset", default="slice4")
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the medians")
    p.add_argument("--max-seqs", type=int, default=8)
    p.add_argument("--timeout", type=int, default=1200, help="seconds per run")
    p.add_argument("--out", default=str(RESULTS_DIR))
    p.add_argument("--smoke", action="store_true", help="tiny preset on the CPU, W = 1, 2, eager, 3 steps")
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="further recipe arguments, last")
    args = p.parse_args(argv)
    args.compile = not args.smoke
    if args.smoke:
        args.preset, args.worlds, args.tokens, args.graphs, args.steps, args.warmup = "tiny", "1,2", "256", "off", 3, 1
        args.extra = ["--device", "cpu", *args.extra]
    worlds, token_counts = [int(w) for w in args.worlds.split(",")], [int(t) for t in args.tokens.split(",")]
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.graphs]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for tokens in token_counts:
            for graphs in modes:
                group = [run_one(w, tokens, graphs, args, Path(tmp)) for w in worlds]
                base = next((r["step ms"] for r in group if r["W"] == 1 and r.get("step ms")), None)
                for r in group:
                    r["scaling"] = base / (r["W"] * r["step ms"]) if base and r.get("step ms") else None
                rows += group
    import fla

    result = Result(
        benchmark="train", name=f"train-{args.preset}" + ("-smoke" if args.smoke else ""),
        title=f"Training step of examples/train_qwen3_next.py, preset {args.preset}, CP over W ranks (dp 1)",
        columns=COLUMNS, rows=[[r.get(c) for c in COLUMNS] for r in rows], formats=FORMATS,
        env=environment(world=max(worlds), fla=fla.__version__, torch_threads=os.environ.get("OMP_NUM_THREADS")),
        notes=f"{args.steps} steps, medians after {args.warmup}; scaling = T1 / (W x TW) at the same global "
              f"tokens; host ms = issuing the step, GPU ms = CUDA events around it; first step includes compilation",
    )  # fmt: skip
    print(result.markdown())
    print(f"[bench_train] wrote {result.write(args.out)}")
    return result


if __name__ == "__main__":
    main()
