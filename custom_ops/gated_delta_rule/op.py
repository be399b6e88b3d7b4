"""The chunked gated delta rule ops of the GDN core on packed THD sequences (docs/design.md
section 2, "Gated DeltaNet core").

``chunk_gated_delta_rule_forward`` and ``_backward`` are opaque custom ops
(:func:`custom_ops.runtime.registration.opaque_op`) around FLA's internal forward and backward
functions, whose own autograd entry points are ``@torch.compiler.disable``: Inductor calls
each as one extern node and never traces into FLA. The public ``chunk_gated_delta_rule`` is
a composite (:func:`custom_ops.runtime.registration.composite_op`) over the forward op. CPU tensors
run the torch reference of :mod:`custom_ops.gated_delta_rule.reference` (FLA's kernels do not run in
Triton's interpreter).
"""

from __future__ import annotations

from typing import Optional

import torch

from custom_ops.gated_delta_rule.fla import (
    FLA_CHUNK,
    fla_call,
    fla_module,
    fla_varlen_indices,
    precompile_varlen_indices,
)
from custom_ops.gated_delta_rule.reference import (
    chunk_gated_delta_rule_reference,
    chunk_gated_delta_rule_reference_backward,
)
from custom_ops.runtime.checks import check_index_tensor
from custom_ops.runtime.registration import NAMESPACE, composite_op, opaque_op
from custom_ops.runtime.validation import checked

__all__ = ["chunk_gated_delta_rule"]

# FLA's GDN kernels keep a [dk, dv] state tile in registers/shared memory.
MAX_HEAD_DIM = 256


