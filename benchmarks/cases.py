"""Benchmark cases shared by several scripts: sequence lengths, segment tables, inputs, FLOP counts.

Imports nothing of the library (torch only), so the cases are the same whichever checkout's
library a benchmark times (benchmarks/compare_checkouts.py).
"""

from __future__ import annotations

import itertools

import torch

# segment attention: 32768 packed tokens, 16 query heads, bf16, causal
ATTENTION_TOKENS = 32768
ATTENTION_HEADS = 16
ATTENTION_HEAD_DIMS = (128, 64)
ATTENTION_DTYPE = torch.bfloat16


def packed_lengths(total: int = ATTENTION_TOKENS, seed: int = 0) -> list[int]:
    """Mixed document lengths (128 .. 8192, log-uniform) filling exactly ``total`` tokens."""
    gen = torch.Generator().manual_seed(seed)
    lens = []
    while sum(lens) < total:
        n = int(2 ** (7 + 6 * torch.rand((), generator=gen).item()))
        lens.append(min(n, total - sum(lens)))
    return lens


def tokens_label(total: int) -> str:
    """``32k`` for 32768 tokens; the number itself where it is no multiple of 1024."""
    return f"{total // 1024}k" if total % 1024 == 0 else str(total)


def attention_cases(totals: tuple[int, ...] = (ATTENTION_TOKENS,)) -> list[tuple[str, list[int]]]:
    """``(name, document lengths)`` of the segment-attention cases: packed documents
    (:func:`packed_lengths`) filling each of ``totals`` tokens, then dense."""
    return [(f"packed {tokens_label(t)}", packed_lengths(t)) for t in totals] + [("dense B8 x 4096", [4096] * 8)]


def segments_for(lens: list[int], device) -> list[torch.Tensor]:
    """Self-attention segments: each document's queries over its own keys, q_pos = 0
    (q_start, q_len, q_pos, k_start, k_len as int32)."""
    starts = [0] + list(itertools.accumulate(lens))[:-1]
    zeros = [0] * len(lens)
    return [torch.tensor(x, dtype=torch.int32, device=device) for x in (starts, lens, zeros, starts, lens)]


def visible_pairs(lens: list[int], causal: bool = True) -> int:
    return sum(n * (n + 1) // 2 if causal else n * n for n in lens)


def tflops(pairs: int, heads: int, d: int, ms: float, factor: float = 1.0) -> float:
    """TFLOP/s of attention over ``pairs`` visible pairs per head: ``4 * d`` FLOPs per pair and
    head in the forward, times ``factor`` (2.5 for the backward, 3.5 for both)."""
    return 4 * d * pairs * heads * factor / (ms * 1e-3) / 1e12


def attention_inputs(total, heads, kv_heads, d, device, seed=0, dtype=ATTENTION_DTYPE):
    """``[q, k, v]`` of ``total`` rows, requiring grad."""
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(total, heads, d, device=device, dtype=dtype, generator=gen)
    k = torch.randn(total, kv_heads, d, device=device, dtype=dtype, generator=gen)
    v = torch.randn(total, kv_heads, d, device=device, dtype=dtype, generator=gen)
    return [t.requires_grad_() for t in (q, k, v)]


def layout_shapes() -> list[tuple[str, list[int], tuple[int, ...]]]:
    """``(name, seqlens, trailing)`` of the THD layout benchmarks: 16 x 4096 tokens of 16 x 64,
    8 x 8192 tokens of 32 x 128, and uneven random lengths of 16 x 64."""
    torch.manual_seed(0)
    uneven = (torch.distributions.LogNormal(7.0, 1.0).sample((40,)).clamp(1, 16384)).long()
    uneven = (uneven * 65536 // uneven.sum()).tolist()
    return [
        ("16x4096 tok, 16x64", [4096] * 16, (16, 64)),
        ("8x8192 tok, 32x128", [8192] * 8, (32, 128)),
        (f"{len(uneven)} uneven ({sum(uneven)} tok), 16x64", uneven, (16, 64)),
    ]


def random_lengths(total: int, num_seqs: int, generator: torch.Generator) -> list[int]:
    """``num_seqs`` lengths around ``total / num_seqs`` (0.5 to 1.5 of it, before rounding)
    summing to ``total``."""
    weights = torch.rand(num_seqs, generator=generator) + 0.5
    lens = (weights / weights.sum() * total).floor().long()
    lens[-1] += total - int(lens.sum())
    return lens.tolist()


def attention_op_inputs(lens, d, gqa, device, heads=ATTENTION_HEADS):
    """``(q, k, v, seg, out, lse, dout, dlse)`` for calling the forward op
    (``torch.ops.cp_ops.varlen_attention``, registered by whichever library the caller
    imported) and the backward's launcher directly on documents of lengths ``lens``: detached inputs,
    the forward's outputs, random ``dout``, zero ``dlse``."""
    q, k, v = (t.detach() for t in attention_inputs(sum(lens), heads, heads // gqa, d, device))
    seg = segments_for(lens, device)
    out, lse = torch.ops.cp_ops.varlen_attention(q, k, v, *seg, True)[:2]  # out and lse
    return q, k, v, seg, out, lse, torch.randn_like(out), torch.zeros_like(lse)
