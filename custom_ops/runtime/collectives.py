"""The collectives of the CP ops: row all-gather, reduce-scatter and all-to-all over a group name.

They go through ``torch.distributed._functional_collectives`` and the ``_c10d_functional`` ops,
which torch.compile traces (docs/design.md section 3), with shims over the names that moved
between torch releases. The all-to-all also comes in two autograd halves (issue, wait), so that
work recorded between them overlaps the exchange in the forward and the backward pass.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed._functional_collectives as funcol

__all__ = ["all_gather_rows", "reduce_scatter_rows", "all_to_all_rows", "overlapped_exchange"]

T = TypeVar("T")

# Newer releases call the autograd-aware gather / reduce-scatter *_single_autograd and keep the
# *_tensor_autograd names as deprecated aliases; older ones only have the latter.
_all_gather_autograd = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
_reduce_scatter_autograd = (
    getattr(funcol, "reduce_scatter_single_autograd", None) or funcol.reduce_scatter_tensor_autograd
)


def all_gather_rows(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """``[R, ...]`` on each of W ranks -> ``[W*R, ...]``, rank 0's rows first (rank order).

    Differentiable: the gradient is the reduce-scatter (sum) of the output gradient.
    In eager mode the result may be an ``AsyncCollectiveTensor`` that waits on first use.
    """
    return _all_gather_autograd(x.contiguous(), 0, group_name)


def reduce_scatter_rows(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """``[W*R, ...]`` on each of W ranks -> ``[R, ...]``: rank r gets the sum over ranks of rows
    ``[r*R, (r+1)*R)``. Differentiable: the gradient is the all-gather of the output gradient."""
    return _reduce_scatter_autograd(x.contiguous(), "sum", 0, group_name)


def _start_all_to_all(x: torch.Tensor, group_name: str, world: int) -> torch.Tensor:
    """Issue the all-to-all of :func:`all_to_all_rows` and return its output still in flight:
    read it only after ``torch.ops._c10d_functional.wait_tensor``."""
    rows = x.shape[0] // world
    splits = [rows] * world
    return torch.ops._c10d_functional.all_to_all_single(x.contiguous(), splits, splits, group_name)


def all_to_all_rows(x: torch.Tensor, group_name: str, world: int) -> torch.Tensor:
    """``[W*R, ...]`` -> ``[W*R, ...]``: rows ``[d*R, (d+1)*R)`` go to rank d; the result holds
    rank s's block for this rank at rows ``[s*R, (s+1)*R)``. Not differentiable by itself;
    meant for op bodies, which own their autograd. Blocks until the data has arrived
    (on CUDA: until the exchange is ordered on the current stream)."""
    return torch.ops._c10d_functional.wait_tensor(_start_all_to_all(x, group_name, world))


class _ExchangeStart(torch.autograd.Function):
    """The first half of a differentiable :func:`all_to_all_rows`: issues the exchange and
    returns its output in flight. Its backward waits for the gradient's exchange, which
    :class:`_ExchangeWait`'s backward issued, so in the backward pass too the work recorded
    between the two halves (whatever autograd runs between their nodes) can overlap it."""

    @staticmethod
    def forward(ctx, send, group_name, world):
        ctx.group_name, ctx.world = group_name, world
        return _start_all_to_all(send, group_name, world)

    @staticmethod
    def backward(ctx, grad):
        return torch.ops._c10d_functional.wait_tensor(grad), None, None


class _ExchangeWait(torch.autograd.Function):
    """The second half: waits for the exchange :class:`_ExchangeStart` issued; its backward
    issues the exchange of the gradient (an all-to-all of equal blocks is its own adjoint)."""

    @staticmethod
    def forward(ctx, recv, group_name, world):
        ctx.group_name, ctx.world = group_name, world
        return torch.ops._c10d_functional.wait_tensor(recv)

    @staticmethod
    def backward(ctx, grad):
        return _start_all_to_all(grad, ctx.group_name, ctx.world), None, None


def overlapped_exchange(
    send: torch.Tensor, group_name: str, world: int, overlap: Callable[[], T] | None
) -> tuple[torch.Tensor, T | None]:
    """One differentiable all-to-all of ``send`` (``[W*R, ...]``, as :func:`all_to_all_rows`) with
    ``overlap()`` run while it is in flight, in the forward pass and (for the work autograd runs
    between the two halves) in the backward pass. Returns ``(received, overlap())``."""
    recv = _ExchangeStart.apply(send, group_name, world)
    extra = overlap() if overlap is not None else None
    return _ExchangeWait.apply(recv, group_name, world), extra
