"""Triton kernels of the depthwise causal conv1d over packed sequences (``custom_ops.causal_conv1d``),
for kernel widths K <= 4 (:data:`MAX_TAPS`).

Each program streams a block of channels down a run of rows, carrying the rows a tap needs in
registers, so every row of x (and of the output gradient) is read once; in steps of
:data:`ROW_STEP` rows, the next step's loads issued before this step computes (one load at a time
left HBM half idle); a step whose rows all sit three or more rows into their sequence runs without
per-row tests (FULL). The backward streams the rows backwards, recomputes the pre-activation, and
sums ``dweight`` and ``dbias`` per program in float32 for the caller to add. Grids are sized from
shapes, their column blocks starting at 0 and again at the cut. Sequences enter through ``pos``
(each row's position capped at :data:`MAX_TAPS`, from :func:`conv_positions_kernel`): tap j of row
t sees ``x[t-j]`` iff ``pos[t] >= j``. The design: docs/design.md section 2, "Gated DeltaNet core".
"""

import triton
import triton.language as tl

MAX_TAPS = 4

# Rows a program loads together (a step); a program's ROWS is a multiple of it.
ROW_STEP = tl.constexpr(4)


# Rows per program of conv_positions_kernel.
POSITIONS_BLOCK = 1024


@triton.jit
def conv_positions_kernel(cu_ptr, pos_ptr, num_bounds, num_rows, steps, CAP: tl.constexpr, BLOCK: tl.constexpr):
    """``pos[t] = min(t - cu[s], CAP)`` (int32) for the rows t of this program, where s is the
    last index with ``cu[s] <= t``, clamped to ``[0, num_bounds - 1]`` (zero-length sequences
    are skipped; rows past ``cu[-1]`` start a sequence of their own there): the reference's
    ``row_positions`` capped at CAP, found by a binary search of ``steps >= log2(num_bounds + 1)``
    halvings over the ``num_bounds`` entries of ``cu``."""
    t = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    lo = tl.zeros([BLOCK], dtype=tl.int32)  # becomes the count of entries <= t
    hi = tl.zeros([BLOCK], dtype=tl.int32) + num_bounds
    for _ in range(steps):
        mid = (lo + hi) // 2
        open_ = lo < hi
        below = tl.load(cu_ptr + mid, mask=open_ & (mid < num_bounds), other=0).to(tl.int64) <= t
        lo = tl.where(open_ & below, mid + 1, lo)
        hi = tl.where(open_ & ~below, mid, hi)
    seq = tl.minimum(tl.maximum(lo - 1, 0), num_bounds - 1)
    start = tl.load(cu_ptr + seq).to(tl.int64)
    tl.store(pos_ptr + t, tl.minimum(t - start, CAP).to(tl.int32), mask=t < num_rows)


@triton.jit
def _weight(w_ptr, cols, col_ok, K: tl.constexpr, k: tl.constexpr):
    """Column k of weight ``[C, K]`` as float32 (zero for k < 0: a tap the kernel does not have)."""
    if k >= 0:
        return tl.load(w_ptr + cols * K + k, mask=col_ok, other=0.0).to(tl.float32)
    else:
        return tl.zeros(cols.shape, dtype=tl.float32)


@triton.jit
def _src(map_ptr, t, num_rows, GATHER: tl.constexpr):
    """The memory row of sequence row t, int64: ``map[t]`` with GATHER (0 outside ``[0, num_rows)``),
    else t. (One return: Triton types every return of a function, the skipped branch's too.)"""
    if GATHER:
        src = tl.load(map_ptr + t, mask=(t >= 0) & (t < num_rows), other=0).to(tl.int64)
    else:
        src = t.to(tl.int64)
    return src


@triton.jit
def _row(ptr, t, stride, cols, col_ok, num_rows, map_ptr=None, GATHER: tl.constexpr = False):
    """Sequence row t of a ``[T, C]`` tensor as float32 (stored at row ``map[t]`` with GATHER),
    zero outside ``[0, num_rows)``."""
    tv = t + cols * 0  # the row as a vector: the mask is built from vectors only
    ok = col_ok & (tv >= 0) & (tv < num_rows)
    src = _src(map_ptr, t, num_rows, GATHER)
    return tl.load(ptr + src * stride + cols, mask=ok, other=0.0).to(tl.float32)


