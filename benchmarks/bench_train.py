"""Training-step benchmark of examples/train_qwen3_next.py (slice4: four Qwen3-Next-80B-width
layers): every run is the recipe itself under torchrun, under a timeout, read back from its
``--log-json``; CP over W = 1, 2, 4 GPUs of one host at fixed global tokens (strong scaling).

    python -m benchmarks.bench_train [--worlds 1,2,4] [--tokens 32768,131072] [--graphs off|on|both]
                                     [--backends fla flashqla] [--steps N] [--warmup N] [--timeout S]
                                     [--out DIR] [--extra ARGS ...]
    python -m benchmarks.bench_train --smoke                  # tiny preset, CPU, W = 1, 2, 3 steps
    python -m benchmarks.bench_train --curves                 # loss curves: 1 GPU, (dp 1, cp 4), (dp 2, cp 2); resume
    python -m benchmarks.bench_train --fit 20,18,16           # the 80B config's largest layer count at cp 4
    python -m benchmarks.bench_train --replay 2 [--steps 20]  # CUDA graphs replayed across packings at cp 2
    python -m benchmarks.bench_train --worlds 1,4 --tokens 32768 --graphs off --profile  # where the step's time goes
    python -m benchmarks.bench_train --memory --worlds 1,4 --tokens 32768   # each rank's peak and what holds it
    python -m benchmarks.bench_train --fit-context 1,2,4 [--ac on|off|both]  # the longest single sequence at each W
    python -m benchmarks.bench_train --loss-check --worlds 1,4 --tokens 32768 --steps 20   # fused loss against unfused

Results (benchmarks/runner.py): ``train-<preset>`` (``-smoke``), with --profile also
``train-<preset>-profile``; with --curves ``train-curves-<preset>``
and ``train-losses-<preset>``; with --fit ``train-qwen3-next-80b``; with --replay
``train-replay-<preset>-wW``; with --memory ``train-memory-<preset>``, with --fit-context
``train-fit-context-<preset>``, with --loss-check ``train-loss-<preset>`` (``-vV`` after any of these
with --vocab-size V). A run that fails or times out
is a row with its status and no numbers. docs/benchmarks.md says what each figure measures.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import KERNEL_CLASSES, collective_waits, timeline_summary
from benchmarks.memory_map import SCRIPT
from benchmarks.runner import ROOT, Result, add_out_argument, checks_off, emit, fla_environment

COLUMNS = ["tokens", "graphs", "GDN core", "W", "dp", "cp", "step ms", "tokens/s", "scaling", "host ms", "GPU ms",
           "peak GiB", "first step s", "MFU", "recompiles", "status"]  # fmt: skip
FORMATS = {"tokens": "{:d}", "W": "{:d}", "dp": "{:d}", "cp": "{:d}", "step ms": "{:.1f}", "tokens/s": "{:.0f}",
           "scaling": "{:.2f}", "host ms": "{:.1f}", "GPU ms": "{:.1f}", "peak GiB": "{:.1f}",
           "first step s": "{:.1f}", "MFU": "{:.3f}", "recompiles": "{:d}"}  # fmt: skip
# --profile: rank 0's device timeline of the recipe's profiled steps (benchmarks.common.timeline_summary),
# the most any rank waited, for its host (idle) or on a collective alone, and the time ranks spent in
# collectives waiting for a peer (benchmarks.common.collective_waits)
PROFILE_FIGURES = ["wall", "GPU busy", "idle", "compute busy", "collectives only", *(c for c, _ in KERNEL_CLASSES),
                   "other", "idle, most of any rank", "collectives only, most of any rank", "collective wait",
                   "collective wait, most of any rank"]  # fmt: skip


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


def torchrun(world: int, recipe_args: list[str], timeout: int, entry: list[str] | None = None) -> str:
    """One torchrun of the recipe (or of ``entry``, a script or ``-m MODULE`` with its arguments, taking
    the recipe's after them): its status ("ok", "out of memory", "failed (rc N)" or "timeout"), its
    output's tail printed on failure."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
           *(entry or [str(SCRIPT)]), *recipe_args, "--no-progress"]  # fmt: skip
    print(f"[bench_train] {' '.join(cmd[2:])}", flush=True)
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, timeout=timeout, capture_output=True, text=True)
        status = "ok" if proc.returncode == 0 else f"failed (rc {proc.returncode})"
        if status != "ok" and "out of memory" in (proc.stdout + proc.stderr).lower():
            status = "out of memory"
        if status != "ok":
            print(proc.stdout[-2000:] + proc.stderr[-4000:], flush=True)
    except subprocess.TimeoutExpired:
        status = "timeout"
    print(f"[bench_train]   {status} in {time.perf_counter() - start:.0f} s", flush=True)
    return status


