"""Compiling an op's kernels while a graph is traced, before their first launch
(docs/design.md section 3, "The first step").

An op's fake calls :func:`schedule` with its launchers; a worker runs them on meta tensors,
under which :func:`custom_ops.runtime.launch.launch_direct` hands each kernel to another worker
to compile instead of launching it. A launch whose kernel is still compiling waits for it
(:func:`wait_for`). ``CP_OPS_PRECOMPILE=0`` turns it off; it never runs under
``TRITON_INTERPRET=1``, without CUDA, or for symbolic shapes.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
from collections.abc import Callable, Hashable

import torch
from torch.utils._python_dispatch import _disable_current_modes

from custom_ops import env

__all__ = ["clear", "cuda_index", "enabled", "meta_like", "schedule", "submit_compile", "wait_all", "wait_for"]

_log = logging.getLogger("cp_ops")


class _State(threading.local):
    device: int | None = None  # the CUDA device whose kernels this thread compiles instead of launching


# Module state, all of it caches or per-thread context: the thread's precompiling device (set
# and reset by a context manager), the worker pool made on first use, the keys already scheduled.
state = _State()
_lock = threading.Lock()
_pool: concurrent.futures.ThreadPoolExecutor | None = None
_scheduled: set = set()  # the keys passed to schedule()
_compiling: dict = {}  # (id(kernel), launch key) -> Future of its compile
_running: list = []  # the futures of every job and compile started, for wait_all()


def enabled() -> bool:
    """Whether :func:`schedule` runs: CUDA present, not interpreting, ``CP_OPS_PRECOMPILE`` not 0."""
    return env.precompile() and not env.triton_interpret() and torch.cuda.is_available()


def cuda_index(t: torch.Tensor) -> int | None:
    """The CUDA device a launch on ``t`` runs on: ``t``'s for a CUDA tensor, the precompiled
    device for a meta tensor in a thread that precompiles, else None (CPU, interpreter). What
    a launcher asks where its choices depend on the GPU, so that precompiling makes them alike."""
    if t.device.type == "cuda":
        return t.device.index if t.device.index is not None else torch.cuda.current_device()
    if t.device.type == "meta":
        return state.device
    return None


def _executor() -> concurrent.futures.ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="cp_ops-precompile"
            )  # fmt: skip
            # at exit, drop the compiles not started yet rather than wait for them (threading's
            # exit callbacks run last registered first, so before the executor joins its threads)
            register = getattr(threading, "_register_atexit", None)
            if register is not None:
                try:
                    register(_pool.shutdown, wait=False, cancel_futures=True)
                except RuntimeError:  # the interpreter is already shutting down
                    pass
        return _pool


def meta_like(t: torch.Tensor | None) -> torch.Tensor | None:
    """A meta tensor of ``t``'s shape, strides and dtype (None for None); raises TypeError for
    symbolic sizes."""
    if t is None:
        return None
    shape, stride = tuple(t.shape), t.stride()
    if not all(type(n) is int for n in shape + tuple(stride)):
        raise TypeError("symbolic sizes")
    # a plain meta tensor, not one of the fake (or tracing) mode the caller runs under
    with _disable_current_modes():
        return torch.empty_strided(shape, stride, dtype=t.dtype, device="meta")


def _on_device(device: int, fn: Callable[[], object]) -> None:
    torch.cuda.set_device(device)
    fn()


def _run_launchers(device: int, launchers: Callable[[], object], key: Hashable) -> None:
    state.device = device
    try:
        _on_device(device, launchers)
    except Exception:  # a launcher the meta tensors cannot drive: its kernels compile at launch
        _log.debug("cp_ops: precompiling %r failed; its kernels compile when launched", key, exc_info=True)
    finally:
        state.device = None


def schedule(name: str, launchers: Callable[..., object], *tensors: torch.Tensor | None, args: Hashable = ()) -> bool:
    """Run ``launchers(*metas)`` in a worker thread in compile-only mode, ``metas`` being
    :func:`meta_like` of ``tensors`` (an op's fake arguments; the first one on the CUDA device
    of the launches): the op's launchers called on them hand their kernels to be compiled.
    Once per op ``name``, shapes, strides and dtypes of ``tensors`` and other launch ``args``.
    Returns whether it was scheduled now (False: disabled, not CUDA, symbolic sizes, or seen
    before)."""
    index = cuda_index(tensors[0])
    if index is None or not enabled():
        return False
    try:
        metas = [meta_like(t) for t in tensors]
    except TypeError:  # symbolic sizes: nothing to predict
        return False
    key = (name, tuple(None if t is None else (m.shape, m.stride(), m.dtype) for t, m in zip(tensors, metas)), args)
    with _lock:
        if key in _scheduled:
            return False
        _scheduled.add(key)
    try:
        future = _executor().submit(_run_launchers, index, lambda: launchers(*metas), key)
    except RuntimeError:  # the interpreter is shutting down: nothing to compile for
        return False
    with _lock:
        _running[:] = [f for f in _running if not f.done()]
        _running.append(future)
    return True


def submit_compile(kernel, launch_key: Hashable, grid, args: tuple, kwargs: dict) -> None:
    """Compile ``kernel`` for these launch arguments in a worker (``launch_direct`` in
    compile-only mode), once per ``launch_key``."""
    device = state.device
    executor = _executor()
    with _lock:
        if (id(kernel), launch_key) in _compiling:
            return
        try:
            future = executor.submit(_on_device, device, lambda: kernel.warmup(*args, grid=grid, **kwargs))
        except RuntimeError:  # the interpreter is shutting down: the launch compiles, if it comes
            return
        _compiling[(id(kernel), launch_key)] = future
        _running.append(future)
    future.add_done_callback(lambda _: _forget_compile(kernel, launch_key, future))


def _forget_compile(kernel, launch_key: Hashable, future) -> None:
    """Once compiled, the kernel is in Triton's cache: launches need not wait for anything."""
    with _lock:
        if _compiling.get((id(kernel), launch_key)) is future:
            del _compiling[(id(kernel), launch_key)]


def wait_for(kernel, launch_key: Hashable) -> None:
    """Wait for a compile of ``kernel`` for ``launch_key`` that :func:`submit_compile` started,
    if any (a failed one is left to the launch, which compiles again)."""
    if not _compiling:
        return
    with _lock:
        future = _compiling.pop((id(kernel), launch_key), None)
    if future is not None:
        try:
            future.result()
        except Exception:
            _log.debug("cp_ops: precompiling %s failed; compiling at launch", kernel, exc_info=True)


def clear() -> None:
    """Forget the keys :func:`schedule` has seen, so that they are scheduled again (for tests
    and benchmarks that measure a first compile in one process)."""
    with _lock:
        _scheduled.clear()


def wait_all() -> None:
    """Wait until every scheduled job and the compiles it started have finished (their errors
    are left to the launches, as in :func:`wait_for`): for a warm-up that should end with the
    kernels compiled, and for tests."""
    while True:
        with _lock:
            futures = list(_running)
            _running.clear()
        if not futures:
            return
        concurrent.futures.wait(futures)
