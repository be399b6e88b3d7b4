"""Input factories, tolerances and hypothesis strategies shared by tests, benchmarks and notebooks.

Layout ops move bits and are compared exactly (:func:`same_bits`); compute ops by the
error-RMS / reference-RMS ratio (:func:`rel_error`) against a float64 reference, within
:data:`TOLERANCE` for the working dtype. The strategies (:func:`thd_packings`,
:func:`thd_layouts`, :func:`layout_dtypes`, :func:`strided_views`, :func:`section_layouts`,
:func:`attention_masks`, :func:`gqa_heads`) draw what the ops' contracts allow; docs/testing.md
lists what each draws and has an example. hypothesis is imported only when a strategy is
built, so the rest of this module works without it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from unittest import mock

import torch

from custom_ops.runtime.words import dense

# rel_error bounds against a float64 reference, by the dtype the op computes in.
TOLERANCE = {
    torch.float64: 1e-10,
    torch.float32: 1e-5,
    torch.float16: 5e-3,
    torch.bfloat16: 1e-2,
}

# dtypes the layout ops are property-tested over (they move bits, so any dtype works)
LAYOUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64)

# The other dtypes the layout ops promise to move ("any dtype"): the row kernels move these as
# integer words of their element size (custom_ops.runtime.words.word_dtype), 16-byte ones as two words.
WORD_DTYPES = (
    torch.bool, torch.int8, torch.uint8, torch.int16, torch.int32,
    torch.float8_e4m3fn, torch.float8_e5m2, torch.complex64, torch.complex128,
)  # fmt: skip

# torch's unsigned dtypes past 8 bits, which few CPU ops implement (index_select of a 1-D
# tensor among those missing): drawn by layout_dtypes(unsigned=True) only
UNSIGNED_DTYPES = (torch.uint16, torch.uint32, torch.uint64)

# CP sizes the strategies draw by default: every size up to a node of 8 GPUs, odd ones included
CP_SIZES = (1, 2, 3, 4, 5, 6, 7, 8)

# dtypes an index tensor (cu_seqlens, offsets) may have
INDEX_DTYPES = (torch.int32, torch.int64)

# memory layouts :func:`as_memory_layout` gives a tensor (its values unchanged)
MEMORY_LAYOUTS = ("contiguous", "offset", "row_strided", "transposed", "last_dim_strided")

# the floating dtypes the compute ops take: each op's contract is checked at every one
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def rel_error(out: torch.Tensor, ref: torch.Tensor, chunk: int = 1 << 24) -> float:
    """``||out - ref|| / ||ref||`` in float64 (0 when both are zero; inf on NaN), summed over
    ``chunk`` elements at a time so that a tensor of many GiB needs no float64 copy of itself."""
    out, ref = out.detach(), ref.detach()
    if out.shape != ref.shape:
        out, ref = torch.broadcast_tensors(out, ref)
    out, ref = out.reshape(-1), ref.reshape(-1)
    num = den = 0.0
    for start in range(0, out.numel(), chunk):
        o, r = out[start : start + chunk].double(), ref[start : start + chunk].double()
        if not torch.isfinite(o).all():
            return float("inf")
        num += float((o - r).square().sum())
        den += float(r.square().sum())
    return (num / den) ** 0.5 if den > 0 else num**0.5


def random_tensor(shape, dtype: torch.dtype, device="cpu", generator: torch.Generator | None = None) -> torch.Tensor:
    """Fresh random data, never zeros: normal floats (complex: both parts), or integers across
    the whole range (unsigned 16-64 bit ones as random bytes)."""
    if dtype.is_floating_point:
        return torch.randn(shape, dtype=torch.float32, device=device, generator=generator).to(dtype)
    if dtype.is_complex:
        return torch.randn(shape, dtype=dtype, device=device, generator=generator)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, device=device, generator=generator).bool()
    if dtype in (torch.uint16, torch.uint32, torch.uint64):  # randint takes no bounds past int64
        shape = tuple(shape)
        size = torch.empty((), dtype=dtype).element_size()
        raw = torch.randint(0, 256, shape + (size,), dtype=torch.uint8, device=device, generator=generator)
        return raw.view(dtype).reshape(shape)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, dtype=dtype, device=device, generator=generator)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` have one shape and dtype and the same bytes, element by element
    (``torch.equal`` is not implemented for every dtype, float8 among them, and calls NaN != NaN)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False

    def as_bytes(t):  # dense: .contiguous() keeps the strides of empty and one-element tensors
        return dense(t).reshape(-1).view(torch.uint8)

    return torch.equal(as_bytes(a), as_bytes(b))


def as_memory_layout(t: torch.Tensor, layout: str, generator: torch.Generator | None = None) -> torch.Tensor:
    """A tensor with ``t``'s shape, dtype and values, stored as ``layout`` (one of
    :data:`MEMORY_LAYOUTS`) inside a larger buffer of random data: ``contiguous`` a copy;
    ``offset`` contiguous from one element into its storage (not 16-byte aligned);
    ``row_strided`` every other row of a buffer twice as long; ``transposed`` dim 0
    innermost in memory (a ``[..., T]`` buffer seen as ``[T, ...]``); ``last_dim_strided``
    every other element of the last dim. 1-D tensors get ``row_strided`` for the last two.
    Reading outside the view reads the random data around it. Raises ValueError for an
    unknown ``layout``.
    """
    if layout not in MEMORY_LAYOUTS:
        raise ValueError(f"layout must be one of {MEMORY_LAYOUTS}, got {layout!r}")
    if t.dim() == 0 or layout == "contiguous":
        return t.clone(memory_format=torch.contiguous_format)
    if t.dim() == 1 and layout in ("transposed", "last_dim_strided"):
        layout = "row_strided"
    shape = tuple(t.shape)
    if layout == "offset":
        flat = random_tensor((t.numel() + 1 + 7,), t.dtype, t.device, generator)
        view = flat[1 : 1 + t.numel()].view(shape)
    elif layout == "row_strided":
        view = random_tensor((2 * shape[0],) + shape[1:], t.dtype, t.device, generator)[::2]
    elif layout == "transposed":
        view = random_tensor(shape[1:] + (shape[0],), t.dtype, t.device, generator).movedim(-1, 0)
    else:
        view = random_tensor(shape[:-1] + (2 * shape[-1],), t.dtype, t.device, generator)[..., ::2]
    view.copy_(t)
    return view


def random_seqlens(num_seqs: int, max_len: int, generator: torch.Generator | None = None) -> list[int]:
    """Random real lengths in [0, max_len], with zero- and one-length sequences likely."""
    lens = torch.randint(0, max_len + 1, (num_seqs,), generator=generator)
    special = torch.rand(num_seqs, generator=generator)
    lens = torch.where(special < 0.1, 0, torch.where(special < 0.2, 1, lens))
    return lens.tolist()


def thd_layouts(max_seqs: int = 6, max_len: int = 40, cp_sizes=CP_SIZES, min_seqs: int = 1):
    """Hypothesis strategy of ``(cp_size, seqlens)``: zero-length and length-1 sequences likely,
    ``min_seqs = 0`` for batches with no sequence at all. Pad with ``cp_ops.pad_cu_seqlens``."""
    from hypothesis import strategies as st

    lengths = st.one_of(st.just(0), st.just(1), st.integers(0, max_len))
    return st.tuples(st.sampled_from(cp_sizes), st.lists(lengths, min_size=min_seqs, max_size=max_seqs))


@dataclasses.dataclass(frozen=True)
class ThdPacking:
    """A packed batch for W = ``cp_size`` ranks: real lengths and both cumulative index tensors
    (``cu_seqlens``, ``cu_seqlens_padded``, of one index dtype; each padded length the least
    multiple of 2W that holds the sequence)."""

    cp_size: int
    seqlens: tuple[int, ...]
    cu_seqlens: torch.Tensor
    cu_seqlens_padded: torch.Tensor

    @property
    def num_rows(self) -> int:
        """T, the rows of the global (sequence-order) tensor."""
        return int(self.cu_seqlens_padded[-1])

    @property
    def local_rows(self) -> int:
        """T/W, the rows of one rank's shard."""
        return self.num_rows // self.cp_size

    def __repr__(self) -> str:  # what a failing example prints: enough to rebuild it
        return f"ThdPacking(cp_size={self.cp_size}, seqlens={list(self.seqlens)}, index_dtype={self.cu_seqlens.dtype})"


