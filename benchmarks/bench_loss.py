"""The causal-LM loss of a linear head, forward and backward, on one GPU: the unfused loss (the
whole logits), this package's chunked loss (custom_ops.linear_cross_entropy), Liger-Kernel's fused
linear cross-entropy and Apple's cut-cross-entropy, at hidden 2048, bf16, vocabularies 32000 and
151936 (Qwen3-Next's), 32768 and 262144 rows (one rank's share of a 1048576-token sequence at W = 4).

    python -m benchmarks.bench_loss [--vocabs 32000,151936] [--rows 32768,262144] [--chunk-rows N,...]
                                    [--runs N] [--out DIR]
    python -m benchmarks.bench_loss --smoke      # CPU, float32, tiny shapes: the unfused loss and ours

The other libraries are not dependencies of the package; a candidate whose package is missing
(``pip install liger-kernel==0.8.5 cut-cross-entropy==25.1.1``) or that needs a GPU is skipped
with the reason printed. Result (benchmarks/runner.py): ``loss`` (``loss-smoke``); a case that runs
out of memory is a row with that status. docs/benchmarks.md says what each column measures.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.runner import Result, add_out_argument, emit, environment, package_versions
from benchmarks.timing import median_ms_counted
from custom_ops import default_chunk_rows, linear_cross_entropy, linear_cross_entropy_reference

HIDDEN = 2048
IGNORE = -100
PACKAGES = {"liger": "liger-kernel", "cce": "cut-cross-entropy"}
COLUMNS = ["vocab", "rows", "loss", "status", "fwd+bwd ms", "TFLOP/s", "peak GiB", "time vs ours", "memory vs ours",
           "rel diff vs unfused"]  # fmt: skip


def _unfused(h, w, labels):
    return linear_cross_entropy_reference(h, w, labels, IGNORE, "sum")


def _ours(chunk_rows):
    return lambda h, w, labels: linear_cross_entropy(h, w, labels, IGNORE, "sum", chunk_rows)


def _liger():
    from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

    loss = LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE, reduction="sum")
    return lambda h, w, labels: loss(w, h, labels)


def _cce(filter_eps):
    from cut_cross_entropy import linear_cross_entropy as cce

    return lambda h, w, labels: cce(h, w, labels, ignore_index=IGNORE, reduction="sum", filter_eps=filter_eps)


def candidates(device: torch.device, vocab: int, chunk_rows: list[int]) -> dict[str, object]:
    """``{name: loss(h, w, labels) or the reason it is skipped}``: the unfused loss, ours at each
    chunk size (the default when none), Liger's and cut-cross-entropy's (its default, which skips
    gradient entries below a threshold, ``filter_eps="high"``, and its exact form, ``filter_eps=None``)."""
    out = {"unfused": _unfused}
    for rows in chunk_rows or [default_chunk_rows(vocab)]:
        out[f"ours, chunks of {rows}"] = _ours(rows)
    for name, make in (("liger", _liger), ("cce", lambda: _cce("high")), ("cce exact", lambda: _cce(None))):
        package = PACKAGES[name.split()[0]]
        if device.type != "cuda":
            out[name] = "needs a GPU (Triton kernels)"
            continue
        try:
            out[name] = make()
        except ImportError as err:
            out[name] = f"{package} not installed ({err})"
    return out


def measure(fn, h, w, labels, device: torch.device, runs: int) -> dict:
    """Median ms of a forward and backward, the peak memory beyond the inputs (GiB, CUDA only),
    the loss's value; or the status "out of memory" or "failed: ..." (an exception of the loss)."""
    cuda = device.type == "cuda"

    def step():
        h.grad, w.grad = None, None
        fn(h, w, labels).backward()

    try:
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        with torch.no_grad():
            loss = float(fn(h, w, labels))
        step()
        peak = (torch.cuda.max_memory_allocated(device) - base) / 2**30 if cuda else None
        ms = median_ms_counted(step, warmup=1, runs=runs, device=device)
    except torch.OutOfMemoryError:
        h.grad, w.grad = None, None
        return {"status": "out of memory"}
    except Exception as err:  # a library's failure is its row's status, not the end of the table
        h.grad, w.grad = None, None
        return {"status": f"failed: {type(err).__name__}: {err}"[:120]}
    return {"status": "ok", "fwd+bwd ms": ms, "peak GiB": peak, "value": loss}


