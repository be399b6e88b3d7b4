"""Fine-tune a small transformers Qwen3-Next with context parallelism on local CPU ranks.

    python examples/finetune_qwen3_next.py [--cp 2] [--steps 20] [--compile] [--out losses.json]

The model is ``Qwen3NextForCausalLM`` built from a ``Qwen3NextConfig``: four decoder layers
(three Gated DeltaNet, one gated attention, Qwen3-Next's 3:1 pattern, partial_rotary_factor
0.25), tiny widths, random weights, nothing downloaded. The data is one fixed batch of token
sequences of mixed lengths (a zero-length and a one-token one included), learnt by heart, so
the loss falls.

Each of the ``--cp`` ranks (gloo processes on the CPU, spawned here) builds the same model,
patches it with ``apply_context_parallel(model, group)``, takes its shard of the batch with
``shard_batch`` and runs the usual loop: ``model(**batch.model_inputs()).loss``, backward,
the sum of the gradients over the CP group (each rank's gradient is its share), AdamW. The
rank losses add up to the batch loss (``num_items_in_batch`` is the global label count).
``--cp 1`` runs the same loop in this process without CP (``group=None``), for comparison.
``--compile`` compiles every decoder layer with ``torch.compile(fullgraph=True)``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cp_ops import COMPILE_OPTIONS
from cp_ops.local_ranks import init_local_rank, leave_local_rank, local_rendezvous
from cp_ops.integrations.transformers import apply_context_parallel, shard_batch

SEQLENS = (40, 0, 1, 27, 70, 13)


def build_model(seed: int = 0):
    """A tiny random Qwen3-Next causal LM (float32)."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    config = Qwen3NextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=8, linear_value_head_dim=8,
        num_experts=0, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    return Qwen3NextForCausalLM(config)


def batch_sequences(vocab_size: int, seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=gen) for n in SEQLENS]


def train(rank: int, world: int, group, steps: int, lr: float, compile_layers: bool) -> list[float]:
    """The training loop on one rank; returns the batch loss of every step."""
    model = apply_context_parallel(build_model(), group)
    if compile_layers:
        for layer in model.model.layers:
            layer.compile(fullgraph=True, options=COMPILE_OPTIONS)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    inputs = shard_batch(batch_sequences(model.config.vocab_size), world, rank).model_inputs()
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = model(**inputs).loss  # this rank's share: its label tokens' loss / the batch's label count
        loss.backward()
        loss = loss.detach()
        if group is not None:
            dist.all_reduce(loss, group=group)
            for p in model.parameters():
                dist.all_reduce(p.grad, group=group)
        optimizer.step()
        losses.append(loss.item())
    return losses


def _rank_entry(rank: int, world: int, init_method: str, steps: int, lr: float, compile_layers: bool, path: str):
    init_local_rank(rank, world, init_method, "cpu")
    try:
        losses = train(rank, world, dist.group.WORLD, steps, lr, compile_layers)
        if rank == 0:
            with open(path, "w") as f:
                json.dump(losses, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    leave_local_rank()  # reached only when the rank succeeded


def run(cp: int = 2, steps: int = 20, lr: float = 3e-3, compile_layers: bool = False) -> list[float]:
    """The batch loss of every step, trained on ``cp`` local gloo ranks (1: one process, no CP).

    With ``cp > 1`` the ranks are processes started with the ``spawn`` method: a script calling
    this needs the usual ``if __name__ == "__main__":`` guard."""
    if cp == 1:
        return train(0, 1, None, steps, lr, compile_layers)
    with tempfile.TemporaryDirectory() as tmp, local_rendezvous() as init_method:
        path = os.path.join(tmp, "losses.json")
        mp.spawn(_rank_entry, args=(cp, init_method, steps, lr, compile_layers, path), nprocs=cp, join=True)
        with open(path) as f:
            return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cp", type=int, default=2, help="CP ranks (gloo processes); 1: one process, no CP")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--compile", action="store_true", help="torch.compile(fullgraph=True) every decoder layer")
    parser.add_argument("--out", help="write the losses to this JSON file")
    args = parser.parse_args()
    losses = run(args.cp, args.steps, args.lr, args.compile)
    for step, loss in enumerate(losses, 1):
        print(f"step {step:3d}  loss {loss:.5f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(losses, f)


if __name__ == "__main__":
    main()
