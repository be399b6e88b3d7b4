"""How the GDN ops call flash-linear-attention (FLA) without host syncs or cached tensors.

:func:`fla_varlen_indices` builds the ``chunk_indices`` of FLA's varlen kernels with a length
fixed by shapes, ``T // 64 + B``, so FLA never calls ``prepare_chunk_indices`` (a host read;
docs/design.md section 3): one launch of :func:`fla_chunk_indices_kernel` on CUDA, the torch
ops of :func:`fla_varlen_indices_reference` on the CPU. :func:`fla_call` wraps each call into
FLA: the recorded autotuning choices for the device
(:mod:`custom_ops.fla.configs`), and FLA's tensor cache switched off.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import warnings

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from custom_ops.fla.configs import use_recorded_configs
from custom_ops.runtime import precompile
from custom_ops.runtime.launch import launch_direct, use_triton
from custom_ops.runtime.tiles import cdiv

__all__ = [
    "FLA_CHUNK",
    "fla_call",
    "fla_grads",
    "fla_state",
    "fla_chunk_indices_kernel",
    "fla_module",
    "fla_varlen_indices",
    "fla_varlen_indices_reference",
    "precompile_varlen_indices",
]

# What FLA's hardware probe warns, once a process, on importing FLA where Triton has no GPU driver.
_NO_DRIVER_NOTICE = r"Triton is not supported on current platform, roll back to CPU\.$"


@functools.cache
def fla_module(name: str):
    """FLA's module ``name`` (e.g. ``"fla.ops.gated_delta_rule.chunk"``), imported without the
    notice "Triton is not supported on current platform, roll back to CPU." that FLA's hardware
    probe warns on a machine without a GPU: every CPU run would print it, and it concerns FLA's
    own device choice, which these ops never use (they pass FLA tensors on the device they
    chose). Every other warning passes."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", _NO_DRIVER_NOTICE, UserWarning, r"fla\.utils\.hardware$")
        return importlib.import_module(name)


# FLA's chunk length for both kernels (its default; the GDN kernels take 16, 32 or 64).
FLA_CHUNK = 64

# Chunk-index rows, and sequences per loop step, of one program of fla_chunk_indices_kernel.
INDICES_BLOCK = 128
INDICES_SEQ_BLOCK = 128


