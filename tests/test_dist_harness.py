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
    with pytest.raises(ProcessRaisedException) as failure:
        run_ranks(2, _rank_one_fails)
    # the error reported is the first a process exits with: rank 1's own, or the one gloo
    # raises in rank 0's barrier when its peer is gone ("Connection closed by peer", ...)
    message = str(failure.value)
    assert "rank 1 of 2 fails" in message or "gloo" in message, message


@pytest.mark.dist
def test_passing_ranks_exit_cleanly():
    run_ranks(2, _all_pass)
