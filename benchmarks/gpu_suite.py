"""Run the GPU tests and benchmarks in one call and print a short table last.

    python benchmarks/gpu_suite.py [PART ...] [--out DIR]

PARTS (default: every part that fits the visible GPUs):
  tests-1gpu   pytest -m gpu (kernels against their references on CUDA)
  layout       benchmarks/bench_thd_layout.py --sweep
  attention    benchmarks/bench_varlen_attention.py       (if present)
  attention-tune  the same with --tune: kernel configs
  gdn          benchmarks/bench_gdn.py                    (if present)
  a2a          benchmarks/bench_cp2hp.py, needs 2 GPUs    (if present)
  ag-attention benchmarks/bench_ag_attention.py, 2 GPUs   (if present)
  tests-2gpu   pytest -m "gpu and dist" on 2 GPUs         (if any)

Logs and markdown tables go to --out (default $OUT or ./gpu-results).
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
    "layout": (1, [sys.executable, "benchmarks/bench_thd_layout.py", "--sweep", "--out", "{out}/layout.md"]),
    "attention": (1, [sys.executable, "benchmarks/bench_varlen_attention.py"]),
    "attention-tune": (1, [sys.executable, "benchmarks/bench_varlen_attention.py", "--tune"]),
    "gdn": (1, [sys.executable, "benchmarks/bench_gdn.py", "--out", "{out}/gdn.md"]),
    "a2a": (2, [sys.executable, "benchmarks/bench_cp2hp.py", "--out", "{out}/a2a.md"]),
    "ag-attention": (2, [sys.executable, "benchmarks/bench_ag_attention.py", "--out", "{out}/ag_attention.md"]),
    "tests-2gpu": (2, [sys.executable, "-m", "pytest", "-m", "gpu and dist", "-q", "-p", "no:cacheprovider"]),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("parts", nargs="*", help="parts to run")
    parser.add_argument("--out", default=os.environ.get("OUT", os.path.join(ROOT, "gpu-results")))
    parser.add_argument("--timeout", type=int, default=420, help="seconds per part")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    import torch

    gpus = torch.cuda.device_count()
    print(f"{gpus} GPU(s): {[torch.cuda.get_device_name(i) for i in range(gpus)]}, torch {torch.__version__}", flush=True)
    parts = args.parts or [p for p, (need, _) in PARTS.items() if need <= gpus]
    summary = []
    for part in parts:
        need, cmd = PARTS[part]
        cmd = [c.format(out=args.out) for c in cmd]
        script = cmd[1] if cmd[1].endswith(".py") else None
        if script and not os.path.exists(os.path.join(ROOT, script)):
            summary.append((part, "absent", 0.0, ""))
            continue
        if need > gpus:
            summary.append((part, f"needs {need} GPUs", 0.0, ""))
            continue
        print(f"\n===== {part}: {' '.join(cmd)}", flush=True)
        start = time.time()
        with open(os.path.join(args.out, f"{part}.log"), "w") as log:
            try:
                proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      timeout=args.timeout)
                output, status = proc.stdout, "ok" if proc.returncode == 0 else f"rc={proc.returncode}"
            except subprocess.TimeoutExpired as e:
                output, status = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""), "timeout"
            log.write(output)
        print(output[-6000:], flush=True)
        last = [line for line in output.strip().splitlines() if line.strip()][-1:] or [""]
        summary.append((part, status, time.time() - start, last[0][:110]))
    print("\n| part | status | seconds | last line |\n|---|---|---|---|")
    for part, status, secs, last in summary:
        print(f"| {part} | {status} | {secs:.0f} | {last} |")


if __name__ == "__main__":
    main()
