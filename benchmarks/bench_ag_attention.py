"""All-gather CP attention on W GPUs (NCCL) against segment attention on one GPU.

    python -m benchmarks.bench_ag_attention [--world W] [--tokens T ...] [--gqa G] [--head-dim D]
        [--head-groups G ...] [--cudagraphs] [--profile] [--nccl-max-ctas N ...] [--out DIR]
    python -m benchmarks.bench_ag_attention --smoke        # 2 gloo ranks on the CPU, tiny shapes
    python -m benchmarks.bench_ag_attention --work-model   # CPU only: kernel tiles per rank against one GPU

Results (benchmarks/runner.py): ``ag-attention-wW`` (``-gqaG-dD`` at other heads, ``-cudagraphs``;
``ag-attention-smoke-wW``), ``...-profile`` with --profile, ``ag-attention-work-model``.
docs/benchmarks.md says what each column measures.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import custom_ops
from benchmarks.cases import packed_lengths
from benchmarks.common import (
    add_nccl_cta_argument,
    check_nccl_cta_argument,
    cta_label,
    default_world,
    host_issue_ms,
    kernel_class,
    kernel_totals,
    max_over_ranks,
    median_ms_counted,
    nccl_cta_groups,
    profile_kernels,
    rank_waits,
    recompile_limit,
    spawn_ranks,
    timeline_summary,
)
from benchmarks.runner import Result, add_out_argument, emit, environment
from cp_ops import COMPILE_OPTIONS, ag_thd_attention, all_gather_rows, pad_cu_seqlens, resolve_group, shard_thd
from cp_ops.local_ranks import init_local_rank
from custom_ops.testing import TOLERANCE, rel_error

TOTALS = (32768, 65536)
HEADS, HEAD_DIM = 16, 128
DTYPE = torch.bfloat16
# --smoke: the same code path on 2 gloo ranks, at sizes a CPU runs in seconds
SMOKE_TOTALS, SMOKE_HEADS, SMOKE_HEAD_DIM = (1024,), 4, 16  # two documents: 1008 and 16 tokens


def _fwd_and_step(fn, q, k, v, dout):
    """Two closures: the forward alone, and forward + backward to q, k, v."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]

    def fwd():
        with torch.no_grad():
            fn(q, k, v)

    def step():
        torch.autograd.grad(fn(*leaves), leaves, dout)

    return fwd, step


PROFILE_RUNS = 5


def _compiled(fn, cudagraphs: bool, options: dict | None = None):
    """``fn`` compiled the way every compiled form of this benchmark is, the one-GPU baseline's
    included: ``fullgraph=True``, with ``options``, and Inductor's CUDA graphs under --cudagraphs."""
    graphs = {"triton.cudagraphs": True} if cudagraphs else {}
    return torch.compile(fn, fullgraph=True, options={**(options or {}), **graphs})


def _profile_rows(step) -> dict[str, float]:
    """Where one fwd+bwd step's GPU time goes: :func:`benchmarks.common.timeline_summary` of
    its kernels, and the kernel time of each attention kernel and of NCCL, per step (ms)."""
    kernels = profile_kernels(step, PROFILE_RUNS)
    out = timeline_summary(kernels, PROFILE_RUNS)
    for name in ("varlen_attn_fwd", "varlen_attn_bwd_dq", "varlen_attn_bwd_dkdv", "nccl"):
        out[f"{name} kernels"] = sum(e - s for n, s, e in kernels if name in n.lower()) / PROFILE_RUNS / 1e3
    top = [(n, t) for n, t in kernel_totals(kernels, PROFILE_RUNS).items() if kernel_class(n) == "other"][:6]
    print("  largest 'other' kernels (ms per step): " + "; ".join(f"{n[:70]} {t:.3f}" for n, t in top), flush=True)
    out["host issue"] = host_issue_ms(step)
    return out


def _worker(*args) -> None:
    # the compiled forms are closures of one function: one graph per form, group, total and grad mode
    with recompile_limit(64):
        _rank(*args)


