"""Every registered op's contract at every floating dtype it takes (float32, bfloat16, float16,
float64): its fake implementation against what the op returns, every output included (the
auxiliary ones: lse, delta, the GDN's saved tensors and FLA indices, the gathered rows, the
conv's dbias), for dtype, shape, device, storage offset and strides, on drawn layouts and
memory layouts (:func:`custom_ops.testing.check_fake`); ``torch.library.opcheck`` at bfloat16
and float16 (float16 in the slow tier; the per-family test files run it at float32 and float64);
and each family compiled with ``fullgraph=True`` in bfloat16, every output of the compiled graph
against eager.

A wrong dtype of an auxiliary output shows only where it differs from the main one's, so the
dtypes are the point: an lse or a GDN state that a fake gives in bf16 while the op computes it
in float32 passes every float32 test.

The collective ops run in the spawned tests of tests/cp_ops: thd_cp2hp, thd_hp2cp and
group_rank_tensor in test_comm.py (:data:`CHECKED_IN_SPAWNS`); FlashAttention 4's calls, CUDA only,
through a torch emulation of their semantics in test_attention_fa4.py (:data:`CHECKED_EMULATED`). On CPU tensors the ops take
their torch references (and the Triton kernels under ``TRITON_INTERPRET=1``, the interpret
tier); the GDN forward's auxiliary outputs are then empty, FLA's are checked on CUDA
(``test_fakes_on_cuda``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import custom_ops
from custom_ops.ops import OPS
from custom_ops.sections.op import sections_to_rank_blocks
from custom_ops.testing import (
    FLOAT_DTYPES,
    MEMORY_LAYOUTS,
    TOLERANCE,
    as_memory_layout,
    check_fake,
    gdn_layouts,
    memory_layouts,
    random_tensor,
    rel_error,
    section_layouts,
    thd_layouts,
    thd_packing,
    thd_packings,
    trailing_shapes,
)
from tests._profiles import examples
from tests.custom_ops.test_gdn_ops import _conv_case, _gather_case, _gdn_case, _states
from tests.custom_ops.test_segment_matmul import _tensors as _segment_tensors
from tests.custom_ops.test_segment_matmul import cases as segment_cases
from tests.custom_ops.test_thd_copy_valid_tokens import _case as _copy_case
from tests.custom_ops.test_varlen_attention import WINDOWS, _tensors as _attention_tensors, segment_layouts
from tests.custom_ops.test_varlen_attention_kv import _kv_case

ops = torch.ops.cp_ops
# ops whose contract needs a process group: checked at every dtype in tests/cp_ops/test_comm.py
CHECKED_IN_SPAWNS = frozenset({"thd_cp2hp", "thd_hp2cp", "group_rank_tensor"})
# ops that call a CUDA-only library: opcheck through its emulation in tests/cp_ops/test_attention_fa4.py
CHECKED_EMULATED = frozenset({"fa4_varlen_forward", "fa4_varlen_backward"})
# the layout ops move any dtype: the floats and an integer one
LAYOUT_DTYPES = FLOAT_DTYPES + (torch.int64,)


def _floats(t: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    return t.detach().requires_grad_(requires_grad and t.dtype.is_floating_point)


def _detached(outputs) -> list:
    return [o.detach() if isinstance(o, torch.Tensor) else o for o in outputs]


@dataclass(frozen=True)
class Family:
    """The ops of one family, how their arguments are drawn (``params``, a hypothesis strategy,
    and ``example``, one fixed draw), the dtypes they take, and ``samples(params, dtype, grad)``:
    ``[(op, args, kwargs)]`` covering every op of the family, backward ops on what the forward
    returns; ``grad`` marks the forward ops' floating inputs as requiring gradients."""

    ops: tuple[str, ...]
    params: st.SearchStrategy
    example: tuple
    dtypes: tuple[torch.dtype, ...]
    samples: Callable[[tuple, torch.dtype, bool], list]


# --- the families ---------------------------------------------------------------------------------


def _reorder_samples(params, dtype, grad):
    packing, trailing, layout = params
    x = _floats(as_memory_layout(random_tensor((packing.num_rows, *trailing), dtype), layout), grad)
    cup, w = packing.cu_seqlens_padded, packing.cp_size
    return [(ops.thd_seq_to_rank_order.default, (x, cup, w), {}), (ops.thd_rank_to_seq_order.default, (x, cup, w), {})]


