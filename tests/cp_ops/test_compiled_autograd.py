"""Both layers under compiled autograd: the forward and ``backward()`` in one ``torch.compile``d
function with ``torch._dynamo.config.compiled_autograd`` set, as PyTorch documents it. The
backward of every op (the custom ops' registered autograd included) is traced into one graph;
the gradients equal those of the ordinary autograd engine, and later steps reuse the graphs."""

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from cp_ops import Attention, GatedDeltaNet, pad_cu_seqlens
from custom_ops.testing import TOLERANCE, random_tensor, rel_error

HIDDEN = 24


def _layer(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "gdn":
        layer = GatedDeltaNet(hidden_size=HIDDEN, num_k_heads=2, num_v_heads=4, head_k_dim=6, head_v_dim=5)
    else:
        layer = Attention(HIDDEN, 4, 2, 8, partial_rotary_factor=0.25)
    with torch.no_grad():  # norm weights too: zeros would hide their gradients
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * (HIDDEN**-0.5 if p.dim() == 2 else 0.3))
    return layer


# the GDN layer in the slow tier: compiled autograd runs custom ops' autograd formulas alike for both layers
@pytest.mark.slow  # the fast tier compiles both layers with the autograd engine
@pytest.mark.parametrize("kind", ["gdn", "attention"])
def test_compiled_autograd_matches_the_autograd_engine(kind):
    layer = _layer(kind)
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True)
    seqlens = [9, 0, 14, 5]
    cu, cup = pad_cu_seqlens(seqlens, 2)
    x = random_tensor((int(cup[-1]), HIDDEN), torch.float32)
    upstream = random_tensor(x.shape, torch.float32)
    args = (cup,) if kind == "gdn" else (cu, cup)

    def grads(step):
        leaf = x.clone().requires_grad_()
        for p in layer.parameters():
            p.grad = None
        step(leaf)
        return [leaf.grad] + [p.grad.clone() for p in layer.parameters()]

    want = grads(lambda leaf: compiled(leaf, *args).backward(upstream))

    counters.clear()

    def fwd_bwd(leaf):
        compiled(leaf, *args).backward(upstream)

    with torch._dynamo.config.patch(compiled_autograd=True):
        fwd_bwd = torch.compile(fwd_bwd)  # torch.compile keeps the config it was called under
        for _ in range(2):
            got = grads(fwd_bwd)
            for g, w in zip(got, want):
                assert g is not None and rel_error(g, w) < TOLERANCE[torch.float32]
    assert counters["compiled_autograd"]["captures"] == 1
