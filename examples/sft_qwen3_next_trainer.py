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
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # finetune_qwen3_next, beside this script
from finetune_qwen3_next import build_model  # noqa: E402

from cp_ops.integrations.trainer import (  # noqa: E402
    ContextParallelCollator,
    ContextParallelMixin,
    ContextParallelTrainer,
)
from cp_ops.integrations.transformers import apply_context_parallel  # noqa: E402

SEQLENS = (40, 1, 27, 70, 13, 9, 33, 50, 6, 21, 64, 2, 17, 45, 30, 11, 58, 3, 24, 38)


def dataset(vocab_size: int, seed: int = 1) -> list[dict]:
    """Token sequences of mixed lengths, as a tokenised dataset's rows."""
    gen = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(1, vocab_size, (n,), generator=gen).tolist()} for n in SEQLENS]


def tokenizer(vocab_size: int):
    """A word-level tokenizer over the model's vocabulary (TRL needs one, with a padding token)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, **{f"t{i}": i for i in range(1, vocab_size)}}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<pad>")),
                                   pad_token="<pad>", eos_token="<pad>")  # fmt: skip


def trainer_arguments(kind: str, out: str, steps: int, lr: float, grad_accum: int, batch_size: int, save_steps: int):
    """The arguments both trainers take, and TRL's packing for ``kind == "sft"``."""
    common = dict(
        output_dir=out, max_steps=steps, per_device_train_batch_size=batch_size,
        gradient_accumulation_steps=grad_accum, learning_rate=lr, lr_scheduler_type="constant", warmup_steps=0,
        logging_steps=1, report_to="none", disable_tqdm=True, train_sampling_strategy="sequential",
        save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500,
        use_cpu=not torch.cuda.is_available(), dataloader_drop_last=True, seed=0, data_seed=0,
    )  # fmt: skip
    if kind == "hf":
        from transformers import TrainingArguments

        return TrainingArguments(**common)
    from trl import SFTConfig

    return SFTConfig(**common, packing=True, max_length=96, dataset_num_proc=None)


def make_trainer(kind: str, cp: int, out: str, steps: int = 5, lr: float = 1e-3, grad_accum: int = 2,
                 batch_size: int = 2, save_steps: int = 0, dtype: torch.dtype = torch.float32):  # fmt: skip
    """A trainer for this process: CP over a (W / cp, cp) mesh of the running process group, or
    (no process group) one process with the unmodified trainer class; the model in ``dtype``."""
    from transformers import DataCollatorWithFlattening, Trainer

    args = trainer_arguments(kind, out, steps, lr, grad_accum, batch_size, save_steps)  # starts torchrun's group
    world = dist.get_world_size() if dist.is_initialized() else 1
    model = build_model().to(dtype)
    rows = dataset(model.config.vocab_size)
    if kind == "hf":
        base, extra = Trainer, dict(data_collator=DataCollatorWithFlattening(), train_dataset=rows)
    else:
        from datasets import Dataset
        from trl import SFTTrainer

        base = SFTTrainer
        model.config.router_aux_loss_coef = 0.0  # the model's MLPs are dense: no router loss
        extra = dict(train_dataset=Dataset.from_list(rows), processing_class=tokenizer(model.config.vocab_size))
    if world == 1:
        trainer = base(model=apply_context_parallel(model), args=args, **extra)
        trainer.data_collator = ContextParallelCollator(trainer.data_collator, 1, 0)
        return trainer
    if world % cp:
        raise ValueError(f"--cp {cp} does not divide the {world} ranks")
    from torch.distributed.device_mesh import init_device_mesh

    device = "cuda" if torch.cuda.is_available() else "cpu"
    mesh = init_device_mesh(device, (world // cp, cp), mesh_dim_names=("dp", "cp"))
    apply_context_parallel(model, mesh["cp"])
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trainer", choices=("hf", "sft"), default="hf",
                        help="transformers' Trainer or TRL's SFTTrainer")
    parser.add_argument("--cp", type=int, default=2, help="CP ranks of each data-parallel group (under torchrun)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--grad-accum", type=int, default=2)
    parser.add_argument("--save-steps", type=int, default=0, help="save a checkpoint every N steps (0: none)")
    parser.add_argument("--out", default="sft-qwen3-next", help="the trainer's output directory")
    args = parser.parse_args()
    logs, state = train(args.trainer, args.cp, args.out, steps=args.steps, lr=args.lr, grad_accum=args.grad_accum,
                          save_steps=args.save_steps)  # fmt: skip
    if not dist.is_initialized() or dist.get_rank() == 0:
        for step, log in enumerate(logs, 1):
            print(f"step {step:3d}  loss {log['loss']:.5f}  grad norm {log['grad_norm']:.5f}")
        with open(os.path.join(args.out, "losses.json"), "w") as f:
            json.dump(logs, f)
        torch.save(state, os.path.join(args.out, "model.pt"))


if __name__ == "__main__":
    main()