def _copy_samples(params, dtype, grad):
    (cp_size, seqlens), local, trailing, layout = params
    dst, src, offsets, cu = _copy_case(cp_size, seqlens, trailing, dtype, local)
    dst, src = as_memory_layout(dst, layout), as_memory_layout(src, layout)
    return [
        (ops.thd_copy_valid_tokens.default, (_floats(dst, grad), _floats(src, grad), offsets, cu), {}),
        # a copy of its own to write; contiguous, as its kernel path requires
        (ops.thd_copy_valid_tokens_.default, (dst.contiguous().clone(), src, offsets, cu), {}),
    ]


def _section_samples(params, dtype, grad):
    (cp_size, sections, lead), layout = params
    x = as_memory_layout(random_tensor((*lead, sum(sections)), dtype), layout)
    blocks = as_memory_layout(sections_to_rank_blocks(x, sections, cp_size), layout)
    x, blocks = _floats(x, grad), _floats(blocks, grad)
    return [(getattr(ops, name).default, (x, sections, cp_size), {})
            for name in ("permute_sections", "unpermute_sections", "sections_to_rank_blocks")] + [
        (ops.rank_blocks_to_sections.default, (blocks, sections, cp_size), {})
    ]  # fmt: skip


def _mask(causal, window):
    return {"causal": causal, "window_left": window[0], "window_right": window[1]}


def _attention_samples(params, dtype, grad):
    layout, heads, d, causal, window, memory = params
    q, k, v, seg = _attention_tensors(layout, heads, d, dtype)
    q, k, v = (_floats(as_memory_layout(t, memory), grad) for t in (q, k, v))
    mask = _mask(causal, window)
    out, lse, _ = _detached(ops.varlen_attention(q, k, v, *seg, **mask))
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    qd, kd, vd = _detached((q, k, v))
    delta = ops.varlen_attention_backward_dkdv(dout, dlse, qd, kd, vd, out, lse, *seg, **mask)[2]
    return [
        (ops.varlen_attention.default, (q, k, v, *seg), mask),
        (ops.varlen_attention_backward_dkdv.default, (dout, dlse, qd, kd, vd, out, lse, *seg), mask),
        (ops.varlen_attention_backward_dq.default, (dout, qd, kd, vd, lse, delta, *seg), mask),
    ]


def _attention_kv_samples(params, dtype, grad):
    layout, heads, d, causal, window, memory = params
    q, kv, rows, seg = _kv_case(layout, heads, d, dtype, 0)
    q, kv = _floats(as_memory_layout(q, memory), grad), _floats(as_memory_layout(kv, memory), grad)
    mask = _mask(causal, window)
    out, lse, kv_rows = _detached(ops.varlen_attention(q, kv, None, *seg, **mask, key_rows=rows))
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    return [
        (ops.varlen_attention.default, (q, kv, None, *seg), dict(mask, key_rows=rows)),
        (ops.varlen_attention_backward_dkdv.default, (dout, dlse, q.detach(), kv_rows, None, out, lse, *seg),
         dict(mask, key_rows=rows)),
    ]


def _ag_attention_samples(params, dtype, grad):
    (_, seqlens), heads, causal, window, head_groups, memory = params
    packing = thd_packing(1, seqlens)
    cu, cup = packing.cu_seqlens, packing.cu_seqlens_padded
    q, k, v = (_floats(as_memory_layout(random_tensor((int(cup[-1]), h, 8), dtype), memory), grad)
               for h in (heads[0], heads[1], heads[1]))  # fmt: skip
    args = (q, k, v, cu, cup, causal, window[0], window[1], None, None, 1, head_groups)
    return [(ops.ag_thd_attention.default, args, {})]


def _conv_samples(params, dtype, grad):
    seqlens, taps, weight_dtype, bias, activation, memory = params
    weight_dtype = weight_dtype or dtype
    x, w, b, cu = _conv_case(seqlens, 6, taps, dtype, bias)
    w, b = w.to(weight_dtype), None if b is None else b.to(weight_dtype)
    x = as_memory_layout(x, memory)
    gx, rows, _, _, _ = _gather_case(seqlens, 6, taps, 3, dtype, bias)
    grad_y, grad_rest = random_tensor((x.shape[0], 6), dtype), random_tensor((x.shape[0], 3), dtype)
    xg, wg, bg = (None if t is None else _floats(t, grad) for t in (x, w, b))
    return [
        (ops.causal_conv1d.default, (xg, wg, bg, cu, activation), {}),
        (ops.causal_conv1d_backward.default, (grad_y, x, w, b, cu, activation), {}),
        *[(ops.causal_conv1d_gather.default, (_floats(gx, grad), r, wg, bg, cu, activation, split, norm, parts), {})
          for r, split, norm, parts in ((rows, 0, 0, 1), (None, 4, 2, 2))],
        *[(ops.causal_conv1d_gather_backward.default,
           (grad_y[:, :split].unflatten(1, (parts, -1)).transpose(0, 1).contiguous(), grad_y[:, split:], grad_rest,
            gx, r, w, b, cu, activation, norm), {})
          for r, split, norm, parts in ((rows, 4, 2, 2), (None, 0, 0, 1))],
    ]  # fmt: skip


