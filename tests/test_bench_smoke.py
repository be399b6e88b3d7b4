"""The multi-rank benchmark scripts run end to end in their ``--smoke`` mode (2 gloo ranks on
the CPU, tiny shapes): their built-in checks against references pass and they write their
result as JSON (benchmarks/runner.py). Keeps the GPU benchmarks from rotting between GPU runs.

Each spawns two ranks (the layer benchmarks compile their layers there for minutes): slow tests
(make test-all), as are the Inductor compiles of those layers on two ranks
(tests/cp_ops/test_gdn_cp.py, test_attention.py); the fast tier compiles them on two ranks in
tests/cp_ops/test_gdn_states.py and test_transformers.py, and checks the benchmarks' tables and
result files in tests/test_benchmarks.py."""

import os
import subprocess
import sys

import pytest

from benchmarks.runner import load_all

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CASES = {
    # module, extra args, the result's name, a column or row name the table must have
    "cp2hp": ("benchmarks.bench_cp2hp", [], "cp2hp-smoke-w2", "bare a2a, no self block"),
    "gdn": ("benchmarks.bench_gdn", ["--cp", "2"], "gdn-cp-smoke-w2", "scaling efficiency, compiled"),
    "ag-attention": (
        "benchmarks.bench_attention", ["cp"], "ag-attention-smoke-w2", "eff 1L compiled vs 1 GPU compiled"
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_benchmark_smoke_run(name, tmp_path):
    module, args, result_name, expected = CASES[name]
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    # a crash in a rank (a signal, not an exception) then shows each thread's Python stack, and
    # the ranks' progress lines reach the pipe before it instead of dying in their buffers
    env.update(PYTHONFAULTHANDLER="1", PYTHONUNBUFFERED="1")
    run = subprocess.run(
        [sys.executable, "-m", module, *args, "--smoke", "--out", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-10000:]
    results = load_all(tmp_path)
    assert result_name in results, list(results)
    result = results[result_name]
    assert expected in result.columns or expected in result.column(result.columns[0])
    assert result.env["device"] and result.rows and "|---" in result.markdown()
