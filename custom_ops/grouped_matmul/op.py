"""Segment matmul as torch.library ops: rows grouped into segments by bounds ``cu``, each row
times its segment's matrix, per head (docs/design.md section 4.3, where the GDN state mode
corrects each chunk's rows by its incoming state with it).

``torch.ops.cp_ops.segment_matmul(x, w, cu)`` and its weight gradient
``torch.ops.cp_ops.segment_matmul_weight_grad(x, dy, cu)``, opaque custom ops: the Triton
kernels of :mod:`custom_ops.grouped_matmul.kernels` on CUDA (and under ``TRITON_INTERPRET=1``),
the torch references on CPU and in float64. No host syncs: grids are sized from shapes, each
row's segment is found on the device.
"""

from __future__ import annotations

import torch

from custom_ops.grouped_matmul.kernels import segment_matmul_kernel, segment_matmul_weight_grad_kernel
from custom_ops.grouped_matmul.reference import segment_matmul_reference, segment_matmul_weight_grad_reference
from custom_ops.runtime.dtypes import accumulation_dtype
from custom_ops.runtime.launch import launch_direct, triton_interpreting, use_triton
from custom_ops.runtime.registration import NAMESPACE, kernel_op
from custom_ops.runtime.tiles import cdiv
from custom_ops.thd.checks import check_index_tensor

__all__ = ["segment_matmul"]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_MAX_KERNEL_DIM = 256  # K and N: one tile of K per program, its registers bounded


def _tile(n: int, cap: int) -> int:
    """The power of two >= n (at least 16, tl.dot's smallest), at most ``cap``."""
    block = 16
    while block < n and block < cap:
        block *= 2
    return block


def _tiles(k: int, n: int, *operands: torch.Tensor) -> dict:
    """The kernels' constexprs: K and N, whole K per program, BLOCK_M rows and BLOCK_N columns a
    program (smaller under the interpreter, which runs tiles in numpy), and the products'
    precision: TF32, exact for 16-bit ``operands``, else TF32x3 (each float32 as two TF32 parts)."""
    block_m, cap_n = (16, 32) if triton_interpreting() else (64, 64)
    precision = "tf32" if all(t.dtype in (torch.float16, torch.bfloat16) for t in operands) else "tf32x3"
    return dict(K=k, N=n, BLOCK_M=block_m, BLOCK_K=_tile(k, _MAX_KERNEL_DIM), BLOCK_N=_tile(n, cap_n),
                PRECISION=precision)  # fmt: skip


