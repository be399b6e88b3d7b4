"""transformers' ``Trainer`` and TRL's ``SFTTrainer`` with context parallelism (CP) over a
(dp, cp) mesh, for a model patched with :func:`cp_ops.integrations.transformers.apply_context_parallel`.

Under torchrun, on every rank::

    args = TrainingArguments(...)                                    # starts the process group
    mesh = init_device_mesh(device, (dp, cp), mesh_dim_names=("dp", "cp"))
    model = apply_context_parallel(model, mesh["cp"])
    trainer = ContextParallelTrainer(model=model, args=args, cp_mesh=mesh,
                                     data_collator=DataCollatorWithFlattening(), train_dataset=...)
    trainer.train()

``ContextParallelMixin`` adds the same to another ``Trainer`` subclass (TRL's ``SFTTrainer``:
``class CPSFTTrainer(ContextParallelMixin, SFTTrainer)``). What it changes: docs/transformers.md.
"""

from __future__ import annotations

import torch

from cp_ops.integrations.transformers import (
    ContextParallelQwen3NextAttention,
    ContextParallelQwen3NextGatedDeltaNet,
    shard_labelled,
)
from cp_ops.layout import pack, shard_thd

try:
    from accelerate.data_loader import BatchSamplerShard, IterableDatasetShard
    from transformers import Trainer
except ImportError as err:  # pragma: no cover - exercised only without the extra installed
    raise ImportError(
        "cp_ops.integrations.trainer needs accelerate and transformers: pip install -e '.[hf,trainer]' "
        "in a clone of this repository"
    ) from err

__all__ = ["ContextParallelCollator", "ContextParallelMixin", "ContextParallelTrainer"]

_PADDING = (
    "pads instead of packing; context parallelism needs every batch packed in one row: "
    "transformers' DataCollatorWithFlattening, or TRL's SFTConfig(padding_free=True) / packing=True"
)


def _sequence_starts(batch: dict, num_tokens: int) -> torch.Tensor:
    """The packed row's sequence boundaries ``[0, ..., T]`` (int64) from ``cu_seq_lens_q`` or,
    without them, from ``position_ids`` (a sequence starts at each position 0)."""
    cu = batch.get("cu_seq_lens_q")
    if cu is not None:
        cu = torch.as_tensor(cu).to(torch.int64).flatten()
        if cu.numel() < 2 or cu[0] != 0 or cu[-1] != num_tokens or bool((cu.diff() < 0).any()):
            raise ValueError(f"cu_seq_lens_q must run from 0 to the {num_tokens} packed tokens, got {cu.tolist()}")
        return cu
    positions = batch.get("position_ids")
    if positions is None:
        return torch.tensor([0, num_tokens])  # one sequence
    starts = (torch.as_tensor(positions).flatten() == 0).nonzero().flatten().to(torch.int64)
    if num_tokens and (starts.numel() == 0 or starts[0] != 0):
        raise ValueError("position_ids of a packed row must start at 0")
    return torch.cat([starts, torch.tensor([num_tokens])])


class ContextParallelCollator:
    """Wraps a packing collator: its packed row ``input_ids [1, T]`` (with ``labels``, and the
    boundaries as ``cu_seq_lens_q`` or ``position_ids``) becomes CP rank ``cp_rank``'s shard.

    The labels are shifted within each sequence (``-100`` at its last token), each sequence is
    padded to a multiple of ``2 * cp_size`` (``pad_token_id``; labels ``-100``) and the tokens
    and labels are sharded into a :class:`~cp_ops.integrations.transformers.ShardedBatch`
    (:func:`~cp_ops.integrations.transformers.shard_labelled`), the positions alike. Returns its
    model inputs but ``num_items_in_batch`` (the Trainer counts the label tokens of the whole
    accumulated batch itself): ``input_ids``, ``labels`` (= ``shift_labels``), ``shift_labels``
    ``[1, T/W]`` and ``cu_seq_lens_q`` = ``cu_seq_lens_k`` (int32, the global real lengths), with
    ``position_ids`` ``[1, T/W]``; other keys are dropped. ``ValueError`` for a padded batch (several rows or an
    ``attention_mask`` with zeros).
    """

    def __init__(self, collator, cp_size: int, cp_rank: int, pad_token_id: int = 0):
        if not 0 <= cp_rank < cp_size:
            raise ValueError(f"cp_rank must be in [0, cp_size = {cp_size}), got {cp_rank}")
        self.collator, self.cp_size, self.cp_rank, self.pad_token_id = collator, cp_size, cp_rank, pad_token_id

    def __call__(self, features):
        batch = self.collator(features)
        ids = torch.as_tensor(batch["input_ids"])
        mask = batch.get("attention_mask")
        if ids.dim() != 2 or ids.shape[0] != 1 or (mask is not None and not bool(torch.as_tensor(mask).all())):
            got = f"input_ids of shape {tuple(ids.shape)}{'' if mask is None else ' and an attention_mask'}"
            raise ValueError(f"the data collator ({type(self.collator).__name__}) {_PADDING} (got {got})")
        ids = ids[0]
        cu = _sequence_starts(batch, ids.numel())
        if "shift_labels" in batch:
            shifted = torch.as_tensor(batch["shift_labels"])[0]
        else:
            labels = torch.as_tensor(batch.get("labels", ids[None]))[0]
            shifted = torch.cat([labels[1:], labels.new_full((1,), -100)])
            shifted[cu[1:] - 1] = -100  # the last token of each sequence has no target
        lens = cu.diff().tolist()
        batch = shard_labelled(ids.split(lens), shifted.split(lens), self.cp_size, self.cp_rank,
                               pad_token_id=self.pad_token_id)  # fmt: skip
        positions, _, cup = pack([torch.arange(n) for n in lens], self.cp_size)
        inputs = batch.model_inputs()
        del inputs["num_items_in_batch"]
        return dict(inputs, position_ids=shard_thd(positions.to(torch.int64), cup, self.cp_size, self.cp_rank)[None])