def fla_varlen_indices(
    cu_seqlens: torch.Tensor, num_rows: int, chunk_size: int = FLA_CHUNK
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cu_ext [B+2], chunk_indices [T // chunk_size + B, 2])`` for FLA's varlen kernels, sync-free.

    ``chunk_indices[s] = (i, c)``: program s handles chunk c of sequence i. The real rows
    are FLA's own (``prepare_chunk_indices``: sequences in order, ``ceil(L_i / chunk_size)``
    rows each); every spare row is ``(B, 0)``, chunk 0 of the zero-length sequence
    ``cu_ext[B] .. cu_ext[B+1]`` appended here, which FLA's kernels process as empty.
    ``cu_seqlens`` is clamped to ``[0, num_rows]`` first, so a bad layout gives wrong rows,
    never an out-of-bounds access (docs/design.md section 3). Both tensors have
    ``cu_seqlens``'s dtype. On CUDA (and under ``TRITON_INTERPRET=1``) one launch of
    :func:`fla_chunk_indices_kernel`; otherwise :func:`fla_varlen_indices_reference`.
    """
    if not use_triton(cu_seqlens) or cu_seqlens.shape[0] == 0:
        return fla_varlen_indices_reference(cu_seqlens, num_rows, chunk_size)
    return _launch_chunk_indices(cu_seqlens, num_rows, chunk_size)


def _launch_chunk_indices(cu_seqlens: torch.Tensor, num_rows: int, chunk_size: int):
    """:func:`fla_varlen_indices` by one launch of :func:`fla_chunk_indices_kernel`."""
    num_seqs = cu_seqlens.shape[0] - 1
    slots = num_rows // chunk_size + num_seqs
    cu_ext = torch.empty(num_seqs + 2, dtype=cu_seqlens.dtype, device=cu_seqlens.device)
    chunk_indices = torch.empty((slots, 2), dtype=cu_seqlens.dtype, device=cu_seqlens.device)
    launch_direct(
        fla_chunk_indices_kernel, (cdiv(max(slots, num_seqs + 2), INDICES_BLOCK),),
        cu_seqlens, cu_ext, chunk_indices, num_seqs, num_rows, slots,
        CHUNK=chunk_size, BLOCK=INDICES_BLOCK, SEQ_BLOCK=INDICES_SEQ_BLOCK,
    )  # fmt: skip
    return cu_ext, chunk_indices


def fla_state(state: torch.Tensor | None) -> torch.Tensor | None:
    """A state ``[B, ...]`` as ``[B+1, ...]`` float32, the form FLA's and FlashQLA's kernels take:
    they also run the empty sequence that :func:`fla_varlen_indices` appends, from a zero state."""
    if state is None:
        return None
    return torch.cat([state.float(), state.new_zeros((1, *state.shape[1:]), dtype=torch.float32)])


def fla_grads(grads, q, k, v, g, beta, initial_state):
    """``(dq, dk, dv, dg, dbeta, dh0)`` from a backend's batched ``[1, T, ...]`` gradients (in that
    order) in the inputs' shapes and dtypes; ``dh0`` without the appended sequence's state, None
    where there is no initial state."""
    dq, dk, dv, dg, dbeta, dh0 = grads
    return (
        dq.squeeze(0).to(q.dtype),
        dk.squeeze(0).to(k.dtype),
        dv.squeeze(0).to(v.dtype),
        dg.squeeze(0).to(g.dtype),
        dbeta.squeeze(0).to(beta.dtype),
        None if initial_state is None or dh0 is None else dh0[:-1],
    )


def precompile_varlen_indices(cu_seqlens: torch.Tensor, num_rows) -> None:
    """Start compiling :func:`fla_chunk_indices_kernel` for these arguments (an op's fake
    ``cu_seqlens`` and its row count, while a graph is traced) in the background
    (:mod:`custom_ops.runtime.precompile`); nothing for a symbolic row count."""
    if type(num_rows) is int:
        precompile.schedule(
            "fla_varlen_indices", lambda cu: _launch_chunk_indices(cu, num_rows, FLA_CHUNK), cu_seqlens
        )


def fla_varlen_indices_reference(
    cu_seqlens: torch.Tensor, num_rows: int, chunk_size: int = FLA_CHUNK
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`fla_varlen_indices` from torch ops (a dozen launches on a GPU)."""
    cu = cu_seqlens.clamp(0, num_rows)
    num_seqs = cu.numel() - 1
    slots = num_rows // chunk_size + num_seqs
    cu_ext = torch.cat([cu, cu[-1:]])
    lens = (cu[1:] - cu[:-1]).to(torch.int64).clamp(min=0)
    offsets = F.pad(torch.div(lens + chunk_size - 1, chunk_size, rounding_mode="floor").cumsum(0), (1, 0))
    slot = torch.arange(slots, device=cu.device, dtype=torch.int64)
    # right-sided search skips zero-length sequences; slots past the last chunk land on B
    seq = torch.searchsorted(offsets, slot, right=True) - 1
    real = seq < num_seqs
    chunk = torch.where(real, slot - offsets[seq.clamp(max=num_seqs)], 0)
    return cu_ext, torch.stack([seq, chunk], 1).to(cu.dtype)