def dry_run(recipe_args: list[str], log: Path) -> dict:
    """The recipe's checked settings and model configuration for ``recipe_args`` (its ``--dry-run``,
    one process on the CPU, read back from its ``--log-json``); ``RuntimeError`` with its error."""
    cmd = [sys.executable, str(SCRIPT), *recipe_args, "--device", "cpu", "--dry-run", "--log-json", str(log)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd[1:])} failed: {proc.stderr.strip()}")
    return json.loads(log.read_text())


def cp_run_args(args: argparse.Namespace, world: int, tokens, graphs: bool, log: Path) -> list[str]:
    """The recipe's arguments for ``--steps`` steps at (dp 1, cp ``world``), logging to ``log``."""
    return ["--preset", args.preset, "--dp", "1", "--cp", str(world), "--tokens-per-step", str(tokens),
            "--steps", str(args.steps), "--max-seqs", str(args.max_seqs), "--log-json", str(log),
            *(["--compile"] if args.compile else []), *(["--cuda-graphs"] if graphs else []), *vocab_args(args),
            *args.extra]  # fmt: skip


def vocab_args(args: argparse.Namespace) -> list[str]:
    """``--vocab-size V`` for the recipe when given (else the preset's vocabulary)."""
    return ["--vocab-size", str(args.vocab_size)] if args.vocab_size else []


def suffix(args: argparse.Namespace) -> str:
    """``-vV`` in a result's name when the vocabulary is not the preset's, then the words of
    --extra (``--ac --tiled-mlp``: ``-ac-tiled-mlp``; --smoke's ``--device cpu`` left out), so a
    run with other recipe settings does not write over another's result."""
    words = [re.sub(r"[^A-Za-z0-9_.-]+", "_", a.lstrip("-")) for a in args.extra]
    if "device" in words:
        del words[words.index("device") : words.index("device") + 2]
    return (f"-v{args.vocab_size}" if args.vocab_size else "") + "".join(f"-{w}" for w in words)


def run_one(world: int, tokens: int, graphs: bool, args: argparse.Namespace, tmp: Path,
            backend: str | None = None) -> dict:  # fmt: skip
    """One torchrun of the recipe, with the GDN core ``backend`` where given (``CP_OPS_GDN_BACKEND``
    for its ranks; None: as this process has it); its row (``status`` "ok", "failed (...)" or
    "timeout")."""
    if backend is not None:
        os.environ["CP_OPS_GDN_BACKEND"] = backend
    backend = os.environ.get("CP_OPS_GDN_BACKEND", "auto")
    log = tmp / f"w{world}-t{tokens}-g{int(graphs)}-{backend}.json"
    row = {"tokens": tokens, "graphs": "on" if graphs else "off", "GDN core": backend, "W": world, "dp": 1,
           "cp": world}  # fmt: skip
    print(f"[bench_train] W={world} tokens={tokens} graphs={row['graphs']}", flush=True)
    profile = tmp / f"profile-w{world}-t{tokens}-g{int(graphs)}-{backend}"
    recipe_args = cp_run_args(args, world, tokens, graphs, log) + (["--profile", str(profile)] if args.profile else [])
    status = torchrun(world, recipe_args, args.timeout)
    if status == "ok" and not log.exists():
        status = "failed (no log)"
    if status == "ok":
        row.update(summarise(json.loads(log.read_text()), args.warmup))
        if args.profile:
            row["profile"] = profile_summary(profile)
        print(f"[bench_train]   step {row['step ms']:.1f} ms, {row['tokens/s']:.0f} tokens/s, "
              f"peak {row['peak GiB']:.1f} GiB", flush=True)  # fmt: skip
    row["status"] = status
    return row


def profile_summary(folder: Path) -> dict[str, float]:
    """:data:`PROFILE_FIGURES` in ms per step from the ``rank<R>.kernels.json`` files the recipe's
    ``--profile`` writes: rank 0's timeline, the most idle and collective-only time of any rank, and
    rank 0's and the most of any rank's collective wait ({} without a device timeline, as on the CPU)."""
    ranks = {int(p.name[4:].split(".")[0]): json.loads(p.read_text()) for p in folder.glob("rank*.kernels.json")}
    timelines = [([tuple(k) for k in d["kernels"]], d["steps"]) for _, d in sorted(ranks.items()) if d["kernels"]]
    if not timelines:
        return {}
    summaries = [timeline_summary(kernels, steps) for kernels, steps in timelines]
    out = {k: v for k, v in summaries[0].items() if k in PROFILE_FIGURES}
    out["idle, most of any rank"] = max(s["idle"] for s in summaries)
    out["collectives only, most of any rank"] = max(s["collectives only"] for s in summaries)
    waits = collective_waits([kernels for kernels, _ in timelines], timelines[0][1])
    out["collective wait"] = waits[0] if waits else None
    out["collective wait, most of any rank"] = max(waits) if waits else None
    return out


