"""Joining a process group of W local ranks: the one piece the demo, the multi-rank tests and
the multi-rank benchmarks share (each spawns its ranks itself).

Rank r of a CUDA group computes on GPU r (NCCL); a CPU group uses gloo. Ports come free
from the OS, never fixed. NVLink multicast stays off (NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 unless set): a program that uses it can put a shared
host's GPUs out of service.
"""

from __future__ import annotations

import os
import socket
import sys

import torch
import torch.distributed as dist


def free_port() -> int:
    """A TCP port on 127.0.0.1 that the OS reports free now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_local_rank(rank: int, world: int, port: int, device: str, num_threads: int | None = None) -> torch.device:
    """Join the ``world``-rank group rendezvousing on 127.0.0.1:``port`` as ``rank``.

    ``device="cuda"``: NCCL, this rank on GPU ``rank``; ``"cpu"``: gloo. ``num_threads``
    sets torch's intra-op threads (default on the CPU: the cores shared out over the
    ranks; on CUDA: left as it is). Returns the device this rank computes on.
    """
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    if num_threads is None and device == "cpu":
        num_threads = max(1, (os.cpu_count() or 1) // world)
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    if device == "cuda":
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        torch.cuda.set_device(rank)
        dev = torch.device("cuda", rank)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=dev)
        return dev
    if device != "cpu":
        raise ValueError(f"device must be 'cuda' or 'cpu', got {device!r}")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    return torch.device("cpu")


def leave_local_rank() -> None:
    """End a spawned rank's process now, with exit status 0 and without the interpreter's
    teardown. Call it last, after ``destroy_process_group``, on the success path only.

    Gloo's worker threads can still hold work objects when a process exits; destroying them
    during finalisation has, now and then, aborted a rank whose work had all succeeded
    ("terminate called without an active exception", SIGABRT): once in the demo's two-rank
    test and once in the GDN benchmark's smoke run, neither reproducible on demand (the
    mechanism is described in pytorch/pytorch#179291). Skipping the teardown skips that.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
