"""Train transformers' Qwen3-Next with context parallelism (CP) and FSDP2, under torchrun.

    torchrun --nproc-per-node 4 examples/train_qwen3_next.py --preset slice4 --dp 1 --cp 4 --compile
    torchrun --nproc-per-node 2 examples/train_qwen3_next.py --preset tiny --device cpu --cp 2

The W = dp x cp ranks form a 2-D DeviceMesh ("dp", "cp"). Every decoder layer's Gated DeltaNet
and attention run CP over mesh["cp"] (cp_ops.integrations.transformers.apply_context_parallel);
FSDP2 shards every decoder layer and the root over the flattened dp x cp mesh and reduces the
gradients over it. Each dp replica trains on its own packed batch of --tokens-per-step / dp real
tokens, each cp rank on its shard of it (shard_batch, static shapes). docs/training.md explains
the mesh, the gradient scaling, the checkpoint and data formats, fault tolerance (torchrun
--max-restarts with --resume auto), non-finite steps, static shapes and CUDA graphs.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import math
import os
import re
import resource
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from cp_ops.layout import static_num_tokens
from cp_ops.local_ranks import host_threads
from custom_ops import env

PRESETS = ("tiny", "slice4", "qwen3-next-80b")
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0}  # dense bf16, per GPU
ADAMW = dict(betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
# the steps --profile records, counted from the first step of the run (compiled, warm)
PROFILE_STEPS = range(4, 6)
# what a checkpoint must agree on to be resumed: the model, the data stream and the optimiser
RESUME_KEYS = ("preset", "num_layers", "dp", "cp", "tokens_per_step", "max_seqs", "batch_shards", "seed", "dtype", "lr",
               "data")
# a complete checkpoint's folder; a save writes "<name>.partial" and renames it when complete
CHECKPOINT_NAME = re.compile(r"step-(\d{8})")
# what --fault injects, for the fault-tolerance tests: the process killed (SIGKILL) as the step
# starts, or as the checkpoint of the step has its shards written but is not complete yet; or the
# rank's loss of the step made NaN
FAULT_KINDS = ("kill", "kill-in-save", "nan")
# how long a rank other than 0 that refuses the command line waits for torchrun to stop it, once
# rank 0 has printed the error and exited, before it prints the error itself (an error of its own)
REFUSAL_WAIT_S = 30.0


# --- the command line -------------------------------------------------------------------------


class Parser(argparse.ArgumentParser):
    """argparse's parser, raising ``ValueError`` for a bad command line instead of printing it and
    exiting: :func:`main` reports it once for all ranks."""

    def error(self, message: str):
        raise ValueError(message)


def flag(default=None, **argparse_kw):
    """A :class:`TrainConfig` field and its command-line flag (``num_layers``: ``--num-layers``),
    the field's default the flag's; ``argparse_kw`` go to ``add_argument``."""
    return field(default=default, metadata={"argparse": argparse_kw})


@dataclass(frozen=True)
class Fault:
    """A fault ``--fault`` injects (testing only): ``kind`` (one of :data:`FAULT_KINDS`) at
    ``step`` on global rank ``rank``, in torchrun's attempt ``attempt`` (0: the first run of the
    workers, n: after n restarts), so that the restarted job runs on."""

    kind: str
    step: int
    rank: int
    attempt: int = 0


@dataclass(frozen=True)
class TrainConfig:
    """The recipe's settings, one field per command-line flag, built and checked once by
    :meth:`from_args`: the fields left None there (``dp``, ``num_layers``, ``tokens_per_step``,
    ``batch_shards``) are filled in, ``fault`` holds the parsed faults and ``resume_from`` the
    checkpoint ``--resume`` names (None: the run starts from step 1)."""

    preset: str = flag("tiny", choices=PRESETS)
    num_layers: int | None = flag(type=int, help="decoder layers, in the 3:1 linear / full attention pattern")
    vocab_size: int | None = flag(type=int, help="the vocabulary (default: the preset's; Qwen3-Next's is 151936)")
    dp: int | None = flag(type=int, help="data-parallel replicas (default: world / cp)")
    cp: int = flag(1, type=int, help="context-parallel ranks per replica")
    device: str = flag("cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    steps: int = flag(20, type=int)
    tokens_per_step: int | None = flag(type=int, help="global real tokens per step")
    max_seqs: int = flag(8, type=int, help="static maximum number of sequences per batch shard")
    batch_shards: int | None = flag(
        type=int, help="shards of each step's global batch, split over the dp replicas (default: dp); the same "
                       "value gives every dp x cp layout the same data")  # fmt: skip
    lr: float = flag(3e-4, type=float)
    clip_grad_norm: float = flag(1.0, type=float, help="0: no clipping (the norm is still logged)")
    seed: int = flag(0, type=int)
    dtype: str = flag("bf16", choices=("bf16", "fp32"))
    compile: bool = flag(False, action="store_true", help="torch.compile(fullgraph=True) every decoder layer")
    ac: bool = flag(False, action="store_true", help="activation checkpointing per decoder layer")
    tiled_mlp: bool = flag(
        False, action="store_true",
        help="the MLPs over row tiles, saving only their input (cp_ops.integrations.tiled_mlp): for long sequences")  # fmt: skip
    loss: str = flag(
        "fused", choices=("fused", "unfused"),
        help="fused: the loss from the hidden states in row chunks, never the logits "
             "(custom_ops.linear_cross_entropy); unfused: transformers' loss over the whole logits")  # fmt: skip
    reshard_after_forward: str = flag(
        "always", choices=("always", "never"),
        help="FSDP2: free each layer's unsharded parameters after its forward (always: all-gathered again for "
             "the backward) or keep them until the backward (never: one all-gather a step)")  # fmt: skip
    cuda_graphs: bool = flag(False, action="store_true", help="CUDA graphs in the compiled layers (needs --compile)")
    gdn_cp: str = flag(
        "heads", choices=("heads", "states"),
        help="Gated DeltaNet CP: by heads (all-to-all; cp must divide the key heads) or by chunk states")  # fmt: skip
    data: str | None = flag(help="a .npy file of one 1-D integer array of token ids (default: synthetic)")
    checkpoint_dir: str | None = flag()
    save_every: int = flag(0, type=int, help="save a checkpoint every N steps (0: never)")
    resume: str | None = flag(
        nargs="?", const="latest",
        help="continue from checkpoint PATH; without a value from the latest complete one in --checkpoint-dir; "
             "'auto': from the latest if there is one, else from the start (a job that torchrun --max-restarts "
             "restarts)")  # fmt: skip
    nonfinite: str = flag(
        "stop", choices=("stop", "skip"),
        help="a step whose loss or gradient norm is not finite: its update is never applied; stop: the run stops "
             "with an error, skip: it goes on with the next step")  # fmt: skip
    log_json: str | None = flag(help="rank 0 writes the per-step log here")
    peak_tflops: float | None = flag(type=float, help="the device's peak for MFU (default: 989 on H100 / H200)")
    no_progress: bool = flag(False, action="store_true", help="no progress bar")
    profile: str | None = flag(
        metavar="DIR",
        help=f"profile the run's steps {PROFILE_STEPS.start}-{PROFILE_STEPS.stop - 1} (compiled, warm) and write "
             "each rank's op tables, by host and by GPU time, to DIR")  # fmt: skip
    dry_run: bool = flag(
        False, action="store_true",
        help="check the settings, write them and the model's configuration (to --log-json, else to stdout) and "
             "exit without training")  # fmt: skip
    fault: tuple[Fault, ...] = flag(
        (), action="append", metavar="KIND:STEP:RANK[:ATTEMPT]",
        help=f"testing only: inject a fault, one of {', '.join(FAULT_KINDS)}, at STEP on global rank RANK in "
             "torchrun's attempt ATTEMPT (default 0: the first; TORCHELASTIC_RESTART_COUNT)")  # fmt: skip
    resume_from: Path | None = None

    @classmethod
    def from_args(cls, argv: list[str] | None, world: int) -> TrainConfig:
        """The settings of a command line for ``world`` ranks: parsed, defaults filled in, checked;
        ``ValueError`` for a bad command line or inconsistent settings, before anything starts."""
        raw = vars(parser().parse_args(argv))
        return cls(**dict(raw, fault=tuple(raw["fault"]))).checked(world)

    def checked(self, world: int) -> TrainConfig:
        """These settings with the defaults that depend on others filled in; ``ValueError`` for
        inconsistent ones."""
        if self.cp < 1:
            raise ValueError(f"--cp must be >= 1, got {self.cp}")
        dp = world // self.cp if self.dp is None else self.dp
        if dp < 1 or dp * self.cp != world:
            raise ValueError(f"--dp {dp} x --cp {self.cp} must equal the world size {world} (torchrun's ranks)")
        num_layers = self.num_layers
        if num_layers is None:
            num_layers = {"tiny": 4, "slice4": 4, "qwen3-next-80b": 48}[self.preset]
        if num_layers < 1:
            raise ValueError(f"--num-layers must be >= 1, got {num_layers}")
        if self.vocab_size is not None and self.vocab_size < 2:
            raise ValueError(f"--vocab-size must be >= 2, got {self.vocab_size}")
        tokens = self.tokens_per_step
        if tokens is None:
            tokens = 256 * dp if self.preset == "tiny" else 32768
        shards = dp if self.batch_shards is None else self.batch_shards
        if shards < 1 or shards % dp:
            raise ValueError(f"--batch-shards {shards} must be a positive multiple of --dp {dp}")
        if tokens % shards or tokens // shards <= self.max_seqs or self.max_seqs < 1:
            raise ValueError(
                f"--tokens-per-step {tokens} must split evenly into --batch-shards {shards} shards of more than "
                f"--max-seqs {self.max_seqs} (>= 1) tokens each (a shard of one-token sequences has no label)"
            )
        faults = tuple(parse_fault(f) if isinstance(f, str) else f for f in self.fault)
        cfg = dataclasses.replace(self, dp=dp, num_layers=num_layers, tokens_per_step=tokens, batch_shards=shards,
                                  fault=faults)  # fmt: skip
        config = cfg.model_config()
        if config.linear_num_key_heads % cfg.cp or config.linear_num_value_heads % cfg.cp:
            raise ValueError(
                f"--cp {cfg.cp} must divide the Gated DeltaNet's {config.linear_num_key_heads} key and "
                f"{config.linear_num_value_heads} value heads (preset {cfg.preset})"
            )
        if cfg.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device is available (use --device cpu)")
        if cfg.profile and cfg.steps < PROFILE_STEPS.stop - 1:
            last = PROFILE_STEPS.stop - 1
            raise ValueError(f"--profile records steps {PROFILE_STEPS.start}-{last}: --steps must be at least {last}")
        if cfg.cuda_graphs and (not cfg.compile or cfg.device != "cuda"):
            raise ValueError("--cuda-graphs needs --compile and --device cuda")
        if (cfg.save_every or cfg.resume in ("latest", "auto")) and not cfg.checkpoint_dir:
            raise ValueError("--save-every and --resume need --checkpoint-dir (or --resume PATH)")
        if cfg.data:
            check_token_file(cfg.data, cfg.shard_tokens)
        resume_from = find_checkpoint(cfg) if cfg.resume else None
        if resume_from is not None:
            check_resume(resume_from, cfg)
        return dataclasses.replace(cfg, resume_from=resume_from)

    def model_config(self):
        """The ``Qwen3NextConfig`` these settings train (:func:`model_config`)."""
        return model_config(self.preset, self.num_layers, self.vocab_size)

    @property
    def shard_tokens(self) -> int:
        """The real tokens of one batch shard."""
        return self.tokens_per_step // self.batch_shards

    @property
    def replica_max_seqs(self) -> int:
        """The static maximum number of sequences of a replica's batch: its shards' together."""
        return self.max_seqs * (self.batch_shards // self.dp)

    def replica_shards(self, dp_rank: int) -> range:
        """The shards of each step's global batch that replica ``dp_rank`` trains on."""
        per = self.batch_shards // self.dp
        return range(dp_rank * per, (dp_rank + 1) * per)

    def resume_config(self) -> dict:
        """What a checkpoint must agree on to be resumed (:data:`RESUME_KEYS`)."""
        return {k: getattr(self, k) for k in RESUME_KEYS}


