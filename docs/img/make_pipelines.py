"""Draws docs/img/pipelines.png: the THD layout and the CP pipelines of both layers (docs/design.md).

    python docs/img/make_pipelines.py [--out PATH]

A diagram, not a measurement: boxes and arrows in one matplotlib axis, no data read.
"""

from __future__ import annotations

import argparse
import io
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Patch, Rectangle  # noqa: E402
from PIL import Image  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))

# what a box holds: local rows with all features (CP), all rows with 1/W of the heads (HP),
# a collective, work that runs while a collective is in flight
COLORS = {
    "cp": "#cfe2f3",
    "hp": "#fce5cd",
    "comm": "#f4cccc",
    "overlap": "#d9ead3",
    "gathered": "#fff2cc",
}
RANK_COLORS = ("#6fa8dc", "#f6b26b")


def box(ax, x, y, w, h, text, kind, size=7.0):
    ax.add_patch(
        FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.6", fc=COLORS[kind], ec="#444444", lw=0.8)
    )
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=size, linespacing=1.25)


def arrow(ax, start, end, style="-|>", color="#333333", dashed=False):
    ax.add_patch(
        FancyArrowPatch(start, end, arrowstyle=style, mutation_scale=9, lw=0.9, color=color,
                        linestyle=(0, (3, 2)) if dashed else "-", shrinkA=0, shrinkB=0)  # fmt: skip
    )


def chain(ax, xs, y, w, h, texts, kinds):
    """Boxes left to right at ``xs``, joined by arrows; returns the boxes' (x, y, w, h)."""
    boxes = []
    for x, text, kind in zip(xs, texts, kinds):
        box(ax, x, y, w, h, text, kind)
        boxes.append((x, y, w, h))
    for (x0, y0, w0, h0), (x1, _, _, _) in zip(boxes, boxes[1:]):
        arrow(ax, (x0 + w0, y0 + h0 / 2), (x1, y0 + h0 / 2))
    return boxes


def layout_panel(ax, top):
    """W = 2, real lengths 5, 2 and 0 (padded 8, 4, 0): sequence order, the two shards, rank order."""
    ax.text(1, top, "THD layout, W = 2: real lengths 5, 2, 0; padded 8, 4, 0 (multiples of 2W); chunks of 2 and 1 rows",
            fontsize=9, weight="bold", va="top")  # fmt: skip
    cell = 3.2
    # (label, owning rank, real) per sequence-order row
    seq_rows = [("a0", 0, 1), ("a1", 0, 1), ("a2", 1, 1), ("a3", 1, 1), ("a4", 1, 1), ("a5", 1, 0), ("a6", 0, 0),
                ("a7", 0, 0), ("b0", 0, 1), ("b1", 1, 1), ("b2", 1, 0), ("b3", 0, 0)]  # fmt: skip
    by_name = {name: (rank, real) for name, rank, real in seq_rows}

    def strip(x0, y, names, label):
        ax.text(x0 - 1, y + cell / 2 - 0.6, label, ha="right", va="center", fontsize=7.5)
        for i, name in enumerate(names):
            rank, real = by_name[name]
            ax.add_patch(Rectangle((x0 + i * cell, y), cell, cell * 0.62, fc=RANK_COLORS[rank], ec="white", lw=1,
                                   hatch=None if real else "////", alpha=1.0 if real else 0.55))  # fmt: skip
            ax.text(x0 + i * cell + cell / 2, y + cell * 0.31, name, ha="center", va="center", fontsize=6.5)

    x0, y = 20, top - 6
    strip(x0, y, [r[0] for r in seq_rows], "sequence order (global)")
    for c, text in ((0, "chunk 0"), (2, "1"), (4, "2"), (6, "3"), (8, "0"), (9, "1"), (10, "2"), (11, "3")):
        ax.text(x0 + c * cell + 0.2, y - 0.9, text, fontsize=5.5, va="center", color="#555555")
    shard0, shard1 = ["a0", "a1", "a6", "a7", "b0", "b3"], ["a2", "a3", "a4", "a5", "b1", "b2"]
    strip(x0, y - 4.6, shard0, "rank 0 (local): chunks 0, 3")
    strip(x0, y - 7.6, shard1, "rank 1 (local): chunks 1, 2")
    strip(x0, y - 11.4, shard0 + shard1, "rank order (all-gather)")
    notes = (
        "rank r holds chunks r and 2W-1-r of every sequence (same causal work on every rank)",
        "local offsets cu_seqlens_padded / W = [0, 4, 6, 6]; hatched = padding (tail of each sequence)",
        "seq -> rank order: rows [0 1 6 7 8 11 | 2 3 4 5 9 10]",
        "local row x of sequence i on rank r: chunk j = r if x < c_i else 2W-1-r,",
        "   position j*c_i + (x mod c_i); valid rows in chunk j: clamp(L_i - j*c_i, 0, c_i)",
    )
    for i, line in enumerate(notes):
        ax.text(64, y + 1.6 - i * 2.2, line, fontsize=7, va="center")
    handles = [Patch(fc=RANK_COLORS[0], label="rank 0's rows"), Patch(fc=RANK_COLORS[1], label="rank 1's rows"),
               Patch(fc=COLORS["cp"], ec="#444444", label="local rows, all features (CP)"),
               Patch(fc=COLORS["hp"], ec="#444444", label="all rows, 1/W of the heads (HP)"),
               Patch(fc=COLORS["gathered"], ec="#444444", label="all rows of K, V (gathered)"),
               Patch(fc=COLORS["comm"], ec="#444444", label="collective"),
               Patch(fc=COLORS["overlap"], ec="#444444", label="runs during a collective")]  # fmt: skip
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(63.5, top - 15.5), ncol=3, fontsize=6.5,
              frameon=False, bbox_transform=ax.transData, handlelength=1.4, columnspacing=1.0)  # fmt: skip


