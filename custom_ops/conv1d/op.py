"""The causal depthwise conv1d ops of the GDN core on packed THD sequences (docs/design.md
section 2, "Gated DeltaNet core"): ``causal_conv1d``, ``causal_conv1d_gather`` (the conv of
the first columns of wider rows, in any row order, its backward writing the whole rows'
gradient) and their backward ops.

Opaque custom ops (:func:`custom_ops.runtime.registration.opaque_op`): Inductor calls each as one
extern node and never traces into FLA. On CUDA the conv runs this package's Triton kernels
for kernel widths up to 4 (:mod:`custom_ops.conv1d.kernels`, which read every row once) and
FLA's for wider ones; on CPU the torch references of :mod:`custom_ops.conv1d.reference`, and
under ``TRITON_INTERPRET=1`` the kernels in Triton's interpreter (how they are tested
without a GPU). No host syncs: the kernels' grids are sized from shapes, and the rows'
positions in their sequences are computed on the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from custom_ops.conv1d.kernels import (
    MAX_TAPS,
    POSITIONS_BLOCK,
    ROW_STEP,
    conv_positions_kernel,
    cp_causal_conv1d_bwd_kernel,
    cp_causal_conv1d_fwd_kernel,
)
from custom_ops.conv1d.reference import (
    L2NORM_EPS,
    causal_conv1d_gather_reference,
    causal_conv1d_reference,
    causal_conv1d_reference_backward,
    check_activation,
    from_column_blocks,
    head_blocks,
    l2norm_groups_backward,
)
from custom_ops.fla.adapter import FLA_CHUNK, fla_call, fla_module, fla_varlen_indices
from custom_ops.runtime import precompile
from custom_ops.runtime.launch import launch_direct, use_triton
from custom_ops.runtime.precompile import cuda_index
from custom_ops.runtime.registration import NAMESPACE, opaque_op
from custom_ops.runtime.tiles import cdiv
from custom_ops.runtime.words import unit_last_stride
from custom_ops.thd.checks import check_index_tensor
from custom_ops.thd.validation import checked

__all__ = ["causal_conv1d", "causal_conv1d_gather"]

# The widest group the conv kernels l2-normalise: a program holds whole groups.
MAX_NORM_DIM = 1024


class ConvConfig(NamedTuple):
    """The launch of one conv kernel: ``rows`` rows per program (ROWS), ``block_c`` channels
    (BLOCK_C), ``num_warps``, ``num_stages``."""

    rows: int
    block_c: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class ConvSettings:
    """The launch configs of the conv kernels, which the launchers below take as ``settings``.
    ``fwd`` and ``bwd`` serve CUDA tensors: the fastest in the GDN layer's form (``python -m
    benchmarks.bench_gdn --conv --sweep``, docs/benchmarks.md). ``interpreter`` serves CPU tensors in
    Triton's interpreter: small blocks, so that a test's few rows span many programs (the rows
    carried over block boundaries) and the interpreter's loops stay short. Each ``rows`` is a
    multiple of the kernels' step, :data:`custom_ops.conv1d.kernels.ROW_STEP`."""

    fwd: ConvConfig = ConvConfig(rows=256, block_c=512, num_warps=4, num_stages=1)
    bwd: ConvConfig = ConvConfig(rows=512, block_c=512, num_warps=4, num_stages=1)
    interpreter: ConvConfig = ConvConfig(rows=8, block_c=16, num_warps=1, num_stages=1)

    def __post_init__(self):
        for name in ("fwd", "bwd", "interpreter"):
            rows, step = getattr(self, name).rows, ROW_STEP.value
            if rows <= 0 or rows % step:
                raise ValueError(f"{name}.rows must be a positive multiple of {step} (the kernels' step), got {rows}")

    def config(self, kernel: str, on_gpu: bool) -> ConvConfig:
        """The config of ``kernel`` ("fwd" or "bwd") for CUDA tensors (``on_gpu``) or the interpreter."""
        if kernel not in ("fwd", "bwd"):
            raise ValueError(f"kernel must be 'fwd' or 'bwd', got {kernel!r}")
        if not on_gpu:
            return self.interpreter
        return self.fwd if kernel == "fwd" else self.bwd


