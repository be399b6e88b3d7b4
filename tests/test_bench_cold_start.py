"""The CPU parts of benchmarks/bench_host.py --cold-start: it reads a child's output as it comes and
parses the demo's real output. The smoke run starts fresh processes that compile from empty
caches and takes minutes on the CPU: a slow test (make test-all); the table's arithmetic and
the parsing are tested here in the fast tier, the layers themselves in tests/cp_ops."""

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from benchmarks import bench_host as cold
from benchmarks.runner import load

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env() -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("TRITON_INTERPRET", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    return env


def _run(module: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    run = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=_env(), capture_output=True, text=True,
                         timeout=timeout)  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    return run


# --- bench_host --cold-start ------------------------------------------------------------------------------

# An excerpt of ``python -m cp_ops demo --cp-size 1`` on the CPU with empty caches, as
# stamp_output read it: (seconds since the process started, piece of output)
DEMO_SAMPLE = [
    (2.581, "[   0.0 s] compiling: the first run on a machine compiles for minutes (Inductor, Triton, autotuning); "
            "later runs reuse the caches and start in seconds"),
    (2.59, "[   0.0 s] training on 1 rank(s), float32; step 1 compiles"),
    (17.593, "train:   0%|          | 0/6 [00:00<?, ?step/s][  15.0 s] still compiling (15 s in this step)"),
    (47.599, "[  45.0 s] still compiling (45 s in this step)"),
    (51.293, "train:  17%|█▋        | 1/6 [00:48<04:03, 48.70s/step, loss 5.7248]"),
    (54.79, "train:  33%|███▎      | 2/6 [00:52<01:28, 22.11s/step, loss 5.2018]"),
    (68.961, "train: 100%|██████████| 6/6 [01:06<00:00, 11.06s/step, loss 3.6723]"),
    (68.962, "---------------------------------------------------------------------------------"),
    (68.962, "ranks          1"),
    (68.962, "mode           torch.compile(fullgraph=True); ops run torch references on the CPU"),
    (68.962, "tokens / step  690 real, 692 rows padded"),
    (68.962, "tokens/s       195 (real tokens of the global batch)"),
    (68.962, "step time      3534.9 ms (median after step 1)"),
    (68.962, "compile time   45.2 s (step 1 - median)"),
    (68.962, "graph breaks   0"),
    (68.962, "recompiles     0"),
    (68.962, "max rel error  n/a (W = 1: the run is the one-device run)"),
    (68.962, "peak memory    616 MiB (peak RSS)"),
]  # fmt: skip


def test_parse_demo_reads_the_demos_output():
    figures = cold.parse_demo(DEMO_SAMPLE)
    assert figures == {"to_step1_s": 51.293, "to_training_s": 2.59, "step_ms": 3534.9, "compile_s": 45.2,
                       "tokens_per_s": 195.0, "graph_breaks": 0}  # fmt: skip


def test_parse_demo_reads_the_demos_own_bar_and_missing_figures():
    pieces = [(1.0, "train [..............................] 0/12 "), (9.5, "train [##............................] 1/12 "
              "loss 5.1"), (10.0, "train [#####.........................] 11/12 loss 4.0"),
              (11.0, "step time      n/a (one step)"), (11.0, "tokens/s       12,345 (real tokens)")]  # fmt: skip
    figures = cold.parse_demo(pieces)
    assert figures["to_step1_s"] == 9.5 and figures["tokens_per_s"] == 12345.0
    assert figures["step_ms"] is None and figures["compile_s"] is None and figures["to_training_s"] is None
    assert cold.parse_demo([(3.0, "train [#####] 11/12 loss 4.0")])["to_step1_s"] is None


def test_stamper_stamps_a_redrawn_line_when_its_text_arrives():
    s = cold.Stamper()
    assert s.feed(b"[   0.0 s] training on 1 rank", 1.0) == []
    assert s.feed(b"(s)\n\rtrain:   0%| 0/6", 2.0) == [(2.0, "[   0.0 s] training on 1 rank(s)")]
    assert s.feed(b"\rtrain:  17%|\xe2\x96", 5.0) == [(2.0, "train:   0%| 0/6")]
    assert s.feed(b"\x8b| 1/6", 6.0) == []
    assert s.feed(b"\rtrain:  33%| 2/6\n", 9.0) == [(6.0, "train:  17%|▋| 1/6"), (9.0, "train:  33%| 2/6")]
    assert s.feed(b"step time      1.0 ms", 9.5) == [] and s.close() == [(9.5, "step time      1.0 ms")]


def test_stamp_output_streams_and_stops_a_run_past_its_limit():
    script = ("import sys, time\nsys.stderr.write('\\rtrain 0/2'); sys.stderr.flush(); time.sleep(0.5)\n"
              "sys.stderr.write('\\rtrain 1/2'); sys.stderr.flush(); time.sleep(0.5)\nprint('\\nstep time  2.0 ms')\n")  # fmt: skip
    run = cold.stamp_output([sys.executable, "-c", script], _env(), timeout=60)
    assert run["rc"] == 0 and [text for _, text in run["pieces"]] == ["train 0/2", "train 1/2", "step time  2.0 ms"]
    (t0, _), (t1, _), (t2, _) = run["pieces"]
    assert t0 < t1 < t2 <= run["total_s"] and t1 - t0 > 0.3
    assert cold.parse_demo(run["pieces"])["to_step1_s"] == t1
    stuck = cold.stamp_output([sys.executable, "-c", "print('up', flush=True); import time; time.sleep(60)"], _env(),
                              timeout=2)  # fmt: skip
    assert stuck["rc"] is None and stuck["total_s"] < 30 and stuck["pieces"][0][1] == "up"


def test_child_environment_has_empty_caches_and_no_kept_autotuning(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_AUTOTUNING", "1")
    env = cold.child_environment(str(tmp_path), keep_autotuning=False)
    assert "TRITON_CACHE_AUTOTUNING" not in env and env["PYTHONPATH"].split(os.pathsep)[0] == cold.ROOT
    for name in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "CUDA_CACHE_PATH"):
        assert env[name].startswith(str(tmp_path)) and os.listdir(env[name]) == []
    assert cold.child_environment(str(tmp_path), keep_autotuning=True)["TRITON_CACHE_AUTOTUNING"] == "1"


def test_cold_start_runs_cold_warm_then_unseeded():
    runs = [(which, dict(env)) for which, env in cold.runs_and_environments(SimpleNamespace(
        keep_autotuning=False, unseeded=True), "demo")]  # fmt: skip
    assert [which for which, _ in runs] == ["cold", "warm", "unseeded"]
    (_, first), (_, warm), (_, unseeded) = runs
    assert warm["TRITON_CACHE_DIR"] == first["TRITON_CACHE_DIR"] != unseeded["TRITON_CACHE_DIR"]
    assert "CP_OPS_FLA_CONFIGS" not in first and unseeded["CP_OPS_FLA_CONFIGS"] == "0"
    seeded_only = cold.runs_and_environments(SimpleNamespace(keep_autotuning=False, unseeded=False), "demo")
    assert [which for which, _ in seeded_only] == ["cold", "warm"]


def test_cold_start_rows_and_target():
    runs = {"cold": {**cold.parse_demo(DEMO_SAMPLE), "total_s": 70.6}, "warm": {"to_step1_s": 9.0}}
    rows = cold.demo_rows(runs)
    assert rows[0] == ["demo", "process start to end of step 1, s", 51.293, 9.0, None, "<= 60 s cold: yes"]
    assert cold.demo_rows({"cold": {"to_step1_s": 75.0}})[0][-1] == "<= 60 s cold: no"
    assert cold.demo_rows({})[0][2:] == [None, None, None, "<= 60 s cold: -"]
    assert cold.demo_rows({"unseeded": {"to_step1_s": 190.0}})[0][4] == 190.0
    args = SimpleNamespace(smoke=True, keep_autotuning=False)
    layer = cold.layer_rows("compiled", {"cold": {"first_step_s": 15.0}})
    result = cold.cold_start_result(rows + layer, ["demo, warm: exited with rc=1"], args)
    assert result.name == "cold-start-smoke" and "rc=1" in result.notes and "| 51.29 | 9.00 |" in result.markdown()


@pytest.mark.slow
def test_cold_start_smoke_runs_the_demo_and_the_layer(tmp_path):
    _run("benchmarks.bench_host", "--cold-start", "--smoke", "--parts", "demo", "layer", "--out", str(tmp_path), timeout=900)
    result = load(tmp_path / "cold-start-smoke.json")
    cells = {(r["part"], r["figure"]): (r["cold"], r["warm"]) for r in result.records()}
    assert all(v is not None and v >= 0 for pair in cells.values() for v in pair), cells
    step1 = cells[("demo", "process start to end of step 1, s")]
    assert step1[0] <= cells[("demo", "process start to exit, s")][0]
    compiled = cells[("GatedDeltaNet compiled", "first fwd+bwd (compiles), s")]
    assert compiled[1] < compiled[0]  # the warm run reuses the cold run's caches
