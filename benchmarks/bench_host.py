"""Host time per eager call of every cp_ops op, in both registration forms (a subprocess each).

    python -m benchmarks.bench_host [--ops NAME ...] [--forms 0 1] [--layout-sweep] [--raw FILE.json] [--out DIR]
    python -m benchmarks.bench_host --smoke     # tiny shapes on the CPU (the torch references)

Results (benchmarks/runner.py): ``host`` (``host-smoke``), with --layout-sweep also
``host-layout-sweep``. Two checkouts are compared with ``python -m benchmarks.compare_checkouts
BASE NEW --suites host``. docs/benchmarks.md says what each column measures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FORMS = {"0": "triton_op", "1": "opaque"}


# --- what is timed ----------------------------------------------------------------------------


class Case:
    """One op: ``fwd()`` is one eager call; ``make_bwd()`` returns a function that runs one
    backward through autograd from a fresh forward's output (the forward issued beforehand,
    not timed), or None where the op is not differentiable. ``main`` is the input a clone of
    which moves the same bytes (None: no clone row). ``calls`` is N per timed batch."""

    def __init__(self, name, group, fwd, make_bwd=None, main=None, calls=50, reference=None):
        self.name, self.group, self.fwd, self.make_bwd, self.main, self.calls = name, group, fwd, make_bwd, main, calls
        self.reference = reference  # what fwd() must return, bit for bit (the layout ops)


def _grad_case(fn, inputs, grads_like):
    """``make_bwd`` for ``fn(*inputs)``: each call of the returned factory runs one forward with
    ``inputs`` requiring grad and returns a closure that runs its backward
    (``torch.autograd.grad``, so no gradient accumulates between calls)."""
    import torch

    leaves = [t.detach().requires_grad_(True) if req else t for t, req in inputs]
    wanted = [t for t, (_, req) in zip(leaves, inputs) if req]

    def make():
        out = fn(*leaves)
        outs = [o for o in (out if isinstance(out, tuple) else (out,)) if o.requires_grad]
        grads = grads_like(outs)
        return lambda: torch.autograd.grad(outs, wanted, grads)

    return make


def build_cases(device, smoke: bool, only=None):
    import torch

    import custom_ops

    bf16 = torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(*shape, dtype=bf16):
        return torch.randn(shape, generator=gen, device=device).to(dtype)

    def wanted(group, *names):
        """Whether ``--ops`` asks for the group or one of its ops (everything without ``--ops``)."""
        return not only or group in only or any(name in only for name in names)

    def same_grads(outs):
        return [torch.ones_like(o) for o in outs]

    def cu(lengths):
        return torch.tensor([0] + list(_cumsum(lengths)), dtype=torch.int32, device=device)

    w = 4
    seqs, seq_len = (4, 16) if smoke else (16, 4096)
    rows = seqs * seq_len
    real = [seq_len - 3 * (i % 3) for i in range(seqs)]  # a few padding rows per sequence
    cup, cur = cu([seq_len] * seqs), cu(real)
    trailing = (2, 4) if smoke else (16, 64)
    x = rand(rows, *trailing)
    src = rand(rows, *trailing)
    dst = x.clone()
    feats = 8 * w if smoke else 1024
    sections = [feats // 4, feats // 4, feats // 2]
    xf = rand(rows, feats)
    blocks = rand(w, rows, feats // w)
    cases = [
        Case("clone (floor)", "floor", lambda: x.clone(), _grad_case(lambda a: a.clone(), [(x, True)], same_grads), x),
        Case("thd_seq_to_rank_order", "layout", lambda: custom_ops.thd_seq_to_rank_order(x, cup, w),
             _grad_case(lambda a: custom_ops.thd_seq_to_rank_order(a, cup, w), [(x, True)], same_grads), x),
        Case("thd_rank_to_seq_order", "layout", lambda: custom_ops.thd_rank_to_seq_order(x, cup, w),
             _grad_case(lambda a: custom_ops.thd_rank_to_seq_order(a, cup, w), [(x, True)], same_grads), x),
        Case("thd_copy_valid_tokens", "layout", lambda: custom_ops.thd_copy_valid_tokens(dst, src, cup, cur),
             _grad_case(lambda a, b: custom_ops.thd_copy_valid_tokens(a, b, cup, cur), [(dst, True), (src, True)],
                        same_grads), x),
        Case("thd_copy_valid_tokens_", "layout", lambda: custom_ops.thd_copy_valid_tokens_(dst, src, cup, cur), None, x),
        Case("permute_sections", "layout", lambda: custom_ops.permute_sections(xf, sections, w),
             _grad_case(lambda a: custom_ops.permute_sections(a, sections, w), [(xf, True)], same_grads), xf),
        Case("unpermute_sections", "layout", lambda: custom_ops.unpermute_sections(xf, sections, w),
             _grad_case(lambda a: custom_ops.unpermute_sections(a, sections, w), [(xf, True)], same_grads), xf),
        Case("sections_to_rank_blocks", "layout", lambda: custom_ops.sections_to_rank_blocks(xf, sections, w),
             _grad_case(lambda a: custom_ops.sections_to_rank_blocks(a, sections, w), [(xf, True)], same_grads), xf),
        Case("rank_blocks_to_sections", "layout", lambda: custom_ops.rank_blocks_to_sections(blocks, sections, w),
             _grad_case(lambda a: custom_ops.rank_blocks_to_sections(a, sections, w), [(blocks, True)], same_grads),
             blocks),
    ]  # fmt: skip

    references = {
        "thd_seq_to_rank_order": lambda: custom_ops.thd_seq_to_rank_order_reference(x, cup, w),
        "thd_rank_to_seq_order": lambda: custom_ops.thd_rank_to_seq_order_reference(x, cup, w),
        "thd_copy_valid_tokens": lambda: custom_ops.thd_copy_valid_tokens_reference(dst, src, cup, cur),
        "permute_sections": lambda: custom_ops.permute_sections_reference(xf, sections, w),
        "unpermute_sections": lambda: custom_ops.unpermute_sections_reference(xf, sections, w),
        "sections_to_rank_blocks": lambda: custom_ops.permute_sections_reference(xf, sections, w)
        .unflatten(-1, (w, -1)).movedim(-2, 0),
        "rank_blocks_to_sections": lambda: custom_ops.unpermute_sections_reference(
            blocks.movedim(0, -2).flatten(-2), sections, w),
    }  # fmt: skip
    for c in cases:
        c.reference = references.get(c.name)
    if not (wanted("attention", "varlen_attention") or wanted("conv", "causal_conv1d", "causal_conv1d_gather")
            or wanted("gdn", "chunk_gated_delta_rule")):  # fmt: skip
        return _select(cases, only)
    # attention: 4 causal segments, 16 heads, D = 128
    a_seqs, a_len, heads, dim = (2, 16, 2, 16) if smoke else (4, 4096, 16, 128)
    a_rows = a_seqs * a_len
    q, k, v = (rand(a_rows, heads, dim) for _ in range(3))
    starts = torch.arange(a_seqs, dtype=torch.int32, device=device) * a_len
    lens = torch.full((a_seqs,), a_len, dtype=torch.int32, device=device)
    seg = (starts, lens, torch.zeros_like(starts), starts, lens)

    def attn(q_, k_, v_):
        return custom_ops.varlen_attention(q_, k_, v_, *seg, causal=True)

    cases.append(Case("varlen_attention", "attention", lambda: attn(q, k, v),
                      _grad_case(attn, [(q, True), (k, True), (v, True)],
                                 lambda outs: [torch.ones_like(outs[0])] + [torch.zeros_like(o) for o in outs[1:]]),
                      None, calls=30))  # fmt: skip

    if not (wanted("conv", "causal_conv1d", "causal_conv1d_gather") or wanted("gdn", "chunk_gated_delta_rule")):
        return _select(cases, only)
    # the GDN layer's conv: C = 2048 channels of K = 4 taps over the layout above
    channels = 16 if smoke else 2048
    xc = rand(rows, channels)
    weight = rand(channels, 4)
    xg = rand(rows, channels + channels // 4)
    perm = custom_ops.thd_seq_to_rank_order(torch.arange(rows, device=device), cup, w)

    def conv(a, wt):
        return custom_ops.causal_conv1d(a, wt, None, cup, "silu")

    def conv_gather(a, wt):
        return custom_ops.causal_conv1d_gather(a, perm, wt, None, cup, "silu")

    cases.append(Case("causal_conv1d", "conv", lambda: conv(xc, weight),
                      _grad_case(conv, [(xc, True), (weight, True)], same_grads), None, calls=30))
    cases.append(Case("causal_conv1d_gather", "conv", lambda: conv_gather(xg, weight),
                      _grad_case(conv_gather, [(xg, True), (weight, True)], same_grads), None, calls=30))  # fmt: skip

    # gated delta rule: Hk = 4, Hv = 8, d = 128 over 4 sequences of 4096 (FLA's kernels on CUDA)
    if device == "cpu" or _has_fla():
        g_seqs, g_len, hk, hv, dk = (2, 8, 1, 2, 8) if smoke else (4, 4096, 4, 8, 128)
        g_rows = g_seqs * g_len
        gq, gk = rand(g_rows, hk, dk), rand(g_rows, hk, dk)
        gq, gk = (torch.nn.functional.normalize(t.float(), dim=-1).to(bf16) for t in (gq, gk))
        gv = rand(g_rows, hv, dk)
        gg = torch.nn.functional.logsigmoid(rand(g_rows, hv, dtype=torch.float32))
        gb = torch.sigmoid(rand(g_rows, hv, dtype=torch.float32)).to(bf16)
        gcu = cu([g_len] * g_seqs)

        def gdn(q_, k_, v_, g_, b_):
            return custom_ops.chunk_gated_delta_rule(q_, k_, v_, g_, b_, gcu)

        cases.append(Case("chunk_gated_delta_rule", "gdn", lambda: gdn(gq, gk, gv, gg, gb),
                          _grad_case(gdn, [(gq, True), (gk, True), (gv, True), (gg, True), (gb, True)], same_grads),
                          None, calls=10))  # fmt: skip
    return _select(cases, only)


def _select(cases, only):
    return [c for c in cases if not only or c.name in only or c.group in only or c.group == "floor"]


def _cumsum(values):
    total = 0
    for v in values:
        total += v
        yield total


def _has_fla() -> bool:
    try:
        import fla  # noqa: F401
    except ImportError:
        return False
    return True


# --- timing -----------------------------------------------------------------------------------


def host_us(fn, calls: int, cuda: bool, reps: int = 7) -> dict:
    """Host microseconds per call of ``fn``: ``{"us": median over reps, "min": best rep,
    "gpu_waited": whether the sleep ran out in any rep}``. On the CPU, plain wall time."""
    import torch

    fn()  # compiles, allocates
    if not cuda:
        times = []
        for _ in range(calls):
            fn()
        for _ in range(reps):
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            times.append((time.perf_counter() - start) / calls * 1e6)
        return {"us": statistics.median(times), "min": min(times), "gpu_waited": False}
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    estimate = (time.perf_counter() - start) / 3  # seconds per call, GPU time included: an upper bound
    cycles = _sleep_cycles(calls, estimate)
    times, waited = [], False
    for rep in range(reps + 1):  # the first round warms the allocator for N live results
        for _attempt in range(3):
            torch.cuda.synchronize()
            torch.cuda._sleep(cycles)
            slept = torch.cuda.Event()
            slept.record()
            start = time.perf_counter()
            keep = [fn() for _ in range(calls)]
            elapsed = time.perf_counter() - start
            pending = not slept.query()
            del keep
            if pending:
                break
            cycles *= 4
        waited |= not pending
        if rep:
            times.append(elapsed / calls * 1e6)
    torch.cuda.synchronize()
    return {"us": statistics.median(times), "min": min(times), "gpu_waited": waited}


def _sleep_cycles(calls: int, seconds_per_call: float) -> int:
    """GPU clock cycles (at most 2 GHz) that outlast issuing ``calls`` calls twice over, capped at
    2 s: a row whose sleep still runs out says so."""
    return int(min(2 * calls * seconds_per_call, 2.0) * 2e9) + 2_000_000


def host_us_backward(make_bwd, calls: int, cuda: bool, reps: int = 5) -> dict:
    """:func:`host_us` of backward calls alone: N forwards are issued first (not timed)."""
    import torch

    results = []
    estimate = 0.0
    if cuda:
        make_bwd()()  # compiles the backward's kernels
        first = make_bwd()
        torch.cuda.synchronize()
        start = time.perf_counter()
        first()
        torch.cuda.synchronize()
        estimate = time.perf_counter() - start  # seconds per call, GPU time included: an upper bound
    for rep in range(reps + 1):
        backwards = [make_bwd() for _ in range(calls)]
        if cuda:
            torch.cuda.synchronize()
        pending = True
        if cuda:
            torch.cuda._sleep(_sleep_cycles(calls, estimate))
            slept = torch.cuda.Event()
            slept.record()
        start = time.perf_counter()
        keep = [b() for b in backwards]
        elapsed = time.perf_counter() - start
        if cuda:
            pending = not slept.query()
            torch.cuda.synchronize()
        del keep, backwards
        if rep:
            results.append((elapsed / calls * 1e6, pending))
    times = [t for t, _ in results]
    return {"us": statistics.median(times), "min": min(times), "gpu_waited": not all(p for _, p in results)}


def device_ms(fn, runs: int = 5) -> float:
    """Device time in ms of everything one ``fn()`` launches (torch.profiler, kernels and memsets)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            fn()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()) / runs / 1e3


