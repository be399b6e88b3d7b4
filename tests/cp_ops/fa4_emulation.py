"""A torch emulation of the part of FlashAttention 4's varlen interface that the ``fa4`` attention
backend relies on (``flash_attn.cute.interface._flash_attn_fwd`` and ``_flash_attn_bwd``), so that
the CPU tests check the translation from the op's layout to FlashAttention 4's arguments.

It is an emulation of the semantics the backend assumes, not FlashAttention 4: sequence b's
queries are rows ``[cu_seqlens_q[b], cu_seqlens_q[b] + seqused_q[b])``, its keys rows
``[cu_seqlens_k[b], cu_seqlens_k[b] + seqused_k[b])``; the causal mask and the left window are
aligned to the ranges' ends (query i of sq sees key j of sk where ``j <= i + sk - sq`` and
``j >= i + sk - sq - left``); head h reads kv head ``h // (Hq / Hkv)``; lse is ``[Hq, Tq]``; the
forward writes out and lse, the backward dq, dk and dv, only on the rows of the ranges (rows it
allocates itself are NaN elsewhere, so a row the backend forgets shows). The backward uses the
forward's out and lse as FlashAttention 4 does (``dS = P (dP - rowsum(dO O))``), so a call handed
another call's lse fails. The GPU tests (tests/cp_ops/test_attention_fa4.py) run the real kernels.
"""

from __future__ import annotations

import types

import torch


def _ranges(cu_seqlens_q, seqused_q, cu_seqlens_k, seqused_k):
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k), ("seqused_q", seqused_q),
                    ("seqused_k", seqused_k)):  # fmt: skip
        assert t.dtype == torch.int32 and t.dim() == 1 and t.is_contiguous(), f"{name}: {t.dtype} {tuple(t.shape)}"
    batch = seqused_q.shape[0]
    assert cu_seqlens_q.shape == cu_seqlens_k.shape == (batch + 1,) and seqused_k.shape == (batch,)
    for qs, qn, ks, kn in zip(*(t.tolist() for t in (cu_seqlens_q[:-1], seqused_q, cu_seqlens_k[:-1], seqused_k))):
        yield slice(qs, qs + qn), slice(ks, ks + kn)


def _scores(q, k, scale, causal, window_size_left):
    """``[Hq, sq, sk]`` float64 scores, -inf where masked, and k with its heads repeated for GQA."""
    kk = k.double().repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    s = torch.einsum("qhd,khd->hqk", q.double(), kk) * scale
    sq, sk = q.shape[0], k.shape[0]
    diag = torch.arange(sq)[:, None] + sk - sq
    col = torch.arange(sk)[None, :]
    visible = torch.ones(sq, sk, dtype=torch.bool)
    if causal:
        visible &= col <= diag
    if window_size_left is not None:
        visible &= col >= diag - window_size_left
    return s.masked_fill(~visible, float("-inf")), kk


def _flash_attn_fwd(q, k, v, *, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, softmax_scale, causal,
                    window_size_left=None, window_size_right=None, return_lse=False, out=None, lse=None):  # fmt: skip
    assert window_size_right is None and q.shape[1] % k.shape[1] == 0 and k.shape[:2] == v.shape[:2]
    if out is None:
        out = torch.full((*q.shape[:2], v.shape[2]), float("nan"), dtype=q.dtype)
    if lse is None:
        lse = torch.full((q.shape[1], q.shape[0]), float("nan"), dtype=torch.float32)
    assert out.shape == (*q.shape[:2], v.shape[2]) and lse.shape == (q.shape[1], q.shape[0])
    assert lse.dtype == torch.float32 and lse.is_contiguous()
    for qs, ks in _ranges(cu_seqlens_q, seqused_q, cu_seqlens_k, seqused_k):
        s, _ = _scores(q[qs], k[ks], softmax_scale, causal, window_size_left)
        m = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - m[..., None]).nan_to_num(0.0)  # a row with no key: zeros, lse -inf
        vv = v[ks].double().repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        out[qs] = torch.einsum("hqk,khd->qhd", p, vv).to(out.dtype)
        lse[:, qs] = m.float()
    return out, lse, None, None, None


def _group_sum(t, kv_heads):
    return t.reshape(t.shape[0], kv_heads, t.shape[1] // kv_heads, t.shape[2]).sum(2)


def _flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=None, causal=False, softcap=0.0, *, window_size_left=None,
                    window_size_right=None, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, dq=None, dk=None,
                    dv=None):  # fmt: skip
    assert window_size_right is None and softcap == 0.0
    assert lse.shape == (q.shape[1], q.shape[0]) and out.shape == dout.shape == (*q.shape[:2], v.shape[2])
    dq, dk, dv = (torch.full_like(t, float("nan")) if d is None else d for t, d in ((q, dq), (k, dk), (v, dv)))
    for qs, ks in _ranges(cu_seqlens_q, seqused_q, cu_seqlens_k, seqused_k):
        s, kk = _scores(q[qs], k[ks], softmax_scale, causal, window_size_left)
        p = torch.exp(s - lse[:, qs].double()[..., None]).nan_to_num(0.0)
        do, o = dout[qs].double(), out[qs].double()
        vv = v[ks].double().repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        ds = p * (torch.einsum("qhd,khd->hqk", do, vv) - (do * o).sum(-1).T[..., None])
        dq[qs] = (torch.einsum("hqk,khd->qhd", ds, kk) * softmax_scale).to(dq.dtype)
        dk[ks] = _group_sum(torch.einsum("hqk,qhd->khd", ds, q[qs].double()) * softmax_scale, k.shape[1]).to(dk.dtype)
        dv[ks] = _group_sum(torch.einsum("hqk,qhd->khd", p, do), v.shape[1]).to(dv.dtype)
    return dq, dk, dv


EMULATION = types.SimpleNamespace(_flash_attn_fwd=_flash_attn_fwd, _flash_attn_bwd=_flash_attn_bwd)
