"""cp_ops.integrations.transformers: transformers' Qwen3-Next trained with CP equals the model
it patches, run one sequence at a time.

The oracle is the unpatched ``Qwen3NextForCausalLM`` (a copy taken before patching) fed each
sequence alone, with ``num_items_in_batch`` = the batch's label count so that its per-sequence
losses add up to the batch loss. Each rank compares its shard: logits of its real tokens, the
sum over ranks of its loss, and every parameter's gradient summed over ranks.

Tolerance 1e-6 (relative), float64. transformers computes part of a float64 model in float32
in both paths alike (its RMSNorms and gated norm call ``x.float()`` / ``.to(torch.float32)``,
the loss upcasts logits with ``.float()``), so the two paths agree to float32 rounding of
nearly equal inputs: about 2e-7 measured. Its torch Gated DeltaNet core (``torch_chunk_gated_
delta_rule``) also runs in float32, and on the CPU FLA's kernel, which transformers picks when
FLA is installed, cannot run at all; the oracle runs :func:`_float64_gated_delta_rule` instead,
transformers' recurrent form written out in float64. Its rotary angles are float32 as well
(``Qwen3NextRotaryEmbedding``), which stays below 1e-7 at these positions and theta.

Spawns are the main cost (each rank imports transformers), so each spawned test runs every
check of its W in one go.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from hypothesis import given

from cp_ops import StatePassing, pad_cu_seqlens, shard_thd, unshard_thd
from custom_ops.testing import rel_error, thd_layouts
from tests._dist import run_ranks

transformers = pytest.importorskip("transformers")

from transformers import Qwen3NextConfig, Qwen3NextForCausalLM  # noqa: E402
from transformers.models.qwen3_next import modeling_qwen3_next  # noqa: E402

from cp_ops.integrations.transformers import (  # noqa: E402
    ContextParallelQwen3NextAttention,
    ContextParallelQwen3NextGatedDeltaNet,
    apply_context_parallel,
    cu_seqlens_padded,
    shard_batch,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOL = 1e-6
VOCAB = 61
# lengths 1, odd, 0, and 70 (> 64: more than one chunk of the gated delta rule)
SEQLENS = [1, 9, 0, 70, 6]


def _config(num_k_heads: int = 12, moe: bool = True, **overrides) -> Qwen3NextConfig:
    """Both layer types (GDN, attention, GDN) with partial_rotary_factor 0.25; 12 GDN key heads
    (24 value heads) divide W = 1, 2, 3, 4; the last layer's MLP is a mixture of experts."""
    settings = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=3,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        linear_num_key_heads=num_k_heads, linear_num_value_heads=2 * num_k_heads,
        linear_key_head_dim=4, linear_value_head_dim=4,
        num_experts=4 if moe else 0, num_experts_per_tok=2, moe_intermediate_size=12,
        shared_expert_intermediate_size=12, mlp_only_layers=[0, 1],
        attn_implementation="eager", experts_implementation="eager",
    )  # fmt: skip
    settings.update(overrides)
    return Qwen3NextConfig(**settings)


def _model(config: Qwen3NextConfig, seed: int = 0) -> Qwen3NextForCausalLM:
    """A float64 model with the zero-initialised norm weights and the decay parameters random,
    so that their gradients are not hidden."""
    torch.manual_seed(seed)
    model = Qwen3NextForCausalLM(config).double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.3)
            elif name.endswith("A_log"):
                p.uniform_(-2.0, 1.0)
            elif name.endswith("dt_bias"):
                p.normal_(0.0, 0.5)
    return model


def _float64_gated_delta_rule(query, key, value, g, beta, use_qk_l2norm_in_kernel=False, initial_state=None,
                              output_final_state=False, **kwargs):  # fmt: skip
    """transformers' ``torch_recurrent_gated_delta_rule`` in float64 (it computes in float32):
    per value head, ``S <- S * exp(g)``, ``S <- S + k (beta (v - S^T k))^T``, ``o = S^T q / sqrt(dk)``."""
    if initial_state is not None or output_final_state:
        raise ValueError("the oracle runs without a cache")
    group = value.shape[2] // key.shape[2]
    q, k = (t.repeat_interleave(group, dim=2).double() for t in (query, key))
    v, beta, g = value.double(), beta.double(), g.double()
    if use_qk_l2norm_in_kernel:
        q = q * torch.rsqrt(q.square().sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt(k.square().sum(-1, keepdim=True) + 1e-6)
    q = q * q.shape[-1] ** -0.5
    state = q.new_zeros(k.shape[0], k.shape[2], k.shape[3], v.shape[3])
    out = []
    for t in range(k.shape[1]):
        state = state * g[:, t].exp()[..., None, None]
        delta = (v[:, t] - (state * k[:, t, ..., None]).sum(-2)) * beta[:, t, :, None]
        state = state + k[:, t, ..., None] * delta[:, :, None, :]
        out.append((state * q[:, t, ..., None]).sum(-2))
    return torch.stack(out, 1).to(value.dtype), None


def _sequences(seqlens, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=gen) for n in seqlens]


