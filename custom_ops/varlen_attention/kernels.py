"""Triton kernels for segment attention: flash-attention forward and the FA2 backward split.

Notation (see reference.py): segment s has query rows ``q_start + a`` at positions
``pos(a) = q_pos + a`` (``0 <= a < q_len``) and key rows ``k_start + b``
(``0 <= b < k_len``). Scores are kept in base 2: ``x = s * log2(e)``, so
``exp(s - lse) = exp2(x - lse * log2(e))``.

The forward and dq cut each segment's queries into tiles of BLOCK_M rows; a
small kernel launched before them (:func:`segment_tables_kernel`) computes, on the
device, a table of every query tile's segment and place in it, in launch order
(heaviest segments first), so grids depend on shapes only. A binary-search loop in the attention
kernels themselves stops Triton's software pipeliner from pipelining the key
loops that follow it (no async copies in the TTGIR, checked for sm_90 with
triton 3.7), which costs the forward most of its speed. dk/dv runs one program per
BLOCK_N-row tile of the key tensor (two, one for dk and one for dv, at D = 256), over the
segments whose key ranges reach it (a slice of the segments sorted by key
start, also built on the device).

For each tile the visible range of the other side is computed from the mask
bounds; tiles entirely inside the mask run without the elementwise mask, only the
boundary tiles apply it (with the window's terms only in launches that have a window,
``WINDOW``). Grids are 1-D with the heads of one tile adjacent
(:func:`_program_tile`); the forward and dq run the segments heaviest first and each
segment's tiles last to first (:func:`segment_tables_kernel`), so a launch ends on short tiles.

With ``TMA`` (Hopper, see TMA_CONFIGS) the streamed tiles come from host tensor descriptors
instead of pointer loads (:func:`_load_rows`); everything else is the same code.
"""

import triton
import triton.language as tl


# Launch configurations, one table so they can be tuned on the GPU (the benchmark
# overwrites entries). Per kernel: {largest BLOCK_D served: config}; the first
# entry whose key is >= BLOCK_D is used.
CONFIGS = {
    # Each entry is the best of benchmarks/bench_varlen_attention.py --tune (D = 256 with --gqa 8
    # --head-dims 256, Qwen3-Next's attention heads; docs/benchmarks.md, section "Segment
    # attention"). K_ROWS picks how the forward loads K tiles; PARTS = 2 computes dk and dv
    # of a key tile in two programs (varlen_attn_bwd_dkdv_kernel).
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
}

# The same kernels loading their streamed tiles (K and V in the forward and dq, q and dout in
# dk/dv) through TMA tensor descriptors (Hopper and later, 2-byte elements, D a power of two,
# heads adjacent in memory; see ``tma_usable`` in op.py). Head dims without an entry here use
# the pointer loads and CONFIGS. The entries are the best of a sweep of tile shapes (forward) and of
# benchmarks/bench_varlen_attention.py --tune --kinds bwd_dq bwd_dkdv (backward) under the
# HEAD_GROUP launch order; D = 256 has no backward entry because its backward is slower with TMA
# loads than with the pointer loads (docs/benchmarks.md, sections "TMA loads", "Launch order, and
# TMA loads in the D = 256 forward" and "The backward's tiles re-tuned").
# ``TMA_ENABLED = False`` makes every launch use the pointer loads (benchmarks time both forms).
TMA_ENABLED = True
# Per kernel: whether the forward and dq run the segments heaviest first (True) or last to
# first (False); each segment's tiles last to first either way
# (:func:`segment_tables_kernel`; benchmarks time both orders).
SEGMENTS_BY_WORK = {"fwd": True, "bwd_dq": True}
TMA_CONFIGS = {
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
}

# float32 inputs: the tables above are tuned for 2-byte elements, and at 4 bytes their
# tiles need more shared memory than a Hopper SM has (the D = 128 forward asks for 256 KiB
# of 227). Smaller tiles and fewer stages, each kernel within about 160 KiB: q/k/v tiles
# plus num_stages copies of the streamed ones.
WIDE_CONFIGS = {
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
}

# Under TRITON_INTERPRET=1 the kernels run in numpy: small tiles keep CPU tests
# fast and still give several tiles (and all three loop phases) per segment.
INTERPRET_CONFIGS = {
    "fwd": dict(BLOCK_M=16, BLOCK_N=16, num_warps=1, num_stages=1, K_ROWS=True),
    "bwd_dkdv": dict(BLOCK_M=16, BLOCK_N=16, num_warps=1, num_stages=1),
    "bwd_dq": dict(BLOCK_M=16, BLOCK_N=16, num_warps=1, num_stages=1),
}

# Launch order (:func:`_program_tile`): per kernel, how many kv heads run their programs for
# one tile side by side (the query heads of each in the forward and dq; its PARTS in dk/dv);
# the largest count dividing both the entry and the kv heads. Heads side by side keep a launch
# from ending on one head's long tiles, and groups stop at 16 kv heads because past that the
# programs running together read ever more K/V; the forward keeps one kv head's query heads
# together (they read the same K/V) since larger groups did not gain, and dq runs groups of 2
# since the segments run heaviest first (SEGMENTS_BY_WORK) (docs/benchmarks.md, sections
# "Launch order, and TMA loads in the D = 256 forward" and "Segments heaviest first").
HEAD_GROUP = {"fwd": 1, "bwd_dq": 2, "bwd_dkdv": 16}


def _lookup(table: dict, block_d: int) -> dict | None:
    """The first entry of ``table`` whose key is >= block_d (None past the largest)."""
    for bound in sorted(table):
        if block_d <= bound:
            return dict(table[bound])
    return None


def has_tma_config(kernel: str, block_d: int) -> bool:
    """Whether TMA_CONFIGS serves ``kernel`` at head-dim tile ``block_d``."""
    return _lookup(TMA_CONFIGS[kernel], block_d) is not None


