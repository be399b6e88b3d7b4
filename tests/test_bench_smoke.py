"""The multi-rank benchmark scripts run end to end in their ``--smoke`` mode (2 gloo ranks on
the CPU, tiny shapes): their built-in checks against references pass and they write a table.
So does the single-process GEMM benchmark (tiny shapes on the CPU).
Keeps the GPU benchmarks from rotting between GPU runs."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CASES = {
    # script, extra args, a header cell the table must have
    "cp2hp": ("benchmarks/bench_cp2hp.py", [], "bare a2a, no self block"),
    "gdn": ("benchmarks/bench_gdn.py", ["--cp", "2"], "scaling efficiency, compiled"),
    "ag-attention": ("benchmarks/bench_ag_attention.py", [], "eff 1L compiled vs 1 GPU compiled"),
    "gdn-gemms": ("benchmarks/bench_gdn_gemms.py", [], "rank / (1 GPU / W)"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_benchmark_smoke_run(name, tmp_path):
    script, args, expected = CASES[name]
    out = tmp_path / f"{name}.md"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TRITON_INTERPRET", None)
    # a crash in a rank (a signal, not an exception) then shows each thread's Python stack, and
    # the ranks' progress lines reach the pipe before it instead of dying in their buffers
    env.update(PYTHONFAULTHANDLER="1", PYTHONUNBUFFERED="1")
    run = subprocess.run(
        [sys.executable, script, *args, "--smoke", "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-10000:]
    table = out.read_text()
    assert expected in table and "|---" in table