def _gdn_samples(params, dtype, grad):
    seqlens, group, gate_dtype, scale, with_state, (dk, dv), memory = params
    q, k, v, g, beta, cu = _gdn_case(seqlens, 1, group, dk, dv, dtype)
    g, beta = g.to(gate_dtype or dtype), beta.to(gate_dtype or dtype)
    q, k, v, g, beta = (as_memory_layout(t, memory) for t in (q, k, v, g, beta))
    h0 = _states(len(seqlens), v.shape[1], dk, dv, dtype) if with_state else None
    inputs = tuple(_floats(t, grad) for t in (q, k, v, g, beta))
    state = None if h0 is None else _floats(h0, grad)
    o, _, g_cum, A, fla_cu, chunks = _detached(ops.chunk_gated_delta_rule_forward(*inputs, cu, scale))
    saved = (q, k, v, g, beta, cu, fla_cu, chunks, g_cum, A, scale)
    grad_o, grad_final = torch.randn_like(o), None if h0 is None else torch.randn_like(h0)
    return [
        (ops.chunk_gated_delta_rule.default, (*inputs, cu, scale), {}),
        (ops.chunk_gated_delta_rule_forward.default, (*inputs, cu, scale), {}),
        (ops.chunk_gated_delta_rule_backward.default, (grad_o, *saved), {}),
        (ops.chunk_gated_delta_rule_with_state.default, (*inputs, cu, scale, state), {}),
        (ops.chunk_gated_delta_rule_forward.default, (*inputs, cu, scale, state, True), {}),
        (ops.chunk_gated_delta_rule_backward.default, (grad_o, *saved, h0, grad_final), {}),
    ]


def _segment_matmul_samples(params, dtype, grad):
    case, (heads, k, n), weight_dtype = params
    x, w, cu = _segment_tensors(case, heads, k, n, dtype)
    w = w.to(weight_dtype or dtype)
    dy = random_tensor((x.shape[0], heads, n), dtype)
    return [
        (ops.segment_matmul.default, (_floats(x, grad), _floats(w, grad), cu), {}),
        (ops.segment_matmul_weight_grad.default, (x, dy, cu), {}),
    ]


def _linear_cross_entropy_samples(params, dtype, grad):
    (rows, hidden_dim, vocab), chunk_rows, ignored = params
    hidden, weight = random_tensor((rows, hidden_dim), dtype), random_tensor((vocab, hidden_dim), dtype)
    labels = torch.randint(0, vocab, (rows,))
    labels[: min(ignored, rows)] = -100
    return [
        (ops.linear_cross_entropy.default, (_floats(hidden, grad), _floats(weight, grad), labels, -100, "sum",
                                            chunk_rows), {}),
        (ops.linear_cross_entropy_forward.default, (hidden, weight, labels, -100, chunk_rows, True, True), {}),
        (ops.linear_cross_entropy_forward.default, (hidden, weight, labels, -100, chunk_rows, False, False), {}),
    ]  # fmt: skip


def _swiglu_mlp_samples(params, dtype, grad):
    (rows, hidden_dim, inter), tile_rows = params
    x, dy = random_tensor((rows, hidden_dim), dtype), random_tensor((rows, hidden_dim), dtype)
    w_gate, w_up = random_tensor((inter, hidden_dim), dtype), random_tensor((inter, hidden_dim), dtype)
    w_down = random_tensor((hidden_dim, inter), dtype)
    weights = (w_gate, w_up, w_down)
    return [
        (ops.swiglu_mlp.default, (_floats(x, grad), *(_floats(w, grad) for w in weights), tile_rows), {}),
        (ops.swiglu_mlp_forward.default, (x, *weights, tile_rows), {}),
        (ops.swiglu_mlp_backward.default, (dy, x, *weights, tile_rows, True, True), {}),
        (ops.swiglu_mlp_backward.default, (dy, x, *weights, tile_rows, False, False), {}),
    ]


