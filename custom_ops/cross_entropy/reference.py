"""Torch reference of the linear cross-entropy op: the unfused loss, the full logits
materialised (the definition the op is tested against)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from custom_ops.runtime.dtypes import accumulation_dtype


def linear_cross_entropy_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    chunk_rows: Optional[int] = None,
) -> torch.Tensor:
    """``F.cross_entropy(hidden @ weight^T, labels)`` with the logits ``[N, V]`` rounded to
    hidden's dtype (what an ``nn.Linear`` head returns) and upcast (float32, float64 for float64)
    before the softmax, as transformers' causal-LM loss does. ``chunk_rows`` is not used: the
    whole ``[N, V]`` exists at once here."""
    logits = (hidden @ weight.T).to(accumulation_dtype(hidden.dtype))
    return F.cross_entropy(logits, labels.long(), ignore_index=ignore_index, reduction=reduction)
