"""custom_ops.swiglu_mlp: the SwiGLU MLP over row tiles, saving only its input.

Against the reference (the MLP as transformers writes it) on drawn shapes and tile sizes (tiles
that do not divide the rows, larger than the rows, no rows), in float32 and float64; gradcheck in
float64; bf16 weights' gradients summed in float32; the backward's saved tensors are x and the
weights alone; opcheck; compiled with ``fullgraph=True`` over two row counts without a recompile;
bad input; on a GPU, bf16 at slice4's widths.
"""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from custom_ops import default_tile_rows, swiglu_mlp, swiglu_mlp_reference
from custom_ops.testing import TOLERANCE, rel_error


def _leaves(rows, hidden, inter, dtype, seed=0, lead=()):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype).requires_grad_()

    return randn(*lead, rows, hidden), randn(inter, hidden, scale=hidden**-0.5), \
        randn(inter, hidden, scale=hidden**-0.5), randn(hidden, inter, scale=inter**-0.5)  # fmt: skip


def _out_and_grads(fn, leaves, **kwargs):
    leaves = [t.detach().clone().requires_grad_() for t in leaves]
    out = fn(*leaves, **kwargs)
    out.backward(torch.linspace(-1, 1, out.numel(), dtype=out.dtype, device=out.device).reshape(out.shape))
    return [out.detach(), *(t.grad for t in leaves)]


@given(st.integers(0, 50), st.integers(1, 12), st.integers(1, 20), st.integers(1, 60),
       st.sampled_from([torch.float32, torch.float64]), st.sampled_from([(), (3,)]))  # fmt: skip
def test_matches_the_reference(rows, hidden, inter, tile_rows, dtype, lead):
    leaves = _leaves(rows, hidden, inter, dtype, lead=lead)
    got = _out_and_grads(swiglu_mlp, leaves, tile_rows=tile_rows)
    want = _out_and_grads(swiglu_mlp_reference, leaves)
    for name, a, b in zip(("out", "d x", "d w_gate", "d w_up", "d w_down"), got, want):
        assert a.shape == b.shape and a.dtype == b.dtype == dtype
        assert rel_error(a, b) < TOLERANCE[dtype], f"{name}: {rows} rows, tiles of {tile_rows}"


def test_gradcheck():
    """float64, 11 rows in tiles of 4 (the last one short)."""
    leaves = _leaves(11, 6, 9, torch.float64)
    assert torch.autograd.gradcheck(lambda *a: swiglu_mlp(*a, tile_rows=4), leaves)


def test_bf16_weight_gradients_sum_in_float32():
    """bf16 inputs: the output and gradients in bf16, within bf16's tolerance of the reference in
    bf16 and of float64, over 40 tiles."""
    leaves = _leaves(400, 64, 160, torch.bfloat16)
    got = _out_and_grads(swiglu_mlp, leaves, tile_rows=10)
    want = _out_and_grads(swiglu_mlp_reference, leaves)
    exact = _out_and_grads(swiglu_mlp_reference, [t.double() for t in leaves])
    for a, b, c in zip(got, want, exact):
        assert a.dtype == torch.bfloat16
        assert rel_error(a, b) < TOLERANCE[torch.bfloat16] and rel_error(a, c) < TOLERANCE[torch.bfloat16]


def test_autocast_runs_it_in_the_autocast_dtype():
    """float32 x and weights under bf16 autocast: a bf16 output and float32 gradients, as the
    reference's nn.Linear GEMMs give under autocast, eager and compiled."""
    leaves = _leaves(30, 8, 12, torch.float32)
    compiled = torch.compile(swiglu_mlp, fullgraph=True, backend="aot_eager")
    runs = []
    for fn in (swiglu_mlp, compiled, swiglu_mlp_reference):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            runs.append(_out_and_grads(fn, leaves))
    for got in runs[:2]:
        for a, b in zip(got, runs[2]):
            assert a.dtype == b.dtype and rel_error(a, b) < TOLERANCE[torch.bfloat16]
    assert runs[2][0].dtype == torch.bfloat16 and runs[2][1].dtype == torch.float32


def test_the_backward_saves_x_and_the_weights_alone():
    """What autograd keeps for the backward: x and the three weights, none of the [N, I]
    intermediates the reference saves."""
    leaves = _leaves(64, 8, 32, torch.float32)

    def saved(fn):
        kept = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
            fn(*leaves, tile_rows=16)
        return kept

    assert {t.data_ptr() for t in saved(swiglu_mlp)} == {t.data_ptr() for t in leaves}
    assert sum(t.numel() for t in saved(swiglu_mlp_reference) if t.shape == (64, 32)) >= 4 * 64 * 32


