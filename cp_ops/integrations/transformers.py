"""Qwen3-Next models from Hugging Face transformers, trained with context parallelism (CP).

On each of the W ranks of a CP group::

    apply_context_parallel(model, group)       # in place: the GDN and attention layers run cp_ops' layers
    batch = shard_batch(sequences, W, rank)    # this rank's tokens and labels, the global layout
    loss = model(**batch.model_inputs()).loss  # this rank's share; sum the gradients over the group

What the patch changes, the packed inputs it expects and what it refuses: docs/transformers.md.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn as nn

from cp_ops.attention import Attention
from cp_ops.integrations.causal_lm_loss import check_fused_loss, set_fused_loss
from custom_ops import fla_module, resolve_group
from cp_ops.gdn import GatedDeltaNet, from_qwen3_next_state_dict
from cp_ops.gdn_strategies import GDNContextParallel
from cp_ops.layout import pack, shard_thd, static_seqlens

try:  # transformers' module imports FLA when it is installed: loaded here first, without its CPU notice
    _qwen3_next = fla_module("transformers.models.qwen3_next.modeling_qwen3_next")
except ImportError as err:  # pragma: no cover - exercised only without the extra installed
    raise ImportError(
        "cp_ops.integrations.transformers needs transformers with Qwen3-Next (5.17 or later): "
        "pip install -e '.[hf]' in a clone of this repository"
    ) from err
Qwen3NextAttention, Qwen3NextGatedDeltaNet = _qwen3_next.Qwen3NextAttention, _qwen3_next.Qwen3NextGatedDeltaNet
Qwen3NextModel, Qwen3NextForCausalLM = _qwen3_next.Qwen3NextModel, _qwen3_next.Qwen3NextForCausalLM

__all__ = [
    "apply_context_parallel",
    "shard_batch",
    "ShardedBatch",
    "shard_labelled",
    "cu_seqlens_padded",
    "ContextParallelQwen3NextGatedDeltaNet",
    "ContextParallelQwen3NextAttention",
]


def cu_seqlens_padded(cu_seqlens: torch.Tensor, cp_size: int) -> torch.Tensor:
    """``cu_seqlens_padded`` from ``cu_seqlens`` on their device, no host sync: every length
    rounded up to a multiple of ``2 * cp_size`` (:func:`cp_ops.pad_cu_seqlens`' rule), in
    ``cu_seqlens``' dtype."""
    # [0, L_0, ..., L_{B-1}]: B+1 entries, so that no tensor's size is B (B = 1 would be specialised)
    lens = torch.diff(cu_seqlens, prepend=cu_seqlens[:1])
    block = 2 * cp_size
    return torch.cumsum((lens + block - 1) // block * block, 0).to(cu_seqlens.dtype)


# --- the patched layers -----------------------------------------------------------------------


def _packed_rows(hidden_states: torch.Tensor, layer: nn.Module) -> torch.Tensor:
    if hidden_states.dim() != 3 or hidden_states.shape[0] != 1:
        raise ValueError(
            f"{type(layer).__name__}: hidden_states must be one packed batch [1, T/W, hidden] "
            f"(this rank's shard of every sequence), got shape {tuple(hidden_states.shape)}"
        )
    return hidden_states[0]


def _layout(layer: nn.Module, cache, attention_mask, kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cu_seqlens, cu_seqlens_padded)`` of the packed batch a patched layer is called with."""
    name = type(layer).__name__
    if cache is not None:
        raise ValueError(f"{name}: context parallelism is for training; a key/value cache is refused (use_cache=False)")
    if attention_mask is not None:
        raise ValueError(
            f"{name}: got an attention_mask; with context parallelism the sequence boundaries come from "
            "cu_seq_lens_q and the mask must be None"
        )
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        raise ValueError(
            f"{name}: cu_seq_lens_q is missing; a context-parallel layer needs the global cumulative real "
            "lengths of the packed batch (int32 [B+1] on the device; shard_batch(...).model_inputs() has them)"
        )
    if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.dtype not in (torch.int32, torch.int64):
        what = f"{cu.dtype} of shape {tuple(cu.shape)}" if isinstance(cu, torch.Tensor) else type(cu).__name__
        raise ValueError(f"{name}: cu_seq_lens_q must be a 1-D int32 or int64 tensor [B+1], got {what}")
    return cu, cu_seqlens_padded(cu, layer.cp_size)


class _Group:
    """A patched layer's CP group: copies of the layer (``copy.deepcopy``) share it, as they
    share the process it belongs to (a ``ProcessGroup`` cannot be copied)."""

    def __init__(self, group):
        self.group = group

    def __deepcopy__(self, memo):
        return self


class _CPLayer:
    """What both patched layer classes add: their CP group and its size."""

    _cp = _Group(None)
    cp_size = 1

    @property
    def cp_group(self):
        """The ``ProcessGroup`` the layer runs CP over (None: no CP)."""
        return self._cp.group


class _SectionInProj:
    """:class:`cp_ops.GatedDeltaNet`'s ``in_proj`` (what its forward reads: ``.weight``) as a
    regrouping of a transformers layer's ``in_proj_qkvz`` and ``in_proj_ba`` weights."""

    def __init__(self, layer: Qwen3NextGatedDeltaNet):
        tensors = {
            "in_proj_qkvz.weight": layer.in_proj_qkvz.weight,
            "in_proj_ba.weight": layer.in_proj_ba.weight,
            "conv1d.weight": layer.conv1d.weight,
            "A_log": layer.A_log,
            "dt_bias": layer.dt_bias,
            "norm.weight": layer.norm.weight,
            "out_proj.weight": layer.out_proj.weight,
        }
        dims = layer.num_k_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim
        self.weight = from_qwen3_next_state_dict(tensors, *dims)["in_proj.weight"]


class ContextParallelQwen3NextGatedDeltaNet(_CPLayer, GatedDeltaNet, Qwen3NextGatedDeltaNet):
    """A ``Qwen3NextGatedDeltaNet`` that runs :class:`cp_ops.GatedDeltaNet`'s forward on its own
    parameters, with CP over ``cp_group`` (set by :func:`apply_context_parallel`).

    ``forward(hidden_states [1, T/W, hidden], cache=None, attention_mask=None, *,
    cu_seq_lens_q, **ignored) -> [1, T/W, hidden]``: the keyword arguments transformers'
    decoder layer passes. ``in_proj`` is the regrouped ``in_proj_qkvz`` / ``in_proj_ba``
    weight, computed on each read.
    """

    @property
    def in_proj(self) -> _SectionInProj:
        return _SectionInProj(self)

    def forward(self, hidden_states: torch.Tensor, cache=None, attention_mask=None, **kwargs) -> torch.Tensor:
        x = _packed_rows(hidden_states, self)
        _, cup = _layout(self, cache, attention_mask, kwargs)
        return GatedDeltaNet.forward(self, x, cup, self.cp_group)[None]


class ContextParallelQwen3NextAttention(_CPLayer, Attention, Qwen3NextAttention):
    """A ``Qwen3NextAttention`` that runs :class:`cp_ops.Attention`'s forward on its own
    parameters (all-gather CP over ``cp_group``; rotary embedding at each token's position in
    its sequence, the first ``int(head_dim * partial_rotary_factor)`` features, set by
    :func:`apply_context_parallel` from the config).

    ``forward(hidden_states [1, T/W, hidden], position_embeddings=None, attention_mask=None,
    cache=None, *, cu_seq_lens_q, **ignored) -> (out [1, T/W, hidden], None)``: the arguments
    transformers' decoder layer passes; ``position_embeddings`` are not used.
    """

    def forward(
        self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None, cache=None, **kwargs
    ) -> tuple[torch.Tensor, None]:
        x = _packed_rows(hidden_states, self)
        cu, cup = _layout(self, cache, attention_mask, kwargs)
        # a leading zero-length sequence: the segment tables then have at least two sequences,
        # so a batch of one sequence runs the same compiled graph (dynamo specialises size 1)
        cu, cup = (torch.cat([t[:1], t]) for t in (cu, cup))
        return Attention.forward(self, x, cu, cup, self.cp_group)[None], None


_PATCHED = {
    Qwen3NextGatedDeltaNet: ContextParallelQwen3NextGatedDeltaNet,
    Qwen3NextAttention: ContextParallelQwen3NextAttention,
}


def _patched_class(cls: type) -> type:
    """The context-parallel class for a transformers layer class (or a subclass of one)."""
    for base, patched in _PATCHED.items():
        if issubclass(cls, patched):
            return cls
        if cls is base:
            return patched
    base = Qwen3NextGatedDeltaNet if issubclass(cls, Qwen3NextGatedDeltaNet) else Qwen3NextAttention
    patched = type(f"ContextParallel{cls.__name__}", (_PATCHED[base], cls), {"__module__": __name__})
    _PATCHED[cls] = patched
    return patched


def _check_gdn(name: str, layer: Qwen3NextGatedDeltaNet, world: int, strategy: GDNContextParallel | None) -> None:
    hk, hv = layer.num_k_heads, layer.num_v_heads
    if strategy is not None and world > 1:
        try:
            strategy.check(layer, world)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
    elif hk % world or hv % world:
        raise ValueError(
            f"{name}: linear_num_key_heads = {hk} and linear_num_value_heads = {hv} must be divisible by the "
            f"CP size {world} (each rank runs 1/W of the Gated DeltaNet heads); "
            "apply_context_parallel(..., gdn_context_parallel=cp_ops.StatePassing()) runs them by chunk states "
            "instead, for any W"
        )
    if layer.activation != "silu":
        raise ValueError(f"{name}: hidden_act = {layer.activation!r}; the CP Gated DeltaNet's conv applies silu")
    for part in ("in_proj_qkvz", "in_proj_ba", "conv1d", "out_proj"):
        if getattr(layer, part).bias is not None:
            raise ValueError(f"{name}: {part} has a bias; the CP Gated DeltaNet has none")


def _attention_settings(name: str, layer: Qwen3NextAttention) -> dict:
    """The :class:`cp_ops.Attention` attributes of a transformers attention layer."""
    config = layer.config
    rope = dict(getattr(config, "rope_parameters", None) or {})
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"{name}: rope_type {rope['rope_type']!r}; the CP attention implements the default rotary")
    if getattr(config, "attention_dropout", 0.0):
        raise ValueError(f"{name}: attention_dropout = {config.attention_dropout}; the CP attention has no dropout")
    heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, layer.head_dim
    if layer.q_proj.out_features != 2 * heads * head_dim:
        raise ValueError(
            f"{name}: q_proj has {layer.q_proj.out_features} outputs, expected 2 * {heads} heads * {head_dim} "
            "(query and gate per head)"
        )
    factor = rope.get("partial_rotary_factor", 1.0)
    rotary_dim = int(head_dim * factor)
    if not 0 < factor <= 1 or rotary_dim < 2 or rotary_dim % 2:
        raise ValueError(
            f"{name}: partial_rotary_factor = {factor} with head_dim = {head_dim} rotates {rotary_dim} features; "
            "the CP attention needs an even number, at least 2"
        )
    return dict(
        num_heads=heads, num_kv_heads=kv_heads, gated=True, rope_theta=float(rope["rope_theta"]),
        partial_rotary_factor=factor, rotary_dim=rotary_dim, causal=True, window=(-1, -1), head_groups=1,
        hidden_size=config.hidden_size,
    )  # fmt: skip


# --- the model-level hooks --------------------------------------------------------------------


def _keyword_inputs(args: tuple, kwargs: dict, model: nn.Module) -> torch.Tensor | None:
    """The token tensor (``input_ids`` or ``inputs_embeds``) of a call, with every other argument
    by keyword."""
    if len(args) > 1:
        raise TypeError(
            f"{type(model).__name__}: with context parallelism pass every argument after input_ids by keyword "
            f"(got {len(args)} positional arguments)"
        )
    ids = args[0] if args else kwargs.get("input_ids")
    return ids if ids is not None else kwargs.get("inputs_embeds")


def _check_packed_call(world: int, model: nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook of the patched model: the packed batch is one rank's shard, the labels
    are shifted per sequence and match it."""
    tokens = _keyword_inputs(args, kwargs, model)
    if tokens is None:
        return  # the model raises its own error
    name = "input_ids" if args or kwargs.get("input_ids") is not None else "inputs_embeds"
    if tokens.dim() < 2 or tokens.shape[0] != 1:
        raise ValueError(
            f"{name}: a context-parallel batch is one packed row [1, T/W] (this rank's shard of every "
            f"sequence, shard_batch), got shape {tuple(tokens.shape)}"
        )
    if kwargs.get("cu_seq_lens_q") is None:
        raise ValueError(
            "cu_seq_lens_q is missing: pass the global cumulative real lengths of the packed sequences "
            "(int32 [B+1] on the device), e.g. model(**shard_batch(...).model_inputs())"
        )
    labels, shift_labels = kwargs.get("labels"), kwargs.get("shift_labels")
    if labels is not None and shift_labels is None:
        raise ValueError(
            "labels without shift_labels: the model would shift them across chunk and sequence boundaries; "
            "pass shift_labels shifted within each sequence before sharding (shard_batch(...).shift_labels)"
        )
    for label_name, t in (("labels", labels), ("shift_labels", shift_labels)):
        if t is not None and tuple(t.shape) != tuple(tokens.shape[:2]):
            raise ValueError(
                f"{label_name} has shape {tuple(t.shape)} but {name} has {tuple(tokens.shape[:2])}: labels must "
                "be this rank's shard of the batch, like the tokens (shard_batch)"
            )
    if shift_labels is not None and world > 1 and kwargs.get("num_items_in_batch") is None:
        raise ValueError(
            f"num_items_in_batch is missing: with {world} CP ranks each rank's loss must be divided by the "
            "global number of label tokens for the ranks' losses to add up to the batch loss "
            "(shard_batch(...).num_items_in_batch)"
        )


def _model_pre_hook(world: int, model: nn.Module, args: tuple, kwargs: dict):
    _check_packed_call(world, model, args, kwargs)
    return args, kwargs


def _base_model_pre_hook(model: nn.Module, args: tuple, kwargs: dict):
    """Forward pre-hook of every ``Qwen3NextModel``: no masks (the layers read cu_seq_lens_q),
    no cache."""
    _keyword_inputs(args, kwargs, model)
    if kwargs.get("attention_mask") is not None:
        raise ValueError(
            "attention_mask: with context parallelism the sequence boundaries come from cu_seq_lens_q "
            "(packed sequences, no padding mask); pass attention_mask=None"
        )
    if kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None or kwargs.get("use_cache"):
        raise ValueError(
            "use_cache / cache: a context-parallel model is for training; a key/value cache is refused "
            "(the model runs with use_cache=False)"
        )
    if kwargs.get("cu_seq_lens_q") is None:
        raise ValueError("cu_seq_lens_q is missing: pass the global cumulative real lengths of the packed sequences")
    kwargs = dict(kwargs, use_cache=False)
    kwargs["attention_mask"] = {layer_type: None for layer_type in set(model.config.layer_types)}
    return args, kwargs


def _replace_hook(module: nn.Module, attr: str, hook) -> None:
    old = module.__dict__.get(attr)
    if old is not None:
        old.remove()
    module.__dict__[attr] = module.register_forward_pre_hook(hook, with_kwargs=True)


def apply_context_parallel(
    model: nn.Module, group=None, gdn_context_parallel: GDNContextParallel | None = None, fused_loss: bool = False
) -> nn.Module:
    """Run every ``Qwen3NextGatedDeltaNet`` and ``Qwen3NextAttention`` of ``model`` through this
    package's layers with context parallelism over ``group``; in place, returns ``model``.

    ``group``: a ``ProcessGroup``, a 1-D ``DeviceMesh`` (``mesh["cp"]``) or None (W = 1: one device,
    still through this package's layers). ``model``: any module built from those
    transformers classes (``Qwen3NextForCausalLM``, ``Qwen3NextModel``, ...).
    ``gdn_context_parallel``: how the Gated DeltaNet layers run over the group (e.g.
    :class:`cp_ops.StatePassing`; None: by heads, the layer's default). Parameters stay
    the same objects under the same names and shapes (checkpoints interchangeable, layouts
    converted inside the forward); docs/transformers.md says what else changes. ``fused_loss``
    (a ``Qwen3NextForCausalLM``): ``model(..., labels=...).loss`` is
    :func:`custom_ops.linear_cross_entropy` of the hidden states and ``lm_head``, never the
    logits (then None). Calling it again re-targets the model to another group and loss.

    Raises ``ValueError`` for a model without those layers, GDN heads not divisible by W (by heads),
    settings the CP layers do not implement (a non-default rotary type, attention dropout,
    biases on the GDN projections), or ``fused_loss`` without a bias-free head, before changing anything.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    _, world = resolve_group(group)
    if group is not None and not isinstance(group, torch.distributed.ProcessGroup):
        group = group.get_group()  # a 1-D DeviceMesh (resolve_group checked it)
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, (Qwen3NextGatedDeltaNet, Qwen3NextAttention))]
    if not layers:
        raise ValueError(
            f"model ({type(model).__name__}) has no Qwen3NextGatedDeltaNet or Qwen3NextAttention module; "
            "apply_context_parallel runs those through the CP layers"
        )
    if fused_loss:
        check_fused_loss(model, Qwen3NextForCausalLM)
    settings = {}
    for name, layer in layers:
        if isinstance(layer, Qwen3NextGatedDeltaNet):
            _check_gdn(name or "model", layer, world, gdn_context_parallel)
        else:
            settings[name] = _attention_settings(name or "model", layer)
    for name, layer in layers:
        layer.__class__ = _patched_class(type(layer))
        layer._cp, layer.cp_size = _Group(group), world
        if isinstance(layer, GatedDeltaNet):
            layer.context_parallel = gdn_context_parallel
        for key, value in settings.get(name, {}).items():
            setattr(layer, key, value)
    for module in model.modules():
        if isinstance(module, Qwen3NextModel):
            _replace_hook(module, "_cp_ops_base_hook", _base_model_pre_hook)
    _replace_hook(model, "_cp_ops_model_hook", functools.partial(_model_pre_hook, world))
    if fused_loss or isinstance(model, Qwen3NextForCausalLM):
        set_fused_loss(model, fused_loss)
    return model


# --- batches ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ShardedBatch:
    """One rank's share of a packed batch (:func:`shard_batch`).

    ``input_ids``, ``shift_labels``: ``[T/W]`` (int64), this rank's THD shard; ``cu_seqlens``,
    ``cu_seqlens_padded``: ``[B+1]`` (int32), the global layout; ``num_items_in_batch``: 0-d
    int64, the number of label tokens of the whole batch (every rank); ``ignore_index``: the
    label of positions without a target.
    """

    input_ids: torch.Tensor
    shift_labels: torch.Tensor
    cu_seqlens: torch.Tensor
    cu_seqlens_padded: torch.Tensor
    num_items_in_batch: torch.Tensor
    ignore_index: int = -100

    def to(self, device) -> ShardedBatch:
        """The same batch with every tensor on ``device``."""
        names = ("input_ids", "shift_labels", "cu_seqlens", "cu_seqlens_padded", "num_items_in_batch")
        return replace(self, **{name: getattr(self, name).to(device) for name in names})

    def model_inputs(self) -> dict:
        """Keyword arguments for a patched transformers causal LM: ``input_ids`` and ``labels`` /
        ``shift_labels`` as ``[1, T/W]``, ``cu_seq_lens_q`` = ``cu_seq_lens_k`` = ``cu_seqlens``,
        ``num_items_in_batch`` (and ``ignore_index`` when not -100). ``labels`` is the same
        tensor as ``shift_labels``: transformers computes the loss only when labels are given
        and then uses ``shift_labels`` as they are."""
        labels = self.shift_labels[None]
        inputs = {
            "input_ids": self.input_ids[None],
            "labels": labels,
            "shift_labels": labels,
            "cu_seq_lens_q": self.cu_seqlens,
            "cu_seq_lens_k": self.cu_seqlens,
            "num_items_in_batch": self.num_items_in_batch,
        }
        if self.ignore_index != -100:
            inputs["ignore_index"] = self.ignore_index
        return inputs


def shard_batch(
    sequences: Sequence[torch.Tensor],
    cp_size: int,
    rank: int,
    ignore_index: int = -100,
    pad_token_id: int = 0,
    num_tokens: int | None = None,
    max_sequences: int | None = None,
) -> ShardedBatch:
    """This rank's share of a batch of token sequences for causal-LM training with CP.

    ``sequences``: 1-D integer tensors (lengths may be 0 or 1), on one device. They are packed
    (each padded with ``pad_token_id`` to a multiple of ``2 * cp_size``), their next-token
    labels shifted within each sequence (``ignore_index`` at each sequence's last token and on
    the padding), and both sharded to rank ``rank``'s THD shard. ``num_items_in_batch`` counts
    the label tokens of the whole batch, so that each rank's loss (sum over its label tokens /
    that count, transformers' ``ForCausalLMLoss`` with ``num_items_in_batch``) adds up over
    the ranks to the one-device mean. Host-side data preparation: it may read lengths.

    Static shapes (:func:`cp_ops.layout.static_seqlens`): ``max_sequences`` appends zero-length
    sequences up to that many, ``num_tokens`` one sequence of ``pad_token_id`` (labels
    ``ignore_index``) that fills the batch to ``num_tokens`` rows, so every batch has
    ``input_ids [num_tokens / W]`` and ``cu_seqlens [max_sequences + 2]``; ``ValueError`` past either,
    and for a batch without a label token (no sequence of 2 tokens or more).
    """
    if isinstance(sequences, torch.Tensor) or len(sequences) == 0:
        raise ValueError("sequences must be a non-empty list of 1-D token tensors")
    for i, seq in enumerate(sequences):
        if not isinstance(seq, torch.Tensor) or seq.dim() != 1 or seq.dtype.is_floating_point or seq.is_complex():
            what = f"shape {tuple(seq.shape)}, {seq.dtype}" if isinstance(seq, torch.Tensor) else type(seq).__name__
            raise ValueError(f"sequences[{i}] must be a 1-D integer tensor of token ids, got {what}")
        if seq.device != sequences[0].device:
            raise ValueError(f"sequences[{i}] is on {seq.device}, sequences[0] on {sequences[0].device}")
    if not 0 <= rank < cp_size:
        raise ValueError(f"rank must be in [0, cp_size = {cp_size}), got {rank}")
    if all(len(seq) < 2 for seq in sequences):
        raise ValueError(
            f"the batch has no label token: its {len(sequences)} sequences are all shorter than 2 tokens, so "
            "its loss would be 0 / 0"
        )
    ids = [seq.to(torch.int64) for seq in sequences]
    labels = [torch.cat([seq[1:], seq.new_full((min(len(seq), 1),), ignore_index)]) for seq in ids]
    lens = static_seqlens([len(seq) for seq in ids], cp_size, num_tokens, max_sequences)
    for n in lens[len(ids) :]:  # the zero-length sequences, then the filler
        ids.append(ids[0].new_full((n,), pad_token_id))
        labels.append(ids[0].new_full((n,), ignore_index))
    return shard_labelled(ids, labels, cp_size, rank, ignore_index, pad_token_id)


def shard_labelled(
    ids: Sequence[torch.Tensor],
    shift_labels: Sequence[torch.Tensor],
    cp_size: int,
    rank: int,
    ignore_index: int = -100,
    pad_token_id: int = 0,
) -> ShardedBatch:
    """Rank ``rank``'s share of sequences with their shifted labels (``shift_labels[i]`` as long
    as ``ids[i]``): packed, each padded to a multiple of ``2 * cp_size`` (``pad_token_id``; labels
    ``ignore_index``), sharded. :func:`shard_batch` after its shift; the Trainer's collator."""
    packed_ids, cu, cup = pack(list(ids), cp_size, padding_value=pad_token_id)
    packed_labels, _, _ = pack(list(shift_labels), cp_size, padding_value=ignore_index)
    return ShardedBatch(
        input_ids=shard_thd(packed_ids, cup, cp_size, rank),
        shift_labels=shard_thd(packed_labels, cup, cp_size, rank),
        cu_seqlens=cu,
        cu_seqlens_padded=cup,
        num_items_in_batch=(packed_labels != ignore_index).sum(),
        ignore_index=ignore_index,
    )