@triton.jit
def _pos(pos_ptr, t, num_rows):
    """``pos[t]``, 0 outside ``[0, num_rows)``."""
    return tl.load(pos_ptr + t, mask=(t >= 0) & (t < num_rows), other=0)


@triton.jit
def _taps(w_ptr, b_ptr, cols, col_ok, K: tl.constexpr, HAS_BIAS: tl.constexpr):
    """``(wa, wb, wc, wd, bias)`` for the channels ``cols``, float32: the weights of taps 0-3
    (tap j looks j rows back: weight column K-1-j; zero for a tap the kernel does not have)
    and the bias (zero without one)."""
    wa = _weight(w_ptr, cols, col_ok, K, K - 1)
    wb = _weight(w_ptr, cols, col_ok, K, K - 2)
    wc = _weight(w_ptr, cols, col_ok, K, K - 3)
    wd = _weight(w_ptr, cols, col_ok, K, K - 4)
    bias = tl.zeros(cols.shape, dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    return wa, wb, wc, wd, bias


@triton.jit
def _preactivation(wa, wb, wc, wd, bias, x0, x1, x2, x3, p, FULL: tl.constexpr):
    """The conv before its activation for a row at position ``p`` in its sequence, from its own
    x row ``x0`` and the three before it: tap j counts only where ``p >= j`` (FULL: p >= 3)."""
    if FULL:
        pre = bias + wa * x0 + wb * x1 + wc * x2 + wd * x3
    else:
        pre = bias + wa * x0
        pre += tl.where(p >= 1, wb * x1, 0.0)
        pre += tl.where(p >= 2, wc * x2, 0.0)
        pre += tl.where(p >= 3, wd * x3, 0.0)
    return pre


@triton.jit
def _group_sum(v, BLOCK_C: tl.constexpr, NORM_DIM: tl.constexpr):
    """The sum of ``v [BLOCK_C]`` over each group of NORM_DIM channels, broadcast back to ``[BLOCK_C]``."""
    sums = tl.sum(tl.reshape(v, (BLOCK_C // NORM_DIM, NORM_DIM)), axis=1)
    return tl.reshape(tl.broadcast_to(sums[:, None], (BLOCK_C // NORM_DIM, NORM_DIM)), (BLOCK_C,))


@triton.jit
def _head_offsets(cols, split, num_rows, PARTS: tl.constexpr, NORM_DIM: tl.constexpr):
    """Where y's columns ``cols`` (those < split) sit in the first output ``[PARTS, T, split/PARTS]``,
    past row t's start ``t * split/PARTS``, int64: a part's block of rows, then the column within
    it. With NORM_DIM the part is found per group, so the offsets stay contiguous within one."""
    offsets = cols.to(tl.int64)
    if PARTS > 1:
        width = split // PARTS
        if NORM_DIM > 0:
            part = (cols // NORM_DIM) // (width // NORM_DIM)
        else:
            part = cols // width
        offsets = part.to(tl.int64) * num_rows * width + (cols - part * width)
    return offsets


@triton.jit
def _lowest(a, b, c, d):
    """The least of four scalars."""
    return tl.minimum(tl.minimum(a, b), tl.minimum(c, d))


@triton.jit
def _fwd_loads(x_ptr, pos_ptr, map_ptr, t, stride_x, cols, col_ok, num_rows, GATHER: tl.constexpr):
    """A forward step's loads: x and pos of rows t, t+1, t+2, t+3."""
    xa = _row(x_ptr, t, stride_x, cols, col_ok, num_rows, map_ptr, GATHER)
    xb = _row(x_ptr, t + 1, stride_x, cols, col_ok, num_rows, map_ptr, GATHER)
    xc = _row(x_ptr, t + 2, stride_x, cols, col_ok, num_rows, map_ptr, GATHER)
    xd = _row(x_ptr, t + 3, stride_x, cols, col_ok, num_rows, map_ptr, GATHER)
    return xa, xb, xc, xd, _pos(pos_ptr, t, num_rows), _pos(pos_ptr, t + 1, num_rows), \
        _pos(pos_ptr, t + 2, num_rows), _pos(pos_ptr, t + 3, num_rows)


@triton.jit
def _fwd_row(out_ptr, t, pre, offsets, col_ok, out_stride, num_rows, norm_eps, SILU: tl.constexpr,
             BLOCK_C: tl.constexpr, NORM_DIM: tl.constexpr, FULL: tl.constexpr):  # fmt: skip
    """Output row t from its pre-activation: the activation, with NORM_DIM the l2 norm over each
    group of NORM_DIM columns; stored at ``out_ptr + t * out_stride + offsets`` (FULL: t < num_rows)."""
    y = pre
    if SILU:
        y = pre * tl.sigmoid(pre)
    if NORM_DIM > 0:
        y = y * tl.rsqrt(_group_sum(y * y, BLOCK_C, NORM_DIM) + norm_eps)
    ok = col_ok
    if not FULL:
        ok = ok & (t + offsets * 0 < num_rows)
    tl.store(out_ptr + t.to(tl.int64) * out_stride + offsets, y.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _fwd_step(out_ptr, t, xa, xb, xc, xd, x1, x2, x3, pa, pb, pc, pd, wa, wb, wc, wd, bias, offsets, col_ok,
              out_stride, num_rows, norm_eps, SILU: tl.constexpr, BLOCK_C: tl.constexpr, NORM_DIM: tl.constexpr,
              FULL: tl.constexpr):  # fmt: skip
    """Output rows t..t+3 from their x rows ``xa..xd`` and pos ``pa..pd``, and the x rows t-1, t-2,
    t-3 (``x1..x3``)."""
    pre = _preactivation(wa, wb, wc, wd, bias, xa, x1, x2, x3, pa, FULL)
    _fwd_row(out_ptr, t, pre, offsets, col_ok, out_stride, num_rows, norm_eps, SILU, BLOCK_C, NORM_DIM, FULL)
    pre = _preactivation(wa, wb, wc, wd, bias, xb, xa, x1, x2, pb, FULL)
    _fwd_row(out_ptr, t + 1, pre, offsets, col_ok, out_stride, num_rows, norm_eps, SILU, BLOCK_C, NORM_DIM, FULL)
    pre = _preactivation(wa, wb, wc, wd, bias, xc, xb, xa, x1, pc, FULL)
    _fwd_row(out_ptr, t + 2, pre, offsets, col_ok, out_stride, num_rows, norm_eps, SILU, BLOCK_C, NORM_DIM, FULL)
    pre = _preactivation(wa, wb, wc, wd, bias, xd, xc, xb, xa, pd, FULL)
    _fwd_row(out_ptr, t + 3, pre, offsets, col_ok, out_stride, num_rows, norm_eps, SILU, BLOCK_C, NORM_DIM, FULL)


@triton.jit
def _fwd_block(x_ptr, w_ptr, b_ptr, out_ptr, pos_ptr, map_ptr, t0, cols, col_ok, offsets, out_stride, num_rows,
               stride_x, norm_eps, K: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, ROWS: tl.constexpr,
               BLOCK_C: tl.constexpr, GATHER: tl.constexpr, NORM_DIM: tl.constexpr):  # fmt: skip
    """Output rows ``[t0, t0 + ROWS)`` of the channels ``cols``, each stored at
    ``out_ptr + t * out_stride + offsets``, in steps of ROW_STEP rows."""
    wa, wb, wc, wd, bias = _taps(w_ptr, b_ptr, cols, col_ok, K, HAS_BIAS)
    x1 = _row(x_ptr, t0 - 1, stride_x, cols, col_ok, num_rows, map_ptr, GATHER)  # rows t-1, t-2, t-3, carried
    x2 = _row(x_ptr, t0 - 2, stride_x, cols, col_ok, num_rows, map_ptr, GATHER)
    x3 = _row(x_ptr, t0 - 3, stride_x, cols, col_ok, num_rows, map_ptr, GATHER)
    xa, xb, xc, xd, pa, pb, pc, pd = _fwd_loads(x_ptr, pos_ptr, map_ptr, t0, stride_x, cols, col_ok, num_rows, GATHER)
    for i in range(0, ROWS, ROW_STEP):  # the next step's loads in flight while this step computes
        t = t0 + i
        na, nb, nc, nd, npa, npb, npc, npd = _fwd_loads(
            x_ptr, pos_ptr, map_ptr, t + ROW_STEP, stride_x, cols, col_ok, num_rows, GATHER
        )  # fmt: skip
        # FULL: every row exists and every tap counts (K <= 4), so no row or tap needs a test
        if (t + 3 < num_rows) & (_lowest(pa, pb, pc, pd) >= 3):
            _fwd_step(out_ptr, t, xa, xb, xc, xd, x1, x2, x3, pa, pb, pc, pd, wa, wb, wc, wd, bias, offsets, col_ok,
                      out_stride, num_rows, norm_eps, SILU, BLOCK_C, NORM_DIM, True)  # fmt: skip
        else:
            _fwd_step(out_ptr, t, xa, xb, xc, xd, x1, x2, x3, pa, pb, pc, pd, wa, wb, wc, wd, bias, offsets, col_ok,
                      out_stride, num_rows, norm_eps, SILU, BLOCK_C, NORM_DIM, False)  # fmt: skip
        x3, x2, x1 = xb, xc, xd
        xa, xb, xc, xd, pa, pb, pc, pd = na, nb, nc, nd, npa, npb, npc, npd


@triton.jit
def cp_causal_conv1d_fwd_kernel(
    x_ptr,
    w_ptr,  # [C, K], contiguous
    b_ptr,  # [C] or a dummy (HAS_BIAS False)
    y_ptr,  # [PARTS, T, split/PARTS], contiguous: y's columns [0, split)
    y2_ptr,  # with SPLIT: [T, C - split], contiguous: y's columns [split, C)
    pos_ptr,  # [T] int32, each row's position in its sequence, capped at MAX_TAPS
    map_ptr,  # with GATHER: [T] int, the row of x that holds sequence row t
    num_rows,
    channels,
    split,  # C without SPLIT
    stride_x,  # x's row stride (its channel stride is 1)
    norm_eps,
    K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_C: tl.constexpr,
    GATHER: tl.constexpr = False,
    SPLIT: tl.constexpr = False,
    NORM_DIM: tl.constexpr = 0,
    PARTS: tl.constexpr = 1,
):
    """``y[t, c] = act(b[c] + sum_j w[c, K-1-j] * x[t-j, c])`` over taps j with ``pos[t] >= j``;
    with GATHER, x's sequence row t is its row ``map[t]`` (y is in sequence order); with SPLIT,
    y's columns from ``split`` on go to a second tensor, those before it in PARTS blocks; with
    NORM_DIM, those are l2-normalised over each group of NORM_DIM (dividing BLOCK_C and a block).
    The grid's column blocks are ``cdiv(split, BLOCK_C)`` from column 0, then those from ``split``
    on, so that a program's columns are all before the split or all after it."""
    t0 = tl.program_id(0) * ROWS
    pid_c = tl.program_id(1)
    head_blocks = tl.cdiv(split, BLOCK_C)
    tail = False
    if SPLIT:
        tail = pid_c >= head_blocks
    if tail:
        cols = split + (pid_c - head_blocks) * BLOCK_C + tl.arange(0, BLOCK_C)
        _fwd_block(x_ptr, w_ptr, b_ptr, y2_ptr, pos_ptr, map_ptr, t0, cols, cols < channels, cols - split,
                   channels - split, num_rows, stride_x, norm_eps, K, HAS_BIAS, SILU, ROWS, BLOCK_C, GATHER,
                   0)  # fmt: skip
    else:
        cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
        _fwd_block(x_ptr, w_ptr, b_ptr, y_ptr, pos_ptr, map_ptr, t0, cols, cols < split,
                   _head_offsets(cols, split, num_rows, PARTS, NORM_DIM), split // PARTS, num_rows, stride_x,
                   norm_eps, K, HAS_BIAS, SILU, ROWS, BLOCK_C, GATHER, NORM_DIM)  # fmt: skip


@triton.jit
def _bwd_loads(x_ptr, dy_ptr, pos_ptr, map_ptr, t, stride_x, stride_dy, cols, col_ok, dy_offsets, num_rows,
               GATHER: tl.constexpr):  # fmt: skip
    """A backward step's loads for rows t, t-1, t-2, t-3: x rows t-3..t-6, then dy (at
    ``dy_offsets``) and pos of rows t..t-3."""
    xa = _row(x_ptr, t - 3, stride_x, cols, col_ok, num_rows, map_ptr, GATHER)
    xb = _row(x_ptr, t - 4, stride_x, cols, col_ok, num_rows, map_ptr, GATHER)
    xc = _row(x_ptr, t - 5, stride_x, cols, col_ok, num_rows, map_ptr, GATHER)
    xd = _row(x_ptr, t - 6, stride_x, cols, col_ok, num_rows, map_ptr, GATHER)
    ga = _row(dy_ptr, t, stride_dy, dy_offsets, col_ok, num_rows)
    gb = _row(dy_ptr, t - 1, stride_dy, dy_offsets, col_ok, num_rows)
    gc = _row(dy_ptr, t - 2, stride_dy, dy_offsets, col_ok, num_rows)
    gd = _row(dy_ptr, t - 3, stride_dy, dy_offsets, col_ok, num_rows)
    pa = _pos(pos_ptr, t, num_rows)
    pb = _pos(pos_ptr, t - 1, num_rows)
    pc = _pos(pos_ptr, t - 2, num_rows)
    pd = _pos(pos_ptr, t - 3, num_rows)
    return xa, xb, xc, xd, ga, gb, gc, gd, pa, pb, pc, pd


@triton.jit
def _bwd_row(dx_ptr, map_ptr, t, t0, x0, x1, x2, x3, p, dy, d1, d2, d3, q1, q2, q3, wa, wb, wc, wd, bias,
             db, dwa, dwb, dwc, dwd, cols, col_ok, num_rows, stride_dx, norm_eps, ROWS: tl.constexpr,
             BLOCK_C: tl.constexpr, SILU: tl.constexpr, NORM_DIM: tl.constexpr, GATHER: tl.constexpr,
             FULL: tl.constexpr):  # fmt: skip
    """One row t of the backward: from x rows t..t-3, pos ``p``, the output gradient ``dy`` and
    the dpre (``d1..d3``) and pos (``q1..q3``) of rows t+1..t+3, store dx[t] if the program owns
    row t, and return row t's dpre with the sums ``db, dw...`` plus row t's terms. FULL: the
    program owns row t and p and q1..q3 are at least 3."""
    pre = _preactivation(wa, wb, wc, wd, bias, x0, x1, x2, x3, p, FULL)
    y, dact = pre, 1.0  # the activation's output and derivative
    if SILU:
        sig = tl.sigmoid(pre)
        y, dact = pre * sig, sig * (1.0 + pre * (1.0 - sig))
    dpre = dy
    if NORM_DIM > 0:  # n = y * r with r = rsqrt(sum y^2 + eps): dy = r * dn - r^3 * y * sum(dn * y)
        r = tl.rsqrt(_group_sum(y * y, BLOCK_C, NORM_DIM) + norm_eps)
        dpre = r * dy - r * r * r * y * _group_sum(dy * y, BLOCK_C, NORM_DIM)
    dpre = dpre * dact
    if FULL:
        dx = wa * dpre + wb * d1 + wc * d2 + wd * d3
        ok = col_ok
        mine = dpre
        dwb += mine * x1
        dwc += mine * x2
        dwd += mine * x3
    else:
        dx = wa * dpre
        dx += tl.where(q1 >= 1, wb * d1, 0.0)
        dx += tl.where(q2 >= 2, wc * d2, 0.0)
        dx += tl.where(q3 >= 3, wd * d3, 0.0)
        tv = t + cols * 0
        own = (tv >= t0) & (tv < t0 + ROWS) & (tv < num_rows)
        ok = col_ok & own
        mine = tl.where(own, dpre, 0.0)
        dwb += tl.where(p >= 1, mine * x1, 0.0)
        dwc += tl.where(p >= 2, mine * x2, 0.0)
        dwd += tl.where(p >= 3, mine * x3, 0.0)
    dst = _src(map_ptr, t, num_rows, GATHER)
    tl.store(dx_ptr + dst * stride_dx + cols, dx.to(dx_ptr.dtype.element_ty), mask=ok)
    return dpre, db + mine, dwa + mine * x0, dwb, dwc, dwd


@triton.jit
def _bwd_step(dx_ptr, map_ptr, t, t0, x0, x1, x2, xa, xb, xc, xd, ga, gb, gc, gd, pa, pb, pc, pd, d1, d2, d3,
              q1, q2, q3, wa, wb, wc, wd, bias, db, dwa, dwb, dwc, dwd, cols, col_ok, num_rows, stride_dx, norm_eps,
              ROWS: tl.constexpr, BLOCK_C: tl.constexpr, SILU: tl.constexpr, NORM_DIM: tl.constexpr,
              GATHER: tl.constexpr, FULL: tl.constexpr):  # fmt: skip
    """Rows t, t-1, t-2, t-3 of the backward (:func:`_bwd_row`), from x rows t..t-2 (``x0..x2``)
    and t-3..t-6 (``xa..xd``), the dy (``ga..gd``) and pos (``pa..pd``) of rows t..t-3, and the
    dpre and pos of rows t+1..t+3; returns the four rows' dpre (row t first) and the sums."""
    ea, db, dwa, dwb, dwc, dwd = _bwd_row(
        dx_ptr, map_ptr, t, t0, x0, x1, x2, xa, pa, ga, d1, d2, d3, q1, q2, q3, wa, wb, wc, wd, bias,
        db, dwa, dwb, dwc, dwd, cols, col_ok, num_rows, stride_dx, norm_eps, ROWS, BLOCK_C, SILU, NORM_DIM, GATHER,
        FULL,
    )  # fmt: skip
    eb, db, dwa, dwb, dwc, dwd = _bwd_row(
        dx_ptr, map_ptr, t - 1, t0, x1, x2, xa, xb, pb, gb, ea, d1, d2, pa, q1, q2, wa, wb, wc, wd, bias,
        db, dwa, dwb, dwc, dwd, cols, col_ok, num_rows, stride_dx, norm_eps, ROWS, BLOCK_C, SILU, NORM_DIM, GATHER,
        FULL,
    )  # fmt: skip
    ec, db, dwa, dwb, dwc, dwd = _bwd_row(
        dx_ptr, map_ptr, t - 2, t0, x2, xa, xb, xc, pc, gc, eb, ea, d1, pb, pa, q1, wa, wb, wc, wd, bias,
        db, dwa, dwb, dwc, dwd, cols, col_ok, num_rows, stride_dx, norm_eps, ROWS, BLOCK_C, SILU, NORM_DIM, GATHER,
        FULL,
    )  # fmt: skip
    ed, db, dwa, dwb, dwc, dwd = _bwd_row(
        dx_ptr, map_ptr, t - 3, t0, xa, xb, xc, xd, pd, gd, ec, eb, ea, pc, pb, pa, wa, wb, wc, wd, bias,
        db, dwa, dwb, dwc, dwd, cols, col_ok, num_rows, stride_dx, norm_eps, ROWS, BLOCK_C, SILU, NORM_DIM, GATHER,
        FULL,
    )  # fmt: skip
    return ea, eb, ec, ed, db, dwa, dwb, dwc, dwd


@triton.jit
def _bwd_block(x_ptr, w_ptr, b_ptr, dy_ptr, dx_ptr, dw_ptr, db_ptr, pos_ptr, map_ptr, pid_t, cols, col_ok,
               dy_offsets, stride_dy, num_rows, channels, stride_x, stride_dx, norm_eps, K: tl.constexpr,
               HAS_BIAS: tl.constexpr, SILU: tl.constexpr, ROWS: tl.constexpr, BLOCK_C: tl.constexpr,
               GATHER: tl.constexpr, NORM_DIM: tl.constexpr):  # fmt: skip
    """The backward of rows ``[t0, t0 + ROWS)`` (``t0 = pid_t * ROWS``) of the channels ``cols``,
    dy's row t at ``dy_ptr + t * stride_dy + dy_offsets``: dx stored, dw and db's sums stored as
    this program's partial sums. Rows run from the last one down, in steps of ROW_STEP rows; the
    K-1 rows after the block are recomputed for their ``dpre``."""
    t0 = pid_t * ROWS
    wa, wb, wc, wd, bias = _taps(w_ptr, b_ptr, cols, col_ok, K, HAS_BIAS)
    top = t0 + ROWS + 3  # the first row streamed: the next three rows' dpre reach the block, and steps end on t0
    x0 = _row(x_ptr, top, stride_x, cols, col_ok, num_rows, map_ptr, GATHER)  # rows t, t-1, t-2, carried
    x1 = _row(x_ptr, top - 1, stride_x, cols, col_ok, num_rows, map_ptr, GATHER)
    x2 = _row(x_ptr, top - 2, stride_x, cols, col_ok, num_rows, map_ptr, GATHER)
    d1 = tl.zeros((BLOCK_C,), dtype=tl.float32)  # dpre of rows t+1, t+2, t+3, carried
    d2 = tl.zeros((BLOCK_C,), dtype=tl.float32)
    d3 = tl.zeros((BLOCK_C,), dtype=tl.float32)
    q1 = tl.full([], 0, tl.int32)  # pos of rows t+1, t+2, t+3
    q2 = tl.full([], 0, tl.int32)
    q3 = tl.full([], 0, tl.int32)
    db = tl.zeros((BLOCK_C,), dtype=tl.float32)
    dwa = tl.zeros((BLOCK_C,), dtype=tl.float32)  # weight columns K-1, K-2, K-3, K-4
    dwb = tl.zeros((BLOCK_C,), dtype=tl.float32)
    dwc = tl.zeros((BLOCK_C,), dtype=tl.float32)
    dwd = tl.zeros((BLOCK_C,), dtype=tl.float32)
    xa, xb, xc, xd, ga, gb, gc, gd, pa, pb, pc, pd = _bwd_loads(
        x_ptr, dy_ptr, pos_ptr, map_ptr, top, stride_x, stride_dy, cols, col_ok, dy_offsets, num_rows, GATHER
    )  # fmt: skip
    for i in range(0, ROWS + ROW_STEP, ROW_STEP):  # the next step's loads in flight while this step computes
        t = top - i
        na, nb, nc, nd, nga, ngb, ngc, ngd, npa, npb, npc, npd = _bwd_loads(
            x_ptr, dy_ptr, pos_ptr, map_ptr, t - ROW_STEP, stride_x, stride_dy, cols, col_ok, dy_offsets, num_rows,
            GATHER,
        )  # fmt: skip
        # FULL: the program owns every row, and every tap counts for them and for the rows above
        if (t < tl.minimum(num_rows, t0 + ROWS)) & (_lowest(pa, pb, pc, _lowest(pd, q1, q2, q3)) >= 3):
            ea, eb, ec, ed, db, dwa, dwb, dwc, dwd = _bwd_step(
                dx_ptr, map_ptr, t, t0, x0, x1, x2, xa, xb, xc, xd, ga, gb, gc, gd, pa, pb, pc, pd, d1, d2, d3,
                q1, q2, q3, wa, wb, wc, wd, bias, db, dwa, dwb, dwc, dwd, cols, col_ok, num_rows, stride_dx, norm_eps,
                ROWS, BLOCK_C, SILU, NORM_DIM, GATHER, True,
            )  # fmt: skip
        else:
            ea, eb, ec, ed, db, dwa, dwb, dwc, dwd = _bwd_step(
                dx_ptr, map_ptr, t, t0, x0, x1, x2, xa, xb, xc, xd, ga, gb, gc, gd, pa, pb, pc, pd, d1, d2, d3,
                q1, q2, q3, wa, wb, wc, wd, bias, db, dwa, dwb, dwc, dwd, cols, col_ok, num_rows, stride_dx, norm_eps,
                ROWS, BLOCK_C, SILU, NORM_DIM, GATHER, False,
            )  # fmt: skip
        x0, x1, x2 = xb, xc, xd
        d1, d2, d3 = ed, ec, eb
        q1, q2, q3 = pd, pc, pb
        xa, xb, xc, xd, ga, gb, gc, gd, pa, pb, pc, pd = na, nb, nc, nd, nga, ngb, ngc, ngd, npa, npb, npc, npd
    part = dw_ptr + pid_t.to(tl.int64) * channels * 4 + cols * 4
    tl.store(part + (K - 1), dwa, mask=col_ok)
    if K > 1:
        tl.store(part + (K - 2), dwb, mask=col_ok)
    if K > 2:
        tl.store(part + (K - 3), dwc, mask=col_ok)
    if K > 3:
        tl.store(part + (K - 4), dwd, mask=col_ok)
    tl.store(db_ptr + pid_t.to(tl.int64) * channels + cols, db, mask=col_ok)


@triton.jit
def cp_causal_conv1d_bwd_kernel(
    x_ptr,
    w_ptr,  # [C, K], contiguous
    b_ptr,  # [C] or a dummy (HAS_BIAS False)
    dy_ptr,  # dy's columns [0, split), with PARTS > 1 as the forward's y_ptr
    dy2_ptr,  # with SPLIT: dy's columns [split, C)
    dx_ptr,  # [T, C], contiguous
    dw_ptr,  # [programs along T, C, 4] float32 partial sums (weight column k at k)
    db_ptr,  # [programs along T, C] float32 partial sums
    pos_ptr,
    map_ptr,  # with GATHER: [T] int, the row of x (and of dx) that holds sequence row t
    num_rows,
    channels,
    split,  # C without SPLIT
    stride_x,
    stride_dy,
    stride_dy2,
    stride_dx,
    norm_eps,
    K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_C: tl.constexpr,
    GATHER: tl.constexpr = False,
    SPLIT: tl.constexpr = False,
    NORM_DIM: tl.constexpr = 0,
    PARTS: tl.constexpr = 1,
):
    """With ``dpre = dy * act'(pre)``: ``dx[t] = sum_s w[:, K-1-s] * dpre[t+s]`` over s with
    ``pos[t+s] >= s``; ``dw[:, K-1-j] = sum_t dpre[t] * x[t-j]`` over ``pos[t] >= j`` and
    ``db = sum_t dpre[t]``, over this program's rows. With GATHER, sequence row t of x and of dx
    is their row ``map[t]`` (dy is in sequence order). With SPLIT, dy's columns from ``split`` on
    come from a second tensor, those before it in PARTS blocks; with NORM_DIM, dy before ``split``
    is that of the forward's l2-normalised columns, taken back through the norm. The column
    blocks are laid out as the forward's."""
    pid_c = tl.program_id(1)
    head_blocks = tl.cdiv(split, BLOCK_C)
    tail = False
    if SPLIT:
        tail = pid_c >= head_blocks
    if tail:
        cols = split + (pid_c - head_blocks) * BLOCK_C + tl.arange(0, BLOCK_C)
        _bwd_block(x_ptr, w_ptr, b_ptr, dy2_ptr, dx_ptr, dw_ptr, db_ptr, pos_ptr, map_ptr, tl.program_id(0), cols,
                   cols < channels, cols - split, stride_dy2, num_rows, channels, stride_x, stride_dx, norm_eps, K,
                   HAS_BIAS, SILU, ROWS, BLOCK_C, GATHER, 0)  # fmt: skip
    else:
        cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
        _bwd_block(x_ptr, w_ptr, b_ptr, dy_ptr, dx_ptr, dw_ptr, db_ptr, pos_ptr, map_ptr, tl.program_id(0), cols,
                   cols < split, _head_offsets(cols, split, num_rows, PARTS, NORM_DIM), stride_dy, num_rows, channels,
                   stride_x, stride_dx, norm_eps, K, HAS_BIAS, SILU, ROWS, BLOCK_C, GATHER, NORM_DIM)  # fmt: skip