def _rank(
    rank: int, world: int, init_method: str, gqa: int, out: str | None, smoke: bool, profile: bool, cudagraphs: bool,
    head_groups: tuple[int, ...] = (), max_ctas: tuple[int, ...] = (0,), head_dim: int = HEAD_DIM,
    tokens: tuple[int, ...] = TOTALS,
) -> None:
    device = init_local_rank(rank, world, init_method, "cpu" if smoke else "cuda")
    groups = nccl_cta_groups(max_ctas)  # {cap: group}: the CP forms are timed on each
    name_cap = len(groups) > 1
    totals, heads, head_dim = (SMOKE_TOTALS, SMOKE_HEADS, SMOKE_HEAD_DIM) if smoke else (tokens, HEADS, head_dim)
    warmup, runs = (1, 3) if smoke else (5, 40)

    def timed(fn):
        return median_ms_counted(fn, warmup, runs, device)

    kv_heads = heads // gqa
    rows = []
    profiles = {}
    try:
        for total in totals:
            lens = packed_lengths(total)
            cu, cup = pad_cu_seqlens(lens, world, device=device)
            num_rows = int(cup[-1])
            gen = torch.Generator(device=device).manual_seed(0)  # one global batch on every rank

            def rand(h):
                return torch.randn(num_rows, h, head_dim, device=device, generator=gen).to(DTYPE)

            q, k, v, dout = rand(heads), rand(kv_heads), rand(kv_heads), rand(heads)
            lengths, starts = cu[1:] - cu[:-1], cup[:-1]
            seg = (starts, lengths, torch.zeros_like(lengths), starts, lengths)

            def one_gpu(q_, k_, v_):
                return custom_ops.varlen_attention(q_, k_, v_, *seg, causal=True)[0]

            local = [shard_thd(t, cup, world, rank) for t in (q, k, v, dout)]
            with torch.no_grad():
                want = shard_thd(one_gpu(q, k, v), cup, world, rank)

            # one GPU: rank 0 alone; the other ranks wait at the barrier. The op as called, and
            # compiled as the CP forms are (with CUDA graphs under --cudagraphs): the baseline
            # of the compiled CP forms, like for like
            t1, t1c = [0.0, 0.0], [0.0, 0.0]
            if rank == 0:
                fwd, step = _fwd_and_step(one_gpu, q, k, v, dout)
                t1 = [timed(fwd), timed(step)]
                fwd_c, step_c = _fwd_and_step(_compiled(one_gpu, cudagraphs), q, k, v, dout)
                t1c = [timed(fwd_c), timed(step_c)]
                if profile:
                    profiles[(total, "1 GPU")] = _profile_rows(step)
                    profiles[(total, "1 GPU compiled")] = _profile_rows(step_c)
            dist.barrier()
            del q, k, v, dout
            if device.type == "cuda":
                torch.cuda.empty_cache()
            for cap, group in groups.items():
                named = f", {cta_label(cap)}" if name_cap else ""  # the cap in row and column labels
                times, t_ag = _time_cp_forms(group, cu, cup, local, want, head_groups, cudagraphs, timed)
                # every rank runs the profiled steps (they meet in the all-gathers); rank 0's figures
                profiled = {"compiled": f"W={world} compiled, rank 0"}
                if head_groups:
                    g = max(head_groups)
                    profiled[f"G={g}"] = f"W={world} compiled, {g} head groups, rank 0"
                for form, label in profiled.items() if profile else ():
                    prof = _profile_rows(_fwd_and_step(times[form]["fn"], *local)[1])
                    for r, figures in enumerate(rank_waits(prof, device)):
                        prof.update({f"rank {r}: {k}": v for k, v in figures.items()})
                    profiles[(total, label + named)] = prof
                for label, idx in (("fwd", 0), ("fwd+bwd", 1)):
                    w1, w2, wc = (times[form]["ms"][idx] for form in (1, 2, "compiled"))
                    row = [total, len(lens), label + named, t1[idx], w1, w2,
                           t1[idx] / (world * w1), t1[idx] / (world * w2), w2 / w1,
                           t_ag if idx == 0 else "", wc, t1[idx] / (world * wc),
                           t1c[idx], t1c[idx] / (world * wc)]  # fmt: skip
                    for g in head_groups:  # compiled: against the compiled one-GPU step
                        tg = times[f"G={g}"]["ms"][idx]
                        row += [tg, t1c[idx] / (world * tg)]
                    rows.append(row)
                if rank == 0:  # a line per total and cap, so a run cut short by a time limit still reports
                    print(f"T={total} {cta_label(cap)}: " + ", ".join(
                        f"{form} {t['ms'][0]:.3f}/{t['ms'][1]:.3f}" for form, t in times.items()), flush=True)
                del times
            del local
            if device.type == "cuda":
                torch.cuda.empty_cache()

        if rank == 0:
            emit(_tables(rows, profiles, world, heads, kv_heads, head_dim, runs, gqa, smoke, cudagraphs, head_groups,
                         name_cap), out)  # fmt: skip
        # no rank tears down before all are done (gloo can abort a rank whose peer left first), as in tests/_dist.py
        dist.barrier()
    finally:
        # with CUDA graphs that captured NCCL work, a run hung after its table at the end
        # (barrier or teardown, not narrowed down); the process ends with os._exit either way
        if not cudagraphs:
            dist.destroy_process_group()


