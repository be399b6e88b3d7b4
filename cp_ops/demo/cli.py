"""The demo's command line: ``python -m cp_ops demo [options]`` (``--help`` lists them).

:func:`parse_args` fills in the defaults that depend on the device and refuses sizes the
layers cannot take; :func:`run` trains in this process (W = 1, ``group=None``: the layers'
single-device path) or on W ranks it spawns (:mod:`cp_ops.demo.ranks`), prints the table
and returns the results as a dict (the tests and ``notebooks/03_training_with_cp.ipynb``
call it); :func:`main` turns them into an exit code. On CUDA the default W is the number
of visible GPUs (so one GPU gives W = 1).
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence

import torch

from cp_ops.demo.data import num_targets, random_seqlens
from cp_ops.demo.report import format_table, summarise, verdict
from cp_ops.demo.train import TOLERANCE, train

__all__ = ["DEVICE_DEFAULTS", "build_parser", "parse_args", "run", "main"]

# defaults that depend on the device: (cpu, cuda)
DEVICE_DEFAULTS = {
    "seqlens": ("300,0,1,260,129", "8192,0,1,4093,300,12000,2047,5000"),
    "steps": (6, 20),
    # the GPU width in bfloat16 trains steadily at the lower rate (docs/benchmarks.md, "The whole model")
    "lr": (3e-3, 1e-3),
    "blocks": (2, 4),
    "hidden": (64, 1024),
    "mlp": (128, 2816),
    "vocab": (256, 4096),
    "gdn_head_dim": (16, 128),
    "attn_heads": (4, 8),
    "attn_kv_heads": (2, 2),
    "attn_head_dim": (16, 128),
    "dtype": ("float32", "bfloat16"),
}


def _both(name: str) -> str:
    cpu, cuda = DEVICE_DEFAULTS[name]
    return f"default: {cpu} on cpu, {cuda} on cuda"


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows ``(default: ...)`` for options with a fixed default; the others say theirs in the help."""

    def _get_help_string(self, action):
        if action.default is None or isinstance(action, argparse._StoreTrueAction):
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m cp_ops demo",
        description=(
            "Train a small hybrid GatedDeltaNet / gated-attention stack with context parallelism over local "
            "ranks (gloo on CPU, NCCL with one GPU per rank), check step 1 against the same model on one "
            "device, and print throughput, compile counts, error and peak memory. Exits non-zero when a "
            "compiled run has graph breaks or the error exceeds the tolerance."
        ),
        formatter_class=_HelpFormatter,
    )
    p.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="where to run (default: cuda if available, else cpu)")
    p.add_argument("--cp-size", type=int, default=None,
                   help="number of CP ranks W, one process each; 1 runs in this process without a group "
                        "(default: 2 on cpu, the number of visible GPUs on cuda)")
    p.add_argument("--seqlens", type=str, default=None,
                   help="comma-separated real sequence lengths of the packed batch; 0 and 1 are allowed "
                        f"({_both('seqlens')})")
    p.add_argument("--num-seqs", type=int, default=None,
                   help="instead of --seqlens: this many random lengths in [0, --max-len] (seeded), the first "
                        "two being 0 and 1")
    p.add_argument("--max-len", type=int, default=512, help="longest random length with --num-seqs")
    p.add_argument("--steps", type=int, default=None,
                   help=f"training steps; the first one is checked and compiles ({_both('steps')})")
    p.add_argument("--data", choices=["fixed", "fresh"], default="fixed",
                   help="fixed: one random batch every step (the loss falls as it is memorised); "
                        "fresh: new random tokens each step (same lengths)")
    p.add_argument("--blocks", type=int, default=None, help=f"hybrid blocks ({_both('blocks')})")
    p.add_argument("--hidden", type=int, default=None, help=f"model width ({_both('hidden')})")
    p.add_argument("--mlp", type=int, default=None, help=f"SwiGLU inner width ({_both('mlp')})")
    p.add_argument("--vocab", type=int, default=None, help=f"vocabulary size ({_both('vocab')})")
    p.add_argument("--gdn-k-heads", type=int, default=None,
                   help="GatedDeltaNet key heads, a multiple of --cp-size (default: the smallest multiple of "
                        "--cp-size that is at least 2 on cpu, at least 8 on cuda)")
    p.add_argument("--gdn-v-heads", type=int, default=None,
                   help="GatedDeltaNet value heads, a multiple of --gdn-k-heads (default: 2 x --gdn-k-heads)")
    p.add_argument("--gdn-head-dim", type=int, default=None,
                   help=f"GatedDeltaNet key and value head dim ({_both('gdn_head_dim')})")
    p.add_argument("--heads", "--attn-heads", dest="attn_heads", type=int, default=None,
                   help=f"attention query heads, a multiple of --kv-heads ({_both('attn_heads')})")
    p.add_argument("--kv-heads", "--attn-kv-heads", dest="attn_kv_heads", type=int, default=None,
                   help=f"attention key/value heads ({_both('attn_kv_heads')})")
    p.add_argument("--head-dim", "--attn-head-dim", dest="attn_head_dim", type=int, default=None,
                   help=f"attention head dim, even ({_both('attn_head_dim')})")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help=f"parameter and activation dtype ({_both('dtype')})")
    p.add_argument("--check-dtype", choices=["float32", "bfloat16"], default=None,
                   help="dtype of the step-1 check (default: --dtype); when it differs from --dtype, a copy of "
                        "the model in this dtype runs step 1 on the CP ranks (compiled unless --eager) before "
                        "training. bfloat16 rounding moves this model's step-1 gradients far beyond the float32 "
                        "tolerance. On GPUs, float32 dots in "
                        "Triton kernels are TF32 unless TRITON_F32_DEFAULT=ieee is set")
    p.add_argument("--reference", choices=["same", "eager"], default="same",
                   help="how the one-device reference runs step 1: same: like training (compiled unless "
                        "--eager), so CP is the only difference; eager: eagerly, so the check covers the "
                        "compiler too (use a float32 check). At --cp-size 1 'same' has nothing to compare "
                        "and skips the check")
    p.add_argument("--tol", type=float, default=None,
                   help="max relative error of the step-1 loss and parameter gradients vs one device "
                        f"(default: {TOLERANCE['float32']:g} for a float32 check, {TOLERANCE['bfloat16']:g} "
                        "for bfloat16)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the data")
    p.add_argument("--lr", type=float, default=None, help=f"AdamW learning rate ({_both('lr')})")
    p.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay")
    p.add_argument("--eager", action="store_true", help="run the model eagerly instead of compiling each block with torch.compile(fullgraph=True)")
    p.add_argument("--no-check", action="store_true", help="skip the step-1 check against one device")
    p.add_argument("--quiet", action="store_true", help="no progress bar and no table")
    p.add_argument("--json", type=str, default=None, help="also write the results to this JSON file (default: none)")
    return p