def _reference(model, sequences):
    """The unpatched model over each sequence alone: (loss, logits of the real tokens packed
    with zeros on the padding rows of ``cup`` for W, grads)."""
    count = sum(max(len(s) - 1, 0) for s in sequences)
    model.zero_grad()
    loss, logits = 0.0, []
    with mock.patch.object(modeling_qwen3_next, "torch_chunk_gated_delta_rule", _float64_gated_delta_rule):
        for seq in sequences:
            if len(seq) == 0:
                logits.append(torch.zeros(0, VOCAB, dtype=torch.float64))
                continue
            out = model(input_ids=seq[None], labels=seq[None], num_items_in_batch=count, use_cache=False)
            loss = loss + out.loss
            logits.append(out.logits[0].detach())
        loss.backward()
    return loss.detach(), logits, {n: p.grad.clone() for n, p in model.named_parameters()}


def _packed_logits(logits, world):
    from cp_ops import pack

    packed, _, cup = pack(logits, world)
    real, _, _ = pack([torch.ones(len(t), dtype=torch.bool) for t in logits], world)
    return packed, real, cup


def _check_equivalence(model, reference, sequences, group, rank, world, what=""):
    """The patched ``model`` on rank ``rank``'s shard against :func:`_reference`."""
    want_loss, want_logits, want_grads = reference
    batch = shard_batch(sequences, world, rank)
    model.zero_grad()
    out = model(**batch.model_inputs())
    out.loss.backward()
    loss = out.loss.detach().clone()
    if group is not None:
        dist.all_reduce(loss, group=group)
    what = f"W={world} rank {rank}{what}"
    assert rel_error(loss, want_loss) < TOL, f"{what}: loss {loss.item()} vs {want_loss.item()}"
    packed, real, cup = _packed_logits(want_logits, world)
    mine_real = shard_thd(real, cup, world, rank)
    got = out.logits[0].detach()[mine_real]
    assert rel_error(got, shard_thd(packed, cup, world, rank)[mine_real]) < TOL, f"{what}: logits"
    for name, p in model.named_parameters():
        grad = p.grad.clone()
        if group is not None:
            dist.all_reduce(grad, group=group)
        assert rel_error(grad, want_grads[name]) < TOL, f"{what}: gradient of {name}"


def _patched_pair(config, group, seed=0, gdn_context_parallel=None, fused_loss=False):
    """(patched model, its unpatched copy)."""
    model = _model(config, seed)
    return apply_context_parallel(copy.deepcopy(model), group, gdn_context_parallel, fused_loss), model


def _check_fused_loss(model, reference, sequences, group, rank, world):
    """The patched model with ``fused_loss=True`` on rank ``rank``'s shard against
    :func:`_reference` (transformers' own loss): the loss summed over ranks and every gradient;
    no logits."""
    want_loss, _, want_grads = reference
    model.zero_grad()
    out = model(**shard_batch(sequences, world, rank).model_inputs())
    out.loss.backward()
    assert out.logits is None and out.loss.dtype == torch.float64
    loss = out.loss.detach().clone()
    if group is not None:
        dist.all_reduce(loss, group=group)
    assert rel_error(loss, want_loss) < TOL, f"W={world} rank {rank}, fused loss: {loss.item()} vs {want_loss.item()}"
    for name, p in model.named_parameters():
        grad = p.grad.clone()
        if group is not None:
            dist.all_reduce(grad, group=group)
        assert rel_error(grad, want_grads[name]) < TOL, f"W={world} rank {rank}, fused loss: gradient of {name}"


# --- one process (W = 1) ------------------------------------------------------------------------


