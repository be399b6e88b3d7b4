"""The library kernels ``bench_attention kernel`` times segment attention against, on packed
causal documents, and the float32 reference each is measured against.

Each ``*_fn(lens, device)`` returns ``fn(q, k, v, seg) -> out`` on the packed ``[T, H, D]``
layout (``Hkv`` key/value heads, ``H % Hkv == 0``), differentiable by autograd; it raises
:class:`NotInstalled` when its package is missing. The packages are not dependencies of the
package: ``pip install -e '.[attention-baselines]'`` installs them (tested at constraints.txt's pins).
"""

from __future__ import annotations

import importlib

import torch

from benchmarks.cases import segments_for
from cp_ops import pad_cu_seqlens
from custom_ops import varlen_attention_reference
from custom_ops.testing import rel_error

EXTRA = "attention-baselines"
PACKAGES = ("flash-attn-4", "nvidia-cudnn-frontend")


class NotInstalled(ImportError):
    """A baseline's package is not installed: its row says so instead of ending the run."""


def require(module: str, package: str):
    """``module`` imported; :class:`NotInstalled` naming ``package`` where ``module`` (or a
    package above it) is absent. A module missing inside it (a broken install) raises as is."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name is None or not (module == e.name or module.startswith(e.name + ".")):
            raise
        raise NotInstalled(f"{package} not installed (the {EXTRA} extra)") from e


def fa4_varlen_fn(lens: list[int], device):
    """FlashAttention 4 (flash-attn-4, CuTe DSL kernels): ``flash_attn_varlen_func`` with the
    documents' offsets for queries and keys, causal, GQA from the head counts."""
    cute = require("flash_attn.cute", "flash-attn-4")
    cu, longest = pad_cu_seqlens(lens, 1, device=device)[0], max(lens)  # the documents' int32 offsets

    def fn(q, k, v, seg):
        out = cute.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest,
                                          max_seqlen_k=longest, causal=True)  # fmt: skip
        return out[0] if isinstance(out, tuple) else out  # (out, lse)

    return fn


def cudnn_varlen_fn(lens: list[int], device):
    """cuDNN's SDPA through nvidia-cudnn-frontend's torch op on packed (THD) tensors: it turns the
    documents' offsets into the graph's ragged offsets, causal, GQA from the head counts. The op's
    backward needs the forward's log-sum-exp, so the forward returns it."""
    torch_op = require("cudnn.sdpa.fwd.torch_op", "nvidia-cudnn-frontend")
    cu, longest = pad_cu_seqlens(lens, 1, device=device)[0], max(lens)  # the documents' int32 offsets

    def fn(q, k, v, seg):
        return torch_op.sdpa(q, k, v, is_causal=True, cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                             max_seqlen_kv=longest, return_lse=True)[0]  # fmt: skip

    return fn


def fp32_reference(q, k, v, lens: list[int], dout) -> tuple[torch.Tensor, ...]:
    """``(out, dq, dk, dv)`` in float32: causal attention over each document on its own, by
    :func:`custom_ops.varlen_attention_reference` on float32 copies of the inputs and autograd,
    one document at a time (its memory is quadratic in the document's length)."""
    grads = [torch.empty(t.shape, dtype=torch.float32, device=t.device) for t in (q, q, k, v)]
    start = 0
    for n in lens:
        rows = slice(start, start + n)
        leaves = [t[rows].detach().float().requires_grad_() for t in (q, k, v)]
        with torch.enable_grad():
            out = varlen_attention_reference(*leaves, *segments_for([n], q.device), causal=True)[0]
            d = torch.autograd.grad(out, leaves, dout[rows].float())
        for into, value in zip(grads, (out.detach(), *d)):
            into[rows] = value
        start += n
    return tuple(grads)


def compare(out: torch.Tensor, ref: torch.Tensor, rows: int = 16384) -> tuple[float, float]:
    """``(max |out - ref|, rel_error(out, ref))``, inf for both where ``out - ref`` is not finite.
    The max in float32 chunks of ``rows`` rows: a float64 copy of a 524288-token gradient at
    D = 256 would take 17 GB (:func:`custom_ops.testing.rel_error` sums in chunks too)."""
    worst = 0.0
    for a, b in zip(out.detach().split(rows), ref.detach().split(rows)):
        diff = a.float() - b.float()
        if not bool(torch.isfinite(diff).all()):
            return float("inf"), float("inf")
        worst = max(worst, float(diff.abs().max())) if diff.numel() else worst
    return worst, rel_error(out, ref)