def profile_result(args: argparse.Namespace, rows: list[dict], env: dict) -> Result:
    """The --profile table: a row per run that recorded a device timeline."""
    columns = ["tokens", "graphs", "W", *PROFILE_FIGURES]
    runs = [r for r in rows if r.get("profile")]
    return Result(
        benchmark="train", name=f"train-{args.preset}-profile", columns=columns,
        title=f"Where a training step's time goes, preset {args.preset}, rank 0 (torch.profiler, --profile)",
        rows=[[r["tokens"], r["graphs"], r["W"], *(r["profile"].get(k) for k in PROFILE_FIGURES)] for r in runs],
        formats={"tokens": "{:d}", "W": "{:d}", **{k: "{:.2f}" for k in PROFILE_FIGURES}}, env=env,
        notes="ms per step, the recipe's profiled steps (4 and 5); wall = first kernel start to last kernel end, "
              "GPU busy = time some kernel runs, idle = wall - busy (the GPU waits for the host), collectives only "
              "= time a collective runs and nothing else; the classes are summed kernel times (collectives overlap "
              "the others); collective wait = time in collectives beyond the fastest rank's for the same "
              "collective (waiting for a peer, not transfer); the columns 'most of any rank' the largest over "
              "ranks; the scaling table of the same run includes the profiled steps",
    )  # fmt: skip


def markov_tokens(path: Path, vocab_size: int, count: int = 1 << 21, seed: int = 0) -> Path:
    """A ``.npy`` token stream a model can learn: each token follows its predecessor through a
    fixed random permutation with probability 0.9, else it is drawn uniformly."""
    import numpy as np

    rng = np.random.default_rng(seed)
    follow = rng.permutation(vocab_size)
    tokens = np.empty(count, dtype=np.int32)
    tokens[0] = 0
    jump = rng.random(count) >= 0.9
    fresh = rng.integers(0, vocab_size, count)
    for i in range(1, count):
        tokens[i] = fresh[i] if jump[i] else follow[tokens[i - 1]]
    np.save(path, tokens)
    return path


def learnable_tokens(args: argparse.Namespace, tmp: Path) -> Path:
    """A :func:`markov_tokens` file in ``tmp`` over the vocabulary of the recipe's model at ``args``."""
    model = dry_run(["--preset", args.preset, *vocab_args(args)], tmp / "dry-run.json")["model"]
    return markov_tokens(tmp / "tokens.npy", model["vocab_size"])


