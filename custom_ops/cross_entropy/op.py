"""Cross-entropy of a linear head's logits without the logits: the causal-LM loss over row chunks,
at most one chunk's logits alive at a time (docs/design.md section 2, "Linear cross-entropy").

``torch.ops.cp_ops.linear_cross_entropy_forward`` is an opaque custom op: per chunk of
``chunk_rows`` rows, the logits, their log-sum-exp, the loss of the targets and, when asked, the
gradients of the summed loss in ``hidden`` and ``weight`` (softmax minus one-hot, times ``weight``
and times the rows). Its backward scales those by the loss's gradient: the head's three GEMMs run
once each, and the ``[N, V]`` logits never exist. Where Triton runs and the accumulation is
float32, one kernel (kernels.py) makes a chunk's loss and gradient in two passes over its logits;
torch keeps the CPU and float64. The public ``linear_cross_entropy`` is a composite over the op
(the reduction; which gradients to compute). No host syncs: the chunks follow from shapes.
"""

from __future__ import annotations

from typing import Optional

import torch

from custom_ops.cross_entropy.kernels import BLOCK_COLS, cross_entropy_rows_kernel
from custom_ops.runtime.dtypes import accumulation_dtype
from custom_ops.runtime.launch import launch_direct, use_triton
from custom_ops.runtime.registration import NAMESPACE, composite_op, opaque_op
from custom_ops.runtime.tiles import next_power_of_2, rows_within

__all__ = ["linear_cross_entropy", "default_chunk_rows"]

# logits entries per chunk by default: a float32 chunk of 512 MiB, whatever the vocabulary
CHUNK_ELEMENTS = 2**27
REDUCTIONS = ("mean", "sum")


def default_chunk_rows(vocab_size: int) -> int:
    """Rows per chunk when none are given: ``CHUNK_ELEMENTS / vocab_size``, a multiple of 64 where
    that is at least 64 (:func:`~custom_ops.runtime.tiles.rows_within`)."""
    return rows_within(CHUNK_ELEMENTS, vocab_size)


