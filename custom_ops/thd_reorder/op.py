"""THD reorder between sequence order and CP rank order, as torch.library ops."""

import torch

from custom_ops.runtime.launch import launch_rows, use_triton
from custom_ops.runtime.registration import NAMESPACE, kernel_op
from custom_ops.runtime.tiles import ROW_SETTINGS
from custom_ops.runtime.words import from_row_matrix, row_matrix
from custom_ops.thd.checks import check_cp_size, check_index_tensor, check_rows
from custom_ops.thd.index import padding_multiple
from custom_ops.thd.validation import checked
from custom_ops.thd_reorder.kernels import thd_reorder_kernel
from custom_ops.thd_reorder.reference import thd_rank_to_seq_order_reference, thd_seq_to_rank_order_reference


def _check(x: torch.Tensor, cu_seqlens_padded: torch.Tensor, cp_size: int) -> None:
    check_rows("x", x)
    check_cp_size(cp_size)
    check_index_tensor("cu_seqlens_padded", cu_seqlens_padded, x.device)
    if x.shape[0] % padding_multiple(cp_size) != 0:
        raise ValueError(
            f"x has {x.shape[0]} rows, not a multiple of 2*cp_size = {padding_multiple(cp_size)}; "
            "padded THD tensors have cu_seqlens_padded[-1] rows, each sequence padded to a multiple of 2*cp_size"
        )


def _launch(x: torch.Tensor, cu_seqlens_padded: torch.Tensor, cp_size: int, to_rank: bool) -> torch.Tensor:
    src, rows, cols = row_matrix(x)
    out = torch.empty_like(src)
    if rows > 0 and cols > 0:
        launch_rows(
            thd_reorder_kernel, ROW_SETTINGS, rows, cols, src.element_size(),
            src, out, cu_seqlens_padded, cu_seqlens_padded.shape[0] - 1, rows, cols, cp_size, TO_RANK=to_rank,
        )  # fmt: skip
    return from_row_matrix(out, x.dtype, x.shape)


@kernel_op(f"{NAMESPACE}::thd_seq_to_rank_order", mutates_args=())
def thd_seq_to_rank_order(x: torch.Tensor, cu_seqlens_padded: torch.Tensor, cp_size: int) -> torch.Tensor:
    """Permute the rows of a sequence-order THD tensor into CP rank order.

    x: ``[T, ...]`` any dtype and trailing shape, ``T = cu_seqlens_padded[-1]``.
    Returns ``[T, ...]``: the W local shards concatenated, rank 0 first; rank r
    holds chunks r and 2W-1-r of every sequence. No host sync; the index map is
    computed on the device. Differentiable (the gradient is the inverse reorder).
    """
    _check(x, cu_seqlens_padded, cp_size)
    cu_seqlens_padded = checked("padded", cu_seqlens_padded, (), cp_size, x.shape[0])
    if not use_triton(x):
        return thd_seq_to_rank_order_reference(x, cu_seqlens_padded, cp_size)
    return _launch(x, cu_seqlens_padded, cp_size, to_rank=True)


@thd_seq_to_rank_order.register_fake
def _(x, cu_seqlens_padded, cp_size):
    _check(x, cu_seqlens_padded, cp_size)
    return x.new_empty(x.shape)


@kernel_op(f"{NAMESPACE}::thd_rank_to_seq_order", mutates_args=())
def thd_rank_to_seq_order(x: torch.Tensor, cu_seqlens_padded: torch.Tensor, cp_size: int) -> torch.Tensor:
    """The inverse of :func:`thd_seq_to_rank_order`: rank order -> sequence order.

    x: ``[T, ...]`` in rank order (what an all-gather of the local shards returns).
    """
    _check(x, cu_seqlens_padded, cp_size)
    cu_seqlens_padded = checked("padded", cu_seqlens_padded, (), cp_size, x.shape[0])
    if not use_triton(x):
        return thd_rank_to_seq_order_reference(x, cu_seqlens_padded, cp_size)
    return _launch(x, cu_seqlens_padded, cp_size, to_rank=False)


@thd_rank_to_seq_order.register_fake
def _(x, cu_seqlens_padded, cp_size):
    _check(x, cu_seqlens_padded, cp_size)
    return x.new_empty(x.shape)


def _setup_context(ctx, inputs, output):
    _, ctx.cu_seqlens_padded, ctx.cp_size = inputs


def _seq_to_rank_backward(ctx, grad):
    return thd_rank_to_seq_order(grad, ctx.cu_seqlens_padded, ctx.cp_size), None, None


def _rank_to_seq_backward(ctx, grad):
    return thd_seq_to_rank_order(grad, ctx.cu_seqlens_padded, ctx.cp_size), None, None


thd_seq_to_rank_order.register_autograd(_seq_to_rank_backward, setup_context=_setup_context)
thd_rank_to_seq_order.register_autograd(_rank_to_seq_backward, setup_context=_setup_context)
