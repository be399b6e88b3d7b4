"""Shared helpers for the op modules: argument checks, dispatch, word views.

Every op in this package checks shapes, dtypes and devices (free, and done at
trace time under ``torch.compile``). Checks of *values* (monotone cu_seqlens,
divisibility by 2*cp_size, ...) would need a host sync, so they live in
:mod:`cp_ops.layout` (``validate_thd``), which users call where data is prepared.
"""

from __future__ import annotations

import functools
import importlib.metadata
import inspect
import logging
import math
import os
import re

import torch
from torch._library.infer_schema import infer_schema
from torch._library.triton import is_wrap_triton_enabled, set_wrap_triton_enabled
from torch.library import custom_op, triton_op, wrap_triton
from triton import knobs

NAMESPACE = "cp_ops"

_INDEX_DTYPES = (torch.int32, torch.int64)


# Host arithmetic for grids and tiles. Triton's own ``triton.cdiv`` and
# ``triton.next_power_of_2`` are constexpr functions, which unwrap their arguments at every
# host call and cost microseconds each.
def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of 2 >= n, for n >= 1 (0 for 0, as Triton's)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0

# Integer types used to move elements bit-exactly, whatever their dtype.
_WORD_DTYPES = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def triton_interpreting() -> bool:
    """True when Triton runs kernels on CPU tensors (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(t: torch.Tensor) -> bool:
    """Whether an op body launches its Triton kernel for tensors on ``t``'s device.

    CUDA tensors always do. CPU tensors run the torch reference, except under
    ``TRITON_INTERPRET=1``, where the kernels run in Triton's interpreter (how
    the kernels are tested on machines without a GPU). The answer depends on the
    device only, so it is a trace-time constant under ``torch.compile``.
    """
    return t.device.type == "cuda" or (t.device.type == "cpu" and triton_interpreting())


def _major_minor(version: str) -> tuple[int, int] | None:
    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _torch_triton_pin() -> str | None:
    """The triton version this torch build pins (CUDA wheels do), or None."""
    try:
        requires = importlib.metadata.requires("torch") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for req in requires:
        m = re.match(r"\s*(?:pytorch-)?triton\s*==\s*([0-9][^;\s]*)", req)
        if m:
            return m.group(1)
    return None


@functools.cache
def kernels_visible_to_compiler() -> bool:
    """Whether ops register as ``triton_op`` (Inductor sees their Triton kernels).

    ``torch.compile`` analyses the Triton IR of every kernel launched inside a
    ``triton_op`` to learn which arguments it writes. That analysis is written
    against the triton release a torch build pins; with a newer triton (torch
    2.11 pins 3.6; FLA's GDN backward on Hopper needs 3.7.1) it fails for every
    kernel, torch then assumes every input is written and clones all of them at
    each launch, and Inductor's lowering of those clones fails (seen on torch
    2.11 + triton 3.7.1 compiling the GDN CP layer's backward; pytorch issue
    181735). So when the installed triton is newer than the pinned one, the ops
    register as opaque ``custom_op``s instead: the same kernels, launched by the
    op at run time; Inductor calls each op as one extern node, and graphs still
    have no breaks.

    ``CP_OPS_OPAQUE_KERNELS=1`` (or ``0``) forces the choice. Read once, when
    ``custom_ops`` is imported.
    """
    forced = os.environ.get("CP_OPS_OPAQUE_KERNELS")
    if forced in ("0", "1"):
        return forced == "0"
    if forced is not None:
        raise ValueError(f"CP_OPS_OPAQUE_KERNELS must be 0 or 1, got {forced!r}")
    import triton

    pin, have = _torch_triton_pin(), _major_minor(triton.__version__)
    pinned = _major_minor(pin) if pin else None
    if pinned is None or have is None or have <= pinned:
        return True
    logging.getLogger("cp_ops").info(
        "triton %s is newer than the %s torch %s pins: cp_ops kernels run as opaque ops under torch.compile",
        triton.__version__, pin, torch.__version__,
    )  # fmt: skip
    return False


def kernel_op(qualname: str, *, mutates_args, opaque: bool = False):
    """Register an op whose body launches Triton kernels (through :func:`launch`, which a
    ``triton_op`` needs; an op that is always opaque may use :func:`launch_direct`).

    ``torch.library.triton_op`` where the compiler can analyse the kernels,
    ``torch.library.custom_op`` otherwise (:func:`kernels_visible_to_compiler`), or always
    with ``opaque=True``: for bodies that pass host TMA descriptors to their kernels, which
    torch cannot capture when it traces a ``triton_op``'s body (it records them as constants
    of the traced graph). Both return the same kind of object (``register_fake``,
    ``register_autograd``). Either way the body runs with ``wrap_triton`` off whenever it
    sees real tensors (``triton_op`` does that itself), so :func:`launch` takes its eager path.
    """
    if kernels_visible_to_compiler() and not opaque:
        return triton_op(qualname, mutates_args=mutates_args)

    def register(fn):
        # an opaque body is never traced: its launches never need torch's kernel wrapper
        body = functools.update_wrapper(_without_wrap_triton(fn), fn)
        return custom_op(qualname, body, mutates_args=mutates_args, schema=infer_schema(fn, mutates_args=mutates_args))

    return register


def opaque_op(qualname: str, *, mutates_args):
    """Register an op the compiler calls as one extern node whatever triton is installed: bodies
    that launch kernels torch cannot trace (FLA's autotuned kernels, host TMA descriptors) or
    that read process state (a process group's rank). :func:`kernel_op` with ``opaque=True``."""
    return kernel_op(qualname, mutates_args=mutates_args, opaque=True)


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


# --- kernel launches --------------------------------------------------------------------------
#
# ``kernel[grid](...)`` (Triton's ``JITFunction.run``) binds the arguments, computes their
# specialization and an options string, looks the compiled kernel up and launches it, all in
# Python at every call; through ``wrap_triton`` outside tracing, torch's kernel wrapper adds
# more. The launches below keep, per kernel, the compiled kernel for each key that determines
# Triton's specialization, and launch it directly.

_I32, _I63 = 2**31, 2**63
_NO_KEY = object()
# id(kernel) -> (kernel, whether it compiles, {key: (compiled kernel, arguments past the
# positional ones) or False where that key cannot launch directly})
_KERNELS: dict = {}
_MAX_KEYS = 1024


def _spec_key(a):
    """What Triton specializes a kernel argument on, or a finer key; ``_NO_KEY`` when unknown.

    Tensors: dtype and 16-byte alignment of the pointer. Ints: equal to 1, divisible by 16,
    32- or 64-bit, signed or not (never the value, so a size that changes every call reuses
    one entry). Floats: their type. Bools, None, TMA descriptors (dtype, block shape,
    padding) and other hashable values (tuples, dtypes): themselves.
    """
    t = type(a)
    if t is int:
        return (a == 1, a % 16 == 0, -_I32 <= a < _I32, a >= _I63)
    if t is float:
        return 0.5
    if t is bool or a is None:
        return a
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() % 16 == 0)
    block_shape = getattr(a, "block_shape", None)
    if block_shape is not None and isinstance(getattr(a, "base", None), torch.Tensor):  # a TensorDescriptor
        return (a.base.dtype, tuple(block_shape), getattr(a, "padding", None), getattr(a, "round_f32_to_tf32", None))
    try:
        hash(a)
    except TypeError:
        return _NO_KEY
    return (t, a)


def _kernel_cache(kernel):
    entry = _KERNELS.get(id(kernel))
    if entry is None or entry[0] is not kernel:
        from triton.runtime.jit import JITFunction

        # under TRITON_INTERPRET=1 (when the kernel was defined) it is an interpreted function
        entry = _KERNELS[id(kernel)] = (kernel, isinstance(kernel, JITFunction), {})
    return entry


def _device() -> int:
    return torch._C._cuda_getDevice()


def _stream(device: int) -> int:
    return torch._C._cuda_getCurrentRawStream(device)


def launch_direct(kernel, grid, *args, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs)`` on real tensors, with less host work per call.

    Positional arguments are the kernel's runtime arguments; keyword arguments its
    constexprs and launch options (``num_warps``, ...). The first call with a given key
    (:func:`_spec_key` of every positional argument, the keyword arguments, the current
    device) goes through Triton, which compiles and launches; later ones launch the compiled
    kernel that call returned. Interpreted kernels (``TRITON_INTERPRET=1``) always go
    through Triton.
    """
    _, compiles, cache = _kernel_cache(kernel)
    if not compiles:
        kernel[grid](*args, **kwargs)
        return
    device = _device()
    key = [device]
    for a in args:
        k = _spec_key(a)
        if k is _NO_KEY:
            kernel[grid](*args, **kwargs)
            return
        key.append(k)
    key.append(tuple(kwargs.items()))
    key = tuple(key)
    entry = cache.get(key)
    if entry is None:
        compiled = kernel[grid](*args, **kwargs)
        if len(cache) >= _MAX_KEYS:
            cache.clear()
        cache[key] = _direct_entry(kernel, compiled, len(args), kwargs)
        return
    if entry is False:
        kernel[grid](*args, **kwargs)
        return
    compiled, tail = entry
    grid_0 = grid[0]
    grid_1 = grid[1] if len(grid) > 1 else 1
    grid_2 = grid[2] if len(grid) > 2 else 1
    stream = _stream(device)
    runtime = knobs.runtime
    enter = runtime.launch_enter_hook
    # the metadata is for launch hooks (profilers); with none registered nothing reads it
    metadata = compiled.launch_metadata(grid, stream, *args, *tail) if getattr(enter, "calls", enter) else None
    compiled.run(grid_0, grid_1, grid_2, stream, compiled.function, compiled.packed_metadata, metadata, enter,
                 runtime.launch_exit_hook, *args, *tail)  # fmt: skip


def _direct_entry(kernel, compiled, num_positional: int, kwargs):
    """``(compiled kernel, the arguments after the positional ones)`` for direct launches, or
    False where they are not possible: a compiled kernel that is not Triton's
    ``CompiledKernel`` (whose ``run`` takes the launch in the form used above), or a keyword
    argument that is a runtime argument rather than a constexpr or an option."""
    if hasattr(compiled, "result"):  # a compilation future
        compiled = compiled.result()
    if not all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata", "launch_metadata")):
        return False
    tail = []
    for p in kernel.params[num_positional:]:
        if p.name in kwargs:
            if not p.is_constexpr:
                return False
            tail.append(kwargs[p.name])
        else:
            default = kernel.signature.parameters[p.name].default
            if default is inspect.Parameter.empty:
                return False
            tail.append(default)
    return compiled, tuple(tail)


def launch(kernel, grid, *args, **kwargs) -> None:
    """:func:`launch_direct` from the body of a :func:`kernel_op`, traceable: where torch
    traces a ``triton_op``'s body (``torch.compile``, ``make_fx``), ``wrap_triton`` is on and
    the launch goes through it, which records it in the graph."""
    if is_wrap_triton_enabled():
        wrap_triton(kernel)[grid](*args, **kwargs)
    else:
        launch_direct(kernel, grid, *args, **kwargs)


def unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its last dim contiguous, any other strides: a copy only where that stride is
    not 1. Kernels that take row (and head) strides read views (column slices of a wider
    tensor, head slices of a gathered one) in place this way, where ``.contiguous()`` would
    copy them."""
    return t if t.stride(-1) == 1 else t.contiguous()


def check_index_tensor(name: str, t: torch.Tensor, device: torch.device, min_numel: int = 1) -> None:
    """A 1-D int32/int64 tensor on ``device`` with at least ``min_numel`` entries."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _INDEX_DTYPES:
        raise TypeError(f"{name} must be int32 or int64, got {t.dtype}")
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    if t.numel() < min_numel:
        raise ValueError(f"{name} must have at least {min_numel} entries, got {t.numel()}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but the data is on {device}; put them on one device")


def check_cp_size(cp_size: int) -> None:
    # SymInt: dynamo turns an int that changes between calls into a symbol (automatic dynamic)
    if isinstance(cp_size, bool) or not isinstance(cp_size, (int, torch.SymInt)):
        raise TypeError(f"cp_size must be an int, got {type(cp_size).__name__}")
    if cp_size < 1:
        raise ValueError(f"cp_size must be >= 1, got {cp_size}")


def check_rows(name: str, x: torch.Tensor) -> None:
    """``x`` is a tensor with a leading token dimension."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 1:
        raise ValueError(f"{name} must have a leading token dimension, got a 0-d tensor")


# dtypes Triton loads and stores as themselves; moving them is bit-exact
_NATIVE_DTYPES = (
    torch.float16, torch.bfloat16, torch.float32, torch.float64,
    torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8,
)  # fmt: skip


def word_dtype(dtype: torch.dtype) -> tuple[torch.dtype, int]:
    """(dtype a row-moving kernel uses for ``dtype``, words per element).

    Standard dtypes move as themselves. Others (float8, bool, complex, ...) move as
    integers of their element size, 16-byte elements as two int64 words, so every
    dtype is moved bit-exactly. Only those take a dtype view: Inductor cannot always
    lower a dtype view of an intermediate that feeds a user kernel.
    """
    if dtype in _NATIVE_DTYPES:
        return dtype, 1
    size = torch.empty((), dtype=dtype).element_size()
    if size in _WORD_DTYPES:
        return _WORD_DTYPES[size], 1
    return torch.int64, size // 8


def to_words(x2: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A contiguous 2-D tensor viewed in its :func:`word_dtype`, and the words per element."""
    dtype, k = word_dtype(x2.dtype)
    return (x2 if dtype == x2.dtype else x2.view(dtype)), k


def from_words(words: torch.Tensor, dtype: torch.dtype, shape) -> torch.Tensor:
    """The inverse of :func:`to_words`: ``words`` seen as ``dtype`` with ``shape``."""
    return (words if words.dtype == dtype else words.view(dtype)).view(shape)


def as_words(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a contiguous ``[T, D']`` matrix a row-moving kernel can load and store."""
    x = x.contiguous()
    return to_words(x.reshape(x.shape[0], math.prod(x.shape[1:])))[0]


# Tile shape of the row-moving kernels (reorder, valid-token copy). One table, so a
# benchmark can sweep it; the defaults were picked on an H100 (docs/benchmarks.md).
ROW_TILE = {"tile_bytes": 16384, "max_row_bytes": 8192, "num_warps": 4}


def row_tile(cols: int, word_bytes: int) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_D, num_warps) for a row-moving kernel over ``[T, cols]`` words.

    A program moves BLOCK_R whole rows of up to ``max_row_bytes`` bytes, about
    ``tile_bytes`` in all; wider rows are split over a second grid axis.
    """
    block_d = max(1, min(next_power_of_2(max(cols, 1)), ROW_TILE["max_row_bytes"] // word_bytes))
    block_r = max(1, min(64, ROW_TILE["tile_bytes"] // (block_d * word_bytes)))
    return block_r, block_d, ROW_TILE["num_warps"]