def thd_packing(cp_size: int, seqlens, index_dtype: torch.dtype = torch.int32) -> ThdPacking:
    """The :class:`ThdPacking` of real lengths ``seqlens`` for ``cp_size`` ranks."""
    steps = [-(-int(n) // (2 * cp_size)) * 2 * cp_size for n in seqlens]
    cu = torch.tensor([0] + list(itertools.accumulate(int(n) for n in seqlens)), dtype=index_dtype)
    cup = torch.tensor([0] + list(itertools.accumulate(steps)), dtype=index_dtype)
    return ThdPacking(cp_size, tuple(int(n) for n in seqlens), cu, cup)


def thd_packings(max_seqs: int = 6, max_len: int = 40, cp_sizes=CP_SIZES, min_seqs: int = 0, index_dtypes=INDEX_DTYPES):
    """Hypothesis strategy of :class:`ThdPacking`: :func:`thd_layouts` (no sequences allowed by
    default) with index tensors of a drawn dtype (int32 or int64)."""
    from hypothesis import strategies as st

    layouts = thd_layouts(max_seqs, max_len, cp_sizes, min_seqs)
    return st.builds(lambda layout, dtype: thd_packing(*layout, dtype), layouts, st.sampled_from(index_dtypes))


def index_dtypes():
    """Hypothesis strategy of the dtypes of index tensors (int32, int64)."""
    from hypothesis import strategies as st

    return st.sampled_from(INDEX_DTYPES)


def layout_dtypes(words: bool = True, unsigned: bool = False):
    """Hypothesis strategy of element dtypes for the layout ops: :data:`LAYOUT_DTYPES`, with
    ``words`` the ones moved as integer words (:data:`WORD_DTYPES`: bool, float8, complex,
    int8-32, ...), with ``unsigned`` also :data:`UNSIGNED_DTYPES`. Compare results with
    :func:`same_bits`."""
    from hypothesis import strategies as st

    return st.sampled_from(LAYOUT_DTYPES + (WORD_DTYPES if words else ()) + (UNSIGNED_DTYPES if unsigned else ()))


def memory_layouts():
    """Hypothesis strategy of :data:`MEMORY_LAYOUTS` names (see :func:`as_memory_layout`)."""
    from hypothesis import strategies as st

    return st.sampled_from(MEMORY_LAYOUTS)


def strided_views(t: torch.Tensor):
    """Hypothesis strategy of tensors equal to ``t`` in every element but stored differently:
    contiguous, offset into their storage, row-strided, transposed or last-dim-strided views of
    a larger buffer of random data (:func:`as_memory_layout`)."""
    return memory_layouts().map(lambda layout: as_memory_layout(t, layout))


def trailing_shapes():
    """Hypothesis strategy of trailing shapes: none, 1-D, 2-D (heads x dim), including width 1."""
    from hypothesis import strategies as st

    return st.sampled_from([(), (1,), (3,), (2, 5), (4, 8), (1, 16)])


def _describe(t) -> str:
    if isinstance(t, torch.Tensor):
        return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"
    return repr(t)


def _metadata_differences(real: torch.Tensor, fake: torch.Tensor) -> list[str]:
    """How ``fake`` differs from ``real`` in what a traced graph takes from it: dtype, shape,
    device, and where it has elements its storage offset and the strides of its dims longer than
    1 (the others do not address memory)."""
    out = [f"{what} {f} from the fake, {r} from the op" for what, r, f in (
        ("dtype", real.dtype, fake.dtype), ("shape", list(real.shape), list(fake.shape)),
        ("device", real.device, fake.device)) if r != f]  # fmt: skip
    if out or real.numel() == 0:
        return out
    if real.storage_offset() != fake.storage_offset():
        out.append(f"storage offset {fake.storage_offset()} from the fake, {real.storage_offset()} from the op")
    if any(n > 1 and r != f for n, r, f in zip(real.shape, real.stride(), fake.stride())):
        out.append(f"strides {list(fake.stride())} from the fake, {list(real.stride())} from the op")
    return out


def check_fake(op, args: tuple, kwargs: dict | None = None) -> None:
    """Run ``op`` on ``args`` (on the tensors themselves: pass copies to an op that mutates its
    input) and its fake implementation on fake tensors of them (a ``FakeTensorMode``), then
    compare every output, the auxiliary ones included: ``AssertionError`` listing each one whose
    dtype, shape, device, storage offset or strides (:func:`_metadata_differences`) differ, or a
    different number of outputs. What ``torch.library.opcheck``'s fake check compares, without its
    tracing passes: cheap enough for every dtype and drawn layout."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils import _pytree as pytree

    kwargs = kwargs or {}
    with FakeTensorMode() as mode:
        fake_args, fake_kwargs = pytree.tree_map_only(torch.Tensor, mode.from_tensor, (args, kwargs))
        fake = op(*fake_args, **fake_kwargs)
    real = op(*args, **kwargs)
    real_outs, fake_outs = pytree.tree_leaves(real), pytree.tree_leaves(fake)
    problems = []
    if len(real_outs) != len(fake_outs):
        problems.append(f"{len(fake_outs)} outputs from the fake, {len(real_outs)} from the op")
    for i, (r, f) in enumerate(zip(real_outs, fake_outs)):
        if isinstance(r, torch.Tensor) != isinstance(f, torch.Tensor):
            problems.append(f"output {i}: {_describe(f)} from the fake, {_describe(r)} from the op")
        elif isinstance(r, torch.Tensor):
            problems += [f"output {i}: {d}" for d in _metadata_differences(r, f)]
    if problems:
        inputs = ", ".join(_describe(a) for a in args) + "".join(f", {k}={_describe(v)}" for k, v in kwargs.items())
        raise AssertionError(f"{op} on ({inputs}): the fake disagrees with the op\n  " + "\n  ".join(problems))


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


def section_layouts(cp_sizes=CP_SIZES, max_sections: int = 6, max_multiple: int = 5):
    """Hypothesis strategy of ``(cp_size, sections, leading shape)`` for the section ops:
    widths ``m * cp_size`` with ``0 <= m <= max_multiple`` (zero-width and unequal sections
    included), leading shapes with no, one, seven or zero rows."""
    from hypothesis import strategies as st

    @st.composite
    def cases(draw):
        cp_size = draw(st.sampled_from(cp_sizes))
        multiples = draw(
            st.lists(st.one_of(st.just(0), st.integers(1, max_multiple)), min_size=1, max_size=max_sections)
        )
        lead = draw(st.sampled_from([(), (1,), (7,), (3, 2), (0,)]))
        return cp_size, [m * cp_size for m in multiples], lead

    return cases()


def gqa_heads(max_kv_heads: int = 3, max_group: int = 3):
    """Hypothesis strategy of ``(Hq, Hkv)`` with ``Hq = G * Hkv``: multi-head (G = 1),
    grouped-query and multi-query (Hkv = 1) attention."""
    from hypothesis import strategies as st

    return st.builds(
        lambda hkv, group: (hkv * group, hkv), st.integers(1, max_kv_heads), st.integers(1, max_group)
    )


def attention_masks(max_window: int = 8):
    """Hypothesis strategy of ``(causal, (left, right))``: causal or not, each window bound
    unbounded (-1) or ``0..max_window`` (0: the query's own position only)."""
    from hypothesis import strategies as st

    bound = st.one_of(st.just(-1), st.integers(0, max_window))
    return st.tuples(st.booleans(), st.tuples(bound, bound))


def gdn_layouts(max_seqs: int = 4, max_len: int = 12):
    """Hypothesis strategy of packed real lengths: zero-length and length-1 sequences likely."""
    from hypothesis import strategies as st

    lengths = st.one_of(st.just(0), st.just(1), st.integers(0, max_len))
    return st.lists(lengths, min_size=1, max_size=max_seqs)