def _check_layout_samples(params, dtype, grad):
    packing = params[0]
    cu = packing.cu_seqlens.to(dtype)
    return [(ops.check_layout.default, ("cumulative", cu, [], [int(cu[-1])]), {})]


_packing = thd_packings(max_seqs=4, max_len=20)
_attention = st.tuples(segment_layouts(), st.sampled_from([(1, 1), (2, 1), (4, 2)]), st.sampled_from([4, 8]),
                       st.booleans(), st.sampled_from(WINDOWS), memory_layouts())  # fmt: skip
# transposed (dense, dims permuted) inputs: test_gdn_gradients_of_transposed_inputs
_gdn_memory_layouts = st.sampled_from([m for m in MEMORY_LAYOUTS if m != "transposed"])
_ATTENTION_EXAMPLE = (([0, 9, 20], [8, 11, 4], [0, 3, 11], [0, 4, 4], [5, 14, 14], 24, 18), (4, 2), 8, True, (3, -1),
                      "contiguous")  # fmt: skip
# the dtype of weights and gates beside the activations' (None: the activations' own)
_companion_dtypes = st.sampled_from([None, torch.float32])

FAMILIES = {
    "thd_reorder": Family(
        ("thd_seq_to_rank_order", "thd_rank_to_seq_order"),
        st.tuples(_packing, trailing_shapes(), memory_layouts()),
        (thd_packing(3, [7, 0, 1, 12]), (4, 2), "contiguous"), LAYOUT_DTYPES, _reorder_samples,
    ),
    "thd_copy_valid_tokens": Family(
        ("thd_copy_valid_tokens", "thd_copy_valid_tokens_"),
        st.tuples(thd_layouts(max_seqs=4, max_len=20, min_seqs=0), st.booleans(), trailing_shapes(), memory_layouts()),
        ((2, [5, 0, 1, 9]), False, (2, 3), "contiguous"), LAYOUT_DTYPES, _copy_samples,
    ),
    "permute_sections": Family(
        ("permute_sections", "unpermute_sections", "sections_to_rank_blocks", "rank_blocks_to_sections"),
        st.tuples(section_layouts(max_sections=4), memory_layouts()),
        ((3, [6, 0, 9, 3], (5, 3)), "contiguous"), LAYOUT_DTYPES, _section_samples,
    ),
    "varlen_attention": Family(
        ("varlen_attention", "varlen_attention_backward_dkdv", "varlen_attention_backward_dq"),
        _attention, _ATTENTION_EXAMPLE, FLOAT_DTYPES, _attention_samples,
    ),
    "varlen_attention_key_rows": Family(  # the same ops with a key-row map
        ("varlen_attention", "varlen_attention_backward_dkdv"),
        _attention, _ATTENTION_EXAMPLE, FLOAT_DTYPES, _attention_kv_samples,
    ),
    "ag_thd_attention": Family(
        ("ag_thd_attention",),
        st.tuples(thd_layouts(max_seqs=4, max_len=20, cp_sizes=(1,)), st.sampled_from([(2, 2), (4, 2)]),
                  st.booleans(), st.sampled_from(WINDOWS), st.sampled_from([1, 2]), memory_layouts()),
        ((1, [7, 0, 12]), (4, 2), True, (-1, -1), 2, "contiguous"), FLOAT_DTYPES, _ag_attention_samples,
    ),  # fmt: skip
    "causal_conv1d": Family(
        ("causal_conv1d", "causal_conv1d_backward", "causal_conv1d_gather", "causal_conv1d_gather_backward"),
        st.tuples(gdn_layouts(), st.sampled_from([2, 4]), st.sampled_from([None, torch.float32]), st.booleans(),
                  st.sampled_from(["silu", None]), memory_layouts()),
        ([7, 0, 1, 12], 4, None, True, "silu", "contiguous"), FLOAT_DTYPES, _conv_samples,
    ),  # fmt: skip
    "gated_delta_rule": Family(
        ("chunk_gated_delta_rule", "chunk_gated_delta_rule_forward", "chunk_gated_delta_rule_backward",
         "chunk_gated_delta_rule_with_state"),
        st.tuples(gdn_layouts(max_len=8), st.sampled_from([1, 2]), _companion_dtypes, st.sampled_from([None, 0.5]),
                  st.booleans(), st.sampled_from([(4, 3), (8, 4)]), _gdn_memory_layouts),
        ([6, 0, 1, 9], 2, torch.float32, None, True, (4, 3), "contiguous"), FLOAT_DTYPES, _gdn_samples,
    ),  # fmt: skip
    "segment_matmul": Family(
        ("segment_matmul", "segment_matmul_weight_grad"),
        st.tuples(segment_cases(max_rows=30), st.sampled_from([(1, 4, 4), (2, 4, 3)]), _companion_dtypes),
        ((20, [5, 0, 9], 1), (2, 4, 3), torch.float32), FLOAT_DTYPES, _segment_matmul_samples,
    ),
    "linear_cross_entropy": Family(
        ("linear_cross_entropy", "linear_cross_entropy_forward", "linear_cross_entropy_forward"),
        st.tuples(st.sampled_from([(0, 4, 5), (7, 4, 5), (13, 8, 3)]), st.sampled_from([1, 4, 64]),
                  st.integers(0, 3)),
        ((9, 4, 6), 4, 2), FLOAT_DTYPES, _linear_cross_entropy_samples,
    ),
    "swiglu_mlp": Family(
        ("swiglu_mlp", "swiglu_mlp_forward", "swiglu_mlp_backward", "swiglu_mlp_backward"),
        st.tuples(st.sampled_from([(0, 4, 5), (7, 4, 5), (13, 8, 3)]), st.sampled_from([1, 4, 64])),
        ((9, 4, 6), 4), FLOAT_DTYPES, _swiglu_mlp_samples,
    ),
    "check_layout": Family(
        ("check_layout",), st.tuples(_packing), (thd_packing(2, [3, 0, 5]),),
        (torch.int32, torch.int64), _check_layout_samples,
    ),
}