@pytest.mark.slow  # the fast tier: the fused loss's one-rank test below, and W = 2 (the same checks) compiled
def test_patched_model_equals_transformers_one_rank():
    model, reference_model = _patched_pair(_config(), None)
    sequences = _sequences(SEQLENS)
    _check_equivalence(model, _reference(reference_model, sequences), sequences, None, 0, 1)


def test_fused_loss_equals_transformers_one_rank():
    """fused_loss=True: transformers' own loss and gradients (float64) with num_items_in_batch,
    its mean without it, its router load-balancing term, the tuple output; logits again, from
    the head, once the model is patched without it."""
    model, reference_model = _patched_pair(_config(), None, fused_loss=True)
    sequences = _sequences(SEQLENS)
    _check_fused_loss(model, _reference(reference_model, sequences), sequences, None, 0, 1)
    unfused = apply_context_parallel(copy.deepcopy(model), None)
    inputs = shard_batch(sequences, 1, 0).model_inputs()
    mean_inputs = {k: v for k, v in inputs.items() if k != "num_items_in_batch"}
    for call in (mean_inputs, dict(inputs, output_router_logits=True)):
        with torch.no_grad():
            got, want = model(**call), unfused(**call)
        assert rel_error(got.loss, want.loss) < TOL and (got.aux_loss is None) == (want.aux_loss is None)
    with torch.no_grad():
        assert model(**inputs, return_dict=False)[0] == model(**inputs).loss
        logits = unfused(**inputs).logits
        assert torch.equal(model(**{k: v for k, v in inputs.items() if "labels" not in k}).logits, logits)
    with pytest.raises(ValueError, match="logits_to_keep"):
        model(**inputs, logits_to_keep=1)


def test_fused_loss_refuses_models_without_a_plain_head():
    with pytest.raises(ValueError, match="the loss belongs to the causal LM"):
        apply_context_parallel(_model(_config(num_k_heads=2)).model, None, fused_loss=True)
    model = _model(_config(num_k_heads=2))
    model.lm_head = torch.nn.Linear(32, VOCAB, dtype=torch.float64)
    with pytest.raises(ValueError, match="lm_head must be an nn.Linear without bias"):
        apply_context_parallel(model, None, fused_loss=True)


def test_patching_keeps_parameters_checkpoints_and_classes(tmp_path):
    """The same parameter objects under the same names; save_pretrained of the patched model
    loads into an unpatched one; the layers keep their transformers classes as bases."""
    model = _model(_config(num_k_heads=2, moe=False))
    before = dict(model.named_parameters())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    apply_context_parallel(model)
    after = dict(model.named_parameters())
    assert list(after) == list(before) and all(after[n] is before[n] for n in before)
    assert list(model.state_dict()) == list(state)
    layers = model.model.layers
    assert type(layers[0].linear_attn) is ContextParallelQwen3NextGatedDeltaNet
    assert isinstance(layers[0].linear_attn, modeling_qwen3_next.Qwen3NextGatedDeltaNet)
    assert type(layers[1].self_attn) is ContextParallelQwen3NextAttention
    assert isinstance(layers[1].self_attn, modeling_qwen3_next.Qwen3NextAttention)
    model.save_pretrained(tmp_path)
    loaded = Qwen3NextForCausalLM.from_pretrained(tmp_path, torch_dtype=torch.float64)
    assert not isinstance(loaded.model.layers[0].linear_attn, ContextParallelQwen3NextGatedDeltaNet)
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, state[name]), name
    apply_context_parallel(model)  # again: re-targets, nothing doubles
    assert len(model._forward_pre_hooks) == 1 and len(model.model._forward_pre_hooks) == 1

    class OwnGatedDeltaNet(modeling_qwen3_next.Qwen3NextGatedDeltaNet):
        pass

    other = _model(_config(num_k_heads=2, moe=False))
    other.model.layers[0].linear_attn.__class__ = OwnGatedDeltaNet  # a subclass of transformers' layer
    apply_context_parallel(other)
    patched = other.model.layers[0].linear_attn
    assert type(patched).__name__ == "ContextParallelOwnGatedDeltaNet" and isinstance(patched, OwnGatedDeltaNet)
    assert isinstance(patched, ContextParallelQwen3NextGatedDeltaNet)