def parser() -> argparse.ArgumentParser:
    """The command line of :class:`TrainConfig`: a flag per field."""
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in dataclasses.fields(TrainConfig):
        if "argparse" in f.metadata:
            kw = f.metadata["argparse"]
            p.add_argument(f"--{f.name.replace('_', '-')}", default=[] if kw.get("action") == "append" else f.default,
                           **kw)  # fmt: skip
    return p


def parse_fault(spec: str) -> Fault:
    parts = spec.split(":")
    if len(parts) not in (3, 4) or parts[0] not in FAULT_KINDS or not all(p.isdigit() for p in parts[1:]):
        raise ValueError(f"--fault {spec!r}: expected KIND:STEP:RANK[:ATTEMPT], KIND one of {', '.join(FAULT_KINDS)}")
    return Fault(parts[0], *map(int, parts[1:]))


def fault_here(cfg: TrainConfig, kind: str, step: int, rank: int) -> bool:
    return Fault(kind, step, rank, env.torchrun_restart_count()) in cfg.fault


def inject_fault(cfg: TrainConfig, kind: str, step: int, rank: int) -> None:
    """Kill this process here (SIGKILL: no cleanup, as a crash) if ``--fault`` asks for it."""
    if fault_here(cfg, kind, step, rank):
        os.kill(os.getpid(), signal.SIGKILL)