# the settings every op passes to the launchers; a benchmark or test passes others
CONV_SETTINGS = ConvSettings()


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


@opaque_op(f"{NAMESPACE}::causal_conv1d", mutates_args=())
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
    kernels of :mod:`custom_ops.conv1d.kernels` (the backward recomputes the
    pre-activation in registers), for wider kernels FLA's ``causal_conv1d_fwd`` /
    ``causal_conv1d_bwd``; either way only the inputs are saved.
    """
    _check_conv(x, weight, bias, cu_seqlens, activation)
    cu_seqlens = checked("cumulative", cu_seqlens, (), x.shape[0])
    if not use_triton(x) or x.numel() == 0:
        return causal_conv1d_reference(x, weight, bias, cu_seqlens, activation).contiguous()
    if weight.shape[1] > MAX_TAPS:
        return _fla_conv_forward(x, weight, bias, cu_seqlens, activation)
    return _conv_forward(x, weight, bias, cu_seqlens, activation, CONV_SETTINGS)


def _precompile(x, weight, bias, cu_seqlens, activation, rows=None, gather=False, cut=(0, (0, 0.0), 1)) -> None:
    """Start compiling the forward's and the backward's kernels of :func:`causal_conv1d` (with
    ``gather``, of :func:`causal_conv1d_gather` and its ``rows``) for these arguments, the fake
    tensors of a graph being traced, in the background (:mod:`custom_ops.runtime.precompile`);
    the backward for a contiguous upstream gradient. ``cut``: the gather's ``(split, norm, parts)``
    as :func:`_conv_forward` takes them."""
    if weight.shape[1] > MAX_TAPS:
        return
    channels = weight.shape[0]

    def launchers(mx, mw, mb, mcu, mrows):
        if gather:
            y, tail = _conv_forward(mx[:, :channels], mw, mb, mcu, activation, CONV_SETTINGS, mrows, *cut)
            dx = torch.empty(mx.shape, dtype=mx.dtype, device="meta")[:, :channels]
            grads = torch.empty_like(y), torch.empty_like(tail)
        else:
            y = _conv_forward(mx[:, :channels], mw, mb, mcu, activation, CONV_SETTINGS, mrows)
            dx, grads = None, (torch.empty_like(y), None)
        _conv_backward_kernel(
            grads[0], mx[:, :channels], mw, mb, mcu, activation, CONV_SETTINGS, mrows, dx, grads[1], cut[1]
        )

    name = "causal_conv1d_gather" if gather else "causal_conv1d"
    precompile.schedule(name, launchers, x, weight, bias, cu_seqlens, rows, args=(activation, cut))


@causal_conv1d.register_fake
def _(x, weight, bias, cu_seqlens, activation="silu"):
    _check_conv(x, weight, bias, cu_seqlens, activation)
    _precompile(x, weight, bias, cu_seqlens, activation)
    return x.new_empty(x.shape)


@opaque_op(f"{NAMESPACE}::causal_conv1d_backward", mutates_args=())
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
        grads = causal_conv1d_reference_backward(grad_y, x, weight, bias, cu_seqlens, activation)
        return tuple(g.contiguous() for g in grads)  # the fake's layout, whatever x's
    if weight.shape[1] > MAX_TAPS:
        return _fla_conv_backward(grad_y, x, weight, bias, cu_seqlens, activation)
    return _conv_backward_kernel(grad_y, x, weight, bias, cu_seqlens, activation, CONV_SETTINGS)


def _conv_positions(cu_seqlens: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Each row's position in its sequence capped at MAX_TAPS, int32 ``[T]`` (what the kernels'
    taps test): one launch of :func:`conv_positions_kernel`, where the same from torch ops
    (:func:`custom_ops.thd.index.row_positions`) would take nine."""
    pos = torch.empty(num_rows, dtype=torch.int32, device=cu_seqlens.device)
    if num_rows > 0:
        bounds = cu_seqlens.shape[0]
        launch_direct(
            conv_positions_kernel, (cdiv(num_rows, POSITIONS_BLOCK),),
            cu_seqlens, pos, bounds, num_rows, bounds.bit_length(), CAP=MAX_TAPS, BLOCK=POSITIONS_BLOCK,
        )  # fmt: skip
    return pos


