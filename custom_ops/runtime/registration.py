"""How every op of the package is registered (docs/design.md section 2, "Registration forms").

- :func:`kernel_op`: ops whose bodies launch this package's Triton kernels, a ``triton_op``
  where the compiler can analyse those kernels (:func:`kernels_visible_to_compiler`), an
  opaque ``custom_op`` otherwise or on request;
- :func:`opaque_op`: ops the compiler always calls as one extern node;
- :func:`composite_op`: ops that are their decomposition (``CompositeImplicitAutograd``).

The ``custom_op`` and ``triton_op`` forms also register their body directly as the op's CPU
and CUDA kernel (:func:`_register_eager_kernels`), so an eager call reaches it without going
through ``custom_op``'s Python backend wrapper; their Python objects call it through
:func:`~custom_ops.thd.checked_mode.call_checked` (:class:`_CheckedOpDef`).
"""

from __future__ import annotations

import functools
import importlib.metadata
import inspect
import logging
import re
from collections.abc import Iterable

import torch
from torch._library.custom_ops import CustomOpDef
from torch._library.infer_schema import infer_schema
from torch._library.triton import set_wrap_triton_enabled
from torch.library import custom_op, triton_op

from custom_ops import env
from custom_ops.thd.checked_mode import call_checked

__all__ = ["NAMESPACE", "composite_op", "kernel_op", "kernels_visible_to_compiler", "opaque_op"]

# the torch.library namespace of every op: torch.ops.cp_ops.<name>
NAMESPACE = "cp_ops"


def _major_minor(version: str) -> tuple[int, int] | None:
    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else None


def triton_pin(requires: Iterable[str]) -> str | None:
    """The triton version pinned by a package's requirement strings (``triton==X`` or
    ``pytorch-triton==X``, markers allowed), or None."""
    for req in requires:
        m = re.match(r"\s*(?:pytorch-)?triton\s*==\s*([0-9][^;\s]*)", req)
        if m:
            return m.group(1)
    return None


def torch_triton_pin() -> str | None:
    """The triton version this torch build pins (CUDA wheels do), or None."""
    try:
        requires = importlib.metadata.requires("torch") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    return triton_pin(requires)


def visible_to_compiler(pin: str | None, installed: str, forced: str | None) -> bool:
    """The rule of :func:`kernels_visible_to_compiler` for a torch pin, an installed triton
    version and the value of ``CP_OPS_OPAQUE_KERNELS`` (None when unset)."""
    forced = env.parse("CP_OPS_OPAQUE_KERNELS", forced)
    if forced is not None:
        return forced == "0"
    have = _major_minor(installed)
    pinned = _major_minor(pin) if pin else None
    return pinned is None or have is None or have <= pinned


@functools.cache
def kernels_visible_to_compiler() -> bool:
    """Whether ops register as ``triton_op`` (Inductor sees their Triton kernels).

    False when the installed triton is newer than the one torch pins, whose IR analysis
    of ``triton_op`` kernels then fails (docs/design.md section 2, "Registration forms"):
    the ops register as opaque ``custom_op``s launching the same kernels.
    ``CP_OPS_OPAQUE_KERNELS=1`` (or ``0``) forces the choice. Read once, when
    ``custom_ops`` is imported.
    """
    import triton

    opaque = env.opaque_kernels()
    if opaque is not None:
        return not opaque
    pin = torch_triton_pin()
    visible = visible_to_compiler(pin, triton.__version__, None)
    if not visible:
        logging.getLogger("cp_ops").info(
            "triton %s is newer than the %s torch %s pins: cp_ops kernels run as opaque ops under torch.compile",
            triton.__version__, pin, torch.__version__,
        )  # fmt: skip
    return visible


def kernel_op(qualname: str, *, mutates_args, opaque: bool = False):
    """Register an op whose body launches Triton kernels (through :func:`custom_ops.runtime.launch.launch`,
    which a ``triton_op`` needs; an op that is always opaque may use ``launch_direct``).

    ``torch.library.triton_op`` where the compiler can analyse the kernels,
    ``torch.library.custom_op`` otherwise (:func:`kernels_visible_to_compiler`), or always
    with ``opaque=True``: for bodies that pass host TMA descriptors to their kernels, which
    torch cannot capture when it traces a ``triton_op``'s body (it records them as constants
    of the traced graph). Both return the same kind of object (``register_fake``,
    ``register_autograd``). Either way the body runs with ``wrap_triton`` off whenever it
    sees real tensors (``triton_op`` does that itself), so ``launch`` takes its eager path.
    """
    visible = kernels_visible_to_compiler() and not opaque

    def register(fn):
        # the body of an eager call sees real tensors: its launches never need torch's kernel wrapper
        body = functools.update_wrapper(_without_wrap_triton(fn), fn)
        if visible:
            op = triton_op(qualname, fn, mutates_args=mutates_args)
        else:
            op = custom_op(qualname, body, mutates_args=mutates_args, schema=infer_schema(fn, mutates_args=mutates_args))
        _register_eager_kernels(qualname, body)
        return _documented(op, fn)

    return register


