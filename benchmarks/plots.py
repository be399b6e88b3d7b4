"""Pictures of the measured tables: reads the JSON results in benchmarks/results/, writes PNGs to docs/img/.

    python -m benchmarks.plots [--results benchmarks/results] [--out docs/img]

Runs anywhere (matplotlib, no GPU), from the files the tables are rendered from: layout.png
(result "layout"), a2a.png ("cp2hp-w2", "cp2hp-w4"), attention.png ("attention"),
scaling.png (every CP table of bench_gdn and bench_attention cp, a later point replacing an
earlier one) and train_curves.png ("train-losses-slice4").
"""

from __future__ import annotations

import argparse
import os
import re

import matplotlib

from benchmarks.runner import RESULTS_DIR, ROOT, Result, load_all

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# Results whose points the scaling figure takes, oldest first where their dates tie (the
# conversion of the hand-kept document dated them by day only); a result not listed comes last.
SCALING_ORDER = (
    "gdn-cp-w2", "gdn-cp-w2-z-overlap", "gdn-cp-w2-fused-layouts", "gdn-cp-w2-exchange-windows",
    "gdn-cp-w2-cudagraphs", "gdn-cp-w2-conv-rows", "gdn-cp-w2-gathered-conv", "gdn-cp-w4",
    "ag-attention-w2-opaque", "ag-attention-w2-triton371", "ag-attention-w4", "ag-attention-w2-one-launch",
    "ag-attention-w2",
)  # fmt: skip


def num(cell) -> float:
    """A table cell as a number: numbers as they are, text such as ``1,544`` or ``1.08x`` parsed."""
    if isinstance(cell, (int, float)):
        return float(cell)
    return float(str(cell).replace(",", "").replace("*", "").rstrip("x"))


def result(results: dict[str, Result], name: str) -> Result:
    if name not in results:
        raise KeyError(f"no result named {name!r} (benchmarks/results/{name}.json)")
    return results[name]


def _save(fig, out: str, name: str) -> None:
    fig.tight_layout()
    fig.savefig(os.path.join(out, name), dpi=110)
    plt.close(fig)


def _ordered(results: dict[str, Result], benchmark: str) -> list[Result]:
    chosen = [r for r in results.values() if r.benchmark == benchmark]
    rank = {name: i for i, name in enumerate(SCALING_ORDER)}
    return sorted(chosen, key=lambda r: (r.env.get("date", ""), rank.get(r.name, len(rank)), r.name))


def plot_layout(results, out):
    rows = result(results, "layout").records()
    ops = ["index_select ms", "seq_to_rank ms", "rank_to_seq ms", "copy_valid ms", "copy_valid_ ms", "loop ms"]
    labels = [f"{str(r['shape (bf16)']).split(',')[0].split(' (')[0]}\nW={r['W']}" for r in rows]
    fig, ax = plt.subplots(figsize=(11, 4.5))
    width = 0.8 / len(ops)
    for k, op in enumerate(ops):
        ratios = [num(r[op]) / num(r["clone ms"]) for r in rows]
        ax.bar([i + k * width for i in range(len(rows))], ratios, width, label=op.removesuffix(" ms"))
    ax.axhline(1.0, color="black", lw=0.8)
    ax.axhline(1.1, color="gray", ls="--", lw=0.8, label="target 1.10x")
    ax.set_yscale("log")
    ax.set_ylabel("time / clone time (log)")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(rows))], labels, fontsize=7)
    ax.set_title("THD layout ops on one H100: time over the copy floor")
    ax.legend(fontsize=7, ncol=4)
    _save(fig, out, "layout.png")


def plot_a2a(results, out):
    series = [("W = 2", result(results, "cp2hp-w2").records()),
              ("W = 4 (earlier section-permutation kernel)", result(results, "cp2hp-w4").records())]  # fmt: skip
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, rows in series:
        labels = [f"T={r['T']}\n{r['seqs']} seqs" for r in rows]
        ax1.plot(labels, [num(r["per-seq cp2hp"]) / num(r["cp2hp"]) for r in rows], "o-", label=name)
        ax2.plot(labels, [num(r["cp2hp / bare"]) for r in rows], "o-", label=name)
    ax1.axhline(20, color="gray", ls="--", lw=0.8, label="target 20x at 64 seqs")
    ax1.set_ylabel("per-sequence time / fused time")
    ax1.set_title("fused cp2hp vs one all-to-all per sequence and section")
    ax2.axhline(1.1, color="gray", ls="--", lw=0.8, label="target 1.10x")
    ax2.set_ylim(0, max(2.2, ax2.get_ylim()[1]))
    ax2.set_ylabel("cp2hp time / bare all-to-all time")
    ax2.set_title("fused cp2hp vs a bare all-to-all of the same bytes")
    for ax in (ax1, ax2):
        ax.legend(fontsize=8)
        ax.tick_params(labelsize=8)
    fig.suptitle("Qwen3-Next GDN sections, bf16, H200s (NCCL)")
    _save(fig, out, "a2a.png")