def bench_ms(fn) -> float:
    import triton

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def _first_tensor(out):
    return out[0] if isinstance(out, tuple) else out


def consistent(fn) -> bool | None:
    """Whether two calls give the same bits: the first goes through Triton's own launch path
    (a new launch key), the second through the cached launch. None for in-place ops."""
    import torch

    a, b = fn(), fn()
    if a is None:
        return None
    a, b = (a if isinstance(a, tuple) else (a,)), (b if isinstance(b, tuple) else (b,))
    return all(torch.equal(x, y) for x, y in zip(a, b))


def run_child(args) -> dict:
    import torch

    cuda = not args.smoke
    if cuda and not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device (or --smoke)")
    device = "cuda" if cuda else "cpu"
    torch.manual_seed(0)
    import custom_ops

    result = {"form": "triton_op" if custom_ops.kernels_visible_to_compiler() else "opaque", "rows": []}
    for case in build_cases(device, args.smoke, args.ops):
        calls = min(case.calls, 5) if args.smoke else case.calls
        row = {"op": case.name, "group": case.group}
        with torch.no_grad():
            row["same bits twice"] = consistent(case.fwd) if cuda else None
            if case.reference is not None:
                row["matches reference"] = bool(torch.equal(case.fwd(), case.reference()))
            fwd = host_us(case.fwd, calls, cuda)
        row["fwd host us"], row["fwd host us min"], row["fwd gpu waited"] = fwd["us"], fwd["min"], fwd["gpu_waited"]
        if case.make_bwd is not None:
            bwd = host_us_backward(case.make_bwd, calls, cuda)
            row["bwd host us"], row["bwd host us min"], row["bwd gpu waited"] = bwd["us"], bwd["min"], bwd["gpu_waited"]
        if cuda and not args.host_only:
            with torch.no_grad():
                row["call ms"] = bench_ms(case.fwd)
                row["kernels ms"] = device_ms(case.fwd)
                if case.main is not None:
                    main = case.main
                    row["clone ms"] = bench_ms(lambda: main.clone())
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
    if args.layout_sweep and cuda and not args.host_only:
        result["layout_sweep"] = layout_sweep()
    return result


