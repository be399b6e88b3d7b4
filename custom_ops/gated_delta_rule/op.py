"""The chunked gated delta rule ops of the GDN core on packed THD sequences (docs/design.md
section 2, "Gated DeltaNet core" and "Kernel backends").

``chunk_gated_delta_rule_forward`` / ``_backward`` (with optional per-sequence initial and
final states) are opaque custom ops around a kernel backend's internal
forward and backward (FLA's or FlashQLA's, :mod:`custom_ops.gated_delta_rule.backends`), whose
own autograd entry points are ``@torch.compiler.disable``: Inductor calls each as one extern node.
The public ``chunk_gated_delta_rule`` and ``chunk_gated_delta_rule_with_state`` are composites
(:func:`custom_ops.runtime.registration.composite_op`) over the forward op. CPU tensors run
the torch references of :mod:`custom_ops.gated_delta_rule.reference`.
"""

from __future__ import annotations

from typing import Optional

import torch

from custom_ops.gated_delta_rule import backends
from custom_ops.fla.adapter import (
    FLA_CHUNK,
    fla_call,
    fla_grads,
    fla_state,
    fla_module,
    fla_varlen_indices,
    precompile_varlen_indices,
)
from custom_ops.gated_delta_rule.flash_qla import flash_qla_backward, flash_qla_forward
from custom_ops.gated_delta_rule.reference import (
    chunk_gated_delta_rule_reference,
    chunk_gated_delta_rule_reference_backward,
    chunk_gated_delta_rule_with_state_reference,
    chunk_gated_delta_rule_with_state_reference_backward,
    state_dtype,
)
from custom_ops.runtime.registration import NAMESPACE, composite_op, opaque_op
from custom_ops.thd.checked_mode import call_checked
from custom_ops.thd.checks import check_index_tensor
from custom_ops.thd.validation import checked

__all__ = ["chunk_gated_delta_rule", "chunk_gated_delta_rule_with_state"]

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


def _check_state(name: str, state: Optional[torch.Tensor], q, v, cu_seqlens) -> None:
    """A per-sequence state ``[B, Hv, dk, dv]`` of :func:`custom_ops.gated_delta_rule.reference.state_dtype`
    on q's device, or None."""
    if state is None:
        return
    shape = (cu_seqlens.shape[0] - 1, v.shape[1], q.shape[2], v.shape[2])
    if tuple(state.shape) != shape:
        raise ValueError(f"{name} must be [B, Hv, dk, dv] = {list(shape)}, got shape {tuple(state.shape)}")
    if state.dtype != state_dtype(q):
        raise TypeError(f"{name} must be {state_dtype(q)} for q of {q.dtype}, got {state.dtype}")
    if state.device != q.device:
        raise ValueError(f"{name} is on {state.device} but q is on {q.device}")


def _check_fla_indices(cu_seqlens, fla_cu_seqlens, chunk_indices, num_rows: int) -> None:
    """The shapes :func:`custom_ops.fla.adapter.fla_varlen_indices` gives for ``cu_seqlens`` and T rows."""
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


def _aux_shapes(q, v, backend: str):
    """Shapes of what the forward keeps for the kernels' backward (FLA's and FlashQLA's alike);
    nothing on the reference path. CPU tensors always take the reference: FLA's state-passing
    kernel does not run in Triton's interpreter (its loop counter is a Python int there)."""
    if backend == "reference":
        return (0,), (0,)
    return (v.shape[0], v.shape[1]), (v.shape[0], v.shape[1], FLA_CHUNK)