def plot_attention(results, out):
    rows = result(results, "attention").records()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, case in zip(axes, ("dense B8 x 4096", "packed 32k")):
        sel = [r for r in rows if r["case"] == case and num(r["D"]) == 128]
        names = [r["implementation"] for r in sel]
        xs = range(len(sel))
        ax.bar([x - 0.2 for x in xs], [num(r["fwd TFLOP/s"]) for r in sel], 0.4, label="fwd")
        ax.bar([x + 0.2 for x in xs], [num(r["fwd+bwd TFLOP/s"]) for r in sel], 0.4, label="fwd+bwd")
        ax.set_xticks(list(xs), [n.replace(", ", ",\n").replace(" doc mask", "\ndoc mask") for n in names], fontsize=7)
        ax.set_title(f"{case}, D = 128, causal")
        ax.axhline(400, color="gray", ls="--", lw=0.8, label="fwd target 400")
        ax.legend(fontsize=7)
    axes[0].set_ylabel("TFLOP/s on visible pairs")
    fig.suptitle("Segment attention on one H100, bf16 (same run)")
    _save(fig, out, "attention.png")


def _short(case: str) -> str:
    """``T=32768 B=8`` -> ``T=32k B=8``: tick labels that fit under a bar."""
    return re.sub(r"T=(\d+)", lambda m: f"T={int(m.group(1)) // 1024}k", case)


def plot_scaling(results, out):
    points = {}  # label -> efficiency; a later result (a newer run) replaces an earlier one's point
    for res in _ordered(results, "gdn"):
        if res.columns[0] != "":  # not bench_gdn.py's CP table (row names in an unnamed first column)
            continue
        by_name = {r[""]: r for r in res.records()}
        if "1 GPU fwd+bwd compiled" not in by_name:  # an excerpt of an earlier run, not a benchmark table
            continue
        w = re.search(r"W=(\d+)", "".join(by_name)).group(1)
        for mode in ("eager", "compiled"):
            for col, val in by_name.get(f"scaling efficiency, {mode}", {}).items():
                if col and val not in ("nan", None) and not (isinstance(val, float) and val != val):
                    points[f"GDN {mode}, W={w}\n{_short(col)}"] = num(val)
    # the benchmark's timing tables (not the work model, not the table of the removed overlap)
    for res in (r for r in _ordered(results, "ag_attention") if "pass" in r.columns and "eff 1L" in r.columns):
        rows = res.records()
        world = [k for k in res.columns if k.startswith("W=")][0].split()[0]
        for r in rows:
            if r["pass"] == "fwd+bwd":
                tokens = _short(f"T={r['T']}")
                points[f"AG attn eager, {world}\n{tokens}"] = num(r["eff 1L"])
                if r.get("eff 1L compiled") not in (None, ""):
                    points[f"AG attn compiled, {world}\n{tokens}"] = num(r["eff 1L compiled"])
    points = list(points.items())
    fig, ax = plt.subplots(figsize=(12, 5))
    ax.bar(range(len(points)), [p[1] for p in points], color=["C0" if "GDN" in p[0] else "C1" for p in points])
    ax.set_xticks(range(len(points)), [p[0] for p in points], fontsize=7, rotation=45, ha="right")
    ax.axhline(0.85, color="gray", ls="--", lw=0.8, label="target 0.85 (W = 2)")
    ax.set_ylim(0, 1)
    ax.set_ylabel("T_1 / (W * T_W)")
    ax.set_title("Scaling efficiency of the CP layers against one GPU on the same global batch (H200s)")
    ax.legend(fontsize=8)
    _save(fig, out, "scaling.png")


def plot_train_curves(results, out):
    res = result(results, "train-losses-slice4")
    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [row[0] for row in res.rows]
    for i, label in enumerate(res.columns[1:], start=1):
        ax.plot(steps, [row[i] for row in res.rows], label=label, linewidth=1.2, linestyle="-" if i == 1 else "--")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(f"examples/train_qwen3_next.py, slice4, bf16 ({res.env.get('device', '')})")
    ax.legend(fontsize=8)
    _save(fig, out, "train_curves.png")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", default=str(RESULTS_DIR), help="directory of JSON results")
    parser.add_argument("--out", default=os.path.join(ROOT, "docs", "img"))
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    results = load_all(args.results)
    for plot in (plot_layout, plot_a2a, plot_attention, plot_scaling, plot_train_curves):
        plot(results, args.out)
        print(f"{plot.__name__.removeprefix('plot_')}.png written to {args.out}")


if __name__ == "__main__":
    main()
