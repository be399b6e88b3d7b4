"""The FLA's-own-CP baseline of ``bench_gdn --cp W --fla-cp`` (benchmarks/baselines.py): the layer
with FLA's conv and delta rule equals the package's layer on one GPU, and its CP over NCCL on two
equals it on one (FLA's CP runs only on CUDA: these are GPU tests)."""

import pytest
import torch
import torch.distributed as dist

from benchmarks.baselines import fla_cp_layer_step
from benchmarks.bench_gdn import CP_TOLERANCE, FLA_TOLERANCE
from cp_ops import GatedDeltaNet, pad_cu_seqlens
from custom_ops.testing import rel_error
from custom_ops.valid_tokens.reference import valid_token_mask
from tests._dist import run_ranks

SEQLENS = [3000, 17, 1, 900, 4178]


def _case(device):
    torch.manual_seed(0)
    layer = GatedDeltaNet(256, 2, 4, 64, 64).to(device, torch.bfloat16)
    cu, cup = pad_cu_seqlens(SEQLENS, 2, device=device)
    x = torch.randn(int(cup[-1]), 256, device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        want = layer(x, cup)
    return layer, cup, x, want, valid_token_mask(cup, cu, x.shape[0])


@pytest.mark.gpu
def test_fla_layer_matches_the_layer_on_one_gpu():
    pytest.importorskip("fla")
    layer, cup, x, want, real = _case("cuda")
    with torch.no_grad():
        got = fla_cp_layer_step(layer, cup)(x)
    assert rel_error(got[real], want[real]) < FLA_TOLERANCE


def _rank(rank, world):
    layer, cup, x, _, real = _case(f"cuda:{rank}")
    part = slice(rank * x.shape[0] // world, (rank + 1) * x.shape[0] // world)
    with torch.no_grad():
        want = fla_cp_layer_step(layer, cup)(x)[part]
        got = fla_cp_layer_step(layer, cup, dist.group.WORLD)(x[part])
    assert rel_error(got[real[part]], want[real[part]]) < CP_TOLERANCE, rank


@pytest.mark.gpu
@pytest.mark.dist
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_fla_cp_matches_the_layer_w2():
    pytest.importorskip("fla")
    run_ranks(2, _rank, backend="nccl")
