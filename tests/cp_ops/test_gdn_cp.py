"""GatedDeltaNet with context parallelism on gloo ranks agrees with the same layer on one rank,
and the layer on one rank agrees with the layer written out by hand, sequence by sequence.

float64 on CPU: the CP path computes exactly the single-device arithmetic, only on
other devices' rows, so agreement is to rounding (1e-7 relative, as the issue asks);
every row is compared, padding included.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from torch._inductor.utils import run_and_get_code
from torch.utils._python_dispatch import TorchDispatchMode

from cp_ops import COMPILE_OPTIONS, GatedDeltaNet, pad_cu_seqlens, shard_thd
from cp_ops.gdn_strategies import FusedExchange
from custom_ops.testing import gdn_layouts, rel_error, thd_packing
from custom_ops.valid_tokens.reference import valid_token_mask
from tests._dist import check_gdn_overlap, gemms_write_the_first_send_buffer, run_ranks

HIDDEN, DK, DV = 12, 8, 4


def _compare_rank(rank, world, seqlens, heads, compiled, context_parallel=None, dims=(HIDDEN, DK, DV)):
    torch.manual_seed(0)  # every rank builds the same weights and global batch
    hk, hv = heads
    hidden, dk, dv = dims
    layer = GatedDeltaNet(hidden, hk, hv, dk, dv, context_parallel=context_parallel).double()
    cu, cup = pad_cu_seqlens(seqlens, world)
    num_rows = int(cup[-1])
    x = torch.randn(num_rows, hidden, dtype=torch.float64)
    real = valid_token_mask(cup, cu, num_rows)[:, None]
    grad_out = torch.randn(num_rows, hidden, dtype=torch.float64) * real  # loss on real tokens only

    x_ref = x.clone().requires_grad_()
    out_ref = layer(x_ref, cup)
    out_ref.backward(grad_out)
    ref_grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    layer.zero_grad()

    x_cp = shard_thd(x, cup, world, rank).requires_grad_()
    fn = torch.compile(layer, fullgraph=True, options=COMPILE_OPTIONS) if compiled else layer

    def step():
        out = fn(x_cp, cup, group=dist.group.WORLD)
        out.backward(shard_thd(grad_out, cup, world, rank))
        return out

    if compiled:
        out_cp, codes = run_and_get_code(step)
        check_gdn_overlap(codes)  # GEMMs run while the all-to-alls are in flight
        # the fused layouts: in_proj's GEMMs write the send buffer, no copy lays it out
        assert gemms_write_the_first_send_buffer(codes[0]), "the send buffer is not written by the GEMMs"
    else:
        out_cp = step()

    assert rel_error(out_cp, shard_thd(out_ref, cup, world, rank)) < 1e-7
    assert rel_error(x_cp.grad, shard_thd(x_ref.grad, cup, world, rank)) < 1e-7
    for name, p in layer.named_parameters():
        dist.all_reduce(p.grad)
        assert rel_error(p.grad, ref_grads[name]) < 1e-7, name

    if world == 3:  # heads that do not split over the group are refused before any collective
        with pytest.raises(ValueError, match="must be divisible by the CP size 3.*cp_ops.StatePassing\\(\\)"):
            GatedDeltaNet(HIDDEN, 2, 4, DK, DV)(x_cp.detach(), cup, group=dist.group.WORLD)


def _layer_by_hand(layer, x, cu_seqlens_padded):
    """The layer's docstring formula per padded sequence, in float64, from its parameters alone:
    F.conv1d for the conv, the gated delta rule as a loop over tokens and value heads."""
    hk, hv, dk, dv = layer.num_k_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim
    taps, group = layer.conv_kernel_size, hv // hk
    q_w, v_w = hk * dk, hv * dv
    out = torch.zeros(x.shape[0], layer.hidden_size, dtype=torch.float64)
    bounds = cu_seqlens_padded.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        n = end - start
        if n == 0:
            continue
        proj = x[start:end] @ layer.in_proj.weight.t()
        qkv, z, b, a = torch.split(proj, [2 * q_w + v_w, v_w, hv, hv], dim=-1)
        conv = F.conv1d(qkv.t()[None], layer.conv1d.weight, padding=taps - 1, groups=qkv.shape[1])[0, :, :n].t()
        conv = F.silu(conv)
        q = conv[:, :q_w].reshape(n, hk, dk)
        k = conv[:, q_w : 2 * q_w].reshape(n, hk, dk)
        v = conv[:, 2 * q_w :].reshape(n, hv, dv)
        q = q / (q.square().sum(-1, keepdim=True) + 1e-6).sqrt()
        k = k / (k.square().sum(-1, keepdim=True) + 1e-6).sqrt()
        g = -layer.A_log.exp() * F.softplus(a + layer.dt_bias)
        beta = torch.sigmoid(b)
        o = torch.zeros(n, hv, dv, dtype=torch.float64)
        for h in range(hv):
            kh = h // group
            state = torch.zeros(dk, dv, dtype=torch.float64)
            for t in range(n):
                state = state * g[t, h].exp()
                state = state + torch.outer(k[t, kh], beta[t, h] * (v[t, h] - state.t() @ k[t, kh]))
                o[t, h] = dk**-0.5 * (state.t() @ q[t, kh])
        normed = o / (o.square().mean(-1, keepdim=True) + layer.norm.eps).sqrt() * layer.norm.weight
        gated = normed * F.silu(z.view(n, hv, dv))
        out[start:end] = gated.reshape(n, v_w) @ layer.out_proj.weight.t()
    return out


@given(gdn_layouts(max_seqs=4, max_len=10), st.sampled_from([(1, 1), (1, 2), (2, 2), (2, 4)]), st.sampled_from([2, 3, 4]),
       st.sampled_from([1, 2, 4]))  # fmt: skip
def test_one_rank_matches_the_layer_by_hand(seqlens, heads, taps, cp_size):
    """The layer with no group (what every CP test compares with) against its formula written out
    per sequence: padded to 2W of several W, with empty and one-token sequences."""
    torch.manual_seed(len(seqlens) + taps)
    layer = GatedDeltaNet(HIDDEN, *heads, DK, DV, conv_kernel_size=taps).double()
    with torch.no_grad():  # every parameter random but A_log (decays stay in (0, 1))
        for p in (layer.in_proj.weight, layer.conv1d.weight, layer.out_proj.weight):
            p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
        for p in (layer.dt_bias, layer.norm.weight):
            p.copy_(torch.randn_like(p))
    cup = thd_packing(cp_size, seqlens).cu_seqlens_padded
    x = torch.randn(int(cup[-1]), HIDDEN, dtype=torch.float64)
    with torch.no_grad():
        assert rel_error(layer(x, cup), _layer_by_hand(layer, x, cup)) < 1e-10


@pytest.mark.dist
@pytest.mark.parametrize(
    "world,heads",
    [(2, (2, 4)), (3, (3, 6)), pytest.param(4, (4, 8), marks=pytest.mark.slow)],
)  # W = 8: test_eight_ranks.py
def test_cp_layer_matches_one_rank(world, heads):
    run_ranks(world, _compare_rank, [9, 0, 1, 23, 6], heads, False)


@pytest.mark.dist
def test_cp_layer_fused_exchange_eager_matches_one_rank():
    """The fused exchange (the compiled default) run eagerly, W = 3: values and gradients."""
    run_ranks(3, _compare_rank, [9, 0, 1, 23, 6], (3, 6), False, FusedExchange())


# The fast tier compiles the layer at W = 2 by chunk states with Inductor (test_gdn_states.py) and
# by heads inside the whole model through AOTAutograd (test_transformers.py), and tests the
# scheduling pass on hand-built graphs (test_comm.py).
@pytest.mark.slow
@pytest.mark.dist
def test_cp_layer_compiled_matches_one_rank():
    """Compiled, at widths where the GEMMs outweigh the elementwise work (hidden 64, as in a
    real layer), so that the scheduling pass gives each backward exchange a GEMM."""
    run_ranks(2, _compare_rank, [90, 0, 1, 230, 60], (2, 4), True, None, (64, 16, 16))


class _TwoLayers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = (GatedDeltaNet(64, 2, 4, 16, 16) for _ in range(2))

    def forward(self, x, cu_seqlens_padded, group=None):
        return self.second(self.first(x, cu_seqlens_padded, group), cu_seqlens_padded, group)


def _two_layers_rank(rank, world):
    torch.manual_seed(0)
    model = _TwoLayers().double()
    _, cup = pad_cu_seqlens([90, 0, 1, 230, 60], world)
    x = torch.randn(int(cup[-1]), 64, dtype=torch.float64)
    grad_out = torch.randn_like(x)
    x_ref = x.clone().requires_grad_()
    out_ref = model(x_ref, cup)
    out_ref.backward(grad_out)

    x_cp = shard_thd(x, cup, world, rank).requires_grad_()
    fn = torch.compile(model, fullgraph=True, options=COMPILE_OPTIONS)

    def step():
        out = fn(x_cp, cup, group=dist.group.WORLD)
        out.backward(shard_thd(grad_out, cup, world, rank))
        return out

    out_cp, codes = run_and_get_code(step)
    check_gdn_overlap(codes, exchanges=4)
    assert rel_error(out_cp, shard_thd(out_ref.detach(), cup, world, rank)) < 1e-7
    assert rel_error(x_cp.grad, shard_thd(x_ref.grad, cup, world, rank)) < 1e-7


@pytest.mark.slow  # a second compile of the layer on two ranks; one layer's is the fast tier's
@pytest.mark.dist
def test_two_compiled_layers_overlap_every_exchange():
    """Two layers in one compiled graph, W = 2: each of the four exchanges a pass has a GEMM
    beside it (the scheduling pass's windows across layers, its one-window deferral bound
    included), and the result is the one-rank result. The pass's windows across exchanges and
    its deferral bound are also tested on hand-built graphs (tests/cp_ops/test_comm.py)."""
    run_ranks(2, _two_layers_rank)


class _RecordOps(TorchDispatchMode):
    """Records every op that reaches the dispatcher below autograd, with its arguments."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append((func, args))
        return func(*args, **(kwargs or {}))

    def names(self):
        return [func.name() for func, _ in self.calls]


