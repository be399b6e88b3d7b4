"""What a user waits the first time and the second time: the demo and a GatedDeltaNet layer,
each in fresh processes on empty caches (cold), then again on the caches the first run left (warm).

    python -m benchmarks.bench_cold_start [--parts demo layer] [--keep-autotuning] [--unseeded]
                                          [--timeout S] [--out DIR]
    python -m benchmarks.bench_cold_start --smoke     # the CPU: a tiny layer
    python -m benchmarks.bench_cold_start --smoke --parts demo layer   # and a short compiled demo

Every run is a subprocess of its own. Each part gets new, empty cache directories, shared by
its cold and its warm runs and removed at the end: ``TRITON_CACHE_DIR`` and
``TORCHINDUCTOR_CACHE_DIR`` (Triton's kernels; Inductor's FX graph, AOTAutograd and code
caches) and ``CUDA_CACHE_PATH`` (the driver's JIT cache). ``TRITON_CACHE_AUTOTUNING`` is
removed from the children's environment, as a user's shell would not have it; with
``--keep-autotuning`` it is 1, so Triton keeps autotuning results (FLA's kernels') on disk and
the warm run does not autotune again (result ``cold-start-keep-autotuning``). ``--unseeded``
adds a third run of each part, cold on caches of its own, with ``CP_OPS_FLA_CONFIGS=0``: FLA
autotunes every kernel as it would without the recorded choices of
``custom_ops.gdn.fla_configs`` (the baseline, run last so that it, not the measured cold run,
finds the operating system's file cache warm). Not reset: the
operating system's file cache (a cold run on a fresh machine also reads torch from disk) and
Python's bytecode caches.

demo   ``python -m cp_ops demo --cp-size 1`` with its device defaults (``--smoke``: on the CPU,
       ``--steps 2 --blocks 1 --seqlens 64,0,1,40``). Its stdout and stderr are read as they
       come, each piece (a line, or a progress-bar update ended by ``\\r``) stamped with the
       seconds since the subprocess was started (:func:`stamp_output`); :func:`parse_demo` reads:

         to step 1       subprocess start to the first progress update that counts step 1
                         done (tqdm's ``1/N``, or the demo's own bar's); the target: at most
                         60 s on a fresh H100
         to training     subprocess start to the demo's "training on ..." line (imports, model)
         compile         the demo's own "compile time" (step 1 minus the median step)
         step            the demo's "step time" (median step after step 1)
         total           subprocess start to its exit

layer  GatedDeltaNet at Qwen3-Next-80B's widths (hidden 2048, Hk 16, Hv 32, dk = dv = 128), bf16,
       on one GPU, T = 32768 tokens in 8 sequences of random lengths
       (``benchmarks.cases.random_lengths``); ``--smoke``: a tiny layer in float32 on the CPU.
       Two children, each run cold then warm (``--child eager`` / ``--child compiled``):

         eager      subprocess start to ``cp_ops`` imported; the first eager forward; the first
                    backward (from a fixed random gradient, to the parameters and the input);
                    the median of 3 further synchronised fwd+bwd steps
         compiled   the same import; the first fwd+bwd step of
                    ``torch.compile(layer, fullgraph=True)`` (tracing, compiling, Triton,
                    autotuning); subprocess start to the end of that step; the median of 3
                    further steps

Each child run has its own time limit (``--timeout``, seconds); a run that fails or runs out of
time leaves its cells empty and says so in the notes. Result (benchmarks/runner.py):
``cold-start`` (``cold-start-smoke`` with --smoke); a row per figure, a column for the cold
and the warm run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from benchmarks.runner import Result, add_out_argument, emit, environment

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DEMO_ARGS = ["--cp-size", "1"]
SMOKE_DEMO_ARGS = ["--device", "cpu", "--steps", "2", "--blocks", "1", "--seqlens", "64,0,1,40"]
STEP1_TARGET_S = 60.0
LAYER_DIMS = (2048, 16, 32, 128, 128)  # hidden, Hk, Hv, dk, dv
LAYER_TOKENS, LAYER_SEQS = 32768, 8
SMOKE_LAYER_DIMS, SMOKE_LAYER_TOKENS, SMOKE_LAYER_SEQS = (32, 2, 4, 16, 16), 32, 3
STEADY_STEPS = 3
RESULT_PREFIX = "COLD_START_RESULT "  # the line a child prints its figures on, as JSON
T0_VARIABLE = "COLD_START_T0"  # the parent's time.time() just before it starts the child


# --- reading a child's output as it comes ------------------------------------------------------------


class Stamper:
    """Splits a byte stream fed in chunks into pieces ended by ``\\n`` or ``\\r``, each with the
    time its last byte came in. A progress bar redraws its line as ``\\r`` then the text, so
    a piece is stamped when its text arrives, not when the next redraw ends it."""

    def __init__(self):
        self.pending, self.pending_t = b"", 0.0

    def feed(self, data: bytes, t: float) -> list[tuple[float, str]]:
        parts = re.split(rb"[\r\n]", data)
        if parts[0]:
            self.pending, self.pending_t = self.pending + parts[0], t
        if len(parts) == 1:
            return []
        done = [(self.pending_t, self.pending)] + [(t, p) for p in parts[1:-1]]
        self.pending, self.pending_t = parts[-1], t
        return [(at, p.decode(errors="replace")) for at, p in done if p.strip()]

    def close(self) -> list[tuple[float, str]]:
        rest, self.pending = self.pending, b""
        return [(self.pending_t, rest.decode(errors="replace"))] if rest.strip() else []


def stamp_output(cmd: list[str], env: dict, timeout: float, cwd: str = ROOT) -> dict:
    """Run ``cmd`` and stamp its output (stdout and stderr together) with the seconds since it
    was started: ``{"pieces": [(s, text), ...], "rc": exit status or None when it ran past
    ``timeout``, "total_s": start to exit}``. The child runs in a session of its own, which is
    killed at the end, so that no process it started outlives it."""
    env = dict(env)
    env[T0_VARIABLE] = repr(time.time())
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, bufsize=0,
                            start_new_session=True)  # fmt: skip
    stamper, pieces = Stamper(), []

    def read():
        while True:
            data = os.read(proc.stdout.fileno(), 65536)
            now = time.perf_counter() - start
            if not data:
                pieces.extend(stamper.close())
                return
            pieces.extend(stamper.feed(data, now))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        rc = None
    total = time.perf_counter() - start
    try:  # the child's own session: it (past its limit) and compile workers it left behind
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    reader.join(timeout=10)
    proc.stdout.close()
    # output read after the exit was written before it: its stamp is at most the exit's
    pieces = [(min(t, total), text) for t, text in pieces]
    return {"pieces": pieces, "rc": rc, "total_s": total}


# --- the demo's output ----------------------------------------------------------------------------------

_STEP1 = re.compile(r"\btrain\b.*?(?<![\d/])1/(\d+)\b")
_TRAINING = re.compile(r"\[\s*[\d.]+ s\] training on ")
_TABLE = {
    "step_ms": re.compile(r"^step time\s+([\d.,]+) ms"),
    "compile_s": re.compile(r"^compile time\s+([\d.,]+) s"),
    "tokens_per_s": re.compile(r"^tokens/s\s+([\d.,]+)"),
    "graph_breaks": re.compile(r"^graph breaks\s+(\d+)"),
}


def parse_demo(pieces: list[tuple[float, str]]) -> dict:
    """The figures of one demo run from its stamped output (:func:`stamp_output`):
    ``to_step1_s`` (the first progress update counting step 1 done: ``train ... 1/N``),
    ``to_training_s`` (its "training on ..." line), and from its table ``step_ms``,
    ``compile_s``, ``tokens_per_s``, ``graph_breaks``; None for what the output lacks."""
    out = dict.fromkeys(["to_step1_s", "to_training_s", *_TABLE])
    for t, text in pieces:
        line = text.strip()
        if out["to_step1_s"] is None and _STEP1.search(line):
            out["to_step1_s"] = t
        if out["to_training_s"] is None and _TRAINING.search(line):
            out["to_training_s"] = t
        for key, pattern in _TABLE.items():
            m = pattern.match(line)
            if m and out[key] is None:
                value = float(m.group(1).replace(",", ""))
                out[key] = int(value) if key == "graph_breaks" else value
    return out


# --- the layer children ----------------------------------------------------------------------------------


def _since_start() -> float:
    """Seconds since the parent started this process (its ``COLD_START_T0``)."""
    return time.time() - float(os.environ[T0_VARIABLE])


def child(mode: str, smoke: bool) -> dict:
    """One layer child's figures (the module docstring's ``layer``); runs in the fresh process."""
    import torch

    import cp_ops
    from benchmarks.cases import random_lengths

    out = {"import_s": _since_start()}
    cuda = not smoke
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    dims, tokens, seqs = (SMOKE_LAYER_DIMS, SMOKE_LAYER_TOKENS, SMOKE_LAYER_SEQS) if smoke else (
        LAYER_DIMS, LAYER_TOKENS, LAYER_SEQS)  # fmt: skip
    torch.manual_seed(0)
    layer = cp_ops.GatedDeltaNet(*dims).to(device, dtype)
    gen = torch.Generator().manual_seed(0)
    _, cup = cp_ops.pad_cu_seqlens(random_lengths(tokens, seqs, gen), 1, device=device)
    rows = int(cup[-1])
    x = torch.randn(rows, dims[0], generator=gen).to(device, dtype).requires_grad_()
    grad = torch.randn(rows, dims[0], generator=gen).to(device, dtype)
    leaves = [x, *layer.parameters()]

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def timed(fn) -> float:
        sync()
        start = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - start

    fn = layer if mode == "eager" else torch.compile(layer, fullgraph=True)

    def step():
        for t in leaves:
            t.grad = None
        fn(x, cup).backward(grad)

    sync()
    if mode == "eager":
        start = time.perf_counter()
        y = fn(x, cup)
        sync()
        out["first_fwd_s"] = time.perf_counter() - start
        out["first_bwd_s"] = timed(lambda: y.backward(grad))
    else:
        out["first_step_s"] = timed(step)
    out["to_first_step_s"] = _since_start()
    out["steady_ms"] = statistics.median(timed(step) for _ in range(STEADY_STEPS)) * 1e3
    return out


def run_child(mode: str, env: dict, smoke: bool, timeout: float) -> tuple[dict | None, str]:
    """A layer child in a fresh process: ``(figures, "")``, or ``(None, why)`` when it failed."""
    cmd = [sys.executable, "-m", "benchmarks.bench_cold_start", "--child", mode] + ["--smoke"] * smoke
    run = stamp_output(cmd, env, timeout)
    for _, text in run["pieces"]:
        if text.startswith(RESULT_PREFIX):
            figures = json.loads(text[len(RESULT_PREFIX) :])
            figures["total_s"] = run["total_s"]
            return figures, ""
    tail = " | ".join(text for _, text in run["pieces"][-3:])
    return None, ("ran past the time limit" if run["rc"] is None else f"rc={run['rc']}") + f": {tail[-300:]}"


# --- the parent ------------------------------------------------------------------------------------------


def child_environment(caches: str, keep_autotuning: bool) -> dict:
    """The children's environment: this one with new cache directories under ``caches``, the
    repository first on PYTHONPATH, and TRITON_CACHE_AUTOTUNING as --keep-autotuning says."""
    env = dict(os.environ)
    for name, sub in (("TRITON_CACHE_DIR", "triton"), ("TORCHINDUCTOR_CACHE_DIR", "inductor"),
                      ("CUDA_CACHE_PATH", "cuda")):  # fmt: skip
        env[name] = os.path.join(caches, sub)
        os.makedirs(env[name], exist_ok=True)
    env.pop("TRITON_INTERPRET", None)
    env.pop("TRITON_CACHE_AUTOTUNING", None)
    if keep_autotuning:
        env["TRITON_CACHE_AUTOTUNING"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    return env


def runs_and_environments(args, part: str):
    """``(which, environment)`` of each run of a part, in order: cold and warm on one set of new
    cache directories, then with ``--unseeded`` a cold run on another with
    ``CP_OPS_FLA_CONFIGS=0``; the directories are removed after the part's last run."""
    with tempfile.TemporaryDirectory(prefix=f"cold-start-{part}-") as caches:
        env = child_environment(caches, args.keep_autotuning)
        yield "cold", env
        yield "warm", env
    if args.unseeded:
        with tempfile.TemporaryDirectory(prefix=f"cold-start-{part}-unseeded-") as caches:
            yield "unseeded", dict(child_environment(caches, args.keep_autotuning), CP_OPS_FLA_CONFIGS="0")