def _check_operand(name: str, t: torch.Tensor, dims: int, x: torch.Tensor) -> None:
    """``t`` a floating tensor of ``dims`` dimensions on x's device."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != dims:
        raise ValueError(f"{name} must be {dims}-D, got shape {tuple(t.shape)}")
    if t.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {t.dtype}")
    if t.device != x.device:
        raise ValueError(f"x is on {x.device} but {name} is on {t.device}")


def _check(x: torch.Tensor, w: torch.Tensor, cu: torch.Tensor) -> None:
    _check_operand("x", x, 3, x)
    _check_operand("w", w, 4, x)
    check_index_tensor("cu", cu, x.device)
    if w.shape[0] != cu.shape[0] - 1 or w.shape[1:3] != x.shape[1:]:
        raise ValueError(
            f"w must be [S, H, K, N] with S = len(cu) - 1 = {cu.shape[0] - 1} and x's [H, K] = {tuple(x.shape[1:])}, "
            f"got {tuple(w.shape)}"
        )


def _check_grad(x: torch.Tensor, dy: torch.Tensor, cu: torch.Tensor) -> None:
    _check_operand("x", x, 3, x)
    _check_operand("dy", dy, 3, x)
    check_index_tensor("cu", cu, x.device)
    if dy.shape[:2] != x.shape[:2]:
        raise ValueError(f"dy [R, H, N] must match x [R, H, K] in R and H, got {tuple(dy.shape)} and {tuple(x.shape)}")


def _use_kernel(x: torch.Tensor, other: torch.Tensor, other_name: str) -> bool:
    """Whether the Triton kernels run ``x`` with ``other`` (w, or dy for the weight gradient)."""
    if not use_triton(x) or torch.float64 in (x.dtype, other.dtype):
        return False
    dims = (x.shape[-1], other.shape[-1])
    if max(dims) > _MAX_KERNEL_DIM:
        raise ValueError(f"the Triton kernels take K and N up to {_MAX_KERNEL_DIM}, got {dims}")
    if other.numel() >= 2**31:  # the kernels' int32 offsets
        raise ValueError(f"the Triton kernels take {other_name} of fewer than 2**31 entries, got {other.numel()}")
    return True


@kernel_op(f"{NAMESPACE}::segment_matmul", mutates_args=(), opaque=True)
def _segment_matmul(x: torch.Tensor, w: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
    """``torch.ops.cp_ops.segment_matmul``: see :func:`segment_matmul`."""
    _check(x, w, cu)
    if not _use_kernel(x, w, "w"):
        return segment_matmul_reference(x, w, cu).contiguous()
    (rows, heads, k), n = x.shape, w.shape[-1]
    y = torch.empty(rows, heads, n, dtype=x.dtype, device=x.device)
    if y.numel() == 0:
        return y
    x, w, tiles = x.contiguous(), w.contiguous(), _tiles(k, n, x, w)
    launch_direct(
        segment_matmul_kernel, (cdiv(rows, tiles["BLOCK_M"]), heads, cdiv(n, tiles["BLOCK_N"])),
        x, w, cu, y, rows, w.shape[0], x.stride(0), x.stride(1), w.stride(0), w.stride(1), w.stride(2),
        y.stride(0), y.stride(1), **tiles,
    )  # fmt: skip
    return y


@_segment_matmul.register_fake
def _(x, w, cu):
    _check(x, w, cu)
    return x.new_empty(*x.shape[:2], w.shape[-1])


@kernel_op(f"{NAMESPACE}::segment_matmul_weight_grad", mutates_args=(), opaque=True)
def _segment_matmul_weight_grad(x: torch.Tensor, dy: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
    """``dw [S, H, K, N]``, the sum over each segment's rows of ``x[r, h]^T dy[r, h]``, in float32
    (float64 for float64 inputs). Not differentiable itself."""
    _check_grad(x, dy, cu)
    if not _use_kernel(x, dy, "dy"):
        return segment_matmul_weight_grad_reference(x, dy, cu).contiguous()
    (rows, heads, k), n, segments = x.shape, dy.shape[-1], cu.shape[0] - 1
    dw = torch.zeros(segments, heads, k, n, dtype=torch.float32, device=x.device)
    if dw.numel() == 0:
        return dw
    x, dy, tiles = x.contiguous(), dy.contiguous(), _tiles(k, n, x, dy)
    launch_direct(
        segment_matmul_weight_grad_kernel, (segments, heads, cdiv(n, tiles["BLOCK_N"])),
        x, dy, cu, dw, rows, x.stride(0), x.stride(1), dy.stride(0), dy.stride(1), dw.stride(0), dw.stride(1),
        dw.stride(2), **tiles,
    )  # fmt: skip
    return dw


@_segment_matmul_weight_grad.register_fake
def _(x, dy, cu):
    _check_grad(x, dy, cu)
    dtype = accumulation_dtype(torch.promote_types(x.dtype, dy.dtype))
    return x.new_empty(cu.shape[0] - 1, x.shape[1], x.shape[2], dy.shape[-1], dtype=dtype)


def _setup_context(ctx, inputs, output):
    x, w, cu = inputs
    ctx.save_for_backward(x, w, cu)


def _backward(ctx, dy):
    x, w, cu = ctx.saved_tensors
    dx = _segment_matmul(dy, w.transpose(-1, -2).contiguous(), cu).to(x.dtype)
    dw = _segment_matmul_weight_grad(x, dy, cu).to(w.dtype)
    return dx, dw, None


_segment_matmul.register_autograd(_backward, setup_context=_setup_context)


def segment_matmul(x: torch.Tensor, w: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
    """``y [R, H, N]`` with ``y[r, h] = x[r, h] @ w[s, h]`` for the segment s of row r
    (``cu[s] <= r < cu[s+1]``); rows before ``cu[0]`` or from ``cu[S]`` on get 0.

    x ``[R, H, K]``; w ``[S, H, K, N]``; cu ``[S+1]`` int32/int64, non-decreasing (values
    unchecked: no host sync). Accumulates in float32 (float64 for float64 inputs), returns x's
    dtype. Differentiable in x and w. fp16/bf16/fp32 run Triton kernels (K, N <= 256), float64
    and CPU tensors the torch reference. Also ``torch.ops.cp_ops.segment_matmul``.
    """
    return _segment_matmul(x, w, cu)