@triton.jit(do_not_specialize=["num_seqs", "num_rows", "slots"])
def fla_chunk_indices_kernel(
    cu_ptr,
    cu_ext_ptr,  # [num_seqs + 2]
    idx_ptr,  # [slots, 2]
    num_seqs,
    num_rows,
    slots,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
    SEQ_BLOCK: tl.constexpr,
):
    """:func:`fla_varlen_indices_reference` for BLOCK rows of ``chunk_indices`` (and of ``cu_ext``)
    per program. With ``end_i`` the chunks of sequences 0..i (each ``cdiv(max(L_i, 0), CHUNK)``
    of its ``cu`` clamped into ``[0, num_rows]``), row s is sequence ``i = #{i : end_i <= s}``
    and chunk ``s - max{end_i <= s}`` (0 where i = num_seqs): the reference's right-sided search,
    as counts over all sequences, SEQ_BLOCK at a time (``slots * num_seqs`` comparisons in all)."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    # cu_ext: cu clamped, its last entry twice
    ext = rows < num_seqs + 2
    bound = tl.load(cu_ptr + tl.minimum(rows, num_seqs), mask=ext, other=0).to(tl.int64)
    bound = tl.minimum(tl.maximum(bound, 0), num_rows)
    tl.store(cu_ext_ptr + rows, bound.to(cu_ext_ptr.dtype.element_ty), mask=ext)

    seq = tl.zeros([BLOCK], dtype=tl.int32)
    start = tl.zeros([BLOCK], dtype=tl.int32)  # the chunk of the row's sequence that comes first
    carry = tl.full([], 0, tl.int32)
    for c in range(0, num_seqs, SEQ_BLOCK):
        i = c + tl.arange(0, SEQ_BLOCK)
        m = i < num_seqs
        lo = tl.minimum(tl.maximum(tl.load(cu_ptr + i, mask=m, other=0).to(tl.int64), 0), num_rows)
        hi = tl.minimum(tl.maximum(tl.load(cu_ptr + i + 1, mask=m, other=0).to(tl.int64), 0), num_rows)
        chunks = ((tl.maximum(hi - lo, 0) + CHUNK - 1) // CHUNK).to(tl.int32)  # 0 past num_seqs
        end = tl.cumsum(chunks, 0) + carry
        carry += tl.sum(chunks, 0)
        done = m[None, :] & (end[None, :] <= rows[:, None])
        seq += tl.sum(done.to(tl.int32), 1)
        start = tl.maximum(start, tl.max(tl.where(done, end[None, :], 0), 1))
    chunk = tl.where(seq < num_seqs, rows - start, 0)
    out = rows < slots
    tl.store(idx_ptr + 2 * rows, seq.to(idx_ptr.dtype.element_ty), mask=out)
    tl.store(idx_ptr + 2 * rows + 1, chunk.to(idx_ptr.dtype.element_ty), mask=out)


@contextlib.contextmanager
def fla_call(device: torch.device):
    """Around one call into FLA on ``device``: FLA's autotuners seeded with the choices recorded
    for the device (:func:`custom_ops.fla.configs.use_recorded_configs`, once per device),
    and FLA's ``tensor_cache`` off.

    These ops pass FLA its ``chunk_indices``, so what FLA still caches is derived from the
    ``cu_seqlens`` each call builds anew (``prepare_chunk_offsets``, ``prepare_lens``): an
    identity key never hit again. The cache would only keep those tensors, and that
    ``cu_seqlens``, alive after the op returns; under CUDA graphs (``torch.compile`` with
    Inductor's ``triton.cudagraphs``) that is memory in the graph's pool that no output
    accounts for, which the graph trees refuse ("tensor(s) in the cudagraph pool not
    tracked as outputs"). FLA reads the switch ``fla.utils.FLA_DISABLE_TENSOR_CACHE`` at
    every call.
    """
    fla_utils = fla_module("fla.utils")
    use_recorded_configs(device)
    before = getattr(fla_utils, "FLA_DISABLE_TENSOR_CACHE", False)
    fla_utils.FLA_DISABLE_TENSOR_CACHE = True
    try:
        yield
    finally:
        fla_utils.FLA_DISABLE_TENSOR_CACHE = before

