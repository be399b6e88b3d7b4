"""GatedDeltaNet layer (group=None): packing, padding, gradients, checkpoint mapping, compile, GPU."""

import importlib.util

import pytest
import torch

import cp_ops
from cp_ops import GatedDeltaNet, from_qwen3_next_state_dict, pad_cu_seqlens
from cp_ops.gdn_strategies import FusedExchange, SectionExchange, SingleDevice, default_context_parallel
from custom_ops.testing import TOLERANCE, random_tensor, rel_error

# Small, pairwise different dims; no packed row count below equals one of them (duck sizing).
HIDDEN, HK, HV, DK, DV = 24, 2, 4, 6, 5


def _layer(dtype=torch.float64, device="cpu", **dims):
    torch.manual_seed(1)
    cfg = dict(hidden_size=HIDDEN, num_k_heads=HK, num_v_heads=HV, head_k_dim=DK, head_v_dim=DV)
    cfg.update(dims)
    return GatedDeltaNet(**cfg).to(device=device, dtype=dtype)


def _packed(seqlens, cp_size=2, dtype=torch.float64, hidden=HIDDEN, device="cpu"):
    cu, cup = pad_cu_seqlens(seqlens, cp_size, device=device)
    return random_tensor((int(cup[-1]), hidden), dtype, device), cu, cup


def test_the_context_parallel_strategy_is_chosen_explicitly():
    """One device always runs SingleDevice, whatever strategy the layer holds; with W > 1 the
    eager default is the section exchange (the compiled one is tests/cp_ops/test_gdn_cp.py's)."""
    assert isinstance(default_context_parallel(1), SingleDevice)
    assert isinstance(default_context_parallel(2), SectionExchange)
    x, _, cup = _packed([9, 0, 1, 14, 5])
    want = _layer()(x, cup)
    for strategy in (FusedExchange(), SectionExchange(), SingleDevice()):
        assert torch.equal(_layer(context_parallel=strategy)(x, cup), want), strategy
    with pytest.raises(ValueError, match="SingleDevice runs without CP"):
        SingleDevice().check(_layer(), 2)


def test_packed_batch_equals_each_sequence_alone():
    layer = _layer()
    seqlens = [9, 0, 1, 14, 5]
    x, _, cup = _packed(seqlens)
    out = layer(x, cup)
    assert out.shape == x.shape
    bounds = cup.tolist()
    for s, e in zip(bounds[:-1], bounds[1:]):
        alone = layer(x[s:e], torch.tensor([0, e - s], dtype=torch.int32))
        assert rel_error(out[s:e], alone) < TOLERANCE[torch.float64]


def test_padding_does_not_change_real_tokens():
    layer = _layer()
    x, cu, cup = _packed([7, 2, 13], cp_size=4)  # padded to multiples of 8
    real = torch.cat([torch.arange(s, s + n) for s, n in zip(cup[:-1].tolist(), cu.diff().tolist())])
    pad_rows = torch.ones(x.shape[0], dtype=torch.bool)
    pad_rows[real] = False
    assert pad_rows.any()
    x2 = x.clone()
    x2[pad_rows] = random_tensor((int(pad_rows.sum()), HIDDEN), x.dtype) * 10
    out, out2 = layer(x, cup), layer(x2, cup)
    assert rel_error(out2[real], out[real]) < TOLERANCE[torch.float64]
    assert rel_error(out2[pad_rows], out[pad_rows]) > 1e-3  # the padding rows did change


def test_gradients_reach_every_parameter():
    layer = _layer()
    x, _, cup = _packed([6, 11, 3])
    x.requires_grad_()
    layer(x, cup).square().sum().backward()
    for name, p in [("x", x)] + list(layer.named_parameters()):
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


def test_gradcheck_small_layer():
    layer = _layer(hidden_size=6, num_k_heads=1, num_v_heads=2, head_k_dim=3, head_v_dim=2)
    x, _, cup = _packed([3, 1], hidden=6)
    params = [layer.A_log, layer.dt_bias, layer.norm.weight]
    assert torch.autograd.gradcheck(lambda x, *p: layer(x, cup), (x.requires_grad_(), *params))


