"""The segment-attention forward kernel (docs/design.md section 5): flash attention over many
segments in one launch, one program per query tile and query head.

Scores are kept in base 2: ``x = s * log2(e)``, so ``exp(s - lse) = exp2(x - lse * log2(e))``.
For each query tile the visible keys are computed from the mask bounds (:func:`_key_range`);
key tiles entirely inside the mask run without the elementwise mask, only the boundary tiles
apply it (with the window's terms only in launches that have a window, ``WINDOW``). With
``TMA`` (Hopper) K and V come from host tensor descriptors instead of pointer loads
(:func:`_load_rows`); everything else is the same code.
"""

import triton
import triton.language as tl

from custom_ops.segment_attention.kernels.schedule import _query_tile
from custom_ops.segment_attention.kernels.tiles import _key_range, _load_rows, _query_tile_rows, _visible


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
        # scaled before the mask and the max: right for any sign of scale (folding it into the
        # max and the exponent is wrong for scale <= 0 and gained nothing; docs/benchmarks.md)
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
    tile_row_ptr,  # [num_tiles]: the tile's index within its segment, from its end (_query_tile_rows)
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
    # a float argument can arrive as an fp64 scalar (from Inductor's launcher): fp32 keeps
    # every tensor of the kernel in fp32 (loop-carried types must not change)
    qk_scale = tl.cast(qk_scale, tl.float32)
    s, j, h = _query_tile(tile_seg_ptr, tile_row_ptr, num_heads, HEAD_GROUP)
    if s >= n_seg:
        return
    q_start = tl.load(q_start_ptr + s)
    q_len = tl.load(q_len_ptr + s)
    q_pos = tl.load(q_pos_ptr + s)
    k_start = tl.load(k_start_ptr + s)
    k_len = tl.load(k_len_ptr + s)

    offs_m, row_ok, pos_lo, pos_hi = _query_tile_rows(j, q_pos, q_len, left, BLOCK_M, BLOCK_N, CAUSAL)
    offs_d = tl.arange(0, BLOCK_D)
    pos = q_pos + offs_m
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