def _check_gdn(q, k, v, g, beta, cu_seqlens) -> None:
    for name, t, dim in (("q", q, 3), ("k", k, 3), ("v", v, 3), ("g", g, 2), ("beta", beta, 2)):
        if t.dim() != dim:
            raise ValueError(f"{name} must be {dim}-D, got shape {tuple(t.shape)}")
        if not t.dtype.is_floating_point:
            raise TypeError(f"{name} must be floating point, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    num_rows, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    if k.shape != q.shape:
        raise ValueError(f"q and k must have one shape [T, Hk, dk], got {tuple(q.shape)} and {tuple(k.shape)}")
    if v.shape[0] != num_rows or tuple(g.shape) != (num_rows, hv) or tuple(beta.shape) != (num_rows, hv):
        raise ValueError(
            f"v must be [T, Hv, dv] and g, beta [T, Hv] with T = {num_rows}; got v {tuple(v.shape)}, "
            f"g {tuple(g.shape)}, beta {tuple(beta.shape)}"
        )
    if hk == 0 or hv % hk != 0:
        raise ValueError(f"the value heads Hv = {hv} must be a multiple of the key heads Hk = {hk}")
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise TypeError(f"q, k, v must have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.device.type == "cuda" and max(dk, dv) > MAX_HEAD_DIM:
        raise ValueError(f"FLA's kernels take head dims up to {MAX_HEAD_DIM}, got dk = {dk}, dv = {dv}")
    check_index_tensor("cu_seqlens", cu_seqlens, q.device)


def _check_fla_indices(cu_seqlens, fla_cu_seqlens, chunk_indices, num_rows: int) -> None:
    """The shapes :func:`custom_ops.gated_delta_rule.fla.fla_varlen_indices` gives for ``cu_seqlens`` and T rows."""
    num_seqs = cu_seqlens.shape[0] - 1
    check_index_tensor("fla_cu_seqlens", fla_cu_seqlens, cu_seqlens.device)
    if fla_cu_seqlens.shape[0] != num_seqs + 2 or tuple(chunk_indices.shape) != (num_rows // FLA_CHUNK + num_seqs, 2):
        raise ValueError(
            f"fla_cu_seqlens and chunk_indices must be fla_varlen_indices(cu_seqlens, {num_rows}): shapes "
            f"[{num_seqs + 2}] and [{num_rows // FLA_CHUNK + num_seqs}, 2], got {tuple(fla_cu_seqlens.shape)} and "
            f"{tuple(chunk_indices.shape)}"
        )


def _resolve_scale(q: torch.Tensor, scale: Optional[float]) -> float:
    return q.shape[-1] ** -0.5 if scale is None else scale


def _uses_fla(q: torch.Tensor) -> bool:
    # CUDA only: FLA's state-passing kernel does not run in Triton's interpreter (its
    # loop counter is a Python int there), so CPU tensors always take the reference.
    return q.device.type == "cuda" and q.shape[0] > 0


def _aux_shapes(q, v):
    """Shapes of what the forward keeps for FLA's backward; nothing on the reference path."""
    if not _uses_fla(q):
        return (0,), (0,)
    return (v.shape[0], v.shape[1]), (v.shape[0], v.shape[1], FLA_CHUNK)


@opaque_op(f"{NAMESPACE}::chunk_gated_delta_rule_forward", mutates_args=())
def chunk_gated_delta_rule_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: Optional[float] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(o [T, Hv, dv], g_cum, A, fla_cu_seqlens, chunk_indices)``: the output of
    :func:`chunk_gated_delta_rule` and what its backward needs.

    ``fla_cu_seqlens`` and ``chunk_indices`` are :func:`custom_ops.gated_delta_rule.fla.fla_varlen_indices`
    of ``cu_seqlens``, returned so that the backward reuses them instead of building them again;
    ``chunk_indices`` flattened to ``[2 * rows]``, a length that is never 1, so that compiling
    for shapes that vary does not guard on its row count being 1.

    CUDA: FLA's ``chunk_gated_delta_rule_fwd``; ``g_cum [T, Hv]`` (fp32) is g
    cumulated within each 64-row chunk (in log2 units) and ``A [T, Hv, 64]`` (q's
    dtype) the solved ``(I + tril(beta K K^T))^{-1}`` blocks, the two tensors FLA's
    own autograd keeps besides the inputs. CPU reference path: both are empty.
    """
    _check_gdn(q, k, v, g, beta, cu_seqlens)
    scale = _resolve_scale(q, scale)
    fla_cu_seqlens, chunk_indices = fla_varlen_indices(cu_seqlens, q.shape[0])
    if not _uses_fla(q):
        o = chunk_gated_delta_rule_reference(q, k, v, g, beta, cu_seqlens, scale)
        return o, g.new_empty(0, dtype=torch.float32), q.new_empty(0), fla_cu_seqlens, chunk_indices.view(-1)
    chunk_gated_delta_rule_fwd = fla_module("fla.ops.gated_delta_rule.chunk").chunk_gated_delta_rule_fwd

    with fla_call(q.device):
        g_cum, o, A, _, _, _ = chunk_gated_delta_rule_fwd(
            q=q.contiguous().unsqueeze(0),
            k=k.contiguous().unsqueeze(0),
            v=v.contiguous().unsqueeze(0),
            g=g.contiguous().unsqueeze(0),
            beta=beta.contiguous().unsqueeze(0),
            scale=scale,
            initial_state=None,
            output_final_state=False,
            cu_seqlens=fla_cu_seqlens,
            chunk_indices=chunk_indices,
            chunk_size=FLA_CHUNK,
        )
    return o.squeeze(0).to(q.dtype), g_cum.squeeze(0), A.squeeze(0), fla_cu_seqlens, chunk_indices.view(-1)


@chunk_gated_delta_rule_forward.register_fake
def _(q, k, v, g, beta, cu_seqlens, scale=None):
    _check_gdn(q, k, v, g, beta, cu_seqlens)
    if _uses_fla(q):
        precompile_varlen_indices(cu_seqlens, q.shape[0])
    g_shape, a_shape = _aux_shapes(q, v)
    num_seqs = cu_seqlens.shape[0] - 1
    return (
        v.new_empty(v.shape, dtype=q.dtype),
        g.new_empty(g_shape, dtype=torch.float32),
        q.new_empty(a_shape),
        cu_seqlens.new_empty(num_seqs + 2),
        cu_seqlens.new_empty(2 * (q.shape[0] // FLA_CHUNK + num_seqs)),
    )


@opaque_op(f"{NAMESPACE}::chunk_gated_delta_rule_backward", mutates_args=())
def chunk_gated_delta_rule_backward(
    grad_o: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    fla_cu_seqlens: torch.Tensor,
    chunk_indices: torch.Tensor,
    g_cum: torch.Tensor,
    A: torch.Tensor,
    scale: Optional[float] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dg, dbeta) of :func:`chunk_gated_delta_rule`, from the forward's saved tensors.

    CUDA: FLA's ``chunk_gated_delta_rule_bwd`` (it recomputes w, u and the chunk
    states h from A and g_cum, as in FLA's own autograd). GVA: FLA sums the key-head
    gradients over each group of value heads. CPU: the reverse scan of the reference.
    """
    chunk_indices = chunk_indices.view(-1, 2)
    _check_fla_indices(cu_seqlens, fla_cu_seqlens, chunk_indices, q.shape[0])
    scale = _resolve_scale(q, scale)
    if not _uses_fla(q):
        return chunk_gated_delta_rule_reference_backward(grad_o, q, k, v, g, beta, cu_seqlens, scale)
    chunk_gated_delta_rule_bwd = fla_module("fla.ops.gated_delta_rule.chunk").chunk_gated_delta_rule_bwd

    with fla_call(q.device):
        dq, dk, dv, dbeta, dg, _, _, _ = chunk_gated_delta_rule_bwd(
            q=q.contiguous().unsqueeze(0),
            k=k.contiguous().unsqueeze(0),
            v=v.contiguous().unsqueeze(0),
            g=g_cum.unsqueeze(0),
            beta=beta.contiguous().unsqueeze(0),
            A=A.unsqueeze(0),
            scale=scale,
            initial_state=None,
            do=grad_o.contiguous().unsqueeze(0),
            dht=None,
            cu_seqlens=fla_cu_seqlens,
            chunk_indices=chunk_indices,
            chunk_size=FLA_CHUNK,
        )
    return (
        dq.squeeze(0).to(q.dtype),
        dk.squeeze(0).to(k.dtype),
        dv.squeeze(0).to(v.dtype),
        dg.squeeze(0).to(g.dtype),
        dbeta.squeeze(0).to(beta.dtype),
    )


@chunk_gated_delta_rule_backward.register_fake
def _(grad_o, q, k, v, g, beta, cu_seqlens, fla_cu_seqlens, chunk_indices, g_cum, A, scale=None):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), g.new_empty(g.shape), beta.new_empty(beta.shape)


def _gdn_setup_context(ctx, inputs, output):
    q, k, v, g, beta, cu_seqlens, scale = inputs
    _, g_cum, A, fla_cu_seqlens, chunk_indices = output
    ctx.save_for_backward(q, k, v, g, beta, cu_seqlens, fla_cu_seqlens, chunk_indices, g_cum, A)
    ctx.scale = scale


def _gdn_backward(ctx, grad_o, *_grad_aux):
    dq, dk, dv, dg, dbeta = torch.ops.cp_ops.chunk_gated_delta_rule_backward(grad_o, *ctx.saved_tensors, ctx.scale)
    return dq, dk, dv, dg, dbeta, None, None


chunk_gated_delta_rule_forward.register_autograd(_gdn_backward, setup_context=_gdn_setup_context)


# The public op returns o alone. It is CompositeImplicitAutograd over the forward op above,
# so autograd and tracing see chunk_gated_delta_rule_forward (with its fake and backward)
# and the auxiliary outputs reach the backward without being recomputed.
@composite_op(
    f"{NAMESPACE}::chunk_gated_delta_rule",
    "(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor cu_seqlens, float? scale=None) -> Tensor",
)
def _chunk_gated_delta_rule_composite(q, k, v, g, beta, cu_seqlens, scale=None):
    cu_seqlens = checked("cumulative", cu_seqlens, (), q.shape[0])
    return torch.ops.cp_ops.chunk_gated_delta_rule_forward(q, k, v, g, beta, cu_seqlens, scale)[0]


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: Optional[float] = None,
) -> torch.Tensor:
    """Chunked gated delta rule over packed sequences (``torch.ops.cp_ops.chunk_gated_delta_rule``).

    Per sequence (zero initial state) and value head h, with key head ``h // (Hv/Hk)``:
    ``S_t = exp(g_t) S_{t-1};  S_t += k_t (beta_t (v_t - S_t^T k_t))^T;  o_t = scale S_t^T q_t``.
    q, k ``[T, Hk, dk]`` (not normalised here), v ``[T, Hv, dv]``, g (log decay, float32)
    and beta ``[T, Hv]``, ``Hv % Hk == 0``, cu_seqlens ``[B+1]`` (``cu[-1] = T``), scale
    default ``dk ** -0.5``. Returns o ``[T, Hv, dv]`` in q's dtype. Differentiable in q, k,
    v, g, beta. CUDA: FLA's chunked kernels, q/k/v bf16 or fp16, ``dk, dv <= 256``; CPU: the
    sequential torch reference (docs/design.md section 2).
    """
    return torch.ops.cp_ops.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens, scale)
