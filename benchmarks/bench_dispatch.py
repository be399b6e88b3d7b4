"""What registering an op from Python costs per call, against registering it in C++.

    python -m benchmarks.bench_dispatch [--out DIR]
    python -m benchmarks.bench_dispatch --smoke     # the CPU, fewer calls

Every row calls an op whose whole body is ``empty_like(x)`` on a 1024-element tensor, so the
figures are the registration's cost and nothing else:

  torch.empty_like                the floor: an ATen op
  C++ op (TORCH_LIBRARY)          an op defined and implemented in C++ (``TORCH_LIBRARY``,
                                  ``TORCH_LIBRARY_IMPL`` for CPU and CUDA, body
                                  ``at::empty_like``), built here with g++ against torch's
                                  headers and loaded with ``torch.ops.load_library``
  torch.library.custom_op         an op registered from Python, called as ``torch.ops.ns.op``
  custom_op, body as its kernel   the same registered as this package registers its ops
                                  (``custom_ops.registration.kernel_op``, opaque: the body
                                  is also the op's CPU and CUDA kernel)

Host microseconds per call: N calls timed with ``time.perf_counter`` (on a GPU behind a
``torch.cuda._sleep``, so that no call waits for the device), the least and the median of 7
batches. ``over empty_like`` is the least figure less the floor's. The ops registered in
Python are the floor under this package's layout ops (docs/benchmarks.md, section "Host time
per eager op call"); the C++ row is what the same ops would start from if they were registered in
C++, which needs a compiled extension in the package.

Needs ``g++`` (the C++ row) on the path. Result: ``dispatch`` (``dispatch-smoke`` with --smoke).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import tempfile
import time

import torch
from torch.utils import cpp_extension

from benchmarks.runner import Result, add_out_argument, emit, environment

CPP_SOURCE = r"""
#include <ATen/ATen.h>
#include <torch/library.h>

at::Tensor empty_like_op(const at::Tensor& x) { return at::empty_like(x); }

TORCH_LIBRARY(cp_ops_bench_cpp, m) { m.def("empty_like(Tensor x) -> Tensor"); }
TORCH_LIBRARY_IMPL(cp_ops_bench_cpp, CPU, m) { m.impl("empty_like", empty_like_op); }
TORCH_LIBRARY_IMPL(cp_ops_bench_cpp, CUDA, m) { m.impl("empty_like", empty_like_op); }
"""


def build_cpp_op(directory: str):
    """Compile and load :data:`CPP_SOURCE`; its op, ``torch.ops.cp_ops_bench_cpp.empty_like``."""
    compiler = shutil.which("g++")
    if compiler is None:
        raise SystemExit("bench_dispatch needs g++ on the path to build its C++ op")
    source, library = os.path.join(directory, "op.cpp"), os.path.join(directory, "op.so")
    with open(source, "w") as f:
        f.write(CPP_SOURCE)
    includes = [flag for path in cpp_extension.include_paths() for flag in ("-I", path)]
    libraries = [flag for path in cpp_extension.library_paths() for flag in ("-L", path, f"-Wl,-rpath,{path}")]
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    cmd = [compiler, "-O2", "-shared", "-fPIC", "-std=c++17", abi, *includes, source, "-o", library, *libraries,
           "-lc10", "-ltorch_cpu", "-ltorch"]  # fmt: skip
    build = subprocess.run(cmd, capture_output=True, text=True)
    if build.returncode != 0:
        raise SystemExit(f"building the C++ op failed:\n{build.stderr[-3000:]}")
    torch.ops.load_library(library)
    return torch.ops.cp_ops_bench_cpp.empty_like.default


def python_ops():
    """``(custom_op, custom_op with its body as its kernel)``, both with ``empty_like`` as the body."""
    from custom_ops.runtime.registration import kernel_op

    @torch.library.custom_op("cp_ops_bench::empty_like", mutates_args=())
    def _plain(x: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(x)

    # the package's registration takes its own namespace only; this op exists in this process alone
    @kernel_op("cp_ops::bench_dispatch_empty_like", mutates_args=(), opaque=True)
    def _kernel(x: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(x)

    return torch.ops.cp_ops_bench.empty_like.default, torch.ops.cp_ops.bench_dispatch_empty_like.default


def host_us(fn, x: torch.Tensor, calls: int, batches: int = 7) -> tuple[float, float]:
    """``(least, median)`` host microseconds per call of ``fn(x)`` over ``batches`` batches."""
    cuda = x.is_cuda
    fn(x)
    times = []
    for _ in range(batches):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda._sleep(50_000_000)  # tens of ms: longer than a batch's host time
        start = time.perf_counter()
        for _ in range(calls):
            fn(x)
        times.append((time.perf_counter() - start) / calls * 1e6)
    if cuda:
        torch.cuda.synchronize()
    return min(times), statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=None, help="calls per batch (default 2000; 200 with --smoke)")
    parser.add_argument("--smoke", action="store_true", help="the CPU, fewer calls")
    add_out_argument(parser)
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.smoke
    calls = args.calls or (200 if args.smoke else 2000)
    x = torch.randn(1024, device="cuda" if cuda else "cpu")
    with tempfile.TemporaryDirectory() as tmp:
        cpp = build_cpp_op(tmp)
        plain, kernel = python_ops()
        ops = {"torch.empty_like": torch.empty_like, "C++ op (TORCH_LIBRARY)": cpp, "torch.library.custom_op": plain,
               "custom_op, body as its kernel": kernel}  # fmt: skip
        for op in ops.values():
            assert op(x).shape == x.shape
        figures = {name: host_us(op, x, calls) for name, op in ops.items()}
    floor = figures["torch.empty_like"][0]
    rows = [[name, least, median, least - floor] for name, (least, median) in figures.items()]
    notes = (f"`python -m benchmarks.bench_dispatch{' --smoke' if args.smoke else ''}`; {calls} calls per batch, "
             f"{'CUDA tensors, behind a GPU sleep' if cuda else 'CPU tensors'}; each op's body is empty_like of "
             f"1024 floats")  # fmt: skip
    result = Result("dispatch", "Host time per call by how an op is registered", ["registration", "host us (least)",
                    "host us (median)", "over empty_like"], rows, notes, environment(),
                    name="dispatch" + "-smoke" * args.smoke, formats=[None, "{:.2f}", "{:.2f}", "{:.2f}"])  # fmt: skip
    emit([result], args.out)


if __name__ == "__main__":
    main()
