"""``python -m cp_ops demo``: train a small hybrid GDN / attention stack with context parallelism.

The model is a Qwen3-Next-style hybrid: an embedding, ``--blocks`` blocks of::

    x = x + GatedDeltaNet(RMSNorm(x))      cp_ops.GatedDeltaNet (all-to-all CP)
    x = x + MLP(RMSNorm(x))                SwiGLU
    x = x + Attention(RMSNorm(x))          cp_ops.Attention, gated (all-gather CP)
    x = x + MLP(RMSNorm(x))

then a final RMSNorm and an LM head over a small vocabulary. It is trained with
next-token cross-entropy on packed random variable-length sequences (THD layout
from :func:`cp_ops.pad_cu_seqlens`, sharded with :func:`cp_ops.shard_thd`), AdamW,
for ``--steps`` steps, on W = ``--cp-size`` local ranks that this module spawns
itself (``torch.multiprocessing``, meeting at a file store in a temporary directory): gloo on CPU, NCCL on
GPUs (rank r on GPU r). Every rank builds the same weights and the same global
batch and keeps its shard.

The loss of a step is the mean cross-entropy over the global batch's targets (every
real token that has a next real token in its sequence): each rank sums the
cross-entropy over its local targets and divides by the global count, so the sum
over ranks is the one-device loss and the parameter gradients, summed over the CP
group (all-reduce) before the optimizer step, are the one-device gradients.

Step 1 is checked against the same model (same seed, same weights, same batch)
run on one device over the whole batch without a group: the relative error of
the loss and of every parameter gradient (after the all-reduce),
``||g_cp - g_ref|| / ||g_ref||``, max over parameters and ranks. By default
(``--reference same``) the reference runs the way training runs (compiled unless
``--eager``), so context parallelism is the only difference between the two;
``--reference eager`` runs it eagerly, so the check covers the compiler as well
(meaningful in float32 only: compiled and eager code round differently). At
W = 1 with ``--reference same`` there is nothing to compare (the training step
is the one-device step) and the check is skipped. The check runs
in ``--check-dtype`` (default: ``--dtype``). With ``--dtype bfloat16
--check-dtype float32`` a float32 copy of the model runs step 1 on the CP ranks,
compiled like training, before training starts (which then compiles afresh in
bfloat16): bfloat16 rounding moves this model's step-1 gradients by 10-30 % against
float64 (``benchmarks/demo_precision.py``), so two bfloat16 runs can only be
compared where they round alike (``--reference same``). On GPUs a float32
check is only as good as Triton's float32 dots, TF32 unless
``TRITON_F32_DEFAULT=ieee`` is set, and compiles and autotunes a second set of
kernels (FLA's included), which makes a cold-cache start much slower
(docs/benchmarks.md, section "The demo on GPUs").

The GatedDeltaNet layers start from FLA's decay init (``dt_bias`` the inverse
softplus of dt log-uniform in [1e-3, 0.1]) instead of Qwen3-Next's
``dt_bias = 1``: with ``A`` up to 16 the latter decays the state by up to
e^-20 per token, so each head's delta-rule output is a multiple of its own
token's value, the gated RMSNorm divides that multiple out, and the gradients
of q, k and beta are zero in exact arithmetic; computed, they are rounding
noise, and no two runs' step-1 gradients agree (bfloat16 vs float64: 0.78 over
all parameters with Qwen3-Next's init; 0.15, worst parameter 0.3, with FLA's).

Counting: graph breaks are ``sum(torch._dynamo.utils.counters["graph_break"].values())``
and compiles are counted by a backend wrapper around Inductor
(``torch._dynamo.testing.CompileCounterWithBackend``: one call per graph dynamo hands
to the backend); recompiles = compiles - 1. Both work the same way on torch 2.11 and
2.13. ``counters["stats"]["unique_graphs"]`` is reported alongside as a cross-check.
With ``fullgraph=True`` a graph break raises instead of splitting the graph, so a
compiled run that finishes has none; the count is still reported (and checked).

W = 1 runs in the calling process without a process group (``group=None``): the
layers take their single-device path. On CUDA the default W is the number of
visible GPUs (so one GPU gives W = 1).

:func:`run` takes the command-line arguments as a list and returns the results as
a dict (the tests and ``notebooks/03_training_with_cp.ipynb`` call it).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import resource
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

import cp_ops
from cp_ops._local_ranks import init_local_rank, leave_local_rank, local_rendezvous
from cp_ops.attention import RMSNorm
from custom_ops._common import kernels_visible_to_compiler

__all__ = ["HybridLM", "build_parser", "parse_args", "run", "main", "make_batch", "TOLERANCE"]

IGNORE_INDEX = -100

# Max relative error (loss and every parameter gradient) of the CP step vs one device. Both
# run the same code but for CP: the weight gradients are summed in another order (per rank,
# then all-reduced), the GEMMs run on fewer rows, and the gradients reach the first block
# through the delta-rule recurrence, which amplifies rounding; the tolerances sit above the
# errors of correct runs (docs/benchmarks.md, section "The demo on GPUs"). A sharding or
# reduction bug gives errors of order 1.
TOLERANCE = {"float32": 5e-4, "bfloat16": 5e-2}


def fla_dt_bias_(dt_bias: torch.Tensor, dt_min: float = 1e-3, dt_max: float = 0.1) -> torch.Tensor:
    """FLA's (and Mamba2's) decay init, in place: ``softplus(dt_bias) = dt``, dt log-uniform in
    ``[dt_min, dt_max]`` (floored at 1e-4). Uses the global RNG."""
    with torch.no_grad():
        u = torch.rand(dt_bias.shape, dtype=torch.float64)
        dt = torch.exp(u * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)).clamp(min=1e-4)
        dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
    return dt_bias


# defaults that depend on the device: (cpu, cuda)
DEVICE_DEFAULTS = {
    "seqlens": ("300,0,1,260,129", "8192,0,1,4093,300,12000,2047,5000"),
    "steps": (6, 20),
    # width 1024 in bf16 at 3e-3: the loss rose again after step 3 on H200s (docs/benchmarks.md)
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


# --- the model ------------------------------------------------------------------------------------


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))`` (gate and up as one Linear), no biases."""

    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.gate_up = nn.Linear(hidden, 2 * inner, bias=False)
        self.down = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class HybridBlock(nn.Module):
    """GDN -> MLP -> gated attention -> MLP, each pre-normed (RMSNorm) with a residual."""

    def __init__(self, cfg: argparse.Namespace):
        super().__init__()
        h = cfg.hidden
        self.gdn_norm, self.mlp1_norm, self.attn_norm, self.mlp2_norm = (RMSNorm(h) for _ in range(4))
        self.gdn = cp_ops.GatedDeltaNet(
            h, cfg.gdn_k_heads, cfg.gdn_v_heads, cfg.gdn_head_dim, cfg.gdn_head_dim
        )
        fla_dt_bias_(self.gdn.dt_bias)  # see the module docstring
        self.mlp1 = MLP(h, cfg.mlp)
        self.attn = cp_ops.Attention(h, cfg.attn_heads, cfg.attn_kv_heads, cfg.attn_head_dim, gated=True)
        self.mlp2 = MLP(h, cfg.mlp)

    def forward(self, x, cu_seqlens, cu_seqlens_padded, group=None):
        x = x + self.gdn(self.gdn_norm(x), cu_seqlens_padded, group=group)
        x = x + self.mlp1(self.mlp1_norm(x))
        x = x + self.attn(self.attn_norm(x), cu_seqlens, cu_seqlens_padded, group=group)
        return x + self.mlp2(self.mlp2_norm(x))


