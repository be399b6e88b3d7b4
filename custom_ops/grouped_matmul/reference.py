"""Torch references of the segment matmul ops: the definition the kernels are tested against,
and what the ops run on CPU and in float64."""

from __future__ import annotations

import torch

from custom_ops.runtime.dtypes import accumulation_dtype


def row_segments(cu: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(segment [R], inside [R])``: each row's segment under the bounds ``cu [S+1]`` (the last
    one whose start is at or before the row) and whether the row lies in ``[cu[0], cu[S])``."""
    rows = torch.arange(num_rows, device=cu.device)
    num_segments = cu.shape[0] - 1
    seg = (torch.searchsorted(cu.long(), rows, right=True) - 1).clamp(0, max(num_segments - 1, 0))
    inside = (rows >= cu[0]) & (rows < cu[-1]) if num_segments > 0 else torch.zeros_like(rows, dtype=torch.bool)
    return seg, inside


def segment_matmul_reference(x: torch.Tensor, w: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
    """``y [R, H, N]``: row r of segment s (``cu[s] <= r < cu[s+1]``) times its segment's matrix,
    ``y[r, h] = x[r, h] @ w[s, h]``, in float32 (float64 for float64) and returned in x's dtype;
    rows in no segment get 0. x ``[R, H, K]``, w ``[S, H, K, N]``. Memory ``O(R H K N)``."""
    dt = accumulation_dtype(torch.promote_types(x.dtype, w.dtype))
    seg, inside = row_segments(cu, x.shape[0])
    if w.shape[0] == 0:
        return x.new_zeros(*x.shape[:2], w.shape[-1])
    y = torch.einsum("rhk,rhkn->rhn", x.to(dt), w.to(dt)[seg])
    return (y * inside[:, None, None]).to(x.dtype)


def segment_matmul_weight_grad_reference(x: torch.Tensor, dy: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
    """``dw [S, H, K, N] = sum over the rows r of segment s of x[r, h]^T dy[r, h]``: the gradient of
    :func:`segment_matmul_reference` in w, in float32 (float64 for float64 inputs)."""
    dt = accumulation_dtype(torch.promote_types(x.dtype, dy.dtype))
    seg, inside = row_segments(cu, x.shape[0])
    outer = torch.einsum("rhk,rhn->rhkn", x.to(dt), dy.to(dt)) * inside[:, None, None, None]
    dw = outer.new_zeros(cu.shape[0] - 1, *outer.shape[1:])
    return dw.index_add(0, seg, outer) if dw.shape[0] > 0 else dw