def curves(args: argparse.Namespace) -> list[Result]:
    """The ``--curves`` runs: the same model from the same seed for ``--steps`` steps on one GPU,
    at (dp 1, cp 4) and at (dp 2, cp 2), on a token file with learnable structure
    (:func:`markov_tokens`); the (dp 1, cp 4) run saves a checkpoint at step ``--steps // 2``, from
    which one step is resumed. A summary of the runs and every run's loss per step."""
    tmp = Path(tempfile.mkdtemp())
    data = learnable_tokens(args, tmp)
    tokens = args.tokens.split(",")[0]
    # two batch shards: the one-GPU run trains on what the two replicas of (dp 2, cp 2) split
    common = ["--preset", args.preset, "--tokens-per-step", tokens, "--max-seqs", str(args.max_seqs), "--batch-shards",
              "2", "--data", str(data), *(["--compile"] if args.compile else []), *vocab_args(args),
              *args.extra]  # fmt: skip
    half = args.steps // 2
    runs = {"1 GPU": (1, 1, 1), "dp 1, cp 4": (4, 1, 4), "dp 2, cp 2": (4, 2, 2)}
    logs, rows = {}, []
    for label, (world, dp, cp) in runs.items():
        log = tmp / f"{dp}x{cp}.json"
        extra = ["--checkpoint-dir", str(tmp / "ck"), "--save-every", str(half)] if label == "dp 1, cp 4" else []
        status = torchrun(world, [*common, "--steps", str(args.steps), "--dp", str(dp), "--cp", str(cp),
                                  "--log-json", str(log), *extra], args.timeout)  # fmt: skip
        logs[label] = json.loads(log.read_text()) if status == "ok" else None
        rows.append([label, world, status])
    resumed = tmp / "resumed.json"
    status = torchrun(4, [*common, "--steps", str(half + 1), "--dp", "1", "--cp", "4", "--checkpoint-dir",
                          str(tmp / "ck"), "--resume", str(tmp / "ck" / f"step-{half:08d}"), "--log-json",
                          str(resumed)], args.timeout)  # fmt: skip
    base = [s["loss"] for s in logs["1 GPU"]["steps"]] if logs["1 GPU"] else None
    table, curves_ = [], {}
    for (label, world, status_), log in zip(rows, logs.values()):
        losses = [s["loss"] for s in log["steps"]] if log else []
        curves_[label] = losses
        diff = max(abs(a - b) / abs(b) for a, b in zip(losses, base)) if log and base else None
        peak = max(s["peak_mem_gib"] for s in log["steps"]) if log else None
        table.append([label, world, status_, losses[0] if losses else None, losses[-1] if losses else None, diff,
                      peak])  # fmt: skip
    cp4 = logs["dp 1, cp 4"]
    resumed_loss = json.loads(resumed.read_text())["steps"][-1]["loss"] if status == "ok" else None
    uninterrupted = cp4["steps"][half]["loss"] if cp4 else None
    notes = (f"{args.steps} steps, {tokens} tokens a step, the same seed and token file; max rel diff = "
             f"largest |loss - loss on 1 GPU| / loss on 1 GPU over the steps; resumed from the step-{half} checkpoint "
             f"of (dp 1, cp 4): step {half + 1} loss {resumed_loss} against {uninterrupted} uninterrupted")
    env = fla_environment(world=4)
    summary = Result(
        benchmark="train", name=f"train-curves-{args.preset}",
        title=f"Loss curves of examples/train_qwen3_next.py, preset {args.preset}: one GPU, (dp 1, cp 4), (dp 2, cp 2)",
        columns=["run", "GPUs", "status", "first loss", "last loss", "max rel diff vs 1 GPU", "peak GiB"],
        rows=table, formats={"first loss": "{:.4f}", "last loss": "{:.4f}", "max rel diff vs 1 GPU": "{:.2e}",
                             "peak GiB": "{:.1f}"},
        env=env, notes=notes,
    )  # fmt: skip
    steps = max((len(v) for v in curves_.values()), default=0)
    per_step = Result(
        benchmark="train", name=f"train-losses-{args.preset}", title=f"Loss per step, preset {args.preset}",
        columns=["step", *curves_], env=env, notes=notes,
        rows=[[i + 1, *(v[i] if i < len(v) else None for v in curves_.values())] for i in range(steps)],
    )  # fmt: skip
    return [summary, per_step]


LOSS_COLUMNS = ["W", "loss", "status", "first loss", "last loss", "max rel diff vs unfused", "step ms", "tokens/s",
                "MFU", "peak GiB"]  # fmt: skip


def loss_check(args: argparse.Namespace) -> Result:
    """The ``--loss-check`` runs: at each W of --worlds, the recipe with ``--loss fused`` and with
    ``--loss unfused`` from the same seed on the same learnable token file (:func:`markov_tokens`) for
    ``--steps`` steps at the first --tokens; a row per run, the fused one with its largest relative
    loss difference from the unfused one over the steps."""
    tmp = Path(tempfile.mkdtemp())
    data = learnable_tokens(args, tmp)
    tokens = int(args.tokens.split(",")[0])
    rows = []
    for world in [int(w) for w in args.worlds.split(",")]:
        logs = {}
        for loss in ("unfused", "fused"):
            log = tmp / f"w{world}-{loss}.json"
            recipe_args = cp_run_args(args, world, tokens, False, log) + ["--data", str(data), "--loss", loss]
            status = torchrun(world, recipe_args, args.timeout)
            logs[loss] = json.loads(log.read_text()) if status == "ok" and log.exists() else None
            row = {"W": world, "loss": loss, "status": status}
            if logs[loss]:
                losses = [s["loss"] for s in logs[loss]["steps"]]
                row.update(summarise(logs[loss], args.warmup), **{"first loss": losses[0], "last loss": losses[-1]})
            if loss == "fused" and logs["fused"] and logs["unfused"]:
                row["max rel diff vs unfused"] = max(
                    abs(f["loss"] - u["loss"]) / abs(u["loss"])
                    for f, u in zip(logs["fused"]["steps"], logs["unfused"]["steps"]))  # fmt: skip
            rows.append(row)
    return Result(
        benchmark="train", name=f"train-loss-{args.preset}{suffix(args)}",
        title=f"The fused loss against the unfused one in the recipe, preset {args.preset}"
              + (f", vocabulary {args.vocab_size}" if args.vocab_size else "") + f", {tokens} tokens a step, (dp 1, cp W)",
        columns=LOSS_COLUMNS, rows=[[r.get(c) for c in LOSS_COLUMNS] for r in rows],
        formats={c: f for c, f in FORMATS.items() if c in LOSS_COLUMNS}
        | {"first loss": "{:.4f}", "last loss": "{:.4f}", "max rel diff vs unfused": "{:.1e}"},
        env=fla_environment(world=max(r["W"] for r in rows)),
        notes=f"{args.steps} steps from the same seed on the same token file, medians after {args.warmup}; max rel "
              "diff = the largest |fused - unfused| / unfused loss over the steps; the recipe's settings: "
              + " ".join(["--compile"] * args.compile + vocab_args(args) + args.extra),
    )  # fmt: skip