def kernel_config(kernel: str, block_d: int, interpreting: bool, element_size: int = 2, tma: bool = False) -> dict:
    """The launch config of ``kernel`` for head-dim tile ``block_d``, q/k/v elements of
    ``element_size`` bytes, and TMA loads or not (the config then carries ``TMA=True``, under
    which the forward ignores ``K_ROWS``; the caller checks :func:`has_tma_config` first)."""
    if interpreting:
        cfg = dict(INTERPRET_CONFIGS[kernel])
    elif tma:
        cfg = _lookup(TMA_CONFIGS[kernel], block_d)
    else:
        table = (CONFIGS if element_size <= 2 else WIDE_CONFIGS)[kernel]
        cfg = _lookup(table, block_d) or dict(table[max(table)])
    if tma:
        cfg["TMA"] = True
    return cfg


# Segments, and tiles, handled per step of the segment-table kernel's loops (any count is
# served by looping, so the kernel is compiled once whatever the packing); a power of two.
TABLE_BLOCK = 1024
# Launch-order buckets of the segments' work (:func:`segment_tables_kernel`): eight per
# doubling of the key-tile count of a segment's last query tile, the last one holding every
# segment of 2**15 key tiles and more.
WORK_BUCKETS = 128


@triton.jit
def _maximum(a, b):
    return tl.maximum(a, b)


