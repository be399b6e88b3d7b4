"""The demo's training loop on one rank, with the check of step 1 against one device.

The loss of a step is the mean cross-entropy over the global batch's targets: each rank
sums the cross-entropy over its local targets and divides by the global count, so the
sum over ranks is the one-device loss, and the parameter gradients, summed over the CP
group (one all-reduce) before the optimizer step, are the one-device gradients.

Step 1 is checked against the same model (same seed, same weights, same batch) run on
one device over the whole batch without a group: the relative error of the loss and of
every parameter gradient after the all-reduce, ``||g_cp - g_ref|| / ||g_ref||``, max
over parameters and ranks. With ``--reference same`` the reference runs the way training
runs (compiled unless ``--eager``), so context parallelism is the only difference;
``--reference eager`` runs it eagerly, so the check covers the compiler as well
(meaningful in float32 only: compiled and eager code round differently). When the check
dtype differs from the training dtype, a copy of the model in the check dtype runs step 1
on the CP ranks, compiled like training, before training (which then compiles afresh).

Compiling: each block is compiled with ``torch.compile(fullgraph=True)`` (regional
compilation), and so is the head with the loss (``HybridLM.loss``): :data:`REGIONS` graphs.
The blocks are alike, so dynamo compiles the block's code once and every block runs it,
which takes a fraction of the time one graph of the whole stack would take to compile on a
cold start; the embedding runs eagerly.

Counting: graph breaks are ``sum(torch._dynamo.utils.counters["graph_break"].values())``;
compiles are counted by a backend wrapper around Inductor
(``torch._dynamo.testing.CompileCounterWithBackend``: one call per graph dynamo hands to
the backend), which works the same way on torch 2.11 and 2.13; recompiles = compiles - REGIONS.
``counters["stats"]["unique_graphs"]`` is reported alongside as a cross-check. With
``fullgraph=True`` a graph break raises instead of splitting the graph, so a compiled run
that finishes has none; the count is still reported (and checked).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import resource
import sys
import threading
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import cp_ops
from cp_ops.demo.data import Batches, num_targets, shard
from cp_ops.demo.model import HybridLM
from custom_ops import env

__all__ = ["REGIONS", "TOLERANCE", "train", "compile_options", "reference_is_eager", "check_skipped"]

# the compiled regions of a run: the block (one graph for every block) and the head with the loss
REGIONS = 2

# Max relative error (loss and every parameter gradient) of the CP step vs one device. Both
# run the same code but for CP: the weight gradients are summed in another order (per rank,
# then all-reduced) and the GEMMs run on fewer rows, so the two round differently. At
# initialisation on random tokens each weight gradient is a small difference of large sums
# over the tokens, which turns bfloat16's rounding into errors of several percent in every
# parameter; the bfloat16 tolerance sits above those of correct runs and below those of a
# fault as small as one rank's rotary positions off by one (docs/benchmarks.md, section
# "The whole model", and test_demo.py). A float32 check is the tight one.
TOLERANCE = {"float32": 5e-4, "bfloat16": 0.15}


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


def compile_options(world: int) -> dict:
    """The Inductor options of a run's compiles on ``world`` ranks, applied around them only.

    With CP, :data:`cp_ops.COMPILE_OPTIONS` keep the GDN layers' all-to-alls overlapped with
    the work recorded beside them, and the W ranks, which compile at once, share the cores
    instead of starting W pools of a worker per core (unless TORCHINDUCTOR_COMPILE_THREADS
    says otherwise). One rank has no exchange to overlap and the cores to itself.
    """
    if world == 1:
        return {}
    options = dict(cp_ops.COMPILE_OPTIONS)
    if not env.inductor_compile_threads_set():
        options["compile_threads"] = max(1, (os.cpu_count() or 1) // world)
    return options


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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory_mib(device: torch.device) -> float:
    """Peak memory of this process: CUDA's max_memory_allocated, or the peak RSS on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    # ru_maxrss: KiB on Linux, bytes on macOS
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10


class Say:
    """``say(text)`` prints text on stderr after the seconds since this object was made:
    what a long first step is busy with."""

    def __init__(self, enabled: bool):
        self.enabled, self.start = enabled, time.perf_counter()

    def __call__(self, text: str) -> None:
        if self.enabled:
            print(f"[{time.perf_counter() - self.start:6.1f} s] {text}", file=sys.stderr, flush=True)

    @contextlib.contextmanager
    def heartbeat(self, every: float):
        """Say every ``every`` seconds how long the enclosed work has run, until it ends."""
        done = threading.Event()
        start = time.perf_counter()

        def beat():
            while not done.wait(every):
                self(f"still compiling ({time.perf_counter() - start:.0f} s in this step)")

        thread = threading.Thread(target=beat, daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()


class Progress:
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


def train(rank: int, world: int, group, args: argparse.Namespace, device: torch.device) -> dict:
    """Build, check step 1, train; runs on every rank (``group=None`` at W = 1). Returns this
    rank's results. The compiles run under :func:`compile_options`."""
    import torch._inductor.config

    with torch._inductor.config.patch(compile_options(world)):
        return _train(rank, world, group, args, device)


def _train(rank: int, world: int, group, args: argparse.Namespace, device: torch.device) -> dict:
    import torch._dynamo
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    dtype = getattr(torch, args.dtype)
    torch.manual_seed(args.seed)  # the same weights on every rank
    model = HybridLM(args).to(device=device, dtype=dtype)
    batch = Batches(args.seqlens, world, args.vocab, args.seed, args.data == "fresh", device)
    targets = num_targets(args.seqlens)

    def step_grads(fn, net, step: int) -> torch.Tensor:
        """One forward/backward of ``net`` (through ``fn``) on this rank's shard; the global loss."""
        tokens, labels, cu, cup = batch(step)
        tokens, labels = shard(tokens, labels, cup, world, rank)
        loss = fn(tokens, labels, cu, cup, group=group) / targets
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
        if not args.eager:
            # regional compilation: the blocks are alike, so their code compiles once and every
            # block runs it; the head and loss are a region of their own, the embedding is eager
            for block in net.blocks:
                block.compile(fullgraph=True, backend=counter)
            net.loss = torch.compile(net.loss, fullgraph=True, backend=counter)
        return net, counter

    say = Say(enabled=rank == 0 and not args.quiet)

    def busy(compiling: bool):  # a heartbeat while a first step compiles, which can take minutes
        return say.heartbeat(every=15.0) if compiling and not args.eager else contextlib.nullcontext()

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
            ref_loss = ref_fn(tokens, labels, cu, cup) / targets
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
    progress = Progress(args.steps, enabled=rank == 0 and not args.quiet)
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
        "peak_memory_mib": peak_memory_mib(device),
        "num_real_tokens": sum(args.seqlens),
        "num_targets": targets,
        "num_rows": int(cp_ops.pad_cu_seqlens(args.seqlens, world)[1][-1]),
    }