def demo_rows(runs: dict[str, dict]) -> list[list]:
    """Table rows of the demo's runs (``{"cold": figures, "warm": figures, "unseeded": figures}``)."""
    cold, warm, unseeded = runs.get("cold", {}), runs.get("warm", {}), runs.get("unseeded", {})
    step1 = cold.get("to_step1_s")
    verdict = "-" if step1 is None else ("yes" if step1 <= STEP1_TARGET_S else "no")
    figures = [
        ("process start to end of step 1, s", "to_step1_s", f"<= {STEP1_TARGET_S:.0f} s cold: {verdict}"),
        ("process start to training start, s", "to_training_s", ""),
        ("compile time (the demo's), s", "compile_s", ""),
        ("steady step (the demo's), ms", "step_ms", ""),
        ("process start to exit, s", "total_s", ""),
    ]
    return [["demo", label, cold.get(key), warm.get(key), unseeded.get(key), target] for label, key, target in figures]


def layer_rows(mode: str, runs: dict[str, dict]) -> list[list]:
    cold, warm, unseeded = runs.get("cold", {}), runs.get("warm", {}), runs.get("unseeded", {})
    if mode == "eager":
        figures = [("process start to cp_ops imported, s", "import_s"), ("first forward, s", "first_fwd_s"),
                   ("first backward, s", "first_bwd_s"), ("process start to end of first fwd+bwd, s",
                   "to_first_step_s"), ("steady fwd+bwd, ms", "steady_ms")]  # fmt: skip
    else:
        figures = [("process start to cp_ops imported, s", "import_s"), ("first fwd+bwd (compiles), s",
                   "first_step_s"), ("process start to end of first fwd+bwd, s", "to_first_step_s"),
                   ("steady fwd+bwd, ms", "steady_ms")]  # fmt: skip
    return [[f"GatedDeltaNet {mode}", label, cold.get(key), warm.get(key), unseeded.get(key), ""]
            for label, key in figures]  # fmt: skip


