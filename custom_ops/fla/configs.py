"""Recorded autotuning choices for FLA's kernels, so that a first step does not autotune.

:func:`use_recorded_configs` puts the choices recorded on a GPU of the same compute capability
(``fla_configs_sm<major><minor>.json`` beside this module, written by
``python -m benchmarks.record_fla_configs``) into FLA's autotuner caches for the keys they have
not seen, where FLA's version is the recorded one and the configuration still in the
kernel's list; other keys and GPUs autotune as before. The caches are shared by every
caller of FLA in the process. ``CP_OPS_FLA_CONFIGS=0`` turns this off; why and what a key is:
docs/design.md section 3.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import torch

from custom_ops import env

__all__ = ["autotuner_of", "recorded_configs_path", "seed_autotuners", "use_recorded_configs"]

_DIR = Path(__file__).resolve().parent
_SEEDED: dict[int, int] = {}  # cache: device index -> entries put into the autotuners' caches


def recorded_configs_path(capability: tuple[int, int]) -> Path:
    """The file of recorded choices for GPUs of ``capability`` (it need not exist)."""
    major, minor = capability
    return _DIR / f"fla_configs_sm{major}{minor}.json"


def autotuner_of(kernel):
    """The ``triton.runtime.autotuner.Autotuner`` of a module-level kernel object (under any
    ``triton.heuristics`` wrapping it), or None for a kernel that is not autotuned."""
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import KernelInterface

    while isinstance(kernel, KernelInterface) and not isinstance(kernel, Autotuner):
        kernel = getattr(kernel, "fn", None)
    return kernel if isinstance(kernel, Autotuner) else None


def _autotuner(name: str):
    """The autotuner of kernel ``module.attribute``, or None."""
    module_name, _, attr = name.rpartition(".")
    try:
        return autotuner_of(getattr(importlib.import_module(module_name), attr, None))
    except ImportError:
        return None


def seed_autotuners(record: dict, fla_version: str) -> int:
    """Put ``record``'s choices into FLA's autotuner caches where their key is not cached yet;
    the number put. Nothing for a record of another FLA version; an entry whose kernel is gone
    or whose configuration is not among the kernel's configurations is skipped."""
    if record.get("fla") != fla_version:
        return 0
    seeded = 0
    for entry in record["entries"]:
        tuner = _autotuner(entry["kernel"])
        if tuner is None:
            continue
        config = next((c for c in tuner.configs if c.all_kwargs() == entry["config"]), None)
        key = tuple(entry["key"])
        if config is not None and key not in tuner.cache:
            tuner.cache[key] = config
            seeded += 1
    return seeded


def use_recorded_configs(device: torch.device) -> int:
    """Seed FLA's autotuners with the choices recorded for ``device``'s compute capability, once
    per device (later calls return at once); the number of entries put (0 on
    devices other than CUDA ones)."""
    if device.type != "cuda":
        return 0
    index = device.index if device.index is not None else torch.cuda.current_device()
    done = _SEEDED.get(index)
    if done is not None:
        return done
    _SEEDED[index] = 0
    if not env.fla_configs():
        return 0
    path = recorded_configs_path(torch.cuda.get_device_capability(index))
    if not path.exists():
        return 0
    import fla

    with open(path) as f:
        record = json.load(f)
    _SEEDED[index] = seed_autotuners(record, fla.__version__)
    return _SEEDED[index]
