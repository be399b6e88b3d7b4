"""Multi-rank agreement on GPUs with NCCL at W = 2, 4 and 8 ranks (each W that the visible GPUs
allow; the others are skipped): the layout ops on every rank's GPU, the fused all-to-all, the
GDN layer, all-gather CP attention and the Attention layer.

Test ids carry the CP size (``[W2]``, ``[W4-compiled]``, ...), so ``-k W8`` runs one size.
Shapes work at every W: section widths and GDN heads divisible by 8, sequence lengths
padded with ``pad_cu_seqlens(lens, W)`` (multiples of 2W), including an empty and a
one-token sequence. bf16 tolerances as Megatron-LM uses with CP (5e-3 relative): the CP
layer runs the same kernels on the same rows as one GPU does, except that the
projections see other row blocks. Attention on CP ranks runs the kernels on other tile
boundaries than one GPU (query tiles start at each local chunk), so its bf16 rounding
differs more: 1e-2, TOLERANCE[bf16].
"""

import pytest
import torch
import torch.distributed as dist
from torch._inductor.utils import run_and_get_code

import cp_ops
import custom_ops
from cp_ops import Attention, GatedDeltaNet, StatePassing, local_cu_seqlens, pad_cu_seqlens, shard_thd, unshard_thd
from custom_ops import ag_thd_attention
from custom_ops.testing import TOLERANCE, rel_error
from tests._dist import check_gdn_overlap, run_ranks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.dist,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]

WORLDS = [
    pytest.param(
        w,
        id=f"W{w}",
        marks=pytest.mark.skipif(
            torch.cuda.device_count() < w, reason=f"needs {w} GPUs, {torch.cuda.device_count()} visible"
        ),
    )
    for w in (2, 4, 8)
]
COMPILED = [pytest.param(False, id="eager"), pytest.param(True, id="compiled")]

SECTIONS = [256, 256, 512, 512, 8, 8]  # every width divisible by 8
SEQLENS = [1000, 0, 1, 3000, 77]


def _layout_rank(rank, world):
    """The layout ops on this rank's GPU (cuda:rank) at CP size W against their torch references,
    and the W shards gathered over NCCL against the whole batch."""
    torch.manual_seed(0)
    cu, cup = pad_cu_seqlens(SEQLENS, world)
    padded = cup.diff()
    assert all(int(p) % (2 * world) == 0 and int(p) >= n for p, n in zip(padded, SEQLENS))
    rows, per_rank = int(cup[-1]), int(cup[-1]) // world
    dev = torch.device("cuda", rank)
    x = torch.randn(rows, 4, 32, dtype=torch.bfloat16)
    x_d, cup_d = x.to(dev), cup.to(dev)

    rank_order = custom_ops.thd_seq_to_rank_order(x_d, cup_d, world)
    assert torch.equal(rank_order.cpu(), custom_ops.thd_seq_to_rank_order_reference(x, cup, world))
    assert torch.equal(custom_ops.thd_rank_to_seq_order(rank_order, cup_d, world), x_d)
    assert torch.equal(
        custom_ops.thd_rank_to_seq_order(rank_order, cup_d, world).cpu(),
        custom_ops.thd_rank_to_seq_order_reference(rank_order.cpu(), cup, world),
    )
    local = shard_thd(x_d, cup_d, world, rank)
    assert torch.equal(local, rank_order[rank * per_rank : (rank + 1) * per_rank])
    shards = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(shards, local)
    assert torch.equal(unshard_thd(shards, cup_d, world), x_d)

    # valid-token copies over the global layout and over this rank's shard (its first chunks' real tokens)
    chunk = padded // (2 * world)
    local_lens = [min(max(n - rank * int(c), 0), int(c)) for n, c in zip(SEQLENS, chunk)]
    local_cu, _ = pad_cu_seqlens(local_lens, 1)
    for offsets, lens_cu, n in ((cup, cu, rows), (local_cu_seqlens(cup, world), local_cu, per_rank)):
        dst, src = torch.randn(n, 4, 32, dtype=torch.bfloat16), torch.randn(n, 4, 32, dtype=torch.bfloat16)
        want = custom_ops.thd_copy_valid_tokens_reference(dst, src, offsets, lens_cu)
        args = (src.to(dev), offsets.to(dev), lens_cu.to(dev))
        assert torch.equal(custom_ops.thd_copy_valid_tokens(dst.to(dev), *args).cpu(), want)
        inplace = dst.to(dev)
        custom_ops.thd_copy_valid_tokens_(inplace, *args)
        assert torch.equal(inplace.cpu(), want)


