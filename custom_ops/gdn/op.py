"""Gated DeltaNet core ops (causal depthwise conv1d, chunked gated delta rule) on packed THD sequences.

The ops are opaque ``torch.library.custom_op``s: under ``torch.compile`` Inductor
sees one extern call per op and never traces into flash-linear-attention (FLA),
whose own autograd entry points are ``@torch.compiler.disable``. On CUDA the conv
runs this package's Triton kernels for kernel widths up to 4
(:mod:`custom_ops.gdn.kernels`, faster than FLA's forward+backward at the layer's
shapes; docs/benchmarks.md, section "The causal conv1d kernels") and FLA's for wider ones; the delta
rule calls FLA's internal forward/backward functions directly.
``causal_conv1d_gather`` is the conv of rows held in another order, read and
written through a row map by the same kernels. On CPU all run the torch references
in :mod:`custom_ops.gdn.reference`. Under ``TRITON_INTERPRET=1`` the
conv runs its kernels on CPU tensors in Triton's interpreter (how they are tested
without a GPU); the delta rule cannot.

No host syncs: the conv kernels' grids are sized from shapes, and the rows' positions
in their sequences are computed on the device. FLA's varlen kernels take
``chunk_indices`` (one ``(sequence, chunk)`` row per program) whose length, the number
of 64-row chunks, depends on the lengths. FLA builds it with ``repeat_interleave`` on
device counts, which reads the total on the host. Here it is built by
:func:`fla_varlen_indices` with a length fixed by shapes, ``T // 64 + B``, an upper
bound; the spare rows point at an extra zero-length sequence appended to
``cu_seqlens``, whose programs load nothing and store nothing. FLA then never calls
``prepare_chunk_indices``.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.nn.functional as F

from custom_ops._common import NAMESPACE, cdiv, check_index_tensor, launch_direct, unit_last_stride, use_triton
from custom_ops.gdn.kernels import MAX_TAPS
from custom_ops.gdn.reference import (
    causal_conv1d_gather_reference,
    causal_conv1d_reference,
    causal_conv1d_reference_backward,
    check_activation,
    chunk_gated_delta_rule_reference,
    chunk_gated_delta_rule_reference_backward,
    row_positions,
)
from custom_ops.validation import checked

# FLA's chunk length for both kernels (its default; the GDN kernels take 16, 32 or 64).
FLA_CHUNK = 64
# FLA's GDN kernels keep a [dk, dv] state tile in registers/shared memory.
MAX_HEAD_DIM = 256


def fla_varlen_indices(
    cu_seqlens: torch.Tensor, num_rows: int, chunk_size: int = FLA_CHUNK
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cu_ext [B+2], chunk_indices [T // chunk_size + B, 2])`` for FLA's varlen kernels, sync-free.

    ``chunk_indices[s] = (i, c)``: program s handles chunk c of sequence i. The
    real rows are FLA's own (``prepare_chunk_indices``): sequences in order,
    ``ceil(L_i / chunk_size)`` rows each. Their count is at most
    ``sum_i (L_i // chunk_size + 1) <= T // chunk_size + B``, so the tensor has
    that many rows and every spare row is ``(B, 0)``: chunk 0 of the zero-length
    sequence ``cu_ext[B] .. cu_ext[B+1]`` appended here, which FLA's kernels
    process as empty (masked loads and stores; its per-chunk partial sums are zero).
    ``cu_seqlens`` is clamped to ``[0, num_rows]`` first: a layout whose last entry
    exceeds the rows (validate_thd reports it where data is prepared) then gives
    wrong rows, never an out-of-bounds access inside FLA's kernels.
    """
    cu = cu_seqlens.clamp(0, num_rows)
    num_seqs = cu.numel() - 1
    slots = num_rows // chunk_size + num_seqs
    cu_ext = torch.cat([cu, cu[-1:]])
    lens = (cu[1:] - cu[:-1]).to(torch.int64)
    offsets = F.pad(torch.div(lens + chunk_size - 1, chunk_size, rounding_mode="floor").cumsum(0), (1, 0))
    slot = torch.arange(slots, device=cu.device, dtype=torch.int64)
    # right-sided search skips zero-length sequences; slots past the last chunk land on B
    seq = torch.searchsorted(offsets, slot, right=True) - 1
    real = seq < num_seqs
    chunk = torch.where(real, slot - offsets[seq.clamp(max=num_seqs)], 0)
    return cu_ext, torch.stack([seq, chunk], 1).to(cu.dtype)


