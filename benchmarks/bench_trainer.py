"""The Trainer path beside the recipe: examples/sft_qwen3_next_trainer.py (transformers' ``Trainer``
with :class:`cp_ops.integrations.trainer.ContextParallelTrainer`) and examples/train_qwen3_next.py
on the same model preset, packed batches, steps and W ranks (dp 1, cp W), each under torchrun,
under a timeout, read back from its ``--log-json``.

    python -m benchmarks.bench_trainer [--worlds 1,4] [--tokens 32768] [--preset slice4] [--steps N]
                                       [--warmup N] [--max-seqs N] [--vocab-size V] [--timeout S] [--out DIR]
    python -m benchmarks.bench_trainer --smoke        # tiny preset, CPU (gloo), W = 1, 2, 3 steps, float32

The recipe runs as benchmarks/bench_train runs it (compiled, FSDP2, bf16 mixed precision, its
fused loss); the Trainer eager, in bf16 mixed precision (``bf16=True``), with the fused loss, at
the recipe's learning rate, one micro-batch a step. Both train on the recipe's synthetic batches of
``--tokens`` real tokens a step (the same sequences). Result (benchmarks/runner.py):
``train-trainer-<preset>`` (``-smoke``; ``-vV`` with --vocab-size V), a row per run; a run that
fails or times out is a row with its status and no numbers.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from benchmarks.bench_train import FORMATS, cp_run_args, suffix, summarise, torchrun, vocab_args
from benchmarks.runner import ROOT, Result, add_out_argument, checks_off, emit, fla_environment

TRAINER_SCRIPT = ROOT / "examples" / "sft_qwen3_next_trainer.py"
RUNNERS = ("recipe", "Trainer")
COLUMNS = ["runner", "W", "status", "step ms", "tokens/s", "Trainer / recipe", "peak GiB", "first step s", "last loss"]
RECIPE_LR = "3e-4"  # examples/train_qwen3_next.py's default --lr


def trainer_run_args(args: argparse.Namespace, world: int, log: Path, out: Path) -> list[str]:
    """The Trainer example's arguments for ``--steps`` steps at (dp 1, cp ``world``), logging to ``log``."""
    device = ["--device", "cpu", "--dtype", "float32"] if args.smoke else ["--dtype", "bfloat16"]
    return ["--preset", args.preset, "--cp", str(world), "--tokens-per-step", str(args.tokens), "--max-seqs",
            str(args.max_seqs), "--steps", str(args.steps), "--grad-accum", "1", "--lr", RECIPE_LR, "--loss", "fused",
            "--out", str(out), "--log-json", str(log), *device, *vocab_args(args)]  # fmt: skip


def run_one(runner: str, world: int, args: argparse.Namespace, tmp: Path) -> dict | str:
    """One torchrun of ``runner`` at W = ``world``: its ``--log-json`` or its status."""
    log = tmp / f"{runner}-w{world}.json"
    if runner == "recipe":
        status = torchrun(world, cp_run_args(args, world, args.tokens, False, log), args.timeout)
    else:
        entry = [str(TRAINER_SCRIPT)]
        status = torchrun(world, trainer_run_args(args, world, log, tmp / f"trainer-w{world}"), args.timeout, entry)
    if status == "ok" and not log.exists():
        status = "failed (no log)"
    return json.loads(log.read_text()) if status == "ok" else status


def summarise_run(found: dict | str, warmup: int) -> dict:
    """A row's numbers from one run's log (with its last loss), or its failure status alone."""
    if isinstance(found, str):
        return {"status": found}
    return {**summarise(found, warmup), "status": "ok", "last loss": found["steps"][-1]["loss"]}


def comparison_result(args: argparse.Namespace, runs: dict[tuple[str, int], dict | str], env: dict) -> Result:
    """The table of ``runs``: ``{(runner, W): its --log-json, or its status}``, a row each, W by W."""
    rows = []
    for world in sorted({w for _, w in runs}):
        found = {r: summarise_run(runs[r, world], args.warmup) for r in RUNNERS if (r, world) in runs}
        recipe = found.get("recipe", {}).get("tokens/s")
        for runner, row in found.items():
            if runner == "Trainer" and recipe and row.get("tokens/s"):
                row["Trainer / recipe"] = row["tokens/s"] / recipe
            rows.append([runner, world] + [row.get(c) for c in COLUMNS[2:]])
    return Result(
        benchmark="train", name=f"train-trainer-{args.preset}" + ("-smoke" if args.smoke else "") + suffix(args),
        title=f"Training step of transformers' Trainer with CP beside examples/train_qwen3_next.py, preset "
              f"{args.preset}, {args.tokens} tokens a step, CP over W ranks (dp 1)",
        columns=COLUMNS, rows=rows,
        formats={c: f for c, f in FORMATS.items() if c in COLUMNS}
        | {"Trainer / recipe": "{:.2f}", "last loss": "{:.4f}"},
        env=env,
        notes=f"{args.steps} steps, medians after {args.warmup}, the same synthetic batches (at most {args.max_seqs} "
              "sequences a step); recipe: compiled decoder layers, FSDP2 over the W ranks, bf16 parameters in the "
              "forward, step ms from the step before's end to this one's (one step in flight); Trainer "
              "(examples/sft_qwen3_next_trainer.py): eager, DDP over the W ranks (each holds the whole model, "
              "gradients and optimizer state), bf16 autocast, the Trainer's AdamW (betas 0.9, 0.999, no weight "
              "decay) at the recipe's learning rate, step ms between the ends of consecutive optimizer steps, "
              "synchronised; both the fused loss; tokens/s = real tokens a step / step time; peak GiB = the "
              "largest max_memory_allocated over ranks; first step includes compilation (recipe)"
              + ("; smoke: tiny preset on the CPU, both eager and in float32, peak = host RSS" if args.smoke else ""),
    )  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    checks_off()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worlds", default="1,4", help="CP sizes W (one GPU per rank)")
    p.add_argument("--tokens", type=int, default=32768, help="global real tokens per step")
    p.add_argument("--preset", choices=("tiny", "slice4"), default="slice4")
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the medians")
    p.add_argument("--max-seqs", type=int, default=8)
    p.add_argument("--vocab-size", type=int, help="both runs' --vocab-size (default: the preset's vocabulary)")
    p.add_argument("--timeout", type=int, default=1200, help="seconds per run")
    add_out_argument(p)
    p.add_argument("--smoke", action="store_true", help="tiny preset on the CPU, W = 1, 2, 3 steps, float32")
    args = p.parse_args(argv)
    args.compile, args.extra = not args.smoke, []
    if args.smoke:
        args.preset, args.worlds, args.tokens, args.steps, args.warmup = "tiny", "1,2", 256, 3, 1
        args.extra = ["--device", "cpu", "--dtype", "fp32"]
    worlds = [int(w) for w in args.worlds.split(",")]
    env = fla_environment(world=max(worlds))
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for world in worlds:
            for runner in RUNNERS:
                runs[runner, world] = run_one(runner, world, args, Path(tmp))
            # the rows so far, written after every W: a run cut short keeps what finished
            emit([comparison_result(args, runs, env)], args.out, quiet=True)
    emit([comparison_result(args, runs, env)], args.out)


if __name__ == "__main__":
    main()
