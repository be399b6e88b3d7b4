"""Input factories, tolerances and hypothesis strategies shared by tests, benchmarks and notebooks.

Layout ops move bits and are compared exactly. Compute ops are compared by the
error-RMS / reference-RMS ratio (:func:`rel_error`) against a float64 reference,
with the bound for the working dtype in :data:`TOLERANCE`.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import torch

# rel_error bounds against a float64 reference, by the dtype the op computes in.
TOLERANCE = {
    torch.float64: 1e-10,
    torch.float32: 1e-5,
    torch.float16: 5e-3,
    torch.bfloat16: 1e-2,
}

# dtypes the layout ops are property-tested over (they move bits, so any dtype works)
LAYOUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64)


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in float64 (0 when both are zero; inf on NaN)."""
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    num = (out - ref).norm()
    den = ref.norm()
    return float(num / den) if den > 0 else float(num)


def random_tensor(shape, dtype: torch.dtype, device="cpu", generator: torch.Generator | None = None) -> torch.Tensor:
    """Fresh random data, never zeros: normal floats, or integers across the whole range."""
    if dtype.is_floating_point:
        return torch.randn(shape, dtype=torch.float32, device=device, generator=generator).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, device=device, generator=generator).bool()
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, dtype=dtype, device=device, generator=generator)


def random_seqlens(num_seqs: int, max_len: int, generator: torch.Generator | None = None) -> list[int]:
    """Random real lengths in [0, max_len], with zero- and one-length sequences likely."""
    lens = torch.randint(0, max_len + 1, (num_seqs,), generator=generator)
    special = torch.rand(num_seqs, generator=generator)
    lens = torch.where(special < 0.1, 0, torch.where(special < 0.2, 1, lens))
    return lens.tolist()


def thd_layouts(max_seqs: int = 6, max_len: int = 40, cp_sizes=(1, 2, 3, 4, 5, 8)):
    """Hypothesis strategy of ``(cp_size, seqlens)``: zero-length and length-1 sequences included."""
    from hypothesis import strategies as st

    lengths = st.one_of(st.just(0), st.just(1), st.integers(0, max_len))
    return st.tuples(st.sampled_from(cp_sizes), st.lists(lengths, min_size=1, max_size=max_seqs))


def trailing_shapes():
    """Hypothesis strategy of trailing shapes: none, 1-D, 2-D (heads x dim), including width 1."""
    from hypothesis import strategies as st

    return st.sampled_from([(), (1,), (3,), (2, 5), (4, 8), (1, 16)])


def _poisoned(t: torch.Tensor) -> torch.Tensor:
    if t.dtype.is_floating_point or t.dtype.is_complex:
        return t.fill_(float("nan"))
    if t.dtype == torch.bool:
        return t.fill_(True)
    return t.fill_(torch.iinfo(t.dtype).min + 7)


@contextlib.contextmanager
def poisoned_allocations():
    """Fill every ``torch.empty`` / ``empty_like`` / ``Tensor.new_empty`` allocation with NaN (or an
    odd integer) while active, so a kernel that leaves part of its output unwritten fails a
    comparison instead of passing on whatever the allocator handed back. Eager mode only."""
    empty, empty_like, new_empty = torch.empty, torch.empty_like, torch.Tensor.new_empty
    with (
        mock.patch.object(torch, "empty", lambda *a, **k: _poisoned(empty(*a, **k))),
        mock.patch.object(torch, "empty_like", lambda *a, **k: _poisoned(empty_like(*a, **k))),
        mock.patch.object(torch.Tensor, "new_empty", lambda self, *a, **k: _poisoned(new_empty(self, *a, **k))),
    ):
        yield


@contextlib.contextmanager
def first_autotune_config():
    """Make every ``triton.autotune`` take its first config without benchmarking, while active.

    Triton's interpreter has no benchmarker, so autotuned kernels of other libraries (FLA's)
    can only run under ``TRITON_INTERPRET=1`` this way. Numerics do not depend on the config.
    """
    from triton.runtime.autotuner import Autotuner

    prune = Autotuner.prune_configs
    with mock.patch.object(Autotuner, "prune_configs", lambda self, kwargs: prune(self, kwargs)[:1]):
        yield


def kernel_constexprs(kernel, constants: dict) -> dict:
    """A Triton kernel's constexpr arguments: ``constants`` without the launch options
    (``num_warps``, ``num_stages``), completed with the defaults of the constexprs it leaves
    out (as a launch would fill them in)."""
    out = {k: v for k, v in constants.items() if k not in ("num_warps", "num_stages")}
    for param in kernel.params:
        if param.is_constexpr and param.has_default:
            out.setdefault(param.name, param.default)
    return out


def gdn_layouts(max_seqs: int = 4, max_len: int = 12):
    """Hypothesis strategy of packed real lengths: zero-length and length-1 sequences likely."""
    from hypothesis import strategies as st

    lengths = st.one_of(st.just(0), st.just(1), st.integers(0, max_len))
    return st.lists(lengths, min_size=1, max_size=max_seqs)
