"""Compiling the attention, conv and chunk-index kernels while a graph is traced (custom_ops.runtime.precompile).

On the CPU: the ops' fake implementations, on fake CUDA tensors, hand each kernel of the
forward and the backward to a worker to compile, once, with the arguments the launch would
pass (TMA descriptors where the GPU launch uses them), and launch nothing. On a GPU: a
compiled fwd+bwd compiles those kernels in the workers only, and matches eager.
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import custom_ops
from custom_ops.conv1d import op as conv_mod
from custom_ops.runtime import launch as launch_mod, precompile

triton = pytest.importorskip("triton")
from triton.runtime.jit import JITFunction  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture
def recorded(monkeypatch):
    """Precompiling on a CPU machine as on a Hopper GPU, device 0: JITFunction.warmup records
    its calls (kernel name, arguments, keyword arguments, thread) instead of compiling, and
    any launch fails the test."""
    calls = []

    def warmup(self, *args, grid, **kwargs):
        calls.append((self.fn.__name__, args, kwargs, threading.current_thread().name))

    def run(self, *args, **kwargs):
        raise AssertionError(f"{self.fn.__name__} launched while precompiling")

    monkeypatch.setattr(JITFunction, "warmup", warmup)
    monkeypatch.setattr(JITFunction, "run", run)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    precompile.clear()
    yield calls
    precompile.wait_all()
    precompile.clear()


def _names(calls):
    return sorted(name for name, *_ in calls)


def test_attention_fake_compiles_forward_and_backward_kernels(recorded):
    with FakeTensorMode():
        q = torch.empty(256, 8, 128, dtype=torch.bfloat16, device="cuda")
        k = torch.empty(256, 2, 128, dtype=torch.bfloat16, device="cuda")
        seg = [torch.empty(4, dtype=torch.int32, device="cuda") for _ in range(5)]
        out, lse = custom_ops.varlen_attention(q, k, k, *seg, causal=True)
        custom_ops.varlen_attention(q, k, k, *seg, causal=True)  # same shapes: scheduled once
    precompile.wait_all()
    assert out.shape == q.shape and lse.shape == (8, 256)
    assert set(_names(recorded)) == {
        "segment_tables_kernel", "varlen_attn_fwd_kernel", "varlen_attn_bwd_delta_kernel", "varlen_attn_bwd_dq_kernel",
        "key_tile_segments_kernel", "varlen_attn_bwd_dkdv_kernel",
    }  # fmt: skip
    # the forward's and dq's table launches (their tiles differ) are one compiled variant
    tables = [kwargs for name, _, kwargs, _ in recorded if name == "segment_tables_kernel"]
    assert tables and all(kw == tables[0] for kw in tables)
    assert all(thread.startswith("cp_ops-precompile") for *_, thread in recorded)
    by_name = {name: (args, kwargs) for name, args, kwargs, _ in recorded}
    args, kwargs = by_name["varlen_attn_fwd_kernel"]
    # D = 128 in bf16 loads K and V through TMA descriptors on Hopper: the same variant
    assert kwargs["TMA"] is True
    assert sum(type(a).__name__ == "TensorDescriptor" for a in args) == 2
    assert all(a.device.type == "meta" for a in args if isinstance(a, torch.Tensor))
    assert kwargs["CAUSAL"] is True and kwargs["HEAD_DIM"] == 128


def test_attention_fake_with_window_is_a_second_schedule(recorded):
    with FakeTensorMode():
        q = torch.empty(64, 2, 64, dtype=torch.float16, device="cuda")
        seg = [torch.empty(2, dtype=torch.int64, device="cuda") for _ in range(5)]
        custom_ops.varlen_attention(q, q, q, *seg, causal=True)
        custom_ops.varlen_attention(q, q, q, *seg, causal=True, window=(8, -1))
    precompile.wait_all()
    fwd = [kwargs for name, _, kwargs, _ in recorded if name == "varlen_attn_fwd_kernel"]
    assert sorted(kw["WINDOW"] for kw in fwd) == [False, True]


@pytest.mark.parametrize("gather", [False, True])
def test_conv_fake_compiles_forward_and_backward_kernels(recorded, gather):
    with FakeTensorMode():
        x = torch.empty(128, 48, dtype=torch.bfloat16, device="cuda")
        weight = torch.empty(32, 4, dtype=torch.bfloat16, device="cuda")
        cu = torch.empty(3, dtype=torch.int32, device="cuda")
        # views of fake CUDA tensors need a CUDA build of torch: the gather op's fake (which
        # slices x) runs only there, so its schedule is called as that fake calls it
        if gather:
            rows = torch.empty(128, dtype=torch.int64, device="cuda")
            conv_mod._precompile(x, weight, None, cu, "silu", rows)
        else:
            # the first 32 columns of x, as a view would have them
            y = custom_ops.causal_conv1d(x.as_strided((128, 32), (48, 1)), weight, None, cu)
            assert y.shape == (128, 32)
    precompile.wait_all()
    # the rows' positions are computed for the forward and again for the backward: one compile,
    # or two where the first had finished when the second was asked for
    names = [n for n in _names(recorded) if n != "conv_positions_kernel"]
    assert names == ["cp_causal_conv1d_bwd_kernel", "cp_causal_conv1d_fwd_kernel"]
    assert 1 <= _names(recorded).count("conv_positions_kernel") <= 2
    for name, args, kwargs, _ in recorded:
        if name == "conv_positions_kernel":
            continue
        assert kwargs["GATHER"] is gather
        # x's row stride is the wider tensor's (48): the launch's specialization, not a copy's
        assert 48 in [a for a in args if type(a) is int]


def test_gdn_fake_compiles_the_chunk_index_kernel(recorded):
    """The delta rule's fake schedules the kernel that builds FLA's chunk indices (FLA's own
    kernels compile in FLA), once per shape."""
    with FakeTensorMode():
        q = torch.empty(256, 2, 64, dtype=torch.bfloat16, device="cuda")
        v = torch.empty(256, 4, 64, dtype=torch.bfloat16, device="cuda")
        g = torch.empty(256, 4, dtype=torch.float32, device="cuda")
        cu = torch.empty(5, dtype=torch.int32, device="cuda")
        for _ in range(2):
            torch.ops.cp_ops.chunk_gated_delta_rule_forward(q, q, v, g, g.to(q.dtype), cu)
    precompile.wait_all()
    assert _names(recorded) == ["fla_chunk_indices_kernel"]
    _, args, kwargs, thread = recorded[0]
    assert args[3:] == (4, 256, 256 // 64 + 4) and kwargs["CHUNK"] == 64
    assert thread != threading.current_thread().name


def test_symbolic_shapes_and_the_switch_schedule_nothing(recorded, monkeypatch):
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    mode = FakeTensorMode(shape_env=ShapeEnv())
    with mode:
        q = torch.empty(mode.shape_env.create_unbacked_symint(), 2, 64, dtype=torch.float16, device="cuda")
        seg = [torch.empty(2, dtype=torch.int64, device="cuda") for _ in range(5)]
        with pytest.raises(TypeError, match="symbolic"):
            precompile.meta_like(q)
        custom_ops.varlen_attention(q, q, q, *seg)
    precompile.wait_all()
    assert recorded == []

    monkeypatch.setenv("CP_OPS_PRECOMPILE", "0")
    assert not precompile.enabled()
    with FakeTensorMode():
        q = torch.empty(64, 2, 64, dtype=torch.float16, device="cuda")
        seg = [torch.empty(2, dtype=torch.int64, device="cuda") for _ in range(5)]
        custom_ops.varlen_attention(q, q, q, *seg)
    precompile.wait_all()
    assert recorded == []
    monkeypatch.setenv("CP_OPS_PRECOMPILE", "2")
    with pytest.raises(ValueError, match="CP_OPS_PRECOMPILE"):
        precompile.enabled()


@pytest.mark.gpu
def test_compiled_attention_compiles_its_kernels_in_the_workers(monkeypatch):
    """torch.compile of an attention fwd+bwd: the six kernels compile in the precompile
    workers while the graph is traced, none at launch, and the results are eager's."""
    from collections import defaultdict

    from custom_ops.segment_attention.kernels.backward import (
        varlen_attn_bwd_delta_kernel,
        varlen_attn_bwd_dkdv_kernel,
        varlen_attn_bwd_dq_kernel,
    )
    from custom_ops.segment_attention.kernels.forward import varlen_attn_fwd_kernel
    from custom_ops.segment_attention.kernels.schedule import key_tile_segments_kernel, segment_tables_kernel

    kernels = [segment_tables_kernel, varlen_attn_fwd_kernel, varlen_attn_bwd_delta_kernel, varlen_attn_bwd_dq_kernel,
               key_tile_segments_kernel, varlen_attn_bwd_dkdv_kernel]  # fmt: skip
    if not hasattr(JITFunction, "_do_compile") or not all(isinstance(k.device_caches, defaultdict) for k in kernels):
        pytest.skip(f"triton {triton.__version__} keeps its compiled kernels in another form")
    compiles = []
    do_compile = JITFunction._do_compile

    def recording(self, *args, **kwargs):
        compiles.append((self.fn.__name__, threading.current_thread().name))
        return do_compile(self, *args, **kwargs)

    monkeypatch.setattr(JITFunction, "_do_compile", recording)
    # forget the kernels compiled by earlier tests (Triton's disk cache makes compiles quick)
    for k in kernels:
        monkeypatch.setattr(k, "device_caches", defaultdict(k.device_caches.default_factory))
    launch_mod.launch_direct.cache_clear()
    precompile.clear()
    torch._dynamo.reset()

    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(300, h, 128, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
               for h in (4, 2, 2))  # fmt: skip
    lens = torch.tensor([100, 120, 80], device="cuda", dtype=torch.int32)
    starts = torch.cumsum(lens, 0, dtype=torch.int32) - lens
    seg = (starts, lens, torch.zeros_like(lens), starts, lens)
    g = torch.randn(300, 4, 128, device="cuda", dtype=torch.bfloat16, generator=gen)

    def step(fn):
        q.grad = k.grad = v.grad = None
        out, _ = fn(q, k, v, *seg)
        (out.float() * g).sum().backward()
        return out.detach(), q.grad, k.grad, v.grad

    compiled = step(torch.compile(custom_ops.varlen_attention, fullgraph=True))
    assert {name for name, _ in compiles} == {k.fn.__name__ for k in kernels}
    assert all(thread.startswith("cp_ops-precompile") for _, thread in compiles), compiles
    for got, want in zip(compiled, step(custom_ops.varlen_attention)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
