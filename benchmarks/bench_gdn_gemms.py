"""The GatedDeltaNet layer's GEMMs alone: one GPU against one CP rank, no collectives running.

    python -m benchmarks.bench_gdn_gemms [--tokens 32768 65536] [--cp 2] [--out DIR]

Times each matrix product of the layer's forward and backward at Qwen3-Next-80B GDN
shapes (hidden 2048, Hk 16, Hv 32, dk = dv = 128, bf16) as the compiled layer issues
them (the generated code lists them): on one GPU over T rows, and on one rank of W
with fused layouts, over T/W rows with in_proj and out_proj split into W blocks (one
per destination of the all-to-all, :meth:`cp_ops.GatedDeltaNet.project_send_blocks`;
out_proj per received block, its weight read as a column slice). The difference
between the rank's sum and 1/W of the one-GPU sum is what the block shapes cost on
their own; in the layer the GEMMs also share the GPU with NCCL (``bench_gdn.py
--profile``). ``--smoke`` runs tiny shapes on the CPU. The result is ``gdn-gemms-wW``
(``gdn-gemms-smoke-wW`` with --smoke; benchmarks/runner.py).
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.runner import Result, add_out_argument, emit, environment
from benchmarks.timing import median_ms, median_ms_counted

HIDDEN, HK, HV, DK, DV = 2048, 16, 32, 128, 128


def layer_gemms(rows: int, world: int, dims=(HIDDEN, HK, HV, DK, DV), device="cuda", dtype=torch.bfloat16):
    """``{name: fn}``: the layer's GEMMs over ``rows`` local rows, in_proj / out_proj split into
    ``world`` blocks (``world = 1``: the one-GPU layer, one block)."""
    hidden, hk, hv, dk, dv = dims
    sent = (2 * hk * dk + hv * dv + 2 * hv) // world  # q, k, v, b, a features per destination
    z_w, o_k = hv * dv, hv * dv // world  # the gate z's width; out_proj's K per received block
    g = torch.Generator(device=device).manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, device=device, dtype=dtype, generator=g)

    x, w_in = rand(rows, hidden), rand(world, sent, hidden)  # the send-block rows of in_proj's weight
    w_z, w_out = rand(z_w, hidden), rand(hidden, hv * dv)
    g_in, g_z, g_out = rand(world, rows, sent), rand(rows, z_w), rand(rows, hidden)
    o = rand(world, rows, o_k)  # the normed output's received blocks
    blocks = range(world)

    def each(f):
        return lambda: [f(i) for i in blocks]

    return {
        "fwd in_proj (q, k, v, b, a)": each(lambda i: x @ w_in[i].t()),
        "fwd z": lambda: x @ w_z.t(),
        "fwd out_proj": each(lambda i: o[i] @ w_out[:, i * o_k : (i + 1) * o_k].t()),
        "dx in_proj": each(lambda i: g_in[i] @ w_in[i]),
        "dW in_proj": each(lambda i: g_in[i].t() @ x),
        "dx z": lambda: g_z @ w_z,
        "dW z": lambda: g_z.t() @ x,
        "d(normed output), out_proj": each(lambda i: g_out @ w_out[:, i * o_k : (i + 1) * o_k]),
        "dW out_proj": each(lambda i: g_out.t() @ o[i]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[32768, 65536], help="global tokens per batch")
    parser.add_argument("--cp", type=int, default=2, help="W: the rank's share of the tokens and its blocks")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, few runs")
    add_out_argument(parser)
    args = parser.parse_args()
    world = args.cp
    if args.smoke:
        device, dims, tokens = "cpu", (64, 2, 4, 16, 16), [64]

        def timer(fn):
            return median_ms_counted(fn, warmup=1, runs=3, device="cpu")

        how = "median of 3 wall-clock runs (CPU smoke)"
    else:
        device, dims, tokens, timer = "cuda", (HIDDEN, HK, HV, DK, DV), args.tokens, median_ms
        how = "median of do_bench (L2 flushed before each call)"
    header, formats = ["GEMM"], [None]
    rows: dict[str, list] = {}
    for t in tokens:
        one = {k: timer(f) for k, f in layer_gemms(t, 1, dims, device).items()}
        rank = {k: timer(f) for k, f in layer_gemms(t // world, world, dims, device).items()}
        header += [f"T={t}: 1 GPU", f"1 GPU / {world}", f"W={world} rank", "rank / (1 GPU / W)"]
        formats += [None, None, None, "{:.2f}"]
        for k in list(one) + ["sum"]:
            a = sum(one.values()) if k == "sum" else one[k]
            b = sum(rank.values()) if k == "sum" else rank[k]
            rows.setdefault(k, [k]).extend([a, a / world, b, b / (a / world)])
    title = (f"GatedDeltaNet GEMMs alone, one GPU against one rank of W={world} (hidden {dims[0]}, "
             f"Hk {dims[1]}, Hv {dims[2]}, dk {dims[3]}, dv {dims[4]}), bf16")  # fmt: skip
    notes = f"times in ms: {how}; a rank's in_proj and out_proj GEMMs are its {world} blocks, summed"
    name = f"gdn-gemms{'-smoke' if args.smoke else ''}-w{world}"
    emit([Result("gdn_gemms", title, header, list(rows.values()), notes, environment(), name=name, formats=formats)],
         args.out)  # fmt: skip


if __name__ == "__main__":
    main()
