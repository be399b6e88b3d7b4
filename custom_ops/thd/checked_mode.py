"""The checked mode's state: the process's mode (:func:`set_checks`) and whether an op's body runs
for an eager call (:func:`call_checked`). The checks themselves are in
:mod:`custom_ops.thd.validation`; this module imports neither it nor the registration, which
makes the ops' Python objects call through :func:`call_checked`."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Literal

import torch

from custom_ops import env

__all__ = ["call_checked", "checks_enabled", "eager_call", "set_checks"]

# the process's checked mode: read from the environment once, changed only by set_checks
_MODE: bool | Literal["eager"] = env.checks()


class _EagerCall(threading.local):
    """Whether an op's body runs for an eager call (set by :func:`call_checked`): the body
    cannot tell otherwise, as a compiled graph calls an opaque op's body with real tensors too."""

    active = False


_EAGER_CALL = _EagerCall()


def set_checks(mode: bool | Literal["eager"]) -> None:
    """Set the checked mode for this process: ``True`` (every call validates, compiled graphs
    included), ``False`` (none) or ``"eager"`` (eager calls only; the default). See
    :mod:`custom_ops.thd.validation`."""
    global _MODE
    if not isinstance(mode, bool) and mode != "eager":
        raise TypeError(f"mode must be True, False or 'eager', got {mode!r}")
    _MODE = mode


def checks_enabled() -> bool | Literal["eager"]:
    """The checked mode :func:`set_checks` set: ``True``, ``False`` or ``"eager"``."""
    return _MODE



def eager_call() -> bool:
    """Whether the running op body was called eagerly, through :func:`call_checked`."""
    return _EAGER_CALL.active


def call_checked(op: Callable, *args, **kwargs):
    """``op(*args, **kwargs)``, its body's checks validating in the eager mode: the way a Python
    entry point (an op's Python object, a wrapper) calls an op eagerly. Under ``torch.compile``
    it is the bare call, so the graph holds no check."""
    if _MODE != "eager" or torch.compiler.is_compiling() or _EAGER_CALL.active:
        return op(*args, **kwargs)
    _EAGER_CALL.active = True
    try:
        return op(*args, **kwargs)
    finally:
        _EAGER_CALL.active = False
