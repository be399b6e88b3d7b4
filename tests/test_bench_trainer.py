"""benchmarks/bench_trainer.py: the Trainer path beside the recipe. Its table from canned logs
(the recipe's --log-json shape, which the Trainer example writes too), the command lines it
gives both scripts (their own parsers accept them), and (slow tier) its --smoke end to end."""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys

import pytest

from benchmarks import bench_trainer
from benchmarks.memory_map import load_recipe
from benchmarks.runner import ROOT, load_all


def _args(**kw) -> argparse.Namespace:
    base = dict(preset="slice4", smoke=False, tokens=32768, steps=4, warmup=1, max_seqs=8, vocab_size=None,
                compile=True, extra=[])  # fmt: skip
    return argparse.Namespace(**{**base, **kw})


def _log(step_ms: list[float], tokens: int, peak: float, losses: list[float]) -> dict:
    steps = [{"step": i + 1, "loss": loss, "step_ms": ms, "tokens": tokens, "tokens_per_s": tokens / ms * 1e3,
              "peak_mem_gib": peak + i} for i, (ms, loss) in enumerate(zip(step_ms, losses))]  # fmt: skip
    return {"settings": {}, "world": 1, "steps": steps}


def test_comparison_table_from_logs():
    runs = {
        ("recipe", 1): _log([9000.0, 100.0, 110.0, 120.0], 32768, 20.0, [10.0, 9.0, 8.0, 7.5]),
        ("Trainer", 1): _log([3000.0, 200.0, 220.0, 240.0], 32768, 30.0, [10.0, 9.5, 9.0, 8.5]),
        ("recipe", 4): _log([9000.0, 40.0, 40.0, 40.0], 32768, 8.0, [10.0, 9.0, 8.0, 7.0]),
        ("Trainer", 4): "out of memory",
    }
    result = bench_trainer.comparison_result(_args(), runs, env={"device": "GPU"})
    assert result.name == "train-trainer-slice4"
    rows = result.records()
    assert [(r["runner"], r["W"], r["status"]) for r in rows] == [
        ("recipe", 1, "ok"), ("Trainer", 1, "ok"), ("recipe", 4, "ok"), ("Trainer", 4, "out of memory")]  # fmt: skip
    recipe, trainer = rows[0], rows[1]
    assert recipe["step ms"] == 110.0 and trainer["step ms"] == 220.0  # medians after the warm-up step
    assert trainer["tokens/s"] == pytest.approx(32768 / 0.22)
    assert trainer["Trainer / recipe"] == pytest.approx(0.5) and recipe["Trainer / recipe"] is None
    assert trainer["peak GiB"] == 33.0 and trainer["first step s"] == 3.0 and trainer["last loss"] == 8.5
    assert rows[3]["tokens/s"] is None and rows[3]["Trainer / recipe"] is None
    assert "| Trainer | 1 | ok | 220.0 | 148945 | 0.50 | 33.0 | 3.0 | 8.5000 |" in result.markdown()
    smoke = bench_trainer.comparison_result(_args(preset="tiny", smoke=True, vocab_size=512), runs, env={})
    assert smoke.name == "train-trainer-tiny-smoke-v512"


def test_both_scripts_accept_their_command_lines(tmp_path):
    """The arguments bench_trainer gives each script, with the --no-progress that bench_train's
    torchrun appends, parse as meant."""
    pytest.importorskip("accelerate", reason="the trainer extra is not installed (pip install -e '.[hf,trainer]')")
    spec = importlib.util.spec_from_file_location("sft_qwen3_next_trainer", bench_trainer.TRAINER_SCRIPT)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    for smoke in (False, True):
        args = _args(smoke=smoke, vocab_size=1024)
        got = example.parser().parse_args(
            bench_trainer.trainer_run_args(args, 4, tmp_path / "log.json", tmp_path) + ["--no-progress"]
        )
        assert (got.preset, got.cp, got.tokens_per_step, got.steps, got.grad_accum, got.loss, got.vocab_size) == (
            "slice4", 4, 32768, 4, 1, "fused", 1024)  # fmt: skip
        assert got.dtype == ("float32" if smoke else "bfloat16") and (got.device == "cpu" or not smoke)
        assert not got.progress
    recipe = load_recipe().parser().parse_args(
        bench_trainer.cp_run_args(_args(), 4, 32768, False, tmp_path / "log.json") + ["--no-progress"]
    )
    assert (recipe.preset, recipe.dp, recipe.cp, recipe.tokens_per_step, recipe.compile, recipe.lr) == (
        "slice4", 1, 4, 32768, True, float(bench_trainer.RECIPE_LR))  # fmt: skip


@pytest.mark.slow
def test_smoke_run(tmp_path):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("TRITON_INTERPRET", None)
    run = subprocess.run([sys.executable, "-m", "benchmarks.bench_trainer", "--smoke", "--out", str(tmp_path)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    result = load_all(tmp_path)["train-trainer-tiny-smoke"]
    rows = result.records()
    assert [(r["runner"], r["W"], r["status"]) for r in rows] == [
        ("recipe", 1, "ok"), ("Trainer", 1, "ok"), ("recipe", 2, "ok"), ("Trainer", 2, "ok")]  # fmt: skip
    assert all(r["tokens/s"] > 0 and r["peak GiB"] > 0 for r in rows)
    assert all(r["Trainer / recipe"] > 0 for r in rows if r["runner"] == "Trainer")