@given(thd_layouts(max_seqs=6, max_len=40, cp_sizes=(1, 2, 3, 4)))
def test_cu_seqlens_padded_is_the_package_rule(layout):
    world, seqlens = layout
    cu, cup = pad_cu_seqlens(seqlens, world)
    assert torch.equal(cu_seqlens_padded(cu, world), cup)
    assert torch.equal(cu_seqlens_padded(cu.long(), world), cup.long())


@given(thd_layouts(max_seqs=5, max_len=30, cp_sizes=(1, 2, 3, 4)))
def test_shard_batch_shards_shifted_labels(layout):
    """Unsharded, the W ranks' tokens are the packed sequences and their labels each sequence
    shifted by one, ignore_index at its last token and on the padding."""
    world, seqlens = layout
    sequences = _sequences(seqlens)
    if all(n < 2 for n in seqlens):  # no label token (test_batch_without_labels_is_refused)
        with pytest.raises(ValueError, match="the batch has no label token"):
            shard_batch(sequences, world, 0)
        return
    shards = [shard_batch(sequences, world, r, ignore_index=-7, pad_token_id=3) for r in range(world)]
    cup = shards[0].cu_seqlens_padded
    ids = unshard_thd([s.input_ids for s in shards], cup, world)
    labels = unshard_thd([s.shift_labels for s in shards], cup, world)
    for seq, start, end in zip(sequences, cup[:-1].tolist(), cup[1:].tolist()):
        n = len(seq)
        assert torch.equal(ids[start : start + n], seq) and (ids[start + n : end] == 3).all()
        assert torch.equal(labels[start : start + max(n - 1, 0)], seq[1:])
        assert (labels[start + max(n - 1, 0) : end] == -7).all()
    for s in shards:
        assert int(s.num_items_in_batch) == sum(max(n - 1, 0) for n in seqlens)
        assert s.model_inputs()["ignore_index"] == -7 and s.input_ids.shape[0] == int(cup[-1]) // world


def test_bad_input():
    model = _model(_config(num_k_heads=2, moe=False))
    with pytest.raises(ValueError, match="has no Qwen3NextGatedDeltaNet or Qwen3NextAttention module"):
        apply_context_parallel(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        apply_context_parallel("model")
    with pytest.raises(ValueError, match="rope_type 'linear'"):
        bad = _model(_config(num_k_heads=2, moe=False, num_hidden_layers=2, layer_types=["full_attention"] * 2,
                             rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}))  # fmt: skip
        apply_context_parallel(bad)
    apply_context_parallel(model)
    batch = shard_batch(_sequences([5, 4]), 1, 0)
    inputs = batch.model_inputs()

    def call(**changes):
        return model(**{**inputs, **changes})

    missing = {k: v for k, v in inputs.items() if k not in ("cu_seq_lens_q", "cu_seq_lens_k")}
    with pytest.raises(ValueError, match="cu_seq_lens_q is missing"):
        model(**missing)
    with pytest.raises(ValueError, match=r"labels has shape \(1, 9\) but input_ids has \(1, 10\)"):
        call(labels=inputs["labels"][:, 1:])
    with pytest.raises(ValueError, match=r"shift_labels has shape \(10,\) but input_ids has \(1, 10\)"):
        call(shift_labels=inputs["shift_labels"][0])
    with pytest.raises(ValueError, match="labels without shift_labels"):
        model(**{k: v for k, v in inputs.items() if k != "shift_labels"})
    with pytest.raises(ValueError, match=r"one packed row \[1, T/W\].*got shape \(2, 5\)"):
        call(input_ids=inputs["input_ids"].view(2, 5), labels=None, shift_labels=None)
    with pytest.raises(ValueError, match="a key/value cache is refused"):
        call(use_cache=True)
    with pytest.raises(ValueError, match="pass attention_mask=None"):
        call(attention_mask=torch.ones_like(inputs["input_ids"]))
    with pytest.raises(TypeError, match="pass every argument after input_ids by keyword"):
        model(inputs["input_ids"], None)
    # a decoder layer called on its own reports the missing layout too
    hidden = torch.zeros(1, 10, 32, dtype=torch.float64)
    with pytest.raises(ValueError, match="ContextParallelQwen3NextGatedDeltaNet: cu_seq_lens_q is missing"):
        model.model.layers[0](hidden, position_embeddings=None)
    with pytest.raises(ValueError, match=r"cu_seq_lens_q must be a 1-D int32 or int64 tensor \[B\+1\], got "
                                         r"torch.float32 of shape \(3,\)"):  # fmt: skip
        model.model.layers[1].self_attn(hidden, cu_seq_lens_q=torch.zeros(3))
    with pytest.raises(ValueError, match=r"hidden_states must be one packed batch \[1, T/W, hidden\]"):
        model.model.layers[1].self_attn(hidden.view(2, 5, 32), cu_seq_lens_q=batch.cu_seqlens)
    bad_sequences = (
        ([], "non-empty list"),
        ([torch.zeros(2, 3, dtype=torch.long)], r"sequences\[0\] must be a 1-D"),
        ([torch.zeros(3)], "integer tensor"),
    )
    for bad, message in bad_sequences:
        with pytest.raises(ValueError, match=message):
            shard_batch(bad, 2, 0)
    with pytest.raises(ValueError, match=r"rank must be in \[0, cp_size = 2\)"):
        shard_batch(_sequences([3]), 2, 2)