def gdn_panel(ax, top):
    ax.text(1, top, "GatedDeltaNet with CP (fused layouts, as compiled): one all-to-all each way",
            fontsize=9, weight="bold", va="top")  # fmt: skip
    w, h, y = 12.4, 7.2, top - 11
    xs = [1 + i * 14.8 for i in range(8)]
    texts = [
        "x [T/W, hidden]\nin_proj of q,k,v,b,a\nas W GEMMs: send\n[W, T/W, F/W]",
        "all-to-all\ncp -> hp\n(block d to rank d)",
        "conv1d, silu\ncausal_conv1d_gather:\nreads rank order\nthrough a row map",
        "l2norm(q), l2norm(k)\ng = -exp(A_log)\n * softplus(a + dt_bias)\nbeta = sigmoid(b)",
        "chunk_gated_\ndelta_rule\nHv/W heads, all T\n(sequence order)",
        "seq -> rank\norder\n(send buffer)",
        "all-to-all\nhp -> cp",
        "per received block s:\ngated norm with z_s,\nout_proj columns of s;\nsum -> [T/W, hidden]",
    ]
    kinds = ["cp", "comm", "hp", "hp", "hp", "hp", "comm", "cp"]
    boxes = chain(ax, xs, y, w, h, texts, kinds)
    # the overlap lane
    yo = y - 9.5
    box(ax, xs[1], yo, w, 6.2, "z = in_proj_z(x)\n[T/W, Hv*dv]\nnever leaves the rank", "overlap")
    box(ax, xs[6], yo, w, 6.2, "own block (heads of r,\nits own rows): norm\n+ out_proj part", "overlap")
    arrow(ax, (xs[0] + w / 2, y), (xs[1], yo + 3.1), dashed=True)
    arrow(ax, (xs[1] + w, yo + 3.1), (xs[7] + w / 2 - 2, y), dashed=True)
    arrow(ax, (xs[6] + w, yo + 3.1), (xs[7] + w / 2 + 2, y), dashed=True)
    for x in (xs[1], xs[6]):
        ax.annotate("", xy=(x + w / 2, yo + 6.2), xytext=(x + w / 2, y), arrowprops=dict(arrowstyle="-", ls=":", lw=0.8))
    ax.text(xs[2], yo + 1.5, "backward: the same two exchanges reversed (an all-to-all of equal blocks is its own\n"
            "adjoint); out_proj's and the z projection's weight gradients fill the exchange windows",
            fontsize=7, va="center", style="italic")  # fmt: skip
    return boxes


