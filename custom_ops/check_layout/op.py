"""The opaque op ``cp_ops::check_layout``: the checked mode's layout checks inside a compiled graph
(:func:`custom_ops.thd.validation.checked` calls it where the mode is ``True``)."""

from __future__ import annotations

import torch

from custom_ops.runtime.registration import NAMESPACE, opaque_op
from custom_ops.thd.validation import validate

__all__ = ["check_layout"]


@opaque_op(f"{NAMESPACE}::check_layout", mutates_args=())
def check_layout(kind: str, index: torch.Tensor, others: list[torch.Tensor], sizes: list[int]) -> torch.Tensor:
    """Validate ``index`` (and ``others``) as ``kind`` on the host; a copy of ``index``.

    Opaque, so that under ``torch.compile`` the check runs with the graph; the copy is what the
    caller goes on with, which keeps the check in the graph and ordered before its users.
    """
    validate(kind, index, others, sizes)
    return index.clone()


@check_layout.register_fake
def _(kind, index, others, sizes):
    return index.new_empty(index.shape)