def _check(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_rows: Optional[int]) -> None:
    for name, t in (("hidden", hidden), ("weight", weight), ("labels", labels)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if hidden.dim() != 2 or weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(
            f"hidden must be [N, H] and weight [V, H] (an nn.Linear's weight), got {tuple(hidden.shape)} and "
            f"{tuple(weight.shape)}"
        )
    if not hidden.dtype.is_floating_point or weight.dtype != hidden.dtype:
        raise TypeError(f"hidden and weight must share one floating dtype, got {hidden.dtype} and {weight.dtype}")
    if labels.dtype not in (torch.int32, torch.int64) or tuple(labels.shape) != (hidden.shape[0],):
        raise ValueError(
            f"labels must be int32 or int64 [N] with N = {hidden.shape[0]} (hidden's rows), got {labels.dtype} "
            f"of shape {tuple(labels.shape)}"
        )
    if weight.device != hidden.device or labels.device != hidden.device:
        raise ValueError(f"hidden, weight and labels must be on one device, got {hidden.device}, {weight.device}, "
                         f"{labels.device}")  # fmt: skip
    if chunk_rows is not None and chunk_rows < 1:
        raise ValueError(f"chunk_rows must be at least 1, got {chunk_rows}")


def _accumulate_weight_grad(d_weight: torch.Tensor, d_logits: torch.Tensor, rows: torch.Tensor) -> None:
    """``d_weight += d_logits^T rows``, in d_weight's dtype (float32 for half-precision rows)."""
    if d_weight.dtype == rows.dtype:
        d_weight.addmm_(d_logits.T, rows)
    else:
        d_weight.add_(d_logits.T @ rows)


def _chunk_by_kernel(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int, grads: bool) -> torch.Tensor:
    """A chunk's summed loss (float32) by :func:`cross_entropy_rows_kernel`; with ``grads`` the
    logits are overwritten by their gradient."""
    losses = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    if logits.shape[0] > 0:
        launch_direct(
            cross_entropy_rows_kernel, (logits.shape[0],), logits, targets, losses, logits.stride(0), logits.shape[1],
            ignore_index, GRAD=grads, BLOCK=min(BLOCK_COLS, next_power_of_2(logits.shape[1])), num_warps=8,
        )  # fmt: skip
    return losses.sum()


def _chunk_by_torch(logits, targets, ignore_index: int, grads: bool, acc: torch.dtype) -> torch.Tensor:
    """:func:`_chunk_by_kernel` by torch ops, in ``acc``: the CPU's path, and float64's."""
    dtype, logits_acc = logits.dtype, logits.to(acc)
    valid = targets != ignore_index
    index = torch.where(valid, targets, 0).long()[:, None]
    lse = torch.logsumexp(logits_acc, dim=1)
    loss = torch.where(valid, lse - logits_acc.gather(1, index)[:, 0], 0.0).sum()
    if grads:
        # d loss / d logits = softmax - one-hot target, zero on rows without a target (an
        # infinite log-sum-exp makes their softmax 0), computed in place of the upcast logits
        logits_acc.sub_(torch.where(valid, lse, torch.inf)[:, None]).exp_()
        logits_acc.scatter_add_(1, index, -valid.to(acc)[:, None])
        logits.copy_(logits_acc.to(dtype))
    return loss


@opaque_op(f"{NAMESPACE}::linear_cross_entropy_forward", mutates_args=())
def linear_cross_entropy_forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int,
    chunk_rows: int,
    grad_hidden: bool,
    grad_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(loss, d_hidden, d_weight)``: the summed cross-entropy of ``hidden @ weight^T`` over the
    rows whose label is not ``ignore_index`` (0-d, float32; float64 for float64 inputs) and, when
    ``grad_hidden`` / ``grad_weight``, its gradient in hidden (hidden's dtype, ``[N, H]``) and in
    weight (float32 or float64, ``[V, H]``); an unrequested gradient is an empty tensor.

    Each chunk's logits are rounded to hidden's dtype and upcast, as an ``nn.Linear`` head
    followed by transformers' loss computes them; the softmax, the loss and the weight gradient
    accumulate in float32 (float64 for float64).
    """
    _check(hidden, weight, labels, chunk_rows)
    acc = accumulation_dtype(hidden.dtype)
    rows_total = hidden.shape[0]
    loss = torch.zeros((), dtype=acc, device=hidden.device)
    d_hidden = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device) if grad_hidden else hidden.new_empty(0)
    d_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if grad_weight else weight.new_empty(0, dtype=acc)
    grads = grad_hidden or grad_weight
    kernel = use_triton(hidden) and acc == torch.float32
    labels = labels.contiguous()  # the kernel reads a chunk's targets at unit stride
    for start in range(0, rows_total, chunk_rows):
        rows, targets = hidden[start : start + chunk_rows], labels[start : start + chunk_rows]
        logits = rows @ weight.T  # [chunk, V], the only logits alive
        if kernel:
            loss += _chunk_by_kernel(logits, targets, ignore_index, grads)
        else:
            loss += _chunk_by_torch(logits, targets, ignore_index, grads, acc)
        if not grads:
            continue
        d_logits = logits
        if grad_hidden:
            torch.mm(d_logits, weight, out=d_hidden[start : start + chunk_rows])
        if grad_weight:
            _accumulate_weight_grad(d_weight, d_logits, rows)
    return loss, d_hidden, d_weight


@linear_cross_entropy_forward.register_fake
def _(hidden, weight, labels, ignore_index, chunk_rows, grad_hidden, grad_weight):
    _check(hidden, weight, labels, chunk_rows)
    acc = accumulation_dtype(hidden.dtype)
    d_hidden = hidden.new_empty(hidden.shape) if grad_hidden else hidden.new_empty(0)
    d_weight = weight.new_empty(weight.shape, dtype=acc) if grad_weight else weight.new_empty(0, dtype=acc)
    return hidden.new_empty((), dtype=acc), d_hidden, d_weight


def _setup_context(ctx, inputs, output):
    _, d_hidden, d_weight = output
    ctx.save_for_backward(d_hidden, d_weight)
    ctx.grads = inputs[5:7]
    ctx.weight_dtype = inputs[1].dtype


def _backward(ctx, grad_loss, *_grad_saved):
    d_hidden, d_weight = ctx.saved_tensors
    grad_hidden, grad_weight = ctx.grads
    return (
        d_hidden * grad_loss if grad_hidden else None,
        (d_weight * grad_loss).to(ctx.weight_dtype) if grad_weight else None,
        None, None, None, None, None,
    )  # fmt: skip


linear_cross_entropy_forward.register_autograd(_backward, setup_context=_setup_context)


# The public op, a composite: autograd and tracing see linear_cross_entropy_forward (its fake
# and backward); which gradients it computes follows from what requires them.
@composite_op(
    f"{NAMESPACE}::linear_cross_entropy",
    "(Tensor hidden, Tensor weight, Tensor labels, int ignore_index=-100, str reduction=\"mean\", "
    "int? chunk_rows=None) -> Tensor",
)
def _linear_cross_entropy_composite(hidden, weight, labels, ignore_index=-100, reduction="mean", chunk_rows=None):
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    _check(hidden, weight, labels, chunk_rows)
    grad = torch.is_grad_enabled()
    loss, _, _ = torch.ops.cp_ops.linear_cross_entropy_forward(
        hidden, weight, labels, ignore_index, chunk_rows or default_chunk_rows(weight.shape[0]),
        grad and hidden.requires_grad, grad and weight.requires_grad,
    )  # fmt: skip
    if reduction == "sum":
        return loss
    return loss / (labels != ignore_index).sum()


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    chunk_rows: Optional[int] = None,
) -> torch.Tensor:
    """``F.cross_entropy(hidden @ weight^T, labels, ignore_index, reduction)`` without the ``[N, V]``
    logits (``torch.ops.cp_ops.linear_cross_entropy``).

    hidden ``[N, H]`` and weight ``[V, H]`` (an ``nn.Linear(H, V, bias=False)``'s) of one floating
    dtype; labels ``[N]`` int32/int64 aligned with the rows (shifted within each sequence),
    ``ignore_index`` where a row has no target, else in ``[0, V)`` (unchecked: no host sync).
    ``reduction``: ``"sum"`` over the rows with a target or ``"mean"`` (NaN when none). Returns a
    0-d float32 loss (float64 for float64); the logits rounded to hidden's dtype, as a head returns
    them. Rows run in chunks of ``chunk_rows`` (default :func:`default_chunk_rows`), one chunk's
    logits alive at a time. Differentiable in hidden and weight, the gradients computed in the
    forward (docs/design.md section 2). Under CP: each rank's ``"sum"`` / the global target count.
    """
    return torch.ops.cp_ops.linear_cross_entropy(hidden, weight, labels, ignore_index, reduction, chunk_rows)
