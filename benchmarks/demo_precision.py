"""How far the demo model's step-1 gradients are from float64, per dtype (CPU, one device).

    python -m benchmarks.demo_precision [--dtype bfloat16] [demo options ...]

Builds ``cp_ops_demo.HybridLM`` with the demo's options (``python -m cp_ops demo
--help``; the defaults here are the CPU ones with 4 blocks and 2030 tokens), runs one
forward and backward of the summed token loss in ``--dtype`` and in float64 from the
same (``--dtype``) weights, and prints the relative error ``||g - g64|| / ||g64||``
of the worst parameters and over all parameters. It tells which tolerance a step-1
check in that dtype can use: two runs that differ only in rounding can be this far
apart.
"""

from __future__ import annotations

import argparse
import copy

import torch

import cp_ops_demo as demo


class _Zero(torch.nn.Module):
    """Stands in for a layer: returns zeros of its input's shape (the residual branch drops out)."""

    def forward(self, x, *args, **kwargs):
        return torch.zeros_like(x)


def gradients(model, batch) -> dict[str, torch.Tensor]:
    model(*batch).backward()
    # parameters that feed a removed layer only (its norm) get no gradient
    return {name: p.grad.double() for name, p in model.named_parameters() if p.grad is not None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--without", choices=["gdn", "attn"], help="replace every block's GDN or attention by zeros")
    args, rest = parser.parse_known_args()
    cfg = demo.parse_args(
        ["--device", "cpu", "--cp-size", "1", "--blocks", "4", "--seqlens", "300,0,1,700,129,900"] + rest
    )
    torch.manual_seed(cfg.seed)
    model = demo.HybridLM(cfg).to(getattr(torch, args.dtype))  # both runs start from these weights
    if args.without:  # which layers make the gradients sensitive to rounding
        for block in model.blocks:
            setattr(block, args.without, _Zero())
    batch = demo.make_batch(cfg.seqlens, 1, cfg.vocab, cfg.seed * 1000)
    exact = gradients(copy.deepcopy(model).double(), batch)
    low = gradients(model, batch)
    errors = {name: float((low[name] - exact[name]).norm() / exact[name].norm()) for name in exact}
    flat = [torch.cat([g[n].flatten() for n in exact]) for g in (low, exact)]
    without = f", without {args.without}" if args.without else ""
    print(f"{args.dtype} vs float64, step-1 gradients of the demo model ({cfg.blocks} blocks, "
          f"{sum(cfg.seqlens)} tokens, hidden {cfg.hidden}{without})")  # fmt: skip
    for name in sorted(errors, key=errors.get, reverse=True)[:5]:
        print(f"  {name:40s} {errors[name]:.3g}")
    print(f"  {'all parameters':40s} {float((flat[0] - flat[1]).norm() / flat[1].norm()):.3g}")


if __name__ == "__main__":
    main()