@triton.jit(do_not_specialize=["n_seg", "num_q_rows", "num_k_rows", "num_tiles", "left", "right"])
def segment_tables_kernel(
    q_start_ptr,
    q_len_ptr,
    q_pos_ptr,
    k_start_ptr,
    k_len_ptr,
    tab_ptr,  # [5, n_seg] int32: q_start, q_len, q_pos, k_start, k_len, clamped into the tensors
    cum_ptr,  # [n_seg] int32 scratch: inclusive cumulative count of TILE-row query tiles per segment
    tiles_ptr,  # [5, num_tiles] int32: rows 0 and 1 the launch order, rows 2 to 4 scratch
    n_seg,
    num_q_rows,
    num_k_rows,
    num_tiles,
    left,
    right,
    CAUSAL: tl.constexpr,
    TILE: tl.constexpr,
    KEY_TILE: tl.constexpr,
    BY_WORK: tl.constexpr,
    BLOCK: tl.constexpr,
    BUCKETS: tl.constexpr,
):
    """Every table a forward or dq launch needs, in one program: the clamped segment tables,
    and for each of the grid's ``num_tiles`` query tiles, in the order the grid runs them,
    its segment (row 0 of ``tiles``; ``n_seg`` for a tile past the last segment's) and its
    index within the segment (row 1).

    Starts and lengths are clamped so that an invalid layout gives wrong rows but never
    an out-of-bounds access: ``start`` into ``[0, rows]``, ``len`` into
    ``[0, rows - start]``. Index tensors may be int32 or int64.

    Launch order. Programs start in launch order as SMs free up, so a long tile started
    near the end of the launch keeps its SM busy while the others idle; and the programs
    running together share the L2, where tiles of one segment read the same K/V rows.
    Without ``BY_WORK`` the segments run last to first, each segment's tiles last to first
    (the whole table reversed; under a causal mask a segment's last tile is its longest).
    With ``BY_WORK`` the segments run heaviest first, each one's tiles last to first: a
    stable counting sort of the tiles on a bucket of their segment's work w, the number of
    ``KEY_TILE``-row tiles of keys that the segment's last query tile sees
    (:func:`_key_range`; under a causal mask the segment's longest tile), ``8 * floor(log2(w
    + 1))`` plus the three bits after the leading one, so eight buckets per doubling and
    segments whose work differs by less than an eighth keep their order. The launch then
    ends on the short documents, and a segment's tiles still run side by side. (Sorting
    the tiles themselves, longest first, mixes the tiles of many segments among the programs
    running together and is slower; docs/benchmarks.md, section "Segments heaviest first".) Tiles past the
    last segment's come last.
    """
    # row 0 first holds, at tile t, one more than the last segment whose cum entry is t (its
    # tiles and those of every segment before it end before t), so that the running maximum
    # over the tiles up to t is the number of cum entries <= t: the segment of tile t
    for c in range(0, num_tiles, BLOCK):
        t = c + tl.arange(0, BLOCK)
        tl.store(tiles_ptr + t, tl.zeros([BLOCK], dtype=tl.int32), mask=t < num_tiles)
    tl.debug_barrier()
    carry = tl.full([], 0, tl.int32)
    for c in range(0, n_seg, BLOCK):
        i = c + tl.arange(0, BLOCK)
        m = i < n_seg
        qs = tl.minimum(tl.maximum(tl.load(q_start_ptr + i, mask=m, other=0).to(tl.int64), 0), num_q_rows)
        ql = tl.minimum(tl.maximum(tl.load(q_len_ptr + i, mask=m, other=0).to(tl.int64), 0), num_q_rows - qs)
        ks = tl.minimum(tl.maximum(tl.load(k_start_ptr + i, mask=m, other=0).to(tl.int64), 0), num_k_rows)
        kl = tl.minimum(tl.maximum(tl.load(k_len_ptr + i, mask=m, other=0).to(tl.int64), 0), num_k_rows - ks)
        qp = tl.load(q_pos_ptr + i, mask=m, other=0)
        tl.store(tab_ptr + i, qs.to(tl.int32), mask=m)
        tl.store(tab_ptr + n_seg + i, ql.to(tl.int32), mask=m)
        tl.store(tab_ptr + 2 * n_seg + i, qp.to(tl.int32), mask=m)
        tl.store(tab_ptr + 3 * n_seg + i, ks.to(tl.int32), mask=m)
        tl.store(tab_ptr + 4 * n_seg + i, kl.to(tl.int32), mask=m)
        tiles = ((ql + TILE - 1) // TILE).to(tl.int32)  # 0 past n_seg (ql = 0 there)
        cum = tl.cumsum(tiles, 0) + carry
        tl.store(cum_ptr + i, cum, mask=m)
        # the tile after segment i's last is the first of segment i + 1 (or of a later one,
        # past segments without tiles: the largest i with that cum wins)
        tl.atomic_max(tiles_ptr + cum, i + 1, mask=m & (cum < num_tiles))
        carry += tl.sum(tiles, 0)
    num_live = tl.minimum(carry, num_tiles)  # the tiles that belong to a segment: 0 .. num_live - 1
    # the loops below read cum and the scratch rows back: the program's stores first
    tl.debug_barrier()

    # every tile's segment and index within it (BY_WORK: last to first, and the rank of its
    # segment's work bucket, heaviest 0, and the tiles per rank) in scratch rows 2-4
    count = tl.zeros([BUCKETS], dtype=tl.int32)
    seg_before = tl.full([], 0, tl.int32)
    for c in range(0, num_tiles, BLOCK):
        t = c + tl.arange(0, BLOCK)
        m = t < num_tiles
        # the segment of tile t (n_seg past the last segment's tiles)
        ends = tl.load(tiles_ptr + t, mask=m, other=0, cache_modifier=".cg")  # from L2, where the atomics went
        s = tl.maximum(tl.associative_scan(ends, 0, _maximum), seg_before)
        seg_before = tl.max(s, 0)
        live = m & (s < n_seg)
        seg_first = tl.load(cum_ptr + s - 1, mask=live & (s > 0), other=0)  # the segment's first tile
        j = t - seg_first
        if BY_WORK:
            last = tl.load(cum_ptr + s, mask=live, other=0) - 1  # the segment's last tile
            j = last - t  # the segment's tiles last to first
            ql = tl.load(tab_ptr + n_seg + s, mask=live, other=0)
            qp = tl.load(tab_ptr + 2 * n_seg + s, mask=live, other=0)
            kl = tl.load(tab_ptr + 4 * n_seg + s, mask=live, other=0)
            pos_lo = qp + (last - seg_first) * TILE
            pos_hi = qp + ql - 1
            lo, _, _, hi = _key_range(pos_lo, pos_hi, kl, left, right, CAUSAL, KEY_TILE)
            work = (hi - lo + KEY_TILE - 1) // KEY_TILE
            # 8 * floor(log2(work + 1)) + the 3 bits after the leading one: exponent and top
            # mantissa bits of the float (exact below 2**24)
            bits = (work + 1).to(tl.float32).to(tl.int32, bitcast=True)
            bucket = tl.minimum(((bits >> 23) - 127) * 8 + ((bits >> 20) & 7), BUCKETS - 1)
            rank = tl.where(live, BUCKETS - 1 - bucket, BUCKETS - 1)
            tl.store(tiles_ptr + 4 * num_tiles + t, rank, mask=m)
            count += tl.histogram(rank, BUCKETS, mask=m)
        tl.store(tiles_ptr + 2 * num_tiles + t, s, mask=m)
        tl.store(tiles_ptr + 3 * num_tiles + t, j, mask=m)
    tl.debug_barrier()

    # BY_WORK: a stable counting sort by rank: a tile's place is the tiles of lower ranks, plus
    # those of its rank in earlier blocks, plus those before it in its block (a sort of the
    # block). Otherwise the live tiles reversed.
    first = tl.cumsum(count, 0) - count  # per rank: its first place
    lane = tl.arange(0, BLOCK)
    for c in range(0, num_tiles, BLOCK):
        t = c + lane
        m = t < num_tiles
        s = tl.load(tiles_ptr + 2 * num_tiles + t, mask=m, other=0)
        j = tl.load(tiles_ptr + 3 * num_tiles + t, mask=m, other=0)
        if BY_WORK:
            rank = tl.load(tiles_ptr + 4 * num_tiles + t, mask=m, other=BUCKETS)  # lanes past the end last
            key = tl.sort(rank * BLOCK + lane)
            sorted_rank = key // BLOCK
            sorted_lane = key % BLOCK
            in_block = tl.histogram(rank, BUCKETS, mask=m)
            # place of the i-th tile of the sorted block: first[r] + i - (tiles of lower ranks in the block)
            shift = first - (tl.cumsum(in_block, 0) - in_block)
            place = lane + tl.gather(shift, tl.minimum(sorted_rank, BUCKETS - 1), 0)
            ok = sorted_rank < BUCKETS
            tl.store(tiles_ptr + place, tl.gather(s, sorted_lane, 0), mask=ok)
            tl.store(tiles_ptr + num_tiles + place, tl.gather(j, sorted_lane, 0), mask=ok)
            first += in_block
        else:
            place = tl.where(t < num_live, num_live - 1 - t, t)
            tl.store(tiles_ptr + place, s, mask=m)
            tl.store(tiles_ptr + num_tiles + place, j, mask=m)


@triton.jit
def _program_tile(num_parts, HEAD_GROUP: tl.constexpr):
    """``(tile, part)`` of this program in a 1-D grid of ``num_tiles * num_parts`` programs
    (parts: the heads, or kv heads x PARTS in dk/dv). Launch order: the parts in groups of
    HEAD_GROUP (which divides num_parts), every tile of one group before the next group,
    and within a group the HEAD_GROUP parts of one tile adjacent. HEAD_GROUP = 1 runs each
    part's tiles in one stretch; HEAD_GROUP = num_parts runs all parts of a tile together.

    Programs start in launch order as SMs free up, so the order decides two things: what
    is left running at the end of the launch, and which K/V rows the programs running
    together read. Parts of one tile have the same work; with the parts one at a time,
    the last part's whole sequence of tiles, short and long, is what the launch ends on,
    and a long tile started near the end leaves the other SMs idle while it finishes.
    All parts of a tile together, the programs running at once read the K/V of every
    head, more than the L2 cache holds. HEAD_GROUP sits between the two (see HEAD_GROUP
    at the top of this module)."""
    pid = tl.program_id(0)
    num_tiles = tl.num_programs(0) // num_parts
    per_group = num_tiles * HEAD_GROUP
    group = pid // per_group
    r = pid % per_group
    return r // HEAD_GROUP, group * HEAD_GROUP + r % HEAD_GROUP


@triton.jit
def _query_tile(tile_seg_ptr, tile_row_ptr, num_heads, HEAD_GROUP: tl.constexpr):
    """``(s, j, head)`` of a forward or dq program: query tile j of segment s, in the launch
    order of the tile table (:func:`segment_tables_kernel`), the heads
    as :func:`_program_tile` orders them. Two loads and no loop, so the loops after it
    pipeline."""
    tile, h = _program_tile(num_heads, HEAD_GROUP)
    return tl.load(tile_seg_ptr + tile), tl.load(tile_row_ptr + tile), h


@triton.jit
def _key_range(pos_lo, pos_hi, k_len, left, right, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr):
    """Key loop phases for the query positions [pos_lo, pos_hi].

    Keys outside [lo, hi) are invisible to every query of the tile; key tiles in
    [mid_lo, mid_hi) are visible to every query (no elementwise mask). Returns
    (lo, mid_lo, mid_hi, hi) with mid_lo - lo and mid_hi - mid_lo multiples of BLOCK_N.
    """
    hi = k_len
    full_hi = k_len
    if CAUSAL:
        hi = tl.minimum(hi, pos_hi + 1)
        full_hi = tl.minimum(full_hi, pos_lo + 1)
    hi = tl.where(right >= 0, tl.minimum(hi, pos_hi + right + 1), hi)
    full_hi = tl.where(right >= 0, tl.minimum(full_hi, pos_lo + right + 1), full_hi)
    lo = tl.where(left >= 0, tl.maximum(pos_lo - left, 0), 0)
    full_lo = tl.where(left >= 0, tl.maximum(pos_hi - left, 0), 0)
    hi = tl.maximum(hi, lo)
    # round the unmasked range inwards onto the tile grid that starts at lo
    mid_lo = tl.minimum(lo + tl.cdiv(tl.maximum(full_lo - lo, 0), BLOCK_N) * BLOCK_N, hi)
    mid_hi = mid_lo + (tl.maximum(full_hi - mid_lo, 0) // BLOCK_N) * BLOCK_N
    return lo, mid_lo, mid_hi, hi


@triton.jit
def _visible(pos, b, k_len, left, right, CAUSAL: tl.constexpr, WINDOW: tl.constexpr):
    """Elementwise mask for query positions ``pos`` [M, 1] and key positions ``b`` [1, N].

    The window's terms only where WINDOW (the launch has left >= 0 or right >= 0): for a
    causal or full mask they are per-entry work with a known result."""
    vis = (b < k_len) & (b >= 0)
    if CAUSAL:
        vis = vis & (b <= pos)
    if WINDOW:
        vis = vis & ((left < 0) | (pos - b <= left))
        vis = vis & ((right < 0) | (b - pos <= right))
    return vis


@triton.jit
def _fwd_inner(
    acc,
    l_i,
    m_i,
    q,
    k_base,
    v_base,
    stride_kt,
    stride_vt,
    desc_k,
    desc_v,
    k_start,
    col,
    pos,
    offs_d,
    k_len,
    left,
    right,
    qk_scale,
    start,
    stop,
    MASK: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
    EVEN_D: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    K_ROWS: tl.constexpr,
    TMA: tl.constexpr,
):
    offs_n = tl.arange(0, BLOCK_N)
    for n in range(start, stop, BLOCK_N):
        b = n + offs_n
        if K_ROWS or TMA:
            # K tile as stored ([N, D], D contiguous); the dot takes its transpose
            k, v = _load_rows(k_base, v_base, stride_kt, stride_vt, b.to(tl.int64), b < k_len, offs_d, desc_k, desc_v,
                              k_start + n, col, MASK, EVEN_D, HEAD_DIM, TMA)  # fmt: skip
            kt = tl.trans(k)
        else:
            k_ptrs = k_base + b.to(tl.int64)[None, :] * stride_kt + offs_d[:, None]
            v_ptrs = v_base + b.to(tl.int64)[:, None] * stride_vt + offs_d[None, :]
            if MASK:
                kt = tl.load(k_ptrs, mask=(b < k_len)[None, :] & (offs_d < HEAD_DIM)[:, None], other=0.0)
                v = tl.load(v_ptrs, mask=(b < k_len)[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)
            elif EVEN_D:
                kt = tl.load(k_ptrs)
                v = tl.load(v_ptrs)
            else:
                kt = tl.load(k_ptrs, mask=(offs_d < HEAD_DIM)[:, None], other=0.0)
                v = tl.load(v_ptrs, mask=(offs_d < HEAD_DIM)[None, :], other=0.0)
        # scaled before the mask and the max: any sign of scale (folding it into the max and
        # the exponent instead measured no faster on the H100 and is wrong for scale <= 0)
        x = tl.dot(q, kt) * qk_scale
        if MASK:
            x = tl.where(_visible(pos[:, None], b[None, :], k_len, left, right, CAUSAL, WINDOW), x, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(x, 1))
        if MASK:
            # a row that has seen no visible key yet keeps m = -inf; shift by 0 instead
            # so exp2 never evaluates (-inf) - (-inf)
            m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_new_safe = m_new
        p = tl.math.exp2(x - m_new_safe[:, None])
        alpha = tl.math.exp2(m_i - m_new_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["n_seg", "left", "right"])
def varlen_attn_fwd_kernel(
    Q,
    K,
    V,
    O,
    LSE,
    desc_k,  # with TMA: descriptors over K and V as [rows, Hkv * HEAD_DIM], [BLOCK_N, BLOCK_D] tiles
    desc_v,
    q_start_ptr,
    q_len_ptr,
    q_pos_ptr,
    k_start_ptr,
    k_len_ptr,
    tile_seg_ptr,  # [num_tiles]: the segment of each query tile in launch order (n_seg: none)
    tile_row_ptr,  # [num_tiles]: the tile's index within its segment (BLOCK_M-row tiles)
    n_seg,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_lh,
    group,  # Hq // Hkv
    num_heads,  # Hq: the grid has num_tiles * Hq programs (:func:`_query_tile`)
    qk_scale,  # scale * log2(e)
    left,
    right,
    CAUSAL: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    K_ROWS: tl.constexpr = True,
    HEAD_GROUP: tl.constexpr = 1,
    TMA: tl.constexpr = False,
    WINDOW: tl.constexpr = True,  # whether left >= 0 or right >= 0 (:func:`_visible`)
):
    """One query tile x one query head: online softmax over the visible key tiles.

    ``m`` (running max of x), ``l = sum exp2(x - m)``, ``acc = sum exp2(x - m) v``;
    at the end ``out = acc / l`` and ``lse = (m + log2 l) ln 2``; a row with no
    visible key (l = 0) gets out = 0, lse = -inf.
    """
    # a float argument can arrive as an fp64 scalar (seen from Inductor's launcher, torch 2.11):
    # fp32 keeps every tensor of the kernel in fp32 (loop-carried types must not change)
    qk_scale = tl.cast(qk_scale, tl.float32)
    s, j, h = _query_tile(tile_seg_ptr, tile_row_ptr, num_heads, HEAD_GROUP)
    if s >= n_seg:
        return
    q_start = tl.load(q_start_ptr + s)
    q_len = tl.load(q_len_ptr + s)
    q_pos = tl.load(q_pos_ptr + s)
    k_start = tl.load(k_start_ptr + s)
    k_len = tl.load(k_len_ptr + s)

    offs_m = j * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < q_len
    pos = q_pos + offs_m
    pos_lo = q_pos + j * BLOCK_M
    pos_hi = q_pos + tl.minimum(j * BLOCK_M + BLOCK_M, q_len) - 1
    lo, mid_lo, mid_hi, hi = _key_range(pos_lo, pos_hi, k_len, left, right, CAUSAL, BLOCK_N)

    rows = (q_start + offs_m).to(tl.int64)
    d_ok = offs_d < HEAD_DIM
    q = tl.load(
        Q + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0
    )
    kvh = h // group
    k_base = K + k_start.to(tl.int64) * stride_kt + kvh * stride_kh
    v_base = V + k_start.to(tl.int64) * stride_vt + kvh * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    EVEN_D: tl.constexpr = BLOCK_D == HEAD_DIM
    acc, l_i, m_i = _fwd_inner(
        acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, desc_k, desc_v, k_start, kvh * HEAD_DIM, pos, offs_d,
        k_len, left, right, qk_scale,
        lo, mid_lo, True, CAUSAL, WINDOW, EVEN_D, HEAD_DIM, BLOCK_N, K_ROWS, TMA,
    )
    acc, l_i, m_i = _fwd_inner(
        acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, desc_k, desc_v, k_start, kvh * HEAD_DIM, pos, offs_d,
        k_len, left, right, qk_scale,
        mid_lo, mid_hi, False, CAUSAL, WINDOW, EVEN_D, HEAD_DIM, BLOCK_N, K_ROWS, TMA,
    )
    acc, l_i, m_i = _fwd_inner(
        acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, desc_k, desc_v, k_start, kvh * HEAD_DIM, pos, offs_d,
        k_len, left, right, qk_scale,
        mid_hi, hi, True, CAUSAL, WINDOW, EVEN_D, HEAD_DIM, BLOCK_N, K_ROWS, TMA,
    )

    seen = l_i > 0
    l_safe = tl.where(seen, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(seen, (m_i + tl.math.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    tl.store(
        O + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
        out.to(O.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )
    tl.store(LSE + h * stride_lh + rows, lse, mask=row_ok)


@triton.jit
def _load_rows(a_base, b_base, stride_a, stride_b, rows, row_ok, offs_d, desc_a, desc_b, row0, col,
               MASK: tl.constexpr, EVEN_D: tl.constexpr, HEAD_DIM: tl.constexpr, TMA: tl.constexpr):
    """Two ``[len(rows), BLOCK_D]`` tiles of the same rows of two tensors, e.g. K and V or q
    and dout: with MASK, rows where ``row_ok`` is false read 0; columns past HEAD_DIM read 0
    unless EVEN_D.

    Pointer loads take ``a_base``/``b_base`` and ``rows`` (int64 offsets from the bases).
    With TMA the tiles come from the tensor descriptors ``desc_a``/``desc_b`` over the
    ``[rows, heads * HEAD_DIM]`` view of the tensors, at row ``row0`` and column ``col``
    (the launcher builds them only where EVEN_D); rows past the tensor read 0, and rows
    of other segments are zeroed here (with MASK), since P = 0 times a non-finite value
    of another segment's row would still be NaN."""
    if TMA:
        a = desc_a.load([row0, col])
        b = desc_b.load([row0, col])
        if MASK:
            a = tl.where(row_ok[:, None], a, 0.0)
            b = tl.where(row_ok[:, None], b, 0.0)
        return a, b
    a_ptrs = a_base + rows[:, None] * stride_a + offs_d[None, :]
    b_ptrs = b_base + rows[:, None] * stride_b + offs_d[None, :]
    if MASK:
        mask = row_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
        a = tl.load(a_ptrs, mask=mask, other=0.0)
        b = tl.load(b_ptrs, mask=mask, other=0.0)
    elif EVEN_D:
        a = tl.load(a_ptrs)
        b = tl.load(b_ptrs)
    else:
        a = tl.load(a_ptrs, mask=(offs_d < HEAD_DIM)[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=(offs_d < HEAD_DIM)[None, :], other=0.0)
    return a, b


@triton.jit
def _dq_inner(
    dq,
    q,
    do,
    lse2,
    delta,
    k_base,
    v_base,
    stride_kt,
    stride_vt,
    desc_k,
    desc_v,
    k_start,
    col,
    pos,
    offs_d,
    k_len,
    left,
    right,
    qk_scale,
    start,
    stop,
    MASK: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
    EVEN_D: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TMA: tl.constexpr,
):
    offs_n = tl.arange(0, BLOCK_N)
    for n in range(start, stop, BLOCK_N):
        b = n + offs_n
        k, v = _load_rows(k_base, v_base, stride_kt, stride_vt, b.to(tl.int64), b < k_len, offs_d, desc_k, desc_v,
                          k_start + n, col, MASK, EVEN_D, HEAD_DIM, TMA)  # fmt: skip
        x = tl.dot(q, tl.trans(k)) * qk_scale
        p = tl.math.exp2(x - lse2[:, None])
        if MASK:
            p = tl.where(_visible(pos[:, None], b[None, :], k_len, left, right, CAUSAL, WINDOW), p, 0.0)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k)
    return dq


@triton.jit(do_not_specialize=["n_seg", "left", "right"])
def varlen_attn_bwd_dq_kernel(
    Q,
    K,
    V,
    O,
    DO,
    LSE,
    DLSE,  # [Hq, Tq] fp32, as LSE
    DELTA,  # [Hq, Tq] fp32, written here for the rows of every segment (the dk/dv kernel reads it)
    DQ,
    desc_k,  # with TMA: descriptors over K and V as [rows, Hkv * HEAD_DIM], [BLOCK_N, BLOCK_D] tiles
    desc_v,
    q_start_ptr,
    q_len_ptr,
    q_pos_ptr,
    k_start_ptr,
    k_len_ptr,
    tile_seg_ptr,  # [num_tiles]: the segment of each query tile in launch order (n_seg: none)
    tile_row_ptr,  # [num_tiles]: the tile's index within its segment (BLOCK_M-row tiles)
    n_seg,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_dot,
    stride_doh,
    stride_dqt,
    stride_dqh,
    stride_lh,
    group,
    num_heads,
    sm_scale,
    qk_scale,
    left,
    right,
    CAUSAL: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_GROUP: tl.constexpr = 1,
    TMA: tl.constexpr = False,
    WINDOW: tl.constexpr = True,  # whether left >= 0 or right >= 0 (:func:`_visible`)
):
    """One query tile x one query head: ``dq = scale * sum_b P (dP - delta) k_b``,
    P recomputed from the saved lse, over the same key phases as the forward.

    ``delta = <dout, out> - dlse`` per row is computed here from the tile's out and dout
    and stored for the dk/dv kernel, which runs after this one: no separate pass over
    out and dout."""
    # fp32 scales, as in the forward
    sm_scale = tl.cast(sm_scale, tl.float32)
    qk_scale = tl.cast(qk_scale, tl.float32)
    s, j, h = _query_tile(tile_seg_ptr, tile_row_ptr, num_heads, HEAD_GROUP)
    if s >= n_seg:
        return
    q_start = tl.load(q_start_ptr + s)
    q_len = tl.load(q_len_ptr + s)
    q_pos = tl.load(q_pos_ptr + s)
    k_start = tl.load(k_start_ptr + s)
    k_len = tl.load(k_len_ptr + s)

    offs_m = j * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < q_len
    pos = q_pos + offs_m
    pos_lo = q_pos + j * BLOCK_M
    pos_hi = q_pos + tl.minimum(j * BLOCK_M + BLOCK_M, q_len) - 1
    lo, mid_lo, mid_hi, hi = _key_range(pos_lo, pos_hi, k_len, left, right, CAUSAL, BLOCK_N)

    rows = (q_start + offs_m).to(tl.int64)
    mask = row_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    q = tl.load(Q + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :], mask=mask, other=0.0)
    do = tl.load(DO + rows[:, None] * stride_dot + h * stride_doh + offs_d[None, :], mask=mask, other=0.0)
    o = tl.load(O + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :], mask=mask, other=0.0)
    lse = tl.load(LSE + h * stride_lh + rows, mask=row_ok, other=float("-inf"))
    # rows with no visible key (lse = -inf) must get P = 0: shift them by +inf
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    dlse = tl.load(DLSE + h * stride_lh + rows, mask=row_ok, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1) - dlse
    tl.store(DELTA + h * stride_lh + rows, delta, mask=row_ok)
    kvh = h // group
    k_base = K + k_start.to(tl.int64) * stride_kt + kvh * stride_kh
    v_base = V + k_start.to(tl.int64) * stride_vt + kvh * stride_vh

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    EVEN_D: tl.constexpr = BLOCK_D == HEAD_DIM
    dq = _dq_inner(
        dq, q, do, lse2, delta, k_base, v_base, stride_kt, stride_vt, desc_k, desc_v, k_start, kvh * HEAD_DIM, pos,
        offs_d, k_len, left, right, qk_scale,
        lo, mid_lo, True, CAUSAL, WINDOW, EVEN_D, HEAD_DIM, BLOCK_N, TMA,
    )
    dq = _dq_inner(
        dq, q, do, lse2, delta, k_base, v_base, stride_kt, stride_vt, desc_k, desc_v, k_start, kvh * HEAD_DIM, pos,
        offs_d, k_len, left, right, qk_scale,
        mid_lo, mid_hi, False, CAUSAL, WINDOW, EVEN_D, HEAD_DIM, BLOCK_N, TMA,
    )
    dq = _dq_inner(
        dq, q, do, lse2, delta, k_base, v_base, stride_kt, stride_vt, desc_k, desc_v, k_start, kvh * HEAD_DIM, pos,
        offs_d, k_len, left, right, qk_scale,
        mid_hi, hi, True, CAUSAL, WINDOW, EVEN_D, HEAD_DIM, BLOCK_N, TMA,
    )
    tl.store(
        DQ + rows[:, None] * stride_dqt + h * stride_dqh + offs_d[None, :],
        (dq * sm_scale).to(DQ.dtype.element_ty),
        mask=mask,
    )


@triton.jit
def _query_range(b_lo, b_hi, q_pos, q_len, left, right, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr):
    """Query loop phases (offsets a within the segment) for the keys [b_lo, b_hi].

    Queries outside [lo, hi) see no key of the tile; query tiles in [mid_lo, mid_hi)
    see every key of it. Mirrors :func:`_key_range` with queries and keys swapped.
    """
    lo = q_len * 0
    hi = q_len
    full_lo = q_len * 0
    full_hi = q_len
    if CAUSAL:
        lo = tl.maximum(lo, b_lo - q_pos)
        full_lo = tl.maximum(full_lo, b_hi - q_pos)
    lo = tl.where(right >= 0, tl.maximum(lo, b_lo - right - q_pos), lo)
    full_lo = tl.where(right >= 0, tl.maximum(full_lo, b_hi - right - q_pos), full_lo)
    hi = tl.where(left >= 0, tl.minimum(hi, b_hi + left - q_pos + 1), hi)
    full_hi = tl.where(left >= 0, tl.minimum(full_hi, b_lo + left - q_pos + 1), full_hi)
    hi = tl.maximum(hi, lo)
    mid_lo = tl.minimum(lo + tl.cdiv(tl.maximum(full_lo - lo, 0), BLOCK_M) * BLOCK_M, hi)
    mid_hi = mid_lo + (tl.maximum(full_hi - mid_lo, 0) // BLOCK_M) * BLOCK_M
    return lo, mid_lo, mid_hi, hi


@triton.jit
def _dkdv_inner(
    dk,
    dv,
    k,
    v,
    q_base,
    do_base,
    lse_base,
    delta_base,
    stride_qt,
    stride_dot,
    desc_q,
    desc_do,
    q_start,
    col,
    b,
    offs_d,
    q_pos,
    q_len,
    k_len,
    left,
    right,
    qk_scale,
    start,
    stop,
    MASK: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
    EVEN_D: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    WANT_DK: tl.constexpr,
    WANT_DV: tl.constexpr,
    TMA: tl.constexpr,
):
    offs_m = tl.arange(0, BLOCK_M)
    for a0 in range(start, stop, BLOCK_M):
        a = a0 + offs_m
        a64 = a.to(tl.int64)
        row_ok = a < q_len
        q, do = _load_rows(q_base, do_base, stride_qt, stride_dot, a64, row_ok, offs_d, desc_q, desc_do, q_start + a0,
                           col, MASK, EVEN_D, HEAD_DIM, TMA)  # fmt: skip
        if MASK:
            lse = tl.load(lse_base + a64, mask=row_ok, other=float("-inf"))
            delta = tl.load(delta_base + a64, mask=row_ok, other=0.0)
        else:
            lse = tl.load(lse_base + a64)
            delta = tl.load(delta_base + a64)
        lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
        # transposed tiles [BLOCK_N, BLOCK_M]: rows are keys, so dk/dv accumulate without transposes
        xt = tl.dot(k, tl.trans(q)) * qk_scale
        pt = tl.math.exp2(xt - lse2[None, :])
        if MASK:
            vis = _visible(q_pos + a[None, :], b[:, None], k_len, left, right, CAUSAL, WINDOW) & row_ok[None, :]
            pt = tl.where(vis, pt, 0.0)
        if WANT_DV:
            dv += tl.dot(pt.to(do.dtype), do)
        if WANT_DK:
            dpt = tl.dot(v, tl.trans(do))
            dst = pt * (dpt - delta[None, :])
            if MASK:
                # key rows of the tile no segment reads may hold anything (NaN in padding): their
                # dP is not finite, and P = 0 times it must still give 0
                dst = tl.where(vis, dst, 0.0)
            dk += tl.dot(dst.to(q.dtype), q)
    return dk, dv


@triton.jit
def _dkdv_program(
    Q, K, V, DO, LSE, DELTA, DK, DV, desc_q, desc_do, q_start_ptr, q_len_ptr, q_pos_ptr, k_start_ptr, k_len_ptr,
    order_ptr, first_ptr, last_ptr, num_k_rows, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_dot, stride_doh, stride_dkt, stride_dkh, stride_lh, group, sm_scale, qk_scale, left, right,
    tile,
    kvh,
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WANT_DK: tl.constexpr,
    WANT_DV: tl.constexpr,
    TMA: tl.constexpr,
):
    """The work of one dk/dv program (see :func:`varlen_attn_bwd_dkdv_kernel`): key tile
    ``tile`` of kv head ``kvh``, dk and/or dv."""
    t0 = tile * BLOCK_N
    rows = t0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    EVEN_D: tl.constexpr = BLOCK_D == HEAD_DIM
    rows64 = rows.to(tl.int64)
    kv_mask = (rows < num_k_rows)[:, None] & d_ok[None, :]
    k = tl.load(K + rows64[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V + rows64[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    first = tl.load(first_ptr + tile)
    last = tl.load(last_ptr + tile)
    for i in range(first, last):
        s = tl.load(order_ptr + i)
        q_start = tl.load(q_start_ptr + s)
        q_len = tl.load(q_len_ptr + s)
        q_pos = tl.load(q_pos_ptr + s)
        k_start = tl.load(k_start_ptr + s)
        k_len = tl.load(k_len_ptr + s)
        # the tile's keys as offsets into the segment's key range (negative before it)
        b = rows - k_start
        b_lo = tl.maximum(t0 - k_start, 0)
        b_hi = tl.minimum(t0 + BLOCK_N - k_start, k_len) - 1
        lo, mid_lo, mid_hi, hi = _query_range(b_lo, b_hi, q_pos, q_len, left, right, CAUSAL, BLOCK_M)
        # keys of the tile outside the segment are never visible: mask every query tile
        inside = (t0 >= k_start) & (t0 + BLOCK_N <= k_start + k_len)
        mid_lo = tl.where(inside, mid_lo, hi)
        mid_hi = tl.where(inside, mid_hi, hi)
        if (b_lo <= b_hi) & (lo < hi):
            for g in range(0, group):
                h = kvh * group + g
                q_base = Q + q_start.to(tl.int64) * stride_qt + h * stride_qh
                do_base = DO + q_start.to(tl.int64) * stride_dot + h * stride_doh
                lse_base = LSE + h * stride_lh + q_start
                delta_base = DELTA + h * stride_lh + q_start
                dk, dv = _dkdv_inner(
                    dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qt, stride_dot, desc_q, desc_do, q_start,
                    h * HEAD_DIM, b, offs_d,
                    q_pos, q_len, k_len, left, right, qk_scale, lo, mid_lo, True, CAUSAL, WINDOW, EVEN_D, HEAD_DIM,
                    BLOCK_M, WANT_DK, WANT_DV, TMA,
                )
                dk, dv = _dkdv_inner(
                    dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qt, stride_dot, desc_q, desc_do, q_start,
                    h * HEAD_DIM, b, offs_d,
                    q_pos, q_len, k_len, left, right, qk_scale, mid_lo, mid_hi, False, CAUSAL, WINDOW, EVEN_D, HEAD_DIM,
                    BLOCK_M, WANT_DK, WANT_DV, TMA,
                )
                dk, dv = _dkdv_inner(
                    dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qt, stride_dot, desc_q, desc_do, q_start,
                    h * HEAD_DIM, b, offs_d,
                    q_pos, q_len, k_len, left, right, qk_scale, mid_hi, hi, True, CAUSAL, WINDOW, EVEN_D, HEAD_DIM,
                    BLOCK_M, WANT_DK, WANT_DV, TMA,
                )
    out_off = rows64[:, None] * stride_dkt + kvh * stride_dkh + offs_d[None, :]
    if WANT_DK:
        tl.store(DK + out_off, (dk * sm_scale).to(DK.dtype.element_ty), mask=kv_mask)
    if WANT_DV:
        tl.store(DV + out_off, dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit(do_not_specialize=["num_k_rows", "left", "right"])
def varlen_attn_bwd_dkdv_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DK,  # [Tk, Hkv, D] in k's dtype: every row is written (zero where no segment reads it)
    DV,
    desc_q,  # with TMA: descriptors over Q and DO as [rows, Hq * HEAD_DIM], [BLOCK_M, BLOCK_D] tiles
    desc_do,
    q_start_ptr,
    q_len_ptr,
    q_pos_ptr,
    k_start_ptr,
    k_len_ptr,
    order_ptr,  # segments sorted by key start
    first_ptr,  # [grid]: the range [first, last) of ``order`` that can reach each key tile
    last_ptr,
    num_k_rows,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_dot,
    stride_doh,
    stride_dkt,
    stride_dkh,
    stride_lh,
    group,
    num_kv_heads,  # the grid has num_key_tiles * Hkv * PARTS programs
    sm_scale,
    qk_scale,
    left,
    right,
    CAUSAL: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PARTS: tl.constexpr = 1,
    TMA: tl.constexpr = False,
    HEAD_GROUP: tl.constexpr = 1,
    WINDOW: tl.constexpr = True,  # whether left >= 0 or right >= 0 (:func:`_visible`)
):
    """One tile of BLOCK_N rows of the key tensor x one kv head (x dk or dv, with PARTS = 2):
    ``dv_b = sum_a P_ab dout_a``, ``dk_b = scale * sum_a P_ab (dP_ab - delta_a) q_a``
    over every segment whose key range reaches the tile, the query heads of the kv
    group, and the queries of the segment that see the tile.

    Key ranges of different segments may overlap (all-gather CP runs two query
    segments over one key range) or share a tile (short documents): one program
    sums all of them in registers and stores the tile once, so there are no
    atomics, no fp32 buffers to zero and cast, and the result does not depend on
    the order programs run in. The launcher sorts the segments by key start and
    gives each tile the slice of that order that can reach it (segments before
    ``first`` end at or before the tile, those from ``last`` on start after it);
    a segment in the slice that misses the tile is skipped.

    The query loop runs in three phases like the other kernels' key loops: only
    a tile wholly inside the segment's key range has an unmasked middle phase.
    On sm_90 it spills at D = 128 (255 registers and a 256-424 byte stack at
    every tile shape tried, read from the cubin); one masked loop spills less
    but masks every tile, and measured slower on the H100 at every tile shape
    (docs/benchmarks.md).

    With PARTS = 2 the launcher's grid has two programs per tile and kv head, one
    computing dv and one dk, each with one accumulator: five matrix products per query
    tile in all instead of four (both compute the scores; dv skips dP), and half the
    accumulator registers. At D = 256 the two accumulators alone are 128 registers a
    thread at 64 x 256 with 8 warps and the kernel spills heavily; the split form still
    spills (read from the sm_90 cubin) but is faster there for the whole backward and slower
    at D = 128, so only D = 256 uses it (docs/benchmarks.md, section "D = 256 with 16 query
    heads on 2 kv heads").
    """
    # fp32 scales, as in the forward
    sm_scale = tl.cast(sm_scale, tl.float32)
    qk_scale = tl.cast(qk_scale, tl.float32)
    tile, part = _program_tile(num_kv_heads * PARTS, HEAD_GROUP)
    kvh = part // PARTS
    if PARTS == 1:
        _dkdv_program(
            Q, K, V, DO, LSE, DELTA, DK, DV, desc_q, desc_do, q_start_ptr, q_len_ptr, q_pos_ptr, k_start_ptr,
            k_len_ptr, order_ptr, first_ptr, last_ptr, num_k_rows, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
            stride_dot, stride_doh, stride_dkt, stride_dkh, stride_lh, group, sm_scale, qk_scale, left, right, tile, kvh,
            CAUSAL, WINDOW, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, True, True, TMA,
        )
    elif part % 2 == 0:
        _dkdv_program(
            Q, K, V, DO, LSE, DELTA, DK, DV, desc_q, desc_do, q_start_ptr, q_len_ptr, q_pos_ptr, k_start_ptr,
            k_len_ptr, order_ptr, first_ptr, last_ptr, num_k_rows, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
            stride_dot, stride_doh, stride_dkt, stride_dkh, stride_lh, group, sm_scale, qk_scale, left, right, tile, kvh,
            CAUSAL, WINDOW, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, False, True, TMA,
        )
    else:
        _dkdv_program(
            Q, K, V, DO, LSE, DELTA, DK, DV, desc_q, desc_do, q_start_ptr, q_len_ptr, q_pos_ptr, k_start_ptr,
            k_len_ptr, order_ptr, first_ptr, last_ptr, num_k_rows, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
            stride_dot, stride_doh, stride_dkt, stride_dkh, stride_lh, group, sm_scale, qk_scale, left, right, tile, kvh,
            CAUSAL, WINDOW, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, True, False, TMA,
        )
