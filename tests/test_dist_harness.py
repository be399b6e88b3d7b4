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


def _meets_its_own_group(rank, world, tag):
    import torch
    import torch.distributed as dist

    got = [None] * world
    dist.all_gather_object(got, (tag, rank))
    assert got == [(tag, r) for r in range(world)], got  # no rank of the other group joined
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    assert t.item() == world * (world + 1) / 2


@pytest.mark.dist
def test_concurrent_groups_never_collide():
    """Two groups started at the same moment: each meets at its own store, so neither fails to
    rendezvous nor takes a rank of the other. One round shows it: every store is a directory of
    its own (``local_rendezvous``), so a collision is not a matter of timing."""
    import threading

    errors = []

    def start(tag):
        try:
            run_ranks(2, _meets_its_own_group, tag)
        except Exception as e:  # noqa: BLE001 (reported below with the tag)
            errors.append((tag, e))

    threads = [threading.Thread(target=start, args=(f"group-{g}",)) for g in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
