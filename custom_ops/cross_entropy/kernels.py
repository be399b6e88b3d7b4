"""Triton kernel of the linear cross-entropy's chunk step (``custom_ops.linear_cross_entropy``):
one program a row of a logits chunk, in the logits' own dtype, two passes over the row (an online
log-sum-exp, then the gradient written over the logits), where the torch form makes about six
over a float32 copy. The design: docs/design.md section 2, "Linear cross-entropy".
"""

import triton
import triton.language as tl

# Columns a program loads at a time (a power of two; a row's tail is masked)
BLOCK_COLS = 4096


@triton.jit
def cross_entropy_rows_kernel(logits_ptr, targets_ptr, loss_ptr, stride_row, num_cols, ignore_index,
                              GRAD: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """``loss[r] = logsumexp(logits[r]) - logits[r, target[r]]`` in float32 (0 where the target is
    ``ignore_index``); with GRAD, ``logits[r]`` is overwritten by its gradient, ``softmax - onehot``
    (zero where the target is ``ignore_index``), in the logits' dtype."""
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    target = tl.load(targets_ptr + row).to(tl.int64)
    valid = target != ignore_index
    top = tl.full([BLOCK], float("-inf"), tl.float32)  # each lane's running max and sum of exp
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, num_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < num_cols, other=float("-inf")).to(tl.float32)
        new_top = tl.maximum(top, x)
        # a lane that has seen only masked columns keeps total 0 (shifting by 0, not by -inf)
        shift = tl.where(new_top > float("-inf"), new_top, 0.0)
        total = total * tl.exp(top - shift) + tl.exp(x - shift)
        top = new_top
    row_max = tl.max(top, axis=0)
    lse = row_max + tl.log(tl.sum(total * tl.exp(top - row_max), axis=0))
    # a target outside [0, num_cols) reads nothing (the op does not check labels: no host sync)
    picked = tl.load(base + target, mask=valid & (target >= 0) & (target < num_cols), other=0.0).to(tl.float32)
    tl.store(loss_ptr + row, tl.where(valid, lse - picked, 0.0))
    if GRAD:
        for start in range(0, num_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            ok = cols < num_cols
            x = tl.load(base + cols, mask=ok, other=0.0).to(tl.float32)
            grad = tl.exp(x - lse) - tl.where(cols == target, 1.0, 0.0)
            tl.store(base + cols, tl.where(valid, grad, 0.0).to(logits_ptr.dtype.element_ty), mask=ok)
