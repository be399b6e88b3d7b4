"""Launch settings of the segment-attention kernels (docs/design.md section 5).

The tuned launch configurations (tiles, warps, stages and the kernels' own constexprs) are
read-only tables here, and :func:`kernel_config` is the one lookup that picks a kernel's
configuration. The launch choices (TMA loads or not, the launch order, the window's mask
terms, a configuration in place of the tables') are an :class:`AttentionSettings`, which the
launchers of :mod:`custom_ops.segment_attention.launch` take as an argument; the ops launch
with :data:`ATTENTION_SETTINGS`. Benchmarks and tests build other settings with
:meth:`AttentionSettings.with_kernel` / :meth:`AttentionSettings.with_every_kernel` or
``dataclasses.replace`` and pass them to the launchers.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any, Mapping

# The three attention kernels, by the names the tables and settings use.
KERNELS = ("fwd", "bwd_dq", "bwd_dkdv")


def _frozen(table: dict) -> Mapping:
    """``table`` with every nested dict made a read-only mapping."""
    return MappingProxyType({key: _frozen(value) if isinstance(value, dict) else value for key, value in table.items()})


# Pointer loads, 2-byte elements. Per kernel: {largest BLOCK_D served: config}; the first entry
# whose key is >= BLOCK_D is used (past the largest, the largest). Each entry is the best of
# `python -m benchmarks.bench_attention tune` (D = 256 with --gqa 8 --head-dims 256, Qwen3-Next's
# attention heads; docs/benchmarks.md, section "Segment attention"). K_ROWS picks how the forward
# loads K tiles; PARTS = 2 computes dk and dv of a key tile in two programs (see
# varlen_attn_bwd_dkdv_kernel).
CONFIGS = _frozen({
    "fwd": {
        64: dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3, K_ROWS=False),
        128: dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3, K_ROWS=True),
        256: dict(BLOCK_M=128, BLOCK_N=32, num_warps=8, num_stages=3, K_ROWS=True),
    },
    "bwd_dkdv": {
        64: dict(BLOCK_M=32, BLOCK_N=128, num_warps=4, num_stages=3),
        128: dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2),
        256: dict(BLOCK_M=32, BLOCK_N=128, num_warps=8, num_stages=2, PARTS=2),
    },
    "bwd_dq": {
        64: dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
        128: dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=4),
        256: dict(BLOCK_M=128, BLOCK_N=32, num_warps=8, num_stages=2),
    },
})  # fmt: skip

# The same kernels loading their streamed tiles (K and V in the forward and dq, q and dout in
# dk/dv) through TMA tensor descriptors (Hopper and later, 2-byte elements, D a power of two,
# heads adjacent in memory; see ``tma_usable`` in launch.py). A kernel and head dim without an
# entry here uses the pointer loads and CONFIGS. The entries are the best of a sweep of tile
# shapes (forward) and of --tune --kinds bwd_dq bwd_dkdv (backward) under the HEAD_GROUP launch
# order; D = 256 has no backward entry because its backward is slower with TMA loads than with
# the pointer loads (docs/benchmarks.md's history, sections "TMA loads", "Launch order, and TMA loads in
# the D = 256 forward" and "The backward's tiles re-tuned").
TMA_CONFIGS = _frozen({
    "fwd": {
        64: dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
        128: dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3),
        256: dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2),
    },
    "bwd_dkdv": {
        64: dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
        128: dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2),
    },
    "bwd_dq": {
        64: dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
        128: dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=4),
    },
})  # fmt: skip

# float32 inputs: the tables above are tuned for 2-byte elements, and at 4 bytes their tiles
# need more shared memory than a Hopper SM has (the D = 128 forward asks more than its 227 KiB).
# Smaller tiles and fewer stages, each kernel within about 160 KiB: q/k/v tiles plus num_stages
# copies of the streamed ones.
WIDE_CONFIGS = _frozen({
    "fwd": {
        128: dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2, K_ROWS=False),
        256: dict(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=1, K_ROWS=False),
    },
    "bwd_dkdv": {
        64: dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=1),
        128: dict(BLOCK_M=32, BLOCK_N=64, num_warps=4, num_stages=1),
        256: dict(BLOCK_M=16, BLOCK_N=32, num_warps=8, num_stages=1),
    },
    "bwd_dq": {
        128: dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2),
        256: dict(BLOCK_M=32, BLOCK_N=32, num_warps=8, num_stages=1),
    },
})  # fmt: skip

# Under TRITON_INTERPRET=1 the kernels run in numpy: small tiles keep CPU tests fast and still
# give several tiles (and all three loop phases) per segment. One config per kernel.
INTERPRET_CONFIGS = _frozen({
    "fwd": dict(BLOCK_M=16, BLOCK_N=16, num_warps=1, num_stages=1, K_ROWS=True),
    "bwd_dkdv": dict(BLOCK_M=16, BLOCK_N=16, num_warps=1, num_stages=1),
    "bwd_dq": dict(BLOCK_M=16, BLOCK_N=16, num_warps=1, num_stages=1),
})  # fmt: skip

# Segments, and tiles, handled per step of the segment-table kernel's loops (any count is
# served by looping, so the kernel is compiled once whatever the packing), a power of two, and
# the kernel's warps. Its sort and scans grow with BLOCK, and so does its compile time, which
# a cold first step waits for (docs/benchmarks.md's history, section "Cold start: kernels compiled while
# the graph is traced").
TABLE_BLOCK = 256
TABLE_WARPS = 8

# Query rows per program of the backward's delta pass and its warps: a streaming row reduction.
DELTA_BLOCK = 64
DELTA_WARPS = 4

# Segments and key tiles per program of key_tile_segments_kernel (its comparisons are BLOCK x BLOCK).
KEY_TILE_BLOCK = 64

# Launch-order buckets of the segments' work (see segment_tables_kernel): eight per doubling of
# the key-tile count of a segment's last query tile, the last one holding every segment of
# 2**15 key tiles and more.
WORK_BUCKETS = 128


def _lookup(table: Mapping, block_d: int) -> dict | None:
    """The first entry of ``table`` whose key is >= block_d, as a new dict (None past the largest)."""
    for bound in sorted(table):
        if block_d <= bound:
            return dict(table[bound])
    return None


def has_tma_config(kernel: str, block_d: int) -> bool:
    """Whether TMA_CONFIGS serves ``kernel`` at head-dim tile ``block_d``."""
    return _lookup(TMA_CONFIGS[kernel], block_d) is not None


def kernel_config(
    kernel: str, block_d: int, interpreting: bool, element_size: int = 2, tma: bool = False,
    override: Mapping[str, Any] | None = None,
) -> dict:  # fmt: skip
    """The launch config of ``kernel`` for head-dim tile ``block_d``, q/k/v elements of
    ``element_size`` bytes, and TMA loads or not (the config then carries ``TMA=True``, under
    which the forward ignores ``K_ROWS``; the caller checks :func:`has_tma_config` first).
    ``override`` (a :class:`KernelSettings`' ``config``) replaces the tables' entry. A new dict."""
    if override is not None:
        cfg = dict(override)
    elif interpreting:
        cfg = dict(INTERPRET_CONFIGS[kernel])
    elif tma:
        cfg = _lookup(TMA_CONFIGS[kernel], block_d)
    else:
        table = (CONFIGS if element_size <= 2 else WIDE_CONFIGS)[kernel]
        cfg = _lookup(table, block_d) or dict(table[max(table)])
    if tma:
        cfg["TMA"] = True
    return cfg


@dataclass(frozen=True)
class KernelSettings:
    """The launch choices of one attention kernel.

    ``head_group``: how many kv heads run their programs for one tile side by side (their
    query heads in the forward and dq, their PARTS in dk/dv); the launcher takes the largest
    count dividing both this and the kv heads (see ``_program_tile``). ``by_work`` (forward and
    dq): the segments run heaviest first, else last to first; each segment's tiles last to first
    either way (see ``segment_tables_kernel``). ``config``: a launch config used in place of the
    tables' entry (the one :func:`kernel_config` would pick, TMA or pointer loads alike, the
    interpreter's included), e.g. a candidate timed by a tuner or the small tiles of a test.
    """

    head_group: int
    by_work: bool = False
    config: Mapping[str, Any] | None = None

    def __post_init__(self):
        if self.config is not None:  # a private read-only copy: the caller's dict may change
            object.__setattr__(self, "config", MappingProxyType(dict(self.config)))


@dataclass(frozen=True)
class AttentionSettings:
    """The launch choices of a forward or backward launch (docs/design.md section 5).

    ``tma``: load the streamed tiles through TMA descriptors where ``tma_usable`` holds (off:
    pointer loads everywhere). ``window_terms_always``: compile the window's terms into the
    elementwise mask of every launch, not only of those with a window (the same results, more
    work per masked entry). ``fwd``, ``bwd_dq``, ``bwd_dkdv``: each kernel's
    :class:`KernelSettings`.

    The defaults are the tuned launch order (docs/design.md section 5, "Where the tuned
    settings live").
    """

    tma: bool = True
    window_terms_always: bool = False
    fwd: KernelSettings = KernelSettings(head_group=1, by_work=True)
    bwd_dq: KernelSettings = KernelSettings(head_group=2, by_work=True)
    bwd_dkdv: KernelSettings = KernelSettings(head_group=16)

    def kernel(self, name: str) -> KernelSettings:
        """The :class:`KernelSettings` of kernel ``name`` (one of :data:`KERNELS`)."""
        if name not in KERNELS:
            raise ValueError(f"unknown kernel {name!r}; the kernels are {KERNELS}")
        return getattr(self, name)

    def with_kernel(self, name: str, **changes) -> AttentionSettings:
        """These settings with kernel ``name``'s fields replaced, e.g.
        ``with_kernel("fwd", config=dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3))``."""
        return replace(self, **{name: replace(self.kernel(name), **changes)})

    def with_every_kernel(self, **changes) -> AttentionSettings:
        """These settings with the same fields replaced in every kernel's settings, e.g.
        ``with_every_kernel(head_group=1)`` or ``with_every_kernel(by_work=False)``."""
        return replace(self, **{name: replace(self.kernel(name), **changes) for name in KERNELS})


# The settings every op passes to the launchers; nothing assigns it, other settings are new instances.
ATTENTION_SETTINGS = AttentionSettings()
