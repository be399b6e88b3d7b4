"""GPU benchmark and tuner for custom_ops.varlen_attention (bf16, causal) against SDPA flash,
cuDNN and FlexAttention, every implementation checked against SDPA first.

    python -m benchmarks.bench_varlen_attention [--gqa G] [--head-dims D ...] [--configs FILE] [--pointer-loads]
    python -m benchmarks.bench_varlen_attention --tune [--kinds fwd bwd_dkdv bwd_dq] [--rounds N] [--save FILE]
    python -m benchmarks.bench_varlen_attention --profile  # CUDA time per kernel of one forward and one backward

Results (benchmarks/runner.py): ``attention`` (``attention-gqaG-dD..`` at other heads),
``attention-profile...``; ``-pointer-loads``, ``-tuned`` added with those flags. docs/benchmarks.md
gives the cases and the FLOP count.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import statistics

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import custom_ops
from benchmarks.cases import ATTENTION_DTYPE as DTYPE
from benchmarks.cases import ATTENTION_HEAD_DIMS as HEAD_DIMS
from benchmarks.cases import ATTENTION_HEADS as HEADS
from benchmarks.cases import attention_cases, segments_for, tflops, visible_pairs
from benchmarks.cases import attention_inputs as make_inputs
from benchmarks.cases import attention_op_inputs
from benchmarks.internals import CONFIGS, DEFAULT_SETTINGS, KERNELS, AttentionSettings, resolve_scale
from benchmarks.internals import attention_launch as launch
from benchmarks.runner import Result, add_out_argument, emit, environment
from benchmarks.timing import kernel_breakdown
from custom_ops.testing import TOLERANCE, rel_error


# --- launch settings ------------------------------------------------------------------------------
# The ops launch with the library's DEFAULT_SETTINGS. The tuner, the sweeps and the runs with
# other settings (--pointer-loads, --configs) call the launchers of
# custom_ops.varlen_attention.launch with an AttentionSettings instead.


def settings_for(base: AttentionSettings, tuned: dict | None, d: int) -> AttentionSettings:
    """``base`` with the configs a ``--tune --save`` file (:func:`load_configs`) holds for head dim ``d``."""
    settings = base
    for kind, by_dim in (tuned or {}).items():
        if d in by_dim:
            settings = settings.with_kernel(kind, config=by_dim[d])
    return settings


def launchers(settings: AttentionSettings, q, k, v, seg, out=None, lse=None, dout=None, dlse=None):
    """``(fwd, bwd)``: closures running the forward and backward launchers under ``settings``
    (causal, no window, the default scale), as the ops would with their own settings."""
    scale = resolve_scale(None, q.shape[2])

    def fwd():
        return launch.forward(q, k, v, seg, True, -1, -1, scale, settings)

    def bwd():
        return launch.backward(dout, dlse, q, k, v, out, lse, seg, True, -1, -1, scale, settings)

    return fwd, bwd


class _Launched(torch.autograd.Function):
    """Segment attention (causal) by the launchers under given settings, differentiable: what
    ``custom_ops.varlen_attention`` computes, under other settings than the op's."""

    @staticmethod
    def forward(ctx, q, k, v, settings, *seg):
        out, lse = launchers(settings, q, k, v, seg)[0]()
        ctx.save_for_backward(q, k, v, out, lse, *seg)
        ctx.settings = settings
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, *seg = ctx.saved_tensors
        dq, dk, dv = launchers(ctx.settings, q, k, v, seg, out, lse, dout, torch.zeros_like(lse))[1]()
        return (dq, dk, dv, None) + (None,) * len(seg)


def settings_fn(settings: AttentionSettings):
    def fn(q, k, v, seg):
        return _Launched.apply(q, k, v, settings, *seg)

    return fn


# --- implementations ------------------------------------------------------------------------------


def varlen_fn(q, k, v, seg):
    return custom_ops.varlen_attention(q, k, v, *seg, causal=True)[0]


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


def op_inputs(lens, d, gqa, device):
    """:func:`benchmarks.cases.attention_op_inputs` at this benchmark's heads."""
    return attention_op_inputs(lens, d, gqa, device, HEADS)


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


def _suffix(gqa: int, head_dims) -> str:
    """The result-name suffix of a run at other heads than the default's."""
    if gqa == 1 and tuple(head_dims) == HEAD_DIMS:
        return ""
    return f"-gqa{gqa}-d" + "-".join(str(d) for d in head_dims)


