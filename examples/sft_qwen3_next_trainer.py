"""Fine-tune a transformers Qwen3-Next with context parallelism through transformers' ``Trainer``
or TRL's ``SFTTrainer``, on packed (padding-free) batches.

    torchrun --nproc-per-node 4 examples/sft_qwen3_next_trainer.py --cp 2 [--trainer sft] [--out DIR]
    python examples/sft_qwen3_next_trainer.py [--trainer sft]      # one process, no CP

Under torchrun the W ranks form a (dp = W / cp, cp) mesh; the model (the tiny random Qwen3-Next
of examples/finetune_qwen3_next.py, float32) is patched with ``apply_context_parallel(model,
mesh["cp"])`` and trained by :class:`cp_ops.integrations.trainer.ContextParallelTrainer` (``--trainer
hf``: ``DataCollatorWithFlattening`` packs each batch) or an ``SFTTrainer`` with
:class:`~cp_ops.integrations.trainer.ContextParallelMixin` (``--trainer sft``: TRL packs the
dataset, ``packing=True``, and its padding-free collator flattens each batch). In one process
the same model is patched without a group and trained by the unmodified trainer class, the
collator wrapped in ``ContextParallelCollator(collator, 1, 0)``: the reference the CP runs
equal. The data: token sequences of mixed lengths, learnt by heart, so the loss falls.
``--out DIR``: the trainer's output directory; rank 0 writes ``losses.json`` there (the logged
loss and gradient norm of every step) and ``model.pt`` (the final state dict).

The GPU run beside the recipe (benchmarks/bench_trainer.py runs both):

    torchrun --nproc-per-node 4 examples/sft_qwen3_next_trainer.py --preset slice4 --cp 4 --dtype bfloat16 \
        --loss fused --tokens-per-step 32768 --max-seqs 8 --steps 15 --log-json trainer.json

``--preset slice4``: examples/train_qwen3_next.py's four Qwen3-Next-80B-width layers (``--vocab-size``
as there). ``--tokens-per-step N``: instead of the 20 sequences, step ``s`` trains on the recipe's
synthetic batches of step ``s`` (``TokenStream``: 1 to ``--max-seqs`` sequences of random lengths adding
up to N real tokens over the dp replicas and accumulation steps, the recipe's ``--batch-shards dp x
grad-accum``), one dataset row per replica's micro-batch, packed by the collator.
``--dtype bfloat16``: ``TrainingArguments(bf16=True)``, the Trainer's mixed precision (float32
weights and optimizer state, the forward under bf16 autocast), as the recipe keeps float32 weights
and computes in bf16. ``--log-json PATH``: rank 0 writes every optimizer step's loss, wall time,
real tokens (over the dp replicas), tokens/s and peak memory (the largest over ranks) in the
recipe's ``--log-json`` shape (:class:`StepLog`).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time

import torch
import torch.distributed as dist
from transformers import TrainerCallback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # train_qwen3_next, beside this script
from train_qwen3_next import TokenStream, model_config  # noqa: E402
from train_qwen3_next import build_model as build_recipe_model  # noqa: E402

from cp_ops.integrations.trainer import (  # noqa: E402
    ContextParallelCollator,
    ContextParallelMixin,
    ContextParallelTrainer,
)
from cp_ops.integrations.transformers import apply_context_parallel  # noqa: E402
from custom_ops import env  # noqa: E402

SEQLENS = (40, 1, 27, 70, 13, 9, 33, 50, 6, 21, 64, 2, 17, 45, 30, 11, 58, 3, 24, 38)
PRESETS = ("tiny", "slice4")


def build_model(preset: str = "tiny", vocab_size: int | None = None, seed: int = 0):
    """The recipe's seeded Qwen3-Next of ``preset`` (four layers, float32); ``tiny`` is
    examples/finetune_qwen3_next.py's model."""
    return build_recipe_model(model_config(preset, 4, vocab_size), seed)


def dataset(vocab_size: int, seed: int = 1) -> list[dict]:
    """Token sequences of mixed lengths, as a tokenised dataset's rows."""
    gen = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(1, vocab_size, (n,), generator=gen).tolist()} for n in SEQLENS]