def build_result(rows: list[list], notes: list[str], args) -> Result:
    name = "cold-start" + "-smoke" * args.smoke + "-keep-autotuning" * args.keep_autotuning
    where = "the CPU (--smoke)" if args.smoke else "one GPU"
    dims = SMOKE_LAYER_DIMS if args.smoke else LAYER_DIMS
    tokens, seqs = (SMOKE_LAYER_TOKENS, SMOKE_LAYER_SEQS) if args.smoke else (LAYER_TOKENS, LAYER_SEQS)
    demo = " ".join(DEMO_ARGS + SMOKE_DEMO_ARGS * args.smoke)
    text = [
        f"fresh processes on {where}; cold: empty TRITON_CACHE_DIR, TORCHINDUCTOR_CACHE_DIR, CUDA_CACHE_PATH; "
        f"warm: the same caches after the cold run; TRITON_CACHE_AUTOTUNING "
        f"{'= 1' if args.keep_autotuning else 'unset'}; demo: python -m cp_ops demo {demo}; layer: "
        f"GatedDeltaNet (hidden {dims[0]}, Hk {dims[1]}, Hv {dims[2]}, dk {dims[3]}, dv {dims[4]}), "
        f"{'float32' if args.smoke else 'bf16'}, T = {tokens} in {seqs} random-length sequences; steady: "
        f"median of {STEADY_STEPS} synchronised steps; cold, CP_OPS_FLA_CONFIGS=0: a third, cold run on caches "
        f"of its own without the recorded FLA autotuning choices (--unseeded; empty where not run)"
    ] + notes
    return Result("cold_start", "Cold and warm start: the demo and a GatedDeltaNet layer in fresh processes",
                  ["part", "figure", "cold", "warm", "cold, CP_OPS_FLA_CONFIGS=0", "target"], rows,
                  "\n".join(f"- {n}" for n in text), environment(), name=name,
                  formats=[None, None, "{:.2f}", "{:.2f}", "{:.2f}", None])  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", nargs="+", choices=["demo", "layer"], default=None,
                        help="what to run (default: both; the layer alone with --smoke)")  # fmt: skip
    parser.add_argument("--keep-autotuning", action="store_true",
                        help="set TRITON_CACHE_AUTOTUNING=1 in the children (autotuning results kept on disk)")
    parser.add_argument("--unseeded", action="store_true",
                        help="also a cold run of each part with CP_OPS_FLA_CONFIGS=0 (FLA autotunes), the baseline")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds per child run (default 600; 300 with --smoke)")
    parser.add_argument("--smoke", action="store_true", help="the CPU: a tiny layer (and a short demo with --parts)")
    parser.add_argument("--child", choices=["eager", "compiled"], help=argparse.SUPPRESS)
    add_out_argument(parser)
    args = parser.parse_args(argv)
    # a compiled demo takes minutes on the CPU: --smoke leaves it out unless asked for
    args.parts = args.parts or (["layer"] if args.smoke else ["demo", "layer"])
    if args.child:
        print(RESULT_PREFIX + json.dumps(child(args.child, args.smoke)), flush=True)
        return
    import torch

    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("bench_cold_start needs a CUDA device (or --smoke on the CPU)")
    timeout = args.timeout or (300.0 if args.smoke else 600.0)
    rows, notes = [], []

    def write():
        if args.out is not None:  # the table so far, so a run cut short by a time limit still leaves one
            build_result(rows, notes, args).write(args.out)

    if "demo" in args.parts:
        cmd = [sys.executable, "-m", "cp_ops", "demo", *DEMO_ARGS, *SMOKE_DEMO_ARGS * args.smoke]
        runs = {}
        for which, env in runs_and_environments(args, "demo"):
            run = stamp_output(cmd, env, timeout)
            runs[which] = {**parse_demo(run["pieces"]), "total_s": run["total_s"]}
            if run["rc"] != 0:
                why = "ran past the time limit" if run["rc"] is None else f"exited with rc={run['rc']}"
                tail = " | ".join(text for _, text in run["pieces"][-3:])
                notes.append(f"demo, {which}: {why}: {tail[-300:]}")
            print(f"demo {which}: " + ", ".join(f"{k} {v}" for k, v in runs[which].items()), flush=True)
        rows += demo_rows(runs)
        write()
    if "layer" in args.parts:
        for mode in ("eager", "compiled"):
            runs = {}
            for which, env in runs_and_environments(args, mode):
                figures, why = run_child(mode, env, args.smoke, timeout)
                if figures is None:
                    notes.append(f"GatedDeltaNet {mode}, {which}: {why}")
                    figures = {}
                runs[which] = figures
                print(f"GatedDeltaNet {mode} {which}: " + (", ".join(f"{k} {v:.3f}" for k, v in figures.items())
                                                           or why), flush=True)  # fmt: skip
            rows += layer_rows(mode, runs)
            write()
    emit([build_result(rows, notes, args)], args.out)
    if notes:
        raise SystemExit("some runs failed: " + "; ".join(notes))


if __name__ == "__main__":
    main()