def test_head_parallel_core_is_additive_over_head_ranges():
    """Running the core on two halves of the heads (what two CP ranks do) and
    concatenating gives the full core: the slicing of sections, conv channels and gates."""
    layer = _layer(num_k_heads=4, num_v_heads=8)
    x, _, cup = _packed([10, 3, 7])
    proj = layer._project(x)[0]
    full = layer._head_parallel_core(proj, cup, 0, 4)
    widths = layer._exchanged_sections()
    parts = torch.split(proj, widths, dim=-1)
    halves = []
    for r in range(2):
        local = [p.chunk(2, dim=-1)[r] for p in parts]
        halves.append(layer._head_parallel_core(torch.cat(local, -1), cup, 2 * r, 2))
    assert layer._exchanged_sections(2) == [w // 2 for w in widths]
    assert rel_error(torch.cat(halves, -1), full) < TOLERANCE[torch.float64]


def test_project_is_in_proj_without_and_with_z():
    """project() splits in_proj into the exchanged sections q, k, v, b, a and the local z."""
    layer = _layer()
    x = random_tensor((9, HIDDEN), torch.float64)
    q, k, v, z, b, a = torch.split(layer.in_proj(x), layer._sections(), dim=-1)
    qkvba, z_local = layer._project(x)
    assert rel_error(qkvba, torch.cat([q, k, v, b, a], -1)) < TOLERANCE[torch.float64]
    assert rel_error(z_local, z) < TOLERANCE[torch.float64]
    assert sum(layer._exchanged_sections()) == qkvba.shape[-1]


def test_from_qwen3_next_state_dict():
    """Build a layer's tensors in the Qwen3-Next layout, load them, and compare the projected
    sections with the Hugging Face split (``fix_query_key_value_ordering``) of the same input."""
    layer = _layer()
    g = HV // HK
    qkvz = random_tensor((2 * HK * DK + 2 * HV * DV, HIDDEN), torch.float64)
    ba = random_tensor((2 * HV, HIDDEN), torch.float64)
    hf = {
        "in_proj_qkvz.weight": qkvz,
        "in_proj_ba.weight": ba,
        "conv1d.weight": random_tensor((2 * HK * DK + HV * DV, 1, 4), torch.float64),
        "A_log": random_tensor((HV,), torch.float64),
        "dt_bias": random_tensor((HV,), torch.float64),
        "norm.weight": random_tensor((DV,), torch.float64),
        "out_proj.weight": random_tensor((HIDDEN, HV * DV), torch.float64),
    }
    layer.load_state_dict(from_qwen3_next_state_dict(hf, HK, HV, DK, DV), strict=True)

    x = random_tensor((13, HIDDEN), torch.float64)
    # the HF split: [T, Hk, 2dk + 2G dv] -> q, k, v, z per key head; [T, Hk, 2G] -> b, a
    mixed = (x @ qkvz.t()).view(13, HK, -1)
    q, k, v, z = torch.split(mixed, [DK, DK, g * DV, g * DV], dim=-1)
    b, a = torch.split((x @ ba.t()).view(13, HK, 2 * g), [g, g], dim=-1)
    hf_sections = [t.reshape(13, -1) for t in (q, k, v, z, b, a)]
    ours = torch.split(layer.in_proj(x), layer._sections(), dim=-1)
    for mine, theirs in zip(ours, hf_sections):
        assert rel_error(mine, theirs) < TOLERANCE[torch.float64]  # same rows, GEMM blocking may differ
    assert torch.equal(layer.conv1d.weight, hf["conv1d.weight"])


def _counting_backend():
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs = {"forward": 0, "backward": 0}

    def compiler(kind):
        def compile_fn(gm, example_inputs):
            graphs[kind] += 1
            graphs[f"last {kind}"] = gm
            return make_boxed_func(gm.forward)

        return compile_fn

    return aot_autograd(fw_compiler=compiler("forward"), bw_compiler=compiler("backward")), graphs


PACKINGS = ([9, 3], [17, 0, 2, 5], [30], [1, 2, 3, 4, 5, 6], [21, 8, 7])


def test_compiled_one_graph_per_direction_no_recompile():
    from torch._dynamo.testing import CompileCounterWithBackend

    layer = _layer()
    torch._dynamo.reset()
    backend, graphs = _counting_backend()
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(layer, backend=counter, fullgraph=True, dynamic=True)
    for seqlens in PACKINGS:
        x, _, cup = _packed(seqlens)
        x_eager = x.clone().requires_grad_()
        x.requires_grad_()
        out = compiled(x, cup)
        out.square().sum().backward()
        grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
        layer.zero_grad()
        ref = layer(x_eager, cup)
        ref.square().sum().backward()
        assert rel_error(out, ref) < TOLERANCE[torch.float64]
        assert rel_error(x.grad, x_eager.grad) < TOLERANCE[torch.float64]
        for n, p in layer.named_parameters():
            assert rel_error(grads[n], p.grad) < TOLERANCE[torch.float64], n
        layer.zero_grad()
    assert counter.frame_count == 1
    assert (graphs["forward"], graphs["backward"]) == (1, 1)
    # the gradient of the q, k, v, b, a projection comes whole from the conv op's backward, not
    # assembled by autograd from the gradients of column slices (a zero-filled copy of it)
    width = sum(layer._exchanged_sections())
    assembled = [n for n in graphs["last backward"].graph.nodes
                 if n.target == torch.ops.aten.slice_backward.default and n.meta["val"].shape[-1] == width]  # fmt: skip
    assert assembled == []


def test_compiled_inductor_matches_eager():
    """Inductor fuses the elementwise steps around the two opaque ops; answers unchanged."""
    layer = _layer(dtype=torch.float32)
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, dynamic=True)
    for seqlens in PACKINGS[:2]:
        x, _, cup = _packed(seqlens, dtype=torch.float32)
        x_eager = x.clone().requires_grad_()
        out = compiled(x.requires_grad_(), cup)
        out.sum().backward()
        ref = layer(x_eager, cup)
        ref.sum().backward()
        assert rel_error(out, ref) < TOLERANCE[torch.float32]
        assert rel_error(x.grad, x_eager.grad) < TOLERANCE[torch.float32]


