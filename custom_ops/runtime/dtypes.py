"""The dtype the references compute in and the kernels accumulate in."""

from __future__ import annotations

import torch


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 for float64 inputs (the gradchecks' and the oracle's precision), else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32