@pytest.mark.parametrize("world", WORLDS)
def test_layout_ops_nccl(world):
    run_ranks(world, _layout_rank, backend="nccl")


def _cp2hp_rank(rank, world):
    torch.manual_seed(0)
    _, cup = pad_cu_seqlens(SEQLENS, world)
    x = torch.randn(int(cup[-1]), sum(SECTIONS), dtype=torch.bfloat16)
    x_cp = shard_thd(x, cup, world, rank).cuda().requires_grad_()
    cup = cup.cuda()
    x_hp = custom_ops.thd_cp2hp(x_cp, cup, SECTIONS, dist.group.WORLD)
    assert torch.equal(x_hp.cpu(), custom_ops.thd_cp2hp_reference(x, SECTIONS, world, rank))
    back = custom_ops.thd_hp2cp(x_hp, cup, [s // world for s in SECTIONS], dist.group.WORLD)
    assert torch.equal(back, x_cp)
    grad = torch.randn_like(x_hp)
    x_hp.backward(grad)
    assert torch.equal(x_cp.grad, custom_ops.thd_hp2cp(grad, cup, [s // world for s in SECTIONS], dist.group.WORLD))
    compiled = torch.compile(lambda t: custom_ops.thd_cp2hp(t, cup, SECTIONS, dist.group.WORLD), fullgraph=True)
    assert torch.equal(compiled(x_cp.detach()), x_hp.detach())


@pytest.mark.parametrize("world", WORLDS)
def test_cp2hp_nccl(world):
    run_ranks(world, _cp2hp_rank, backend="nccl")


def _gdn_rank(rank, world, compiled, states=False):
    torch.manual_seed(0)
    strategy = StatePassing() if states else None
    # Hk = 8: W = 8 gets one key head by heads
    layer = GatedDeltaNet(256, 8, 16, 64, 64, context_parallel=strategy).to("cuda", torch.bfloat16)
    cu, cup = pad_cu_seqlens([700, 0, 1, 2000, 300], world, device="cuda")
    num_rows = int(cup[-1])
    x = torch.randn(num_rows, 256, device="cuda", dtype=torch.bfloat16)
    grad_out = torch.randn_like(x)

    # The reference runs the same way (compiled or eager) on one rank over the global batch, so
    # CP is the only difference: compiled bf16 and eager bf16 differ by about as much as the
    # tolerance on their own (Inductor keeps fp32 between fused elementwise ops; 2-4e-3 on
    # the CPU references), which would hide nothing and flag noise.
    fn = torch.compile(layer, fullgraph=True, options=cp_ops.COMPILE_OPTIONS) if compiled else layer
    x_ref = x.clone().requires_grad_()
    out_ref = fn(x_ref, cup)
    out_ref.backward(grad_out)
    ref_grads = {n: p.grad.float().clone() for n, p in layer.named_parameters()}
    layer.zero_grad()

    x_cp = shard_thd(x, cup, world, rank).requires_grad_()

    def step():
        out = fn(x_cp, cup, group=dist.group.WORLD)
        out.backward(shard_thd(grad_out, cup, world, rank))
        return out

    if compiled and not states:  # GEMMs run while the all-to-alls are in flight
        out_cp, codes = run_and_get_code(step)
        check_gdn_overlap(codes)
    else:
        out_cp = step()
    errors = {
        "out": rel_error(out_cp, shard_thd(out_ref, cup, world, rank)),
        "dx": rel_error(x_cp.grad, shard_thd(x_ref.grad, cup, world, rank)),
    }
    for name, p in layer.named_parameters():
        g = p.grad.float()
        dist.all_reduce(g)
        errors[name] = rel_error(g, ref_grads[name])
    assert max(errors.values()) < 5e-3, errors


@pytest.mark.parametrize("compiled", COMPILED)
@pytest.mark.parametrize("world", WORLDS)
def test_gdn_cp_layer_nccl(world, compiled):
    run_ranks(world, _gdn_rank, compiled, backend="nccl")


@pytest.mark.parametrize("compiled", COMPILED)
@pytest.mark.parametrize("world", WORLDS)
def test_gdn_cp_layer_by_chunk_states_nccl(world, compiled):
    """The layer by chunk states (FLA's kernels from composed states) against one GPU, bf16."""
    run_ranks(world, _gdn_rank, compiled, True, backend="nccl")


def _ag_attention_rank(rank, world, compiled):
    torch.manual_seed(0)
    group = dist.group.WORLD
    cu, cup = pad_cu_seqlens(SEQLENS, world, device="cuda")
    rows = int(cup[-1])
    q = torch.randn(rows, 8, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(rows, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    dout = torch.randn_like(q)
    lens, starts = cu[1:] - cu[:-1], cup[:-1]
    for causal, window in ((True, (-1, -1)), (True, (256, -1)), (False, (100, 50))):
        ref = [t.clone().requires_grad_() for t in (q, k, v)]
        out_ref, _ = custom_ops.varlen_attention(
            *ref, starts, lens, torch.zeros_like(lens), starts, lens, causal=causal, window=window
        )
        out_ref.backward(dout)
        want = [shard_thd(t, cup, world, rank) for t in (out_ref.detach(), *(t.grad for t in ref))]

        def step(q_cp, k_cp, v_cp, launches=1, head_groups=1):
            return ag_thd_attention(q_cp, k_cp, v_cp, cu, cup, causal=causal, window=window, group=group,
                                    launches=launches, head_groups=head_groups)  # fmt: skip

        fns = [(step, 1, 1), (step, 2, 1), (step, 1, 2)]
        if compiled:
            fns = [(torch.compile(step, fullgraph=True, dynamic=True), 1, 1),
                   (torch.compile(step, fullgraph=True, dynamic=True, options=cp_ops.COMPILE_OPTIONS), 1, 2)]  # fmt: skip
        for fn, launches, groups in fns:
            local = [shard_thd(t, cup, world, rank).requires_grad_() for t in (q, k, v)]
            out = fn(*local, launches=launches, head_groups=groups)
            out.backward(shard_thd(dout, cup, world, rank))
            for name, a, b in zip(("out", "dq", "dk", "dv"), (out, *(t.grad for t in local)), want):
                err = rel_error(a, b)
                assert err < TOLERANCE[torch.bfloat16], (
                    f"{name} {causal} {window} launches={launches} head_groups={groups}: {err:.3g}"
                )


@pytest.mark.parametrize("compiled", COMPILED)
@pytest.mark.parametrize("world", WORLDS)
def test_ag_thd_attention_nccl(world, compiled):
    run_ranks(world, _ag_attention_rank, compiled, backend="nccl")


def _attention_layer_rank(rank, world, compiled):
    torch.manual_seed(0)
    layer = Attention(1024, 8, 2, 128).to("cuda", torch.bfloat16)
    with torch.no_grad():  # the norm weights start at zero; random ones exercise their gradients
        layer.q_norm.weight.normal_(0, 0.3)
        layer.k_norm.weight.normal_(0, 0.3)
    cu, cup = pad_cu_seqlens([700, 0, 1, 2000, 300], world, device="cuda")
    x = torch.randn(int(cup[-1]), 1024, device="cuda", dtype=torch.bfloat16)
    grad_out = torch.randn_like(x)

    x_ref = x.clone().requires_grad_()
    out_ref = layer(x_ref, cu, cup)
    out_ref.backward(grad_out)
    ref_grads = {n: p.grad.float().clone() for n, p in layer.named_parameters()}
    layer.zero_grad()

    x_cp = shard_thd(x, cup, world, rank).requires_grad_()
    fn = torch.compile(layer, fullgraph=True) if compiled else layer
    out_cp = fn(x_cp, cu, cup, group=dist.group.WORLD)
    out_cp.backward(shard_thd(grad_out, cup, world, rank))
    tol = TOLERANCE[torch.bfloat16]
    assert rel_error(out_cp, shard_thd(out_ref, cup, world, rank)) < tol
    assert rel_error(x_cp.grad, shard_thd(x_ref.grad, cup, world, rank)) < tol
    for name, p in layer.named_parameters():
        g = p.grad.float()
        dist.all_reduce(g)
        assert rel_error(g, ref_grads[name]) < tol, name


@pytest.mark.parametrize("compiled", COMPILED)
@pytest.mark.parametrize("world", WORLDS)
def test_attention_layer_nccl(world, compiled):
    run_ranks(world, _attention_layer_rank, compiled, backend="nccl")
