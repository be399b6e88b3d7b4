"""The cases benchmarks/compare_checkouts.py times, run in a child process against one checkout's library.

    PYTHONPATH=CHECKOUT python benchmarks/checkout_cases.py --checkout CHECKOUT --suites attention layout gdn host

Run as a script, so that cp_ops and custom_ops come from CHECKOUT; the cases use the public
API both checkouts share, with this tree's case builders and timing (loaded by file path).
Prints ``RESULT {"suite", "case", "metric", "ms"}`` per timing and ``FAILED {"suite"}`` per
suite that raised. The suites: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import statistics
import traceback
from pathlib import Path

SUITES = ("attention", "layout", "gdn", "host")
DEFAULT_SUITES = SUITES[:3]  # host times vary from process to process: asked for by name, with more rounds
HERE = Path(__file__).resolve().parent


def _sibling(name: str):
    """This tree's ``benchmarks/<name>.py``, loaded by path (the ``benchmarks`` package on
    ``sys.path`` may be the checkout's)."""
    spec = importlib.util.spec_from_file_location(f"_compare_{name}", HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_imports(checkout: str) -> dict[str, str]:
    """The files the library packages were imported from, refusing any that lies outside ``checkout``."""
    import cp_ops
    import custom_ops

    root = Path(checkout).resolve()
    files = {"cp_ops": cp_ops.__file__, "custom_ops": custom_ops.__file__}
    outside = {k: f for k, f in files.items() if not Path(f).resolve().is_relative_to(root)}
    if outside:
        raise SystemExit(f"imported {outside}, not from the checkout {root}")
    return files


def moved_module(*names: str):
    """The first of ``names``, one module's paths from the newest to the oldest, that the checkout
    has: the two checkouts compared may place it differently."""
    for name in names:
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError:
            continue
    raise ModuleNotFoundError(f"the checkout has none of {names}")


def report(suite: str, case: dict, metric: str, ms: float | None) -> None:
    print("RESULT " + json.dumps({"suite": suite, "case": case, "metric": metric, "ms": ms}), flush=True)


def attention(timing, cases) -> None:
    import torch

    launch = moved_module("custom_ops.segment_attention.launch", "custom_ops.varlen_attention.launch")
    Segments = moved_module("custom_ops.thd.validation", "custom_ops.runtime.validation").Segments

    for d in cases.ATTENTION_HEAD_DIMS:
        for name, lens in cases.attention_cases():
            q, k, v, seg, out, lse, dout, dlse = cases.attention_op_inputs(lens, d, 1, torch.device("cuda"))

            def fwd():
                return torch.ops.cp_ops.varlen_attention(q, k, v, *seg, True)

            def bwd():  # the launcher, whose signature both checkouts share, not the ops it is split into
                return launch.backward(dout, dlse, q, k, v, out, lse, Segments(*seg), True, -1, -1, d**-0.5)

            fwd(), bwd()  # compile outside the timing
            case = {"case": name, "D": d}
            report("attention", case, "fwd", statistics.median(timing.median_ms(fwd, 10, 200) for _ in range(3)))
            report("attention", case, "bwd", statistics.median(timing.median_ms(bwd, 10, 200) for _ in range(3)))
            kernels = timing.kernel_breakdown(bwd, runs=20)
            for kind in ("delta", "dq", "dkdv"):
                found = [ms for kernel, ms in kernels if f"bwd_{kind}_kernel" in kernel]
                report("attention", case, kind, sum(found) if found else None)


def layout(timing, cases) -> None:
    import torch

    import cp_ops

    for shape, seqlens, trailing in cases.layout_shapes()[:2]:  # the two row widths
        for w in (2, 4, 8):
            cu, cup = cp_ops.pad_cu_seqlens(seqlens, w, device="cuda")
            x = torch.randn((int(cup[-1]),) + trailing, device="cuda", dtype=torch.bfloat16)
            src, dst = torch.randn_like(x), x.clone()
            ops = {
                "seq_to_rank": lambda: torch.ops.cp_ops.thd_seq_to_rank_order(x, cup, w),
                "rank_to_seq": lambda: torch.ops.cp_ops.thd_rank_to_seq_order(x, cup, w),
                "copy_valid": lambda: torch.ops.cp_ops.thd_copy_valid_tokens(x, src, cup, cu),
                "copy_valid_": lambda: torch.ops.cp_ops.thd_copy_valid_tokens_(dst, src, cup, cu),
            }
            for op, fn in ops.items():
                fn()  # compile outside the timing
                report("layout", {"shape": shape, "W": w}, op, timing.median_ms(fn))


GDN_SHAPE = {"hidden": 2048, "Hk": 16, "Hv": 32, "dk": 128, "dv": 128, "T": 16384, "B": 8}


def gdn(timing, cases) -> None:
    import torch

    import cp_ops

    s = GDN_SHAPE
    torch.manual_seed(0)
    layer = cp_ops.GatedDeltaNet(s["hidden"], s["Hk"], s["Hv"], s["dk"], s["dv"]).to("cuda", torch.bfloat16)
    lens = cases.random_lengths(s["T"], s["B"], torch.Generator().manual_seed(s["T"] + s["B"]))
    _, cup = cp_ops.pad_cu_seqlens(lens, 1, device="cuda")
    x = torch.randn(int(cup[-1]), s["hidden"], device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)
    params = [x, *layer.parameters()]
    compiled = torch.compile(layer, fullgraph=True)

    def step():
        for p in params:
            p.grad = None
        compiled(x, cup).backward(grad)

    step()  # compile and autotune outside the timing
    case = {"shape": f"T={s['T']} B={s['B']}"}
    report("gdn", case, "fwd+bwd", timing.median_ms(step))
    report("gdn", case, "kernels", timing.kernel_ms(step))


def host(timing, cases) -> None:
    """Host time per eager call of bench_host.py's cases, in the registration form this process's
    environment selects (``CP_OPS_OPAQUE_KERNELS``), reported in ms."""
    import torch

    bench_host = _sibling("bench_host")
    for case in bench_host.build_cases("cuda", smoke=False):
        with torch.no_grad():
            fwd = bench_host.host_us(lambda: case.fwd, case.calls, True)
        report("host", {"op": case.name}, "fwd host", fwd["us"] / 1e3)
        if case.make_bwd is not None:
            bwd = bench_host.host_us(case.make_bwd, case.calls, True, reps=5)
            report("host", {"op": case.name}, "bwd host", bwd["us"] / 1e3)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkout", required=True, help="the checkout whose library this process must import")
    parser.add_argument("--suites", nargs="+", choices=SUITES, default=list(DEFAULT_SUITES))
    parser.add_argument("--imports-only", action="store_true", help="check where the library comes from, and exit")
    args = parser.parse_args(argv)
    files = check_imports(args.checkout)
    print("IMPORTS " + json.dumps(files), flush=True)
    if args.imports_only:
        return
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("the checkout comparison needs a CUDA device")
    timing, cases = _sibling("timing"), _sibling("cases")
    failed = []
    for suite in args.suites:
        try:
            {"attention": attention, "layout": layout, "gdn": gdn, "host": host}[suite](timing, cases)
        except Exception:  # one suite's failure (a missing dependency, an API a checkout lacks) spares the others
            traceback.print_exc()
            print("FAILED " + json.dumps({"suite": suite}), flush=True)
            failed.append(suite)
    if failed and len(failed) == len(args.suites):
        raise SystemExit(f"every suite failed: {failed}")


if __name__ == "__main__":
    main()
