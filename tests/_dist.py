"""One harness for multi-rank tests: spawn W processes, each in a gloo (CPU) or NCCL (one GPU
per rank) group.

The rank function must be a module-level function (it is pickled by name):
``fn(rank, world_size, *args)``. Exceptions in any rank fail the test with
that rank's traceback. Ports are taken free from the OS, never fixed.
"""

import torch.distributed as dist
import torch.multiprocessing as mp

from cp_ops._local_ranks import free_port, init_local_rank


def _entry(rank: int, world_size: int, port: int, backend: str, fn, args) -> None:
    init_local_rank(rank, world_size, port, "cuda" if backend == "nccl" else "cpu", num_threads=1)
    try:
        fn(rank, world_size, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_ranks(world_size: int, fn, *args, backend: str = "gloo") -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks and wait for all.

    ``backend="nccl"`` puts rank r on GPU r (needs ``world_size`` GPUs).
    """
    mp.spawn(_entry, args=(world_size, free_port(), backend, fn, args), nprocs=world_size, join=True)


_WAIT = "_c10d_functional.wait_tensor.default("


def collective_windows(code: str, collective: str = "all_to_all_single") -> list[str]:
    """The stretches of Inductor-generated ``code`` between each call of the functional
    collective ``collective`` (``all_to_all_single``, ``all_gather_into_tensor``,
    ``reduce_scatter_tensor``) and the next wait after it: what runs while it is in flight."""
    marker = f"_c10d_functional.{collective}.default("
    windows, start = [], code.find(marker)
    while start >= 0:
        end = code.find(_WAIT, start)
        windows.append(code[start : end if end >= 0 else len(code)])
        start = code.find(marker, start + 1)
    return windows


def exchange_windows(code: str) -> list[str]:
    """:func:`collective_windows` of the all-to-alls."""
    return collective_windows(code, "all_to_all_single")


def gemm_overlaps_an_exchange(code: str) -> bool:
    """Whether a GEMM runs in Inductor-generated ``code`` while some all-to-all is in flight."""
    return any("mm(" in w for w in exchange_windows(code))
