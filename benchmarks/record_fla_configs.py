"""Record the configurations FLA's autotuner picks for the GDN layer's kernels on this GPU.

    python -m benchmarks.record_fla_configs [--heads 16,32 8,16 4,8 2,4] [--head-dim 128]
                                            [--tokens 32768] [--seqs 8] [--write FILE] [--out DIR]

One eager forward and backward of ``cp_ops.GatedDeltaNet`` per ``Hk,Hv`` pair (bf16, one GPU; the
default pairs are Qwen3-Next-80B's heads per rank at W = 1, 2, 4, 8, the demo's among them; FLA's
autotuning keys hold no token count, so one run covers every packing) lets FLA autotune every kernel
the layer launches. Every FLA autotuner's cache is then written, as the JSON that
:mod:`custom_ops.fla.configs` reads, to ``--write`` (default: the package's
``custom_ops/fla/fla_configs_sm<major><minor>.json`` for this GPU), and copied to ``--out``:

    {"fla": "0.6.0", "capability": [9, 0], "recorded_with": {device, torch, triton, ...},
     "entries": [{"kernel": "fla.ops.common.chunk_o.chunk_fwd_kernel_o",
                  "key": [...], "config": {"num_warps": 4, "num_stages": 2, "BV": 64, ...}}]}
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

import torch

from benchmarks.cases import random_lengths
from benchmarks.runner import environment

DEFAULT_HEADS = ("16,32", "8,16", "4,8", "2,4")


def run_layer(hk: int, hv: int, head_dim: int, tokens: int, seqs: int) -> float:
    """One eager fwd+bwd of a GatedDeltaNet with ``hk``/``hv`` heads; its wall seconds."""
    import cp_ops

    torch.manual_seed(0)
    layer = cp_ops.GatedDeltaNet(2048, hk, hv, head_dim, head_dim).to("cuda", torch.bfloat16)
    lens = random_lengths(tokens, seqs, torch.Generator().manual_seed(tokens + seqs))
    _, cup = cp_ops.pad_cu_seqlens(lens, 1, device="cuda")
    x = torch.randn(int(cup[-1]), 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    start = time.perf_counter()
    layer(x, cup).float().square().mean().backward()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def fla_autotuners() -> dict[str, object]:
    """``{"module.attribute": Autotuner}`` for every autotuned kernel of the FLA modules loaded
    (where it is defined, not where it is imported)."""
    from benchmarks.internals import autotuner_of

    found = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith("fla.") or module is None:
            continue
        for attr, obj in list(vars(module).items()):
            tuner = autotuner_of(obj)
            if tuner is not None and getattr(tuner.base_fn, "__module__", None) == name:
                found[f"{name}.{attr}"] = tuner
    return found


def cache_entries() -> list[dict]:
    """Every (kernel, key, chosen configuration) in the FLA autotuners' caches, sorted."""
    entries = []
    for kernel, tuner in sorted(fla_autotuners().items()):
        for key, config in tuner.cache.items():
            entries.append({"kernel": kernel, "key": list(key), "config": config.all_kwargs()})
    return sorted(entries, key=lambda e: (e["kernel"], json.dumps(e["key"])))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", nargs="+", default=list(DEFAULT_HEADS), help="Hk,Hv pairs to record")
    parser.add_argument("--head-dim", type=int, default=128, help="dk = dv")
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--seqs", type=int, default=8)
    parser.add_argument("--write", default=None, help="the JSON file to write (default: the package's for this GPU)")
    parser.add_argument("--out", default=None, help="also copy the file into this directory")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device: the configurations are recorded on the GPU they are for")
    import fla

    from benchmarks.internals import recorded_configs_path

    major, minor = torch.cuda.get_device_capability()
    path = args.write or str(recorded_configs_path((major, minor)))
    for pair in args.heads:
        hk, hv = (int(h) for h in pair.split(","))
        seconds = run_layer(hk, hv, args.head_dim, args.tokens, args.seqs)
        print(f"Hk {hk}, Hv {hv}: first fwd+bwd {seconds:.1f} s", flush=True)
    record = {
        "fla": fla.__version__,
        "capability": [major, minor],
        "recorded_with": environment(fla=fla.__version__, heads=args.heads, head_dim=args.head_dim,
                                     tokens=args.tokens, seqs=args.seqs),  # fmt: skip
        "entries": cache_entries(),
    }
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(record, f, indent=1, default=str)
        f.write("\n")
    print(f"{len(record['entries'])} entries -> {path}", flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        shutil.copy(path, args.out)


if __name__ == "__main__":
    main()