def run_case(vocab: int, rows: int, hidden: int, dtype, device, chunk_rows: list[int], runs: int) -> list[dict]:
    gen = torch.Generator(device=device).manual_seed(0)
    h = torch.randn(rows, hidden, device=device, dtype=dtype, generator=gen).requires_grad_()
    w = (torch.randn(vocab, hidden, device=device, dtype=dtype, generator=gen) * 0.02).requires_grad_()
    labels = torch.randint(0, vocab, (rows,), device=device, generator=gen)
    labels[::8] = IGNORE  # the last token of sequences and padding carry no target
    flops = 6 * rows * vocab * hidden  # the head's three GEMMs
    out = []
    for name, fn in candidates(device, vocab, chunk_rows).items():
        row = {"vocab": vocab, "rows": rows, "loss": name}
        if isinstance(fn, str):
            print(f"[bench_loss] {name}: skipped, {fn}", flush=True)
            row["status"] = f"skipped: {fn}"
        else:
            row.update(measure(fn, h, w, labels, device, runs))
            if row.get("fwd+bwd ms"):
                row["TFLOP/s"] = flops / row["fwd+bwd ms"] / 1e9
            print(f"[bench_loss] V={vocab} rows={rows} {name}: {row['status']} {row.get('fwd+bwd ms')} ms", flush=True)
        out.append(row)
    ours = next((r for r in out if r["loss"].startswith("ours") and r["status"] == "ok"), None)
    unfused = next((r for r in out if r["loss"] == "unfused" and r["status"] == "ok"), None)
    for r in out:
        if r["status"] != "ok":
            continue
        if ours:
            r["time vs ours"] = r["fwd+bwd ms"] / ours["fwd+bwd ms"]
            r["memory vs ours"] = r["peak GiB"] / ours["peak GiB"] if r["peak GiB"] is not None else None
        if unfused:
            r["rel diff vs unfused"] = abs(r["value"] - unfused["value"]) / abs(unfused["value"])
    del h, w, labels
    return out


def versions() -> dict:
    """The candidates' package versions (``absent`` where not installed)."""
    return package_versions(*PACKAGES.values())


def main(argv: list[str] | None = None) -> list[Result]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocabs", default="32000,151936")
    p.add_argument("--rows", default="32768,262144", help="rows of hidden states (tokens of one rank)")
    p.add_argument("--chunk-rows", default="", help="our loss at each of these chunk sizes (default: its default)")
    p.add_argument("--runs", type=int, default=10, help="timed calls per case (after one warm-up)")
    p.add_argument("--smoke", action="store_true", help="CPU, float32, tiny shapes")
    add_out_argument(p)
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    dtype, hidden = (torch.float32, 16) if args.smoke else (torch.bfloat16, HIDDEN)
    if args.smoke:
        args.vocabs, args.rows, args.chunk_rows, args.runs = "100", "64", "24", 2
    elif device.type != "cuda":
        raise SystemExit("bench_loss times the losses on a GPU; --smoke runs the CPU path")
    chunk_rows = [int(n) for n in args.chunk_rows.split(",") if n]
    rows = []
    for vocab in (int(v) for v in args.vocabs.split(",")):
        for n in (int(r) for r in args.rows.split(",")):
            rows += run_case(vocab, n, hidden, dtype, device, chunk_rows, args.runs)
    found = versions()
    result = Result(
        benchmark="loss", name="loss-smoke" if args.smoke else "loss",
        title=f"The causal-LM loss of a linear head, forward and backward: hidden {hidden}, {str(dtype)[6:]}",
        columns=COLUMNS, rows=[[r.get(c) for c in COLUMNS] for r in rows],
        formats={"fwd+bwd ms": "{:.1f}", "TFLOP/s": "{:.0f}", "peak GiB": "{:.2f}", "time vs ours": "{:.2f}",
                 "memory vs ours": "{:.2f}", "rel diff vs unfused": "{:.1e}"},
        env=environment(**found),
        notes=f"sum over the rows with a target (one in 8 without), median of {args.runs} calls after one; peak = "
              "the most memory allocated during one forward and backward beyond the inputs; TFLOP/s = the head's "
              "three GEMMs (6 x rows x vocab x hidden) / time; cce = cut-cross-entropy's default, which skips "
              "gradient entries below a threshold, cce exact = without that; "
              + ", ".join(f"{k} {v}" for k, v in found.items()),
    )  # fmt: skip
    emit([result], args.out)
    return [result]


if __name__ == "__main__":
    main()
