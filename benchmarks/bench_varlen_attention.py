"""GPU benchmark and tuner for custom_ops.varlen_attention (bf16, causal).

    python benchmarks/bench_varlen_attention.py            # table: varlen_attention vs SDPA flash / cuDNN / FlexAttention
    python benchmarks/bench_varlen_attention.py --gqa 4    # the same with Hkv = H / 4
    python benchmarks/bench_varlen_attention.py --tune     # time kernel configs, print the best per kernel and head_dim
    python benchmarks/bench_varlen_attention.py --profile  # CUDA time per kernel of one forward and one backward
    python benchmarks/bench_varlen_attention.py --tune --kinds bwd_dkdv --save tuned.json
    python benchmarks/bench_varlen_attention.py --configs tuned.json   # the table with the tuned entries
    python benchmarks/bench_varlen_attention.py --pointer-loads   # everything without TMA loads
    python benchmarks/bench_varlen_attention.py --tune --kinds bwd_dkdv --rounds 5   # 5 rounds, candidates in turn
    python benchmarks/bench_varlen_attention.py --head-groups      # the launch order's HEAD_GROUP, 1 to 16 kv heads
    python benchmarks/bench_varlen_attention.py --head-groups 1 2  # only these groups (both segment orders)

Cases: (i) packed documents of mixed lengths totalling 32768 tokens, (ii) dense
B = 8 x S = 4096 (eight segments); H = 16 query heads, D = 128 and 64 (``--head-dims``).
TFLOP/s count visible (query, key) pairs only: forward ``4 * D`` FLOPs per pair
and head, backward 2.5x that (so forward+backward = 3.5x forward). Times are
medians of triton.testing.do_bench. Before timing, every implementation is
checked against SDPA in bf16 (rel_error below the bf16 tolerance).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import itertools
import json
import os
import statistics
import sys

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import custom_ops  # noqa: E402
from benchmarks.common import kernel_breakdown  # noqa: E402
from custom_ops.testing import TOLERANCE, rel_error  # noqa: E402
from custom_ops.varlen_attention import kernels  # noqa: E402
from custom_ops.varlen_attention import op as op_mod  # noqa: E402

DTYPE = torch.bfloat16
TOTAL_TOKENS = 32768
HEADS = 16
HEAD_DIMS = (128, 64)


# --- cases ----------------------------------------------------------------------------------------


def packed_lengths(total: int = TOTAL_TOKENS, seed: int = 0) -> list[int]:
    """Mixed document lengths (128 .. 8192, log-uniform) filling exactly ``total`` tokens."""
    gen = torch.Generator().manual_seed(seed)
    lens = []
    while sum(lens) < total:
        n = int(2 ** (7 + 6 * torch.rand((), generator=gen).item()))
        lens.append(min(n, total - sum(lens)))
    return lens


def segments_for(lens: list[int], device) -> list[torch.Tensor]:
    """Self-attention segments: each document's queries over its own keys, q_pos = 0."""
    starts = [0] + list(itertools.accumulate(lens))[:-1]
    zeros = [0] * len(lens)
    return [torch.tensor(x, dtype=torch.int32, device=device) for x in (starts, lens, zeros, starts, lens)]


def visible_pairs(lens: list[int], causal: bool = True) -> int:
    return sum(n * (n + 1) // 2 if causal else n * n for n in lens)


def tflops(pairs: int, heads: int, d: int, ms: float, factor: float = 1.0) -> float:
    return 4 * d * pairs * heads * factor / (ms * 1e-3) / 1e12


# --- implementations ------------------------------------------------------------------------------


def varlen_fn(q, k, v, seg):
    return custom_ops.varlen_attention(q, k, v, *seg, causal=True)[0]


@contextlib.contextmanager
def _kernel_setting(name: str, value, module=kernels):
    """The kernels with ``<module>.<name> = value`` inside the block (``module``: by default
    custom_ops.varlen_attention.kernels; the launcher, op_mod, for what it decides)."""
    saved = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, saved)


