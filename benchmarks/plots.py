"""Pictures of the measured tables: reads docs/benchmarks.md, writes PNGs to docs/img/.

    python benchmarks/plots.py [--doc docs/benchmarks.md] [--out docs/img]

Runs anywhere (matplotlib, no GPU): the numbers are the ones the GPU benchmarks
wrote into docs/benchmarks.md, so a picture never shows anything the tables do
not. One figure per question:

  layout.png     each layout op's time over the clone's (the copy floor), per shape and W
  a2a.png        fused all-to-all vs per-sequence all-to-alls, by number of sequences and W
  attention.png  segment attention TFLOP/s against SDPA / FlexAttention / cuDNN, same run
  scaling.png    scaling efficiency T_1 / (W * T_W) of the CP layers
"""

from __future__ import annotations

import argparse
import os
import re

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def sections(text: str) -> dict[str, str]:
    """``{heading: body}`` for every ``##`` / ``###`` heading of a markdown text."""
    parts = re.split(r"^(#{2,3} .*)$", text, flags=re.M)
    return {parts[i].lstrip("# ").strip(): parts[i + 1] for i in range(1, len(parts) - 1, 2)}


def tables(body: str) -> list[list[dict[str, str]]]:
    """Every markdown table in ``body`` as a list of rows keyed by the header cells."""
    found, lines = [], body.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("|") and i + 1 < len(lines) and re.match(r"^\|[-| :]+\|$", lines[i + 1]):
            header = [c.strip() for c in lines[i].strip("|").split("|")]
            rows, i = [], i + 2
            while i < len(lines) and lines[i].startswith("|"):
                rows.append(dict(zip(header, (c.strip() for c in lines[i].strip("|").split("|")))))
                i += 1
            found.append(rows)
        else:
            i += 1
    return found


def num(cell: str) -> float:
    return float(cell.replace(",", "").rstrip("x"))


def section(secs: dict[str, str], prefix: str) -> str:
    for name, body in secs.items():
        if name.startswith(prefix):
            return body
    raise KeyError(f"no section starting with {prefix!r} in the document")


def plot_layout(secs, out):
    rows = tables(section(secs, "THD layout ops"))[0]
    ops = ["index_select ms", "seq_to_rank ms", "rank_to_seq ms", "copy_valid ms", "copy_valid_ ms", "loop ms"]
    labels = [f"{r['shape (bf16)'].split(',')[0].split(' (')[0]}\nW={r['W']}" for r in rows]
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
    fig.tight_layout()
    fig.savefig(os.path.join(out, "layout.png"), dpi=110)
    plt.close(fig)


def plot_a2a(secs, out):
    series = [("W = 2", tables(section(secs, "Fused CP <-> head-parallel all-to-all"))[0]),
              ("W = 4 (earlier section-permutation kernel)", tables(section(secs, "W = 4"))[0])]  # fmt: skip
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
    fig.tight_layout()
    fig.savefig(os.path.join(out, "a2a.png"), dpi=110)
    plt.close(fig)


def plot_attention(secs, out):
    # the latest full table of the section (later runs are appended below earlier ones)
    rows = [t for t in tables(section(secs, "Segment attention")) if "implementation" in t[0]][-1]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, case in zip(axes, ("dense B8 x 4096", "packed 32k")):
        sel = [r for r in rows if r["case"] == case and r["D"] == "128"]
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
    fig.tight_layout()
    fig.savefig(os.path.join(out, "attention.png"), dpi=110)
    plt.close(fig)


def _short(case: str) -> str:
    """``T=32768 B=8`` -> ``T=32k B=8``: tick labels that fit under a bar."""
    return re.sub(r"T=(\d+)", lambda m: f"T={int(m.group(1)) // 1024}k", case)


def plot_scaling(secs, out):
    points = {}  # label -> efficiency; a later table (a newer run) replaces an earlier one's point
    gdn = section(secs, "GatedDeltaNet with CP")
    for rows in tables(gdn):
        if "" not in rows[0]:  # not a table of bench_gdn.py (row names in an unnamed first column)
            continue
        by_name = {r[""]: r for r in rows}
        if "1 GPU fwd+bwd compiled" not in by_name:  # an excerpt of an earlier run, not a benchmark table
            continue
        w = re.search(r"W=(\d+)", "".join(by_name)).group(1)
        for mode in ("eager", "compiled"):
            for col, val in by_name.get(f"scaling efficiency, {mode}", {}).items():
                if col and val != "nan":
                    points[f"GDN {mode}, W={w}\n{_short(col)}"] = num(val)
    ag = section(secs, "All-gather CP attention")
    # the benchmark's timing tables (not the work model, not the table of the removed overlap)
    for rows in (t for t in tables(ag) if "pass" in t[0] and "eff 1L" in t[0]):
        world = [k for k in rows[0] if k.startswith("W=")][0].split()[0]
        for r in rows:
            if r["pass"] == "fwd+bwd":
                points[f"AG attn eager, {world}\n{_short('T=' + r['T'])}"] = num(r["eff 1L"])
                if r.get("eff 1L compiled"):
                    points[f"AG attn compiled, {world}\n{_short('T=' + r['T'])}"] = num(r["eff 1L compiled"])
    points = list(points.items())
    fig, ax = plt.subplots(figsize=(12, 5))
    ax.bar(range(len(points)), [p[1] for p in points], color=["C0" if "GDN" in p[0] else "C1" for p in points])
    ax.set_xticks(range(len(points)), [p[0] for p in points], fontsize=7, rotation=45, ha="right")
    ax.axhline(0.85, color="gray", ls="--", lw=0.8, label="target 0.85 (W = 2)")
    ax.set_ylim(0, 1)
    ax.set_ylabel("T_1 / (W * T_W)")
    ax.set_title("Scaling efficiency of the CP layers against one GPU on the same global batch (H200s)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "scaling.png"), dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--doc", default=os.path.join(ROOT, "docs", "benchmarks.md"))
    parser.add_argument("--out", default=os.path.join(ROOT, "docs", "img"))
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    with open(args.doc) as f:
        secs = sections(f.read())
    for plot in (plot_layout, plot_a2a, plot_attention, plot_scaling):
        plot(secs, args.out)
        print(f"{plot.__name__.removeprefix('plot_')}.png written to {args.out}")


if __name__ == "__main__":
    main()
