"""Torch references for the valid-token copy.

Segment i covers rows ``[offsets[i], offsets[i] + L_i)`` with
``L_i = cu_seqlens[i+1] - cu_seqlens[i]``. The segments must be sorted
(``offsets[:B]`` non-decreasing) and must not overlap; cp_ops.validate_offsets
checks that where the data is prepared.
"""

import torch


def valid_token_mask(offsets: torch.Tensor, cu_seqlens: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Boolean ``[num_rows]``: which rows fall inside a segment. Vectorised, no host sync.

    Written without B-sized intermediates (no ``offsets[:B]``, no ``diff``): dynamo
    specializes size-1 tensors, and a one-sequence batch would then recompile.
    """
    n_seq = cu_seqlens.shape[0] - 1
    rows = torch.arange(num_rows, device=cu_seqlens.device, dtype=torch.int64)
    if n_seq == 0:
        return torch.zeros(num_rows, dtype=torch.bool, device=cu_seqlens.device)
    # an offsets[B] entry, if present, is ignored: it becomes +inf for the search
    slot = torch.arange(offsets.shape[0], device=offsets.device)
    starts = torch.where(slot < n_seq, offsets.to(torch.int64), torch.iinfo(torch.int64).max)
    i = torch.searchsorted(starts, rows, right=True) - 1
    ic = i.clamp(min=0)
    length = (cu_seqlens[ic + 1] - cu_seqlens[ic]).to(torch.int64)
    return (i >= 0) & (rows < starts[ic] + length)


def thd_copy_valid_tokens_reference(
    dst: torch.Tensor, src: torch.Tensor, offsets: torch.Tensor, cu_seqlens: torch.Tensor
) -> torch.Tensor:
    """:func:`custom_ops.thd_copy_valid_tokens` in torch ops: ``torch.where`` over the mask of
    :func:`valid_token_mask`.

    dst, src: ``[T, ...]``, one shape and dtype; offsets ``[B]`` or ``[B+1]``; cu_seqlens
    ``[B+1]``. Returns ``[T, ...]``, differentiable in dst and src; no host sync.
    """
    mask = valid_token_mask(offsets, cu_seqlens, dst.shape[0])
    return torch.where(mask.view((-1,) + (1,) * (dst.dim() - 1)), src, dst)


def thd_copy_valid_tokens_loop(
    dst: torch.Tensor, src: torch.Tensor, offsets: torch.Tensor, cu_seqlens: torch.Tensor
) -> torch.Tensor:
    """The definition as a loop over sequences; syncs with the host."""
    out = dst.clone()
    cu = cu_seqlens.tolist()
    for i, start in enumerate(offsets.tolist()[: len(cu) - 1]):
        n = cu[i + 1] - cu[i]
        out[start : start + n] = src[start : start + n]
    return out
