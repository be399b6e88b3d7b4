"""One harness for multi-rank tests: spawn W processes, each in a gloo (CPU) or NCCL (one GPU
per rank) group.

The rank function must be a module-level function (it is pickled by name):
``fn(rank, world_size, *args)``. Exceptions in any rank fail the test with
that rank's traceback. Ports are taken free from the OS, never fixed.
"""

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, backend: str, fn, args) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    if backend == "nccl":
        # NVLink multicast stays off on shared hosts
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", rank=rank, world_size=world_size, device_id=torch.device("cuda", rank))
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_ranks(world_size: int, fn, *args, backend: str = "gloo") -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks and wait for all.

    ``backend="nccl"`` puts rank r on GPU r (needs ``world_size`` GPUs).
    """
    mp.spawn(_entry, args=(world_size, _free_port(), backend, fn, args), nprocs=world_size, join=True)
