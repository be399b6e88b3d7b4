"""Joining a process group of W local ranks: the one piece the demo, the multi-rank tests,
the examples and the multi-rank benchmarks share (each spawns its ranks itself).

Rank r of a CUDA group computes on GPU r (NCCL); a CPU group uses gloo. The ranks meet through
a file store in a fresh temporary directory (:func:`local_rendezvous`), so no TCP port is
needed and two groups started at once on one machine can never take each other's. NVLink
multicast stays off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 unless set): a
program that uses it can put a shared host's GPUs out of service.
"""

from __future__ import annotations

import contextlib
import multiprocessing.util
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator

import torch
import torch.distributed as dist

from custom_ops import env

__all__ = ["host_threads", "init_local_rank", "leave_local_rank", "local_rendezvous"]


@contextlib.contextmanager
def local_rendezvous() -> Iterator[str]:
    """An ``init_method`` (``file://...``) for one group of local ranks, removed on exit.

    Each call makes its own temporary directory, so concurrent groups never share a store.
    Spawn the ranks inside the ``with`` block and pass them the string.
    """
    folder = tempfile.mkdtemp(prefix="cp_ops_rendezvous_")
    try:
        yield "file://" + os.path.join(folder, "store")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def host_threads(device: str, local_world: int) -> int | None:
    """torch's intra-op threads for one of ``local_world`` ranks on this host, None to leave
    them as they are.

    On the CPU the ranks share the cores out. On CUDA one thread a rank unless
    ``OMP_NUM_THREADS`` is set, as torchrun sets for several ranks a node: a rank's host ops
    are small (batches, tables), and a thread per core in each rank makes them wait for cores
    the other ranks' threads hold.
    """
    if device == "cpu":
        return max(1, (os.cpu_count() or 1) // local_world)
    return None if env.omp_threads_set() else 1


def init_local_rank(
    rank: int, world: int, init_method: str, device: str, num_threads: int | None = None
) -> torch.device:
    """Join the ``world``-rank group that meets at ``init_method`` (from :func:`local_rendezvous`)
    as ``rank``.

    ``device="cuda"``: NCCL, this rank on GPU ``rank``; ``"cpu"``: gloo. ``num_threads``
    sets torch's intra-op threads (default: :func:`host_threads`). Returns the device this
    rank computes on.
    """
    if num_threads is None:
        num_threads = host_threads(device, world)
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    if device == "cuda":
        env.set_nvlink_multicast_off()
        torch.cuda.set_device(rank)
        dev = torch.device("cuda", rank)
        dist.init_process_group("nccl", init_method=init_method, rank=rank, world_size=world, device_id=dev)
        return dev
    if device != "cpu":
        raise ValueError(f"device must be 'cuda' or 'cpu', got {device!r}")
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    return torch.device("cpu")


def leave_local_rank() -> None:
    """End a spawned rank's process now, with exit status 0 and without the interpreter's
    teardown. Call it last, after ``destroy_process_group``, on the success path only.

    Gloo's worker threads can still hold work objects at exit, and destroying them during
    finalisation can abort a rank whose work all succeeded (pytorch/pytorch#179291).

    The one part of the teardown kept is multiprocessing's: its finalizers release the named
    semaphores the rank created (tqdm's write lock, for one: the demo's progress bar), which
    the parent's resource tracker would otherwise report as leaked when the run ends.
    """
    multiprocessing.util._run_finalizers(0)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