def pointer_loads():
    """The kernels with pointer loads and their own tuned tiles (CONFIGS), as before TMA."""
    return _kernel_setting("TMA_ENABLED", False)


def heads_one_at_a_time():
    """Each head's programs in one stretch of the launch order (HEAD_GROUP 1), as before 2026-11-25."""
    return _kernel_setting("HEAD_GROUP", dict.fromkeys(kernels.HEAD_GROUP, 1))


def segments_last_to_first():
    """The forward and dq running the segments last to first, not heaviest first (SEGMENTS_BY_WORK),
    as before 2026-11-25."""
    return _kernel_setting("SEGMENTS_BY_WORK", dict.fromkeys(kernels.SEGMENTS_BY_WORK, False))


def window_terms_always():
    """The kernels compiled with the window's terms in the elementwise mask for every launch
    (WINDOW always on), as before 2026-11-25's last change: the same results, more work per
    masked entry under causal and full masks."""
    return _kernel_setting("_has_window", lambda left, right: True, op_mod)


# Earlier forms of the kernels, timed beside the current one: {row name: context manager}.
VARIANTS = {
    "varlen_attention, pointer loads": pointer_loads,
    "varlen_attention, one head at a time": heads_one_at_a_time,
    "varlen_attention, segments last to first": segments_last_to_first,
    "varlen_attention, window terms always": window_terms_always,
}


def sdpa_dense_fn(backend, batch, seqlen):
    """SDPA on [B, H, S, D] views of the packed [B*S, H, D] tensors."""

    def fn(q, k, v, seg):
        def to_bhsd(t):
            return t.view(batch, seqlen, t.shape[1], t.shape[2]).transpose(1, 2)

        with sdpa_kernel(backend):
            out = F.scaled_dot_product_attention(
                to_bhsd(q), to_bhsd(k), to_bhsd(v), is_causal=True, enable_gqa=q.shape[1] != k.shape[1]
            )
        return out.transpose(1, 2).reshape(q.shape)

    return fn


def sdpa_loop_fn(backend, lens):
    """SDPA per document in a Python loop (packed case; includes the launch overheads)."""
    starts = [0] + list(itertools.accumulate(lens))[:-1]

    def fn(q, k, v, seg):
        outs = []
        with sdpa_kernel(backend):
            for s, n in zip(starts, lens):
                qd, kd, vd = (t[s : s + n].transpose(0, 1)[None] for t in (q, k, v))
                o = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
                outs.append(o[0].transpose(0, 1))
        return torch.cat(outs)

    return fn