def opaque_op(qualname: str, *, mutates_args):
    """Register the decorated function as an opaque ``torch.library.custom_op``, its schema
    inferred from the signature: the compiler calls it as one extern node whatever triton is
    installed. For bodies that launch kernels torch cannot trace (FLA's autotuned kernels, this
    package's kernels through ``launch_direct``) or that read process state (a process group's
    rank). The body runs as written: unlike :func:`kernel_op`'s, it does not switch
    ``wrap_triton`` off, as it launches nothing through ``launch``."""

    def register(fn):
        op = custom_op(qualname, fn, mutates_args=mutates_args, schema=infer_schema(fn, mutates_args=mutates_args))
        _register_eager_kernels(qualname, fn)
        return _documented(op, fn)

    return register


class _CheckedOpDef(CustomOpDef):
    """A ``CustomOpDef`` whose Python call is :func:`~custom_ops.thd.checked_mode.call_checked`:
    an eager call runs its body's layout checks in the eager checked mode. The compiler inlines
    this call (under tracing it is the bare op) and a compiled graph calls the op itself."""

    def __call__(self, *args, **kwargs):
        return call_checked(self._opoverload, *args, **kwargs)


def _documented(op, fn):
    """``op`` (a ``CustomOpDef``, made a :class:`_CheckedOpDef`) with ``fn``'s signature and
    docstring as its ``__doc__``.

    ``help()`` and ``pydoc`` show an instance's own ``__doc__`` (otherwise the class's generic
    text), but no signature for an instance, so the signature leads the text, as for builtins.
    """
    try:  # annotations as types, not the strings of a module with postponed annotations
        signature = inspect.signature(fn, eval_str=True)
    except (NameError, SyntaxError, TypeError):
        signature = inspect.signature(fn)
    doc = inspect.getdoc(fn)
    op.__class__ = _CheckedOpDef
    op.__doc__ = f"{fn.__name__}{signature}" + (f"\n\n{doc}" if doc else "")
    return op


# Holds the eager kernels' registrations for the life of the process.
_EAGER_KERNELS = torch.library.Library(NAMESPACE, "FRAGMENT")


def _register_eager_kernels(qualname: str, body) -> None:
    """Register ``body`` as op ``qualname``'s CPU and CUDA kernel.

    ``custom_op`` (and ``triton_op``, built on it) registers the body as the op's
    ``CompositeExplicitAutograd`` kernel inside a Python wrapper that checks, at every call, that
    the outputs alias no input, at a cost in host time to every eager call (docs/benchmarks.md,
    "Host time per eager op call"). A kernel registered for a
    backend key takes precedence over that one, so eager calls on CPU and CUDA tensors reach
    the body directly. Everything else stays ``custom_op``'s: the autograd kernel, the version
    bump of mutated arguments, the fake, and under tracing the ``triton_op`` decomposition (a
    mode's rule, which applies before any backend kernel).
    """
    namespace, name = qualname.split("::", 1)
    if namespace != NAMESPACE:
        raise ValueError(f"ops of this package live in namespace {NAMESPACE!r}, got {qualname!r}")
    for key in ("CPU", "CUDA"):
        _EAGER_KERNELS.impl(name, body, key)


def composite_op(qualname: str, schema: str):
    """Register the decorated function as op ``qualname`` with ``schema``, implemented as
    ``CompositeImplicitAutograd``: the op is its decomposition into other ops, so autograd, fake
    tensors and ``torch.compile`` see those ops (each with its own fake and backward), and the op
    needs neither of its own."""

    def register(fn):
        torch.library.define(qualname, schema)
        torch.library.impl(qualname, "CompositeImplicitAutograd")(fn)
        return fn

    return register


def _without_wrap_triton(fn):
    """``fn`` run with ``wrap_triton`` off (what ``set_wrap_triton_enabled(False)`` does, without
    a generator-based context manager's cost where torch's thread-local flag is reachable)."""
    from torch._library import triton as torch_triton

    state = getattr(torch_triton, "wrap_triton_enabled", None)
    default = getattr(torch_triton, "wrap_triton_enabled_default", None)
    if state is None or not isinstance(default, bool):

        def body(*args, **kwargs):
            with set_wrap_triton_enabled(False):
                return fn(*args, **kwargs)

        return body

    def body(*args, **kwargs):
        before = getattr(state, "value", default)
        state.value = False
        try:
            return fn(*args, **kwargs)
        finally:
            state.value = before

    return body
