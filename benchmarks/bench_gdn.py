"""The Gated DeltaNet capability at Qwen3-Next-80B's widths: the layer on one GPU, its conv
kernels, and the layer with CP on W GPUs.

    python -m benchmarks.bench_gdn [--tokens T ...] [--seqs B ...] [--kernel-time] [--rank-share W ...]
                                   [--backends fla flashqla]   # the layer with each GDN core backend
    python -m benchmarks.bench_gdn --core [--tokens T ...] [--heads HK/HV ...]   # the core op by backend
    python -m benchmarks.bench_gdn --conv [--gather]    # our conv kernels against FLA's (--gather: permuted rows)
    python -m benchmarks.bench_gdn --conv --sweep       # our conv kernels' launch configs, in the layer's form
    python -m benchmarks.bench_gdn --cp W [--profile] [--compiled-only]
                                   [--cudagraphs] [--states] [--fla-cp]    # spawns W NCCL ranks
    python -m benchmarks.bench_gdn --cp 2 --smoke       # 2 gloo ranks on the CPU, a tiny layer

Results (benchmarks/runner.py): ``gdn``; ``gdn-core``; ``conv``, ``conv-gather`` or ``conv-sweep``; ``gdn-cp-wW``
(``-compiled``, ``-cudagraphs``, ``-states``, ``-fla-cp`` added with those flags, ``-slow-link`` with
NCCL_P2P_DISABLE=1; ``gdn-cp-smoke-wW``); with ``--backends``, ``-BACKEND`` after each layer result's
name, one run of each backend. docs/benchmarks.md says what each row
measures.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import math
import os
import subprocess
import sys
import time
from functools import partial

import torch
import torch.distributed as dist

import custom_ops
from benchmarks.baselines import cp2hp_per_sequence, fla_cp_layer_step, hp2cp_per_sequence
from benchmarks.cases import random_lengths as _lengths
from benchmarks.common import (
    KERNEL_CLASSES,
    RANK_KEYS,
    max_over_ranks,
    profile_step,
    spawn_ranks,
)
from benchmarks.internals import fla_varlen_indices, valid_token_mask
from benchmarks.runner import Result, add_out_argument, checks_off, emit, environment, fla_environment, format_cell
from benchmarks.timing import kernel_ms, median_ms, median_ms_counted
from cp_ops import COMPILE_OPTIONS, GatedDeltaNet, StatePassing, pad_cu_seqlens, shard_thd
from custom_ops import group_rank, resolve_group, thd_cp2hp, thd_hp2cp
from custom_ops.testing import rel_error

HIDDEN, HK, HV, DK, DV = 2048, 16, 32, 128, 128
TOKENS, SEQS = (32768, 65536), (8, 64)
# --smoke: a tiny layer in float32 on the CPU; two packings, so the compiled layer meets a second shape
SMOKE_DIMS = (32, 2, 4, 16, 16)
SMOKE_TOKENS, SMOKE_SEQS = (192,), (2, 5)
CP_TOLERANCE = 5e-3  # bf16 CP vs one device, as the GPU tests (Megatron-LM's CP tolerance)
# bf16 FLA's layer vs the package's on one device: two implementations, each rounding its own
# intermediates (its CP is checked against its own one-device output, at CP_TOLERANCE)
FLA_TOLERANCE = 1e-2


def _fwd_bwd(fn, inputs, grad):
    """A closure running ``fn()`` and its backward with ``grad`` (a tensor, or a tuple for a
    tuple of outputs), clearing the grads of ``inputs`` first."""

    def run():
        for t in inputs:
            t.grad = None
        torch.autograd.backward(fn(), grad)

    return run


def piece_steps(layer: GatedDeltaNet, x: torch.Tensor, cup: torch.Tensor, world: int = 1) -> dict:
    """Closures running the compute pieces of one rank's layer step (``world`` ranks; 1 = one GPU).

    in_proj (the layer's two GEMMs, :meth:`GatedDeltaNet._project`), gated norm and out_proj
    on x's rows (``[T/W, hidden]``, all heads); conv and core on all ``T = W * x.shape[0]``
    rows for 1/W of the heads (what a rank of the CP layer runs), on random inputs of those
    shapes. fwd+bwd each, except "core fwd". With ``world`` > 1 also "core by states": the
    state-passing core on x's rows for all heads (:func:`custom_ops.chunk_gated_delta_rule_dual_chunks`
    over the rank's 2B chunks, without the exchanges: what a rank of ``StatePassing`` computes).
    """
    dev, dtype = x.device, x.dtype
    local_rows, rows = x.shape[0], x.shape[0] * world
    hk, hv = layer.num_k_heads // world, layer.num_v_heads // world
    dk, dv = layer.head_k_dim, layer.head_v_dim
    conv_w = 2 * hk * dk + hv * dv

    def randn(*shape, dt=dtype):
        return torch.randn(*shape, device=dev, dtype=dt)

    def core_inputs(num_rows: int, num_k: int, num_v: int) -> tuple[list[torch.Tensor], torch.Tensor]:
        """``[q, k, v, g, beta]`` of the core on ``num_rows`` rows (unit-norm keys, log decays; leaves)
        and a gradient of its output."""
        q, k = (torch.nn.functional.normalize(randn(num_rows, num_k, dk), dim=-1).requires_grad_() for _ in "qk")
        v = randn(num_rows, num_v, dv).requires_grad_()
        g = torch.nn.functional.logsigmoid(randn(num_rows, num_v, dt=torch.float32) + 3).requires_grad_()
        beta = torch.rand(num_rows, num_v, device=dev).requires_grad_()
        return [q, k, v, g, beta], randn(num_rows, num_v, dv)

    with torch.no_grad():
        proj_grads = tuple(torch.randn_like(t) for t in layer._project(x))  # qkvba, z
    # the conv reads the head-parallel projection's first columns and writes its whole gradient, as in the layer
    proj_hp = randn(rows, sum(layer._exchanged_sections(world))).requires_grad_()
    weight = layer.conv1d.weight[:conv_w, 0, :].detach().contiguous().requires_grad_()
    core_leaves, o_grad = core_inputs(rows, hk, hv)
    # the gated norm runs on the local rows, all heads
    z = randn(local_rows, layer.num_v_heads, dv).requires_grad_()
    o_in = randn(local_rows, layer.num_v_heads, dv).requires_grad_()
    norm_grad = randn(local_rows, layer.num_v_heads, dv)
    core_in = randn(local_rows, layer.value_dim).requires_grad_()
    norm_c = torch.compile(layer.norm, fullgraph=True, dynamic=True)

    def core():
        return custom_ops.chunk_gated_delta_rule(*core_leaves, cup)

    states = {}
    if world > 1:
        leaves, grad_s = core_inputs(local_rows, layer.num_k_heads, layer.num_v_heads)
        local_cu = custom_ops.local_chunk_bounds(cup, world)
        by_states = partial(custom_ops.chunk_gated_delta_rule_dual_chunks, *leaves, local_cu)
        states["core by states fwd+bwd"] = _fwd_bwd(by_states, leaves, grad_s)

    return {
        "in_proj fwd+bwd": _fwd_bwd(lambda: layer._project(x), [x, layer.in_proj.weight], proj_grads),
        "conv fwd+bwd": _fwd_bwd(
            lambda: custom_ops.causal_conv1d_gather(proj_hp, None, weight, None, cup, "silu", 2 * hk * dk, dk, 2),
            [proj_hp, weight],
            (randn(2, rows, hk * dk), randn(rows, hv * dv), randn(rows, proj_hp.shape[1] - conv_w)),
        ),
        "core fwd": core,
        "core fwd+bwd": _fwd_bwd(core, core_leaves, o_grad),
        "gated norm fwd+bwd eager": _fwd_bwd(lambda: layer.norm(o_in, z), [o_in, z], norm_grad),
        "gated norm fwd+bwd compiled": _fwd_bwd(lambda: norm_c(o_in, z), [o_in, z], norm_grad),
        "out_proj fwd+bwd": _fwd_bwd(
            lambda: layer.out_proj(core_in), [core_in, layer.out_proj.weight], randn(local_rows, layer.hidden_size)
        ),
        **states,
    }


# Milliseconds of calls a layer row's median is taken over: at 131072 tokens the whole layer's
# fwd+bwd takes about 60 ms, and do_bench's default budget would time it once or twice.
LAYER_REP_MS = 1000


def bench_case(layer, tokens: int, num_seqs: int, kernel_time: bool = False, shares=()) -> dict[str, float]:
    gen = torch.Generator().manual_seed(tokens + num_seqs)
    lens = _lengths(tokens, num_seqs, gen)
    _, cup = pad_cu_seqlens(lens, 1, device="cuda")
    tokens = int(cup[-1])  # padding to whole 2-row chunks can add a row per sequence
    dev, bf16 = "cuda", torch.bfloat16
    x = torch.randn(tokens, HIDDEN, device=dev, dtype=bf16, requires_grad=True)
    grad = torch.randn(tokens, HIDDEN, device=dev, dtype=bf16)
    params = list(layer.parameters())
    compiled = torch.compile(layer, fullgraph=True, dynamic=True)
    steps = {
        "layer fwd eager": lambda: layer(x, cup),
        "layer fwd+bwd eager": _fwd_bwd(lambda: layer(x, cup), [x] + params, grad),
        "layer fwd compiled": lambda: compiled(x, cup),
        "layer fwd+bwd compiled": _fwd_bwd(lambda: compiled(x, cup), [x] + params, grad),
    }
    steps.update(piece_steps(layer, x, cup))  # the pieces (fwd+bwd each)
    for world in shares:  # one rank's pieces of a W-rank CP layer (its padded layout), on this GPU
        if layer.num_k_heads % world:
            raise SystemExit(f"--rank-share {world}: W must divide Hk = {layer.num_k_heads}")
        _, cup_w = pad_cu_seqlens(lens, world, device=dev)
        local = torch.randn(int(cup_w[-1]) // world, HIDDEN, device=dev, dtype=bf16, requires_grad=True)
        steps.update({f"W={world} share: {k}": fn for k, fn in piece_steps(layer, local, cup_w, world).items()})
    res = {name: median_ms(fn, 100, LAYER_REP_MS) for name, fn in steps.items()}
    if kernel_time:
        res.update({f"{name}: kernels": kernel_ms(fn) for name, fn in steps.items()})
        for name in [n for n in steps if n.endswith("core by states fwd+bwd")]:
            profile = profile_step(steps[name], named=("segment_matmul",))  # prints the largest others
            res.update({f"{name}: {k}": profile[k] for k in STATES_PROFILE})
    return res


# where the state-passing core's kernel time goes (--kernel-time): the delta rule's kernels (FLA's,
# or FlashQLA's under "other"), the compositions' GEMMs, the segment matmuls, the small ops around them
STATES_PROFILE = ("GPU busy", "FLA", "GEMMs", "segment_matmul kernels", "Inductor-fused", "other")


# --- the GDN core alone, by kernel backend ----------------------------------------------------

CORE_TOKENS = (32768, 131072, 262144, 524288, 1048576)
CORE_HEADS = ((16, 32), (8, 16), (4, 8), (2, 4))  # Qwen3-Next-80B's heads on one GPU and a rank of W = 2, 4, 8
CORE_SEQS = 8


def _core_steps(hk: int, hv: int, tokens: int, num_seqs: int, backend: str) -> dict:
    """Closures of the core op's forward and forward+backward with ``backend``, on inputs in the
    layer's ranges (unit-norm keys, decays in (0, 1)), ``num_seqs`` random lengths."""
    lens = _lengths(tokens, num_seqs, torch.Generator().manual_seed(tokens + num_seqs))
    cu, _ = pad_cu_seqlens(lens, 1, device="cuda")
    dev, bf16 = "cuda", torch.bfloat16
    torch.manual_seed(tokens + hk)  # the same inputs for every backend
    q = torch.nn.functional.normalize(torch.randn(tokens, hk, DK, device=dev), dim=-1).to(bf16).requires_grad_()
    k = torch.nn.functional.normalize(torch.randn(tokens, hk, DK, device=dev), dim=-1).to(bf16).requires_grad_()
    v = torch.randn(tokens, hv, DV, device=dev, dtype=bf16).requires_grad_()
    g = torch.nn.functional.logsigmoid(torch.randn(tokens, hv, device=dev) + 3).requires_grad_()
    beta = torch.rand(tokens, hv, device=dev).requires_grad_()
    grad = torch.randn_like(v)

    def forward():
        return torch.ops.cp_ops.chunk_gated_delta_rule_forward(q, k, v, g, beta, cu, None, backend=backend)[0]

    return {"fwd": forward, "fwd+bwd": _fwd_bwd(forward, [q, k, v, g, beta], grad)}


def core_main(tokens, heads, out) -> None:
    """The core op (``chunk_gated_delta_rule``) by backend: median ms of fwd and fwd+bwd, the
    ratio FLA / FlashQLA, and FlashQLA's output against FLA's (rel_error)."""
    from custom_ops.gated_delta_rule import backends

    probe = torch.empty(1, 1, DK, device="cuda", dtype=torch.bfloat16)
    unfit = backends.flash_qla_unfit(probe, probe)
    if unfit is None:  # TileLang compiles per head count: all of them side by side, before timing
        warm = [sys.executable, "-m", "custom_ops.gated_delta_rule.flash_qla", *(f"{hk}/{hv}" for hk, hv in heads)]
        subprocess.run(warm, check=True)
    notes = [f"{CORE_SEQS} packed sequences of random lengths, bf16 q/k/v, float32 g and beta, dk = dv = {DK}; "
             "forward op alone (`chunk_gated_delta_rule_forward`) and with its backward; triton.testing.do_bench"]  # fmt: skip
    if unfit is not None:
        notes.append(f"FlashQLA not run: {unfit}")
    columns = ["Hk/Hv", "T", "FLA fwd", "FLA fwd+bwd"]
    if unfit is None:
        columns += ["FlashQLA fwd", "FlashQLA fwd+bwd", "fwd+bwd FLA / FlashQLA", "FlashQLA o vs FLA"]
    rows = []
    for hk, hv in heads:
        for t in tokens:
            row = [f"{hk}/{hv}", t]
            outputs = {}
            for backend in ["fla"] + ["flashqla"] * (unfit is None):
                try:
                    steps = _core_steps(hk, hv, t, CORE_SEQS, backend)
                    with torch.no_grad():
                        outputs[backend] = steps["fwd"]()
                    row += [median_ms(steps["fwd"]), median_ms(steps["fwd+bwd"])]
                except torch.OutOfMemoryError:
                    row += [math.nan, math.nan]
                    notes.append(f"{backend} at {hk}/{hv} heads, T = {t}: out of memory (nan)")
                steps = None
                torch.cuda.empty_cache()
            if unfit is None:
                both = len(outputs) == 2
                row += [row[3] / row[5], rel_error(outputs["flashqla"], outputs["fla"]) if both else math.nan]
            rows.append(row)
            print(" ".join(format_cell(c) for c in row), flush=True)
            del outputs
            title = "The gated delta rule core by kernel backend, one GPU, median ms"
            result = Result("gdn", title, columns, rows, "\n".join(notes), fla_environment(), name="gdn-core",
                            formats={"fwd+bwd FLA / FlashQLA": "{:.2f}", "FlashQLA o vs FLA": "{:.1e}"}
                            if unfit is None else {})  # fmt: skip
            emit([result], out, quiet=True)
    emit([result], out)


# --- the conv kernels: ours against FLA's, and the conv on rows in rank order ------------------

CONV_CHANNELS = (8192, 4096)  # 2*Hk*dk + Hv*dv on one GPU, and on one rank of W = 2
CONV_EXTRA = 64  # the b, a columns beside the conv channels in the projection output (one GPU)
CONV_KERNEL = 4
CONV_TOLERANCE = 1e-2  # bf16, two kernels summing in different orders
CONV_SWEEP_TOKENS = 131072


def fla_conv(x, w, cu):
    """FLA's forward and backward as a pair of callables, with sync-free chunk indices."""
    from fla.modules.causal_conv1d.ops import causal_conv1d_bwd, causal_conv1d_fwd

    cu_ext, idx = fla_varlen_indices(cu, x.shape[0])
    kw = dict(weight=w, bias=None, residual=None, initial_state=None, activation="silu", cu_seqlens=cu_ext,
              chunk_indices=idx, chunk_size=64)  # fmt: skip

    def fwd():
        return causal_conv1d_fwd(x=x.unsqueeze(0), output_final_state=False, **kw)[0].view(x.shape)

    def bwd(dy):
        dx, dw, *_ = causal_conv1d_bwd(x=x.unsqueeze(0), dy=dy.unsqueeze(0), dht=None, **kw)
        return dx.view(x.shape), dw

    return fwd, bwd


def ours_conv(x, w, cu):
    def fwd():
        return custom_ops.causal_conv1d(x, w, None, cu, "silu")

    def bwd(dy):
        dx, dw, _ = torch.ops.cp_ops.causal_conv1d_backward(dy, x, w, None, cu, "silu")
        return dx, dw

    return fwd, bwd


def conv_inputs(total: int, num_seqs: int, channels: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(cu_seqlens, x, weight)`` of the conv in the layer's form on one GPU: ``num_seqs`` packed
    sequences of ``total`` tokens, x ``[total, channels]`` a column slice of the projection output."""
    cu, _ = pad_cu_seqlens(_lengths(total, num_seqs, torch.Generator().manual_seed(total + num_seqs)), 1, device="cuda")
    x = torch.randn(total, channels + CONV_EXTRA, device="cuda", dtype=torch.bfloat16)[:, :channels]
    w = (torch.randn(channels, CONV_KERNEL, device="cuda") / CONV_KERNEL**0.5).to(torch.bfloat16)
    return cu, x, w


def bench_conv(total: int, num_seqs: int, channels: int) -> dict[str, float]:
    cu, x, w = conv_inputs(total, num_seqs, channels)
    dy = torch.randn(total, channels, device="cuda", dtype=torch.bfloat16)
    forms = {"ours": ours_conv(x, w, cu), "FLA": fla_conv(x, w, cu)}
    (of, ob), (ff, fb) = forms["ours"], forms["FLA"]
    out = {"err y": rel_error(of(), ff())}
    (odx, odw), (fdx, fdw) = ob(dy), fb(dy)
    out["err dx"], out["err dw"] = rel_error(odx, fdx), rel_error(odw, fdw.to(odw.dtype))
    worst = max(out.values())
    if not worst < CONV_TOLERANCE:
        raise AssertionError(f"T={total} B={num_seqs} C={channels}: ours against FLA rel_error {worst:.3g}")
    tensor_gb = total * channels * 2 / 1e9
    for name, (fwd, bwd) in forms.items():
        out[f"{name} fwd"] = median_ms(fwd)
        out[f"{name} fwd+bwd"] = median_ms(lambda: (fwd(), bwd(dy)))
        out[f"{name} fwd GB/s"] = 2 * tensor_gb / out[f"{name} fwd"] * 1e3
        out[f"{name} fwd+bwd GB/s"] = 5 * tensor_gb / out[f"{name} fwd+bwd"] * 1e3
    out["FLA / ours, fwd+bwd"] = out["FLA fwd+bwd"] / out["ours fwd+bwd"]
    return out


def bench_conv_gather(total: int, num_seqs: int, channels: int = 4096, extra: int = 32, world: int = 2) -> dict:
    """ms of the two forms of the conv on permuted rows (docs/benchmarks.md), compiled."""
    from custom_ops.thd.index import rank_to_seq_index

    lens = _lengths(total, num_seqs, torch.Generator().manual_seed(total + num_seqs))
    _, cup = pad_cu_seqlens(lens, world, device="cuda")
    rows_total = int(cup[-1])
    recv = torch.randn(rows_total, channels + extra, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(channels, CONV_KERNEL, device="cuda") / CONV_KERNEL**0.5).to(torch.bfloat16).requires_grad_()
    rows = rank_to_seq_index(cup, world, rows_total)
    dy = torch.randn(rows_total, channels, device="cuda", dtype=torch.bfloat16)
    dtail = torch.randn(rows_total, extra, device="cuda", dtype=torch.bfloat16)

    def reorder_then_conv(recv, w):
        xs = custom_ops.thd_rank_to_seq_order(recv, cup, world)
        return custom_ops.causal_conv1d(xs[:, :channels], w, None, cup, "silu"), xs[:, channels:]

    def gather_conv(recv, w):
        _, y, tail = custom_ops.causal_conv1d_gather(recv, rows, w, None, cup, "silu")
        return y, tail

    out, grads = {}, {}
    for name, form in (("reorder + conv", reorder_then_conv), ("gather conv", gather_conv)):
        fn = torch.compile(form, fullgraph=True)

        def step(fn=fn):
            y, tail = fn(recv, w)
            return (y.detach(), *torch.autograd.grad([y, tail], [recv, w], [dy, dtail]))

        grads[name] = step()
        out[f"{name} fwd+bwd"] = median_ms(step)
        out[f"{name} fwd+bwd, kernel time"] = kernel_ms(step)
    for label, a, b in zip(("y", "dx", "dw"), *grads.values()):
        out[f"err {label}"] = rel_error(a, b)
    if not max(v for k, v in out.items() if k.startswith("err")) < CONV_TOLERANCE:
        raise AssertionError(f"T={total} B={num_seqs}: the two forms disagree: {out}")
    for suffix in ("", ", kernel time"):
        ratio = out[f"reorder + conv fwd+bwd{suffix}"] / out[f"gather conv fwd+bwd{suffix}"]
        out[f"reorder + conv / gather conv{suffix}"] = ratio
    return out


# --- context parallelism: the per-sequence all-to-all baseline and the section-layout form --------


class _PerSequence(torch.autograd.Function):
    """A per-sequence exchange, cp2hp (``to_hp``) or hp2cp, with the other one as its gradient
    (the baseline's autograd)."""

    @staticmethod
    def forward(ctx, x, cu_seqlens_padded, sections, group, to_hp):
        ctx.cup, ctx.sections, ctx.group, ctx.to_hp = cu_seqlens_padded, [int(s) for s in sections], group, to_hp
        return (cp2hp_per_sequence if to_hp else hp2cp_per_sequence)(x, cu_seqlens_padded, ctx.sections, group)

    @staticmethod
    def backward(ctx, grad):
        world = ctx.group.size()
        if ctx.to_hp:
            dx = hp2cp_per_sequence(grad.contiguous(), ctx.cup, [s // world for s in ctx.sections], ctx.group)
        else:
            dx = cp2hp_per_sequence(grad.contiguous(), ctx.cup, [s * world for s in ctx.sections], ctx.group)
        return dx, None, None, None, None


def per_sequence_cp2hp(x_cp, cu_seqlens_padded, sections, group):
    """``thd_cp2hp``'s signature, one all-to-all per sequence and section (eager, differentiable)."""
    return _PerSequence.apply(x_cp, cu_seqlens_padded, sections, group, True)


def per_sequence_hp2cp(y_hp, cu_seqlens_padded, sections, group):
    """``thd_hp2cp``'s signature, one all-to-all per sequence and section (eager, differentiable)."""
    return _PerSequence.apply(y_hp, cu_seqlens_padded, sections, group, False)


class SectionsForm(torch.nn.Module):
    """The CP layer converting section-layout tensors with ``cp2hp`` and ``hp2cp`` (``thd_cp2hp``'s
    and ``thd_hp2cp``'s signatures): ``in_proj`` as ``layer._project``, ``cp2hp`` of q, k, v, b, a,
    the core on this rank's heads, ``hp2cp`` of its output, the gated norm, ``out_proj``; the z
    projection after the exchange, nothing overlapped. The same values as ``layer.forward``, with
    a pass over the activations on each side of each exchange: with the defaults, the layer as it
    was before the fused layouts and the overlap."""

    def __init__(self, layer: GatedDeltaNet, cp2hp=thd_cp2hp, hp2cp=thd_hp2cp):
        super().__init__()
        self.layer, self.cp2hp, self.hp2cp = layer, cp2hp, hp2cp

    def forward(self, x, cu_seqlens_padded, group=None):
        layer = self.layer
        heads = layer.num_k_heads // resolve_group(group)[1]
        qkvba, z = layer._project(x)
        qkvba_hp = self.cp2hp(qkvba, cu_seqlens_padded, layer._exchanged_sections(), group)
        o_hp = layer._head_parallel_core(qkvba_hp, cu_seqlens_padded, group_rank(group) * heads, heads)
        o = self.hp2cp(o_hp, cu_seqlens_padded, [o_hp.shape[-1]], group)
        rows, dv = o.shape[0], layer.head_v_dim
        gated = layer.norm(o.view(rows, -1, dv), z.view(rows, -1, dv)).reshape(rows, -1)
        return layer.out_proj(gated)


def a2a_steps(layer: GatedDeltaNet, x_cp: torch.Tensor, cup: torch.Tensor, group, cp2hp, hp2cp) -> dict:
    """fwd+bwd closures of the layer's two all-to-alls on one rank: cp2hp of the q, k, v, b, a
    projections (``[T/W, F]``, five sections; z stays local) and hp2cp of the core output
    (``[T, Hv*dv/W]``, one section)."""
    world = group.size()
    rows = x_cp.shape[0] * world
    with torch.no_grad():
        proj = layer._project(x_cp)[0].requires_grad_()
    width = layer.value_dim // world
    core_hp = torch.randn(rows, width, device=x_cp.device, dtype=x_cp.dtype, requires_grad=True)
    grad_hp = torch.randn(rows, proj.shape[-1] // world, device=x_cp.device, dtype=x_cp.dtype)
    grad_cp = torch.randn(x_cp.shape[0], layer.value_dim, device=x_cp.device, dtype=x_cp.dtype)
    return {
        "cp2hp": _fwd_bwd(lambda: cp2hp(proj, cup, layer._exchanged_sections(), group), [proj], grad_hp),
        "hp2cp": _fwd_bwd(lambda: hp2cp(core_hp, cup, [width], group), [core_hp], grad_cp),
    }


def compiled_options(opts: dict) -> dict:
    return {**COMPILE_OPTIONS, "triton.cudagraphs": True} if opts["cudagraphs"] else COMPILE_OPTIONS


def sent_mib(world: int, rows: int, num_seqs: int, heads: tuple, dtype, taps: int) -> tuple[float, float]:
    """MiB one rank sends in a fwd+bwd step (the backward sends as much again), by heads and by
    chunk states (docs/design.md section 4.3): the all-to-alls' (W-1)/W of its rows' q, k, v, b, a
    and o; the all-gathered state maps and conv halos of its 2B chunks, to each of W-1 ranks."""
    hk, hv, dk, dv = heads
    size = torch.finfo(dtype).bits // 8
    heads_bytes = (world - 1) / world * rows / world * (2 * hk * dk + 2 * hv * dv + 2 * hv) * size
    maps = 2 * num_seqs * hv * dk * (dk + dv) * 4  # float32 states
    halos = 2 * num_seqs * (taps - 1) * (2 * hk * dk + hv * dv) * size
    return 2 * heads_bytes / 2**20, 2 * (world - 1) * (maps + halos) / 2**20


def _cp_rank(rank, world, device, tokens, seqs, out, smoke, opts: dict) -> None:
    """One CP rank of the multi-rank benchmark; ``opts``: the flags ``compiled_only``, ``cudagraphs``,
    ``states``, ``fla_cp`` and ``profile`` of the command line."""
    profile, full = opts["profile"], not opts["compiled_only"]
    group = dist.group.WORLD
    hidden, hk, hv, dk, dv = SMOKE_DIMS if smoke else (HIDDEN, HK, HV, DK, DV)
    dtype = torch.float32 if smoke else torch.bfloat16
    warmup, runs, seq_warmup, seq_runs = (1, 2, 1, 2) if smoke else (3, 20, 2, 10)

    def timed(fn, per_sequence=False):
        counts = (seq_warmup, seq_runs) if per_sequence else (warmup, runs)
        return max_over_ranks(median_ms_counted(fn, *counts, device))

    torch.manual_seed(0)  # the same weights on every rank
    layer = GatedDeltaNet(hidden, hk, hv, dk, dv).to(device, dtype)
    params = list(layer.parameters())

    unfused = SectionsForm(layer)
    per_sequence = SectionsForm(layer, per_sequence_cp2hp, per_sequence_hp2cp)

    def compile_layer(dynamic: bool):
        """The layer compiled as recommended, and (``unfused``) its section-layout form compiled as
        the layer was compiled before the fused layouts (thd_cp2hp / thd_hp2cp as one op each, the
        z projection after the exchange, default options)."""
        fn = torch.compile(layer, fullgraph=True, dynamic=dynamic, options=compiled_options(opts))
        return {"fn": fn, "dynamic": dynamic, "unfused": torch.compile(unfused, fullgraph=True, dynamic=dynamic)}

    def compile_states(dynamic: bool):
        """The same weights by chunk states, compiled as the layer is."""
        fn = torch.compile(states_layer, fullgraph=True, dynamic=dynamic, options=compiled_options(opts))
        return {"fn": fn, "dynamic": dynamic}

    def check_compiled(form, recompile, what):
        """``(form, check(form))``, ``form`` compiled again by ``recompile(dynamic=False)`` where
        dynamic=True fails to compile."""
        try:
            return form, check(form["fn"])
        except Exception as e:  # noqa: BLE001  (a compile failure: retry with static shapes)
            if not form["dynamic"]:
                raise
            msg = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            print(f"rank {rank}: {what}: torch.compile(dynamic=True) failed ({msg}); using dynamic=False", flush=True)
            torch._dynamo.reset()
            notes.append(f"{what} compiled with dynamic=False (dynamic=True failed: {msg[:200]})")
            form = recompile(dynamic=False)
            return form, check(form["fn"])

    compiled = compile_layer(dynamic=True)
    states = None
    if opts["states"]:
        states_layer = GatedDeltaNet(hidden, hk, hv, dk, dv, context_parallel=StatePassing()).to(device, dtype)
        states_layer.load_state_dict(layer.state_dict())
        states = compile_states(dynamic=True)
    notes = ["the compiled layer with CUDA graphs (--cudagraphs), on W GPUs and on one"] if opts["cudagraphs"] else []
    shapes = [(t, b) for t in tokens for b in seqs]
    results = {}
    result_name = f"gdn-cp{'-smoke' if smoke else ''}-w{world}"
    result_name += "-compiled" * opts["compiled_only"] + "-cudagraphs" * opts["cudagraphs"] + "-states" * opts["states"]
    result_name += "-fla-cp" * bool(opts.get("fla_cp"))
    result_name += f"-{opts['backend']}" if opts.get("backend") else ""
    if os.environ.get("NCCL_P2P_DISABLE") == "1":  # NVLink and shared memory off: traffic on the network path
        result_name += "-slow-link"
        notes.append("NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=%s: no NVLink or shared-memory transport"
                     % os.environ.get("NCCL_SHM_DISABLE", "0"))  # fmt: skip

    env = fla_environment(world) if rank == 0 else None

    def result() -> Result:
        """The table of the cases measured so far."""
        table = _cp_table(results, list(results), world, (hidden, hk, hv, dk, dv), dtype, runs, seq_runs, notes)
        return Result("gdn", table[0], table[1], table[2], table[3], env, name=result_name)

    for total, num_seqs in shapes:
        start = time.perf_counter()

        def progress(what: str) -> None:
            """A line per phase on rank 0: where a run cut short by a time limit spent it (compiles, autotuning)."""
            if rank == 0:
                print(f"[bench_gdn] T={total} B={num_seqs}: {what} at {time.perf_counter() - start:.0f} s", flush=True)

        lens = _lengths(total, num_seqs, torch.Generator().manual_seed(total + num_seqs))
        cu, cup = pad_cu_seqlens(lens, world, device=device)
        rows = int(cup[-1])
        gen = torch.Generator(device=device).manual_seed(total + num_seqs)  # one global batch on every rank
        x = torch.randn(rows, hidden, device=device, generator=gen).to(dtype)
        grad = torch.randn(rows, hidden, device=device, generator=gen).to(dtype)
        real = valid_token_mask(cup, cu, rows)
        with torch.no_grad():
            ref = layer(x, cup)  # one device, eager, the whole batch
        x_cp = shard_thd(x, cup, world, rank).requires_grad_()
        grad_cp = shard_thd(grad, cup, world, rank)
        real_cp = shard_thd(real, cup, world, rank)
        ref_cp = shard_thd(ref, cup, world, rank)[real_cp]
        # FLA's CP: this rank's contiguous part of the stream in sequence order, against FLA on one device
        part = slice(rank * rows // world, (rank + 1) * rows // world)
        fla_in = None
        if opts.get("fla_cp"):
            with torch.no_grad():
                fla_ref = fla_cp_layer_step(layer, cup)(x)
            res_fla = {"FLA vs ours, 1 GPU": rel_error(fla_ref[real], ref[real])}
            fla_in = (x[part].detach().requires_grad_(), grad[part], real[part], fla_ref[part][real[part]])
            del fla_ref
        del ref

        def cp_step(fn):
            return _fwd_bwd(lambda: fn(x_cp, cup, group=group), [x_cp] + params, grad_cp)

        def check(fn):
            """One fwd+bwd step of the CP layer; the output's rel_error on real tokens, max over ranks."""
            for t in [x_cp] + params:
                t.grad = None
            out_cp = fn(x_cp, cup, group=group)
            err = max_over_ranks(rel_error(out_cp.detach()[real_cp], ref_cp))
            out_cp.backward(grad_cp)
            return err

        progress("one-device reference done")
        res = {"err eager": check(layer)}
        progress("eager CP step done")
        compiled, res["err compiled"] = check_compiled(compiled, compile_layer, "the layer")
        res["W compiled"] = timed(cp_step(compiled["fn"]))
        progress("compiled CP step timed")
        res["MiB heads"], res["MiB states"] = sent_mib(world, rows, num_seqs, (hk, hv, dk, dv), dtype, 4)
        if states is not None:
            states, res["err compiled states"] = check_compiled(states, compile_states, "the layer by chunk states")
            res["W compiled states"] = timed(cp_step(states["fn"]))
            progress("compiled state mode timed")
        if full:
            res["err per-seq"] = check(per_sequence)
            res["W per-seq eager"] = timed(cp_step(per_sequence), per_sequence=True)
            res["W eager"] = timed(cp_step(layer))
            res["W eager unfused"] = timed(cp_step(unfused))
            res["err compiled unfused"] = check(compiled["unfused"])
            res["W compiled unfused"] = timed(cp_step(compiled["unfused"]))
        if opts.get("fla_cp"):
            fla_step = fla_cp_layer_step(layer, cup, group)
            x_part, grad_part, real_part, ref_part = fla_in
            res["err FLA CP"] = max_over_ranks(rel_error(fla_step(x_part).detach()[real_part], ref_part))
            res.update(res_fla)
            res["W FLA CP eager"] = timed(_fwd_bwd(lambda: fla_step(x_part), [x_part] + params, grad_part))
            progress("FLA's CP timed")
        del fla_in
        if profile:  # every rank runs the profiled steps (they meet in the all-to-alls)
            res.update({f"prof W {k}": v for k, v in profile_step(cp_step(compiled["fn"]), device).items()})

        # one device: rank 0 alone, the whole batch, the same (compiled) layer; the others wait
        one = {"1 compiled": math.nan, "1 eager": math.nan}
        if rank == 0:
            x_all = x.detach().requires_grad_()
            one["1 compiled"] = median_ms_counted(
                _fwd_bwd(lambda: compiled["fn"](x_all, cup), [x_all] + params, grad), warmup, runs, device
            )
            if full:
                one["1 eager"] = median_ms_counted(
                    _fwd_bwd(lambda: layer(x_all, cup), [x_all] + params, grad), warmup, runs, device
                )
            if opts.get("fla_cp"):  # FLA's kernels on one GPU, the same layer, eager
                fla_one = fla_cp_layer_step(layer, cup)
                one["1 FLA eager"] = median_ms_counted(
                    _fwd_bwd(lambda: fla_one(x_all), [x_all] + params, grad), warmup, runs, device
                )
            if profile:
                step = _fwd_bwd(lambda: compiled["fn"](x_all, cup), [x_all] + params, grad)
                one.update({f"prof 1 {k}": v for k, v in profile_step(step).items()})
            del x_all
        dist.barrier()
        progress("one GPU timed")
        del x, grad
        torch.cuda.empty_cache()

        if full:  # where one rank's step goes
            for name, fn in piece_steps(layer, x_cp, cup, world).items():
                res[name] = timed(fn)
            fused = a2a_steps(layer, x_cp, cup, group, thd_cp2hp, thd_hp2cp)
            per_seq = a2a_steps(layer, x_cp, cup, group, per_sequence_cp2hp, per_sequence_hp2cp)
            for name in ("cp2hp", "hp2cp"):
                res[f"{name} fwd+bwd"] = timed(fused[name])
                res[f"per-seq {name} fwd+bwd"] = timed(per_seq[name], per_sequence=True)
            del fused, per_seq
        results[(total, num_seqs)] = {**one, **res}
        if rank == 0:  # a line and the table so far, so a run cut short by a time limit still reports
            done = ", ".join(f"{k} {v:.4g}" for k, v in results[(total, num_seqs)].items()
                             if k.startswith(("err", "W ", "1 ")))  # fmt: skip
            print(f"T={total} B={num_seqs}: {done}", flush=True)
            emit([result()], out, quiet=True)
        del x_cp, grad_cp
        torch.cuda.empty_cache()

    if rank == 0:
        emit([result()], out)
    worst = max(v for r in results.values() for k, v in r.items() if k.startswith("err ") and not math.isnan(v))
    if not worst < CP_TOLERANCE:
        raise AssertionError(f"CP output off by rel_error {worst:.3g} >= {CP_TOLERANCE} against one device")
    fla = max((r["FLA vs ours, 1 GPU"] for r in results.values() if "FLA vs ours, 1 GPU" in r), default=0.0)
    if not fla < FLA_TOLERANCE:
        raise AssertionError(f"FLA's layer off by rel_error {fla:.3g} >= {FLA_TOLERANCE} against the package's")


def _cp_table(results, cases, world, dims, dtype, runs, seq_runs, notes) -> tuple[str, list, list, str]:
    """``(title, columns, rows, notes)`` of the CP table: a row per quantity, a column per case."""
    hidden, hk, hv, dk, dv = dims
    w = f"W={world}"
    for case in cases:  # rows a run skipped (--compiled-only) read nan
        r = results[case] = collections.defaultdict(lambda: math.nan, results[case])
        r["eff compiled"] = r["1 compiled"] / (world * r["W compiled"])
        r["eff compiled states"] = r["1 compiled"] / (world * r["W compiled states"])
        r["eff FLA CP"] = r["1 FLA eager"] / (world * r["W FLA CP eager"])
        r["FLA CP cost"] = r["W FLA CP eager"] - r["1 FLA eager"] / world
        r["states cost"] = r["W compiled states"] - r["1 compiled"] / world
        r["eff eager"] = r["1 eager"] / (world * r["W eager"])
        r["eff compiled unfused"] = r["1 compiled"] / (world * r["W compiled unfused"])
        r["eff eager unfused"] = r["1 eager"] / (world * r["W eager unfused"])
        r["per-seq / fused"] = r["W per-seq eager"] / r["W eager"]
        r["a2a"] = r["cp2hp fwd+bwd"] + r["hp2cp fwd+bwd"]
        r["per-seq a2a"] = r["per-seq cp2hp fwd+bwd"] + r["per-seq hp2cp fwd+bwd"]
        r["sum"] = sum(
            r[k]
            for k in ("in_proj fwd+bwd", "cp2hp fwd+bwd", "conv fwd+bwd", "core fwd+bwd",
                      "gated norm fwd+bwd compiled", "hp2cp fwd+bwd", "out_proj fwd+bwd")
        )  # fmt: skip
    e, t, x = "{:.2e}", "{:.3f}", "{:.2f}"
    errors = {"eager": "err eager", "compiled": "err compiled", "eager, per-seq a2a": "err per-seq",
              "compiled, unfused": "err compiled unfused", "compiled, chunk states": "err compiled states",
              "eager, FLA's own (vs FLA's 1 GPU)": "err FLA CP"}  # fmt: skip
    table = [(f"rel error vs 1 GPU: CP {label}", key, e) for label, key in errors.items()]
    table += [("rel error, 1 GPU: FLA's layer vs the package's", "FLA vs ours, 1 GPU", e)]
    for mode in ("compiled", "eager"):
        table += [(f"1 GPU fwd+bwd {mode}", f"1 {mode}", t), (f"{w} fwd+bwd {mode}", f"W {mode}", t),
                  (f"scaling efficiency, {mode}", f"eff {mode}", x),
                  (f"{w} fwd+bwd {mode}, unfused", f"W {mode} unfused", t),
                  (f"scaling efficiency, {mode}, unfused", f"eff {mode} unfused", x)]  # fmt: skip
    table += [(f"{w} fwd+bwd compiled, chunk states", "W compiled states", t),
              ("scaling efficiency, compiled, chunk states", "eff compiled states", x),
              (f"cost over 1/{world} of 1 GPU, compiled, chunk states", "states cost", t),
              ("1 GPU fwd+bwd eager, FLA's kernels", "1 FLA eager", t),
              (f"{w} fwd+bwd eager, FLA's CP", "W FLA CP eager", t),
              ("scaling efficiency, FLA's CP", "eff FLA CP", x),
              (f"cost over 1/{world} of 1 GPU, FLA's CP", "FLA CP cost", t),
              ("MiB one rank sends per fwd+bwd, by heads", "MiB heads", "{:.1f}"),
              ("MiB one rank sends per fwd+bwd, by chunk states", "MiB states", "{:.1f}")]  # fmt: skip
    table += [(f"{w} fwd+bwd eager, per-seq a2a", "W per-seq eager", t),
              ("per-seq a2a / fused a2a (eager layer)", "per-seq / fused", x)]  # fmt: skip
    table += [(k, k, t) for k in ("in_proj fwd+bwd", "cp2hp fwd+bwd", "conv fwd+bwd", "core fwd", "core fwd+bwd",
                                  "core by states fwd+bwd", "gated norm fwd+bwd eager", "gated norm fwd+bwd compiled",
                                  "hp2cp fwd+bwd", "out_proj fwd+bwd")]  # fmt: skip
    table += [("sum of the fwd+bwd pieces (compiled norm)", "sum", t),
              ("all-to-alls (cp2hp + hp2cp fwd+bwd)", "a2a", t),
              ("per-seq all-to-alls (cp2hp + hp2cp fwd+bwd)", "per-seq a2a", t)]  # fmt: skip
    table += [(k, k, t) for k in ("per-seq cp2hp fwd+bwd", "per-seq hp2cp fwd+bwd")]
    title = (f"GatedDeltaNet with CP, {w} (hidden {hidden}, Hk {hk}, Hv {hv}, dk {dk}, dv {dv}), "
             f"{str(dtype).removeprefix('torch.')}")  # fmt: skip
    text = [
        f"times in ms: median of {runs} runs ({seq_runs} for per-seq), max over ranks; 1 GPU on rank 0 alone; "
        f"efficiency = T_1 / (W * T_W); rel error on real tokens, max over ranks; the pieces below the "
        f"efficiency rows are one rank's share (projections and gated norm on T/W rows; conv and "
        f"core on T rows, 1/W of the heads)"
    ]
    text += [f"- {n}" for n in notes]
    columns = [""] + [f"T={t} B={b}" for t, b in cases]
    rows = []
    if "prof W wall" in results[cases[0]]:  # --profile: rank 0's compiled steps by kernel class
        for who, label in (("1", "1 GPU"), ("W", w)):
            for k in ["wall", "GPU busy", "idle", "compute busy", "collectives only", *dict(KERNEL_CLASSES), "other"]:
                table.append((f"profile, compiled {label}: {k}", f"prof {who} {k}", t))
        table.append(("profile, compiled 1 GPU: host issue", "prof 1 host issue", t))
        for r in range(world):
            for k in RANK_KEYS:
                table.append((f"profile, compiled {w} rank {r}: {k}", f"prof W rank {r}: {k}", t))
    for label, key, fmt in table:
        values = [results[c].get(key, math.nan) for c in cases]
        if all(math.isnan(v) for v in values):
            continue  # a row the flags skipped
        rows.append([label] + [fmt.format(v) for v in values])  # each row its own format: kept as text
    return title, columns, rows, "\n".join(text)


# --conv --sweep: the launch configs tried (rows, channels a program, warps; one stage, as the
# kernels' loads are issued a step ahead by hand)
SWEEP_ROWS = {"fwd": (128, 256, 512), "bwd": (256, 512, 1024)}
SWEEP_BLOCKS, SWEEP_WARPS = (256, 512, 1024), (4, 8)


def conv_sweep(tokens: int, num_seqs: int, out) -> None:
    """Time our conv kernels under each launch config in the GDN layer's form on one GPU (x a
    column slice of the projection output, q and k normalised in two blocks, v in its own tensor)."""
    from custom_ops.conv1d.op import ConvConfig, ConvSettings, _conv_backward_kernel, _conv_forward

    channels, split, norm = CONV_CHANNELS[0], 2 * HK * DK, (DK, custom_ops.L2NORM_EPS)
    cu, x, w = conv_inputs(tokens, num_seqs, channels)
    grad_head = torch.randn(2, tokens, split // 2, device="cuda", dtype=torch.bfloat16)
    grad_tail = torch.randn(tokens, channels - split, device="cuda", dtype=torch.bfloat16)
    calls = {
        "fwd": lambda s: _conv_forward(x, w, None, cu, "silu", s, None, split, norm, 2),
        "bwd": lambda s: _conv_backward_kernel(grad_head, x, w, None, cu, "silu", s, None, None, grad_tail, norm),
    }
    times = {}
    for kind, call in calls.items():
        for r, b, nw in itertools.product(SWEEP_ROWS[kind], SWEEP_BLOCKS, SWEEP_WARPS):
            settings = ConvSettings(**{kind: ConvConfig(r, b, nw, 1)})
            times[kind, r, b, nw] = median_ms(lambda: call(settings))
            print(f"[bench_gdn] conv {kind} {getattr(settings, kind)}: {times[kind, r, b, nw]:.3f} ms", flush=True)
    title, columns, rows, notes = sweep_table(times, tokens, num_seqs, channels, split)
    emit([Result("conv", title, columns, rows, notes, environment(), name="conv-sweep")], out)


def sweep_table(times: dict, tokens: int, num_seqs: int, channels: int, split: int) -> tuple:
    """``(title, columns, rows, notes)`` of the sweep: a row per kernel and rows a program, a
    column per channels a program and warps, ms."""
    blocks = sorted({(b, nw) for _, _, b, nw in times})
    columns = ["kernel", "rows"] + [f"{b} ch, {nw} warps" for b, nw in blocks]
    rows = [[kind, r] + [times.get((kind, r, b, nw)) for b, nw in blocks]
            for kind, r in dict.fromkeys((kind, r) for kind, r, _, _ in times)]  # fmt: skip
    title = f"our causal conv1d kernels by launch config, the GDN layer's form (T={tokens} B={num_seqs} C={channels})"
    notes = (f"median ms of do_bench; q, k (the first {split} columns) l2-normalised over groups of {DK} and written "
             "in two blocks, v in its own tensor; x a column slice of the projection output")  # fmt: skip
    return title, columns, rows, notes


def conv_main(tokens, seqs, gather: bool, out) -> None:
    torch.manual_seed(0)
    if gather:
        cases = [(t, b, 4096) for t in tokens for b in seqs]
        results = [bench_conv_gather(t, b, c) for t, b, c in cases]
        title = "causal conv1d of rows in rank order (one rank of W = 2: 4096 channels + 32 columns), compiled"
        name = "conv-gather"
    else:
        cases = [(t, b, c) for c in CONV_CHANNELS for t in tokens for b in seqs]
        results = [bench_conv(*case) for case in cases]
        title = f"causal conv1d (kernel {CONV_KERNEL}, silu, bf16), ours against FLA's"
        name = "conv"
    keys = list(results[0])
    rows = [[k] + [r[k] if "err" not in k else f"{r[k]:.1e}" for r in results] for k in keys]
    notes = "times in ms (median, do_bench); GB/s = bytes a fused kernel moves / time"
    header = [""] + [f"T={t} B={b} C={c}" for t, b, c in cases]
    emit([Result("conv", title, header, rows, notes, environment(), name=name)], out)


def main() -> None:
    checks_off()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", help=f"global tokens per batch (default {TOKENS})")
    parser.add_argument("--seqs", type=int, nargs="+", help=f"sequences per batch (default {SEQS})")
    parser.add_argument("--cp", type=int, default=0, help="W: run the CP layer on W ranks (one GPU each, NCCL)")
    parser.add_argument("--smoke", action="store_true", help="with --cp: gloo ranks on the CPU, tiny layer, few runs")
    parser.add_argument("--compiled-only", action="store_true",
                        help="with --cp: only the compiled layer's rows (and --profile's); no eager, unfused, "
                        "per-seq or piece rows")
    parser.add_argument("--states", action="store_true",
                        help="with --cp: also the layer by chunk states (cp_ops.StatePassing), compiled")
    parser.add_argument("--fla-cp", action="store_true",
                        help="with --cp: also the layer with FLA's own CP conv and delta rule (fla.ops.cp, eager, "
                        "contiguous layout) on W GPUs and FLA's kernels on one")
    parser.add_argument("--cudagraphs", action="store_true",
                        help="with --cp: compile the layer with CUDA graphs (Inductor's triton.cudagraphs), "
                        "on W GPUs and on one")
    add_out_argument(parser)
    parser.add_argument("--kernel-time", action="store_true",
                        help="one GPU: also the summed kernel time of each row (torch.profiler) and, with "
                        "--rank-share, the state-passing core's by kernel class")
    parser.add_argument("--profile", action="store_true",
                        help="with --cp: also split rank 0's compiled step (1 GPU and W GPUs) by kernel class "
                        "and GPU idle time (torch.profiler)")
    parser.add_argument("--rank-share", type=int, nargs="+", default=[], metavar="W",
                        help="one GPU: also time one rank's pieces of a W-rank CP layer, no collectives")
    parser.add_argument("--conv", action="store_true", help="one GPU: the conv kernels against FLA's, not the layer")
    parser.add_argument("--core", action="store_true",
                        help="one GPU: the GDN core op alone by kernel backend (FLA, FlashQLA), not the layer")
    parser.add_argument("--heads", nargs="+", metavar="HK/HV",
                        help="with --core: key/value head counts (default " + " ".join(f"{a}/{b}" for a, b in CORE_HEADS)
                        + f"); --tokens default {' '.join(map(str, CORE_TOKENS))}")
    parser.add_argument("--backends", nargs="+", choices=("fla", "flashqla"), metavar="BACKEND",
                        help="the layer (one GPU or --cp) once with each GDN core backend (fla, flashqla), "
                        "each result named with it; default: the backend CP_OPS_GDN_BACKEND chooses")
    parser.add_argument("--gather", action="store_true",
                        help="with --conv: the conv on rows in rank order, reorder + conv against the gathered conv")
    parser.add_argument("--sweep", action="store_true",
                        help=f"with --conv: our kernels' launch configs in the layer's form (T = --tokens, default "
                             f"{CONV_SWEEP_TOKENS}, B = --seqs, default {CORE_SEQS})")
    args = parser.parse_args()
    if (args.gather or args.sweep) and not args.conv:
        raise SystemExit("--gather and --sweep need --conv")
    opts = {k: getattr(args, k) for k in ("compiled_only", "cudagraphs", "profile", "states", "fla_cp")}
    if args.smoke and (args.cudagraphs or args.fla_cp):
        raise SystemExit("--cudagraphs and --fla-cp need GPUs, not --smoke")
    if args.fla_cp and not args.cp:
        raise SystemExit("--fla-cp is a row of the CP table: it needs --cp W")
    if args.smoke:
        world = args.cp or 2
        tokens, seqs = args.tokens or SMOKE_TOKENS, args.seqs or SMOKE_SEQS
        if SMOKE_DIMS[1] % world:
            raise SystemExit(f"--smoke runs a layer with Hk = {SMOKE_DIMS[1]}; --cp must divide it")
        spawn_ranks(_cp_rank, world, tokens, seqs, args.out, True, {**opts, "profile": False}, device="cpu")
        return
    tokens, seqs = args.tokens or TOKENS, args.seqs or SEQS
    if args.cp:
        if args.cp < 2 or HK % args.cp:
            raise SystemExit(f"--cp must be at least 2 and divide Hk = {HK}, got {args.cp}")
        for backend in args.backends or [None]:
            if backend is not None:  # the ranks read it as they trace and call the GDN ops
                os.environ["CP_OPS_GDN_BACKEND"] = backend
            spawn_ranks(_cp_rank, args.cp, tokens, seqs, args.out, False, {**opts, "backend": backend},
                        device="cuda", keep_group=args.cudagraphs)  # fmt: skip
        return
    if not torch.cuda.is_available():
        raise SystemExit("bench_gdn needs a CUDA device (or --cp 2 --smoke on the CPU)")
    if args.conv and args.sweep:
        return conv_sweep((args.tokens or [CONV_SWEEP_TOKENS])[0], (args.seqs or [CORE_SEQS])[0], args.out)
    if args.conv:
        return conv_main(tokens, seqs, args.gather, args.out)
    if args.core:
        heads = [tuple(int(n) for n in h.split("/")) for h in args.heads] if args.heads else CORE_HEADS
        return core_main(args.tokens or CORE_TOKENS, heads, args.out)

    from custom_ops.gated_delta_rule import backends

    torch.manual_seed(0)
    layer = GatedDeltaNet(HIDDEN, HK, HV, DK, DV).to("cuda", torch.bfloat16)
    for backend in args.backends or [None]:
        backends.set_backend(backend)
        torch._dynamo.reset()  # a compiled layer keeps the backend it was traced with
        results = {}
        for case in [(t, b) for t in tokens for b in seqs]:
            results[case] = bench_case(layer, *case, args.kernel_time, args.rank_share)
            # the table so far after every case, so a run cut by a time limit still leaves one
            columns = [""] + [f"T={t} B={b}" for t, b in results]
            rows = [[name] + [r[name] for r in results.values()] for name in results[case]]
            title = f"GatedDeltaNet (hidden {HIDDEN}, Hk {HK}, Hv {HV}, dk = dv = {DK}), bf16, median ms"
            name = "gdn" + (f"-{backend}" if backend else "")
            notes = f"each row: the median of triton.testing.do_bench over {LAYER_REP_MS} ms of calls"
            emit([Result("gdn", title, columns, rows, notes, fla_environment(), name=name)], args.out)


if __name__ == "__main__":
    main()
