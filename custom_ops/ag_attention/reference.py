"""The single-process oracle of all-gather CP attention."""

from __future__ import annotations

import torch

from custom_ops.segment_attention.reference import varlen_attention_reference


def ag_thd_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cu_seqlens_padded: torch.Tensor,
    *,
    causal: bool = True,
    window: tuple[int, int] = (-1, -1),
    scale: float | None = None,
) -> torch.Tensor:
    """Every sequence's attention over itself, on the *global* sequence-order q ``[T, Hq, D]``,
    k, v ``[T, Hkv, D]``; returns ``[T, Hq, D]``.

    Rank r's :func:`custom_ops.ag_thd_attention` output is ``shard_thd(this, cu_seqlens_padded, W, r)``
    (and so are its gradients, dk and dv included). Segments ``q_start = k_start = cup[i]``,
    ``q_len = k_len = L_i``, ``q_pos = 0`` through the dense
    ``custom_ops.varlen_attention_reference``; padding rows are zero. Differentiable.
    """
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    starts = cu_seqlens_padded[:-1]
    return varlen_attention_reference(
        q, k, v, starts, lens, torch.zeros_like(lens), starts, lens, causal, window, scale
    )[0]
