"""The multi-rank harness: ranks that pass end their processes early (leave_local_rank, which
skips the interpreter's teardown), so a failing rank must still fail the test."""

import pytest
from torch.multiprocessing import ProcessRaisedException

from tests._dist import run_ranks


def _rank_one_fails(rank, world):
    if rank == 1:
        raise ValueError(f"rank {rank} of {world} fails")


def _all_pass(rank, world):
    assert 0 <= rank < world


@pytest.mark.dist
def test_a_failing_rank_fails_the_run():
    with pytest.raises(ProcessRaisedException, match="rank 1 of 2 fails"):
        run_ranks(2, _rank_one_fails)


@pytest.mark.dist
def test_passing_ranks_exit_cleanly():
    run_ranks(2, _all_pass)
