"""Which kernels run all-gather CP attention on CUDA (docs/design.md section 4.2, "Kernel backends").

Two backends compute :func:`custom_ops.ag_thd_attention`: ``segment`` (the package's
segment-attention kernels through ``varlen_attention`` / ``varlen_attention_kv``, and their torch
references on the CPU) and ``fa4`` (FlashAttention 4's varlen kernels,
:mod:`custom_ops.ag_attention.fa4`, the ``fa4`` extra). :func:`resolve` picks one for a call from
``CP_OPS_ATTENTION_BACKEND`` (``auto``, ``segment`` or ``fa4``) and what it knows without reading
a tensor's values: the device, its compute capability, the dtype, head dims and the mask's form.
The op resolves it while a graph is traced, so a compiled graph keeps the backend it was traced
with. The design follows the gated delta rule's (:mod:`custom_ops.gated_delta_rule.backends`).
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable
from dataclasses import dataclass

import torch

from custom_ops import env
from custom_ops.runtime.compile_cache import replace_tag
from custom_ops.runtime.constants import compile_constant

__all__ = ["BACKENDS", "Machine", "describe", "fa4_unfit", "here", "resolve", "set_backend"]

BACKENDS = ("auto", "segment", "fa4")
FA4_PACKAGE = "flash-attn-4"
# Compute capability majors FlashAttention 4 runs forward and backward on: SM90 (Hopper) and the
# SM100 family (Blackwell); its SM80 and SM120 paths are left to the segment kernels.
FA4_MAJORS = (9, 10)

_override: str | None = None


def set_backend(name: str | None) -> None:
    """Use backend ``name`` (``auto``, ``segment`` or ``fa4``) for calls and traces from now on,
    over ``CP_OPS_ATTENTION_BACKEND``; None goes back to the variable. Graphs compiled before keep
    the backend they were traced with (``torch._dynamo.reset()`` drops them)."""
    global _override
    if name is not None and name not in BACKENDS:
        raise ValueError(f"the attention backend must be 'auto', 'segment' or 'fa4', got {name!r}")
    _override = name
    _tag_compile_caches()


def requested() -> str:
    """The backend asked for: :func:`set_backend`'s, else ``CP_OPS_ATTENTION_BACKEND``'s."""
    return _override if _override is not None else env.attention_backend()


@compile_constant
def fa4_version() -> str | None:
    """The installed flash-attn-4's version, None where it is not installed (read from its
    metadata: importing it loads the CuTe DSL)."""
    try:
        return importlib.metadata.version(FA4_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return None


def _tag_compile_caches() -> None:
    """Name the backend asked for (and FlashAttention 4's version) in torch.compile's cache key,
    as the GDN backend does: a graph traced with one backend must not be loaded by a process
    that asks for another."""
    try:
        asked = requested()
    except ValueError:  # a malformed CP_OPS_ATTENTION_BACKEND raises at the op's call, with its message
        asked = "invalid"
    replace_tag("attn-", f"attn-{asked}-fa4-{fa4_version() or 'none'}")


@compile_constant
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


@dataclass(frozen=True)
class Machine:
    """What the choice reads besides the call: FlashAttention 4's installed version (None: not
    installed) and a CUDA device's compute capability (by device index). :func:`here` is this
    process's."""

    fa4: str | None
    capability: Callable[[int], tuple[int, int]]


def here() -> Machine:
    return Machine(fa4_version(), _capability)


def _head_dim_unfit(d: int, major: int) -> str | None:
    """Why FlashAttention 4 takes no head dim ``d`` (q, k and v alike) on this architecture."""
    if d % 8:
        return f"FlashAttention 4 takes head dims that are multiples of 8, got {d}"
    if major == 9 and not 8 <= d <= 256:
        return f"FlashAttention 4 takes head dims 8 to 256 on SM90, got {d}"
    if major == 10 and not (8 <= d <= 128 or d == 256):
        return f"FlashAttention 4 takes head dims 8 to 128 or 256 on SM100, got {d}"
    return None


def fa4_unfit(q: torch.Tensor, k: torch.Tensor, causal: bool, window: tuple[int, int],
              machine: Machine | None = None) -> str | None:  # fmt: skip
    """Why FlashAttention 4 cannot run this all-gather CP attention call (None: it can). Reads
    shapes, dtypes and the device only. The mask must be one FlashAttention 4 aligns as the op
    does: causal (any left window; the right one is moot), or no window at all."""
    machine = machine or here()
    if q.device.type != "cuda":
        return f"FlashAttention 4 runs on CUDA tensors, got {q.device.type}"
    if machine.fa4 is None:
        return "flash-attn-4 is not installed (pip install 'cp-ops[fa4]')"
    index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    major = machine.capability(index)[0]
    if major not in FA4_MAJORS:
        return f"FlashAttention 4's forward and backward here need compute capability 9.x or 10.x, got {major}.x"
    if q.dtype not in (torch.bfloat16, torch.float16):
        return f"FlashAttention 4 takes bfloat16 or float16 q, k, v, got {q.dtype}"
    for d in (q.shape[-1], k.shape[-1]):
        reason = _head_dim_unfit(d, major)
        if reason is not None:
            return reason
    if not causal and (window[0] >= 0 or window[1] >= 0):
        # FlashAttention 4 aligns a window to the ends of the query and key ranges; a chunk's
        # non-causal keys run to its sequence's end, so the alignment is not the chunk's position
        return f"FlashAttention 4 cannot place a non-causal window on a CP chunk, got window {tuple(window)}"
    return None


def resolve(q: torch.Tensor, k: torch.Tensor, causal: bool = True, window: tuple[int, int] = (-1, -1),
            backend: str = "auto", machine: Machine | None = None) -> str:  # fmt: skip
    """The backend that runs a call on q ``[T, Hq, D]`` and k ``[T, Hkv, D]``, at any number of CP
    ranks: ``segment`` on the CPU; else ``backend``, where ``auto`` is :func:`requested`'s choice
    and that, where ``auto`` again, ``fa4`` if it fits the call (:func:`fa4_unfit`), else
    ``segment``. ``fa4`` asked for where it does not fit raises ``ValueError`` with the reason."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if q.device.type != "cuda":
        return "segment"
    if backend == "auto":
        backend = requested()
    if backend == "segment":
        return "segment"
    reason = fa4_unfit(q, k, causal, window, machine)
    if backend == "fa4" and reason is not None:
        raise ValueError(f"CP_OPS_ATTENTION_BACKEND=fa4, but {reason}; use 'auto' to fall back to the segment kernels")
    return "fa4" if reason is None else "segment"


def describe(head_dim: int = 256, dtype: torch.dtype = torch.bfloat16) -> str:
    """The backend a causal CUDA call of this head dim and dtype takes here (``segment``, or
    FlashAttention 4 with its version: ``fa4 4.0.0b36``), or ``segment`` without CUDA: the
    benchmarks' environment line."""
    if not torch.cuda.is_available():
        return "segment"
    probe = torch.empty(1, 1, head_dim, device="cuda", dtype=dtype)
    if resolve(probe, probe) != "fa4":
        return "segment"
    return f"fa4 {fa4_version()}"


_tag_compile_caches()
