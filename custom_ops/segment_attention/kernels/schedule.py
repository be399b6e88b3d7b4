"""The tile schedule of the segment-attention kernels (docs/design.md section 5): which
program does which tile, in which order.

The forward and dq cut each segment's queries into tiles of BLOCK_M rows; a small kernel
launched before them (:func:`segment_tables_kernel`) computes, on the device, a table of every
query tile's segment and place in it, in launch order (heaviest segments first), so grids
depend on shapes only. A binary-search loop in the attention kernels themselves would stop
Triton's software pipeliner from pipelining the key loops that follow it (no async copies in
the TTGIR), which costs the forward most of its speed (docs/benchmarks.md). Grids are 1-D with
the heads of one tile adjacent (:func:`_program_tile`); an attention program finds its tile with
two loads (:func:`_query_tile`).
"""

import triton
import triton.language as tl

from custom_ops.segment_attention.kernels.tiles import _key_range, _tiles_end


@triton.jit
def _maximum(a, b):
    return tl.maximum(a, b)


@triton.jit(do_not_specialize=["n_seg", "num_q_rows", "num_k_rows", "num_tiles", "left", "right", "tile", "key_tile"])
def segment_tables_kernel(
    q_start_ptr,
    q_len_ptr,
    q_pos_ptr,
    k_start_ptr,
    k_len_ptr,
    tab_ptr,  # [5, n_seg] int32: q_start, q_len, q_pos, k_start, k_len, clamped into the tensors
    cum_ptr,  # [n_seg] int32 scratch: inclusive cumulative count of tile-row query tiles per segment
    tiles_ptr,  # [5, num_tiles] int32: rows 0 and 1 the launch order, rows 2 to 4 scratch
    n_seg,
    num_q_rows,
    num_k_rows,
    num_tiles,
    left,
    right,
    tile,
    key_tile,
    CAUSAL: tl.constexpr,
    BY_WORK: tl.constexpr,
    BLOCK: tl.constexpr,
    BUCKETS: tl.constexpr,
):
    """Every table a forward or dq launch needs, in one program: ``tab`` the five segment
    columns (int32 or int64 in) clamped into the tensors (``start`` into ``[0, rows]``, ``len``
    into ``[0, rows - start]``: an invalid layout gives wrong rows, never an out-of-bounds
    access), and for each of the grid's ``num_tiles`` query tiles, in launch order, its
    segment (row 0 of ``tiles``; ``n_seg`` past the last segment's tiles) and its index in the
    segment, counted from where its tiles end (row 1; ``_query_tile_rows`` in tiles.py). ``tile``
    and ``key_tile`` are runtime arguments, so the forward's and dq's launches share one
    compiled variant. Launch order: the segments last to first, or with ``BY_WORK`` heaviest
    first by a stable counting sort on a bucket of their work (eight per doubling), each
    segment's tiles last to first (docs/design.md section 5).
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
        tiles = ((ql + tile - 1) // tile).to(tl.int32)  # 0 past n_seg (ql = 0 there)
        cum = tl.cumsum(tiles, 0) + carry
        tl.store(cum_ptr + i, cum, mask=m)
        # the tile after segment i's last is the first of segment i + 1 (or of a later one,
        # past segments without tiles: the largest i with that cum wins)
        tl.atomic_max(tiles_ptr + cum, i + 1, mask=m & (cum < num_tiles))
        carry += tl.sum(tiles, 0)
    num_live = tl.minimum(carry, num_tiles)  # the tiles that belong to a segment: 0 .. num_live - 1
    # the loops below read cum and the scratch rows back: the program's stores first
    tl.debug_barrier()

    # every tile's segment and index within it (BY_WORK: also the rank of its
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
        last = tl.load(cum_ptr + s, mask=live, other=0) - 1  # the segment's last tile
        # tile j counts from the segment's end (_query_tile_rows), and tile 0 (under a causal
        # mask the longest) runs first: the work sort keeps this order, the other reverses it
        j = last - t
        if BY_WORK:
            j = t - seg_first
            ql = tl.load(tab_ptr + n_seg + s, mask=live, other=0)
            qp = tl.load(tab_ptr + 2 * n_seg + s, mask=live, other=0)
            kl = tl.load(tab_ptr + 4 * n_seg + s, mask=live, other=0)
            pos_lo = qp + tl.maximum(_tiles_end(qp, ql, left, tile, key_tile, CAUSAL) - tile, 0)
            pos_hi = qp + ql - 1
            lo, _, _, hi = _key_range(pos_lo, pos_hi, kl, left, right, CAUSAL, key_tile)
            work = (hi - lo + key_tile - 1) // key_tile
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
def _sort_keys(ql_ptr, ks_ptr, kl_ptr, j, n_seg, num_k_rows, key_tile):
    """``(start, end, key)`` of segments ``j`` for :func:`key_tile_segments_kernel`: a segment
    with no query or no key starts past every key tile and ends at 0; ``key`` orders them by
    start, ties by index (a stable sort); past ``n_seg``, the largest key and no reach."""
    ok = j < n_seg
    kl = tl.load(kl_ptr + j, mask=ok, other=0)
    live = ok & (tl.load(ql_ptr + j, mask=ok, other=0) > 0) & (kl > 0)
    ks = tl.load(ks_ptr + j, mask=ok, other=0).to(tl.int64)
    start = tl.where(live, ks, num_k_rows + key_tile)
    end = tl.where(live, ks + kl, 0)
    key = tl.where(ok, start * n_seg + j, 2**62)
    return start, end, key


@triton.jit(do_not_specialize=["n_seg", "num_tiles", "num_k_rows", "key_tile", "order_programs"])
def key_tile_segments_kernel(
    ql_ptr,
    ks_ptr,
    kl_ptr,
    order_ptr,  # [n_seg] int32: the segments sorted by key start (stable), those with no query or no key last
    first_ptr,  # [num_tiles] int32
    last_ptr,  # [num_tiles] int32
    n_seg,
    num_tiles,
    num_k_rows,
    key_tile,
    order_programs,
    BLOCK: tl.constexpr,
):
    """The dk/dv kernel's tables: key tile t (rows ``[t*key_tile, (t+1)*key_tile)``) can only be
    reached by the segments ``order[first[t]:last[t]]``. ``last[t]`` counts the segments that
    start before the tile ends; ``first[t]`` the sorted segments before the first one (in
    ``order``) that ends past the tile's start, so they and every segment before them end at
    or before it. Programs below ``order_programs`` sort BLOCK segments each by rank (the count
    of smaller keys); the others fill BLOCK tiles each. Every program reads all segments once
    or twice, BLOCK at a time: ``n_seg * (n_seg + 2 * num_tiles)`` comparisons in all."""
    pid = tl.program_id(0)
    lane = tl.arange(0, BLOCK)
    if pid < order_programs:
        i = pid * BLOCK + lane
        _, _, key_i = _sort_keys(ql_ptr, ks_ptr, kl_ptr, i, n_seg, num_k_rows, key_tile)
        rank = tl.zeros([BLOCK], dtype=tl.int32)
        for j0 in range(0, n_seg, BLOCK):
            _, _, key_j = _sort_keys(ql_ptr, ks_ptr, kl_ptr, j0 + lane, n_seg, num_k_rows, key_tile)
            rank += tl.sum((key_j[None, :] < key_i[:, None]).to(tl.int32), axis=1)
        tl.store(order_ptr + rank, i.to(tl.int32), mask=i < n_seg)
    else:
        t = (pid - order_programs) * BLOCK + lane
        tile_start = t.to(tl.int64) * key_tile
        least = tl.full([BLOCK], 2**62, dtype=tl.int64)  # the least key among segments ending past the tile's start
        last = tl.zeros([BLOCK], dtype=tl.int32)
        for j0 in range(0, n_seg, BLOCK):
            start, end, key = _sort_keys(ql_ptr, ks_ptr, kl_ptr, j0 + lane, n_seg, num_k_rows, key_tile)
            past = end[None, :] > tile_start[:, None]
            least = tl.minimum(least, tl.min(tl.where(past, key[None, :], 2**62), axis=1))
            last += tl.sum((start[None, :] < tile_start[:, None] + key_tile).to(tl.int32), axis=1)
        first = tl.zeros([BLOCK], dtype=tl.int32)
        for j0 in range(0, n_seg, BLOCK):
            _, _, key = _sort_keys(ql_ptr, ks_ptr, kl_ptr, j0 + lane, n_seg, num_k_rows, key_tile)
            first += tl.sum((key[None, :] < least[:, None]).to(tl.int32), axis=1)
        tl.store(first_ptr + t, first, mask=t < num_tiles)
        tl.store(last_ptr + t, last, mask=t < num_tiles)


@triton.jit
def _program_tile(num_parts, HEAD_GROUP: tl.constexpr):
    """``(tile, part)`` of this program in a 1-D grid of ``num_tiles * num_parts`` programs
    (parts: the heads, or kv heads x PARTS in dk/dv). Launch order: the parts in groups of
    HEAD_GROUP (which divides num_parts), every tile of one group before the next group,
    and within a group the HEAD_GROUP parts of one tile adjacent; why: docs/design.md
    section 5, "Launch order"."""
    pid = tl.program_id(0)
    num_tiles = tl.num_programs(0) // num_parts
    per_group = num_tiles * HEAD_GROUP
    group = pid // per_group
    r = pid % per_group
    return r // HEAD_GROUP, group * HEAD_GROUP + r % HEAD_GROUP


@triton.jit
def _query_tile(tile_seg_ptr, tile_row_ptr, num_heads, HEAD_GROUP: tl.constexpr):
    """``(s, j, head)`` of a forward or dq program: query tile j of segment s (counted from its
    end, ``_query_tile_rows``), in the launch order of the tile table
    (:func:`segment_tables_kernel`), the heads as :func:`_program_tile` orders them. Two loads
    and no loop, so the loops after it pipeline."""
    tile, h = _program_tile(num_heads, HEAD_GROUP)
    return tl.load(tile_seg_ptr + tile), tl.load(tile_row_ptr + tile), h