@pytest.mark.gpu
@pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="needs fla-core (FLA's kernels)")
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_layer_cuda_bf16_matches_float64_cpu(compiled):
    """The layer on CUDA in bf16 (FLA kernels) against the same weights in float64 on CPU,
    eager and compiled (fullgraph): both must be as close to float64 as bf16 allows.

    bf16 rounds the projections and the kernels' inputs; 1e-2 error-RMS ratio for the
    output and 2e-2 for gradients, which pass through two bf16 matmuls more.
    """
    cpu = _layer(hidden_size=256, num_k_heads=2, num_v_heads=4, head_k_dim=128, head_v_dim=128)
    gpu = _layer(dtype=torch.bfloat16, device="cuda", hidden_size=256, num_k_heads=2, num_v_heads=4, head_k_dim=128, head_v_dim=128)
    gpu.load_state_dict({k: v.to(torch.bfloat16) for k, v in cpu.state_dict().items()})
    x, _, cup = _packed([300, 0, 1, 200, 64], hidden=256)
    x_gpu = x.to("cuda", torch.bfloat16).requires_grad_()
    out = (torch.compile(gpu, fullgraph=True) if compiled else gpu)(x_gpu, cup.cuda())
    grad = torch.randn_like(out)
    out.backward(grad)
    x_cpu = x_gpu.detach().double().cpu().requires_grad_()
    ref = cpu(x_cpu, cup)
    ref.backward(grad.double().cpu())
    errors = {"out": rel_error(out.cpu(), ref), "dx": rel_error(x_gpu.grad.cpu(), x_cpu.grad)}
    for (n, p), (_, q) in zip(gpu.named_parameters(), cpu.named_parameters()):
        errors[n] = rel_error(p.grad.cpu(), q.grad)
    assert errors["out"] < 1e-2 and max(errors.values()) < 2e-2, errors


def test_layer_errors_name_the_users_input():
    layer = cp_ops.GatedDeltaNet(32, 2, 4, 8, 8)
    _, cup = cp_ops.pad_cu_seqlens([5, 7], 1)
    with pytest.raises(ValueError, match="x must be \\[T/W, hidden\\] = \\[T/W, 32\\], got shape \\(1, 14, 32\\); packed"):
        layer(torch.randn(1, 14, 32), cup)
    with pytest.raises(ValueError, match="x must be \\[T/W, 32\\] \\(hidden_size\\), got shape \\(14, 48\\)"):
        layer(torch.randn(14, 48), cup)
    with pytest.raises(TypeError, match="x is torch.float64 on cpu but the layer's parameters are torch.float32"):
        layer(torch.randn(14, 32, dtype=torch.float64), cup)
    with pytest.raises(TypeError, match="cu_seqlens_padded must be int32 or int64"):
        layer(torch.randn(14, 32), cup.float())
