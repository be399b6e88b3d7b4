"""How the GDN ops call FlashQLA's fused kernels without host syncs (docs/design.md section 2,
"Kernel backends").

FlashQLA's low-level ``chunk_gated_delta_rule_fwd`` / ``_bwd`` take FLA's varlen form. Where they
would read ``cu_seqlens`` on the host they first look for its ``_flash_qla_prepared_varlen``
attribute, which :func:`_prepared` sets from FLA-form indices built on the device
(:func:`custom_ops.fla.adapter.fla_varlen_indices`). Their intra-card split (``auto_cp``)
decides on the host, so it is off. The forward returns FLA's auxiliary outputs, so the ops' fakes
hold for both backends; its cumulated gate goes back to its own backward only.
"""

from __future__ import annotations

import functools
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from custom_ops.gated_delta_rule.backends import FLASH_QLA_HEAD_DIM
from custom_ops.fla.adapter import FLA_CHUNK, fla_grads, fla_state, fla_varlen_indices

__all__ = ["flash_qla_backward", "flash_qla_forward", "warm_up"]


@functools.cache
def _chunk_module():
    import flash_qla.ops.gated_delta_rule.chunk as chunk

    if chunk.CHUNK_SIZE != FLA_CHUNK:
        raise RuntimeError(f"FlashQLA's chunk is {chunk.CHUNK_SIZE} rows on this GPU; these ops need {FLA_CHUNK}")
    return chunk


def _prepared(fla_cu_seqlens: torch.Tensor, chunk_indices: torch.Tensor) -> torch.Tensor:
    """``fla_cu_seqlens`` (a fresh alias) carrying FlashQLA's varlen metadata: the chunk offsets
    of each sequence (device ops), the chunk count (``chunk_indices``' length, a bound on the real
    count) and ``chunk_indices``."""
    cu = fla_cu_seqlens.view(fla_cu_seqlens.shape)
    chunks = torch.div(cu.diff() + FLA_CHUNK - 1, FLA_CHUNK, rounding_mode="floor")
    offsets = F.pad(chunks.cumsum(0), (1, 0)).to(cu.dtype)
    cu._flash_qla_prepared_varlen = (FLA_CHUNK, offsets, chunk_indices.shape[0], chunk_indices)
    return cu