def _conv_forward(
    x, weight, bias, cu_seqlens, activation, settings: ConvSettings, rows=None, split=None, norm=(0, 0.0), parts=1
):
    """Our forward kernel under ``settings``; with ``rows``, sequence row t of x is its row ``rows[t]``.
    Returns y, or with ``split``, ``(head, y[:, split:])``: head ``[parts, T, split/parts]`` holds
    y[:, :split] as ``parts`` column blocks, l2-normalised over each group of ``norm[0]`` columns
    (0: not) with epsilon ``norm[1]``."""
    x = unit_last_stride(x)
    weight = weight.contiguous()
    num_rows, channels = x.shape
    block_rows, block_c, warps, stages = settings.config("fwd", cuda_index(x) is not None)
    block_c = max(block_c, norm[0])  # a program holds whole groups
    head = channels if split is None else split
    shape = (num_rows, head) if split is None else (parts, num_rows, head // parts)
    y = torch.empty(shape, dtype=x.dtype, device=x.device)
    tail = y if split is None else torch.empty(num_rows, channels - head, dtype=x.dtype, device=x.device)
    pos = _conv_positions(cu_seqlens, num_rows)
    grid = (cdiv(num_rows, block_rows), _column_blocks(channels, head, block_c))
    launch_direct(
        cp_causal_conv1d_fwd_kernel, grid,
        x, weight, weight if bias is None else bias.contiguous(), _nonempty(y, tail), _nonempty(tail, y), pos,
        pos if rows is None else rows, num_rows, channels, head, x.stride(0), norm[1], K=weight.shape[1],
        HAS_BIAS=bias is not None, SILU=_is_silu(activation), ROWS=block_rows, BLOCK_C=block_c,
        GATHER=rows is not None, SPLIT=split is not None, NORM_DIM=norm[0], PARTS=parts, num_warps=warps,
        num_stages=stages,
    )  # fmt: skip
    return y if split is None else (y, tail)


def _column_blocks(channels: int, split: int, block_c: int) -> int:
    """The kernels' programs along the channels: blocks from column 0, then from ``split`` (none straddles it)."""
    return cdiv(split, block_c) + cdiv(channels - split, block_c)


def _nonempty(t: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """t, or ``other`` where t has no elements (a kernel argument whose stores are all masked)."""
    return t if t.numel() > 0 else other


def _conv_backward_kernel(
    grad_y, x, weight, bias, cu_seqlens, activation, settings: ConvSettings, rows=None, dx=None, grad_tail=None,
    norm=(0, 0.0),
):  # fmt: skip
    """Our backward kernel under ``settings``; with ``rows``, sequence row t of x is its row ``rows[t]`` and so is
    that of dx (written into ``dx`` when given, an x-shaped view, else a new tensor); with ``grad_tail``, grad_y
    and grad_tail are the gradients of :func:`_conv_forward`'s two outputs (``split``), under its ``norm``."""
    x = unit_last_stride(x)
    if grad_tail is None:
        grad_y, tail, parts, split = unit_last_stride(grad_y), grad_y, 1, x.shape[1]
    else:  # the head's parts read at their offsets in a contiguous [parts, T, split/parts]
        grad_y, tail = grad_y.contiguous(), unit_last_stride(grad_tail)
        parts, split = grad_y.shape[0], grad_y.shape[0] * grad_y.shape[2]
    w = weight.contiguous()
    num_rows, channels = x.shape
    kernel = w.shape[1]
    block_rows, block_c, warps, stages = settings.config("bwd", cuda_index(x) is not None)
    block_c = max(block_c, norm[0])
    programs = cdiv(num_rows, block_rows)
    if dx is None:
        dx = torch.empty(num_rows, channels, dtype=x.dtype, device=x.device)
    dw_parts = torch.empty(programs, channels, MAX_TAPS, dtype=torch.float32, device=x.device)
    db_parts = torch.empty(programs, channels, dtype=torch.float32, device=x.device)
    pos = _conv_positions(cu_seqlens, num_rows)
    launch_direct(
        cp_causal_conv1d_bwd_kernel, (programs, _column_blocks(channels, split, block_c)),
        x, w, w if bias is None else bias.contiguous(), _nonempty(grad_y, tail), _nonempty(tail, grad_y), dx,
        dw_parts, db_parts, pos, pos if rows is None else rows, num_rows, channels, split, x.stride(0),
        grad_y.stride(-2), tail.stride(0), dx.stride(0), norm[1], K=kernel, HAS_BIAS=bias is not None,
        SILU=_is_silu(activation), ROWS=block_rows, BLOCK_C=block_c, GATHER=rows is not None,
        SPLIT=grad_tail is not None, NORM_DIM=norm[0], PARTS=parts, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    dw = dw_parts.sum(0)[:, :kernel].to(weight.dtype).contiguous()  # the fake's layout, also for K < MAX_TAPS
    db = db_parts.sum(0).to(bias.dtype if bias is not None else weight.dtype)
    return dx, dw, db


def _is_silu(activation: Optional[str]) -> bool:
    return activation in ("silu", "swish")


def _fla_conv_forward(x, weight, bias, cu_seqlens, activation) -> torch.Tensor:
    causal_conv1d_fwd = fla_module("fla.modules.causal_conv1d.ops").causal_conv1d_fwd

    cu_ext, chunk_indices = fla_varlen_indices(cu_seqlens, x.shape[0])
    with fla_call(x.device):
        y, _ = causal_conv1d_fwd(
            x=x.unsqueeze(0), weight=weight.contiguous(), bias=None if bias is None else bias.contiguous(),
            residual=None, initial_state=None, output_final_state=False,
            activation="silu" if _is_silu(activation) else None, cu_seqlens=cu_ext, chunk_indices=chunk_indices,
            chunk_size=FLA_CHUNK,
        )  # fmt: skip
    return y.view(x.shape)


def _fla_conv_backward(grad_y, x, weight, bias, cu_seqlens, activation):
    causal_conv1d_bwd = fla_module("fla.modules.causal_conv1d.ops").causal_conv1d_bwd

    cu_ext, chunk_indices = fla_varlen_indices(cu_seqlens, x.shape[0])
    # FLA sums dbias only for a bias; a zero one gives the sum the op returns without one
    b = weight.new_zeros(weight.shape[0]) if bias is None else bias.contiguous()
    with fla_call(x.device):
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


def _check_conv_gather(x, rows, weight, bias, cu_seqlens, activation, split, norm_dim, parts) -> None:
    if x.dim() != 2:
        raise ValueError(f"x must be [T, F], got shape {tuple(x.shape)}")
    if rows is not None:
        _check_rows(x, rows)
    if weight.dim() != 2 or weight.shape[0] > x.shape[1]:
        raise ValueError(f"weight must be [C, K] with C <= F = {x.shape[1]}, got shape {tuple(weight.shape)}")
    if not 0 <= split <= weight.shape[0]:
        raise ValueError(f"split must be in [0, C = {weight.shape[0]}], got {split}")
    if parts < 1 or split % parts != 0:
        raise ValueError(f"parts must be positive and divide split = {split}, got {parts}")
    if norm_dim < 0 or (norm_dim > 0 and (split // parts) % norm_dim != 0):
        raise ValueError(f"norm_dim must be 0 or divide split / parts = {split // parts}, got {norm_dim}")
    _check_conv(x[:, : weight.shape[0]], weight, bias, cu_seqlens, activation)


def _check_rows(x, rows) -> None:
    check_index_tensor("rows", rows, x.device, min_numel=0)
    if rows.shape[0] != x.shape[0]:
        raise ValueError(f"rows must be [T] with T = {x.shape[0]} (a permutation of x's rows), got {tuple(rows.shape)}")


@opaque_op(f"{NAMESPACE}::causal_conv1d_gather", mutates_args=())
def causal_conv1d_gather(
    x: torch.Tensor,
    rows: Optional[torch.Tensor],
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    cu_seqlens: torch.Tensor,
    activation: Optional[str] = "silu",
    split: int = 0,
    norm_dim: int = 0,
    parts: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """With ``y = causal_conv1d(x[rows, :C], weight, bias, cu_seqlens, activation)`` (x's rows in the
    order ``rows``, None: their own): ``(head, y[:, split:], x[rows, C:])``, head ``[parts, T,
    split/parts]`` holding y[:, :split] as column blocks, each group of ``norm_dim`` columns
    l2-normalised (eps :data:`L2NORM_EPS`; 0: not). ``C = weight.shape[0] <= F`` of x ``[T, F]``,
    ``0 <= split <= C``; rows ``[T]`` a permutation: sequence row t (of ``cu_seqlens``) is x's row
    ``rows[t]``. Outputs contiguous, in sequence order. On CUDA (K <= 4) the kernels read x's rows
    where they are, write the parts (normalised in registers for norm_dim a power of two up to 1024)
    and the backward writes dx ``[T, F]`` whole: nothing is reordered, normalised or assembled from
    slices in memory (docs/design.md section 2). The CUDA backward writes each row of dx once.
    """
    _check_conv_gather(x, rows, weight, bias, cu_seqlens, activation, split, norm_dim, parts)
    if rows is not None:
        rows = checked("permutation", rows, (), x.shape[0])
    cu_seqlens = checked("cumulative", cu_seqlens, (), x.shape[0])
    channels = weight.shape[0]
    if not use_triton(x) or x.numel() == 0:
        return causal_conv1d_gather_reference(x, rows, weight, bias, cu_seqlens, activation, split, norm_dim, parts)
    if weight.shape[1] > MAX_TAPS:  # FLA's kernels, on the gathered rows
        xs = x if rows is None else x.index_select(0, rows)
        y = _fla_conv_forward(xs[:, :channels], weight, bias, cu_seqlens, activation)
        tail = y[:, split:].clone(memory_format=torch.contiguous_format)
        return head_blocks(y[:, :split], norm_dim, parts), tail, _take_rows(xs[:, channels:], None)
    head, tail = _conv_forward(
        x[:, :channels], weight, bias, cu_seqlens, activation, CONV_SETTINGS, rows, *_kernel_cut(split, norm_dim, parts)
    )  # fmt: skip
    if not _norm_in_kernels(norm_dim):
        head = head_blocks(head[0], norm_dim, parts)
    return head, tail, _take_rows(x[:, channels:], rows)


def _norm_in_kernels(norm_dim: int) -> bool:
    """Whether our kernels normalise groups of ``norm_dim`` columns themselves (0: nothing to normalise)."""
    return norm_dim == 0 or (norm_dim <= MAX_NORM_DIM and norm_dim & (norm_dim - 1) == 0)


def _kernel_cut(split: int, norm_dim: int, parts: int) -> tuple[int, tuple[int, float], int]:
    """The ``(split, norm, parts)`` :func:`_conv_forward` takes for the gather's cut: the norm and
    the blocks in the kernels where they normalise ``norm_dim``, else the plain cut in one block,
    which :func:`head_blocks` then normalises and lays out."""
    if _norm_in_kernels(norm_dim):
        return split, (norm_dim, L2NORM_EPS), parts
    return split, (0, L2NORM_EPS), 1


def _take_rows(x: torch.Tensor, rows: Optional[torch.Tensor]) -> torch.Tensor:
    """``x[rows]`` (x's rows in sequence order) in new contiguous memory; ``rows=None``: x's."""
    if rows is None:
        return x.clone(memory_format=torch.contiguous_format)
    return x.index_select(0, rows)


@causal_conv1d_gather.register_fake
def _(x, rows, weight, bias, cu_seqlens, activation="silu", split=0, norm_dim=0, parts=1):
    _check_conv_gather(x, rows, weight, bias, cu_seqlens, activation, split, norm_dim, parts)
    _precompile(x, weight, bias, cu_seqlens, activation, rows, gather=True, cut=_kernel_cut(split, norm_dim, parts))
    num_rows, channels = x.shape[0], weight.shape[0]
    return (
        x.new_empty(parts, num_rows, split // parts),
        x.new_empty(num_rows, channels - split),
        x.new_empty(num_rows, x.shape[1] - channels),
    )


@opaque_op(f"{NAMESPACE}::causal_conv1d_gather_backward", mutates_args=())
def causal_conv1d_gather_backward(
    grad_head: torch.Tensor,
    grad_tail: torch.Tensor,
    grad_rest: torch.Tensor,
    x: torch.Tensor,
    rows: Optional[torch.Tensor],
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    cu_seqlens: torch.Tensor,
    activation: Optional[str],
    norm_dim: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx ``[T, F]``, dweight, dbias) of :func:`causal_conv1d_gather` for the gradients of its
    three outputs (grad_head ``[parts, T, split/parts]``)."""
    channels, split = weight.shape[0], grad_head.shape[0] * grad_head.shape[2]
    if not use_triton(x) or x.numel() == 0 or weight.shape[1] > MAX_TAPS or not _norm_in_kernels(norm_dim):
        # the backward of the norm on the recomputed conv, of the conv on the gathered rows
        # (causal_conv1d_backward, which picks the reference or FLA's kernels), of the gather
        xs = x if rows is None else x.index_select(0, rows)
        grad_head = from_column_blocks(grad_head)
        if norm_dim:
            b = None if bias is None else bias[:split]
            y = causal_conv1d(xs[:, :split], weight[:split], b, cu_seqlens, activation)
            grad_head = l2norm_groups_backward(y, grad_head, norm_dim)
        grad_y = torch.cat([grad_head, grad_tail], 1)
        dxs, dw, db = causal_conv1d_backward(grad_y, xs[:, :channels], weight, bias, cu_seqlens, activation)
        dxs = torch.cat([dxs, grad_rest.to(dxs.dtype)], 1)
        dx = dxs if rows is None else torch.zeros_like(x).index_add_(0, rows.long(), dxs)
        return dx, dw, db
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _, dw, db = _conv_backward_kernel(
        grad_head, x[:, :channels], weight, bias, cu_seqlens, activation, CONV_SETTINGS, rows, dx[:, :channels],
        grad_tail, (norm_dim, L2NORM_EPS),
    )
    if rows is None:
        dx[:, channels:].copy_(grad_rest)
    else:
        dx[:, channels:].index_copy_(0, rows.long(), grad_rest.to(dx.dtype))
    return dx, dw, db


@causal_conv1d_gather_backward.register_fake
def _(grad_head, grad_tail, grad_rest, x, rows, weight, bias, cu_seqlens, activation, norm_dim=0):
    db_dtype = bias.dtype if bias is not None else weight.dtype
    return x.new_empty(x.shape), weight.new_empty(weight.shape), weight.new_empty(weight.shape[0], dtype=db_dtype)


def _conv_gather_setup_context(ctx, inputs, output):
    x, rows, weight, bias, cu_seqlens, activation, _, norm_dim, _ = inputs
    ctx.save_for_backward(x, rows, weight, bias, cu_seqlens)
    ctx.activation, ctx.norm_dim = activation, norm_dim


def _conv_gather_backward(ctx, grad_head, grad_tail, grad_rest):
    x, rows, weight, bias, cu_seqlens = ctx.saved_tensors
    dx, dw, db = torch.ops.cp_ops.causal_conv1d_gather_backward(
        grad_head, grad_tail, grad_rest, x, rows, weight, bias, cu_seqlens, ctx.activation, ctx.norm_dim
    )
    return dx, None, dw, (db if bias is not None else None), None, None, None, None, None


causal_conv1d_gather.register_autograd(_conv_gather_backward, setup_context=_conv_gather_setup_context)