def bench(gqa: int = 1, head_dims=HEAD_DIMS, base: AttentionSettings = DEFAULT_SETTINGS, tuned: dict | None = None,
          label: str = "") -> list[Result]:  # fmt: skip
    device = torch.device("cuda")
    rows = []
    cases = attention_cases()
    for d in head_dims:
        for case, lens in cases:
            dense = len(set(lens)) == 1
            q, k, v = make_inputs(sum(lens), HEADS, HEADS // gqa, d, device)
            seg = segments_for(lens, device)
            pairs = visible_pairs(lens)
            settings = settings_for(base, tuned, d)
            ours = varlen_fn if settings == DEFAULT_SETTINGS else settings_fn(settings)
            impls = [("varlen_attention" + label, ours)]
            if dense:
                impls += [
                    ("SDPA flash", sdpa_dense_fn(SDPBackend.FLASH_ATTENTION, len(lens), lens[0])),
                    ("SDPA cuDNN", sdpa_dense_fn(SDPBackend.CUDNN_ATTENTION, len(lens), lens[0])),
                ]
            else:
                impls += [("SDPA flash, loop over docs", sdpa_loop_fn(SDPBackend.FLASH_ATTENTION, lens))]
            impls += [("FlexAttention doc mask", flex_fn(lens, device))]
            ref_name, ref = impls[1]
            print(f"D={d} {case} ({len(lens)} docs, {pairs / 1e6:.1f}M visible pairs per head)")
            for name, fn in impls:
                try:
                    if name != ref_name and not check_agreement(name, fn, ref, q, k, v, seg):
                        rows.append([case, d, name, None, None, None, None, "disagrees with SDPA"])
                        continue
                    ms_fwd, ms_all = time_fwd_bwd(fn, q, k, v, seg)
                except Exception as e:  # a backend may be unavailable for this shape / build
                    rows.append([case, d, name, None, None, None, None, f"{type(e).__name__}: {str(e)[:60]}"])
                    continue
                rows.append(
                    [case, d, name, ms_fwd, tflops(pairs, HEADS, d, ms_fwd),
                     ms_all, tflops(pairs, HEADS, d, ms_all, 3.5), ""]
                )  # fmt: skip
            del q, k, v
    columns = ["case", "D", "implementation", "fwd ms", "fwd TFLOP/s", "fwd+bwd ms", "fwd+bwd TFLOP/s", "note"]
    formats = {"D": "{:d}", "fwd ms": "{:.3f}", "fwd TFLOP/s": "{:.0f}", "fwd+bwd ms": "{:.3f}",
               "fwd+bwd TFLOP/s": "{:.0f}"}  # fmt: skip
    notes = f"bf16, causal, H = {HEADS}, Hkv = {HEADS // gqa}; TFLOP/s on visible pairs; median of do_bench"
    title = "Segment attention against SDPA, FlexAttention and cuDNN"
    return [Result("varlen_attention", title, columns, rows, notes, environment(),
                   name="attention" + _suffix(gqa, head_dims), formats=formats)]  # fmt: skip


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


def _table_in_use(kind: str, d: int, q, k, v, settings: AttentionSettings) -> str:
    """The name of the config table the launcher takes ``kind``'s config from for these inputs."""
    streamed = (k, v) if kind in ("fwd", "bwd_dq") else (q, q)
    return "TMA_CONFIGS" if launch.tma_usable(kind, d, d, *streamed, settings=settings) else "CONFIGS"


def _time_kernel(kind, cfg, settings, q, k, v, seg, out, lse, dout, dlse):
    """do_bench median of the forward (``kind`` "fwd") or the whole backward launch, with
    ``cfg`` in place of ``kind``'s tables entry."""
    fwd, bwd = launchers(settings.with_kernel(kind, config=cfg), q, k, v, seg, out, lse, dout, dlse)
    fn = fwd if kind == "fwd" else bwd
    try:
        fn()  # compile outside the timing
        return triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median")
    except Exception as e:  # e.g. out of shared memory for this tile shape
        print(f"    {cfg}: {type(e).__name__}")
        return float("inf")


def tune(
    gqa: int = 1, kinds=("fwd", "bwd_dkdv", "bwd_dq"), save: str | None = None, head_dims=HEAD_DIMS, rounds: int = 1,
    base: AttentionSettings = DEFAULT_SETTINGS,
) -> None:
    """Time the candidate configs of each kernel on both cases at each of ``head_dims``; print
    the best (and write them to ``save`` as JSON, for ``--configs``).

    Each kernel is tuned for the table the launcher takes it from on this GPU (TMA_CONFIGS
    where the TMA loads serve it, else CONFIGS; ``--pointer-loads`` tunes CONFIGS), each
    candidate passed as the kernel's config in the launch settings. The backward is timed as
    the whole backward launch while one of its kernels varies (the others keep their table
    entries). With ``rounds`` > 1 every candidate is timed once per round, in turn, and
    its time is the median over rounds: drift of the GPU over the run then falls on every
    candidate alike.
    """
    device = torch.device("cuda")
    cases = attention_cases()
    best, tables = {}, {}
    for d in head_dims:
        for kind in kinds:
            probe = make_inputs(16, HEADS, HEADS // gqa, d, device)
            table = tables[kind] = _table_in_use(kind, d, *probe, base)
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
                        ms = _time_kernel(kind, cfg, base, q, k, v, seg, out, lse, dout, dlse)
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
    print("\n# paste into custom_ops/varlen_attention/configs.py")
    for kind in kinds:
        entries = ", ".join(f"{d}: dict({_fmt(best[(kind, d)])})" for d in sorted(head_dims))
        print(f'{tables[kind]} "{kind}": {{{entries}}},')
    if save:
        with open(save, "w") as f:
            json.dump(
                {kind: {"table": tables[kind], **{str(d): best[(kind, d)] for d in sorted(head_dims)}} for kind in kinds},
                f, indent=1,
            )  # fmt: skip


def load_configs(path: str) -> dict[str, dict[int, dict]]:
    """``{kernel: {head dim: config}}`` of a ``--tune --save`` file (:func:`settings_for` passes
    them to the launchers)."""
    with open(path) as f:
        saved = json.load(f)
    tuned = {}
    for kind, entries in saved.items():
        if kind not in KERNELS:
            raise SystemExit(f"{path}: unknown kernel {kind!r}; the kernels are {KERNELS}")
        tuned[kind] = {int(d): cfg for d, cfg in entries.items() if d != "table"}
        for d, cfg in tuned[kind].items():
            print(f"config {kind} D={d}: {_fmt(cfg)}")
    return tuned


def profile(gqa: int = 1, head_dims=HEAD_DIMS, base: AttentionSettings = DEFAULT_SETTINGS,
            tuned: dict | None = None) -> list[Result]:  # fmt: skip
    """CUDA time per kernel of the forward and backward launches (torch.profiler, mean over 5 calls)."""
    device = torch.device("cuda")
    rows = []
    for case, lens in attention_cases()[::-1]:
        for d in head_dims:
            q, k, v, seg, out, lse, dout, dlse = op_inputs(lens, d, gqa, device)
            fwd, bwd = launchers(settings_for(base, tuned, d), q, k, v, seg, out, lse, dout, dlse)

            def step():
                fwd()
                bwd()

            rows += [[case, d, name[:60], ms] for name, ms in kernel_breakdown(step, runs=5, warmup=1)]
    notes = f"bf16, causal, H = {HEADS}, Hkv = {HEADS // gqa}; CUDA ms per call (torch.profiler, mean of 5 calls)"
    return [Result("varlen_attention", "Segment attention: CUDA time per kernel, one forward and one backward",
                   ["case", "D", "kernel", "ms"], rows, notes, environment(),
                   name="attention-profile" + _suffix(gqa, head_dims))]  # fmt: skip


def _fmt(cfg):
    return ", ".join(f"{k}={v}" for k, v in cfg.items())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tune", action="store_true", help="time kernel configs instead of the comparison table")
    parser.add_argument("--profile", action="store_true", help="CUDA time per kernel instead of the table")
    parser.add_argument("--rounds", type=int, default=1, help="with --tune: rounds of timing every candidate in turn")
    parser.add_argument("--kinds", nargs="+", default=["fwd", "bwd_dkdv", "bwd_dq"], help="kernels to tune")
    parser.add_argument("--gqa", type=int, default=1, help="query heads per kv head (default 1)")
    parser.add_argument("--head-dims", type=int, nargs="+", default=list(HEAD_DIMS),
                        help="head dims D to run (default 128 64; 256 is Qwen3-Next's)")  # fmt: skip
    parser.add_argument("--save", help="with --tune: write the best configs to this JSON file")
    parser.add_argument("--configs", help="JSON from --tune --save: use these configs instead of the table's")
    parser.add_argument("--pointer-loads", action="store_true",
                        help="no TMA loads: run (and --tune) the pointer-load kernels and CONFIGS")  # fmt: skip
    add_out_argument(parser)
    args = parser.parse_args(argv)
    if args.tune and set(args.head_dims) - set(CONFIGS["fwd"]):
        raise SystemExit(f"--tune tunes the config table's head dims {sorted(CONFIGS['fwd'])}, "
                         f"got {args.head_dims}")  # fmt: skip
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA device")
    base = dataclasses.replace(DEFAULT_SETTINGS, tma=False) if args.pointer_loads else DEFAULT_SETTINGS
    tuned = load_configs(args.configs) if args.configs else None
    # other settings than the ops': their own row label and result names
    label = ", pointer loads" * args.pointer_loads + ", tuned configs" * bool(tuned)
    if args.tune:
        tune(args.gqa, args.kinds, args.save, args.head_dims, args.rounds, base)
        return
    if args.profile:
        results = profile(args.gqa, args.head_dims, base, tuned)
    else:
        results = bench(args.gqa, args.head_dims, base, tuned, label)
    for r in results:
        r.name += "-pointer-loads" * args.pointer_loads + "-tuned" * bool(tuned)
    emit(results, args.out)


if __name__ == "__main__":
    main()