class HybridLM(nn.Module):
    """Embedding -> HybridBlocks -> RMSNorm -> LM head; ``forward`` returns the summed token loss.

    ``forward(tokens, labels, cu_seqlens, cu_seqlens_padded, group=None)``: tokens and
    labels ``[T/W]`` (this rank's shard; the whole batch when group is None), labels
    ``IGNORE_INDEX`` where there is no target (padding, the last token of a sequence).
    Returns the float32 sum of the cross-entropy over the local targets (0-d).
    """

    def __init__(self, cfg: argparse.Namespace):
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        nn.init.normal_(self.embed.weight, std=0.02)
        self.blocks = nn.ModuleList(HybridBlock(cfg) for _ in range(cfg.blocks))
        self.norm = RMSNorm(cfg.hidden)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)

    def forward(self, tokens, labels, cu_seqlens, cu_seqlens_padded, group=None):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, cu_seqlens, cu_seqlens_padded, group=group)
        logits = self.lm_head(self.norm(x)).float()
        return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")


# --- data -----------------------------------------------------------------------------------------


def make_batch(seqlens: Sequence[int], cp_size: int, vocab: int, seed: int):
    """One global THD batch of random tokens: ``(tokens [T], labels [T], cu_seqlens, cu_seqlens_padded)``.

    Padded for ``cp_size`` (every padded length a multiple of 2W); padding rows carry
    token 0. labels[t] = tokens[t+1] for every real token followed by a real token of
    its sequence, else ``IGNORE_INDEX``. The real tokens depend on the seed and the
    lengths only, not on ``cp_size``, so runs with different CP sizes see the same data.
    Built on the host (data preparation); the same on every rank for the same seed.
    """
    cu, cup = cp_ops.pad_cu_seqlens(seqlens, cp_size)
    num_rows = int(cup[-1])
    cp_ops.validate_thd(cu, cup, cp_size, num_rows)
    gen = torch.Generator().manual_seed(seed)
    real_tokens = torch.randint(vocab, (int(cu[-1]),), generator=gen)
    tokens = torch.zeros(num_rows, dtype=torch.int64)
    labels = torch.full((num_rows,), IGNORE_INDEX, dtype=torch.int64)
    for start, real_start, length in zip(cup[:-1].tolist(), cu[:-1].tolist(), seqlens):
        seq = real_tokens[real_start : real_start + length]
        tokens[start : start + length] = seq
        if length > 1:
            labels[start : start + length - 1] = seq[1:]
    return tokens, labels, cu, cup


