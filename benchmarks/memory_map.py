"""Where a training step's memory goes, rank by rank: the recipe (examples/train_qwen3_next.py,
its own setup and step) with a probe on the allocator at every boundary of the step.

    torchrun --nproc-per-node W -m benchmarks.memory_map --json OUT [--snapshot DIR] -- RECIPE ARGS ...

``python -m benchmarks.bench_train --memory`` starts it for each W and tabulates the JSON. The
recipe's steps run as the recipe runs them; the last (``--steps``) is measured: the allocator's
allocated bytes at the start and end of each phase (the embedding, each decoder layer's forward,
the final norm, head and loss, the backward, the optimizer step) and the peak inside it, from forward hooks on
the modules and the optimizer's step hooks (``torch.cuda`` memory statistics; nothing on the CPU,
where the phases and the sizes counted from the tensors still come out). Parameters, gradients
and optimizer state are counted from the tensors themselves (each rank's shards). ``--snapshot``
also writes each rank's allocator history of the measured step (``torch.cuda.memory``'s snapshot,
viewable at pytorch.org/memory_viz) to ``DIR/rank<R>.pickle``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.runner import ROOT
from custom_ops import env

SCRIPT = ROOT / "examples" / "train_qwen3_next.py"
GIB = 2**30


@dataclass
class Phase:
    name: str
    start: int  # bytes allocated when it began
    end: int | None = None  # and when it ended
    peak: int = 0  # the most allocated within it


@dataclass
class MemoryProbe:
    """Allocated bytes at each mark and the peak between marks. ``allocated``, ``peak`` and
    ``reset_peak`` read the allocator (CUDA's statistics by default); a mark closes the phase
    before it and opens the one it names."""

    allocated: object
    peak: object
    reset_peak: object
    phases: list[Phase] = field(default_factory=list)
    sizes: dict[str, int] = field(default_factory=dict)
    handles: list = field(default_factory=list)

    @classmethod
    def for_device(cls, device: torch.device) -> MemoryProbe:
        if device.type == "cuda":
            return cls(lambda: torch.cuda.memory_allocated(device), lambda: torch.cuda.max_memory_allocated(device),
                       lambda: torch.cuda.reset_peak_memory_stats(device))  # fmt: skip
        return cls(lambda: 0, lambda: 0, lambda: None)

    def mark(self, name: str | None) -> None:
        """End the open phase (if any) and begin ``name`` (None: begin nothing)."""
        now = self.allocated()
        if self.phases and self.phases[-1].end is None:
            self.phases[-1].end = now
            self.phases[-1].peak = max(self.peak(), now, self.phases[-1].start)
        self.reset_peak()
        if name is not None:
            self.phases.append(Phase(name, now))

    def install(self, model: torch.nn.Module, layers, norm: torch.nn.Module, optimizer) -> None:
        """Marks at the start of ``model``'s forward, of each of ``layers``' forwards and of the
        final ``norm``'s (the head and the loss follow it), at the forward's end (the backward
        begins) and around the optimizer step; the parameters' and optimizer state's sizes now,
        the gradients' when the step begins."""

        def at(name):
            return lambda *_args, **_kwargs: self.mark(name)

        add = self.handles.append
        add(model.register_forward_pre_hook(at("embedding"), prepend=True))
        for i, layer in enumerate(layers):
            add(layer.register_forward_pre_hook(at(f"layer {i}"), prepend=True))
        add(norm.register_forward_pre_hook(at("head and loss"), prepend=True))
        add(model.register_forward_hook(at("backward")))
        add(optimizer.register_step_pre_hook(self._before_step))
        add(optimizer.register_step_post_hook(at(None)))
        self.sizes["parameters"] = local_bytes(model.parameters())
        self.sizes["optimizer state"] = local_bytes(t for s in optimizer.state.values() for t in s.values())

    def _before_step(self, optimizer, *_args) -> None:
        self.sizes["gradients"] = local_bytes(p.grad for g in optimizer.param_groups for p in g["params"])
        self.mark("optimizer step")

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def report(self, rank: int) -> dict:
        """This rank's map (:func:`memory_report`)."""
        return memory_report(rank, self.phases, self.sizes)


def local_bytes(tensors) -> int:
    """The bytes of this rank's part of each tensor (a DTensor's local shard)."""
    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor):
            local = t.to_local() if hasattr(t, "to_local") else t
            total += local.numel() * local.element_size()
    return total