def _as_batch(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().unsqueeze(0)


def flash_qla_forward(q, k, v, g, beta, scale, fla_cu_seqlens, chunk_indices, initial_state=None,
                      output_final_state=False):  # fmt: skip
    """``(o, g_cum, A, final_state)`` from FlashQLA's ``chunk_gated_delta_rule_fwd``, as
    :func:`custom_ops.gated_delta_rule.op._fla_forward` returns FLA's."""
    chunk = _chunk_module()
    g_cum, A, o, _, final_state, _ = chunk.chunk_gated_delta_rule_fwd(
        q=_as_batch(q), k=_as_batch(k), v=_as_batch(v), g=_as_batch(g.float()), beta=_as_batch(beta),
        scale=scale, initial_state=fla_state(initial_state), cu_seqlens=_prepared(fla_cu_seqlens, chunk_indices),
        output_final_state=output_final_state, auto_cp=False,
    )  # fmt: skip
    final_state = final_state[:-1] if output_final_state else None
    return o.squeeze(0).to(q.dtype), g_cum.squeeze(0), A.squeeze(0), final_state


def flash_qla_backward(grad_o, q, k, v, g, beta, fla_cu_seqlens, chunk_indices, g_cum, A, scale,
                       initial_state=None, grad_final_state=None):  # fmt: skip
    """``(dq, dk, dv, dg, dbeta, dh0)`` from FlashQLA's ``chunk_gated_delta_rule_bwd``, as
    :func:`custom_ops.gated_delta_rule.op._fla_backward` returns FLA's."""
    chunk = _chunk_module()
    cu = _prepared(fla_cu_seqlens, chunk_indices)
    dq, dk, dv, dbeta, dg, dh0 = chunk.chunk_gated_delta_rule_bwd(
        q=_as_batch(q), k=_as_batch(k), v=_as_batch(v), g=g_cum.unsqueeze(0), beta=_as_batch(beta),
        A=A.unsqueeze(0), do=_as_batch(grad_o), dht=fla_state(grad_final_state), scale=scale,
        initial_state=fla_state(initial_state), cu_seqlens=cu, auto_cp=False,
    )  # fmt: skip
    return fla_grads((dq, dk, dv, dg, dbeta, dh0), q, k, v, g, beta, initial_state)


# --- warm-up: TileLang compiles each kernel variant at its first call (a minute or more cold),
# then loads it from its disk cache (``TILELANG_CACHE_DIR``). A variant is fixed by the head
# counts, dtypes, scale and state flags, and the forward's also by sequences x heads (its tile
# width). ``warm_up`` runs a few rows of each, so that later processes on the machine start warm.

# Sequence counts of the warm-up's forwards: B + 1 (FLA's form) doubling from 1 to 128, so that
# sequences x heads meet every tile width FlashQLA's forward picks from it.
WARM_UP_SEQS = tuple(2**i - 1 for i in range(8))


def warm_up(hk: int, hv: int, initial_state: bool = False, final_state: bool = False, device=None,
            dtype: torch.dtype = torch.bfloat16, beta_dtype: torch.dtype = torch.float32,
            scale: float = FLASH_QLA_HEAD_DIM**-0.5) -> None:  # fmt: skip
    """Compile (or load) FlashQLA's kernels for ``hk`` key and ``hv`` value heads: forwards of every
    tile width and one backward, a chunk of rows a sequence (``initial_state``, ``final_state``:
    the variant from initial states to final states, as the state-passing CP mode runs it)."""
    device, dim = torch.device(device or "cuda"), FLASH_QLA_HEAD_DIM
    for num_seqs in WARM_UP_SEQS:
        rows = max(num_seqs, 1) * FLA_CHUNK
        cu = (torch.arange(num_seqs + 1, device=device, dtype=torch.int32) * FLA_CHUNK).clamp(max=rows)
        q = torch.randn(rows, hk, dim, device=device, dtype=dtype)
        v = torch.randn(rows, hv, dim, device=device, dtype=dtype)
        g = -torch.rand(rows, hv, device=device)
        beta = torch.rand(rows, hv, device=device, dtype=beta_dtype)
        state = torch.zeros(num_seqs, hv, dim, dim, device=device) if initial_state else None
        fla_cu, chunk_indices = fla_varlen_indices(cu, rows)
        o, g_cum, A, final = flash_qla_forward(q, q, v, g, beta, scale, fla_cu, chunk_indices, state, final_state)
    flash_qla_backward(torch.ones_like(o), q, q, v, g, beta, fla_cu, chunk_indices, g_cum, A, scale, state,
                       None if final is None else torch.ones_like(final))  # fmt: skip
    torch.cuda.synchronize(device)


def _main(argv: list[str]) -> int:
    """``python -m custom_ops.gated_delta_rule.flash_qla [--states] HK/HV ...``: compile FlashQLA's
    kernels for these head counts (bf16, float32 gates, the default scale; ``--states``: also from
    initial states to final states) into TileLang's disk cache, one process a head count, so that
    later processes start warm."""
    module = "custom_ops.gated_delta_rule.flash_qla"
    states = "--states" in argv
    heads = [a for a in argv if a != "--states"]
    if not heads or any(a.count("/") != 1 for a in heads):
        print(f"usage: python -m {module} [--states] HK/HV [HK/HV ...]   (e.g. 16/32 8/16 4/8 2/4)", file=sys.stderr)
        return 2
    if len(heads) > 1:
        procs = [subprocess.Popen([sys.executable, "-m", module, *["--states"] * states, a]) for a in heads]
        return max(p.wait() for p in procs)
    start = time.perf_counter()
    hk, hv = (int(n) for n in heads[0].split("/"))
    for flags in ((False, False), (True, True))[: 1 + states]:
        warm_up(hk, hv, *flags)
    print(f"FlashQLA kernels for {hk}/{hv} heads ready in {time.perf_counter() - start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
