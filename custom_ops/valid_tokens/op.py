"""Valid-token copy between THD tensors, functional and in place."""

import torch

from custom_ops.runtime.launch import launch_rows, use_triton
from custom_ops.runtime.registration import NAMESPACE, kernel_op
from custom_ops.runtime.tiles import ROW_SETTINGS
from custom_ops.runtime.words import from_row_matrix, row_matrix
from custom_ops.thd.checks import check_index_tensor, check_rows
from custom_ops.thd.validation import checked
from custom_ops.valid_tokens.kernels import thd_copy_valid_tokens_kernel
from custom_ops.valid_tokens.reference import thd_copy_valid_tokens_reference, valid_token_mask


def _check(dst: torch.Tensor, src: torch.Tensor, offsets: torch.Tensor, cu_seqlens: torch.Tensor) -> None:
    check_rows("dst", dst)
    check_rows("src", src)
    if dst.shape != src.shape:
        raise ValueError(f"dst and src must have one shape, got {tuple(dst.shape)} and {tuple(src.shape)}")
    if dst.dtype != src.dtype:
        raise TypeError(f"dst and src must have one dtype, got {dst.dtype} and {src.dtype}")
    if dst.device != src.device:
        raise ValueError(f"dst is on {dst.device} but src is on {src.device}")
    check_index_tensor("cu_seqlens", cu_seqlens, dst.device)
    n_seq = cu_seqlens.shape[0] - 1
    check_index_tensor("offsets", offsets, dst.device, min_numel=0)
    if offsets.shape[0] not in (n_seq, n_seq + 1):
        raise ValueError(
            f"offsets must have B or B+1 entries for B = {n_seq} sequences (len(cu_seqlens) - 1), got {offsets.shape[0]}"
        )


def _launch(dst: torch.Tensor, src: torch.Tensor, offsets: torch.Tensor, cu_seqlens: torch.Tensor, in_place: bool):
    """Runs the kernel into a new tensor, which it returns, or ``in_place`` into ``dst`` (which
    must be contiguous)."""
    (dst_m, rows, cols), src_m = row_matrix(dst), row_matrix(src)[0]
    out = dst_m if in_place else torch.empty_like(dst_m)
    if rows > 0 and cols > 0:
        launch_rows(
            thd_copy_valid_tokens_kernel, ROW_SETTINGS, rows, cols, dst_m.element_size(),
            dst_m, src_m, out, offsets, cu_seqlens, cu_seqlens.shape[0] - 1, rows, cols, IN_PLACE=in_place,
        )  # fmt: skip
    return out


@kernel_op(f"{NAMESPACE}::thd_copy_valid_tokens", mutates_args=())
def thd_copy_valid_tokens(
    dst: torch.Tensor, src: torch.Tensor, offsets: torch.Tensor, cu_seqlens: torch.Tensor
) -> torch.Tensor:
    """A copy of ``dst`` whose rows ``offsets[i] + j`` (``0 <= j < L_i``) come from ``src``.

    dst, src: ``[T, ...]``, one shape and dtype. offsets: ``[B]`` or ``[B+1]``
    (entries past B are ignored; ``cu_seqlens_padded`` works as is).
    cu_seqlens: ``[B+1]`` real lengths ``L_i``. Segments must be sorted and must
    not overlap. Differentiable in dst and src (the gradient is routed by the
    same mask).
    """
    _check(dst, src, offsets, cu_seqlens)
    offsets = checked("offsets", offsets, (cu_seqlens,), dst.shape[0])
    if not use_triton(dst):
        return thd_copy_valid_tokens_reference(dst, src, offsets, cu_seqlens).contiguous()
    return from_row_matrix(_launch(dst, src, offsets, cu_seqlens, in_place=False), dst.dtype, dst.shape)


@thd_copy_valid_tokens.register_fake
def _(dst, src, offsets, cu_seqlens):
    _check(dst, src, offsets, cu_seqlens)
    return dst.new_empty(dst.shape)


def _setup_context(ctx, inputs, output):
    _, _, ctx.offsets, ctx.cu_seqlens = inputs


def _backward(ctx, grad):
    zeros = torch.zeros_like(grad)
    grad_dst = thd_copy_valid_tokens(grad, zeros, ctx.offsets, ctx.cu_seqlens) if ctx.needs_input_grad[0] else None
    grad_src = thd_copy_valid_tokens(zeros, grad, ctx.offsets, ctx.cu_seqlens) if ctx.needs_input_grad[1] else None
    return grad_dst, grad_src, None, None


thd_copy_valid_tokens.register_autograd(_backward, setup_context=_setup_context)


@kernel_op(f"{NAMESPACE}::thd_copy_valid_tokens_", mutates_args={"dst"})
def thd_copy_valid_tokens_(dst: torch.Tensor, src: torch.Tensor, offsets: torch.Tensor, cu_seqlens: torch.Tensor) -> None:
    """In-place :func:`thd_copy_valid_tokens`: writes the valid rows of ``src`` into ``dst``.

    Moves only the valid rows (the functional form moves all T). Not
    differentiable: use the functional form where gradients flow.
    """
    _check(dst, src, offsets, cu_seqlens)
    offsets = checked("offsets", offsets, (cu_seqlens,), dst.shape[0])
    if not use_triton(dst):
        mask = valid_token_mask(offsets, cu_seqlens, dst.shape[0])
        dst.copy_(torch.where(mask.view((-1,) + (1,) * (dst.dim() - 1)), src, dst))
        return
    if not dst.is_contiguous():
        raise ValueError("thd_copy_valid_tokens_ needs a contiguous dst on the GPU path")
    out = _launch(dst, src, offsets, cu_seqlens, in_place=True)
    if out.data_ptr() != dst.data_ptr():  # a one-element dst whose word view had to be a copy
        dst.copy_(from_row_matrix(out, dst.dtype, dst.shape))


@thd_copy_valid_tokens_.register_fake
def _(dst, src, offsets, cu_seqlens):
    _check(dst, src, offsets, cu_seqlens)
