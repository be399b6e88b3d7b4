"""The demo's local ranks: W processes on this machine, one per rank, that train together.

Rank r of a CUDA group computes on GPU r (NCCL); a CPU group uses gloo. The ranks meet
through a file store in a fresh temporary directory, so no TCP port is needed and two
runs started at once on one machine never take each other's. NVLink multicast stays off
(NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 unless set): a program that uses
it can put a shared host's GPUs out of service.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cp_ops_demo.report import reduce_results
from cp_ops_demo.train import train

__all__ = ["run_ranks", "init_local_rank", "leave_local_rank"]


def init_local_rank(rank: int, world: int, init_method: str, device: str) -> torch.device:
    """Join the ``world``-rank group that meets at ``init_method`` as ``rank``; returns the
    device this rank computes on. On the CPU the ranks share the cores (torch's intra-op
    threads: the cores over W)."""
    if device == "cuda":
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        torch.cuda.set_device(rank)
        dev = torch.device("cuda", rank)
        dist.init_process_group("nccl", init_method=init_method, rank=rank, world_size=world, device_id=dev)
        return dev
    if device != "cpu":
        raise ValueError(f"device must be 'cuda' or 'cpu', got {device!r}")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    return torch.device("cpu")


def leave_local_rank() -> None:
    """End a rank's process now, with exit status 0 and without the interpreter's teardown.
    Called last, after ``destroy_process_group``, on the success path only.

    Gloo's worker threads can still hold work objects when a process exits, and destroying
    them during finalisation can abort a rank whose work all succeeded ("terminate called
    without an active exception"; pytorch/pytorch#179291). Skipping the teardown skips that.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _rank_entry(rank: int, world: int, init_method: str, args: argparse.Namespace, result_path: str) -> None:
    device = init_local_rank(rank, world, init_method, args.device)
    try:
        group = dist.group.WORLD
        res = reduce_results(train(rank, world, group, args, device), group, device)
        res["backend"] = dist.get_backend(group)
        if rank == 0:
            with open(result_path, "w") as f:
                json.dump(res, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    leave_local_rank()  # reached only when the run succeeded


def run_ranks(args: argparse.Namespace) -> dict:
    """Train on ``args.cp_size`` spawned ranks; returns rank 0's results (maxima over ranks).

    The ranks are started with the ``spawn`` method, so a script calling this needs the
    usual ``if __name__ == "__main__":`` guard.
    """
    with tempfile.TemporaryDirectory(prefix="cp_ops_demo_") as tmp:
        init_method = "file://" + os.path.join(tmp, "store")
        path = os.path.join(tmp, "results.json")
        mp.spawn(_rank_entry, args=(args.cp_size, init_method, args, path), nprocs=args.cp_size, join=True)
        with open(path) as f:
            return json.load(f)
