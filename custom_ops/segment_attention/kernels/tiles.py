"""What every segment-attention kernel does per tile (docs/design.md section 5): a query tile's
rows (:func:`_query_tile_rows`), the loop phases of the mask (:func:`_key_range` for a query
tile's keys, :func:`_query_range` for a key tile's queries), the elementwise mask of the
boundary tiles (:func:`_visible`), and the loads of two tiles of the same rows
(:func:`_load_rows`, by pointers or through TMA descriptors).

Notation (see reference.py): segment s has query rows ``q_start + a`` at positions
``pos(a) = q_pos + a`` (``0 <= a < q_len``) and key rows ``k_start + b`` (``0 <= b < k_len``).
"""

import triton
import triton.language as tl


@triton.jit
def _tiles_end(q_pos, q_len, left, tile, key_tile, CAUSAL: tl.constexpr):
    """Where a segment's ``tile``-row query tiles end, as an offset ``>= q_len`` within the
    segment: the segment's end, moved under a causal mask with no left window onto the
    key-tile grid (positions a multiple of ``key_tile``) where its partial tile has the rows
    to spare, so that each full tile's diagonal spans ``tile / key_tile`` masked key tiles, not
    one more. The count of tiles stays ``cdiv(q_len, tile)``; rows past ``q_len`` are masked."""
    end = q_len
    if CAUSAL:
        stop = q_pos + q_len
        pad = (key_tile - stop % key_tile) % key_tile
        spare = (tile - q_len % tile) % tile
        end = q_len + tl.where((q_len > 0) & (stop > 0) & (left < 0) & (pad <= spare), pad, 0)
    return end


@triton.jit
def _query_tile_rows(e, q_pos, q_len, left, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """Query tile ``e`` of a segment, counted from where its tiles end (:func:`_tiles_end`):
    offsets ``a`` within the segment ``[end - (e+1)*BLOCK_M, end - e*BLOCK_M)``, of which only
    those in ``[0, q_len)`` are the segment's (``row_ok``). So the partial tile is the one
    with the segment's first rows, which under a causal mask sees the fewest keys. Returns
    ``(a, row_ok, pos_lo, pos_hi)``: the positions of the tile's first and last rows in the
    segment."""
    first = _tiles_end(q_pos, q_len, left, BLOCK_M, BLOCK_N, CAUSAL) - (e + 1) * BLOCK_M
    a = first + tl.arange(0, BLOCK_M)
    pos_lo = q_pos + tl.maximum(first, 0)
    pos_hi = q_pos + tl.minimum(first + BLOCK_M, q_len) - 1
    return a, (a >= 0) & (a < q_len), pos_lo, pos_hi


@triton.jit
def _key_range(pos_lo, pos_hi, k_len, left, right, CAUSAL: tl.constexpr, BLOCK_N):
    """Key loop phases for the query positions [pos_lo, pos_hi].

    ``BLOCK_N`` is the attention kernels' constexpr key tile, or a runtime value in the
    table kernel (one compiled variant serves every launch's tiles).

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
