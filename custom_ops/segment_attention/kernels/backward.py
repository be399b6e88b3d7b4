"""The segment-attention backward kernels (docs/design.md section 5): the FA2 split, a delta
pass (``<dout, out> - dlse`` per row), a dk/dv kernel (one program per BLOCK_N-row tile of the
key tensor and kv head, two at D = 256, over the segments whose key ranges reach it: a slice of
the segments sorted by key start, built on the device) and a dq kernel (one program per query
tile and query head, over the forward's key phases). dk/dv before dq, so that a collective on
dk and dv (CP's reduce-scatter) can run beside the dq kernel. Deterministic: no atomics, every
tile summed in one program.
"""

import triton
import triton.language as tl

from custom_ops.segment_attention.kernels.schedule import _program_tile, _query_tile
from custom_ops.segment_attention.kernels.tiles import _key_range, _load_rows, _query_range, _query_tile_rows, _visible


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


@triton.jit(do_not_specialize=["num_rows"])
def varlen_attn_bwd_delta_kernel(
    O,
    DO,
    DLSE,  # [Hq, Tq] fp32, as LSE
    DELTA,  # [Hq, Tq] fp32 out
    num_rows,
    stride_ot,
    stride_oh,
    stride_dot,
    stride_doh,
    stride_lh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """``delta = <dout, out> - dlse`` for one tile of BLOCK_M query rows x one query head: the
    term both backward kernels subtract from dP. Every row, in a segment or not (a row in none
    has out = 0); its own pass so that the dk/dv kernel can run before the dq kernel."""
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    h = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = rows < num_rows
    mask = row_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    o = tl.load(O + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :], mask=mask, other=0.0)
    do = tl.load(DO + rows[:, None] * stride_dot + h * stride_doh + offs_d[None, :], mask=mask, other=0.0)
    dlse = tl.load(DLSE + h * stride_lh + rows, mask=row_ok, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1) - dlse
    tl.store(DELTA + h * stride_lh + rows, delta, mask=row_ok)


@triton.jit(do_not_specialize=["n_seg", "left", "right"])
def varlen_attn_bwd_dq_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,  # [Hq, Tq] fp32: varlen_attn_bwd_delta_kernel's
    DQ,
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
    P recomputed from the saved lse, over the same key phases as the forward, delta read
    from :func:`varlen_attn_bwd_delta_kernel`'s output."""
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

    offs_m, row_ok, pos_lo, pos_hi = _query_tile_rows(j, q_pos, q_len, left, BLOCK_M, BLOCK_N, CAUSAL)
    offs_d = tl.arange(0, BLOCK_D)
    pos = q_pos + offs_m
    lo, mid_lo, mid_hi, hi = _key_range(pos_lo, pos_hi, k_len, left, right, CAUSAL, BLOCK_N)

    rows = (q_start + offs_m).to(tl.int64)
    mask = row_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    q = tl.load(Q + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :], mask=mask, other=0.0)
    do = tl.load(DO + rows[:, None] * stride_dot + h * stride_doh + offs_d[None, :], mask=mask, other=0.0)
    lse = tl.load(LSE + h * stride_lh + rows, mask=row_ok, other=float("-inf"))
    # rows with no visible key (lse = -inf) must get P = 0: shift them by +inf
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    delta = tl.load(DELTA + h * stride_lh + rows, mask=row_ok, other=0.0)
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
    order_ptr, first_ptr, last_ptr, out_rows_ptr, num_k_rows, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt,
    stride_vh, stride_dot, stride_doh, stride_dkt, stride_dkh, stride_lh, group, sm_scale, qk_scale, left, right,
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
    ROW_MAP: tl.constexpr,
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
    if ROW_MAP:
        out_rows = tl.load(out_rows_ptr + rows, mask=rows < num_k_rows, other=0).to(tl.int64)
    else:
        out_rows = rows64
    out_off = out_rows[:, None] * stride_dkt + kvh * stride_dkh + offs_d[None, :]
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
    out_rows_ptr,  # with ROW_MAP: [Tk], the row of DK and DV that key row b's gradient goes to
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
    ROW_MAP: tl.constexpr = False,
):
    """One tile of BLOCK_N rows of the key tensor x one kv head (x dk or dv, with PARTS = 2):
    ``dv_b = sum_a P_ab dout_a``, ``dk_b = scale * sum_a P_ab (dP_ab - delta_a) q_a``
    over every segment whose key range reaches the tile, the query heads of the kv
    group, and the queries of the segment that see the tile. The segments come as the
    slice ``[first, last)`` of ``order`` (sorted by key start) the launcher gives each tile;
    one that misses the tile is skipped. Every key row is written once, summed in
    registers: no atomics, deterministic (docs/design.md section 5, "Deterministic
    backward"). The query loop runs in three phases like the forward's key loop. With
    ROW_MAP, key row b's dk and dv are stored at row ``out_rows[b]`` of DK and DV (a
    permutation: all-gather CP's rank order, section 4.2), not at row b.
    """
    # fp32 scales, as in the forward
    sm_scale = tl.cast(sm_scale, tl.float32)
    qk_scale = tl.cast(qk_scale, tl.float32)
    tile, part = _program_tile(num_kv_heads * PARTS, HEAD_GROUP)
    kvh = part // PARTS
    if PARTS == 1:
        _dkdv_program(
            Q, K, V, DO, LSE, DELTA, DK, DV, desc_q, desc_do, q_start_ptr, q_len_ptr, q_pos_ptr, k_start_ptr,
            k_len_ptr, order_ptr, first_ptr, last_ptr, out_rows_ptr, num_k_rows, stride_qt, stride_qh, stride_kt, stride_kh,
            stride_vt, stride_vh, stride_dot, stride_doh, stride_dkt, stride_dkh, stride_lh, group, sm_scale, qk_scale, left,
            right, tile, kvh, CAUSAL, WINDOW, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, True, True, TMA, ROW_MAP,
        )
    elif part % 2 == 0:
        _dkdv_program(
            Q, K, V, DO, LSE, DELTA, DK, DV, desc_q, desc_do, q_start_ptr, q_len_ptr, q_pos_ptr, k_start_ptr,
            k_len_ptr, order_ptr, first_ptr, last_ptr, out_rows_ptr, num_k_rows, stride_qt, stride_qh, stride_kt, stride_kh,
            stride_vt, stride_vh, stride_dot, stride_doh, stride_dkt, stride_dkh, stride_lh, group, sm_scale, qk_scale, left,
            right, tile, kvh, CAUSAL, WINDOW, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, False, True, TMA, ROW_MAP,
        )
    else:
        _dkdv_program(
            Q, K, V, DO, LSE, DELTA, DK, DV, desc_q, desc_do, q_start_ptr, q_len_ptr, q_pos_ptr, k_start_ptr,
            k_len_ptr, order_ptr, first_ptr, last_ptr, out_rows_ptr, num_k_rows, stride_qt, stride_qh, stride_kt, stride_kh,
            stride_vt, stride_vh, stride_dot, stride_doh, stride_dkt, stride_dkh, stride_lh, group, sm_scale, qk_scale, left,
            right, tile, kvh, CAUSAL, WINDOW, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, True, False, TMA, ROW_MAP,
        )
