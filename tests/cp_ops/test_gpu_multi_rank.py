"""Multi-rank agreement on GPUs with NCCL (2 ranks): the fused all-to-all and the GDN layer.

Skipped unless 2 CUDA devices are visible. bf16 tolerances as Megatron-LM uses
with CP (5e-3 relative): the CP layer runs the same kernels on the same rows as
one GPU does, except that the projections see other row blocks.
"""

import pytest
import torch
import torch.distributed as dist

import cp_ops
from cp_ops import GatedDeltaNet, pad_cu_seqlens, shard_thd
from custom_ops.testing import rel_error
from tests._dist import run_ranks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.dist,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]

SECTIONS = [256, 256, 512, 512, 8, 8]


def _cp2hp_rank(rank, world):
    torch.manual_seed(0)
    _, cup = pad_cu_seqlens([1000, 0, 1, 3000, 77], world)
    x = torch.randn(int(cup[-1]), sum(SECTIONS), dtype=torch.bfloat16)
    x_cp = shard_thd(x, cup, world, rank).cuda().requires_grad_()
    cup = cup.cuda()
    x_hp = cp_ops.thd_cp2hp(x_cp, cup, SECTIONS, dist.group.WORLD)
    assert torch.equal(x_hp.cpu(), cp_ops.thd_cp2hp_reference(x, SECTIONS, world, rank))
    back = cp_ops.thd_hp2cp(x_hp, cup, [s // world for s in SECTIONS], dist.group.WORLD)
    assert torch.equal(back, x_cp)
    grad = torch.randn_like(x_hp)
    x_hp.backward(grad)
    assert torch.equal(x_cp.grad, cp_ops.thd_hp2cp(grad, cup, [s // world for s in SECTIONS], dist.group.WORLD))
    compiled = torch.compile(lambda t: cp_ops.thd_cp2hp(t, cup, SECTIONS, dist.group.WORLD), fullgraph=True)
    assert torch.equal(compiled(x_cp.detach()), x_hp.detach())


def test_cp2hp_nccl():
    run_ranks(2, _cp2hp_rank, backend="nccl")


def _gdn_rank(rank, world, compiled):
    torch.manual_seed(0)
    layer = GatedDeltaNet(256, 4, 8, 64, 64).to("cuda", torch.bfloat16)
    cu, cup = pad_cu_seqlens([700, 0, 1, 2000, 300], world, device="cuda")
    num_rows = int(cup[-1])
    x = torch.randn(num_rows, 256, device="cuda", dtype=torch.bfloat16)
    grad_out = torch.randn_like(x)

    x_ref = x.clone().requires_grad_()
    out_ref = layer(x_ref, cup)
    out_ref.backward(grad_out)
    ref_grads = {n: p.grad.float().clone() for n, p in layer.named_parameters()}
    layer.zero_grad()

    x_cp = shard_thd(x, cup, world, rank).requires_grad_()
    fn = torch.compile(layer, fullgraph=True) if compiled else layer
    out_cp = fn(x_cp, cup, group=dist.group.WORLD)
    out_cp.backward(shard_thd(grad_out, cup, world, rank))
    assert rel_error(out_cp, shard_thd(out_ref, cup, world, rank)) < 5e-3
    assert rel_error(x_cp.grad, shard_thd(x_ref.grad, cup, world, rank)) < 5e-3
    for name, p in layer.named_parameters():
        g = p.grad.float()
        dist.all_reduce(g)
        assert rel_error(g, ref_grads[name]) < 5e-3, name


@pytest.mark.parametrize("compiled", [False, True])
def test_gdn_cp_layer_nccl(compiled):
    run_ranks(2, _gdn_rank, compiled, backend="nccl")