class PackedBatches(torch.utils.data.Dataset):
    """The recipe's synthetic batches as rows: row ``i`` holds the ``sequences`` of one replica's
    micro-batch. Read in order, dp rank ``r`` gets rows ``r, r + dp, ...``, so its micro-batch
    ``a`` of optimizer step ``s`` (from 0) is shard ``r * grad_accum + a`` of the recipe's step
    ``s + 1`` with ``--batch-shards dp * grad_accum``: ``tokens_per_step`` real tokens a step in all."""

    def __init__(self, tokens_per_step: int, max_seqs: int, vocab_size: int, steps: int, dp: int, grad_accum: int,
                 seed: int = 0):  # fmt: skip
        shards = dp * grad_accum
        if tokens_per_step % shards or tokens_per_step // shards <= max_seqs or max_seqs < 1:
            raise ValueError(
                f"--tokens-per-step {tokens_per_step} must split evenly into dp x grad-accum = {shards} micro-batches "
                f"of more than --max-seqs {max_seqs} (>= 1) tokens each"
            )
        self.batches = TokenStream(tokens_per_step // shards, max_seqs, vocab_size, seed)
        self.steps, self.dp, self.grad_accum = steps, dp, grad_accum

    def __len__(self) -> int:
        return self.steps * self.dp * self.grad_accum

    def __getitem__(self, i: int) -> dict:
        micro, dp_rank = divmod(i, self.dp)
        step, accum = divmod(micro, self.grad_accum)
        return {"sequences": [s.tolist() for s in self.batches.sequences(step + 1, dp_rank * self.grad_accum + accum)]}


class SequencesCollator:
    """Rows of :class:`PackedBatches` to the packing ``collator``: their sequences, each a feature."""

    def __init__(self, collator):
        self.collator = collator

    def __call__(self, rows: list[dict]):
        return self.collator([{"input_ids": seq} for row in rows for seq in row["sequences"]])


def tokenizer(vocab_size: int):
    """A word-level tokenizer over the model's vocabulary (TRL needs one, with a padding token)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, **{f"t{i}": i for i in range(1, vocab_size)}}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<pad>")),
                                   pad_token="<pad>", eos_token="<pad>")  # fmt: skip


def trainer_arguments(kind: str, out: str, steps: int, lr: float, grad_accum: int, batch_size: int, save_steps: int,
                      **extra):  # fmt: skip
    """The arguments both trainers take (``extra``: further ``TrainingArguments``), and TRL's
    packing for ``kind == "sft"``."""
    common = dict(
        output_dir=out, max_steps=steps, per_device_train_batch_size=batch_size,
        gradient_accumulation_steps=grad_accum, learning_rate=lr, lr_scheduler_type="constant", warmup_steps=0,
        logging_steps=1, report_to="none", disable_tqdm=True, train_sampling_strategy="sequential",
        save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500,
        use_cpu=not torch.cuda.is_available(), dataloader_drop_last=True, seed=0, data_seed=0,
    )  # fmt: skip
    common.update(extra)
    if kind == "hf":
        from transformers import TrainingArguments

        return TrainingArguments(**common)
    from trl import SFTConfig

    return SFTConfig(**common, packing=True, max_length=96, dataset_num_proc=None)


def _ranks() -> tuple[int, int]:
    """``(rank, world)`` of the running process group, ``(0, 1)`` without one."""
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


class StepLog(TrainerCallback):
    """Records every optimizer step: its loss (the Trainer's log), wall time from the step before's
    end (CUDA synchronised), the real tokens of the step over the dp replicas (the packed batches'
    ``cu_seq_lens_q``, which every CP rank of a replica holds alike: summed over the ranks,
    divided by ``cp``), tokens/s, and peak memory in GiB (``torch.cuda.max_memory_allocated``; on
    the CPU the host's peak RSS), the largest over ranks.
    At the end of training rank 0 writes them to ``path`` as the recipe's ``--log-json`` does:
    ``{"settings", "world", "device", "torch", "steps": [{step, loss, step_ms, tokens, tokens_per_s,
    peak_mem_gib}], "summary"}``."""

    def __init__(self, model: torch.nn.Module, cp: int, path: str | None, settings: dict):
        self.cp, self.path, self.settings = cp, path, settings
        self.tokens, self.steps, self.losses, self.last = 0, [], {}, None
        model.register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, module, args, kwargs):
        cu = kwargs.get("cu_seq_lens_q")
        if cu is not None:
            self.tokens = self.tokens + cu[-1].to(torch.int64)  # on the device: no host sync per forward

    def _now(self, args) -> float:
        if args.device.type == "cuda":
            torch.cuda.synchronize(args.device)
        return time.perf_counter()

    def on_step_begin(self, args, state, control, **kwargs):
        if self.last is None:
            self.last = self._now(args)

    def on_step_end(self, args, state, control, **kwargs):
        now = self._now(args)
        peak = (torch.cuda.max_memory_allocated(args.device) / 2**30 if args.device.type == "cuda"
                else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)  # fmt: skip
        self.steps.append({"step": state.global_step, "step_ms": (now - self.last) * 1e3, "tokens": int(self.tokens),
                           "peak_mem_gib": peak})  # fmt: skip
        self.tokens, self.last = 0, now

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses[state.global_step] = logs["loss"]

    def on_train_end(self, args, state, control, **kwargs):
        tokens = torch.tensor([s["tokens"] for s in self.steps], dtype=torch.float64, device=args.device)
        peaks = torch.tensor([s["peak_mem_gib"] for s in self.steps], dtype=torch.float64, device=args.device)
        rank, world = _ranks()
        if world > 1:
            dist.all_reduce(tokens)
            dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
        for rec, n, peak in zip(self.steps, (tokens / self.cp).tolist(), peaks.tolist()):
            rec.update(tokens=round(n), peak_mem_gib=peak, loss=self.losses.get(rec["step"]))
            rec["tokens_per_s"] = rec["tokens"] / (rec["step_ms"] / 1e3)
        if rank == 0 and self.path:
            times = [s["step_ms"] for s in self.steps[1:]] or [s["step_ms"] for s in self.steps]
            log = {"settings": self.settings, "world": world, "torch": torch.__version__, "steps": self.steps,
                   "device": torch.cuda.get_device_name(args.device) if args.device.type == "cuda" else "cpu",
                   "summary": {"first_step_ms": self.steps[0]["step_ms"] if self.steps else None,
                               "median_step_ms": statistics.median(times) if times else None}}  # fmt: skip
            with open(self.path, "w") as f:
                json.dump(log, f, indent=1)


def make_trainer(kind: str, cp: int, out: str, steps: int = 5, lr: float = 1e-3, grad_accum: int = 2,
                 batch_size: int = 2, save_steps: int = 0, dtype: torch.dtype = torch.float32, preset: str = "tiny",
                 vocab_size: int | None = None, bf16: bool = False, loss: str = "unfused",
                 tokens_per_step: int | None = None, max_seqs: int = 8, device: str | None = None,
                 log_json: str | None = None, progress: bool = False):  # fmt: skip
    """A trainer for this process: CP over a (W / cp, cp) mesh of the running process group, or
    (no process group) one process with the unmodified trainer class; the model of ``preset`` in
    ``dtype``, trained in bf16 mixed precision with ``bf16``, its loss ``fused`` (never the logits)
    or not. ``tokens_per_step``: the recipe's synthetic batches (:class:`PackedBatches`, one row a
    replica's micro-batch: ``batch_size`` is ignored) instead of the 20 sequences. ``device``: "cuda"
    or "cpu" (default: CUDA where there is one). A :class:`StepLog` writes ``log_json``."""
    from transformers import DataCollatorWithFlattening, Trainer

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda":
        env.set_nvlink_multicast_off()  # before the Trainer's arguments start NCCL
    options = dict(use_cpu=device == "cpu", bf16=bf16, disable_tqdm=not progress)
    if tokens_per_step is not None:
        batch_size, options["remove_unused_columns"] = 1, False  # rows of sequences, which the model does not take
    args = trainer_arguments(kind, out, steps, lr, grad_accum, batch_size, save_steps, **options)  # starts the group
    world = dist.get_world_size() if dist.is_initialized() else 1
    cp = cp if world > 1 else 1  # one process: no CP
    if world % cp:
        raise ValueError(f"--cp {cp} does not divide the {world} ranks")
    dp = world // cp
    model = build_model(preset, vocab_size).to(dtype)
    vocab = model.config.vocab_size
    if tokens_per_step is not None:
        if kind != "hf":
            raise ValueError("--tokens-per-step needs --trainer hf (TRL packs its own dataset)")
        collator = SequencesCollator(DataCollatorWithFlattening())
        rows = PackedBatches(tokens_per_step, max_seqs, vocab, steps, dp, grad_accum)
    else:
        collator, rows = DataCollatorWithFlattening(), dataset(vocab)
    if kind == "hf":
        base, extra = Trainer, dict(data_collator=collator, train_dataset=rows)
    else:
        from datasets import Dataset
        from trl import SFTTrainer

        base = SFTTrainer
        model.config.router_aux_loss_coef = 0.0  # the model's MLPs are dense: no router loss
        extra = dict(train_dataset=Dataset.from_list(rows), processing_class=tokenizer(vocab))
    settings = dict(trainer=kind, preset=preset, vocab_size=vocab, cp=cp, dp=dp, steps=steps, lr=lr,
                    grad_accum=grad_accum, dtype="bf16" if bf16 else str(dtype).removeprefix("torch."), loss=loss,
                    tokens_per_step=tokens_per_step, max_seqs=max_seqs, device=device)  # fmt: skip
    extra["callbacks"] = [StepLog(model, cp, log_json, settings)]
    fused = loss == "fused"
    if world == 1:
        trainer = base(model=apply_context_parallel(model, fused_loss=fused), args=args, **extra)
        trainer.data_collator = ContextParallelCollator(trainer.data_collator, 1, 0)
        return trainer
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device, (dp, cp), mesh_dim_names=("dp", "cp"))
    apply_context_parallel(model, mesh["cp"], fused_loss=fused)
    if kind == "hf":
        return ContextParallelTrainer(model=model, args=args, cp_mesh=mesh, **extra)

    class ContextParallelSFTTrainer(ContextParallelMixin, base):
        pass

    return ContextParallelSFTTrainer(model=model, args=args, cp_mesh=mesh, **extra)


def train(kind: str, cp: int, out: str, **kwargs) -> tuple[list[dict], dict]:
    """Train; the logged ``loss`` and ``grad_norm`` of every step and the final state dict (on the CPU)."""
    trainer = make_trainer(kind, cp, out, **kwargs)
    trainer.train()
    logs = [{k: entry[k] for k in ("loss", "grad_norm")} for entry in trainer.state.log_history if "loss" in entry]
    model = trainer.accelerator.unwrap_model(trainer.model)
    return logs, {k: v.detach().cpu() for k, v in model.state_dict().items()}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trainer", choices=("hf", "sft"), default="hf",
                   help="transformers' Trainer or TRL's SFTTrainer")
    p.add_argument("--cp", type=int, default=2, help="CP ranks of each data-parallel group (under torchrun)")
    p.add_argument("--preset", choices=PRESETS, default="tiny",
                   help="the model: tiny, or slice4 (examples/train_qwen3_next.py's)")
    p.add_argument("--vocab-size", type=int, help="the vocabulary (default: the preset's)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="bfloat16: TrainingArguments(bf16=True), float32 weights under bf16 autocast")
    p.add_argument("--loss", choices=("fused", "unfused"), default="unfused",
                   help="fused: the loss from the hidden states and lm_head, never the logits")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tokens-per-step", type=int,
                   help="train on the recipe's synthetic batches of this many real tokens a step")
    p.add_argument("--max-seqs", type=int, default=8, help="with --tokens-per-step: most sequences a micro-batch")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--save-steps", type=int, default=0, help="save a checkpoint every N steps (0: none)")
    p.add_argument("--out", default="sft-qwen3-next", help="the trainer's output directory")
    p.add_argument("--log-json", help="rank 0 writes every step's loss, time, tokens and peak memory here")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=False,
                   help="the Trainer's progress bar")
    return p


def main(argv: list[str] | None = None) -> None:
    p = parser()
    args = p.parse_args(argv)
    if args.vocab_size is not None and args.vocab_size < 2:
        p.error(f"--vocab-size must be >= 2, got {args.vocab_size}")
    logs, state = train(args.trainer, args.cp, args.out, steps=args.steps, lr=args.lr, grad_accum=args.grad_accum,
                        save_steps=args.save_steps, preset=args.preset, vocab_size=args.vocab_size,
                        bf16=args.dtype == "bfloat16", loss=args.loss, tokens_per_step=args.tokens_per_step,
                        max_seqs=args.max_seqs, device=args.device, log_json=args.log_json,
                        progress=args.progress)  # fmt: skip
    if not dist.is_initialized() or dist.get_rank() == 0:
        for step, log in enumerate(logs, 1):
            print(f"step {step:3d}  loss {log['loss']:.5f}  grad norm {log['grad_norm']:.5f}")
        with open(os.path.join(args.out, "losses.json"), "w") as f:
            json.dump(logs, f)
        torch.save(state, os.path.join(args.out, "model.pt"))


if __name__ == "__main__":
    main()
