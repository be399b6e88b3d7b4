"""All-gather CP attention through FlashAttention 4's varlen kernels (docs/design.md section 4.2,
"Kernel backends"): :func:`fa4_tables` states a rank's local chunks as FlashAttention 4's query
and key ranges (one call for the first chunks, one for the second, whose key prefixes overlap;
one call at W = 1), and two opaque ops run the calls forward and backward, so ``torch.compile``
sees one extern node each way.
"""

from __future__ import annotations

import torch

from custom_ops.ag_attention.kernels import zero_uncovered_rows_kernel
from custom_ops.ag_attention.segments import ag_thd_segments
from custom_ops.runtime.launch import launch_direct, use_triton
from custom_ops.runtime.registration import NAMESPACE, opaque_op
from custom_ops.runtime.tiles import cdiv, next_power_of_2
from custom_ops.thd.index import local_offsets

__all__ = ["fa4_attention", "fa4_tables", "fa4_varlen_backward", "fa4_varlen_forward", "set_interface"]

_interface_override = None


def set_interface(interface) -> None:
    """Run the backend's calls through ``interface``, an object with FlashAttention 4's
    ``_flash_attn_fwd`` and ``_flash_attn_bwd`` (the CPU tests pass a torch emulation of their
    semantics); None: FlashAttention 4's own again."""
    global _interface_override
    _interface_override = interface


def _interface():
    """FlashAttention 4's interface module (imported at the first call: it loads the CuTe DSL)."""
    if _interface_override is not None:
        return _interface_override
    from flash_attn.cute import interface

    return interface


def fa4_tables(cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor, cp_size: int, rank, causal: bool):
    """``(cu_seqlens_q [C, B+1], seqused_q [C, B], cu_seqlens_k [C, B+1], seqused_k [C, B])``
    (int32, on the layout's device, no host sync): FlashAttention 4's arguments for C calls that
    together give rank ``rank`` (an int or a 0-d tensor) its attention. Query rows index the local
    shard, key rows the gathered keys in sequence order.

    ``cp_size == 1``: one call, every sequence's real rows against themselves. Else call h (0, 1)
    takes the h-th local chunk of every sequence (its real rows) against its sequence's keys up to
    the chunk's end (causal) or all of them; a chunk without real rows gets no keys either, so
    that no call writes a gradient for them.
    """
    cup = cu_seqlens_padded.to(torch.int32)
    if cp_size == 1:
        lens = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int32)
        return cup[None], lens[None], cup[None], lens[None]
    end = local_offsets(cup[-1:], cp_size)
    calls = []
    for h in (0, 1):
        # window_right -1: under causality a chunk's keys end where the chunk ends, which is what
        # aligns FlashAttention 4's bottom-right mask with the chunk's position
        q_start, q_len, _, _, k_len = ag_thd_segments(cu_seqlens, cu_seqlens_padded, cp_size, rank, causal, -1, (h,))
        calls.append((torch.cat([q_start, end]), q_len, cup, torch.where(q_len > 0, k_len, 0)))
    return tuple(torch.stack(parts) for parts in zip(*calls))


# rows a program of the zeroing kernel tests; the columns of its rows it zeroes per store
_ZERO_ROWS, _ZERO_COLS = 128, 1024


def zero_uncovered_rows(x: torch.Tensor, cu_seqlens_q: torch.Tensor, seqused_q: torch.Tensor) -> torch.Tensor:
    """Zeroes, in place, the rows of ``x [T, ...]`` that no call of the ``[C, ...]`` tables covers
    (:func:`fa4_tables`; FlashAttention 4 writes only the rows it covers): the rows it does cover
    are not touched, so the cost is the padding rows', not the tensor's. Returns ``x``."""
    rows, cols = x.shape[0], x[:1].numel()
    calls, batch = seqused_q.shape
    if use_triton(x):
        if rows > 0 and cols > 0:
            launch_direct(
                zero_uncovered_rows_kernel, (cdiv(rows, _ZERO_ROWS),), x, cu_seqlens_q.contiguous(),
                seqused_q.contiguous(), calls, batch, rows, cols, BLOCK_R=_ZERO_ROWS,
                BLOCK_D=min(_ZERO_COLS, next_power_of_2(cols)),
            )  # fmt: skip
        return x
    g = torch.arange(rows, device=x.device)
    covered = torch.zeros(rows, dtype=torch.bool, device=x.device)
    for c in range(calls if batch > 0 else 0):
        i = torch.searchsorted(cu_seqlens_q[c, :-1], g, right=True) - 1
        found, i = i >= 0, i.clamp(min=0)
        covered |= found & (g < cu_seqlens_q[c, i] + seqused_q[c, i])
    x[~covered] = 0
    return x