def _tables(rows, profiles, world, heads, kv_heads, head_dim, runs, gqa, smoke, cudagraphs, head_groups,
            name_cap) -> list[Result]:  # fmt: skip
    """The timing table and, with --profile, the profile table, as results."""
    env = environment(world)
    name = f"ag-attention{'-smoke' if smoke else ''}-w{world}"
    if not smoke and (gqa != 1 or head_dim != HEAD_DIM):
        name += f"-gqa{gqa}-d{head_dim}"
    name += "-cudagraphs" * cudagraphs
    notes = (
        f"ag_thd_attention, {str(DTYPE).removeprefix('torch.')}, causal, H = {heads}, Hkv = {kv_heads}, "
        f"D = {head_dim}; T = real tokens of the global batch (packed documents); times in ms, median "
        f"over {runs} runs, max over ranks; eff = T_1 / (W * T_W)"
        + ("; the compiled forms, one GPU's too, with CUDA graphs (--cudagraphs)" if cudagraphs else "")
        + ("; a row per cap on NCCL's CTAs (--nccl-max-ctas), the 1 GPU times shared" if name_cap else "")
    )
    ms, eff = "{:.3f}", "{:.2f}"
    columns = {"T": None, "docs": None, "pass": None, "1 GPU": ms, f"W={world} 1 launch": ms,
               f"W={world} 2 launches": ms, "eff 1L": eff, "eff 2L": eff, "2L / 1L": eff, "KV all-gather": ms,
               f"W={world} 1L compiled": ms, "eff 1L compiled": eff, "1 GPU compiled": ms,
               "eff 1L compiled vs 1 GPU compiled": eff}  # fmt: skip
    for g in head_groups:
        columns.update({f"W={world} compiled, {g} head groups": ms, f"eff, {g} groups": eff})
    title = f"All-gather CP attention, W = {world}, against segment attention on one GPU"
    results = [Result("ag_attention", title, list(columns), rows, notes, env, name=name,
                      formats=list(columns.values()))]  # fmt: skip
    if profiles:
        keys = list(dict.fromkeys(k for p in profiles.values() for k in p))  # W columns add rank rows
        results.append(Result(
            "ag_attention",
            f"Profile of one compiled fwd+bwd step (--profile; kernel timeline, mean of {PROFILE_RUNS} steps, ms)",
            [""] + [f"T={t} {who}" for t, who in profiles],
            [[k] + [_cell(p.get(k)) for p in profiles.values()] for k in keys], env=env, name=f"{name}-profile",
        ))  # fmt: skip
    return results


def _time_cp_forms(group, cu, cup, local, want, head_groups, cudagraphs, timed) -> tuple[dict, float]:
    """The CP forms on ``group``, each checked against the one-GPU result ``want`` and timed:
    ``({form: {"fn": fn, "ms": [fwd, fwd+bwd]}}, all-gather ms)``, times max over ranks."""
    group_name, world = resolve_group(group)

    def cp_fn(launches, groups=1):
        def fn(q_, k_, v_):
            return ag_thd_attention(q_, k_, v_, cu, cup, causal=True, group=group, launches=launches,
                                    head_groups=groups)  # fmt: skip

        return fn

    forms = {1: cp_fn(1), 2: cp_fn(2), "compiled": _compiled(cp_fn(1), cudagraphs)}
    for g in head_groups:  # pipelined: the scheduling pass of COMPILE_OPTIONS overlaps the groups
        forms[f"G={g}"] = _compiled(cp_fn(1, g), cudagraphs, COMPILE_OPTIONS)
    with torch.no_grad():
        for form, fn in forms.items():
            err = rel_error(fn(*local[:3]), want)
            if err > TOLERANCE[DTYPE]:
                raise AssertionError(f"form {form}: rel_error {err:.3g} against one GPU")
    times = {}
    for form, fn in forms.items():
        fwd, step = _fwd_and_step(fn, *local)
        times[form] = {"fn": fn, "ms": [max_over_ranks(timed(fwd)), max_over_ranks(timed(step))]}
    kv_cp = torch.cat([local[1], local[2]], dim=1)

    def gather():
        gathered = all_gather_rows(kv_cp, group_name)
        # eager functional collectives return a tensor that waits on first use: wait here,
        # so the end event is recorded after the transfer
        if isinstance(gathered, funcol.AsyncCollectiveTensor):
            gathered.wait()

    return times, max_over_ranks(timed(gather))


def _cell(value: float | None) -> str:
    return "" if value is None else f"{value:.3f}"


