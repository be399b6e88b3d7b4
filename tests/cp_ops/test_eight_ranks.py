"""W = 8 on gloo ranks (CPU): the fused all-to-all, the GDN layer and all-gather CP attention
agree with one rank, as the smaller groups of the other test files do.

One spawn of eight processes runs all three checks (each spawn costs more than the
checks on 2 cores). float64, so agreement is to rounding: bit-exact for the all-to-all,
1e-7 for the GDN layer, the float64 tolerance for attention. The layouts include
zero-length and length-1 sequences and sequences shorter than 2W (whole chunks of
padding on some ranks).
"""

import pytest
import torch
import torch.distributed as dist

from cp_ops import shard_thd
from custom_ops import ag_thd_attention
from tests._dist import run_ranks
from tests.cp_ops.test_attention import CASES, TOL, _assert_close, _cp_run, _global_case, _reference
from tests.cp_ops.test_comm import _check_cases, _drawn_cases
from tests.cp_ops.test_gdn_cp import _compare_rank

WORLD = 8


def _eight_ranks(rank, world, a2a_cases):
    group = dist.group.WORLD
    # the fused CP <-> head-parallel all-to-all: values, round trips, gradients (bit-exact)
    _check_cases(rank, world, a2a_cases, group)
    # the GDN layer: one key head per rank
    _compare_rank(rank, world, [9, 0, 1, 23, 6], (8, 16), False)
    # all-gather CP attention: causal, windows, GQA, empty sequences; one and two launches
    for i, (seqlens, heads, d, causal, window) in enumerate(CASES):
        cu, cup, q, k, v, dout = _global_case(seqlens, heads, d, world, seed=i)
        want = [shard_thd(t, cup, world, rank) for t in _reference(q, k, v, dout, cu, cup, causal, window)]
        local = [shard_thd(t, cup, world, rank) for t in (q, k, v, dout)]
        for launches in (1, 2):
            got = _cp_run(ag_thd_attention, *local, cu, cup, causal, window, group=group, launches=launches)
            _assert_close(got, want, TOL, f"W={world} rank {rank} case {i} launches={launches}")


@pytest.mark.dist
def test_eight_ranks_match_one_rank():
    run_ranks(WORLD, _eight_ranks, _drawn_cases(limit=6))  # section widths are multiples of W
