"""Which kernels run the gated delta rule ops on CUDA (docs/design.md section 2, "Kernel backends").

Three backends compute the same function: ``reference`` (the torch reference of
:mod:`custom_ops.gated_delta_rule.reference`, every CPU tensor), ``fla`` (FLA's Triton kernels,
:mod:`custom_ops.fla.adapter`) and ``flashqla`` (FlashQLA's fused TileLang kernels,
:mod:`custom_ops.gated_delta_rule.flash_qla`, the ``flashqla`` extra). :func:`resolve` picks one
for a call from ``CP_OPS_GDN_BACKEND`` (``auto``, ``fla`` or ``flashqla``) and what it knows
without reading a tensor's values: the device, its compute capability, dtypes and head dims. The
public ops resolve it while a graph is traced and pass it to their forward op as a constant, so a
compiled graph keeps the backend it was traced with, and the backward runs the forward's backend
(their saved tensors are in that backend's form).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch

from custom_ops import env
from custom_ops.runtime.compile_cache import replace_tag
from custom_ops.runtime.constants import compile_constant

__all__ = ["BACKENDS", "Machine", "describe", "flash_qla_unfit", "here", "installed_version", "resolve", "set_backend"]

# What a forward op's ``backend`` argument takes: "auto" resolves at the call.
BACKENDS = ("auto", "reference", "fla", "flashqla")

# Compute capabilities FlashQLA runs forward and backward on (SM120 has a forward kernel only).
FLASH_QLA_CAPABILITIES = ((9, 0), (10, 0), (10, 3))
FLASH_QLA_HEAD_DIM = 128
# ``auto`` takes FLA for calls of this many key heads or fewer (a rank's share of Qwen3-Next's 16 at
# W = 8): there FlashQLA's forward + backward is slower than FLA's from 131072 tokens on.
AUTO_FLA_MAX_KEY_HEADS = 2

_override: str | None = None


def set_backend(name: str | None) -> None:
    """Use backend ``name`` (``auto``, ``fla`` or ``flashqla``) for calls and traces from now on,
    over ``CP_OPS_GDN_BACKEND``; None goes back to the variable. Graphs compiled before keep the
    backend they were traced with (``torch._dynamo.reset()`` drops them)."""
    global _override
    if name is not None and name not in ("auto", "fla", "flashqla"):
        raise ValueError(f"the GDN backend must be 'auto', 'fla' or 'flashqla', got {name!r}")
    _override = name
    _tag_compile_caches()


def requested() -> str:
    """The backend asked for: :func:`set_backend`'s, else ``CP_OPS_GDN_BACKEND``'s."""
    return _override if _override is not None else env.gdn_backend()


# the state mode's map pass resolves its calls' backends while Dynamo traces it
@compile_constant
def installed_version(package: str) -> str | None:
    """The installed version of distribution ``package``, None where it is not importable."""
    module = package.replace("-", "_")
    if importlib.util.find_spec(module) is None:
        return None
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def _tag_compile_caches() -> None:
    """Name the backend asked for (and FlashQLA's version) in torch.compile's cache key: the public
    ops resolve the backend while a graph is traced, so Inductor's and AOTAutograd's caches must
    not hand a graph traced with one backend to a process that asks for another."""
    try:
        asked = requested()
    except ValueError:  # a malformed CP_OPS_GDN_BACKEND raises at the op's call, with its message
        asked = "invalid"
    replace_tag("gdn-", f"gdn-{asked}-flashqla-{installed_version('flash-qla') or 'none'}")


@compile_constant
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


@dataclass(frozen=True)
class Machine:
    """What the choice reads besides the call: FlashQLA's installed version (None: not importable)
    and a CUDA device's compute capability (by device index). :func:`here` is this process's."""

    flash_qla: str | None
    capability: Callable[[int], tuple[int, int]]


def here() -> Machine:
    return Machine(installed_version("flash-qla"), _capability)


def flash_qla_unfit(q: torch.Tensor, v: torch.Tensor, machine: Machine | None = None) -> str | None:
    """Why FlashQLA cannot run this call (None: it can). Reads shapes, dtypes and the device only."""
    machine = machine or here()
    if q.device.type != "cuda":
        return f"FlashQLA runs on CUDA tensors, got {q.device.type}"
    if machine.flash_qla is None:
        return "flash_qla is not installed (pip install 'cp-ops[flashqla]')"
    index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    capability = machine.capability(index)
    if capability not in FLASH_QLA_CAPABILITIES:
        return f"FlashQLA's forward and backward need compute capability 9.0, 10.0 or 10.3, got {capability}"
    if q.dtype not in (torch.bfloat16, torch.float16):
        return f"FlashQLA takes bfloat16 or float16 q, k, v, got {q.dtype}"
    if q.shape[-1] != FLASH_QLA_HEAD_DIM or v.shape[-1] != FLASH_QLA_HEAD_DIM:
        return f"FlashQLA takes head dims dk = dv = {FLASH_QLA_HEAD_DIM}, got dk = {q.shape[-1]}, dv = {v.shape[-1]}"
    return None


def resolve(q: torch.Tensor, v: torch.Tensor, backend: str = "auto", machine: Machine | None = None) -> str:
    """The backend that runs a call on q ``[T, Hk, dk]`` and v ``[T, Hv, dv]``: ``reference`` on the
    CPU and for no rows; else ``backend``, where ``auto`` is :func:`requested`'s choice and that,
    where ``auto`` again, FlashQLA if it fits the call and q has more than
    :data:`AUTO_FLA_MAX_KEY_HEADS` heads, else FLA. ``flashqla`` asked for where it does not fit
    raises ``ValueError`` with the reason."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if q.device.type != "cuda" or q.shape[0] == 0:
        return "reference"
    if backend == "reference":
        raise ValueError("the reference backend runs CPU tensors; CUDA tensors take 'fla' or 'flashqla'")
    if backend == "auto":
        backend = requested()
    if backend == "fla" or (backend == "auto" and q.shape[1] <= AUTO_FLA_MAX_KEY_HEADS):
        return "fla"
    reason = flash_qla_unfit(q, v, machine)
    if backend == "flashqla" and reason is not None:
        raise ValueError(f"CP_OPS_GDN_BACKEND=flashqla, but {reason}; use 'auto' to fall back to FLA's kernels")
    return "flashqla" if reason is None else "fla"


def describe(head_dim: int = FLASH_QLA_HEAD_DIM, dtype: torch.dtype = torch.bfloat16) -> str:
    """The backend a CUDA call of this head dim and dtype takes here (``fla``, or FlashQLA with its
    version: ``flashqla 0.1.3``, and where ``auto`` gives FLA the calls of few key heads, how few),
    or ``reference`` without CUDA: the benchmarks' environment line."""
    if not torch.cuda.is_available():
        return "reference"
    probe = torch.empty(1, AUTO_FLA_MAX_KEY_HEADS + 1, head_dim, device="cuda", dtype=dtype)
    if resolve(probe, probe) != "flashqla":
        return "fla"
    few = f" (fla at <= {AUTO_FLA_MAX_KEY_HEADS} key heads)" if requested() == "auto" else ""
    return f"flashqla {installed_version('flash-qla')}{few}"


_tag_compile_caches()
