"""Triton device functions shared by the kernels of several ops."""

import triton
import triton.language as tl


@triton.jit
def search_sorted_right(sorted_ptr, n, values):
    """For every entry v of ``values``: the largest i in [0, n) with sorted[i] <= v, or -1.

    ``sorted_ptr[0:n]`` must be non-decreasing. A fixed number of halving steps
    (the bit length of n) runs for all lanes at once; lanes whose interval is
    already empty stop loading, so nothing past ``sorted_ptr[n-1]`` is read.
    Equal entries (zero-length sequences) resolve to the last of them, the
    one whose segment actually holds ``v``.
    """
    lo = tl.zeros_like(values)  # number of entries known to be <= v
    hi = tl.zeros_like(values) + n
    n_iter = 0
    t = n
    while t > 0:
        t = t >> 1
        n_iter += 1
    for _ in range(n_iter):
        active = lo < hi
        mid = (lo + hi) // 2
        pivot = tl.load(sorted_ptr + mid, mask=active, other=0)
        le = pivot <= values
        lo = tl.where(active & le, mid + 1, lo)
        hi = tl.where(active & (~le), mid, hi)
    return lo - 1