def fit(args: argparse.Namespace) -> Result:
    """The ``--fit`` attempts: the real Qwen3-Next-80B-A3B config at (dp 1, cp 4) with activation
    checkpointing, eager, for a few steps at each layer count in turn, largest first, up to the
    first that runs; a row per attempt (out of memory or the run's numbers)."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for layers in sorted({int(n) for n in args.fit.split(",")}, reverse=True):
            log = Path(tmp) / f"fit-{layers}.json"
            recipe_args = ["--preset", "qwen3-next-80b", "--num-layers", str(layers), "--dp", "1", "--cp", "4",
                           "--ac", "--steps", "4", "--tokens-per-step", args.tokens.split(",")[0], "--log-json",
                           str(log), *vocab_args(args), *args.extra]  # fmt: skip
            status = torchrun(4, recipe_args, args.timeout)
            row = {"layers": layers, "status": status}
            if status == "ok":
                run = json.loads(log.read_text())
                row.update(summarise(run, warmup=1), tokens=run["settings"]["tokens_per_step"])
            rows.append(row)
            if status == "ok":
                break
    columns = ["layers", "tokens", "step ms", "tokens/s", "MFU", "peak GiB", "first step s", "status"]
    return Result(
        benchmark="train", name="train-qwen3-next-80b",
        title="Qwen3-Next-80B-A3B's config (512 experts, vocabulary 151936), CP over 4 GPUs (dp 1), eager, "
              "activation checkpointing: layer counts tried, largest first",
        columns=columns, rows=[[r.get(c) for c in columns] for r in rows],
        formats={c: f for c, f in FORMATS.items() if c in columns},
        env=fla_environment(world=4),
        notes="4 steps each, medians of steps 2-4; the first run that fits ends the search",
    )  # fmt: skip


def longest_fit(trial, start: int, granularity: int, limit: int) -> tuple[int | None, list[tuple[int, str]]]:
    """The longest length, a multiple of ``granularity`` up to ``limit``, for which ``trial(length)``
    returns "ok", assuming every shorter one fits too; and every ``(length, status)`` tried, in order.
    Doubles from ``start`` (a multiple of ``granularity``) until a length fails or ``limit`` is
    reached, or halves until one fits, then bisects between the longest that fit and the shortest
    that did not. None when not even ``granularity`` fits."""
    if start % granularity or start < granularity or limit < start:
        raise ValueError(f"start {start} must be a multiple of granularity {granularity} and at most limit {limit}")
    tried: list[tuple[int, str]] = []

    def fits(length: int) -> bool:
        tried.append((length, trial(length)))
        return tried[-1][1] == "ok"

    fit, fail, length = None, None, start
    while fit is None or fail is None:
        if fits(length):
            fit = length
            if fail is not None or length == limit:
                break
            length = min(2 * length, limit)
        else:
            fail = length
            if fit is not None:
                break
            length = length // 2 // granularity * granularity
            if length < granularity:
                return None, tried
    while fail is not None and fail - fit > granularity:
        middle = (fit + fail) // 2 // granularity * granularity
        if fits(middle):
            fit = middle
        else:
            fail = middle
    return fit, tried


FIT_COLUMNS = ["W", "ac", "longest tokens", "shortest failed", "step ms", "tokens/s", "MFU", "peak GiB",
               "first step s", "trials"]  # fmt: skip


def fit_context(args: argparse.Namespace) -> Result:
    """The ``--fit-context`` searches: at each W, with and without ``--ac`` (``--ac``), the longest single
    sequence (``--max-seqs 1``) for which the recipe runs ``--fit-steps`` steps at (dp 1, cp W), each
    trial a torchrun of its own (an out-of-memory trial leaves nothing behind), by :func:`longest_fit`
    from ``--fit-start`` tokens per GPU; a row per search, with the longest run's numbers. The table so
    far is written after every trial, so a run cut short keeps the trials it finished."""
    rows: list[dict] = []
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.ac]
    with tempfile.TemporaryDirectory() as tmp:
        for world in [int(w) for w in args.fit_context.split(",")]:
            for ac in modes:
                runs, tried = {}, []
                row = {"W": world, "ac": "on" if ac else "off"}
                rows.append(row)

                def trial(tokens: int) -> str:
                    log = Path(tmp) / f"fit-w{world}-ac{int(ac)}-{tokens}.json"
                    recipe_args = ["--preset", args.preset, "--dp", "1", "--cp", str(world), "--tokens-per-step",
                                   str(tokens), "--max-seqs", "1", "--steps", str(args.fit_steps), "--log-json",
                                   str(log), *(["--compile"] if args.compile else []), *(["--ac"] if ac else []),
                                   *vocab_args(args), *args.extra]  # fmt: skip
                    status = torchrun(world, recipe_args, args.timeout)
                    if status == "ok":
                        runs[tokens] = summarise(json.loads(log.read_text()), warmup=1)
                    tried.append((tokens, status))
                    row.update(_fit_outcome(tried, runs))
                    emit([_fit_result(args, rows)], args.out, quiet=True)
                    return status

                longest_fit(trial, args.fit_start * world, args.fit_granularity,
                            args.fit_limit or 8 * args.fit_start * world)  # fmt: skip
                print(f"[bench_train] fit-context W={world} ac={row['ac']}: {row['longest tokens']} tokens", flush=True)
    return _fit_result(args, rows)


def _fit_outcome(tried: list[tuple[int, str]], runs: dict[int, dict]) -> dict:
    """A ``--fit-context`` search's columns from its trials so far: the longest length that ran, the
    shortest longer one that did not, every trial, and the longest run's numbers."""
    best = max((n for n, status in tried if status == "ok"), default=None)
    failed = [n for n, status in tried if status != "ok" and (best is None or n > best)]
    return {"longest tokens": best, "shortest failed": min(failed, default=None),
            "trials": "; ".join(f"{n} {status}" for n, status in tried), **runs.get(best, {})}  # fmt: skip