@contextlib.contextmanager
def _fla_uncached():
    """FLA's ``tensor_cache`` off for one call into FLA.

    These ops pass FLA its ``chunk_indices``, so what FLA still caches is derived from the
    ``cu_seqlens`` each call builds anew (``prepare_chunk_offsets``, ``prepare_lens``): an
    identity key never hit again. The cache would only keep those tensors, and that
    ``cu_seqlens``, alive after the op returns; under CUDA graphs (``torch.compile`` with
    Inductor's ``triton.cudagraphs``) that is memory in the graph's pool that no output
    accounts for, which the graph trees refuse ("tensor(s) in the cudagraph pool not
    tracked as outputs"). FLA reads the switch ``fla.utils.FLA_DISABLE_TENSOR_CACHE`` at
    every call.
    """
    import fla.utils

    before = getattr(fla.utils, "FLA_DISABLE_TENSOR_CACHE", False)
    fla.utils.FLA_DISABLE_TENSOR_CACHE = True
    try:
        yield
    finally:
        fla.utils.FLA_DISABLE_TENSOR_CACHE = before


# --- causal_conv1d ----------------------------------------------------------------------------


def _check_conv(x, weight, bias, cu_seqlens, activation) -> None:
    if x.dim() != 2:
        raise ValueError(f"x must be [T, C], got shape {tuple(x.shape)}")
    if weight.dim() != 2 or weight.shape[0] != x.shape[1]:
        raise ValueError(f"weight must be [C, K] with C = {x.shape[1]}, got shape {tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (x.shape[1],):
        raise ValueError(f"bias must be [C] with C = {x.shape[1]}, got shape {tuple(bias.shape)}")
    for name, t in (("x", x), ("weight", weight), ("bias", bias)):
        if t is not None and not t.dtype.is_floating_point:
            raise TypeError(f"{name} must be floating point, got {t.dtype}")
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}")
    check_index_tensor("cu_seqlens", cu_seqlens, x.device)
    check_activation(activation)


@torch.library.custom_op(f"{NAMESPACE}::causal_conv1d", mutates_args=())
def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    cu_seqlens: torch.Tensor,
    activation: Optional[str] = "silu",
) -> torch.Tensor:
    """Depthwise causal conv1d over packed sequences, zero history at every sequence start.

    ``y[t, c] = act(bias[c] + sum_{j<K} weight[c, K-1-j] * x[t-j, c])`` with
    ``x[t-j]`` taken as zero before the row's sequence starts.
    x ``[T, C]`` (may be a column slice of a wider tensor), weight ``[C, K]``,
    bias ``[C]`` or None, cu_seqlens ``[B+1]`` (int32/int64, ``cu[-1] = T``),
    activation ``"silu"``/``"swish"`` or ``None``/``"identity"``. Returns ``[T, C]``
    in x's dtype. Differentiable in x, weight and bias. CUDA: for K <= 4 the Triton
    kernels of :mod:`custom_ops.gdn.kernels` (the backward recomputes the
    pre-activation in registers), for wider kernels FLA's ``causal_conv1d_fwd`` /
    ``causal_conv1d_bwd``; either way only the inputs are saved.
    """
    _check_conv(x, weight, bias, cu_seqlens, activation)
    cu_seqlens = checked("cumulative", cu_seqlens, (), x.shape[0])
    if not use_triton(x) or x.numel() == 0:
        return causal_conv1d_reference(x, weight, bias, cu_seqlens, activation).contiguous()
    if weight.shape[1] > MAX_TAPS:
        return _fla_conv_forward(x, weight, bias, cu_seqlens, activation)
    return _conv_forward(x, weight, bias, cu_seqlens, activation)


@causal_conv1d.register_fake
def _(x, weight, bias, cu_seqlens, activation="silu"):
    _check_conv(x, weight, bias, cu_seqlens, activation)
    return x.new_empty(x.shape)


