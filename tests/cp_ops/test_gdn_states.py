"""GatedDeltaNet CP by state passing (cp_ops.gdn_strategies) against the one-rank layer, float64.

The state maps compose exactly (a sequence split anywhere runs from the composed state of its
head); the strategy on gloo ranks equals the layer on one rank to 1e-10 in outputs, input
gradients and every parameter's gradient, at W = 2, 3, 4, and at W = 6 and 8 with 4 key heads
(more ranks than key heads), on packings with sequences of length 0 and 1, shorter than a
chunk and longer than a rank's share, so that conv halos and states cross several ranks.
"""

import pytest
import torch
import torch.distributed as dist
from torch._dynamo.utils import counters

from cp_ops import COMPILE_OPTIONS, GatedDeltaNet, pad_cu_seqlens, shard_thd
from cp_ops.gdn_strategies import StatePassing, chunk_gated_delta_rule_cp_states
from custom_ops import (
    chunk_gated_delta_rule,
    chunk_gated_delta_rule_reference,
    chunk_gated_delta_rule_with_state,
    state_maps,
)
from custom_ops.testing import rel_error
from custom_ops.valid_tokens.reference import valid_token_mask
from tests._dist import run_ranks
from tests.custom_ops.test_gdn_ops import _gdn_case

TOL = 1e-10
HIDDEN, DK, DV = 12, 4, 3
LAYOUTS = ([37, 0, 1, 3, 20], [1, 64], [0, 5, 2, 9, 1, 0])


def test_state_maps_compose_a_split_sequence():
    """Rows [0, n) then [n, L): the second part from ``M S_head + S`` of its own map equals the
    whole sequence run at once, outputs and final state."""
    length, dv = 23, 3
    q, k, v, g, beta, cu = _gdn_case([length], 2, 2, 5, dv, torch.float64)
    whole_o, whole_final = chunk_gated_delta_rule_with_state(q, k, v, g, beta, cu)
    for n in (0, 1, 9, length):
        head_o, head_final = chunk_gated_delta_rule_with_state(*(t[:n] for t in (q, k, v, g, beta)),
                                                               torch.tensor([0, n]))  # fmt: skip
        tail = [t[n:] for t in (q, k, v, g, beta)]
        maps = state_maps(*tail, torch.tensor([0, length - n]))
        composed = maps[..., dv:] @ head_final + maps[..., :dv]
        tail_o, tail_final = chunk_gated_delta_rule_with_state(*tail, torch.tensor([0, length - n]), None, head_final)
        assert rel_error(composed, whole_final) < TOL and rel_error(tail_final, whole_final) < TOL
        assert rel_error(torch.cat([head_o, tail_o]), whole_o) < TOL


def test_one_rank_runs_both_chunks_in_order():
    """W = 1: chunks 0 and 1 of each sequence, the second from the first's composed state."""
    cu, cup = pad_cu_seqlens(LAYOUTS[0], 1)
    *inputs, cu_padded = _gdn_case((cup[1:] - cup[:-1]).tolist(), 2, 2, DK, DV, torch.float64)
    assert torch.equal(cu_padded, cup.to(cu_padded.dtype))
    got = chunk_gated_delta_rule_cp_states(*inputs, cup, None)
    assert rel_error(got, chunk_gated_delta_rule(*inputs, cup)) < TOL


def test_wide_heads_take_two_map_calls():
    """dk + dv past the kernels' 256: the map pass runs as two calls (v from zeros, 0 from I), the
    backward from the first one's saved tensors; W = 1, output and every gradient."""
    cu, cup = pad_cu_seqlens(LAYOUTS[0], 1)
    *inputs, _ = _gdn_case((cup[1:] - cup[:-1]).tolist(), 1, 2, 136, 130, torch.float64)
    leaves = [t.clone().requires_grad_() for t in inputs]
    ref = [t.clone().requires_grad_() for t in inputs]
    o = chunk_gated_delta_rule_cp_states(*leaves, cup, None)
    want = chunk_gated_delta_rule(*ref, cup)
    grad = torch.randn_like(o)
    o.backward(grad)
    want.backward(grad)
    assert rel_error(o, want) < TOL
    for a, e in zip(leaves, ref):
        assert rel_error(a.grad, e.grad) < TOL


