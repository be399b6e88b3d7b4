"""One harness for multi-rank tests: start W processes, each in a gloo (CPU) or NCCL (one GPU
per rank) group.

The rank function must be a module-level function (it is pickled by name):
``fn(rank, world_size, *args)``. Exceptions in any rank fail the test with
that rank's traceback. Each run meets at its own file store (no TCP port).
"""

import multiprocessing
import os
import re

import torch.distributed as dist
import torch.multiprocessing as mp

from cp_ops.local_ranks import init_local_rank, leave_local_rank, local_rendezvous

# gloo ranks start from a fork server that has imported these once (a spawned rank imports
# them anew: seconds of each multi-rank test). NCCL ranks are spawned: importing the packages
# may initialise the CUDA driver, which a forked child cannot use.
multiprocessing.set_forkserver_preload(
    ["torch", "torch.distributed", "hypothesis", "transformers", "custom_ops", "cp_ops"]
)


def _entry(rank: int, world_size: int, init_method: str, backend: str, fn, args, environ: dict) -> None:
    # a fork server's child has the server's environment: the caller's, as it is now
    os.environ.clear()
    os.environ.update(environ)
    init_local_rank(rank, world_size, init_method, "cuda" if backend == "nccl" else "cpu", num_threads=1)
    try:
        fn(rank, world_size, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    leave_local_rank()  # reached only when fn passed


def run_ranks(world_size: int, fn, *args, backend: str = "gloo") -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks and wait for all.

    ``backend="nccl"`` puts rank r on GPU r (needs ``world_size`` GPUs).
    """
    with local_rendezvous() as init_method:
        mp.start_processes(_entry, args=(world_size, init_method, backend, fn, args, dict(os.environ)),
                           nprocs=world_size, join=True, start_method="spawn" if backend == "nccl" else "forkserver")


_WAIT = "_c10d_functional.wait_tensor.default("


def collective_windows(code: str, collective: str) -> list[str]:
    """For each ``collective`` (e.g. ``all_gather_into_tensor``) issued in Inductor-generated
    ``code``, the stretch of code from its issue to the wait on its own output: what runs while
    it is in flight (other collectives may be issued, and waited for, in between)."""
    windows = []
    for m in re.finditer(rf"(\w+) = torch\.ops\._c10d_functional\.{collective}\.default\(", code):
        end = code.find(f"{_WAIT}{m.group(1)})", m.end())
        windows.append(code[m.start() : end if end >= 0 else len(code)])
    return windows


def exchange_windows(code: str) -> list[str]:
    """:func:`collective_windows` of the all-to-alls: what runs while each exchange is in flight."""
    return collective_windows(code, "all_to_all_single")


def gemms_overlap_every_exchange(code: str) -> bool:
    """Whether, in Inductor-generated ``code``, a GEMM runs while each all-to-all is in flight."""
    windows = exchange_windows(code)
    return bool(windows) and all("mm(" in w for w in windows)


def check_gdn_overlap(codes: list[str], exchanges: int = 2) -> None:
    """The compiled GDN layer's graphs (forward, backward) run a GEMM while each of their
    ``exchanges`` all-to-alls (two a layer) is in flight: forward, the z projection during
    the first and the own block's part of out_proj during the exchange back; backward, the
    weight and z gradients and the own block's gradients, spread by the scheduling pass."""
    assert len(codes) == 2, len(codes)
    for name, code in zip(("forward", "backward"), codes):
        windows = exchange_windows(code)
        assert len(windows) == exchanges and gemms_overlap_every_exchange(code), (name, [
            [line.strip() for line in w.splitlines() if "mm(" in line] for w in windows
        ])


def gemms_write_the_first_send_buffer(code: str) -> bool:
    """Whether, in Inductor-generated ``code``, the input of the first all-to-all is written by
    GEMMs alone: each of its blocks is an alias of the buffer that a GEMM writes into with
    ``out=``, and no other kernel takes the buffer (no pass over the activations lays it out)."""
    call = re.search(r"all_to_all_single\.default\((\w+),", code)
    if call is None:
        return False
    send = call.group(1)
    head = code[: call.start()]
    blocks = re.findall(rf"(\w+) = reinterpret_tensor\({send}\b", head)
    gemm_outs = set(re.findall(r"mm\([^\n]*out=(\w+)\)", head))
    writers = [line for line in head.splitlines() if re.search(rf"\b{send}\b", line) and "mm(" not in line]
    allowed = rf"^\s*({send} = empty_strided|\w+ = reinterpret_tensor\({send}\b|#)"  # allocation, aliases, comments
    others = [w for w in writers if not re.search(allowed, w)]
    return bool(blocks) and all(b in gemm_outs for b in blocks) and not others