@torch.library.custom_op(f"{NAMESPACE}::causal_conv1d_backward", mutates_args=())
def causal_conv1d_backward(
    grad_y: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    cu_seqlens: torch.Tensor,
    activation: Optional[str],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx ``[T, C]``, dweight ``[C, K]``, dbias ``[C]``) of :func:`causal_conv1d` (dbias even without bias)."""
    if not use_triton(x) or x.numel() == 0:
        return causal_conv1d_reference_backward(grad_y, x, weight, bias, cu_seqlens, activation)
    if weight.shape[1] > MAX_TAPS:
        return _fla_conv_backward(grad_y, x, weight, bias, cu_seqlens, activation)
    return _conv_backward_kernel(grad_y, x, weight, bias, cu_seqlens, activation)


def _conv_positions(cu_seqlens: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Each row's position in its sequence capped at MAX_TAPS, int32 ``[T]`` (what the kernels' taps test)."""
    return row_positions(cu_seqlens, num_rows).clamp_(max=MAX_TAPS).to(torch.int32)


def _conv_forward(x, weight, bias, cu_seqlens, activation, rows=None) -> torch.Tensor:
    """Our forward kernel; with ``rows``, sequence row t of x is its row ``rows[t]``."""
    from custom_ops.gdn.kernels import FWD_CONFIG, INTERPRETER_CONFIG, cp_causal_conv1d_fwd_kernel

    x = unit_last_stride(x)
    weight = weight.contiguous()
    num_rows, channels = x.shape
    block_rows, block_c, warps, stages = FWD_CONFIG if x.is_cuda else INTERPRETER_CONFIG
    y = torch.empty(num_rows, channels, dtype=x.dtype, device=x.device)
    pos = _conv_positions(cu_seqlens, num_rows)
    grid = (cdiv(num_rows, block_rows), cdiv(channels, block_c))
    launch_direct(
        cp_causal_conv1d_fwd_kernel, grid,
        x, weight, weight if bias is None else bias.contiguous(), y, pos, pos if rows is None else rows, num_rows,
        channels, x.stride(0), K=weight.shape[1], HAS_BIAS=bias is not None, SILU=_is_silu(activation),
        ROWS=block_rows, BLOCK_C=block_c, GATHER=rows is not None, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return y


def _conv_backward_kernel(grad_y, x, weight, bias, cu_seqlens, activation, rows=None, dx=None):
    """Our backward kernel; with ``rows``, sequence row t of x is its row ``rows[t]`` and so is
    that of dx (written into ``dx`` when given, an x-shaped view, else a new tensor)."""
    from custom_ops.gdn.kernels import BWD_CONFIG, INTERPRETER_CONFIG, cp_causal_conv1d_bwd_kernel

    x, grad_y = unit_last_stride(x), unit_last_stride(grad_y)
    w = weight.contiguous()
    num_rows, channels = x.shape
    kernel = w.shape[1]
    block_rows, block_c, warps, stages = BWD_CONFIG if x.is_cuda else INTERPRETER_CONFIG
    programs = cdiv(num_rows, block_rows)
    if dx is None:
        dx = torch.empty(num_rows, channels, dtype=x.dtype, device=x.device)
    dw_parts = torch.empty(programs, channels, MAX_TAPS, dtype=torch.float32, device=x.device)
    db_parts = torch.empty(programs, channels, dtype=torch.float32, device=x.device)
    pos = _conv_positions(cu_seqlens, num_rows)
    launch_direct(
        cp_causal_conv1d_bwd_kernel, (programs, cdiv(channels, block_c)),
        x, w, w if bias is None else bias.contiguous(), grad_y, dx, dw_parts, db_parts, pos,
        pos if rows is None else rows, num_rows, channels, x.stride(0), grad_y.stride(0), dx.stride(0), K=kernel,
        HAS_BIAS=bias is not None, SILU=_is_silu(activation), ROWS=block_rows, BLOCK_C=block_c,
        GATHER=rows is not None, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    dw = dw_parts.sum(0)[:, :kernel].to(weight.dtype)
    db = db_parts.sum(0).to(bias.dtype if bias is not None else weight.dtype)
    return dx, dw, db


def _is_silu(activation: Optional[str]) -> bool:
    return activation in ("silu", "swish")


def _fla_conv_forward(x, weight, bias, cu_seqlens, activation) -> torch.Tensor:
    from fla.modules.causal_conv1d.ops import causal_conv1d_fwd

    cu_ext, chunk_indices = fla_varlen_indices(cu_seqlens, x.shape[0])
    with _fla_uncached():
        y, _ = causal_conv1d_fwd(
            x=x.unsqueeze(0), weight=weight.contiguous(), bias=None if bias is None else bias.contiguous(),
            residual=None, initial_state=None, output_final_state=False,
            activation="silu" if _is_silu(activation) else None, cu_seqlens=cu_ext, chunk_indices=chunk_indices,
            chunk_size=FLA_CHUNK,
        )  # fmt: skip
    return y.view(x.shape)


def _fla_conv_backward(grad_y, x, weight, bias, cu_seqlens, activation):
    from fla.modules.causal_conv1d.ops import causal_conv1d_bwd

    cu_ext, chunk_indices = fla_varlen_indices(cu_seqlens, x.shape[0])
    # FLA sums dbias only for a bias; a zero one gives the sum the op returns without one
    b = weight.new_zeros(weight.shape[0]) if bias is None else bias.contiguous()
    with _fla_uncached():
        dx, dw, db, _, _ = causal_conv1d_bwd(
            x=x.unsqueeze(0), dy=grad_y.unsqueeze(0), dht=None, weight=weight.contiguous(), bias=b, residual=None,
            initial_state=None, activation="silu" if _is_silu(activation) else None, cu_seqlens=cu_ext,
            chunk_indices=chunk_indices, chunk_size=FLA_CHUNK,
        )  # fmt: skip
    return dx.view(x.shape).contiguous(), dw, db


@causal_conv1d_backward.register_fake
def _(grad_y, x, weight, bias, cu_seqlens, activation):
    db_dtype = bias.dtype if bias is not None else weight.dtype
    return x.new_empty(x.shape), weight.new_empty(weight.shape), weight.new_empty(weight.shape[0], dtype=db_dtype)


def _conv_setup_context(ctx, inputs, output):
    x, weight, bias, cu_seqlens, activation = inputs
    ctx.save_for_backward(x, weight, bias, cu_seqlens)
    ctx.activation = activation


def _conv_backward(ctx, grad_y):
    x, weight, bias, cu_seqlens = ctx.saved_tensors
    dx, dw, db = torch.ops.cp_ops.causal_conv1d_backward(grad_y, x, weight, bias, cu_seqlens, ctx.activation)
    return dx, dw, (db if bias is not None else None), None, None


causal_conv1d.register_autograd(_conv_backward, setup_context=_conv_setup_context)


# --- causal_conv1d_gather ---------------------------------------------------------------------


def _check_conv_gather(x, rows, weight, bias, cu_seqlens, activation) -> None:
    if x.dim() != 2:
        raise ValueError(f"x must be [T, F], got shape {tuple(x.shape)}")
    check_index_tensor("rows", rows, x.device, min_numel=0)
    if rows.dim() != 1 or rows.shape[0] != x.shape[0]:
        raise ValueError(f"rows must be [T] with T = {x.shape[0]} (a permutation of x's rows), got {tuple(rows.shape)}")
    if weight.dim() != 2 or weight.shape[0] > x.shape[1]:
        raise ValueError(f"weight must be [C, K] with C <= F = {x.shape[1]}, got shape {tuple(weight.shape)}")
    _check_conv(x[:, : weight.shape[0]], weight, bias, cu_seqlens, activation)


@torch.library.custom_op(f"{NAMESPACE}::causal_conv1d_gather", mutates_args=())
def causal_conv1d_gather(
    x: torch.Tensor,
    rows: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    cu_seqlens: torch.Tensor,
    activation: Optional[str] = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`causal_conv1d` of x's rows taken in the order ``rows``, on its first C columns:
    ``(causal_conv1d(x[rows, :C], weight, bias, cu_seqlens, activation), x[rows, C:])``.

    x ``[T, F]`` with ``C = weight.shape[0] <= F``; rows ``[T]`` (int32/int64) a permutation of
    ``range(T)``: sequence row t (the layout ``cu_seqlens`` describes) is x's row ``rows[t]``.
    Both outputs are in sequence order. The point is the pass it saves: on CUDA (K <= 4) the
    kernels read x's rows where they are and the backward writes dx ``[T, F]`` the same way,
    both column ranges, so a caller whose rows arrive permuted (:class:`cp_ops.GatedDeltaNet`,
    its all-to-all's rank order) never reorders them in memory, in either direction. rows
    must be a permutation: the CUDA backward writes every row of dx once, through rows (the
    reference adds, as the gradient of ``x[rows]`` does; the two agree on permutations).
    """
    _check_conv_gather(x, rows, weight, bias, cu_seqlens, activation)
    rows = checked("permutation", rows, (), x.shape[0])
    cu_seqlens = checked("cumulative", cu_seqlens, (), x.shape[0])
    channels = weight.shape[0]
    if not use_triton(x) or x.numel() == 0:
        return causal_conv1d_gather_reference(x, rows, weight, bias, cu_seqlens, activation)
    if weight.shape[1] > MAX_TAPS:  # FLA's kernels, on the gathered rows
        xs = x.index_select(0, rows)
        y = _fla_conv_forward(xs[:, :channels], weight, bias, cu_seqlens, activation)
        return y, xs[:, channels:].clone(memory_format=torch.contiguous_format)
    y = _conv_forward(x[:, :channels], weight, bias, cu_seqlens, activation, rows)
    return y, x[:, channels:].index_select(0, rows)


@causal_conv1d_gather.register_fake
def _(x, rows, weight, bias, cu_seqlens, activation="silu"):
    _check_conv_gather(x, rows, weight, bias, cu_seqlens, activation)
    channels = weight.shape[0]
    return x.new_empty(x.shape[0], channels), x.new_empty(x.shape[0], x.shape[1] - channels)


@torch.library.custom_op(f"{NAMESPACE}::causal_conv1d_gather_backward", mutates_args=())
def causal_conv1d_gather_backward(
    grad_y: torch.Tensor,
    grad_rest: torch.Tensor,
    x: torch.Tensor,
    rows: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    cu_seqlens: torch.Tensor,
    activation: Optional[str],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx ``[T, F]``, dweight, dbias) of :func:`causal_conv1d_gather` for the gradients of its
    two outputs."""
    channels = weight.shape[0]
    if not use_triton(x) or x.numel() == 0 or weight.shape[1] > MAX_TAPS:
        # the backward of the conv on the gathered rows (causal_conv1d_backward, which picks the
        # reference or FLA's kernels), then that of the gather (an index_add)
        xs = x.index_select(0, rows)
        dxs, dw, db = causal_conv1d_backward(grad_y, xs[:, :channels], weight, bias, cu_seqlens, activation)
        dx = torch.zeros_like(x).index_add_(0, rows.long(), torch.cat([dxs, grad_rest.to(dxs.dtype)], 1))
        return dx, dw, db
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _, dw, db = _conv_backward_kernel(
        grad_y, x[:, :channels], weight, bias, cu_seqlens, activation, rows, dx[:, :channels]
    )
    dx[:, channels:].index_copy_(0, rows.long(), grad_rest.to(dx.dtype))
    return dx, dw, db


@causal_conv1d_gather_backward.register_fake
def _(grad_y, grad_rest, x, rows, weight, bias, cu_seqlens, activation):
    db_dtype = bias.dtype if bias is not None else weight.dtype
    return x.new_empty(x.shape), weight.new_empty(weight.shape), weight.new_empty(weight.shape[0], dtype=db_dtype)


def _conv_gather_setup_context(ctx, inputs, output):
    x, rows, weight, bias, cu_seqlens, activation = inputs
    ctx.save_for_backward(x, rows, weight, bias, cu_seqlens)
    ctx.activation = activation


def _conv_gather_backward(ctx, grad_y, grad_rest):
    x, rows, weight, bias, cu_seqlens = ctx.saved_tensors
    dx, dw, db = torch.ops.cp_ops.causal_conv1d_gather_backward(
        grad_y, grad_rest, x, rows, weight, bias, cu_seqlens, ctx.activation
    )
    return dx, None, dw, (db if bias is not None else None), None, None


causal_conv1d_gather.register_autograd(_conv_gather_backward, setup_context=_conv_gather_setup_context)


# --- chunk_gated_delta_rule -------------------------------------------------------------------


def _check_gdn(q, k, v, g, beta, cu_seqlens) -> None:
    for name, t, dim in (("q", q, 3), ("k", k, 3), ("v", v, 3), ("g", g, 2), ("beta", beta, 2)):
        if t.dim() != dim:
            raise ValueError(f"{name} must be {dim}-D, got shape {tuple(t.shape)}")
        if not t.dtype.is_floating_point:
            raise TypeError(f"{name} must be floating point, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    num_rows, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    if k.shape != q.shape:
        raise ValueError(f"q and k must have one shape [T, Hk, dk], got {tuple(q.shape)} and {tuple(k.shape)}")
    if v.shape[0] != num_rows or tuple(g.shape) != (num_rows, hv) or tuple(beta.shape) != (num_rows, hv):
        raise ValueError(
            f"v must be [T, Hv, dv] and g, beta [T, Hv] with T = {num_rows}; got v {tuple(v.shape)}, "
            f"g {tuple(g.shape)}, beta {tuple(beta.shape)}"
        )
    if hk == 0 or hv % hk != 0:
        raise ValueError(f"the value heads Hv = {hv} must be a multiple of the key heads Hk = {hk}")
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise TypeError(f"q, k, v must have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.device.type == "cuda" and max(dk, dv) > MAX_HEAD_DIM:
        raise ValueError(f"FLA's kernels take head dims up to {MAX_HEAD_DIM}, got dk = {dk}, dv = {dv}")
    check_index_tensor("cu_seqlens", cu_seqlens, q.device)


def _resolve_scale(q: torch.Tensor, scale: Optional[float]) -> float:
    return q.shape[-1] ** -0.5 if scale is None else scale


def _uses_fla(q: torch.Tensor) -> bool:
    # CUDA only: FLA's state-passing kernel does not run in Triton's interpreter (its
    # loop counter is a Python int there), so CPU tensors always take the reference.
    return q.device.type == "cuda" and q.shape[0] > 0


def _aux_shapes(q, v):
    """Shapes of what the forward keeps for FLA's backward; nothing on the reference path."""
    if not _uses_fla(q):
        return (0,), (0,)
    return (v.shape[0], v.shape[1]), (v.shape[0], v.shape[1], FLA_CHUNK)


@torch.library.custom_op(f"{NAMESPACE}::chunk_gated_delta_rule_forward", mutates_args=())
def chunk_gated_delta_rule_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: Optional[float] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(o [T, Hv, dv], g_cum, A)``: the output of :func:`chunk_gated_delta_rule` and what its backward needs.

    CUDA: FLA's ``chunk_gated_delta_rule_fwd``; ``g_cum [T, Hv]`` (fp32) is g
    cumulated within each 64-row chunk (in log2 units) and ``A [T, Hv, 64]`` (q's
    dtype) the solved ``(I + tril(beta K K^T))^{-1}`` blocks, the two tensors FLA's
    own autograd keeps besides the inputs. CPU reference path: both are empty.
    """
    _check_gdn(q, k, v, g, beta, cu_seqlens)
    scale = _resolve_scale(q, scale)
    if not _uses_fla(q):
        o = chunk_gated_delta_rule_reference(q, k, v, g, beta, cu_seqlens, scale)
        return o, g.new_empty(0, dtype=torch.float32), q.new_empty(0)
    from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_fwd

    cu_ext, chunk_indices = fla_varlen_indices(cu_seqlens, q.shape[0])
    with _fla_uncached():
        g_cum, o, A, _, _, _ = chunk_gated_delta_rule_fwd(
            q=q.contiguous().unsqueeze(0),
            k=k.contiguous().unsqueeze(0),
            v=v.contiguous().unsqueeze(0),
            g=g.contiguous().unsqueeze(0),
            beta=beta.contiguous().unsqueeze(0),
            scale=scale,
            initial_state=None,
            output_final_state=False,
            cu_seqlens=cu_ext,
            chunk_indices=chunk_indices,
            chunk_size=FLA_CHUNK,
        )
    return o.squeeze(0).to(q.dtype), g_cum.squeeze(0), A.squeeze(0)


@chunk_gated_delta_rule_forward.register_fake
def _(q, k, v, g, beta, cu_seqlens, scale=None):
    _check_gdn(q, k, v, g, beta, cu_seqlens)
    g_shape, a_shape = _aux_shapes(q, v)
    return v.new_empty(v.shape, dtype=q.dtype), g.new_empty(g_shape, dtype=torch.float32), q.new_empty(a_shape)


@torch.library.custom_op(f"{NAMESPACE}::chunk_gated_delta_rule_backward", mutates_args=())
def chunk_gated_delta_rule_backward(
    grad_o: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    g_cum: torch.Tensor,
    A: torch.Tensor,
    scale: Optional[float] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dg, dbeta) of :func:`chunk_gated_delta_rule`, from the forward's saved tensors.

    CUDA: FLA's ``chunk_gated_delta_rule_bwd`` (it recomputes w, u and the chunk
    states h from A and g_cum, as in FLA's own autograd). GVA: FLA sums the key-head
    gradients over each group of value heads. CPU: the reverse scan of the reference.
    """
    scale = _resolve_scale(q, scale)
    if not _uses_fla(q):
        return chunk_gated_delta_rule_reference_backward(grad_o, q, k, v, g, beta, cu_seqlens, scale)
    from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_bwd

    cu_ext, chunk_indices = fla_varlen_indices(cu_seqlens, q.shape[0])
    with _fla_uncached():
        dq, dk, dv, dbeta, dg, _, _, _ = chunk_gated_delta_rule_bwd(
            q=q.contiguous().unsqueeze(0),
            k=k.contiguous().unsqueeze(0),
            v=v.contiguous().unsqueeze(0),
            g=g_cum.unsqueeze(0),
            beta=beta.contiguous().unsqueeze(0),
            A=A.unsqueeze(0),
            scale=scale,
            initial_state=None,
            do=grad_o.contiguous().unsqueeze(0),
            dht=None,
            cu_seqlens=cu_ext,
            chunk_indices=chunk_indices,
            chunk_size=FLA_CHUNK,
        )
    return (
        dq.squeeze(0).to(q.dtype),
        dk.squeeze(0).to(k.dtype),
        dv.squeeze(0).to(v.dtype),
        dg.squeeze(0).to(g.dtype),
        dbeta.squeeze(0).to(beta.dtype),
    )


@chunk_gated_delta_rule_backward.register_fake
def _(grad_o, q, k, v, g, beta, cu_seqlens, g_cum, A, scale=None):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), g.new_empty(g.shape), beta.new_empty(beta.shape)


def _gdn_setup_context(ctx, inputs, output):
    q, k, v, g, beta, cu_seqlens, scale = inputs
    _, g_cum, A = output
    ctx.save_for_backward(q, k, v, g, beta, cu_seqlens, g_cum, A)
    ctx.scale = scale


def _gdn_backward(ctx, grad_o, _grad_g_cum, _grad_A):
    q, k, v, g, beta, cu_seqlens, g_cum, A = ctx.saved_tensors
    dq, dk, dv, dg, dbeta = torch.ops.cp_ops.chunk_gated_delta_rule_backward(
        grad_o, q, k, v, g, beta, cu_seqlens, g_cum, A, ctx.scale
    )
    return dq, dk, dv, dg, dbeta, None, None


chunk_gated_delta_rule_forward.register_autograd(_gdn_backward, setup_context=_gdn_setup_context)


# The public op returns o alone. It is CompositeImplicitAutograd over the forward op above,
# so autograd and tracing see chunk_gated_delta_rule_forward (with its fake and backward)
# and the auxiliary outputs reach the backward without being recomputed.
torch.library.define(
    f"{NAMESPACE}::chunk_gated_delta_rule",
    "(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor cu_seqlens, float? scale=None) -> Tensor",
)


@torch.library.impl(f"{NAMESPACE}::chunk_gated_delta_rule", "CompositeImplicitAutograd")
def _chunk_gated_delta_rule_composite(q, k, v, g, beta, cu_seqlens, scale=None):
    cu_seqlens = checked("cumulative", cu_seqlens, (), q.shape[0])
    return torch.ops.cp_ops.chunk_gated_delta_rule_forward(q, k, v, g, beta, cu_seqlens, scale)[0]


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: Optional[float] = None,
) -> torch.Tensor:
    """Chunked gated delta rule over packed sequences (``torch.ops.cp_ops.chunk_gated_delta_rule``).

    Per sequence (zero initial state) and value head h, with key head ``h // (Hv/Hk)``
    and state ``S [dk, dv]``::

        S_t = exp(g_t) S_{t-1};  S_t = S_t + k_t (beta_t (v_t - S_t^T k_t))^T;  o_t = scale S_t^T q_t

    q, k ``[T, Hk, dk]`` (not normalised here), v ``[T, Hv, dv]``, g (log decay,
    float32) and beta ``[T, Hv]``, ``Hv % Hk == 0``, cu_seqlens ``[B+1]``
    (``cu[-1] = T``), scale default ``dk ** -0.5``. Returns o ``[T, Hv, dv]`` in q's
    dtype. Differentiable in q, k, v, g, beta. CUDA: FLA's chunked kernels (GVA
    handled by FLA natively), q/k/v in bf16 or fp16, ``dk, dv <= 256``; CPU: the
    sequential torch reference.
    """
    return torch.ops.cp_ops.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens, scale)