def _patched_cp_size(model: torch.nn.Module) -> int:
    sizes = {m.cp_size for m in model.modules()
             if isinstance(m, (ContextParallelQwen3NextGatedDeltaNet, ContextParallelQwen3NextAttention))}  # fmt: skip
    if not sizes:
        raise ValueError(
            f"model ({type(model).__name__}) is not patched for context parallelism: call "
            "cp_ops.integrations.transformers.apply_context_parallel(model, cp_mesh['cp']) before building the trainer"
        )
    return sizes.pop()


def _mesh_sizes(cp_mesh) -> tuple[int, int, int, int]:
    """``(dp_size, dp_rank, cp_size, cp_rank)`` of this process in ``cp_mesh``."""
    names = tuple(cp_mesh.mesh_dim_names or ())
    if names not in (("cp",), ("dp", "cp")):
        raise ValueError(f"cp_mesh must be a DeviceMesh with dimensions ('dp', 'cp') or ('cp',), got {names}")
    cp_size, cp_rank = cp_mesh["cp"].size(), cp_mesh["cp"].get_local_rank()
    if names == ("cp",):
        return 1, 0, cp_size, cp_rank
    return cp_mesh["dp"].size(), cp_mesh["dp"].get_local_rank(), cp_size, cp_rank


class ContextParallelMixin:
    """Context parallelism for a ``Trainer`` subclass (first base: ``class T(ContextParallelMixin,
    Trainer)``), taking ``cp_mesh`` (a ``DeviceMesh`` over every rank, dims ``("dp", "cp")`` or
    ``("cp",)``) besides the trainer's own arguments.

    - The data collator is wrapped in :class:`ContextParallelCollator` (this rank's shard of
      each packed batch) and the data loaders give every CP rank of a data-parallel group the
      same batches (accelerate's sharding by the dp rank, not the process index).
    - The loss: each rank's share is its label tokens' loss over ``num_items_in_batch``, the
      Trainer's count over every rank and accumulation step; the Trainer scales it by the world
      size, which DDP's mean over the world undoes: the gradient is the batch's.
    - Refused (``ValueError``): a model not patched, or patched for another CP size;
      accelerate's own CP (``parallelism_config`` with ``cp_size > 1``);
      ``average_tokens_across_devices=False``; a padding collator (at its first batch).
    """

    def __init__(self, *args, cp_mesh, **kwargs):
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        parallelism = getattr(training_args, "parallelism_config", None)
        if parallelism is not None and getattr(parallelism, "cp_size", 1) > 1:
            raise ValueError(
                "TrainingArguments(parallelism_config=...) turns on accelerate's own context parallelism "
                f"(cp_size = {parallelism.cp_size}), which shards SDPA buffers and knows nothing of Gated DeltaNet "
                "layers or packed batches; leave its cp_size at 1: the model's layers run CP over cp_mesh['cp']"
            )
        if training_args is not None and not training_args.average_tokens_across_devices:
            raise ValueError(
                "average_tokens_across_devices=False: under context parallelism each rank's loss must be divided "
                "by the label count of every rank; set it to True"
            )
        model = kwargs.get("model", args[0] if args else None)
        self.dp_size, self.dp_rank, self.cp_size, self.cp_rank = _mesh_sizes(cp_mesh)
        patched = _patched_cp_size(model)
        if patched != self.cp_size:
            raise ValueError(
                f"the model is patched for CP size {patched} but cp_mesh['cp'] has {self.cp_size} ranks: "
                "apply_context_parallel(model, cp_mesh['cp'])"
            )
        super().__init__(*args, **kwargs)
        self.data_collator = ContextParallelCollator(self.data_collator, self.cp_size, self.cp_rank)

    def _get_dataloader(self, *args, **kwargs):
        loader = super()._get_dataloader(*args, **kwargs)
        sharded = [s for s in (getattr(loader, "batch_sampler", None), getattr(loader, "dataset", None))
                   if isinstance(s, (BatchSamplerShard, IterableDatasetShard))]  # fmt: skip
        if not sharded and self.args.world_size > 1 and self.dp_size < self.args.world_size:
            raise ValueError(
                f"the data loader ({type(loader).__name__} over {type(loader.dataset).__name__}) is not sharded "
                "by accelerate's BatchSamplerShard or IterableDatasetShard: the CP ranks of a data-parallel "
                "group could not be given the same batches (a map-style dataset or a torch IterableDataset is)"
            )
        for shard in sharded:  # the CP ranks of a data-parallel group read the same batches
            shard.num_processes, shard.process_index = self.dp_size, self.dp_rank
        return loader

    def get_total_train_batch_size(self, args) -> int:
        return self._train_batch_size * args.gradient_accumulation_steps * self.dp_size

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if num_items_in_batch is not None:  # the patched model checks it (TRL's fused head does not pass it)
            inputs = {**inputs, "num_items_in_batch": num_items_in_batch}
        return super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)


class ContextParallelTrainer(ContextParallelMixin, Trainer):
    """transformers' ``Trainer`` with context parallelism (:class:`ContextParallelMixin`)."""
