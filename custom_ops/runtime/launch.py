"""Kernel launches with less host work per call (docs/design.md section 2, "Registration forms").

``kernel[grid](...)`` (Triton's ``JITFunction.run``) binds the arguments, computes their
specialization and an options string, looks the compiled kernel up and launches it, all in
Python at every call; through ``wrap_triton`` outside tracing, torch's kernel wrapper adds
more. :func:`launch_direct` keeps, per kernel, the compiled kernel for each key that determines
Triton's specialization, and launches it directly; :func:`launch` is its traceable form for
the bodies of ``triton_op``\\ s.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
from torch import Tensor
from torch._library.triton import is_wrap_triton_enabled
from torch.library import wrap_triton
from triton import knobs

from custom_ops import env
from custom_ops.runtime import precompile
from custom_ops.runtime.tiles import RowSettings, cdiv, row_tile

__all__ = ["direct_launcher", "launch", "launch_direct", "launch_rows", "triton_interpreting", "use_triton"]

def triton_interpreting() -> bool:
    """True when Triton runs kernels on CPU tensors (TRITON_INTERPRET=1)."""
    return env.triton_interpret()


def use_triton(t: torch.Tensor) -> bool:
    """Whether an op body launches its Triton kernel for tensors on ``t``'s device.

    CUDA tensors always do. CPU tensors run the torch reference, except under
    ``TRITON_INTERPRET=1``, where the kernels run in Triton's interpreter (how
    the kernels are tested on machines without a GPU). The answer depends on the
    device only, so it is a trace-time constant under ``torch.compile``.
    """
    return t.is_cuda or (t.device.type == "cpu" and triton_interpreting())


NO_KEY = object()
MAX_KEYS = 1024


# Keys of ints by what Triton specializes on (their values never enter a key): small negative
# ints, which no other argument's key equals (a bool's key is the bool, and True == 1).
_INT_ONE, _I32_DIV16, _I32, _I64_DIV16, _I64, _U64_DIV16, _U64 = -1, -2, -3, -4, -5, -6, -7
_I32_BOUND, _I64_BOUND = 2**31, 2**63


def _int_key(a: int) -> int:
    if a == 1:
        return _INT_ONE
    div16 = a % 16 == 0
    if -_I32_BOUND <= a < _I32_BOUND:
        return _I32_DIV16 if div16 else _I32
    if a < _I64_BOUND:
        return _I64_DIV16 if div16 else _I64
    return _U64_DIV16 if div16 else _U64


def spec_key(a):
    """What Triton specializes a kernel argument on, or a finer key; :data:`NO_KEY` when unknown.

    Tensors: their dtype where the pointer is 16-byte aligned, else a 1-tuple of it. Ints: one
    of seven small negative ints (equal to 1, or 32-bit, 64-bit or unsigned 64-bit, each
    divisible by 16 or not), never the value, so a size that changes every call reuses one
    entry. Floats: their type. Bools, None, TMA descriptors (dtype, block shape, padding) and
    other hashable values (tuples, dtypes): themselves. Keys are small and flat because
    :func:`launch_direct` builds one per argument at every launch.
    """
    t = type(a)
    if t is int:
        return _int_key(a)
    if t is float:
        return 0.5
    if t is bool or a is None:
        return a
    if isinstance(a, torch.Tensor):
        return a.dtype if a.data_ptr() % 16 == 0 else (a.dtype,)
    block_shape = getattr(a, "block_shape", None)
    if block_shape is not None and isinstance(getattr(a, "base", None), torch.Tensor):  # a TensorDescriptor
        return (a.base.dtype, tuple(block_shape), getattr(a, "padding", None), getattr(a, "round_f32_to_tf32", None))
    try:
        hash(a)
    except TypeError:
        return NO_KEY
    return (t, a)


def current_device() -> int:
    return torch._C._cuda_getDevice()


def current_stream(device: int) -> int:
    return torch._C._cuda_getCurrentRawStream(device)


def compiles(kernel) -> bool:
    """Whether ``kernel`` is compiled by Triton (under ``TRITON_INTERPRET=1``, when the kernel
    was defined, it is an interpreted function instead)."""
    from triton.runtime.jit import JITFunction

    return isinstance(kernel, JITFunction)


def direct_launcher(
    device: Callable[[], int] = current_device,
    stream: Callable[[int], int] = current_stream,
    compiled: Callable[[object], bool] = compiles,
) -> Callable[..., None]:
    """A :func:`launch_direct` with its own cache of compiled kernels, reading the current device
    from ``device()``, its stream from ``stream(device)`` and whether a kernel compiles (rather
    than being interpreted) from ``compiled(kernel)``, once per kernel."""
    # id(kernel) -> (kernel, whether it compiles, {key: (compiled kernel, arguments past the
    # positional ones) or False where that key cannot launch directly})
    kernels: dict = {}

    def launch_direct(kernel, grid, *args, **kwargs) -> None:
        """``kernel[grid](*args, **kwargs)`` on real tensors, with less host work per call.

        Positional arguments are the kernel's runtime arguments; keyword arguments its
        constexprs and launch options (``num_warps``, ...). The first call with a given key
        (:func:`spec_key` of every positional argument, the keyword arguments, the current
        device) goes through Triton, which compiles and launches; later ones launch the compiled
        kernel that call returned. Interpreted kernels (``TRITON_INTERPRET=1``) always go
        through Triton. In a thread that precompiles (:mod:`custom_ops.runtime.precompile`), on meta
        tensors, nothing launches: a kernel not launched yet with its key is compiled in a
        worker, and the first launch with that key waits for that compile.
        """
        entry = kernels.get(id(kernel))
        if entry is None or entry[0] is not kernel:
            entry = kernels[id(kernel)] = (kernel, compiled(kernel), {})
        _, is_compiled, cache = entry
        precompiling = precompile.state.device
        if not is_compiled:
            if precompiling is None:
                kernel[grid](*args, **kwargs)
            return
        dev = device() if precompiling is None else precompiling
        key = [dev]
        append = key.append
        for a in args:  # spec_key, its two common cases inlined: this loop runs at every launch
            t = type(a)
            if t is int:
                append(_int_key(a))
            elif t is Tensor:
                append(a.dtype if a.data_ptr() % 16 == 0 else (a.dtype,))
            else:
                k = spec_key(a)
                if k is NO_KEY:
                    if precompiling is None:
                        kernel[grid](*args, **kwargs)
                    return
                append(k)
        append(tuple(kwargs.items()))
        key = tuple(key)
        entry = cache.get(key)
        if precompiling is not None:
            if entry is None:
                precompile.submit_compile(kernel, key, grid, args, kwargs)
            return
        if entry is None:
            precompile.wait_for(kernel, key)
            result = kernel[grid](*args, **kwargs)
            if len(cache) >= MAX_KEYS:
                cache.clear()
            cache[key] = _direct_entry(kernel, result, len(args), kwargs)
            return
        if entry is False:
            kernel[grid](*args, **kwargs)
            return
        fn, tail = entry
        grid_0 = grid[0]
        grid_1 = grid[1] if len(grid) > 1 else 1
        grid_2 = grid[2] if len(grid) > 2 else 1
        s = stream(dev)
        runtime = knobs.runtime
        enter = runtime.launch_enter_hook
        # the metadata is for launch hooks (profilers); with none registered nothing reads it
        metadata = fn.launch_metadata(grid, s, *args, *tail) if getattr(enter, "calls", enter) else None
        fn.run(grid_0, grid_1, grid_2, s, fn.function, fn.packed_metadata, metadata, enter,
               runtime.launch_exit_hook, *args, *tail)  # fmt: skip

    # forgets the compiled kernels, so that each kernel's next launch goes through Triton again
    launch_direct.cache_clear = kernels.clear
    return launch_direct


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


#: The package's launcher: one cache for every kernel, on the current CUDA device and stream.
launch_direct = direct_launcher()


def launch(kernel, grid, *args, **kwargs) -> None:
    """:func:`launch_direct` from the body of a ``kernel_op``, traceable: where torch traces a
    ``triton_op``'s body (``torch.compile``, ``make_fx``), ``wrap_triton`` is on and the launch
    goes through it, which records it in the graph."""
    if is_wrap_triton_enabled():
        wrap_triton(kernel)[grid](*args, **kwargs)
    else:
        launch_direct(kernel, grid, *args, **kwargs)


def launch_rows(kernel, settings: RowSettings, rows: int, cols: int, word_bytes: int, *args, **kwargs) -> None:
    """:func:`launch` of a row-moving kernel over a ``[rows, cols]`` matrix of ``word_bytes``-byte
    elements: one program per tile of :func:`custom_ops.runtime.tiles.row_tile` under ``settings``,
    whose BLOCK_R, BLOCK_D and num_warps it passes with ``kwargs``."""
    block_r, block_d, num_warps = row_tile(cols, word_bytes, settings)
    grid = (cdiv(rows, block_r), cdiv(cols, block_d))
    launch(kernel, grid, *args, BLOCK_R=block_r, BLOCK_D=block_d, num_warps=num_warps, **kwargs)
