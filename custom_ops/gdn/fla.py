"""How the GDN ops call flash-linear-attention (FLA) without host syncs or cached tensors.

FLA's varlen kernels take ``chunk_indices`` (one ``(sequence, chunk)`` row per program)
whose length, the number of 64-row chunks, depends on the lengths. FLA builds it with
``repeat_interleave`` on device counts, which reads the total on the host. Here it is built
by :func:`fla_varlen_indices` with a length fixed by shapes, ``T // 64 + B``, an upper
bound; the spare rows point at an extra zero-length sequence appended to ``cu_seqlens``,
whose programs load nothing and store nothing. FLA then never calls
``prepare_chunk_indices`` (docs/design.md section 3). :func:`fla_call` wraps each call into
FLA: the recorded autotuning choices for the device (:mod:`custom_ops.gdn.fla_configs`), and
FLA's tensor cache switched off.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from custom_ops.gdn.fla_configs import use_recorded_configs

__all__ = ["FLA_CHUNK", "fla_call", "fla_varlen_indices"]

# FLA's chunk length for both kernels (its default; the GDN kernels take 16, 32 or 64).
FLA_CHUNK = 64


def fla_varlen_indices(
    cu_seqlens: torch.Tensor, num_rows: int, chunk_size: int = FLA_CHUNK
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cu_ext [B+2], chunk_indices [T // chunk_size + B, 2])`` for FLA's varlen kernels, sync-free.

    ``chunk_indices[s] = (i, c)``: program s handles chunk c of sequence i. The
    real rows are FLA's own (``prepare_chunk_indices``): sequences in order,
    ``ceil(L_i / chunk_size)`` rows each. Their count is at most
    ``sum_i (L_i // chunk_size + 1) <= T // chunk_size + B``, so the tensor has
    that many rows and every spare row is ``(B, 0)``: chunk 0 of the zero-length
    sequence ``cu_ext[B] .. cu_ext[B+1]`` appended here, which FLA's kernels
    process as empty (masked loads and stores; its per-chunk partial sums are zero).
    ``cu_seqlens`` is clamped to ``[0, num_rows]`` first: a layout whose last entry
    exceeds the rows (validate_thd reports it where data is prepared) then gives
    wrong rows, never an out-of-bounds access inside FLA's kernels.
    """
    cu = cu_seqlens.clamp(0, num_rows)
    num_seqs = cu.numel() - 1
    slots = num_rows // chunk_size + num_seqs
    cu_ext = torch.cat([cu, cu[-1:]])
    lens = (cu[1:] - cu[:-1]).to(torch.int64)
    offsets = F.pad(torch.div(lens + chunk_size - 1, chunk_size, rounding_mode="floor").cumsum(0), (1, 0))
    slot = torch.arange(slots, device=cu.device, dtype=torch.int64)
    # right-sided search skips zero-length sequences; slots past the last chunk land on B
    seq = torch.searchsorted(offsets, slot, right=True) - 1
    real = seq < num_seqs
    chunk = torch.where(real, slot - offsets[seq.clamp(max=num_seqs)], 0)
    return cu_ext, torch.stack([seq, chunk], 1).to(cu.dtype)


@contextlib.contextmanager
def fla_call(device: torch.device):
    """Around one call into FLA on ``device``: FLA's autotuners seeded with the choices recorded
    for the device (:func:`custom_ops.gdn.fla_configs.use_recorded_configs`, once per device),
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
    import fla.utils

    use_recorded_configs(device)
    before = getattr(fla.utils, "FLA_DISABLE_TENSOR_CACHE", False)
    fla.utils.FLA_DISABLE_TENSOR_CACHE = True
    try:
        yield
    finally:
        fla.utils.FLA_DISABLE_TENSOR_CACHE = before