# --- the model ----------------------------------------------------------------------------------


def model_config(preset: str, num_layers: int, vocab_size: int | None = None):
    """The ``Qwen3NextConfig`` of a preset with ``num_layers`` layers (every fourth full attention)
    and the preset's vocabulary or ``vocab_size``."""
    from transformers import Qwen3NextConfig

    layer_types = ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(num_layers)]
    common = dict(num_hidden_layers=num_layers, layer_types=layer_types, use_cache=False)
    rope = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}  # the checkpoints' values
    if preset == "tiny":
        return Qwen3NextConfig(
            vocab_size=vocab_size or 64, hidden_size=32, intermediate_size=64, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, linear_num_key_heads=4, linear_num_value_heads=8,
            linear_key_head_dim=8, linear_value_head_dim=8, num_experts=0,
            rope_parameters=dict(rope, rope_theta=1e4), **common,
        )  # fmt: skip
    if preset == "slice4":
        return Qwen3NextConfig(
            vocab_size=vocab_size or 32000, hidden_size=2048, intermediate_size=5632, num_attention_heads=16,
            num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
            linear_key_head_dim=128, linear_value_head_dim=128, num_experts=0, rope_parameters=rope, **common,
        )  # fmt: skip
    if preset == "qwen3-next-80b":
        # transformers' defaults are Qwen3-Next-80B-A3B; grouped GEMMs keep the experts compilable
        vocab = {"vocab_size": vocab_size} if vocab_size else {}
        return Qwen3NextConfig(rope_parameters=rope, experts_implementation="grouped_mm", **vocab, **common)
    raise ValueError(f"unknown preset {preset!r}; one of {PRESETS}")


def build_model(config, seed: int, device="cpu"):
    """A seeded ``Qwen3NextForCausalLM`` (float32) on ``device`` ("meta": no storage)."""
    from transformers import Qwen3NextForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        return Qwen3NextForCausalLM(config)


@torch.no_grad()
def init_meta_model(model, config, device, seed: int) -> None:
    """Storage on ``device`` and initial values for a model built on "meta" and sharded: every rank
    fills its own shards (transformers' initial distributions), the rotary tables are rebuilt."""
    from torch.distributed.tensor import DTensor

    model.to_empty(device=device)
    torch.manual_seed(seed * 65_537 + dist.get_rank() + 1)  # each rank's shards draw their own values
    std = config.initializer_range
    for name, p in model.named_parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        if name.endswith("A_log"):
            local.uniform_(0.01, 16).log_()
        elif name.endswith("dt_bias") or name.endswith("linear_attn.norm.weight"):
            local.fill_(1.0)
        elif p.dim() >= 2:
            local.normal_(0.0, std)
        else:
            local.zero_()  # the zero-centred RMSNorm weights (1 + weight) and biases
    with torch.device(device):
        model.model.rotary_emb = type(model.model.rotary_emb)(config=config)


def active_params(config) -> int:
    """Parameters a token passes through, without the input embedding (lm_head included): of the
    routed experts only ``num_experts_per_tok`` of ``num_experts``."""
    h, types = config.hidden_size, config.layer_types
    hk, hv, dk, dv = (config.linear_num_key_heads, config.linear_num_value_heads,
                      config.linear_key_head_dim, config.linear_value_head_dim)  # fmt: skip
    hq, hkv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    gdn = h * (2 * hk * dk + 2 * hv * dv + 2 * hv) + config.linear_conv_kernel_dim * (2 * hk * dk + hv * dv)
    gdn += 2 * hv + hv * dv * h + dv  # A_log, dt_bias, out_proj, the gated norm
    attn = h * (2 * hq * d + 2 * hkv * d) + hq * d * h + 2 * d  # q (with gate), k, v, o, q / k norms
    if config.num_experts:
        mlp = 3 * h * config.moe_intermediate_size * config.num_experts_per_tok
        mlp += 3 * h * config.shared_expert_intermediate_size + h * config.num_experts + h  # router, shared gate
    else:
        mlp = 3 * h * config.intermediate_size
    layers = sum(gdn if t == "linear_attention" else attn for t in types) + len(types) * (mlp + 2 * h)
    return layers + h + h * config.vocab_size  # final norm, lm_head


def count_flops_per_step(config, seqlens_per_shard: list[list[int]]) -> float:
    """Model FLOPs of one training step (forward + backward) over every batch shard's sequences:
    6 x :func:`active_params` per real token, plus causal softmax attention, 6 x Hq x D x L^2
    per sequence and full-attention layer (QK^T and PV, half of the square), plus the Gated
    DeltaNet's chunked recurrence, about 6 x Hv x (2 dk dv + C (dk + dv)) per token and linear
    layer (state update and read-out, the intra-chunk products; C = 64, the chunk size).
    """
    n_full = sum(t == "full_attention" for t in config.layer_types)
    n_linear = len(config.layer_types) - n_full
    hv, dk, dv = config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim
    tokens = sum(sum(lens) for lens in seqlens_per_shard)
    square = sum(n * n for lens in seqlens_per_shard for n in lens)
    flops = 6 * active_params(config) * tokens + 6 * n_full * config.num_attention_heads * config.head_dim * square
    return flops + 6 * n_linear * hv * (2 * dk * dv + 64 * (dk + dv)) * tokens


