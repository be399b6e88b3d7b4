"""custom_ops.thd.index: the worked example of docs/design.md section 1, and every map against
the definition written as a loop over (rank, sequence, chunk)."""

import torch
from hypothesis import given

import cp_ops
from custom_ops.testing import thd_layouts
from custom_ops.thd import index as thd_index


def test_worked_example():
    cu, cup = cp_ops.pad_cu_seqlens([5, 2, 0], 2)
    assert cup.tolist() == [0, 8, 12, 12]
    assert thd_index.chunk_rows(cup, 2).tolist() == [2, 1, 0]
    assert thd_index.local_offsets(cup, 2).tolist() == [0, 4, 6, 6]
    assert thd_index.local_chunk_bounds(cup, 2).tolist() == [0, 2, 4, 5, 6, 6, 6]
    assert thd_index.seq_to_rank_index(cup, 2, 12).tolist() == [0, 1, 6, 7, 8, 11, 2, 3, 4, 5, 9, 10]
    assert thd_index.local_positions(cup, 2, 0, 6).tolist() == [0, 1, 6, 7, 0, 3]
    assert thd_index.local_positions(cup, 2, 1, 6).tolist() == [2, 3, 4, 5, 1, 2]
    lens, c = cu.diff().long(), thd_index.chunk_rows(cup.long(), 2)
    assert [thd_index.valid_rows(lens, c, j).tolist() for j in range(4)] == [[2, 1, 0], [2, 1, 0], [1, 0, 0], [0, 0, 0]]
    assert thd_index.local_chunks(1, 2) == (1, 2)


@given(thd_layouts())
def test_maps_match_the_loop_definition(layout):
    cp_size, seqlens = layout
    _, cup = cp_ops.pad_cu_seqlens(seqlens, cp_size)
    rows = int(cup[-1])
    spans = list(thd_index.chunk_spans(cup, cp_size))
    loop = [s + k for _, s, c in spans for k in range(c)]  # sequence-order row of each rank-order row
    assert sorted(loop) == list(range(rows))
    fwd = thd_index.seq_to_rank_index(cup, cp_size, rows)
    assert fwd.tolist() == loop
    assert torch.equal(thd_index.rank_to_seq_index(cup, cp_size, rows)[fwd], torch.arange(rows))
    per_rank = rows // cp_size
    seq_start = torch.repeat_interleave(cup[:-1].long(), cup.diff().long())  # each row's sequence start
    for r in range(cp_size):
        shard = thd_index.shard_rows(cup, cp_size, r, per_rank)
        assert torch.equal(shard, fwd[r * per_rank : (r + 1) * per_rank])
        assert torch.equal(thd_index.local_positions(cup, cp_size, r, per_rank), shard - seq_start[shard])
    rank0_chunks = [c for _, _, c in spans[: 2 * len(seqlens) : 2]]  # one chunk of each sequence
    assert [c * thd_index.padding_multiple(cp_size) for c in rank0_chunks] == cup.diff().tolist()
    assert thd_index.chunk_rows(cup, cp_size).tolist() == rank0_chunks
    bounds, per_rank_spans = thd_index.local_chunk_bounds(cup, cp_size), 2 * len(seqlens)
    assert bounds.dtype == cup.dtype
    for r in range(cp_size):  # the bounds of each rank's spans, in its row order
        sizes = [c for _, _, c in spans[r * per_rank_spans : (r + 1) * per_rank_spans]]
        assert bounds.tolist() == [sum(sizes[:i]) for i in range(len(sizes) + 1)]