def _compare_rank(rank, world, heads, layouts, compiler=None):
    """The layer with :class:`StatePassing` on this rank's rows against the same layer on one
    rank (the whole batch), for each packing: output, x gradient, summed parameter gradients;
    ``compiler``: the layer compiled with that backend (Inductor with COMPILE_OPTIONS)."""
    torch.manual_seed(0)
    hk, hv = heads
    layer = GatedDeltaNet(HIDDEN, hk, hv, DK, DV, context_parallel=StatePassing()).double()
    fn = layer
    if compiler == "inductor":
        fn = torch.compile(layer, fullgraph=True, options=COMPILE_OPTIONS)
    elif compiler is not None:
        fn = torch.compile(layer, fullgraph=True, backend=compiler)
    graphs = None
    for seqlens in layouts:
        cu, cup = pad_cu_seqlens(seqlens, world)
        num_rows = int(cup[-1])
        x = torch.randn(num_rows, HIDDEN, dtype=torch.float64)
        grad_out = torch.randn(num_rows, HIDDEN, dtype=torch.float64) * valid_token_mask(cup, cu, num_rows)[:, None]
        layer.zero_grad()
        x_ref = x.clone().requires_grad_()
        layer(x_ref, cup).backward(grad_out)
        want = {n: p.grad.clone() for n, p in layer.named_parameters()}
        layer.zero_grad()
        x_cp = shard_thd(x, cup, world, rank).requires_grad_()
        out = fn(x_cp, cup, group=dist.group.WORLD)
        out.backward(shard_thd(grad_out, cup, world, rank))
        with torch.no_grad():
            out_ref = layer(x, cup)
        assert rel_error(out, shard_thd(out_ref, cup, world, rank)) < TOL, seqlens
        assert rel_error(x_cp.grad, shard_thd(x_ref.grad, cup, world, rank)) < TOL, seqlens
        for name, p in layer.named_parameters():
            dist.all_reduce(p.grad)
            assert rel_error(p.grad, want[name]) < TOL, (seqlens, name)
        graphs = graphs if graphs is not None else counters["stats"]["unique_graphs"]
    if compiler is not None:
        assert counters["stats"]["unique_graphs"] == graphs, "a new packing recompiled"
        assert not counters["graph_break"], dict(counters["graph_break"])


@pytest.mark.dist
@pytest.mark.parametrize("world,heads", [(2, (2, 4)), (3, (1, 2)), pytest.param(4, (4, 8), marks=pytest.mark.slow)])
def test_state_passing_matches_one_rank(world, heads):
    run_ranks(world, _compare_rank, heads, (*LAYOUTS, [], [0], [0, 0]))  # and batches with no rows


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("world", [6, 8])
def test_state_passing_with_more_ranks_than_key_heads(world):
    run_ranks(world, _compare_rank, (4, 8), LAYOUTS[:2])


@pytest.mark.dist
# the fast tier traces and differentiates it (AOTAutograd); Inductor's CPU code for it takes a
# minute of the fast tier, so it is in the slow one (and on the GPU below)
@pytest.mark.parametrize("compiler", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_state_passing_compiles_whole_and_once(compiler):
    """fullgraph=True on 2 ranks, equal to one rank; a second packing of the same size reuses
    the graph: no graph break, no recompile."""
    run_ranks(2, _compare_rank, (2, 4), ([37, 0, 1, 3, 20], [20, 0, 1, 3, 37]), compiler)


@pytest.mark.gpu
@pytest.mark.parametrize("seqlens", [[300, 0, 1, 200, 64], [1000, 24]])
@pytest.mark.parametrize("dim", [64, 128])
def test_cuda_dual_chunks_match_the_reference_bf16(seqlens, dim):
    """The state-passing core on CUDA (the map pass's forward kernels, the backward from the
    composed states with the map pass's saved tensors) at W = 1 in bf16 against the float64
    reference of the whole sequences: output and every gradient (bf16's error-RMS bounds, as the
    core's own GPU tests). Head dim 64: one map call on FLA's kernels; 128: two calls on
    FlashQLA's where it is installed."""
    pytest.importorskip("fla")
    cu, cup = pad_cu_seqlens(seqlens, 1)
    *inputs, _ = _gdn_case((cup[1:] - cup[:-1]).tolist(), 4, 2, dim, dim, torch.bfloat16, "cuda")
    leaves = [t.clone().requires_grad_() for t in inputs]
    o = chunk_gated_delta_rule_cp_states(*leaves, cup.cuda(), None)
    grad_o = torch.randn_like(o)
    o.backward(grad_o)
    ref = [t.detach().double().cpu().requires_grad_() for t in inputs]
    o_ref = chunk_gated_delta_rule_reference(*ref, cup)
    o_ref.backward(grad_o.double().cpu())
    assert rel_error(o.cpu(), o_ref) < 5e-3
    for name, a, e in zip(("q", "k", "v", "g", "beta"), leaves, ref):
        assert rel_error(a.grad.cpu(), e.grad) < 1e-2, name


@pytest.mark.gpu
def test_cuda_dual_chunks_compile_fullgraph():
    """The state-passing core on CUDA under torch.compile(fullgraph=True): the map pass resolves
    its calls' backends while Dynamo traces it (FlashQLA's where it is installed, at head dim
    128), and the graph gives the eager core's output and gradients."""
    pytest.importorskip("fla")
    cu, cup = pad_cu_seqlens([1000, 24], 1)
    *inputs, _ = _gdn_case((cup[1:] - cup[:-1]).tolist(), 4, 2, 128, 128, torch.bfloat16, "cuda")
    grad_o, runs = None, []
    for fn in (chunk_gated_delta_rule_cp_states, torch.compile(chunk_gated_delta_rule_cp_states, fullgraph=True)):
        leaves = [t.clone().requires_grad_() for t in inputs]
        o = fn(*leaves, cup.cuda(), None)
        grad_o = torch.randn_like(o) if grad_o is None else grad_o
        o.backward(grad_o)
        runs.append([o, *(t.grad for t in leaves)])
    for name, eager, compiled in zip(("o", "q", "k", "v", "g", "beta"), *runs):
        assert rel_error(compiled, eager) < 1e-3, name