# --- compiled -------------------------------------------------------------------------------------

# five packings; no row count or B+1 equals a model dimension or another size on the first call
# (dynamo's duck sizing would tie them and recompile when they part)
PACKINGS = ([9, 0, 1, 23, 6], [31, 2, 0, 5, 1, 17], [70], [3, 3, 3, 50], [13, 41])


def _check_compiled_layers(group, rank, world):
    """torch.compile(fullgraph=True, dynamic=True) over each patched decoder layer: no graph
    break (fullgraph), no graph added after the first of five packings (one of them a single
    sequence), the same loss and gradients as eager."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    eager, _ = _patched_pair(_config(moe=False), group)
    compiled = copy.deepcopy(eager)
    counter = CompileCounterWithBackend("aot_eager")
    for layer in compiled.model.layers:
        layer.compile(backend=counter, fullgraph=True, dynamic=True)
    for i, seqlens in enumerate(PACKINGS):
        inputs = shard_batch(_sequences(seqlens, seed=i), world, rank).model_inputs()
        results = []
        for model in (eager, compiled):
            model.zero_grad()
            loss = model(**inputs).loss
            loss.backward()
            results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        (want, want_grads), (got, got_grads) = results
        what = f"W={world} rank {rank} packing {i}"
        assert rel_error(got, want) < 1e-10, what
        for name in want_grads:
            assert rel_error(got_grads[name], want_grads[name]) < 1e-10, f"{what}: {name}"
        if i == 0:
            first = counter.frame_count  # the two layer types (dynamo may trace one twice: a restart)
    assert counter.frame_count == first, f"W={world} rank {rank}: recompiled ({first} -> {counter.frame_count})"


@pytest.mark.slow  # the same check with a group of two ranks below, in the fast tier
def test_compiled_decoder_layers_one_rank():
    _check_compiled_layers(None, 0, 1)


def test_explain_whole_model_one_graph():
    """torch._dynamo.explain over the whole patched model (embeddings to loss, a mixture-of-experts
    MLP with transformers' default grouped-GEMM experts, float32): one graph, no break."""
    model = apply_context_parallel(_model(_config(num_k_heads=2, experts_implementation="grouped_mm")).float())
    torch._dynamo.reset()
    explain = torch._dynamo.explain(model)(**shard_batch(_sequences(SEQLENS), 1, 0).model_inputs())
    assert (explain.graph_count, explain.graph_break_count) == (1, 0), explain.break_reasons


# --- spawned ------------------------------------------------------------------------------------


def _rank(rank, world, compiled):
    group = dist.group.WORLD
    sequences = _sequences(SEQLENS)
    model, reference_model = _patched_pair(_config(), group)
    _check_equivalence(model, _reference(reference_model, sequences), sequences, group, rank, world)
    _check_all_ignored_rank(group, rank, world)
    if world == 3:
        with pytest.raises(ValueError, match="linear_num_key_heads = 2 and linear_num_value_heads = 4 must be "
                                             r"divisible by the CP size 3.*gdn_context_parallel=cp_ops\.StatePassing\(\)"):  # fmt: skip
            apply_context_parallel(_model(_config(num_k_heads=2)), group)
        # by chunk states, W is not bound to the key heads: 2 key heads on 3 ranks
        model, reference_model = _patched_pair(_config(num_k_heads=2), group, gdn_context_parallel=StatePassing())
        _check_equivalence(model, _reference(reference_model, sequences), sequences, group, rank, world, ", states")
        inputs = shard_batch(sequences, world, rank).model_inputs()
        with pytest.raises(ValueError, match="num_items_in_batch is missing: with 3 CP ranks"):
            model(**{k: v for k, v in inputs.items() if k != "num_items_in_batch"})
    if world == 2:  # a 1-D DeviceMesh is accepted as the group; the fused loss's shares add up
        model, reference_model = _patched_pair(_config(), group, fused_loss=True)
        _check_fused_loss(model, _reference(reference_model, sequences), sequences, group, rank, world)
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,))
        model, reference_model = _patched_pair(_config(num_k_heads=2), mesh)
        _check_equivalence(model, _reference(reference_model, sequences), sequences, group, rank, world, ", mesh")
    if compiled:
        _check_compiled_layers(group, rank, world)


