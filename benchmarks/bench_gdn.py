"""GatedDeltaNet on one GPU at Qwen3-Next-80B shapes: layer eager vs compiled, core op, breakdown.

    PYTHONPATH=. python benchmarks/bench_gdn.py    # from the repo root (or after pip install -e .)
    PYTHONPATH=. python benchmarks/bench_gdn.py --tokens 32768 --seqs 8

Shapes: hidden 2048, Hk 16, Hv 32, dk = dv = 128, conv kernel 4, bf16. Sequence
lengths are random around T/B (a fixed seed) and sum to T. Times are medians of
``triton.testing.do_bench`` in ms; "fwd+bwd" runs forward and backward of
``out.sum()``-style losses with a fixed upstream gradient. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import datetime

import torch
import triton
from triton.testing import do_bench

import custom_ops
from cp_ops import GatedDeltaNet, pad_cu_seqlens

HIDDEN, HK, HV, DK, DV = 2048, 16, 32, 128, 128


def _lengths(total: int, num_seqs: int, generator: torch.Generator) -> list[int]:
    weights = torch.rand(num_seqs, generator=generator) + 0.5
    lens = (weights / weights.sum() * total).floor().long()
    lens[-1] += total - int(lens.sum())
    return lens.tolist()


def _fwd_bwd(fn, inputs, grad):
    def run():
        for t in inputs:
            t.grad = None
        out = fn()
        out.backward(grad)

    return run


def bench_case(layer, tokens: int, num_seqs: int) -> dict[str, float]:
    gen = torch.Generator().manual_seed(tokens + num_seqs)
    _, cup = pad_cu_seqlens(_lengths(tokens, num_seqs, gen), 1, device="cuda")
    tokens = int(cup[-1])  # padding to whole 2-row chunks can add a row per sequence
    dev, bf16 = "cuda", torch.bfloat16
    x = torch.randn(tokens, HIDDEN, device=dev, dtype=bf16, requires_grad=True)
    grad = torch.randn(tokens, HIDDEN, device=dev, dtype=bf16)
    params = list(layer.parameters())
    compiled = torch.compile(layer, fullgraph=True, dynamic=True)
    res = {}
    res["layer fwd eager"] = do_bench(lambda: layer(x, cup))
    res["layer fwd+bwd eager"] = do_bench(_fwd_bwd(lambda: layer(x, cup), [x] + params, grad))
    res["layer fwd compiled"] = do_bench(lambda: compiled(x, cup))
    res["layer fwd+bwd compiled"] = do_bench(_fwd_bwd(lambda: compiled(x, cup), [x] + params, grad))

    # the pieces, on the tensors the layer produces (fwd+bwd each)
    with torch.no_grad():
        proj = layer.in_proj(x)
    proj = proj.detach().requires_grad_()
    conv_w = 2 * HK * DK + HV * DV
    weight = layer.conv1d.weight[:, 0, :].detach().contiguous().requires_grad_()
    q = torch.nn.functional.normalize(torch.randn(tokens, HK, DK, device=dev, dtype=bf16), dim=-1).requires_grad_()
    k = torch.nn.functional.normalize(torch.randn(tokens, HK, DK, device=dev, dtype=bf16), dim=-1).requires_grad_()
    v = torch.randn(tokens, HV, DV, device=dev, dtype=bf16, requires_grad=True)
    g = torch.nn.functional.logsigmoid(torch.randn(tokens, HV, device=dev) + 3).requires_grad_()
    beta = torch.rand(tokens, HV, device=dev).requires_grad_()
    o_grad = torch.randn(tokens, HV, DV, device=dev, dtype=bf16)
    z = torch.randn(tokens, HV, DV, device=dev, dtype=bf16, requires_grad=True)
    o_in = torch.randn(tokens, HV, DV, device=dev, dtype=bf16, requires_grad=True)
    core_in = torch.randn(tokens, HV * DV, device=dev, dtype=bf16, requires_grad=True)

    res["in_proj fwd+bwd"] = do_bench(
        _fwd_bwd(lambda: layer.in_proj(x), [x, layer.in_proj.weight], torch.randn_like(proj))
    )
    res["conv fwd+bwd"] = do_bench(
        _fwd_bwd(
            lambda: custom_ops.causal_conv1d(proj[:, :conv_w], weight, None, cup, "silu"),
            [proj, weight],
            torch.randn(tokens, conv_w, device=dev, dtype=bf16),
        )
    )
    res["core fwd"] = do_bench(lambda: custom_ops.chunk_gated_delta_rule(q, k, v, g, beta, cup))
    res["core fwd+bwd"] = do_bench(
        _fwd_bwd(lambda: custom_ops.chunk_gated_delta_rule(q, k, v, g, beta, cup), [q, k, v, g, beta], o_grad)
    )
    res["gated norm fwd+bwd eager"] = do_bench(_fwd_bwd(lambda: layer.norm(o_in, z), [o_in, z], o_grad))
    norm_c = torch.compile(layer.norm, fullgraph=True, dynamic=True)
    res["gated norm fwd+bwd compiled"] = do_bench(_fwd_bwd(lambda: norm_c(o_in, z), [o_in, z], o_grad))
    res["out_proj fwd+bwd"] = do_bench(_fwd_bwd(lambda: layer.out_proj(core_in), [core_in, layer.out_proj.weight], grad))
    return res


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[32768, 65536])
    parser.add_argument("--seqs", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--out", help="also write the table to this markdown file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_gdn needs a CUDA device")

    import fla

    torch.manual_seed(0)
    layer = GatedDeltaNet(HIDDEN, HK, HV, DK, DV).to("cuda", torch.bfloat16)
    cases = [(t, b) for t in args.tokens for b in args.seqs]
    results = {case: bench_case(layer, *case) for case in cases}

    lines = [
        f"## GatedDeltaNet (hidden {HIDDEN}, Hk {HK}, Hv {HV}, dk = dv = {DK}), bf16, median ms\n",
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
        f"fla {getattr(fla, '__version__', '?')}, {datetime.date.today().isoformat()}\n",
        "| | " + " | ".join(f"T={t} B={b}" for t, b in cases) + " |",
        "|---" * (len(cases) + 1) + "|",
    ]
    for name in results[cases[0]]:
        lines.append(f"| {name} | " + " | ".join(f"{results[c][name]:.3f}" for c in cases) + " |")
    print("\n".join(lines))
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