def _forward_fake(q, k, v, g, beta, cu_seqlens, backend):
    """Fakes of ``(o, g_cum, A, fla_cu_seqlens, chunk_indices)``, the forward ops' outputs besides
    the final state; starts compiling the index kernel the call will launch."""
    _check_gdn(q, k, v, g, beta, cu_seqlens)
    backend = backends.resolve(q, v, backend)
    if backend != "reference":
        precompile_varlen_indices(cu_seqlens, q.shape[0])
    g_shape, a_shape = _aux_shapes(q, v, backend)
    num_seqs = cu_seqlens.shape[0] - 1
    return (
        v.new_empty(v.shape, dtype=q.dtype),
        g.new_empty(g_shape, dtype=torch.float32),
        q.new_empty(a_shape),
        cu_seqlens.new_empty(num_seqs + 2),
        cu_seqlens.new_empty(2 * (q.shape[0] // FLA_CHUNK + num_seqs)),
    )


def _fla_forward(q, k, v, g, beta, scale, fla_cu_seqlens, chunk_indices, initial_state=None, output_final_state=False):
    """``(o, g_cum, A, final_state)`` from FLA's ``chunk_gated_delta_rule_fwd`` on CUDA; ``final_state``
    ``[B, Hv, dk, dv]`` float32 where ``output_final_state``, else None."""
    chunk_gated_delta_rule_fwd = fla_module("fla.ops.gated_delta_rule.chunk").chunk_gated_delta_rule_fwd

    with fla_call(q.device):
        g_cum, o, A, final_state, _, _ = chunk_gated_delta_rule_fwd(
            q=q.contiguous().unsqueeze(0),
            k=k.contiguous().unsqueeze(0),
            v=v.contiguous().unsqueeze(0),
            g=g.contiguous().unsqueeze(0),
            beta=beta.contiguous().unsqueeze(0),
            scale=scale,
            initial_state=fla_state(initial_state),
            output_final_state=output_final_state,
            cu_seqlens=fla_cu_seqlens,
            chunk_indices=chunk_indices,
            chunk_size=FLA_CHUNK,
        )
    # FLA's states are float32 [B+1, Hv, dk, dv]; the last is the appended empty sequence's
    final_state = final_state[:-1] if output_final_state else None
    return o.squeeze(0).to(q.dtype), g_cum.squeeze(0), A.squeeze(0), final_state


def _fla_backward(grad_o, q, k, v, g, beta, fla_cu_seqlens, chunk_indices, g_cum, A, scale,
                  initial_state=None, grad_final_state=None):  # fmt: skip
    """``(dq, dk, dv, dg, dbeta, dh0)`` from FLA's ``chunk_gated_delta_rule_bwd`` on CUDA (it recomputes
    w, u and the chunk states h from A, g_cum and the initial state, as in FLA's own autograd);
    ``dh0`` ``[B, Hv, dk, dv]`` float32 where ``initial_state`` is given, else None."""
    chunk_gated_delta_rule_bwd = fla_module("fla.ops.gated_delta_rule.chunk").chunk_gated_delta_rule_bwd

    with fla_call(q.device):
        dq, dk, dv, dbeta, dg, dh0, _, _ = chunk_gated_delta_rule_bwd(
            q=q.contiguous().unsqueeze(0),
            k=k.contiguous().unsqueeze(0),
            v=v.contiguous().unsqueeze(0),
            g=g_cum.unsqueeze(0),
            beta=beta.contiguous().unsqueeze(0),
            A=A.unsqueeze(0),
            scale=scale,
            initial_state=fla_state(initial_state),
            do=grad_o.contiguous().unsqueeze(0),
            dht=fla_state(grad_final_state),
            cu_seqlens=fla_cu_seqlens,
            chunk_indices=chunk_indices,
            chunk_size=FLA_CHUNK,
        )
    return fla_grads((dq, dk, dv, dg, dbeta, dh0), q, k, v, g, beta, initial_state)


# The CUDA backends' forward and backward, one signature each (docs/design.md section 2).
_KERNEL_FORWARD = {"fla": _fla_forward, "flashqla": flash_qla_forward}
_KERNEL_BACKWARD = {"fla": _fla_backward, "flashqla": flash_qla_backward}


@opaque_op(f"{NAMESPACE}::chunk_gated_delta_rule_forward", mutates_args=())
def chunk_gated_delta_rule_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(o [T, Hv, dv], final_state, g_cum, A, fla_cu_seqlens, chunk_indices)``: the outputs of
    :func:`chunk_gated_delta_rule` (no states) or :func:`chunk_gated_delta_rule_with_state`
    and what their backward needs. ``final_state`` ``[B, Hv, dk, dv]`` (the state dtype) where
    ``output_final_state``, else empty. ``fla_cu_seqlens`` and ``chunk_indices`` are
    :func:`custom_ops.fla.adapter.fla_varlen_indices` of ``cu_seqlens``, for the backward to
    reuse; ``chunk_indices`` flattened to ``[2 * rows]``, never of length 1 (no guard on it).

    CUDA: ``backend``'s ``chunk_gated_delta_rule_fwd`` (``auto``: resolved at the call); ``g_cum
    [T, Hv]`` (fp32, g cumulated per 64-row chunk) and ``A [T, Hv, 64]`` (q's dtype, the solved
    ``(I + tril(beta K K^T))^{-1}`` blocks) are what its backward needs. CPU: the stateless
    reference, or the stateful one where a state goes in or comes out; both empty.
    """
    _check_gdn(q, k, v, g, beta, cu_seqlens)
    _check_state("initial_state", initial_state, q, v, cu_seqlens)
    backend = backends.resolve(q, v, backend)
    scale = _resolve_scale(q, scale)
    fla_cu_seqlens, chunk_indices = fla_varlen_indices(cu_seqlens, q.shape[0])
    no_state = q.new_empty(0, dtype=state_dtype(q))
    if backend == "reference":
        if initial_state is None and not output_final_state:
            o, final_state = chunk_gated_delta_rule_reference(q, k, v, g, beta, cu_seqlens, scale), no_state
        else:
            o, final_state = chunk_gated_delta_rule_with_state_reference(
                q, k, v, g, beta, cu_seqlens, scale, initial_state
            )
        g_cum, A = g.new_empty(0, dtype=torch.float32), q.new_empty(0)
    else:
        o, g_cum, A, final_state = _KERNEL_FORWARD[backend](
            q, k, v, g, beta, scale, fla_cu_seqlens, chunk_indices, initial_state, output_final_state=output_final_state
        )
    final_state = final_state.to(state_dtype(q)) if output_final_state else no_state
    return o, final_state, g_cum, A, fla_cu_seqlens, chunk_indices.view(-1)


@chunk_gated_delta_rule_forward.register_fake
def _(q, k, v, g, beta, cu_seqlens, scale=None, initial_state=None, output_final_state=False, backend="auto"):
    o, g_cum, A, fla_cu_seqlens, chunk_indices = _forward_fake(q, k, v, g, beta, cu_seqlens, backend)
    _check_state("initial_state", initial_state, q, v, cu_seqlens)
    state_shape = (cu_seqlens.shape[0] - 1, v.shape[1], q.shape[2], v.shape[2]) if output_final_state else (0,)
    return o, q.new_empty(state_shape, dtype=state_dtype(q)), g_cum, A, fla_cu_seqlens, chunk_indices


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
    initial_state: Optional[torch.Tensor] = None,
    grad_final_state: Optional[torch.Tensor] = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dg, dbeta, d_initial_state) of :func:`chunk_gated_delta_rule_forward`, from its
    saved tensors and the final state's gradient (None: zero, or no final state); ``backend``
    the forward's. ``d_initial_state`` is empty where ``initial_state`` is None.

    CUDA: the backend's ``chunk_gated_delta_rule_bwd`` with ``initial_state`` and ``dht`` (it
    recomputes w, u and the chunk states h from A and g_cum, as in its own autograd). GVA: the
    key-head gradients are summed over each group of value heads. CPU: the reverse scan of the
    reference, the stateful one where a state goes in or a final state's gradient comes back.
    """
    chunk_indices = chunk_indices.view(-1, 2)
    _check_fla_indices(cu_seqlens, fla_cu_seqlens, chunk_indices, q.shape[0])
    _check_state("initial_state", initial_state, q, v, cu_seqlens)
    _check_state("grad_final_state", grad_final_state, q, v, cu_seqlens)
    backend = backends.resolve(q, v, backend)
    scale = _resolve_scale(q, scale)
    no_state = q.new_empty(0, dtype=state_dtype(q))
    if backend == "reference":
        if initial_state is None and grad_final_state is None:
            grads = (*chunk_gated_delta_rule_reference_backward(grad_o, q, k, v, g, beta, cu_seqlens, scale), no_state)
        else:
            grads = chunk_gated_delta_rule_with_state_reference_backward(
                grad_o, grad_final_state, q, k, v, g, beta, cu_seqlens, scale, initial_state
            )
        return tuple(t.contiguous() for t in grads)  # the fake's layout, whatever the inputs' strides
    *grads, dh0 = _KERNEL_BACKWARD[backend](
        grad_o, q, k, v, g, beta, fla_cu_seqlens, chunk_indices, g_cum, A, scale, initial_state, grad_final_state
    )
    return (*grads, no_state if initial_state is None else dh0.to(initial_state.dtype))


@chunk_gated_delta_rule_backward.register_fake
def _(grad_o, q, k, v, g, beta, cu_seqlens, fla_cu_seqlens, chunk_indices, g_cum, A, scale=None,
      initial_state=None, grad_final_state=None, backend="auto"):  # fmt: skip
    _check_state("initial_state", initial_state, q, v, cu_seqlens)
    _check_state("grad_final_state", grad_final_state, q, v, cu_seqlens)
    d_state = q.new_empty(0, dtype=state_dtype(q)) if initial_state is None else initial_state.new_empty(initial_state.shape)
    return (
        q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), g.new_empty(g.shape),
        beta.new_empty(beta.shape), d_state,
    )  # fmt: skip


def _gdn_setup_context(ctx, inputs, output):
    q, k, v, g, beta, cu_seqlens, scale, initial_state, output_final_state, backend = inputs
    _, _, g_cum, A, fla_cu_seqlens, chunk_indices = output
    ctx.save_for_backward(q, k, v, g, beta, cu_seqlens, fla_cu_seqlens, chunk_indices, g_cum, A, initial_state)
    ctx.scale, ctx.output_final_state = scale, output_final_state
    ctx.backend = backends.resolve(q, v, backend)


def _gdn_backward(ctx, grad_o, grad_final_state, *_grad_aux):
    *saved, initial_state = ctx.saved_tensors
    # without a final state its gradient is autograd's zeros for the empty output: none
    grad_final_state = grad_final_state if ctx.output_final_state else None
    *grads, d_state = torch.ops.cp_ops.chunk_gated_delta_rule_backward(
        grad_o, *saved, ctx.scale, initial_state, grad_final_state, ctx.backend
    )
    return (*grads, None, None, None if initial_state is None else d_state, None, None)


chunk_gated_delta_rule_forward.register_autograd(_gdn_backward, setup_context=_gdn_setup_context)


# The public ops return o alone, or o and the final states. They are CompositeImplicitAutograd
# over the forward op above, so autograd and tracing see chunk_gated_delta_rule_forward (with its
# fake and backward) and the auxiliary outputs reach the backward without being recomputed. The
# kernel backend is resolved here, so a traced graph holds it as a constant.
@composite_op(
    f"{NAMESPACE}::chunk_gated_delta_rule",
    "(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor cu_seqlens, float? scale=None) -> Tensor",
)
def _chunk_gated_delta_rule_composite(q, k, v, g, beta, cu_seqlens, scale=None):
    cu_seqlens = checked("cumulative", cu_seqlens, (), q.shape[0])
    return torch.ops.cp_ops.chunk_gated_delta_rule_forward(
        q, k, v, g, beta, cu_seqlens, scale, backend=backends.resolve(q, v)
    )[0]


@composite_op(
    f"{NAMESPACE}::chunk_gated_delta_rule_with_state",
    "(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor cu_seqlens, float? scale=None, "
    "Tensor? initial_state=None) -> (Tensor, Tensor)",
)
def _chunk_gated_delta_rule_with_state_composite(q, k, v, g, beta, cu_seqlens, scale=None, initial_state=None):
    cu_seqlens = checked("cumulative", cu_seqlens, (), q.shape[0])
    o, final_state, *_ = torch.ops.cp_ops.chunk_gated_delta_rule_forward(
        q, k, v, g, beta, cu_seqlens, scale, initial_state, True, backends.resolve(q, v)
    )
    return o, final_state


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
    v, g, beta. CUDA: FlashQLA's fused kernels where installed and the call fits them (bf16 or
    fp16, ``dk = dv = 128``, Hopper or Blackwell), else FLA's chunked kernels (bf16 or fp16,
    ``dk, dv <= 256``), as ``CP_OPS_GDN_BACKEND`` chooses
    (:mod:`custom_ops.gated_delta_rule.backends`); CPU: the sequential torch reference
    (docs/design.md section 2).
    """
    return call_checked(torch.ops.cp_ops.chunk_gated_delta_rule, q, k, v, g, beta, cu_seqlens, scale)


def chunk_gated_delta_rule_with_state(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`chunk_gated_delta_rule` from a state per sequence: ``(o, final_state)``
    (``torch.ops.cp_ops.chunk_gated_delta_rule_with_state``).

    ``initial_state`` ``[B, Hv, dk, dv]`` (None: zeros) is the state ``S`` before each
    sequence's first row, ``final_state`` (same shape) the state after its last row (the
    initial state for a zero-length sequence); states are float32, float64 for float64 q.
    Running a sequence's tail from its head's final state gives the whole sequence's rows.
    Differentiable in q, k, v, g, beta and ``initial_state``, with gradients from ``o`` and
    ``final_state`` (docs/design.md section 2).
    """
    return call_checked(
        torch.ops.cp_ops.chunk_gated_delta_rule_with_state, q, k, v, g, beta, cu_seqlens, scale, initial_state
    )