# --- options --------------------------------------------------------------------------------------


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
                        "training. bfloat16 rounding moves this model's step-1 gradients by 10-30 %% against "
                        "float64 (benchmarks/demo_precision.py). On GPUs, float32 dots in Triton kernels are "
                        "TF32 unless TRITON_F32_DEFAULT=ieee is set")
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
    p.add_argument("--eager", action="store_true", help="run the model eagerly instead of torch.compile(fullgraph=True)")
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
        gen = torch.Generator().manual_seed(args.seed + 1)
        rest = torch.randint(0, args.max_len + 1, (args.num_seqs - 2,), generator=gen).tolist()
        args.seqlens = [0, 1] + rest
    else:
        args.seqlens = _parse_seqlens(p, args.seqlens) if isinstance(args.seqlens, str) else list(args.seqlens)
    if sum(max(n - 1, 0) for n in args.seqlens) == 0:
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


# --- one rank -------------------------------------------------------------------------------------


class _Progress:
    """tqdm when importable, else a one-line ``\\r`` bar on stderr."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled, self.n, self.bar = total, enabled, 0, None
        if not enabled:
            return
        try:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc="train", unit="step", file=sys.stderr)
        except ImportError:
            self._draw("")

    def _draw(self, text: str) -> None:
        width = 30
        filled = width * self.n // max(self.total, 1)
        sys.stderr.write(f"\rtrain [{'#' * filled}{'.' * (width - filled)}] {self.n}/{self.total} {text}  ")
        sys.stderr.flush()

    def update(self, text: str) -> None:
        if not self.enabled:
            return
        self.n += 1
        if self.bar is not None:
            self.bar.set_postfix_str(text, refresh=False)
            self.bar.update(1)
        else:
            self._draw(text)

    def close(self) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.close()
        else:
            sys.stderr.write("\n")
            sys.stderr.flush()


def _peak_memory_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    # ru_maxrss: KiB on Linux, bytes on macOS
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    if not torch.isfinite(a).all():
        return float("inf")
    den = b.norm()
    num = (a - b).norm()
    return float(num / den) if den > 0 else float(num)


def _errors(loss: torch.Tensor, model: nn.Module, reference) -> dict:
    """Relative error of the loss and of every parameter gradient against ``reference``."""
    errors = {"loss": _rel(loss, reference[0])}
    for name, p in model.named_parameters():
        errors[name] = _rel(p.grad, reference[1][name])
    return errors


def reference_is_eager(args: argparse.Namespace) -> bool:
    """Whether the one-device reference of the step-1 check runs eagerly."""
    return args.eager or args.reference == "eager"


def check_skipped(args: argparse.Namespace) -> str | None:
    """Why step 1 is not checked, or None when it is."""
    if args.no_check:
        return "--no-check"
    if args.cp_size == 1 and reference_is_eager(args) == args.eager:
        return "W = 1: the run is the one-device run"
    return None


def _train(rank: int, world: int, group, args: argparse.Namespace, device: torch.device) -> dict:
    """Build, check step 1, train; runs on every rank. Returns this rank's results."""
    import torch._dynamo
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    dtype = getattr(torch, args.dtype)
    torch.manual_seed(args.seed)  # the same weights on every rank
    model = HybridLM(args).to(device=device, dtype=dtype)
    batches = {}

    def batch(step: int):
        key = 0 if args.data == "fixed" else step
        if key not in batches:
            batches.clear()
            tokens, labels, cu, cup = make_batch(args.seqlens, world, args.vocab, args.seed * 1000 + key)
            batches[key] = tuple(t.to(device) for t in (tokens, labels, cu, cup))
        return batches[key]

    num_targets = sum(max(n - 1, 0) for n in args.seqlens)
    num_real = sum(args.seqlens)

    def step_grads(fn, net, step: int) -> torch.Tensor:
        """One forward/backward of ``net`` (through ``fn``) on this rank's shard; the global loss."""
        tokens, labels, cu, cup = batch(step)
        if world > 1:
            tokens, labels = (cp_ops.shard_thd(t, cup, world, rank) for t in (tokens, labels))
        loss = fn(tokens, labels, cu, cup, group=group) / num_targets
        loss.backward()
        loss = loss.detach().float()
        if world > 1:
            # CP layer gradients are each rank's contribution, the rest each rank's tokens' share;
            # one all-reduce of all of them (a flat copy), as a data-parallel bucket would
            grads = [p.grad for p in net.parameters()]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=group)
            for g, summed in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(summed.view_as(g))
            dist.all_reduce(loss, group=group)
        return loss

    def compile_fresh(net):
        torch._dynamo.reset()
        counters.clear()
        counter = CompileCounterWithBackend("inductor")
        return (net if args.eager else torch.compile(net, fullgraph=True, backend=counter)), counter

    t_start = time.perf_counter()

    def say(text: str) -> None:  # what a long first step is busy with
        if rank == 0 and not args.quiet:
            print(f"[{time.perf_counter() - t_start:6.1f} s] {text}", file=sys.stderr, flush=True)

    def busy(compiling: bool):  # a heartbeat while a first step compiles, which can take minutes
        return _heartbeat(say, every=15.0) if compiling and not args.eager else contextlib.nullcontext()

    if not args.eager:
        say("compiling: the first run on a machine compiles for minutes (Inductor, Triton, autotuning); "
            "later runs reuse the caches and start in seconds")  # fmt: skip

    reference, errors = None, {}
    ref_eager = reference_is_eager(args)
    if check_skipped(args) is None:
        say(f"step 1 on one device, {'eager' if ref_eager else 'compiling'}, {args.check_dtype} (the reference)")
        # the same model in the check dtype, one device, the whole batch, no group
        check_dtype = getattr(torch, args.check_dtype)
        ref_model = copy.deepcopy(model).to(check_dtype)
        ref_fn = ref_model if ref_eager else compile_fresh(ref_model)[0]
        tokens, labels, cu, cup = batch(0)
        with busy(not ref_eager):
            ref_loss = ref_fn(tokens, labels, cu, cup) / num_targets
            ref_loss.backward()
        reference = (ref_loss.detach().float(), {n: p.grad for n, p in ref_model.named_parameters()})
        del ref_model, ref_fn
        if check_dtype != dtype:
            # step 1 of a copy in the check dtype, run the way training runs (CP ranks, compiled),
            # before training; training then compiles afresh in its own dtype
            say(f"step 1 on {world} rank(s), {'eager' if args.eager else 'compiling'}, {args.check_dtype} (the check)")
            check_model = copy.deepcopy(model).to(check_dtype)
            with busy(True):
                loss = step_grads(compile_fresh(check_model)[0], check_model, 0)
            errors = _errors(loss, check_model, reference)
            reference = None
            del check_model
    if device.type == "cuda":  # the peak reported is training's, not the reference's (whole batch)
        torch.cuda.reset_peak_memory_stats(device)

    fn, counter = compile_fresh(model)
    say(f"training on {world} rank(s), {args.dtype}" + ("" if args.eager else "; step 1 compiles"))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)

    losses, times = [], []
    progress = _Progress(args.steps, enabled=rank == 0 and not args.quiet)
    for step in range(args.steps):
        _sync(device)
        start = time.perf_counter()
        with busy(step == 0):
            loss = step_grads(fn, model, step)
        checking = 0.0
        if step == 0 and reference is not None:  # not part of the step's time
            t0 = time.perf_counter()
            errors = _errors(loss, model, reference)
            checking = time.perf_counter() - t0
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)
        times.append(time.perf_counter() - start - checking)
        losses.append(float(loss))
        progress.update(f"loss {losses[-1]:.4f}")
    progress.close()

    worst = max(errors, key=errors.get) if errors else None
    return {
        "losses": losses,
        "step_times": times,
        "errors": errors,
        "max_rel_error": errors[worst] if worst else float("nan"),
        "worst": worst,
        "graph_breaks": int(sum(counters["graph_break"].values())),
        "compiles": 0 if args.eager else counter.frame_count,
        "unique_graphs": int(counters["stats"]["unique_graphs"]),
        "peak_memory_mib": _peak_memory_mib(device),
        "num_real_tokens": num_real,
        "num_targets": num_targets,
        "num_rows": int(cp_ops.pad_cu_seqlens(args.seqlens, world)[1][-1]),
    }