def tile_pairs(q_len, q_pos, k_len, block_m: int, block_n: int) -> int:
    """(query tile, key tile) pairs the causal forward visits over segments ``[S]`` of q rows
    (``block_m``-row tiles per segment) whose keys start at position 0 of the sequence."""
    q_len, q_pos, k_len = (t.to(torch.int64) for t in (q_len, q_pos, k_len))
    tiles = (q_len + block_m - 1) // block_m
    seg = torch.repeat_interleave(torch.arange(len(q_len)), tiles)
    first = torch.arange(len(seg)) - torch.repeat_interleave(torch.cumsum(tiles, 0) - tiles, tiles)
    # last query position of each tile, and the keys it may see (causal)
    last = q_pos[seg] + torch.minimum((first + 1) * block_m, q_len[seg]) - 1
    keys = torch.minimum(k_len[seg], last + 1)
    return int(((keys + block_n - 1) // block_n).sum())


def work_model() -> Result:
    """The --work-model table (CPU only, no kernels run)."""
    from cp_ops import ag_thd_segments
    from benchmarks.internals import kernel_config

    cfg = kernel_config("fwd", HEAD_DIM, interpreting=False)
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    notes = (f"causal forward, BLOCK_M = {bm}, BLOCK_N = {bn} (D = {HEAD_DIM} config); tile pairs visited; "
             "ratio = W * (most loaded rank) / (one GPU): the kernel work CP adds, 1.00 = none")  # fmt: skip
    rows = []
    for total in TOTALS:
        lens = packed_lengths(total)
        lt = torch.tensor(lens)
        one = tile_pairs(lt, torch.zeros_like(lt), lt, bm, bn)
        for world in (2, 4, 8):
            cu, cup = pad_cu_seqlens(lens, world)
            per = []
            for rank in range(world):
                _, ql, qp, _, kl = ag_thd_segments(cu, cup, world, rank, causal=True)
                per.append(tile_pairs(ql, qp, kl, bm, bn))
            rows.append([total, len(lens), one, world, f"{min(per)}-{max(per)}", world * max(per) / one])
    columns = ["T", "docs", "one GPU", "W", "per rank (min-max)", "ratio"]
    return Result("ag_attention", "Kernel tiles per rank against one GPU (work model)", columns, rows, notes,
                  environment(), name="ag-attention-work-model", formats={"ratio": "{:.2f}"})  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--world", type=int, default=None, help="ranks, one GPU each (default: every visible GPU, at least 2)"
    )
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOTALS),
                        help=f"global real tokens per batch (default {' '.join(map(str, TOTALS))}; not with --smoke)")
    parser.add_argument("--gqa", type=int, default=1, help="query heads per kv head (Hkv = H / gqa)")
    parser.add_argument("--head-dim", type=int, default=HEAD_DIM, help=f"D (default {HEAD_DIM}; not with --smoke)")
    parser.add_argument("--smoke", action="store_true", help="2 gloo ranks on the CPU, tiny shapes, few runs")
    add_out_argument(parser)
    parser.add_argument("--work-model", action="store_true", help="print the kernel-tile work model (CPU) and exit")
    parser.add_argument("--profile", action="store_true", help="also profile one fwd+bwd step: one GPU, compiled CP")
    parser.add_argument("--head-groups", type=int, nargs="*", default=[2, 4], metavar="G",
                        help="also time the compiled one-launch form with head_groups=G (the KV heads in G "
                        "all-gathers, overlapped by cp_ops.COMPILE_OPTIONS); each G must divide Hkv (default 2 4)")
    parser.add_argument("--cudagraphs", action="store_true",
                        help="compile the CP form with CUDA graphs (Inductor's triton.cudagraphs)")
    add_nccl_cta_argument(parser)
    args = parser.parse_args()
    if args.work_model:
        emit([work_model()], args.out)
        return
    heads = SMOKE_HEADS if args.smoke else HEADS
    if heads % args.gqa:
        raise SystemExit(f"--gqa must divide {heads}")
    world = args.world or (2 if args.smoke else default_world())
    if args.profile and args.smoke:
        raise SystemExit("--profile needs GPUs")
    if args.smoke and args.cudagraphs:
        raise SystemExit("--cudagraphs needs GPUs, not --smoke")
    bad = [g for g in args.head_groups if g < 2 or (heads // args.gqa) % g]
    if bad:
        raise SystemExit(f"--head-groups must be divisors of Hkv = {heads // args.gqa} above 1, got {bad}")
    if args.smoke and args.head_dim != HEAD_DIM:
        raise SystemExit(f"--smoke runs D = {SMOKE_HEAD_DIM}; --head-dim is for the GPU runs")
    check_nccl_cta_argument(args.nccl_max_ctas, args.smoke)
    spawn_ranks(_worker, world, args.gqa, args.out, args.smoke, args.profile, args.cudagraphs,
                tuple(args.head_groups), tuple(args.nccl_max_ctas), args.head_dim, tuple(args.tokens),
                device="cpu" if args.smoke else "cuda")  # fmt: skip


if __name__ == "__main__":
    main()