def layout_sweep() -> list[dict]:
    """The four THD layout ops against a clone, do_bench, at bench_thd_layout.py's row widths."""
    import torch

    import custom_ops

    out = []
    for trailing, seqs, seq_len in (((16, 64), 16, 4096), ((32, 128), 8, 8192)):
        for w in (2, 4, 8):
            cup = torch.arange(seqs + 1, dtype=torch.int32, device="cuda") * seq_len
            cur = cup  # all rows valid
            x = torch.randn((seqs * seq_len,) + trailing, device="cuda", dtype=torch.bfloat16)
            src, dst = torch.randn_like(x), x.clone()
            clone = bench_ms(lambda: x.clone())
            row = {"shape": f"{seqs}x{seq_len} tok, {trailing[0]}x{trailing[1]}", "W": w, "clone ms": clone}
            for name, fn in (
                ("seq_to_rank", lambda: custom_ops.thd_seq_to_rank_order(x, cup, w)),
                ("rank_to_seq", lambda: custom_ops.thd_rank_to_seq_order(x, cup, w)),
                ("copy_valid", lambda: custom_ops.thd_copy_valid_tokens(x, src, cup, cur)),
                ("copy_valid_", lambda: custom_ops.thd_copy_valid_tokens_(dst, src, cup, cur)),
            ):
                row[f"{name} / clone"] = bench_ms(fn) / clone
            out.append(row)
            print(json.dumps(row), flush=True)
    return out