def flex_fn(lens, device):
    """FlexAttention (compiled) over the packed sequence with a causal document mask."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    doc = torch.repeat_interleave(torch.arange(len(lens), device=device), torch.tensor(lens, device=device))
    total = doc.numel()

    def mask_mod(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    block_mask = create_block_mask(mask_mod, None, None, total, total, device=device)
    flex = torch.compile(flex_attention, dynamic=False)

    def fn(q, k, v, seg):
        out = flex(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1],
        )  # fmt: skip
        return out[0].transpose(0, 1)

    return fn


# --- timing ---------------------------------------------------------------------------------------


def make_inputs(total, heads, kv_heads, d, device, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(total, heads, d, device=device, dtype=DTYPE, generator=gen)
    k = torch.randn(total, kv_heads, d, device=device, dtype=DTYPE, generator=gen)
    v = torch.randn(total, kv_heads, d, device=device, dtype=DTYPE, generator=gen)
    return [t.requires_grad_() for t in (q, k, v)]


def op_inputs(lens, d, gqa, device):
    """``(q, k, v, seg, out, lse, dout, dlse)`` for calling the forward and backward ops directly
    on documents of lengths ``lens``: detached inputs, the forward's outputs, random ``dout``,
    zero ``dlse``."""
    q, k, v = (t.detach() for t in make_inputs(sum(lens), HEADS, HEADS // gqa, d, device))
    seg = segments_for(lens, device)
    out, lse = torch.ops.cp_ops.varlen_attention(q, k, v, *seg, True)
    return q, k, v, seg, out, lse, torch.randn_like(out), torch.zeros_like(lse)


def time_fwd_bwd(fn, q, k, v, seg):
    dout = torch.randn_like(q)

    def fwd():
        with torch.no_grad():
            fn(q, k, v, seg)

    def fwd_bwd():
        fn(q, k, v, seg).backward(dout)

    ms_fwd = triton.testing.do_bench(fwd, warmup=25, rep=200, return_mode="median")
    ms_all = triton.testing.do_bench(fwd_bwd, warmup=25, rep=200, grad_to_none=[q, k, v], return_mode="median")
    return ms_fwd, ms_all


def check_agreement(name, fn, ref_fn, q, k, v, seg):
    """Output and gradients of ``fn`` vs ``ref_fn`` in bf16 (rel_error < bf16 tolerance)."""
    dout = torch.randn_like(q)
    results = []
    for f in (fn, ref_fn):
        qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
        out = f(qq, kk, vv, seg)
        out.backward(dout)
        results.append((out.detach(), qq.grad, kk.grad, vv.grad))
    errs = [rel_error(a, b) for a, b in zip(*results)]
    ok = all(e < TOLERANCE[DTYPE] for e in errs)
    print(f"  check {name}: rel_error out/dq/dk/dv = {', '.join(f'{e:.1e}' for e in errs)} {'ok' if ok else 'FAILED'}")
    return ok


def bench(gqa: int = 1, head_dims=HEAD_DIMS) -> None:
    device = torch.device("cuda")
    rows = []
    cases = [("packed 32k", packed_lengths()), ("dense B8 x 4096", [4096] * 8)]
    for d in head_dims:
        for case, lens in cases:
            dense = len(set(lens)) == 1
            q, k, v = make_inputs(sum(lens), HEADS, HEADS // gqa, d, device)
            seg = segments_for(lens, device)
            pairs = visible_pairs(lens)
            impls = [("varlen_attention", varlen_fn)] + [(name, varlen_fn) for name in VARIANTS]
            if dense:
                impls += [
                    ("SDPA flash", sdpa_dense_fn(SDPBackend.FLASH_ATTENTION, len(lens), lens[0])),
                    ("SDPA cuDNN", sdpa_dense_fn(SDPBackend.CUDNN_ATTENTION, len(lens), lens[0])),
                ]
            else:
                impls += [("SDPA flash, loop over docs", sdpa_loop_fn(SDPBackend.FLASH_ATTENTION, lens))]
            impls += [("FlexAttention doc mask", flex_fn(lens, device))]
            ref_name, ref = impls[1 + len(VARIANTS)]
            print(f"D={d} {case} ({len(lens)} docs, {pairs / 1e6:.1f}M visible pairs per head)")
            for name, fn in impls:
                try:
                    with VARIANTS.get(name, contextlib.nullcontext)():
                        if name != ref_name and not check_agreement(name, fn, ref, q, k, v, seg):
                            rows.append((case, d, name, None, None, None, None, "disagrees with SDPA"))
                            continue
                        ms_fwd, ms_all = time_fwd_bwd(fn, q, k, v, seg)
                except Exception as e:  # a backend may be unavailable for this shape / build
                    rows.append((case, d, name, None, None, None, None, f"{type(e).__name__}: {str(e)[:60]}"))
                    continue
                rows.append(
                    (case, d, name, ms_fwd, tflops(pairs, HEADS, d, ms_fwd),
                     ms_all, tflops(pairs, HEADS, d, ms_all, 3.5), "")
                )  # fmt: skip
            del q, k, v
    props = torch.cuda.get_device_properties(0)
    print()
    print(f"{props.name}, torch {torch.__version__}, triton {triton.__version__}, {datetime.date.today()}")
    print(f"bf16, causal, H = {HEADS}, Hkv = {HEADS // gqa}; TFLOP/s on visible pairs; median of do_bench")
    print()
    print("| case | D | implementation | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s | note |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for case, d, name, mf, tf, ma, ta, note in rows:
        fmt = lambda x, p: "-" if x is None else f"{x:.{p}f}"  # noqa: E731
        print(f"| {case} | {d} | {name} | {fmt(mf, 3)} | {fmt(tf, 0)} | {fmt(ma, 3)} | {fmt(ta, 0)} | {note} |")


# --- tuning ---------------------------------------------------------------------------------------

FWD_CANDIDATES = [
    dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=s, K_ROWS=kr)
    for kr in (True, False)
    for bm, bn, w, s in [
        (128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3),
        (64, 64, 4, 4), (128, 64, 8, 2),
    ]
]  # fmt: skip
DKDV_CANDIDATES = [
    dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=s)
    for bm, bn, w, s in [
        (64, 128, 8, 2), (32, 128, 8, 2), (32, 128, 8, 3), (32, 128, 4, 3), (64, 64, 4, 2),
        (64, 64, 4, 3), (64, 64, 8, 3), (32, 64, 4, 3), (64, 128, 8, 3), (16, 128, 4, 3),
    ]
] + [
    # one program for dv and one for dk per tile (PARTS = 2)
    dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=s, PARTS=2)
    for bm, bn, w, s in [(64, 64, 4, 2), (64, 128, 8, 2), (64, 128, 8, 3), (32, 64, 4, 3)]
]  # fmt: skip
DQ_CANDIDATES = [
    dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=s)
    for bm, bn, w, s in [
        (128, 64, 8, 2), (128, 32, 8, 2), (128, 32, 8, 3), (128, 32, 4, 3), (64, 64, 4, 2),
        (64, 64, 4, 3), (64, 32, 4, 3), (128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2),
    ]
]  # fmt: skip
# D = 256 (Qwen3-Next's attention heads): the tiles above do not fit an SM's shared memory or
# registers at this width; smaller tiles and fewer stages
WIDE_HEAD_CANDIDATES = {
    "fwd": [
        dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=s, K_ROWS=kr)
        for kr in (True, False)
        for bm, bn, w, s in [
            (64, 32, 4, 2), (64, 32, 8, 2), (64, 64, 4, 2), (64, 64, 8, 2), (128, 32, 8, 2),
            (128, 64, 8, 2), (64, 32, 4, 3), (128, 32, 8, 3), (64, 64, 8, 3),
        ]
    ],
    # dk/dv: one program per key tile, and two (PARTS = 2: one for dv, one for dk)
    "bwd_dkdv": [
        dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=s, PARTS=parts)
        for bm, bn, w, s, parts in [
            (64, 64, 8, 1, 1), (32, 32, 4, 2, 1), (32, 64, 8, 2, 1), (64, 64, 8, 1, 2), (64, 128, 8, 1, 2),
            (32, 64, 8, 2, 2), (32, 128, 8, 2, 2), (64, 64, 8, 2, 2), (64, 64, 4, 2, 2), (32, 64, 4, 2, 2),
            (16, 128, 8, 2, 2), (16, 128, 8, 3, 2), (32, 128, 8, 1, 2),
        ]
    ],
    "bwd_dq": [
        dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=s)
        for bm, bn, w, s in [
            (64, 32, 8, 1), (64, 32, 8, 2), (64, 64, 8, 2), (128, 32, 8, 2), (32, 64, 4, 2),
            (64, 32, 4, 2), (128, 64, 8, 1),
        ]
    ],
}  # fmt: skip


def candidates_for(kind: str, d: int) -> list[dict]:
    """The configs ``--tune`` tries for ``kind`` at head dim ``d``."""
    if d > 128:
        return WIDE_HEAD_CANDIDATES[kind]
    return {"fwd": FWD_CANDIDATES, "bwd_dkdv": DKDV_CANDIDATES, "bwd_dq": DQ_CANDIDATES}[kind]


def _table_in_use(kind: str, d: int, q, k, v) -> str:
    """The name of the config table the op launches ``kind`` from for these inputs."""
    streamed = (k, v) if kind in ("fwd", "bwd_dq") else (q, q)
    return "TMA_CONFIGS" if op_mod.tma_usable(kind, d, d, *streamed) else "CONFIGS"


def _time_kernel(kind, cfg, table, bucket, q, k, v, seg, out, lse, dout, dlse):
    configs = getattr(kernels, table)
    saved = configs[kind].get(bucket)
    configs[kind][bucket] = cfg
    try:
        if kind == "fwd":
            fn = lambda: torch.ops.cp_ops.varlen_attention(q, k, v, *seg, True)  # noqa: E731
        else:
            fn = lambda: torch.ops.cp_ops.varlen_attention_backward(dout, dlse, q, k, v, out, lse, *seg, True)  # noqa: E731
        fn()  # compile outside the timing
        return triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median")
    except Exception as e:  # e.g. out of shared memory for this tile shape
        print(f"    {cfg}: {type(e).__name__}")
        return float("inf")
    finally:
        if saved is None:
            del configs[kind][bucket]
        else:
            configs[kind][bucket] = saved


def tune(
    gqa: int = 1, kinds=("fwd", "bwd_dkdv", "bwd_dq"), save: str | None = None, head_dims=HEAD_DIMS, rounds: int = 1
) -> None:
    """Time the candidate configs of each kernel on both cases at each of ``head_dims``; print
    the best (and write them to ``save`` as JSON, for ``--configs``).

    Each kernel is tuned in the table the op launches it from on this GPU (TMA_CONFIGS where
    the TMA loads serve it, else CONFIGS; ``--pointer-loads`` tunes CONFIGS). The backward is
    timed as the whole backward op while one of its kernels varies (the others keep their
    table entries). With ``rounds`` > 1 every candidate is timed once per round, in turn, and
    its time is the median over rounds: drift of the GPU over the run then falls on every
    candidate alike.
    """
    device = torch.device("cuda")
    cases = [("packed 32k", packed_lengths()), ("dense B8 x 4096", [4096] * 8)]
    best, tables = {}, {}
    for d in head_dims:
        bucket = d
        for kind in kinds:
            probe = make_inputs(16, HEADS, HEADS // gqa, d, device)
            table = tables[kind] = _table_in_use(kind, d, *probe)
            candidates = candidates_for(kind, d)
            if table == "TMA_CONFIGS":  # K_ROWS picks a pointer-load form: one row per tile shape
                candidates = [c for c in candidates if c.get("K_ROWS", True)]
            print(f"D={d} {kind}: tuning {table}")
            totals = {}
            for case, lens in cases:
                q, k, v, seg, out, lse, dout, dlse = op_inputs(lens, d, gqa, device)
                pairs = visible_pairs(lens)
                factor = 1.0 if kind == "fwd" else 2.5
                times = {}
                for _ in range(rounds):
                    for i, cfg in enumerate(candidates):
                        ms = _time_kernel(kind, cfg, table, bucket, q, k, v, seg, out, lse, dout, dlse)
                        times.setdefault(i, []).append(ms)
                for i, cfg in enumerate(candidates):
                    ms = statistics.median(times[i])
                    totals[i] = totals.get(i, 0.0) + ms
                    spread = f" (rounds {min(times[i]):.3f}-{max(times[i]):.3f})" if rounds > 1 else ""
                    print(f"  D={d} {kind:8s} {case:16s} {cfg}: {ms:.3f} ms{spread}, "
                          f"{tflops(pairs, HEADS, d, ms, factor):.0f} TFLOP/s")  # fmt: skip
            i = min(totals, key=totals.get)
            best[(kind, d)] = candidates[i]
            print(f"best D={d} {kind}: {candidates[i]} (sum over cases {totals[i]:.3f} ms)")
    print("\n# paste into custom_ops/varlen_attention/kernels.py")
    for kind in kinds:
        entries = ", ".join(f"{d}: dict({_fmt(best[(kind, d)])})" for d in sorted(head_dims))
        print(f'{tables[kind]} "{kind}": {{{entries}}},')
    if save:
        with open(save, "w") as f:
            json.dump(
                {kind: {"table": tables[kind], **{str(d): best[(kind, d)] for d in sorted(head_dims)}} for kind in kinds},
                f, indent=1,
            )  # fmt: skip


HEAD_GROUP_SWEEP = (1, 2, 4, 8, 16)


def sweep_head_groups(gqa: int = 1, head_dims=HEAD_DIMS, groups=HEAD_GROUP_SWEEP, rounds: int = 3) -> None:
    """Time the three kernels with every kernel's ``HEAD_GROUP`` set to each of ``groups`` (kv
    heads; see custom_ops/varlen_attention/kernels.py), and the forward's and dq's segments
    last to first and heaviest first (``SEGMENTS_BY_WORK``), in turn for ``rounds`` rounds: the
    forward op with ``do_bench``, dq and dk/dv from the profiler over 20 backward calls (their
    kernels alone). Prints the medians and the speedup against the first group with the
    segments last to first."""
    device = torch.device("cuda")
    lines = []
    for d in head_dims:
        for case, lens in [("packed 32k", packed_lengths()), ("dense B8 x 4096", [4096] * 8)]:
            q, k, v, seg, out, lse, dout, dlse = op_inputs(lens, d, gqa, device)

            def fwd():
                return torch.ops.cp_ops.varlen_attention(q, k, v, *seg, True)

            def bwd():
                return torch.ops.cp_ops.varlen_attention_backward(dout, dlse, q, k, v, out, lse, *seg, True)

            times = {}
            settings = [(order, g) for order in ("last to first", "by work") for g in groups]
            for _ in range(rounds):
                for order, g in settings:
                    by_work = dict.fromkeys(kernels.SEGMENTS_BY_WORK, order == "by work")
                    with _kernel_setting("HEAD_GROUP", dict.fromkeys(kernels.HEAD_GROUP, g)), _kernel_setting(
                        "SEGMENTS_BY_WORK", by_work
                    ):
                        fwd(), bwd()  # compile outside the timing
                        times.setdefault((order, g, "fwd"), []).append(
                            triton.testing.do_bench(fwd, warmup=10, rep=100, return_mode="median")
                        )
                        for name, ms in kernel_breakdown(bwd, runs=20):
                            for kind in ("dq", "dkdv"):
                                if f"bwd_{kind}_kernel" in name:
                                    times.setdefault((order, g, kind), []).append(ms)
            med = {key: statistics.median(ts) for key, ts in times.items()}
            for order, g in settings:
                cells = " | ".join(
                    f"{med[(order, g, kind)]:.3f} ({med[settings[0] + (kind,)] / med[(order, g, kind)]:.3f})"
                    for kind in ("fwd", "dq", "dkdv")
                )
                lines.append(f"| {case} | {d} | {HEADS // gqa} | {order} | {g} | {cells} |")
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}, torch {torch.__version__}, triton {triton.__version__}, {datetime.date.today()}")
    print(
        f"bf16, causal, H = {HEADS}; medians of {rounds} rounds; in brackets the speedup against group "
        f"{groups[0]}, segments last to first"
    )
    print()
    print("| case | D | Hkv | segments | HEAD_GROUP (kv heads) | fwd ms | dq ms | dk/dv ms |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    print("\n".join(lines))


def load_configs(path: str) -> None:
    """Overwrite entries of the config tables with those of a ``--tune --save`` file."""
    with open(path) as f:
        tuned = json.load(f)
    for kind, entries in tuned.items():
        table = entries.pop("table", "CONFIGS")
        configs = getattr(kernels, table)
        for bucket, cfg in entries.items():
            if table == "CONFIGS" and int(bucket) not in configs[kind]:
                raise SystemExit(f"{path}: {kind} has no head-dim bucket {bucket} in CONFIGS")
            configs[kind][int(bucket)] = cfg
            print(f"config {table} {kind} D<={bucket}: {_fmt(cfg)}")


def profile(gqa: int = 1, head_dims=HEAD_DIMS) -> None:
    """CUDA time per kernel of the forward and backward ops (torch.profiler, mean over 5 calls)."""
    device = torch.device("cuda")
    for case, lens in [("dense B8 x 4096", [4096] * 8), ("packed 32k", packed_lengths())]:
        for d in head_dims:
            q, k, v, seg, out, lse, dout, dlse = op_inputs(lens, d, gqa, device)

            def step():
                torch.ops.cp_ops.varlen_attention(q, k, v, *seg, True)
                torch.ops.cp_ops.varlen_attention_backward(dout, dlse, q, k, v, out, lse, *seg, True)

            print(f"{case}, D = {d}: CUDA ms per call")
            for name, ms in kernel_breakdown(step, runs=5, warmup=1):
                print(f"  {name[:60]:60s} {ms:.3f}")


def _fmt(cfg):
    return ", ".join(f"{k}={v}" for k, v in cfg.items())


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tune", action="store_true", help="time kernel configs instead of the comparison table")
    parser.add_argument("--profile", action="store_true", help="CUDA time per kernel instead of the table")
    parser.add_argument("--head-groups", type=int, nargs="*", default=None,
                        help="time the kernels at these HEAD_GROUP values (none given: 1, 2, 4, 8, 16) "
                             "instead of the table")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=None,
                        help="rounds of timing every candidate in turn (--tune: default 1; --head-groups: 3)")  # fmt: skip
    parser.add_argument("--kinds", nargs="+", default=["fwd", "bwd_dkdv", "bwd_dq"], help="kernels to tune")
    parser.add_argument("--gqa", type=int, default=1, help="query heads per kv head (default 1)")
    parser.add_argument("--head-dims", type=int, nargs="+", default=list(HEAD_DIMS),
                        help="head dims D to run (default 128 64; 256 is Qwen3-Next's)")  # fmt: skip
    parser.add_argument("--save", help="with --tune: write the best configs to this JSON file")
    parser.add_argument("--configs", help="JSON from --tune --save: use these configs instead of the table's")
    parser.add_argument("--pointer-loads", action="store_true",
                        help="no TMA loads: run (and --tune) the pointer-load kernels and CONFIGS")  # fmt: skip
    args = parser.parse_args()
    if args.pointer_loads:
        kernels.TMA_ENABLED = False
    if args.tune and set(args.head_dims) - set(kernels.CONFIGS["fwd"]):
        raise SystemExit(f"--tune tunes the config table's head dims {sorted(kernels.CONFIGS['fwd'])}, "
                         f"got {args.head_dims}")  # fmt: skip
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA device")
    if args.configs:
        load_configs(args.configs)
    if args.tune:
        tune(args.gqa, args.kinds, args.save, args.head_dims, args.rounds or 1)
    elif args.head_groups is not None:
        sweep_head_groups(args.gqa, args.head_dims, tuple(args.head_groups or HEAD_GROUP_SWEEP), args.rounds or 3)
    elif args.profile:
        profile(args.gqa, args.head_dims)
    else:
        bench(args.gqa, args.head_dims)