@pytest.mark.dist
# W = 2 below, compiled, in the fast tier; W = 3 and 4 in the slow one (the layers' W = 3 is in test_cp_properties.py)
@pytest.mark.parametrize("world", [pytest.param(3, marks=pytest.mark.slow), pytest.param(4, marks=pytest.mark.slow)])
def test_patched_model_equals_transformers(world):
    run_ranks(world, _rank, False)


@pytest.mark.dist
def test_patched_model_equals_transformers_w2_compiled():
    run_ranks(2, _rank, True)


def _check_all_ignored_rank(group, rank, world):
    """A batch of sequences no longer than W tokens, padded to static shapes: CP rank W-1 holds
    only last tokens and padding, every label of its shard ``ignore_index``. Its loss is 0 and
    the W shares add up to the one-device loss and gradients; the gradient of its own share
    alone, summed over the ranks, is exactly zero."""
    from cp_ops.layout import static_num_tokens

    sequences = _sequences([world, 1, 0, world - 1, world], seed=world)
    model, reference_model = _patched_pair(_config(moe=False), group)
    want_loss, _, want_grads = _reference(reference_model, sequences)
    real, max_seqs = sum(map(len, sequences)), 8
    batch = shard_batch(sequences, world, rank, num_tokens=static_num_tokens(real, max_seqs, world) + 2 * world,
                        max_sequences=max_seqs)  # fmt: skip
    if rank == world - 1:
        assert bool((batch.shift_labels == batch.ignore_index).all()) and bool((batch.input_ids != 0).any())
    what = f"W={world} rank {rank}, all labels of rank {world - 1} ignored"
    for own_share_of_last in (False, True):
        model.zero_grad()
        loss = model(**batch.model_inputs()).loss
        (loss * float(rank == world - 1) if own_share_of_last else loss).backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        for grad in grads.values():
            dist.all_reduce(grad, group=group)
        if own_share_of_last:
            assert all(int(g.count_nonzero()) == 0 for g in grads.values()), what
            continue
        assert rank != world - 1 or loss.item() == 0.0, f"{what}: loss {loss.item()}"
        total = loss.detach().clone()
        dist.all_reduce(total, group=group)
        assert rel_error(total, want_loss) < TOL, f"{what}: loss {total.item()} vs {want_loss.item()}"
        for name, grad in grads.items():
            assert rel_error(grad, want_grads[name]) < TOL, f"{what}: gradient of {name}"


def test_batch_without_labels_is_refused():
    with pytest.raises(ValueError, match="the batch has no label token: its 3 sequences are all shorter than 2"):
        shard_batch(_sequences([1, 0, 1]), 2, 0)
    assert int(shard_batch(_sequences([1, 2]), 2, 1).num_items_in_batch) == 1


# --- static shapes ------------------------------------------------------------------------------