def _fit_result(args: argparse.Namespace, rows: list[dict]) -> Result:
    return Result(
        benchmark="train", name=f"train-fit-context-{args.preset}{suffix(args)}",
        title=f"The longest single sequence that trains, preset {args.preset}"
              + (f", vocabulary {args.vocab_size}" if args.vocab_size else "") + ", CP over W GPUs (dp 1)",
        columns=FIT_COLUMNS, rows=[[r.get(c) for c in FIT_COLUMNS] for r in rows],
        formats={c: f for c, f in FORMATS.items() if c in FIT_COLUMNS} | {"longest tokens": "{:d}",
                                                                          "shortest failed": "{:d}"},
        env=fla_environment(world=max(int(w) for w in args.fit_context.split(","))),
        notes=f"each trial one sequence of that many tokens, {args.fit_steps} steps, its own torchrun; doubling "
              f"from {args.fit_start} tokens per GPU, then bisection to {args.fit_granularity} tokens; the numbers "
              "are the longest run's (medians after its first step); the recipe's settings: "
              + " ".join(["--compile"] * args.compile + vocab_args(args) + args.extra),
    )  # fmt: skip


MEMORY_COLUMNS = ["W", "rank", "peak GiB", "peak in", "held at its start", "parameters", "optimizer state",
                  "gradients", "activations and loss held", "transient", "head and loss", "activations by layer",
                  "status"]  # fmt: skip


def memory(args: argparse.Namespace) -> Result:
    """The ``--memory`` maps: benchmarks.memory_map at (dp 1, cp W) for each W of --worlds at the first
    --tokens, a row per rank."""
    tokens = int(args.tokens.split(",")[0])
    maps = {}
    with tempfile.TemporaryDirectory() as tmp:
        for world in [int(w) for w in args.worlds.split(",")]:
            out = Path(tmp) / f"memory-w{world}.json"
            entry = ["-m", "benchmarks.memory_map", "--json", str(out),
                     *(["--snapshot", args.snapshot] if args.snapshot else []), "--"]  # fmt: skip
            recipe_args = cp_run_args(args, world, tokens, False, Path(tmp) / f"log-w{world}.json")
            status = torchrun(world, recipe_args, args.timeout, entry)
            maps[world] = json.loads(out.read_text()) if status == "ok" and out.exists() else status
    return memory_result(args, tokens, maps)


