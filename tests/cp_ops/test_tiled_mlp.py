"""cp_ops.integrations.tiled_mlp.apply_tiled_mlp: a transformers Qwen3-Next's SwiGLU MLPs (the dense
ones and the mixture's shared expert) over row tiles give the unpatched model's loss, logits and
every gradient (float64); models it cannot patch are refused before anything changes."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

pytest.importorskip("transformers")

from cp_ops.integrations.tiled_mlp import apply_tiled_mlp  # noqa: E402
from tests.cp_ops.test_transformers import SEQLENS, _config, _model, _reference, _sequences  # noqa: E402


def test_tiled_model_equals_transformers():
    model = _model(_config())
    tiled = apply_tiled_mlp(copy.deepcopy(model), tile_rows=4)
    patched = [n for n, m in tiled.named_modules() if "forward" in m.__dict__]
    assert patched == ["model.layers.0.mlp", "model.layers.1.mlp", "model.layers.2.mlp.shared_expert"]
    sequences = _sequences(SEQLENS)
    (loss, logits, grads), (want_loss, want_logits, want_grads) = _reference(tiled, sequences), _reference(model, sequences)
    assert torch.allclose(loss, want_loss, rtol=1e-12, atol=0)
    for got, want in zip(logits, want_logits):
        assert torch.allclose(got, want, rtol=1e-10, atol=1e-12)
    for name, grad in grads.items():
        assert torch.allclose(grad, want_grads[name], rtol=1e-9, atol=1e-12), name
    assert tiled.state_dict().keys() == model.state_dict().keys()


def test_refuses_what_it_cannot_tile():
    with pytest.raises(ValueError, match="has no SwiGLU MLP"):
        apply_tiled_mlp(nn.Sequential(nn.Linear(4, 4)))
    gelu = _model(_config(hidden_act="gelu"))
    with pytest.raises(ValueError, match="computes SiLU, got act_fn GELU"):
        apply_tiled_mlp(gelu)
    assert not any("forward" in m.__dict__ for m in gelu.modules()), "a refused model was changed"
    biased = _model(_config(moe=False))
    biased.model.layers[1].mlp.up_proj.bias = nn.Parameter(torch.zeros(40, dtype=torch.float64))
    with pytest.raises(ValueError, match="model.layers.1.mlp: the tiled MLP takes bias-free projections"):
        apply_tiled_mlp(biased)
    with pytest.raises(ValueError, match="tile_rows must be None or at least 1"):
        apply_tiled_mlp(_model(_config()), tile_rows=0)