# --- the data -----------------------------------------------------------------------------------


def check_token_file(path: str, min_tokens: int = 0):
    """The token ids of a ``--data`` file, memory-mapped: a ``.npy`` holding one 1-D array of an
    integer dtype, of at least ``min_tokens`` (a batch shard's). ``ValueError`` for anything else."""
    import numpy as np

    if not path.endswith(".npy"):
        raise ValueError(f"--data {path}: expected a .npy file holding one 1-D integer array of token ids")
    try:
        tokens = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as err:
        raise ValueError(f"--data {path}: not a readable .npy array ({err})") from None
    if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
        raise ValueError(
            f"--data {path}: expected one 1-D integer array of token ids, got shape {tokens.shape} {tokens.dtype}"
        )
    if len(tokens) < min_tokens:
        raise ValueError(f"--data {path}: {len(tokens)} tokens, fewer than one batch shard ({min_tokens})")
    return tokens


class TokenStream:
    """The sequences of shard ``k`` of step ``s``'s global batch: a pure function of (seed, s, k),
    so a resumed run continues the same stream, and every dp x cp layout with the same number of
    shards (``--batch-shards``) trains on the same data. Between 1 and ``max_seqs`` sequences of
    random lengths adding up to ``tokens`` real tokens; their ids uniform over the vocabulary, or
    windows at random offsets of the ``--data`` file."""

    def __init__(self, tokens: int, max_seqs: int, vocab_size: int, seed: int, data: str | None = None):
        self.tokens, self.max_seqs, self.vocab_size, self.seed = tokens, max_seqs, vocab_size, seed
        self.data = check_token_file(data, tokens) if data else None

    def _lengths(self, step: int, shard: int) -> tuple[torch.Generator, list[int]]:
        gen = torch.Generator().manual_seed((self.seed * 1_000_003 + step) * 1_009 + shard)
        n = int(torch.randint(1, self.max_seqs + 1, (), generator=gen))
        cuts = (torch.randperm(self.tokens - 1, generator=gen)[: n - 1] + 1).sort().values.tolist()
        return gen, [b - a for a, b in zip([0] + cuts, cuts + [self.tokens])]

    def lengths(self, step: int, shard: int) -> list[int]:
        return self._lengths(step, shard)[1]

    def sequences(self, step: int, shard: int) -> list[torch.Tensor]:
        gen, lens = self._lengths(step, shard)
        if self.data is None:
            return [torch.randint(0, self.vocab_size, (n,), generator=gen) for n in lens]
        seqs = []
        for n in lens:
            start = int(torch.randint(0, len(self.data) - n + 1, (), generator=gen))
            seq = torch.from_numpy(self.data[start : start + n].astype("int64"))
            if len(seq) and (int(seq.min()) < 0 or int(seq.max()) >= self.vocab_size):
                raise ValueError(f"--data: token ids outside [0, {self.vocab_size}) near offset {start}")
            seqs.append(seq)
        return seqs


# --- setting up ---------------------------------------------------------------------------------


@dataclass
class Run:
    cfg: TrainConfig
    model_config: object  # the Qwen3NextConfig
    device: torch.device
    mesh: object
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    data: TokenStream
    num_tokens: int  # static padded rows of a replica's batch
    rank: int
    dp_rank: int
    cp_rank: int


def init_distributed(device_type: str) -> tuple[int, int, torch.device]:
    """Join torchrun's group (NCCL on CUDA, gloo on the CPU); ``(rank, world, device)``. A plain
    ``python`` run is a group of one, meeting at a file in a temporary directory.

    Under torchrun the group meets in torchrun's own store, which outlives a restart of the
    workers (``--max-restarts``): each attempt keeps its keys under a prefix of its own, or a
    restarted rank could read the addresses the ranks of the attempt before published."""
    ranks = env.torchrun_ranks()
    rank, world, local_rank, local_world = ranks or (0, 1, 0, 1)
    if ranks:
        store, rank, world = next(dist.rendezvous("env://"))
        store = dist.PrefixStore(f"attempt-{env.torchrun_restart_count()}", store)
        init = {"store": store, "rank": rank, "world_size": world}
    else:
        init = {"init_method": f"file://{tempfile.mkdtemp()}/store", "rank": 0, "world_size": 1}
    threads = host_threads(device_type, local_world)
    if threads is not None:
        torch.set_num_threads(threads)
    if device_type == "cuda":
        env.set_nvlink_multicast_off()
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, **init)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", **init)
    return rank, world, device


def import_integration_without_fla() -> None:
    """Import cp_ops' transformers integration with FLA (flash-linear-attention) hidden from
    transformers' Qwen3-Next module, which otherwise imports all of FLA to bind the functions that
    the patched layers replace. For runs on the CPU, whose ops take their torch path (FLA's Triton
    kernels run on a GPU or in Triton's interpreter only); FLA stays importable afterwards."""
    if "fla" in sys.modules or env.triton_interpret():
        return
    sys.modules["fla"] = None  # importing it fails: transformers binds its own torch functions
    try:
        import cp_ops.integrations.transformers  # noqa: F401
    finally:
        del sys.modules["fla"]


def flatten(mesh):
    """The dp x cp mesh as one dimension "dp_cp" (FSDP2's data-parallel mesh)."""
    return mesh["dp", "cp"]._flatten("dp_cp")  # private, but torchtitan's way on torch 2.11 and 2.13 alike