def attention_panel(ax, top):
    ax.text(1, top, "All-gather CP attention (per head group g of G), then the gated output",
            fontsize=9, weight="bold", va="top")  # fmt: skip
    w, h, y = 17.2, 7.2, top - 11
    xs = [1 + i * 19.9 for i in range(6)]
    texts = [
        "x [T/W, hidden]: q, k, v,\ngate projections, q/k\nRMSNorm, rope at\nlocal_positions",
        "cat(K_g, V_g)\n[T/W, 2*Hkv/G, D]",
        "all-gather\n-> [T, 2*Hkv/G, D]\nin rank order",
        "thd_rank_to_seq_order\n(sequence order)",
        "varlen_attention: one launch,\n2 segments per sequence\n(chunks r and 2W-1-r);\nq local, k/v gathered",
        "concat groups over heads\no * sigmoid(gate)\no_proj -> [T/W, hidden]",
    ]
    kinds = ["cp", "cp", "comm", "gathered", "cp", "cp"]
    chain(ax, xs, y, w, h, texts, kinds)
    # backward lane, right to left
    yb = y - 8.5
    back = [(xs[4], "dq on local rows;\ndk, dv on gathered"), (xs[3], "thd_seq_to_rank_order"),
            (xs[2], "reduce-scatter (sum)\n-> local dK, dV")]  # fmt: skip
    for x, text in back:
        box(ax, x, yb, w, 5.2, text, "comm" if "reduce" in text else ("gathered" if "seq" in text else "cp"))
    for (x0, _), (x1, _) in zip(back, back[1:]):
        arrow(ax, (x0, yb + 2.6), (x1 + w, yb + 2.6))
    ax.text(xs[0], yb + 2.6, "backward (autograd\nthrough the pieces):", fontsize=7.5, va="center", style="italic")
    # the head-group pipeline as a timeline
    yt, seg = yb - 7.8, 9.0
    ax.text(xs[0], yt + 3.3, "head_groups = 3, compiled\nwith COMPILE_OPTIONS:", fontsize=7.5, va="center",
            style="italic")  # fmt: skip
    x0 = xs[1] + 2
    for g in range(3):
        ax.add_patch(Rectangle((x0 + g * seg, yt + 3.2), seg - 0.4, 2.4, fc=COLORS["comm"], ec="#444444", lw=0.6))
        ax.text(x0 + g * seg + seg / 2, yt + 4.4, f"gather g{g}", ha="center", va="center", fontsize=6.5)
        ax.add_patch(Rectangle((x0 + (g + 1) * seg, yt), seg - 0.4, 2.4, fc=COLORS["overlap"], ec="#444444", lw=0.6))
        ax.text(x0 + (g + 1) * seg + seg / 2, yt + 1.2, f"attention g{g}", ha="center", va="center", fontsize=6.5)
    ax.text(x0 + 4.6 * seg, yt + 2.6, "group g's attention needs only gather g: it runs while g+1 travels;\n"
            "backward in reverse order, each reduce-scatter beside the next group's gradients",
            fontsize=7, va="center")  # fmt: skip


def draw(out: str) -> None:
    fig = plt.figure(figsize=(12, 8.2), dpi=100)
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, 120)
    ax.set_ylim(0, 82)
    ax.axis("off")
    layout_panel(ax, 81)
    gdn_panel(ax, 58)
    attention_panel(ax, 31.5)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    # a palette of 64 colours keeps the file small (a diagram has few); no metadata, so the
    # same script writes the same bytes
    image = Image.open(buf).convert("RGB").quantize(colors=64, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
    image.save(out, format="PNG", optimize=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(HERE, "pipelines.png"))
    draw(parser.parse_args().out)


if __name__ == "__main__":
    main()