@contextlib.contextmanager
def _heartbeat(say, every: float):
    """Say every ``every`` seconds how long the enclosed work has run, until it ends."""
    done = threading.Event()
    start = time.perf_counter()

    def beat():
        while not done.wait(every):
            say(f"still compiling ({time.perf_counter() - start:.0f} s in this step)")

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def _reduce_results(res: dict, group, device: torch.device) -> dict:
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


def _rank_entry(rank: int, world: int, init_method: str, args: argparse.Namespace, result_path: str) -> None:
    import torch._inductor.config

    if "TORCHINDUCTOR_COMPILE_THREADS" not in os.environ:
        # W ranks compile at once: share the cores instead of W pools of cpu_count workers each
        # (on 2 cores with 2 ranks this cuts the cold compile of the defaults by about a quarter)
        torch._inductor.config.compile_threads = max(1, (os.cpu_count() or 1) // world)
    device = init_local_rank(rank, world, init_method, args.device)
    try:
        group = dist.group.WORLD
        # the GDN layers overlap their all-to-all with the gate projection; these Inductor options
        # keep that overlap in the compiled graphs (cp_ops.COMPILE_OPTIONS)
        with torch._inductor.config.patch(cp_ops.COMPILE_OPTIONS):
            res = _reduce_results(_train(rank, world, group, args, device), group, device)
        res["backend"] = dist.get_backend(group)
        if rank == 0:
            with open(result_path, "w") as f:
                json.dump(res, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    leave_local_rank()  # reached only when the run succeeded


# --- driver ---------------------------------------------------------------------------------------


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _summarise(args: argparse.Namespace, res: dict) -> dict:
    times = res["step_times"]
    step_time = _median(times[1:]) if len(times) > 1 else float("nan")
    out = dict(res)
    out.update(
        ranks=args.cp_size,
        device=args.device,
        dtype=args.dtype,
        compiled=not args.eager,
        kernels_visible=kernels_visible_to_compiler(),
        seqlens=list(args.seqlens),
        step_time_s=step_time,
        compile_time_s=times[0] - step_time if len(times) > 1 else float("nan"),
        tokens_per_s=res["num_real_tokens"] / step_time if step_time > 0 else float("nan"),
        recompiles=max(res["compiles"] - 1, 0),
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


def format_table(res: dict) -> str:
    """The results as a two-column table."""
    def fmt(v, spec):
        return "n/a" if isinstance(v, float) and math.isnan(v) else format(v, spec)

    rows = [
        ("ranks", str(res["ranks"])),
        ("backend", res["backend"]),
        ("device", res["device"]),
        ("dtype", res["dtype"]),
        ("mode", ("torch.compile(fullgraph=True)" if res["compiled"] else "eager")
         + ("" if not res["compiled"] else "; ops run torch references on the CPU" if res["device"] == "cpu"
            else "; our Triton kernels in Inductor's graph" if res["kernels_visible"]
            else "; our Triton kernels in opaque ops (triton newer than torch's pin)")),
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
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k.ljust(width)}  {v}" for k, v in rows]
    rule = "-" * max(len(line) for line in lines)
    return "\n".join([rule, *lines, rule])


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
    world = args.cp_size
    if world == 1:
        device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
            torch.cuda.reset_peak_memory_stats(device)
        res = _train(0, 1, None, args, device)
        res["backend"] = "none (one process, group=None)"
    else:
        with tempfile.TemporaryDirectory() as tmp, local_rendezvous() as init_method:
            path = os.path.join(tmp, "results.json")
            mp.spawn(_rank_entry, args=(world, init_method, args, path), nprocs=world, join=True)
            with open(path) as f:
                res = json.load(f)
    res = _summarise(args, res)
    if not args.quiet:
        print(format_table(res))
        for failure in res["failures"]:
            print(f"FAILED: {failure}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return res


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m cp_ops demo``: exit code 0 when the run passed its checks."""
    return 0 if run(argv)["ok"] else 1