def setup(cfg: TrainConfig, rank: int, world: int, device: torch.device) -> Run:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from cp_ops import StatePassing
    from cp_ops.integrations.transformers import apply_context_parallel

    mesh = init_device_mesh(device.type, (cfg.dp, cfg.cp), mesh_dim_names=("dp", "cp"))
    config = cfg.model_config()
    on_meta = cfg.preset == "qwen3-next-80b"  # too large to build whole on every rank first
    model = build_model(config, cfg.seed, "meta" if on_meta else "cpu")
    # the patch changes no parameter and the CP layers read their weights inside the forward,
    # where FSDP2 has unsharded them; either order works, the patch comes first here
    gdn_cp = StatePassing() if cfg.gdn_cp == "states" else None
    apply_context_parallel(model, mesh["cp"] if cfg.cp > 1 else None, gdn_cp, fused_loss=cfg.loss == "fused")
    if cfg.tiled_mlp:
        from cp_ops.integrations.tiled_mlp import apply_tiled_mlp

        apply_tiled_mlp(model)
    for layer in model.model.layers:
        wrap_layer(layer, cfg)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    shard_kw = dict(mesh=flatten(mesh), **({"mp_policy": policy} if cfg.dtype == "bf16" else {}))
    # units in the order the backward finishes them: the output head's gradients are reduced
    # while the layers' backward runs; only the embedding's (the last) wait at the end
    fully_shard(model.model.embed_tokens, **shard_kw)
    for layer in model.model.layers:
        fully_shard(layer, reshard_after_forward=cfg.reshard_after_forward == "always", **shard_kw)
    fully_shard([model.model.norm, model.lm_head], **shard_kw)
    fully_shard(model, **shard_kw)
    if on_meta:
        init_meta_model(model, config, device, cfg.seed)
    model.train()
    # fused on the CPU too: it alone takes found_inf, which skips a non-finite step's update
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, fused=True, **ADAMW)
    data = TokenStream(cfg.shard_tokens, cfg.max_seqs, config.vocab_size, cfg.seed, cfg.data)
    num_tokens = static_num_tokens(cfg.tokens_per_step // cfg.dp, cfg.replica_max_seqs, cfg.cp)
    return Run(cfg, config, device, mesh, model, optimizer, data, num_tokens, rank, mesh["dp"].get_local_rank(),
               mesh["cp"].get_local_rank())  # fmt: skip


def wrap_layer(layer: torch.nn.Module, cfg: TrainConfig) -> None:
    """Activation checkpointing and compilation of one decoder layer's forward. The forward is
    replaced (not the module), so parameter names stay transformers' and FSDP2's hooks, which
    are not traceable, run eagerly around the compiled code."""
    import functools

    import cp_ops

    forward = layer.forward
    if cfg.ac:
        from torch.utils.checkpoint import checkpoint

        forward = functools.partial(checkpoint, forward, use_reentrant=False)
    if cfg.compile:
        options = dict(cp_ops.COMPILE_OPTIONS)
        if cfg.cuda_graphs:
            # mode="reduce-overhead" is triton.cudagraphs=True; it cannot be combined with options
            options["triton.cudagraphs"] = True
            forward = with_parameters_as_inputs(layer, forward, options)
        else:
            forward = torch.compile(forward, fullgraph=True, options=options)
    layer.forward = forward


def with_parameters_as_inputs(layer: torch.nn.Module, forward, options: dict):
    """``forward`` compiled with the layer's parameters passed as graph inputs (views, not
    ``nn.Parameter``). Inductor's CUDA graphs take parameters for static inputs and record the
    graph again whenever one moves, which FSDP2's unsharded parameters do every step; inputs
    are copied into the graph's buffers instead, a few hundred MB a step at most."""
    from torch.nn.utils.stateless import _reparametrize_module

    def run(params: dict, *args, **kwargs):
        with _reparametrize_module(layer, params):
            return forward(*args, **kwargs)

    compiled = torch.compile(run, fullgraph=True, options=options)

    def call(*args, **kwargs):
        return compiled({name: p.view_as(p) for name, p in layer.named_parameters()}, *args, **kwargs)

    return call


# --- the step -----------------------------------------------------------------------------------


def replica_batch(run: Run, step: int):
    """This rank's static-shape shard of its dp replica's batch of ``step``, on the host."""
    from cp_ops.integrations.transformers import shard_batch

    seqs = [seq for k in run.cfg.replica_shards(run.dp_rank) for seq in run.data.sequences(step, k)]
    return shard_batch(seqs, run.cfg.cp, run.cp_rank, num_tokens=run.num_tokens,
                       max_sequences=run.cfg.replica_max_seqs)  # fmt: skip


class Staging:
    """Page-locked host buffers, two sets reused in turn, for the batches on their way to the GPU
    and the step results on their way back: no step allocates page-locked memory (an allocation
    can wait for the device), and a set is written again only once the copy that last read it has
    run. On the CPU, plain copies."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.batches: list = [None, None]  # (pinned tensors by field name, event after their copy)
        self.results = [torch.empty(2, pin_memory=True) for _ in range(2)] if self.cuda else None

    def batch_to_device(self, step: int, batch):
        """``batch`` (a static-shape ShardedBatch on the host) on the device, the copy queued."""
        if not self.cuda:
            return batch.to(self.device)
        names = [f.name for f in dataclasses.fields(batch) if isinstance(getattr(batch, f.name), torch.Tensor)]
        buffers, copied = self.batches[step % 2] or ({n: torch.empty_like(getattr(batch, n), pin_memory=True)
                                                      for n in names}, None)  # fmt: skip
        if copied is not None:
            copied.synchronize()  # a copy queued behind the step two back: run or about to
        for name in names:
            buffers[name].copy_(getattr(batch, name))
        moved = dataclasses.replace(batch, **{n: buffers[n].to(self.device, non_blocking=True) for n in names})
        event = torch.cuda.Event()
        event.record()
        self.batches[step % 2] = (buffers, event)
        return moved

    def result_to_host(self, step: int, values: torch.Tensor):
        """``values`` on their way to the host, and the event after their copy (None on the CPU)."""
        if not self.cuda:
            return values, None
        out = self.results[step % 2]
        out.copy_(values, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return out, done


class Clock:
    """Points on the device's timeline: CUDA events on a GPU, the host's clock on the CPU (whose
    ops have run when they return)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def ms(self, begin, end) -> float:
        """Milliseconds between two marks; waits for ``end`` on a GPU."""
        if not self.cuda:
            return (end - begin) * 1e3
        end.synchronize()
        return begin.elapsed_time(end)


@dataclass
class IssuedStep:
    """A step whose work is queued and whose results are read later (:func:`read_step`), so that
    the host issues the next step while the GPU runs this one."""

    step: int
    values: torch.Tensor  # [the replica-summed loss, the gradient norm]; on the host once `done` has passed
    done: object  # a CUDA event after the copy of `values`, None on the CPU
    start: object  # Clock marks around the step's work
    end: object
    host_ms: float
    cudagraph_recordings: int


def issue_step(run: Run, step: int, batch, clock: Clock, staging: Staging, recordings: Callable[[], int]) -> IssuedStep:
    """Queue one optimizer step on ``batch`` (this rank's shard); nothing in it waits for the GPU."""
    model, cfg = run.model, run.cfg
    recorded = recordings()
    if cfg.cuda_graphs:
        torch.compiler.cudagraph_mark_step_begin()
    t0 = time.perf_counter()
    start = clock.mark()
    loss = model(**batch.model_inputs()).loss  # this cp rank's share of its replica's batch loss
    if fault_here(cfg, "nan", step, run.rank):
        loss = loss * float("nan")
    # FSDP2 averages gradients over all dp x cp ranks; the cp shares must add up instead, so each
    # is scaled by cp: mean over (dp, cp) of cp x share = mean over dp of the replica gradients
    (loss * cfg.cp).backward()
    norm = clip_gradients(model, cfg.clip_grad_norm)
    total = loss.detach().float().reshape(1)
    dist.all_reduce(total)  # the sum of every rank's share = dp x the replica-mean loss
    values = torch.cat([total, norm.detach().float().reshape(1)])
    # the fused AdamW skips its whole update (moments and step count included) where found_inf
    # is 1, on the device: no rank waits for the check, and every rank decides alike (the loss
    # and the norm are reduced over all of them)
    run.optimizer.found_inf = (~torch.isfinite(values)).any().float()
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    end = clock.mark()
    host_ms = (time.perf_counter() - t0) * 1e3
    # read back later through an event: .item() would wait for everything queued after it
    values, done = staging.result_to_host(step, values)
    return IssuedStep(step, values, done, start, end, host_ms, recordings() - recorded)


def read_step(run: Run, issued: IssuedStep, clock: Clock, previous_end=None) -> dict:
    """The log record of an issued step, once its work is done: the replica-mean loss, the gradient
    norm, whether the update was skipped (either not finite), the timings and the wall-clock time.
    ``step_ms`` is the time from ``previous_end`` (the step before's end, when only steps ran in
    between) to this step's end: the step's share of a run that keeps the device busy; without
    ``previous_end`` from the step's own start (the first step: with compilation)."""
    waited = time.perf_counter()
    if issued.done is not None:
        issued.done.synchronize()
    wait_ms = (time.perf_counter() - waited) * 1e3  # the host's lead over the device at this point
    loss, norm = issued.values.tolist()
    step_ms = clock.ms(issued.start if previous_end is None else previous_end, issued.end)
    return dict(
        step=issued.step, loss=loss / run.cfg.dp, grad_norm=norm, skipped=not math.isfinite(loss + norm),
        tokens=run.cfg.tokens_per_step, step_ms=step_ms, host_ms=issued.host_ms,
        gpu_ms=clock.ms(issued.start, issued.end) if clock.cuda else None, wait_ms=wait_ms,
        cudagraph_recordings=issued.cudagraph_recordings, time=time.time(),
    )  # fmt: skip


def clip_gradients(model: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """The gradients' global norm (over every rank's shards), and clipping to ``max_norm`` (0: none)."""
    from torch.distributed.tensor import DTensor

    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    norm = norm.full_tensor() if isinstance(norm, DTensor) else norm  # the shards' partial norms reduced
    if max_norm:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


# --- checkpoints --------------------------------------------------------------------------------


def checkpoint_path(root: str, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def save_checkpoint(run: Run, step: int) -> Path:
    """``DIR/step-NNNNNNNN/``: the model and optimizer (torch.distributed.checkpoint, sharded,
    loadable at another world size) and ``recipe.json`` (step, settings). Written as
    ``step-NNNNNNNN.partial/`` and renamed once complete, so a crash while saving leaves the
    checkpoints before it as they were and no folder that passes for complete."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    path = checkpoint_path(run.cfg.checkpoint_dir, step)
    partial = path.with_name(f"{path.name}.partial")
    if run.rank == 0 and partial.exists():
        shutil.rmtree(partial)  # left by a crash during an earlier save of this step
    dist.barrier()
    model_sd, optim_sd = get_state_dict(run.model, run.optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(partial))
    inject_fault(run.cfg, "kill-in-save", step, run.rank)
    dist.barrier()
    if run.rank == 0:
        meta = {"format": 1, "step": step, "config": run.cfg.resume_config(), "model": run.model_config.to_dict()}
        with open(partial / "recipe.json", "w") as f:
            f.write(json.dumps(meta, indent=1, default=str))
            f.flush()
            os.fsync(f.fileno())
        replace_folder(partial, path)
    dist.barrier()
    return path


def replace_folder(src: Path, dst: Path) -> None:
    """Rename ``src`` to ``dst``; a ``dst`` already there (a checkpoint of the same step from an
    earlier run) is moved aside first and deleted after."""
    old = dst.with_name(f"{dst.name}.old")
    if dst.exists():
        if old.exists():
            shutil.rmtree(old)
        os.replace(dst, old)
    os.replace(src, dst)
    if old.exists():
        shutil.rmtree(old)


def complete_checkpoints(root: str) -> list[Path]:
    """The complete checkpoints in ``root`` (``step-NNNNNNNN/`` with ``recipe.json``), oldest first."""
    folder = Path(root)
    found = [p for p in folder.iterdir() if CHECKPOINT_NAME.fullmatch(p.name)] if folder.is_dir() else []
    return sorted(p for p in found if (p / "recipe.json").is_file())


def find_checkpoint(cfg: TrainConfig) -> Path | None:
    """The checkpoint ``--resume`` names: PATH, or the latest complete one in --checkpoint-dir
    (``auto``: None where there is none). ``ValueError`` for a path that is missing or not a
    complete checkpoint."""
    if cfg.resume in ("latest", "auto"):
        done = complete_checkpoints(cfg.checkpoint_dir)
        if done:
            return done[-1]
        if cfg.resume == "auto":
            return None
        raise ValueError(f"--resume: no complete checkpoint (step-*/recipe.json) in {cfg.checkpoint_dir}")
    path = Path(cfg.resume)
    if not path.is_dir():
        raise ValueError(f"--resume {path}: no such directory")
    if not (path / "recipe.json").is_file():
        raise ValueError(f"--resume {path}: not a complete checkpoint of this recipe (no recipe.json)")
    return path


def check_resume(path: Path, cfg: TrainConfig) -> int:
    """The step a checkpoint was saved at; ``ValueError`` naming every setting that differs."""
    meta = json.loads((path / "recipe.json").read_text())
    saved, now = meta["config"], cfg.resume_config()
    diff = [f"--{k.replace('_', '-')} {saved.get(k)!r} -> {now[k]!r}" for k in RESUME_KEYS if saved.get(k) != now[k]]
    if diff:
        raise ValueError(f"--resume {path}: the checkpoint was trained with other settings: {'; '.join(diff)}")
    return int(meta["step"])


def load_checkpoint(run: Run, path: Path) -> int:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    step = check_resume(path, run.cfg)
    model_sd, optim_sd = get_state_dict(run.model, run.optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(run.model, run.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return step


# --- the loop -----------------------------------------------------------------------------------


def peak_tflops(cfg: TrainConfig, device: torch.device) -> float | None:
    if cfg.peak_tflops:
        return cfg.peak_tflops
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
    return None


def train(cfg: TrainConfig, rank: int, world: int, device: torch.device) -> dict:
    from torch._dynamo.utils import counters

    run = setup(cfg, rank, world, device)
    start = load_checkpoint(run, cfg.resume_from) if cfg.resume_from else 0
    peak = peak_tflops(cfg, device)
    log = {"settings": dataclasses.asdict(cfg), "world": world, "device": str(torch.cuda.get_device_name(device))
           if device.type == "cuda" else "cpu", "torch": torch.__version__, "num_tokens": run.num_tokens,
           "resumed_from": start, "steps": [], "restarts": []}  # fmt: skip
    if start:
        log["steps"], log["restarts"] = earlier_attempts(cfg, start)
    if rank == 0:
        params = sum(p.numel() for p in run.model.parameters())  # the DTensors' global sizes
        print(f"[train] world {world} = dp {cfg.dp} x cp {cfg.cp} on {log['device']}; {cfg.preset}, "
              f"{cfg.num_layers} layers, {params / 1e6:.1f}M parameters ({active_params(run.model_config) / 1e6:.1f}M "
              f"active, non-embedding); {cfg.tokens_per_step} tokens per step, {run.num_tokens} rows per replica "
              f"batch; steps {start + 1}..{cfg.steps}" + (" (the first compiles)" if cfg.compile else ""),
              flush=True)  # fmt: skip
    bar = None
    if rank == 0 and not cfg.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=cfg.steps, initial=start, desc=f"train dp={cfg.dp} cp={cfg.cp}", file=sys.stdout)
    graphs_after_first = None
    profiler = None
    clock = Clock(device)
    first, last = start + 1, cfg.steps

    def synced(step: int) -> bool:
        """Whether ``step`` is read back before the next is issued: the first (compilation), the one
        before the profiled steps and the last of them, a checkpoint's, the run's last."""
        profiled = cfg.profile and step - start in (PROFILE_STEPS.start - 1, PROFILE_STEPS.stop - 1)
        return step in (first, last) or bool(profiled) or bool(cfg.save_every and step % cfg.save_every == 0)

    def finish(issued: IssuedStep, previous_end) -> None:
        nonlocal graphs_after_first
        rec = read_step(run, issued, clock, previous_end)
        step = rec["step"]
        rec["tokens_per_s"] = rec["tokens"] / (rec["step_ms"] / 1e3)
        rec["lengths"] = [run.data.lengths(step, k) for k in range(cfg.batch_shards)]  # the step's packing
        flops = count_flops_per_step(run.model_config, rec["lengths"])
        rec["mfu"] = flops / (rec["step_ms"] / 1e3) / (world * peak * 1e12) if peak else None
        # this rank's peak so far; the largest over ranks replaces it at the end of the run (a
        # collective here would wait for the step issued after this one)
        rec["peak_mem_gib"] = (torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda"
                               else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)  # host RSS
        if graphs_after_first is None:
            graphs_after_first = counters["stats"]["unique_graphs"]
        log["steps"].append(rec)
        if bar:
            bar.set_postfix(loss=f"{rec['loss']:.4f}", tok_s=f"{rec['tokens_per_s']:.0f}", ms=f"{rec['step_ms']:.0f}")
            bar.update()
        if rank == 0 and cfg.log_json:
            write_log(log, cfg.log_json)
        if rec["skipped"]:
            what = f"step {step}: loss {rec['loss']}, gradient norm {rec['grad_norm']}; its update was not applied"
            if cfg.nonfinite == "stop":
                raise NonFiniteStep(f"{what}. The run stops (--nonfinite skip would go on with the next step)")
            if rank == 0:
                print(f"[train] {what} (--nonfinite skip)", flush=True)

    # One step in flight: the host builds the next batch and issues the next step while the
    # device runs this one, then reads this one back (a run that reads every step at once
    # leaves the device idle while the host starts the next).
    with cudagraph_recordings() as recordings:
        staging = Staging(device)
        batch = staging.batch_to_device(first, replica_batch(run, first)) if first <= last else None
        pending = None  # (the issued step not read yet, the end of the step before it or None)
        previous_end = None
        for step in range(first, last + 1):
            inject_fault(cfg, "kill", step, rank)
            if cfg.profile and step - start == PROFILE_STEPS.start:
                profiler = start_profiler()
            issued = issue_step(run, step, batch, clock, staging, recordings)
            if step < last:
                batch = staging.batch_to_device(step + 1, replica_batch(run, step + 1))
            if pending:
                finish(*pending)
            pending = (issued, previous_end)
            previous_end = issued.end
            if synced(step):
                finish(*pending)
                pending, previous_end = None, None
                if profiler and step - start == PROFILE_STEPS.stop - 1:
                    write_profile(profiler, cfg.profile, rank)
                    profiler = None
                if cfg.save_every and step % cfg.save_every == 0:
                    save_checkpoint(run, step)
    if device.type == "cuda" and log["steps"]:
        peaks = torch.tensor([r["peak_mem_gib"] for r in log["steps"]], device=device)
        dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
        for rec, value in zip(log["steps"], peaks.tolist()):
            rec["peak_mem_gib"] = value
    if bar:
        bar.close()
    log["graphs"] = counters["stats"]["unique_graphs"]
    log["recompiles"] = log["graphs"] - graphs_after_first if graphs_after_first is not None else 0
    log["cudagraph_skips"] = counters["inductor"]["cudagraph_skips"]  # graphs that run without CUDA graphs
    times = [r["step_ms"] for r in log["steps"][1:]] or [r["step_ms"] for r in log["steps"]]
    log["summary"] = {"first_step_ms": log["steps"][0]["step_ms"] if log["steps"] else None,
                      "median_step_ms": statistics.median(times) if times else None}  # fmt: skip
    if rank == 0:
        if cfg.log_json:
            write_log(log, cfg.log_json)
        if cfg.compile:
            skips = (f", CUDA graphs recorded per step: {[r['cudagraph_recordings'] for r in log['steps']]}, "
                     f"skipped: {log['cudagraph_skips']}" if cfg.cuda_graphs else "")  # fmt: skip
            print(f"[train] compiled graphs: {log['graphs']}, recompiles after the first step: {log['recompiles']}"
                  + skips)  # fmt: skip
        if log["steps"]:
            last = log["steps"][-1]
            median = log["summary"]["median_step_ms"]
            print(f"[train] step {last['step']}: loss {last['loss']:.4f}, median step {median:.1f} ms, "
                  f"{last['tokens_per_s']:.0f} tokens/s, peak memory {last['peak_mem_gib']:.2f} GiB")  # fmt: skip
    return log


@contextlib.contextmanager
def cudagraph_recordings() -> Iterator[Callable[[], int]]:
    """A count of the CUDA graphs Inductor records inside the block (a replay for a new packing
    records none)."""
    from torch._dynamo.callback import CallbackTrigger, callback_handler

    count = [0]

    def on_start(event) -> None:
        count[0] += event.callback_trigger == CallbackTrigger.CUDAGRAPH_RECORDING

    callback_handler.register_start_callback(on_start)
    try:
        yield lambda: count[0]
    finally:
        callback_handler.remove_start_callback(on_start)


def start_profiler():
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    profiler = profile(activities=activities)
    profiler.start()
    return profiler


def write_profile(profiler, folder: str, rank: int) -> None:
    """Stop ``profiler`` and write its op tables, by host and by GPU time, to ``folder/rank<R>.txt``
    and its device timeline, ``[name, start us, end us]`` of every kernel, copy and memset of the
    profiled steps, to ``folder/rank<R>.kernels.json``."""
    from torch.autograd import DeviceType

    profiler.stop()
    events = profiler.key_averages()
    tables = [f"{sort}\n{events.table(sort_by=sort, row_limit=40)}"
              for sort in ("self_cpu_time_total", "cpu_time_total", "self_device_time_total")]  # fmt: skip
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"rank{rank}.txt"), "w") as f:
        f.write("\n\n".join(tables))
    kernels = [[e.name, e.time_range.start, e.time_range.end] for e in profiler.events()
               if e.device_type == DeviceType.CUDA and not e.is_user_annotation
               and e.time_range.end > e.time_range.start]  # fmt: skip
    with open(os.path.join(folder, f"rank{rank}.kernels.json"), "w") as f:
        json.dump({"steps": len(PROFILE_STEPS), "kernels": kernels}, f)


class NonFiniteStep(FloatingPointError):
    """A step's loss or gradient norm is not finite and ``--nonfinite stop`` is set."""


def earlier_attempts(cfg: TrainConfig, start: int) -> tuple[list[dict], list[dict]]:
    """What the ``--log-json`` an earlier run of these settings left says, for a run resumed from
    step ``start``: its records of steps 1 to ``start``, and its restarts with this one appended:
    ``resumed_from``, ``redone`` (its records of the steps after ``start``, which this run trains
    again) and ``lost_s`` (the wall-clock seconds from its step ``start`` to now, when this run is
    back there: the steps lost, the failure, the restart and the loading). Nothing where there is
    no such log."""
    try:
        with open(cfg.log_json) as f:
            old = json.load(f)
    except (TypeError, OSError, ValueError):  # no --log-json, no file, not a log
        return [], []
    settings = old.get("settings", {}) if isinstance(old, dict) else {}
    if {k: settings.get(k) for k in RESUME_KEYS} != json.loads(json.dumps(cfg.resume_config(), default=str)):
        return [], []
    steps = old.get("steps", [])
    at_start = [r for r in steps if r["step"] == start and "time" in r]
    restart = {"resumed_from": start, "redone": [r for r in steps if r["step"] > start],
               "lost_s": time.time() - at_start[0]["time"] if at_start else None}  # fmt: skip
    return [r for r in steps if r["step"] <= start], old.get("restarts", []) + [restart]


def write_log(log: dict, path: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(log, f, indent=1, default=str)
    os.replace(tmp, path)


def refuse(prog: str, message: str, rank: int):
    """Report a bad command line once and exit with status 2. Every rank of a torchrun job finds
    the same error; rank 0 prints it, the others wait for torchrun to stop them once rank 0 has
    exited, and print theirs only if that takes more than :data:`REFUSAL_WAIT_S` (an error of
    their own: a file missing on their node)."""
    if rank:
        time.sleep(REFUSAL_WAIT_S)
    print(f"{prog}: error{f' (rank {rank})' if rank else ''}: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def dry_run(cfg: TrainConfig, world: int) -> dict:
    """What ``--dry-run`` writes: the checked settings, the world size and the model's configuration."""
    return {"settings": dataclasses.asdict(cfg), "world": world, "model": cfg.model_config().to_dict()}


def main(argv: list[str] | None = None) -> None:
    rank, world = (env.torchrun_ranks() or (0, 1))[:2]
    try:
        cfg = TrainConfig.from_args(argv, world)
    except ValueError as err:
        refuse(parser().prog, str(err), rank)
    if cfg.dry_run:
        if rank == 0:
            if cfg.log_json:
                write_log(dry_run(cfg, world), cfg.log_json)
            else:
                print(json.dumps(dry_run(cfg, world), indent=1, default=str))
        return
    rank, world, device = init_distributed(cfg.device)
    if device.type == "cpu":
        import_integration_without_fla()
    try:
        train(cfg, rank, world, device)
        dist.barrier()
    except NonFiniteStep as err:
        # every rank stops at the same step; rank 0 says why before any of them exits
        if rank == 0:
            print(f"[train] {err}", file=sys.stderr, flush=True)
        dist.barrier()
        sys.exit(1)
    finally:
        if cfg.cuda_graphs:
            # recorded graphs keep the NCCL communicators they captured alive, which
            # destroy_process_group would then wait on
            torch.compiler.reset()
            gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