# --- the parent: one subprocess per form (and package) ------------------------------------------


def spawn(form: str, args, tmp: str) -> dict:
    out = os.path.join(tmp, f"{form}.json")
    env = dict(os.environ, CP_OPS_OPAQUE_KERNELS=form, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    env.pop("TRITON_INTERPRET", None)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--child-out", out]
    cmd += ["--smoke"] * args.smoke + ["--layout-sweep"] * args.layout_sweep + ["--host-only"] * args.host_only
    if args.ops:
        cmd += ["--ops", *args.ops]
    print(f"===== {FORMS[form]} form", flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"the {FORMS[form]} run failed (rc {proc.returncode})")
    with open(out) as f:
        return json.load(f)


def table(runs: dict, smoke: bool) -> tuple[list[str], list[list]]:
    """``(columns, rows)``: one row per op and form (``runs``: ``{form: a child's result}``)."""
    header = ["op", "form", "fwd host us (this tree)", "bwd host us (this tree)"]
    header += [] if smoke else ["call ms", "kernels ms", "clone ms", "call / clone"]
    rows = []
    for form in ("triton_op", "opaque"):
        for row in runs.get(form, {}).get("rows", []):
            cells = [row["op"], form, _fmt_us(row, "fwd"), _fmt_us(row, "bwd")]
            if not smoke:
                call, kernels, clone = row.get("call ms"), row.get("kernels ms"), row.get("clone ms")
                cells += [_fmt_ms(call), _fmt_ms(kernels), _fmt_ms(clone), f"{call / clone:.2f}x" if call and clone else ""]
            rows.append(cells)
    return header, rows


def _fmt_ms(ms) -> str:
    return "" if ms is None else f"{ms:.3f}"


def _fmt_us(row: dict, which: str) -> str:
    us = row.get(f"{which} host us")
    if us is None:
        return ""
    return f"{us:.1f}" + (" (GPU waited)" if row.get(f"{which} gpu waited") else "")


def sweep_table(runs: dict) -> tuple[list[str], list[list]]:
    header = ["form", "shape", "W", "clone ms", "seq_to_rank", "rank_to_seq", "copy_valid", "copy_valid_"]
    rows = []
    for form in ("triton_op", "opaque"):
        for r in runs.get(form, {}).get("layout_sweep", []):
            cells = [form, r["shape"], str(r["W"]), f"{r['clone ms']:.3f}"]
            cells += [f"{r[f'{n} / clone']:.2f}x" for n in ("seq_to_rank", "rank_to_seq", "copy_valid", "copy_valid_")]
            rows.append(cells)
    return header, rows


def main() -> None:
    # the parent's only: the checkout comparison loads this file in a child with another checkout's packages
    from benchmarks.runner import Result, add_out_argument, emit, env_line, environment

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_out_argument(parser)
    parser.add_argument("--raw", help="also write every subprocess's figures to this JSON file")
    parser.add_argument("--ops", nargs="+", help="only these ops (names or groups: layout, attention, conv, gdn)")
    parser.add_argument("--layout-sweep", action="store_true", help="the THD layout ops against a clone, W = 2, 4, 8")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    parser.add_argument("--host-only", action="store_true", help="host times only")
    parser.add_argument("--forms", nargs="+", choices=list(FORMS), default=list(FORMS),
                        help="CP_OPS_OPAQUE_KERNELS values to run (default: 0 1)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        result = run_child(args)
        with open(args.child_out, "w") as f:
            json.dump(result, f)
        return
    env = environment()
    print(env_line(env), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        runs = {FORMS[form]: spawn(form, args, tmp) for form in args.forms}
    command = "python -m benchmarks.bench_host " + " ".join(sys.argv[1:])
    name = "host" + "-smoke" * args.smoke
    results = [Result("host", "Host time per op call, both registration forms", *table(runs, args.smoke),
                      notes=f"`{command}`", env=env, name=name)]  # fmt: skip
    if args.layout_sweep and not args.smoke:
        results.append(Result("host", "The four THD layout ops against a clone, both forms", *sweep_table(runs),
                              notes=f"`{command}`", env=env, name=f"{name}-layout-sweep"))  # fmt: skip
    if args.raw:
        with open(args.raw, "w") as f:
            json.dump({"environment": env, "command": command, "runs": {"this tree": runs}}, f, indent=1)
    emit(results, args.out)


if __name__ == "__main__":
    main()