def memory_result(args: argparse.Namespace, tokens: int, maps: dict[int, dict | str]) -> Result:
    """The --memory table from each W's memory_map JSON (or its run's status)."""
    rows = []
    for world, found in maps.items():
        if isinstance(found, str):
            rows.append({"W": world, "status": found})
            continue
        for r in found["ranks"]:
            row = {c: r[c] for c in MEMORY_COLUMNS if c in r}
            row.update(W=world, status="ok", **{"peak GiB": r["peak"], "peak in": r["peak phase"]})
            row["activations by layer"] = " ".join(f"{gib:.2f}" for gib in r["activations by layer"].values())
            rows.append(row)
    gib = {c: "{:.2f}" for c in ("peak GiB", "held at its start", "parameters", "optimizer state", "gradients",
                                 "activations and loss held", "transient", "head and loss")}  # fmt: skip
    return Result(
        benchmark="train", name=f"train-memory-{args.preset}{suffix(args)}",
        title=f"Where each rank's memory goes, preset {args.preset}, {tokens} tokens a step, CP over W GPUs (dp 1)",
        columns=MEMORY_COLUMNS, rows=[[r.get(c) for c in MEMORY_COLUMNS] for r in rows],
        formats={"W": "{:d}", "rank": "{:d}", **gib}, env=fla_environment(world=max(maps)),
        notes="GiB, step " + str(args.steps) + " of the recipe (benchmarks.memory_map): the peak allocated and the "
              "phase it falls in (the embedding, a decoder layer's forward, the final norm, head and loss, the "
              "backward, the optimizer step); held at its start = parameters + optimizer state (+ gradients in "
              "the optimizer step) + activations and loss; transient = what that phase added on top (its "
              "temporaries, unsharded parameters, communication buffers); activations by layer and head and loss "
              "= what each forward left allocated; the recipe's settings: "
              + " ".join(["--compile"] * args.compile + vocab_args(args) + args.extra),
    )  # fmt: skip


def replay(args: argparse.Namespace) -> Result:
    """The ``--replay W`` runs: the same seeded steps at (dp 1, cp W), compiled, with and without
    CUDA graphs, each step a new packing of one static shape."""
    world, tokens = args.replay, args.tokens.split(",")[0]
    logs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for graphs in (True, False):
            log = Path(tmp) / f"graphs-{graphs}.json"
            ok = torchrun(world, cp_run_args(args, world, tokens, graphs, log), args.timeout) == "ok" and log.exists()
            logs[graphs] = json.loads(log.read_text()) if ok else None
    return replay_result(logs[True], logs[False], args.preset, fla_environment(world=world))


