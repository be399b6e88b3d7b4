"""benchmarks/bench_ag_attention.py --work-model: the tile count against a direct loop."""

import torch
from hypothesis import given
from hypothesis import strategies as st

from benchmarks.bench_ag_attention import tile_pairs, work_model


def _loop(q_len, q_pos, k_len, bm, bn):
    total = 0
    for ql, qp, kl in zip(q_len.tolist(), q_pos.tolist(), k_len.tolist()):
        for t0 in range(0, ql, bm):
            last = qp + min(t0 + bm, ql) - 1
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
    result = work_model()
    assert result.name == "ag-attention-work-model"
    assert [(r["T"], r["W"]) for r in result.records()] == [(t, w) for t in (32768, 65536) for w in (2, 4, 8)]
    assert all(r["ratio"] >= 1.0 for r in result.records())  # for these batches CP adds tiles, never removes them
    assert "| 32768 |" in result.markdown()
