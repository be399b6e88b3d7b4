"""benchmarks/bench_host.py runs end to end in its ``--smoke`` mode (tiny shapes on the CPU, both
registration forms in subprocesses) and reports every op, so the GPU benchmark does not rot
between GPU runs. The smoke run is a slow test (make test-all)."""

import json
import os
import subprocess
import sys

import pytest

from benchmarks.runner import load

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DIFFERENTIABLE = {
    "thd_seq_to_rank_order", "thd_rank_to_seq_order", "thd_copy_valid_tokens", "permute_sections",
    "unpermute_sections", "sections_to_rank_blocks", "rank_blocks_to_sections", "varlen_attention", "causal_conv1d",
    "causal_conv1d_gather", "chunk_gated_delta_rule",
}  # fmt: skip


def test_ops_selects_groups_and_names():
    """``--ops`` takes groups and op names alike; each selection has its cases (and the floor)."""
    from benchmarks.bench_host import build_cases

    def names(only):
        return {c.name for c in build_cases("cpu", smoke=True, only=only)}

    assert names(["attention", "conv"]) == {"clone (floor)", "varlen_attention", "causal_conv1d", "causal_conv1d_gather"}
    assert names(["gdn"]) == {"clone (floor)", "chunk_gated_delta_rule"}
    assert names(["causal_conv1d"]) == {"clone (floor)", "causal_conv1d"}
    assert "thd_copy_valid_tokens_" in names(["layout"]) and "varlen_attention" not in names(["layout"])
    assert DIFFERENTIABLE <= names(None)


@pytest.mark.slow  # every op timed in both registration forms, in subprocesses; the ops' own tests are fast
def test_bench_host_smoke(tmp_path):
    raw = tmp_path / "raw.json"
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    env.pop("CP_OPS_OPAQUE_KERNELS", None)
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_host", "--smoke", "--out", str(tmp_path),
         "--raw", str(raw)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    runs = json.loads(raw.read_text())["runs"]["this tree"]
    assert set(runs) == {"triton_op", "opaque"}
    for form, r in runs.items():
        rows = {row["op"]: row for row in r["rows"]}
        assert DIFFERENTIABLE | {"thd_copy_valid_tokens_", "clone (floor)"} <= set(rows), form
        for name, row in rows.items():
            assert row["fwd host us"] > 0
            assert ("bwd host us" in row) == (name in DIFFERENTIABLE | {"clone (floor)"}), (form, name)
    result = load(tmp_path / "host-smoke.json")
    assert "fwd host us (this tree)" in result.columns
    assert {(row[0], row[1]) for row in result.rows} >= {(op, form) for op in DIFFERENTIABLE for form in runs}
    assert "| rank_blocks_to_sections | opaque |" in run.stdout