def replay_result(graphs: dict | None, eager: dict | None, preset: str, env: dict) -> Result:
    """One row per step of the ``--replay`` runs' logs: its packing, the CUDA graphs recorded in it,
    both runs' losses and step times."""
    if graphs is None or eager is None:
        raise SystemExit("a --replay run failed: no result")
    rows = [[g["step"], sum(n > 0 for shard in g["lengths"] for n in shard), str(g["lengths"]),
             g["cudagraph_recordings"], g["loss"], e["loss"], g["loss"] - e["loss"], g["step_ms"], e["step_ms"]]
            for g, e in zip(graphs["steps"], eager["steps"])]  # fmt: skip
    packings = len({r[2] for r in rows})
    world = graphs["world"]
    return Result(
        benchmark="train", name=f"train-replay-{preset}-w{world}",
        title=f"CUDA graphs replayed across packings: preset {preset}, (dp 1, cp {world}), "
              f"{graphs['settings']['tokens_per_step']} tokens a step",
        columns=["step", "sequences", "packing", "graphs recorded", "loss, graphs", "loss, no graphs",
                 "difference", "step ms, graphs", "step ms, no graphs"],
        rows=rows, formats={"loss, graphs": "{:.6f}", "loss, no graphs": "{:.6f}", "difference": "{:.1e}",
                            "step ms, graphs": "{:.1f}", "step ms, no graphs": "{:.1f}"},
        env=env,
        notes=f"{len(rows)} steps, {packings} distinct packings of one static shape ({graphs['num_tokens']} rows, "
              f"{graphs['num_tokens'] // world} a rank, dp 1); recompiles after the first step: "
              f"{graphs['recompiles']} with graphs, {eager['recompiles']} without; graphs that ran without CUDA "
              f"graphs: {graphs['cudagraph_skips']}; step 1 compiles, step 2 records (Inductor warms a graph up "
              f"before recording it)",
    )  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    checks_off()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worlds", default="1,2,4", help="CP sizes W (one GPU per rank)")
    p.add_argument("--tokens", default="32768,131072", help="global real tokens per step")
    p.add_argument("--graphs", choices=("off", "on", "both"), default="both", help="runs with --cuda-graphs")
    p.add_argument("--backends", help="GDN core backends (CP_OPS_GDN_BACKEND values, e.g. fla,flashqla): every "
                   "run once with each; default: CP_OPS_GDN_BACKEND as set")
    p.add_argument("--preset", default="slice4")
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the medians")
    p.add_argument("--max-seqs", type=int, default=8)
    p.add_argument("--timeout", type=int, default=1200, help="seconds per run")
    add_out_argument(p)
    p.add_argument("--smoke", action="store_true", help="tiny preset on the CPU, W = 1, 2, eager, 3 steps")
    p.add_argument("--curves", action="store_true", help="loss curves on 1 GPU, (dp 1, cp 4), (dp 2, cp 2); resume")
    p.add_argument("--fit", metavar="N,N,...", help="the 80B config at cp 4: the largest of these layer counts that "
                                                    "runs")
    p.add_argument("--replay", type=int, metavar="W", help="CUDA graphs against none over --steps packings at cp W")
    p.add_argument("--profile", action="store_true",
                   help="profile each run's steps 4-5 (the recipe's --profile) and add the table of where rank 0's "
                        "step goes (needs --steps 5 or more; the profiled steps run slower, so take step times "
                        "from a run without it)")
    p.add_argument("--loss-check", action="store_true", help="the recipe's fused loss against its unfused one "
                                                             "over --steps steps at each W of --worlds")
    p.add_argument("--vocab-size", type=int, help="the recipe's --vocab-size (default: the preset's vocabulary)")
    p.add_argument("--memory", action="store_true", help="each rank's peak and what holds it, at each W of --worlds "
                                                         "and the first --tokens (benchmarks.memory_map)")
    p.add_argument("--snapshot", metavar="DIR", help="with --memory: each rank's allocator history to DIR")
    p.add_argument("--fit-context", metavar="W,W,...", help="the longest single sequence that trains at each W")
    p.add_argument("--ac", choices=("off", "on", "both"), default="both",
                   help="--fit-context: the recipe with --ac, without, or both")
    p.add_argument("--fit-start", type=int, default=262144, help="--fit-context: the first length tried, per GPU")
    p.add_argument("--fit-granularity", type=int, default=65536, help="--fit-context: lengths are multiples of it")
    p.add_argument("--fit-limit", type=int, help="--fit-context: the longest tried (default: 8 x the first)")
    p.add_argument("--fit-steps", type=int, default=3, help="--fit-context: steps of each trial")
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="further recipe arguments, last")
    args = p.parse_args(argv)
    args.compile = not args.smoke
    if args.smoke:
        args.preset, args.worlds, args.tokens, args.graphs, args.warmup = "tiny", "1,2", "256", "off", 1
        args.steps = 5 if args.profile else 3  # the recipe profiles steps 4 and 5
        args.extra = ["--device", "cpu", *args.extra]
    worlds, token_counts = [int(w) for w in args.worlds.split(",")], [int(t) for t in args.tokens.split(",")]
    if args.curves:
        if args.steps == 15:
            args.steps = 50
        emit(curves(args), args.out)
        return
    if args.fit:
        emit([fit(args)], args.out)
        return
    if args.fit_context:
        emit([fit_context(args)], args.out)
        return
    if args.loss_check:
        emit([loss_check(args)], args.out)
        return
    if args.memory:
        if args.steps == 15:
            args.steps = 3
        emit([memory(args)], args.out)
        return
    if args.replay:
        if args.steps == 15:
            args.steps = 20
        emit([replay(args)], args.out)
        return
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.graphs]
    rows = []
    env = fla_environment(world=max(worlds), torch_threads=os.environ.get("OMP_NUM_THREADS"))
    with tempfile.TemporaryDirectory() as tmp:
        backends = args.backends.split(",") if args.backends else [None]
        for tokens, graphs, backend in itertools.product(token_counts, modes, backends):
            group = [run_one(w, tokens, graphs, args, Path(tmp), backend) for w in worlds]
            base = next((r["step ms"] for r in group if r["W"] == 1 and r.get("step ms")), None)
            for r in group:
                r["scaling"] = base / (r["W"] * r["step ms"]) if base and r.get("step ms") else None
            rows += group
            # the rows so far, written after every group: a run cut short keeps what finished
            emit(tables(args, rows, env), args.out, quiet=True)
    emit(tables(args, rows, env), args.out)


def tables(args: argparse.Namespace, rows: list[dict], env: dict) -> list[Result]:
    """The scaling table of ``rows`` and, with --profile, where each run's step went."""
    return [scaling_result(args, rows, env)] + ([profile_result(args, rows, env)] if args.profile else [])


def scaling_result(args: argparse.Namespace, rows: list[dict], env: dict) -> Result:
    """The strong-scaling table of ``rows`` (one dict a run)."""
    return Result(
        benchmark="train", name=f"train-{args.preset}" + ("-smoke" if args.smoke else ""),
        title=f"Training step of examples/train_qwen3_next.py, preset {args.preset}, CP over W ranks (dp 1)",
        columns=COLUMNS, rows=[[r.get(c) for c in COLUMNS] for r in rows], formats=FORMATS, env=env,
        notes=f"{args.steps} steps, medians after {args.warmup}; scaling = T1 / (W x TW) at the same global "
              "tokens; step ms = the GPU's time from the step before's end to this step's end (the recipe keeps "
              "one step in flight), host ms = issuing the step, GPU ms = CUDA events around it; first step includes "
              "compilation",
    )  # fmt: skip


if __name__ == "__main__":
    main()