def test_static_shapes_are_one_shape_and_keep_the_loss():
    """Two packings of different lengths and counts shard to the same shapes on every rank; with
    the static padding the loss and gradients are the plain batch's."""
    from cp_ops.layout import static_num_tokens

    packings, world, max_seqs = ([1, 9, 0, 70, 6], [33, 2]), 2, 5
    shapes = set()
    for seqlens in packings:
        seqs = _sequences(seqlens)
        for rank in range(world):
            static = shard_batch(seqs, world, rank, num_tokens=static_num_tokens(86, max_seqs, world),
                                 max_sequences=max_seqs)  # fmt: skip
            plain = shard_batch(seqs, world, rank)
            shapes.add((*static.input_ids.shape, *static.shift_labels.shape, *static.cu_seqlens.shape))
            assert torch.equal(static.cu_seqlens[: len(plain.cu_seqlens)], plain.cu_seqlens)
            assert torch.equal(static.input_ids[: len(plain.input_ids)], plain.input_ids)  # the filler comes last
            assert int(static.num_items_in_batch) == int(plain.num_items_in_batch)
    num_tokens = static_num_tokens(86, max_seqs, world)
    assert shapes == {(num_tokens // world, num_tokens // world, max_seqs + 2)}
    model = apply_context_parallel(_model(_config()), None)
    for seqlens in packings:
        results = []
        for static in (dict(num_tokens=static_num_tokens(86, max_seqs, 1), max_sequences=max_seqs), {}):
            model.zero_grad()
            loss = model(**shard_batch(_sequences(seqlens), 1, 0, **static).model_inputs()).loss
            loss.backward()
            results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
        (loss, grads), (want_loss, want_grads) = results
        assert rel_error(loss, want_loss) < TOL and grads.keys() == want_grads.keys()
        for name, grad in grads.items():
            assert rel_error(grad, want_grads[name]) < TOL, name


def test_static_shapes_refuse_larger_batches():
    seqs = _sequences([10, 20])
    with pytest.raises(ValueError, match="2 sequences, more than the static maximum max_sequences = 1"):
        shard_batch(seqs, 2, 0, max_sequences=1)
    with pytest.raises(ValueError, match="needs 32 rows .* more than the static num_tokens = 24"):
        shard_batch(seqs, 2, 0, num_tokens=24, max_sequences=4)
    with pytest.raises(ValueError, match="num_tokens = 30 must be a multiple of 2 \\* cp_size = 4"):
        shard_batch(seqs, 2, 0, num_tokens=30)


# --- FSDP2 over a 2-D mesh ------------------------------------------------------------------------


def _fsdp_rank(rank, world):
    """FSDP2 over the flattened (dp = 1, cp = W) mesh, the patch before or after ``fully_shard``,
    and with the fused loss and the final norm and head sharded as one unit (the recipe's
    layout): the W shares (scaled by W, as FSDP2 averages) give the one-device loss and
    gradients."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "cp"))
    flat = mesh["dp", "cp"]._flatten("dp_cp")
    sequences, config = _sequences(SEQLENS), _config(num_k_heads=2)
    reference = apply_context_parallel(_model(config), None)
    want = reference(**shard_batch(sequences, 1, 0).model_inputs()).loss
    want.backward()
    for patch_first, fused in ((True, False), (False, False), (True, True)):
        model = _model(config)
        if patch_first:
            apply_context_parallel(model, mesh["cp"], fused_loss=fused)
        for layer in model.model.layers:
            fully_shard(layer, mesh=flat)
        if fused:
            fully_shard([model.model.norm, model.lm_head], mesh=flat)
        fully_shard(model, mesh=flat)
        if not patch_first:
            apply_context_parallel(model, mesh["cp"])
        loss = model(**shard_batch(sequences, world, mesh["cp"].get_local_rank()).model_inputs()).loss
        (loss * world).backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        what = ("patch, then fully_shard" if patch_first else "fully_shard, then patch") + (", fused" if fused else "")
        assert rel_error(total, want.detach()) < TOL, what
        for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
            assert rel_error(p.grad.full_tensor(), q.grad) < TOL, f"{what}: {name}"


@pytest.mark.dist
def test_fsdp2_over_a_2d_mesh_in_either_order():
    run_ranks(2, _fsdp_rank)


# --- the benchmark ------------------------------------------------------------------------------


@pytest.mark.slow  # the model it times is checked against transformers above
def test_benchmark_smoke_run(tmp_path):
    """benchmarks/bench_qwen3_next.py --smoke on the CPU: its checks pass, it writes its table
    and results."""
    out = tmp_path / "qwen3_next"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TRITON_INTERPRET", None)
    run = subprocess.run(
        [sys.executable, "benchmarks/bench_qwen3_next.py", "--smoke", "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    assert "tokens/s" in run.stdout and (out / "qwen3-next-smoke.json").exists()