def test_no_gradients_computed_without_grad():
    leaves = _leaves(20, 4, 6, torch.float32)
    d_x, *d_w = torch.ops.cp_ops.swiglu_mlp_backward(torch.ones(20, 4), *leaves, 8, False, False)
    assert d_x.numel() == sum(d.numel() for d in d_w) == 0
    with torch.no_grad():
        out = swiglu_mlp(*leaves)
    assert not out.requires_grad and rel_error(out, swiglu_mlp_reference(*leaves)) < 1e-6


def test_opcheck():
    leaves = _leaves(10, 3, 5, torch.float32)
    torch.library.opcheck(torch.ops.cp_ops.swiglu_mlp_forward.default, (*leaves, 4))
    for grads in ((True, True), (True, False), (False, True)):
        args = (torch.randn(10, 3), *[t.detach() for t in leaves], 3, *grads)
        torch.library.opcheck(torch.ops.cp_ops.swiglu_mlp_backward.default, args)
    torch.library.opcheck(torch.ops.cp_ops.swiglu_mlp.default, (*leaves, 3))


def test_default_tile_rows():
    assert default_tile_rows(5632) == 5952 and default_tile_rows(512) == 65536
    assert default_tile_rows(2**25) == 1 and default_tile_rows(2**20) == 32


def test_compiled_fullgraph_two_row_counts_no_recompile():
    """A residual block's MLP (a norm before it, the residual after) compiled with fullgraph and
    dynamic shapes: two row counts run one graph, with the eager block's output and gradients
    (AOTAutograd without Inductor: the ops are opaque to it, and Inductor's CPU compile of the
    norm and residual takes half a minute of the fast tier)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    w_gate, w_up, w_down = (p.requires_grad_() for p in _leaves(1, 16, 24, torch.float32)[1:])

    def block(x):
        return x + swiglu_mlp(torch.nn.functional.rms_norm(x, (16,)), w_gate, w_up, w_down, tile_rows=7)

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(block, fullgraph=True, dynamic=True, backend=counter)
    for rows in (40, 53):
        x = torch.randn(rows, 16)
        results = []
        for fn in (block, compiled):
            leaf = x.clone().requires_grad_()
            for w in (w_gate, w_up, w_down):
                w.grad = None
            fn(leaf).sum().backward()
            results.append([leaf.grad, w_gate.grad, w_up.grad, w_down.grad])
        for got, want in zip(*results):
            assert rel_error(got, want) < 1e-5
    assert counter.frame_count == 1


@pytest.mark.gpu
def test_cuda_bf16_at_slice4_widths_holds_less():
    """On the GPU in bf16 at slice4's widths (H 1024, I 5632), 16384 rows in tiles of 4096: within
    bf16's tolerance of float64, and what the forward leaves for the backward is x alone (the
    reference leaves its four [N, I] intermediates)."""
    leaves = [t.detach().cuda().requires_grad_() for t in _leaves(16384, 1024, 5632, torch.bfloat16)]
    exact = _out_and_grads(swiglu_mlp_reference, [t.double() for t in leaves])
    for a, c in zip(_out_and_grads(swiglu_mlp, leaves, tile_rows=4096), exact):
        assert a.dtype == torch.bfloat16 and rel_error(a, c) < TOLERANCE[torch.bfloat16]

    def held(fn, **kwargs):
        start = torch.cuda.memory_allocated()
        out = fn(*leaves, **kwargs)
        return torch.cuda.memory_allocated() - start - out.numel() * out.element_size()

    x_bytes = leaves[0].numel() * 2
    assert held(swiglu_mlp, tile_rows=4096) <= x_bytes < held(swiglu_mlp_reference) / 10


@pytest.mark.parametrize(
    "shapes, message",
    [
        (((4, 3), (5, 3), (5, 3), (3, 4)), "w_gate and w_up must be \\[I, H\\] and w_down \\[H, I\\]"),
        (((4, 3), (5, 2), (5, 2), (3, 5)), "w_gate and w_up must be \\[I, H\\] and w_down \\[H, I\\] with H = 3"),
        (((4, 3), (5, 3), (6, 3), (3, 5)), "w_gate and w_up must be"),
    ],
)
def test_bad_input(shapes, message):
    with pytest.raises(ValueError, match=message):
        swiglu_mlp(*(torch.randn(s) for s in shapes))


def test_bad_dtypes_and_settings():
    x, wg, wu, wd = (t.detach() for t in _leaves(4, 3, 5, torch.float32))
    with pytest.raises(TypeError, match="share one floating dtype"):
        swiglu_mlp(x, wg.double(), wu, wd)
    with pytest.raises(ValueError, match="tile_rows must be at least 1"):
        swiglu_mlp(x, wg, wu, wd, tile_rows=0)
    with pytest.raises(ValueError, match=r"x must be \[\.\.\., H\], got shape \(\)"):
        swiglu_mlp(torch.tensor(1.0), wg, wu, wd)
    with pytest.raises(ValueError, match=r"x must be \[N, H\], got shape \(1, 4, 3\)"):
        torch.ops.cp_ops.swiglu_mlp_forward(x[None], wg, wu, wd, 2)