def _cases(dtypes_of=lambda family: family.dtypes):
    return [pytest.param(name, dtype, id=f"{name}-{str(dtype).removeprefix('torch.')}")
            for name, family in FAMILIES.items() for dtype in dtypes_of(family)]  # fmt: skip


def _bf16_fast(cases: list) -> list:
    """``cases`` at bf16 as they are, those at other dtypes in the slow tier (make test-all)."""
    return [c if c.values[1] == torch.bfloat16 else pytest.param(*c.values, id=c.id, marks=pytest.mark.slow)
            for c in cases]  # fmt: skip


def _samples(name: str, params, dtype: torch.dtype, grad: bool = False) -> list:
    samples = FAMILIES[name].samples(params, dtype, grad)
    # every op of the family, some more than once (the GDN ops with a state and without)
    assert {op.name().split("::")[1].split(".")[0] for op, _, _ in samples} == set(FAMILIES[name].ops)
    return samples


# --- every op, every dtype --------------------------------------------------------------------------


def test_every_registered_op_is_checked():
    checked = {op for family in FAMILIES.values() for op in family.ops}
    assert checked | CHECKED_IN_SPAWNS | CHECKED_EMULATED == {op.name for op in OPS}
    assert not checked & (CHECKED_IN_SPAWNS | CHECKED_EMULATED)


def _check_fakes(name: str, dtype: torch.dtype, data) -> None:
    for op, args, kwargs in _samples(name, data.draw(FAMILIES[name].params, label="params"), dtype):
        check_fake(op, args, kwargs)


@pytest.mark.parametrize("name,dtype", _cases())
@settings(max_examples=examples(8))
@given(data=st.data())
def test_fakes_match_the_ops(name, dtype, data):
    """Each op of the family on drawn layouts, memory layouts and companion dtypes (weights and
    gates in float32 beside bf16 activations): the fake's outputs have the real ones' metadata."""
    _check_fakes(name, dtype, data)


# the families whose ops launch Triton kernels on CPU tensors under TRITON_INTERPRET=1
KERNEL_FAMILIES = ("thd_reorder", "thd_copy_valid_tokens", "permute_sections", "varlen_attention",
                   "varlen_attention_key_rows", "ag_thd_attention", "causal_conv1d", "segment_matmul")  # fmt: skip


# bf16 in the fast tier: test_fakes_match_the_ops checks the fakes at every dtype, and one dtype
# per op takes the kernels' dtype path
@pytest.mark.interpret
@pytest.mark.parametrize("name,dtype", _bf16_fast([c for c in _cases() if c.values[0] in KERNEL_FAMILIES]))
@settings(max_examples=examples(2))
@given(data=st.data())
def test_fakes_match_the_kernels(name, dtype, data):
    """The same with the ops on their Triton kernels (in Triton's interpreter)."""
    _check_fakes(name, dtype, data)