def _parse_seqlens(p: argparse.ArgumentParser, text: str) -> list[int]:
    try:
        lens = [int(s) for s in text.replace(" ", "").split(",") if s != ""]
    except ValueError:
        p.error(f"--seqlens must be comma-separated integers, got {text!r}")
    if not lens:
        p.error("--seqlens needs at least one length")
    if min(lens) < 0:
        p.error(f"--seqlens: lengths must be >= 0, got {min(lens)}")
    return lens


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and validate; device-dependent defaults are filled in. Errors exit via argparse (code 2)."""
    p = build_parser()
    args = p.parse_args(argv)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    on_cuda = args.device == "cuda"
    if on_cuda and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available")
    pick = 1 if on_cuda else 0
    for name, values in DEVICE_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, values[pick])
    if args.cp_size is None:
        args.cp_size = torch.cuda.device_count() if on_cuda else 2
    w = args.cp_size
    if w < 1:
        p.error(f"--cp-size must be >= 1, got {w}")
    if on_cuda and w > torch.cuda.device_count():
        p.error(f"--cp-size {w}: one GPU per rank, but only {torch.cuda.device_count()} are visible")

    if args.num_seqs is not None:
        if args.num_seqs < 2 or args.max_len < 2:
            p.error("--num-seqs and --max-len must be >= 2")
        args.seqlens = random_seqlens(args.num_seqs, args.max_len, args.seed + 1)
    else:
        args.seqlens = _parse_seqlens(p, args.seqlens) if isinstance(args.seqlens, str) else list(args.seqlens)
    if num_targets(args.seqlens) == 0:
        p.error("the batch has no targets: at least one sequence must be 2 tokens or longer")

    if args.gdn_k_heads is None:
        base = 8 if on_cuda else 2
        args.gdn_k_heads = w * math.ceil(base / w)
    if args.gdn_v_heads is None:
        args.gdn_v_heads = 2 * args.gdn_k_heads
    for name in ("steps", "blocks", "hidden", "mlp", "vocab", "gdn_k_heads", "gdn_v_heads", "gdn_head_dim",
                 "attn_heads", "attn_kv_heads", "attn_head_dim"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.gdn_k_heads % w:
        p.error(f"--gdn-k-heads {args.gdn_k_heads} must be divisible by --cp-size {w} "
                "(GatedDeltaNet splits its key heads over the CP ranks)")
    if args.gdn_v_heads % args.gdn_k_heads:
        p.error(f"--gdn-v-heads {args.gdn_v_heads} must be a multiple of --gdn-k-heads {args.gdn_k_heads}")
    if args.attn_heads % args.attn_kv_heads:
        p.error(f"--heads {args.attn_heads} must be a multiple of --kv-heads {args.attn_kv_heads}")
    if args.attn_head_dim % 2:
        p.error(f"--head-dim {args.attn_head_dim} must be even (rotary embedding)")
    if on_cuda and max(args.gdn_head_dim, args.attn_head_dim) > 256:
        p.error("the CUDA kernels take head dims up to 256")
    if args.check_dtype is None:
        args.check_dtype = args.dtype
    if args.tol is None:
        args.tol = TOLERANCE[args.check_dtype]
    if args.lr <= 0:
        p.error(f"--lr must be > 0, got {args.lr}")
    return args


def run(argv: Sequence[str] | None = None) -> dict:
    """Run the demo with command-line arguments ``argv``; returns the results (rank 0's view).

    Keys include ``losses`` (per step, the global mean loss), ``step_times``,
    ``max_rel_error``, ``errors`` (per parameter), ``graph_breaks``, ``recompiles``,
    ``tokens_per_s``, ``step_time_s``, ``compile_time_s``, ``peak_memory_mib``,
    ``ok`` and ``failures``. Invalid arguments raise ``SystemExit`` (argparse).

    With ``--cp-size`` > 1 the ranks are processes started with the ``spawn`` method, so a
    script calling this needs the usual ``if __name__ == "__main__":`` guard. With
    ``--cp-size 1`` the run happens in this process and resets dynamo's caches and counters
    (``torch._dynamo.reset()``) first.
    """
    args = parse_args(argv)
    if args.cp_size == 1:
        device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
            torch.cuda.reset_peak_memory_stats(device)
        res = train(0, 1, None, args, device)
        res["backend"] = "none (one process, group=None)"
    else:
        from cp_ops.demo.ranks import run_ranks

        res = run_ranks(args)
    res = summarise(args, res)
    if not args.quiet:
        print(format_table(res))
        print(verdict(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return res


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m cp_ops demo``: exit code 0 when the run passed its checks."""
    return 0 if run(argv)["ok"] else 1
