"""The demo's local ranks: W processes on this machine, one per rank, that train together,
joined by :mod:`cp_ops.local_ranks` (NCCL with one GPU per rank, or gloo on the CPU)."""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch.distributed as dist
import torch.multiprocessing as mp

from cp_ops.demo.report import reduce_results
from cp_ops.demo.train import train
from cp_ops.local_ranks import init_local_rank, leave_local_rank, local_rendezvous

__all__ = ["run_ranks"]


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
    with tempfile.TemporaryDirectory(prefix="cp_ops_demo_") as tmp, local_rendezvous() as init_method:
        path = os.path.join(tmp, "results.json")
        mp.spawn(_rank_entry, args=(args.cp_size, init_method, args, path), nprocs=args.cp_size, join=True)
        with open(path) as f:
            return json.load(f)