def memory_report(rank: int, phases: list[Phase], sizes: dict[str, int]) -> dict:
    """One rank's map in GiB: the step's peak and the phase it falls in; what was held when that
    phase began (parameters, optimizer state, gradients once the step has them, and the rest:
    activations and the loss's saved tensors) and what the phase added on top (``transient``: the
    phase's temporaries, unsharded parameters, communication buffers); what each decoder layer's
    forward and the head and loss left allocated (their saved activations); every phase."""
    top = max(phases, key=lambda p: p.peak)
    persistent = sizes.get("parameters", 0) + sizes.get("optimizer state", 0)
    grads = sizes.get("gradients", 0) if top.name == "optimizer step" else 0
    left = {p.name: (p.end - p.start) / GIB for p in phases if p.name.startswith("layer ") or p.name == "head and loss"}
    return {
        "rank": rank, "peak": top.peak / GIB, "peak phase": top.name,
        "held at its start": top.start / GIB, "parameters": sizes.get("parameters", 0) / GIB,
        "optimizer state": sizes.get("optimizer state", 0) / GIB, "gradients": sizes.get("gradients", 0) / GIB,
        "activations and loss held": (top.start - persistent - grads) / GIB, "transient": (top.peak - top.start) / GIB,
        "activations by layer": {k: v for k, v in left.items() if k.startswith("layer ")},
        "head and loss": left.get("head and loss"),
        "phases": [[p.name, p.start / GIB, p.end / GIB, p.peak / GIB] for p in phases],
    }  # fmt: skip


def format_reports(reports: list[dict]) -> str:
    """The maps of every rank as text: a line per rank, then each rank's layers."""
    lines = []
    for r in sorted(reports, key=lambda r: r["rank"]):
        lines.append(
            f"rank {r['rank']}: peak {r['peak']:.2f} GiB in {r['peak phase']}: held at its start "
            f"{r['held at its start']:.2f} (parameters {r['parameters']:.2f}, optimizer state "
            f"{r['optimizer state']:.2f}, activations and loss {r['activations and loss held']:.2f}"
            + (f", gradients {r['gradients']:.2f}" if r["peak phase"] == "optimizer step" else "")
            + f"), added within it {r['transient']:.2f}"
        )
        layers = ", ".join(f"{name.split()[1]}: {gib:.2f}" for name, gib in r["activations by layer"].items())
        loss = "-" if r["head and loss"] is None else f"{r['head and loss']:.2f}"
        lines.append(f"  left by each layer's forward (GiB) {layers}; by the head and loss {loss}; "
                     f"gradients {r['gradients']:.2f}")  # fmt: skip
    return "\n".join(lines)


def load_recipe():
    """examples/train_qwen3_next.py as a module (a script, not a package module)."""
    spec = importlib.util.spec_from_file_location("train_qwen3_next", SCRIPT)
    recipe = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = recipe  # its dataclasses look their module up
    spec.loader.exec_module(recipe)
    return recipe


def measure(recipe, cfg, rank: int, world: int, device: torch.device, snapshot: str | None = None) -> dict:
    """Run the recipe's ``cfg.steps`` steps (``cfg`` its ``TrainConfig``) with the probe on the last;
    this rank's map."""
    run = recipe.setup(cfg, rank, world, device)
    clock, staging = recipe.Clock(device), recipe.Staging(device)
    probe = MemoryProbe.for_device(device)
    for step in range(1, cfg.steps + 1):
        batch = staging.batch_to_device(step, recipe.replica_batch(run, step))
        if step == cfg.steps:
            probe.install(run.model, run.model.model.layers, run.model.model.norm, run.optimizer)
            if snapshot and device.type == "cuda":
                torch.cuda.memory._record_memory_history(max_entries=1_000_000)
        recipe.read_step(run, recipe.issue_step(run, step, batch, clock, staging, lambda: 0), clock)
    probe.remove()
    if snapshot and device.type == "cuda":
        Path(snapshot).mkdir(parents=True, exist_ok=True)
        torch.cuda.memory._dump_snapshot(f"{snapshot}/rank{rank}.pickle")
        torch.cuda.memory._record_memory_history(enabled=None)
    return probe.report(rank)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", required=True, help="rank 0 writes every rank's map here")
    p.add_argument("--snapshot", metavar="DIR", help="each rank's allocator history of the measured step (CUDA)")
    ours = p.parse_args(argv[:split])
    recipe = load_recipe()
    cfg = recipe.TrainConfig.from_args(argv[split + 1 :], (env.torchrun_ranks() or (0, 1))[1])
    rank, world, device = recipe.init_distributed(cfg.device)
    try:
        report = measure(recipe, cfg, rank, world, device, ours.snapshot)
        reports = [None] * world
        dist.all_gather_object(reports, report)
        if rank == 0:
            print(format_reports(reports), flush=True)
            settings = dataclasses.asdict(cfg)
            Path(ours.json).write_text(json.dumps({"settings": settings, "world": world, "ranks": reports}, default=str))
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
