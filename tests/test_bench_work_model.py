"""benchmarks/bench_attention.py cp --work-model: the tile count against a direct loop."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from benchmarks.bench_attention import parse_args, tile_pairs, work_model
from benchmarks.internals import kernel_config
from benchmarks.runner import load


def _loop(q_len, q_pos, k_len, bm, bn):
    """The key tiles of each query tile as the kernels cut the tiles (``_tiles_end``): from the
    segment's end, moved onto the key-tile grid where the partial tile has the rows to spare."""
    total = 0
    for ql, qp, kl in zip(q_len.tolist(), q_pos.tolist(), k_len.tolist()):
        end = ql
        if ql > 0 and qp + ql > 0 and -(qp + ql) % bn <= -ql % bm:
            end += -(qp + ql) % bn
        for e in range(-(-ql // bm)):
            last = qp + min(end - e * bm, ql) - 1
            total += -(-min(kl, last + 1) // bn)
    return total


@given(
    st.lists(st.tuples(st.integers(0, 300), st.integers(0, 500), st.integers(0, 800)), max_size=6),
    st.sampled_from([(16, 16), (64, 32), (128, 64)]),
)
def test_tile_pairs_matches_a_loop(segments, blocks):
    q_len, q_pos, k_len = (torch.tensor([s[i] for s in segments], dtype=torch.int32) for i in range(3))
    assert tile_pairs(q_len, q_pos, k_len, *blocks) == _loop(q_len, q_pos, k_len, *blocks)


def test_work_model_table():
    result = work_model(256)
    assert result.name == "ag-attention-work-model-d256"
    bm = kernel_config("fwd", 256, interpreting=False)["BLOCK_M"]
    assert [(r["BLOCK_M"], r["T"], r["W"]) for r in result.records()] == [
        (m, t, w) for m in (bm, bm // 2) for t in (32768, 65536) for w in (2, 4, 8)
    ]
    assert all(r["ratio"] >= 1.0 for r in result.records())  # for these batches CP adds tiles, never removes them
    ratio = {(r["BLOCK_M"], r["T"], r["W"]): r["ratio"] for r in result.records()}
    assert all(ratio[bm // 2, t, w] < ratio[bm, t, w] for t in (32768, 65536) for w in (2, 4, 8))  # fewer partial tiles
    assert "| 32768 |" in result.markdown()


def test_modes_keep_their_flags_apart():
    """kernel's --profile and --head-dims, cp's --profile and --head-dim: each mode parses its own."""
    kernel = parse_args(["kernel", "--profile", "--head-dims", "256", "--gqa", "8", "--pointer-loads"])
    assert (kernel.mode, kernel.profile, kernel.head_dims, kernel.gqa, kernel.pointer_loads) == (
        "kernel", True, [256], 8, True
    )
    tune = parse_args(["tune", "--kinds", "fwd", "--rounds", "3"])
    assert (tune.kinds, tune.rounds, tune.head_dims) == (["fwd"], 3, [128, 64])
    cp = parse_args(["cp", "--world", "4", "--tokens", "32768", "131072", "--gqa", "8", "--head-dim", "256",
                     "--head-groups", "--cudagraphs", "--profile", "--out", "o"])  # fmt: skip
    assert (cp.world, cp.tokens, cp.gqa, cp.head_dim, cp.head_groups, cp.cudagraphs, cp.profile) == (
        4, [32768, 131072], 8, 256, [], True, True
    )
    assert (cp.out, cp.smoke, cp.work_model) == ("o", False, False)


@pytest.mark.slow  # a process of its own; the model's functions are tested above
def test_work_model_from_the_command_line(tmp_path):
    root = Path(__file__).resolve().parent.parent
    cmd = [sys.executable, "-m", "benchmarks.bench_attention", "cp", "--work-model", "--head-dim", "256",
           "--out", str(tmp_path)]  # fmt: skip
    subprocess.run(cmd, cwd=root, check=True, capture_output=True)
    assert load(tmp_path / "ag-attention-work-model-d256.json").rows == work_model(256).rows
