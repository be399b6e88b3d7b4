"""The demo's results: the ranks' results combined, the run's summary and the table it prints."""

from __future__ import annotations

import argparse
import math
import statistics

import torch
import torch.distributed as dist

import custom_ops
from cp_ops.demo.train import REGIONS, check_skipped, reference_is_eager

__all__ = ["reduce_results", "summarise", "format_table"]


def reduce_results(res: dict, group, device: torch.device) -> dict:
    """Max over ranks of the error, the counts, step times and peak memory."""
    names = ["max_rel_error", "graph_breaks", "compiles", "unique_graphs", "peak_memory_mib"]
    vals = torch.tensor([float(res[n]) for n in names] + res["step_times"], dtype=torch.float64, device=device)
    vals = torch.nan_to_num(vals, nan=-1.0)
    dist.all_reduce(vals, op=dist.ReduceOp.MAX, group=group)
    vals = vals.cpu().tolist()
    out = dict(res)
    for n, v in zip(names, vals):
        out[n] = v if n in ("max_rel_error", "peak_memory_mib") else int(v)
    if math.isnan(res["max_rel_error"]):
        out["max_rel_error"] = float("nan")
    out["step_times"] = vals[len(names) :]
    return out


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def summarise(args: argparse.Namespace, res: dict) -> dict:
    """Rank 0's results with the derived figures (step time, compile time, tokens/s,
    recompiles), the run's settings, and ``failures`` / ``ok``: a compiled run with graph
    breaks, or a checked step 1 past the tolerance, fails."""
    times = res["step_times"]
    step_time = _median(times[1:]) if len(times) > 1 else float("nan")
    out = dict(res)
    out.update(
        ranks=args.cp_size,
        device=args.device,
        dtype=args.dtype,
        compiled=not args.eager,
        kernels_visible=custom_ops.kernels_visible_to_compiler(),
        seqlens=list(args.seqlens),
        step_time_s=step_time,
        compile_time_s=times[0] - step_time if len(times) > 1 else float("nan"),
        tokens_per_s=res["num_real_tokens"] / step_time if step_time > 0 else float("nan"),
        recompiles=max(res["compiles"] - REGIONS, 0),
        tol=args.tol,
        check_dtype=args.check_dtype,
        reference="eager" if reference_is_eager(args) else "compiled",
        check_skipped=check_skipped(args),
    )
    failures = []
    if out["compiled"] and out["graph_breaks"] > 0:
        failures.append(f"{out['graph_breaks']} graph breaks")
    if out["check_skipped"] is None and not out["max_rel_error"] <= args.tol:
        failures.append(f"max rel error {out['max_rel_error']:.3g} > tol {args.tol:g} ({out['worst']})")
    out["failures"] = failures
    out["ok"] = not failures
    return out


def _mode(res: dict) -> str:
    if not res["compiled"]:
        return "eager"
    where = (
        "ops run torch references on the CPU" if res["device"] == "cpu"
        else "our Triton kernels in Inductor's graph" if res["kernels_visible"]
        else "our Triton kernels in opaque ops (triton newer than torch's pin)" if res["kernels_visible"] is False
        else "our Triton kernels"
    )  # fmt: skip
    return f"each block under torch.compile(fullgraph=True); {where}"


def verdict(res: dict) -> str:
    """The run's last line: PASS, or FAIL with what failed (the exit code follows it)."""
    if not res["ok"]:
        return "FAIL: " + "; ".join(res["failures"])
    held = ["no graph break"] if res["compiled"] else []
    if res["check_skipped"] is None:
        held.append(f"step 1 within {res['tol']:g} of one device")
    return "PASS: " + ", ".join(held) if held else f"PASS (nothing checked: {res['check_skipped']})"


def format_table(res: dict) -> str:
    """The results as a two-column table."""
    def fmt(v, spec):
        return "n/a" if isinstance(v, float) and math.isnan(v) else format(v, spec)

    rows = [
        ("ranks", str(res["ranks"])),
        ("backend", res["backend"]),
        ("device", res["device"]),
        ("dtype", res["dtype"]),
        ("mode", _mode(res)),
        ("tokens / step", f"{res['num_real_tokens']} real, {res['num_rows']} rows padded"),
        ("tokens/s", fmt(res["tokens_per_s"], ",.0f") + " (real tokens of the global batch)"),
        ("step time", fmt(res["step_time_s"] * 1e3, ".1f") + " ms (median after step 1)"
         if len(res["step_times"]) > 1 else "n/a (one step)"),
        ("compile time", fmt(res["compile_time_s"], ".1f") + " s (step 1 - median)" if res["compiled"] else "n/a (eager)"),
        ("graph breaks", str(res["graph_breaks"]) if res["compiled"] else "n/a (eager)"),
        ("recompiles", str(res["recompiles"]) if res["compiled"] else "n/a (eager)"),
        ("max rel error", f"{res['max_rel_error']:.2e} vs one device ({res['reference']}), step 1 in "
                          f"{res['check_dtype']} (tol {res['tol']:g}; {res['worst']})"
         if res["check_skipped"] is None else f"n/a ({res['check_skipped']})"),
        ("loss", f"{res['losses'][0]:.4f} -> {res['losses'][-1]:.4f}"),
        ("peak memory", fmt(res["peak_memory_mib"], ",.0f") + " MiB"
         + (" (max_memory_allocated)" if res["device"] == "cuda" else " (peak RSS)")),
    ]  # fmt: skip
    width = max(len(k) for k, _ in rows)
    lines = [f"{k.ljust(width)}  {v}" for k, v in rows]
    rule = "-" * max(len(line) for line in lines)
    return "\n".join([rule, *lines, rule])