def _window(causal: bool, window_left: int) -> dict:
    """FlashAttention 4's window arguments for the op's: causal with an optional left window (the
    right one is moot under causality), or none (the backend takes no other form)."""
    return {"window_size_left": window_left if causal and window_left >= 0 else None, "window_size_right": None}


@opaque_op(f"{NAMESPACE}::fa4_varlen_forward", mutates_args=())
def fa4_varlen_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seqused_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    seqused_k: torch.Tensor,
    causal: bool,
    window_left: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [Tq, Hq, Dv], lse [C, Hq, Tq] float32)``: FlashAttention 4's varlen forward, one call
    per row of the ``[C, ...]`` tables (:func:`fa4_tables`), all writing ``out``; rows no call
    covers are zeroed after. ``lse[c]``: call c's log-sum-exp on its rows (-inf on the others; its
    backward reads only its rows)."""
    fa = _interface()
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[2])
    lse = q.new_full((cu_seqlens_q.shape[0], q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32)
    for c in range(cu_seqlens_q.shape[0]):
        fa._flash_attn_fwd(
            q, k, v, cu_seqlens_q=cu_seqlens_q[c], cu_seqlens_k=cu_seqlens_k[c], seqused_q=seqused_q[c],
            seqused_k=seqused_k[c], softmax_scale=scale, causal=causal, **_window(causal, window_left),
            return_lse=True, out=out, lse=lse[c],
        )  # fmt: skip
    return zero_uncovered_rows(out, cu_seqlens_q, seqused_q), lse


@fa4_varlen_forward.register_fake
def _(q, k, v, cu_seqlens_q, seqused_q, cu_seqlens_k, seqused_k, causal, window_left, scale):
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[2])
    return out, q.new_empty(cu_seqlens_q.shape[0], q.shape[1], q.shape[0], dtype=torch.float32)


@opaque_op(f"{NAMESPACE}::fa4_varlen_backward", mutates_args=())
def fa4_varlen_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seqused_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    seqused_k: torch.Tensor,
    causal: bool,
    window_left: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of :func:`fa4_varlen_forward`: FlashAttention 4's varlen backward per call,
    dq written by every call into one tensor (their query rows are disjoint), each call's dk/dv
    into zeros of its own and summed (their key rows overlap). Rows no call covers are zero (dq's
    zeroed after the calls)."""
    fa = _interface()
    dq = q.new_empty(q.shape)
    dk, dv = k.new_zeros(k.shape), v.new_zeros(v.shape)
    for c in range(cu_seqlens_q.shape[0]):
        dk_c, dv_c = (dk, dv) if c == 0 else (k.new_zeros(k.shape), v.new_zeros(v.shape))
        fa._flash_attn_bwd(
            q, k, v, out, grad_out, lse[c], softmax_scale=scale, causal=causal, **_window(causal, window_left),
            cu_seqlens_q=cu_seqlens_q[c], cu_seqlens_k=cu_seqlens_k[c], seqused_q=seqused_q[c],
            seqused_k=seqused_k[c], dq=dq, dk=dk_c, dv=dv_c,
        )  # fmt: skip
        if c > 0:
            dk += dk_c
            dv += dv_c
    return zero_uncovered_rows(dq, cu_seqlens_q, seqused_q), dk, dv


@fa4_varlen_backward.register_fake
def _(grad_out, q, k, v, out, lse, cu_seqlens_q, seqused_q, cu_seqlens_k, seqused_k, causal, window_left, scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, *tables, ctx.causal, ctx.window_left, ctx.scale = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], *tables)


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, *tables = ctx.saved_tensors
    dq, dk, dv = fa4_varlen_backward(grad_out, q, k, v, out, lse, *tables, ctx.causal, ctx.window_left, ctx.scale)
    return dq, dk, dv, None, None, None, None, None, None, None


fa4_varlen_forward.register_autograd(_backward, setup_context=_setup_context)


def fa4_attention(q, k, v, tables, causal: bool, window_left: int, scale: float | None) -> torch.Tensor:
    """``out [Tq, Hq, D]`` of q against k, v (the keys in sequence order) through
    :func:`fa4_varlen_forward` with ``tables`` (:func:`fa4_tables`); differentiable."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return fa4_varlen_forward(q, k, v, *tables, causal, window_left, scale)[0]