def _record_exchanges(rank, world):
    """What the layer hands to the two exchanges: q, k, v, b, a out in the send layout (z
    stays; received in rank order, never reordered: the conv gathers their rows), the
    delta-rule output back; and the send layout is sections_to_rank_blocks of the
    section-layout projection. The section-layout form of the layer gives the same result."""
    from custom_ops import sections_to_rank_blocks

    torch.manual_seed(0)  # the same weights on every rank
    layer = GatedDeltaNet(HIDDEN, 2, 4, DK, DV).double()
    _, cup = pad_cu_seqlens([9, 0, 1, 23, 6], world)
    x_cp = shard_thd(torch.randn(int(cup[-1]), HIDDEN, dtype=torch.float64), cup, world, rank)
    layer.context_parallel = FusedExchange()  # eager runs the section exchange by default
    with _RecordOps() as seen:
        out = layer(x_cp, cup, group=dist.group.WORLD)
    layer.context_parallel = None
    q, k, v, z, b, a = layer._sections()
    rows = x_cp.shape[0]
    exchanged = [tuple(args[0].shape) for func, args in seen.calls if func.name() == "_c10d_functional::all_to_all_single"]
    # the send buffer [W, rows, F/W] goes out flattened to its rows; the output comes back
    assert exchanged == [(world * rows, (q + k + v + b + a) // world), (rows * world, v // world)]
    names = seen.names()
    assert "cp_ops::causal_conv1d_gather" in names and "cp_ops::causal_conv1d" not in names
    assert "cp_ops::thd_rank_to_seq_order" not in names  # the received rows stay in rank order

    want = sections_to_rank_blocks(layer._project(x_cp)[0], layer._exchanged_sections(), world)
    assert rel_error(layer._project_send_blocks(x_cp, world), want) < 1e-12
    assert rel_error(layer(x_cp, cup, group=dist.group.WORLD), out) < 1e-12  # eager default: sections


@pytest.mark.dist
def test_the_gate_z_is_not_exchanged_and_the_send_layout():
    run_ranks(2, _record_exchanges)