# fp16 in the slow tier: it takes bf16's paths, and test_fakes_match_the_ops checks its fakes
@pytest.mark.parametrize("name,dtype", _bf16_fast(_cases(lambda family: [d for d in family.dtypes if d.itemsize == 2])))
def test_opcheck_half_precision(name, dtype):
    """opcheck (schema, autograd registration, fake, AOT dispatch) at bf16 and fp16, the forward
    ops with inputs that require gradients."""
    for op, args, kwargs in _samples(name, FAMILIES[name].example, dtype, grad=True):
        torch.library.opcheck(op, args, kwargs)


@pytest.mark.parametrize("which", ["v", "initial_state"])
def test_gdn_gradients_of_transposed_inputs(which):
    """The GDN backward ops return contiguous gradients, as their fakes say, for a transposed v or
    initial_state too."""
    params = ([6, 0, 9], 2, None, None, True, (4, 3), "contiguous")
    op, (grad_o, q, k, v, *saved, h0, grad_final), _ = _samples("gated_delta_rule", params, torch.float32)[-1]
    if which == "v":
        v = as_memory_layout(v, "transposed")
    else:
        h0 = as_memory_layout(h0, "transposed")
    check_fake(op, (grad_o, q, k, v, *saved, h0, grad_final))


# --- compiled, bf16 ---------------------------------------------------------------------------------


def _outputs_agree(got, want, dtype) -> None:
    got, want = torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert (g.dtype, g.shape, g.device) == (w.dtype, w.shape, w.device), (i, g.dtype, w.dtype, g.shape, w.shape)
        if w.dtype.is_floating_point and w.numel():
            finite = torch.isfinite(w)
            assert torch.equal(finite, torch.isfinite(g)), i
            assert rel_error(g[finite], w[finite]) <= TOLERANCE[dtype], (i, rel_error(g[finite], w[finite]))
        else:
            assert torch.equal(g, w), i


@pytest.mark.parametrize("name", [n for n in FAMILIES if n != "check_layout"])  # check_layout: test_checked_mode
def test_compiled_bf16(name):
    """Every op of the family in one ``fullgraph=True`` graph (Inductor) on bf16 inputs, each
    output, the auxiliary ones too, put through an elementwise op (so a kernel reads it with the
    dtype the fake gave) and returned; against the same in eager mode."""
    torch._dynamo.reset()
    samples = _samples(name, FAMILIES[name].example, torch.bfloat16)
    mutating = {ops.thd_copy_valid_tokens_.default}

    def run(*flat_args):
        results, at = [], 0
        for op, args, kwargs in samples:
            n = len(args)
            call_args = list(flat_args[at : at + n])
            at += n
            outs = op(*call_args, **kwargs)
            if outs is None:  # the in-place op: its result is the destination it wrote
                outs = (call_args[0],)
            outs = outs if isinstance(outs, tuple) else (outs,)
            results += [o * 2 if o.dtype.is_floating_point else o + 1 for o in outs]
        return results

    def fresh(args_list):  # the mutating op's destination anew for each run
        return [a.clone() if op in mutating and i == 0 else a for op, args, _ in args_list for i, a in enumerate(args)]

    want = run(*fresh(samples))
    got = torch.compile(run, fullgraph=True)(*fresh(samples))
    _outputs_agree(got, want, torch.bfloat16)


# --- CUDA: the GDN's FLA path -----------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fakes_on_cuda(dtype):
    """On CUDA the GDN forward ops return FLA's g_cum (float32) and A (q's dtype) for their
    backward ops, which the fakes describe; the conv takes its Triton kernels (K <= 4) or FLA's
    (K = 8). Sequences longer than FLA's 64-row chunks, head dims its kernels take."""
    gdn = ([70, 0, 5], 2, None, None, True, (64, 64), "contiguous")
    wide_conv = ([7, 0, 70], 8, None, True, "silu", "contiguous")
    samples = _samples("gated_delta_rule", gdn, dtype) + _samples("causal_conv1d", wide_conv, dtype)
    samples += _samples("causal_conv1d", FAMILIES["causal_conv1d"].example, dtype)
    for op, args, kwargs in samples:
        check_fake(op, *torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: t.cuda(), (args, kwargs)))
