"""Attention benchmarks: segment attention on one GPU against SDPA flash, cuDNN, FlexAttention,
FlashAttention 4 and cuDNN's varlen SDPA (``kernel``), its kernel-config tuner (``tune``), each
all-gather CP rank's attention kernels on one GPU (``ranks``), and all-gather CP attention on W
GPUs (NCCL) against segment attention on one GPU (``cp``).

    python -m benchmarks.bench_attention kernel [--gqa G] [--head-dims D ...] [--tokens T ...] [--pointer-loads]
        [--backends segment fa4]  # also ag_thd_attention at W = 1 on each attention backend
    python -m benchmarks.bench_attention kernel --profile  # CUDA time per kernel of one forward and one backward
    python -m benchmarks.bench_attention tune [--kinds fwd bwd_dkdv bwd_dq] [--rounds N]
    python -m benchmarks.bench_attention ranks [--worlds W ...] [--tokens T ...] [--gqa G] [--head-dim D]
    python -m benchmarks.bench_attention cp [--world W] [--tokens T ...] [--gqa G] [--head-dim D]
        [--head-groups G ...] [--cudagraphs] [--profile] [--backends segment fa4]
    python -m benchmarks.bench_attention cp --smoke        # 2 gloo ranks on the CPU, tiny shapes
    python -m benchmarks.bench_attention cp --work-model   # CPU only: kernel tiles per rank against one GPU

Results (benchmarks/runner.py): ``attention`` (``attention-gqaG-dD..`` at other heads,
``-tT..`` at other --tokens, e.g. ``attention-gqa8-d256-t32k-128k-512k``; ``-pointer-loads`` with
that flag, ``-backends-B..`` with --backends), ``attention-profile...``; ``ag-attention-wW``
(``-gqaG-dD`` at other heads, ``-cudagraphs``, ``-backends-B..``; ``ag-attention-smoke-wW``), ``...-profile``, ``ag-attention-work-model-dD``,
``ag-attention-rank-kernels-gqaG-dD``.
docs/benchmarks.md gives the cases, the FLOP count and what each column measures.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import custom_ops
from benchmarks.attention_baselines import PACKAGES as BASELINE_PACKAGES
from benchmarks.attention_baselines import NotInstalled, compare, cudnn_varlen_fn, fa4_varlen_fn, fp32_reference
from benchmarks.cases import ATTENTION_DTYPE as DTYPE
from benchmarks.cases import ATTENTION_HEAD_DIMS as HEAD_DIMS
from benchmarks.cases import ATTENTION_HEADS as HEADS
from benchmarks.cases import ATTENTION_TOKENS, attention_cases, attention_op_inputs, packed_lengths, segments_for
from benchmarks.cases import tflops, tokens_label, visible_pairs
from benchmarks.cases import attention_inputs as make_inputs
from benchmarks.common import default_world, max_over_ranks, profile_step, recompile_limit, spawn_ranks
from benchmarks.internals import CONFIGS, DEFAULT_SETTINGS, AttentionSettings, resolve_scale
from benchmarks.internals import attention_launch as launch
from benchmarks.runner import Result, add_out_argument, checks_off, emit, environment, format_cell, package_versions
from benchmarks.timing import kernel_breakdown, median_ms, median_ms_counted
from cp_ops import COMPILE_OPTIONS, pad_cu_seqlens, shard_thd
from custom_ops import ag_thd_attention, all_gather_rows, resolve_group
from custom_ops.ag_attention.backends import fa4_version
from custom_ops.ag_attention.backends import set_backend as set_attention_backend
from custom_ops.ag_attention.op import _ag_thd_attention
from custom_ops.testing import TOLERANCE, rel_error

# --- shared: the op, its forward and fwd+bwd closures, the compiled form -------------------------


def varlen_fn(q, k, v, seg):
    return custom_ops.varlen_attention(q, k, v, *seg, causal=True)[0]


def settings_fn(settings: AttentionSettings):
    """:func:`varlen_fn` by the launchers under ``settings``."""
    return lambda q, k, v, seg: _Launched.apply(q, k, v, settings, *seg)


def _one_gpu_segments(cu, cup) -> tuple[torch.Tensor, ...]:
    """Segment attention over the whole padded batch on one GPU: each sequence's queries over its
    own keys, q_pos = 0 (``cu``, ``cup`` of :func:`cp_ops.pad_cu_seqlens`)."""
    lengths, starts = cu[1:] - cu[:-1], cup[:-1]
    return starts, lengths, torch.zeros_like(lengths), starts, lengths


def _fwd_and_step(fn, q, k, v, dout):
    """Two closures: the forward alone, and forward + backward to q, k, v."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]

    def fwd():
        with torch.no_grad():
            fn(q, k, v)

    def step():
        torch.autograd.grad(fn(*leaves), leaves, dout)

    return fwd, step


def _compiled(fn, cudagraphs: bool, options: dict | None = None):
    """``fn`` compiled the way every compiled form of the CP benchmark is, the one-GPU baseline's
    included: ``fullgraph=True``, with ``options``, and Inductor's CUDA graphs under --cudagraphs."""
    graphs = {"triton.cudagraphs": True} if cudagraphs else {}
    return torch.compile(fn, fullgraph=True, options={**(options or {}), **graphs})


# --- kernel and tune: launch settings ------------------------------------------------------------------------------
# The ops launch with the library's DEFAULT_SETTINGS. The tuner and the runs with other settings
# (--pointer-loads) call the launchers of custom_ops.segment_attention.launch with an
# AttentionSettings instead.


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


# --- kernel: implementations ------------------------------------------------------------------------------


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


# The eager block-mask builder materialises the [T, T] mask (16 GiB at 131072 tokens): above this
# many tokens the mask is built compiled, which fuses the mask into its per-block reduction
FLEX_EAGER_MASK_TOKENS = 65536


def flex_fn(lens, device):
    """FlexAttention (compiled) over the packed sequence with a causal document mask."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    doc = torch.repeat_interleave(torch.arange(len(lens), device=device), torch.tensor(lens, device=device))
    total = doc.numel()

    def mask_mod(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    build = create_block_mask if total <= FLEX_EAGER_MASK_TOKENS else torch.compile(create_block_mask)
    block_mask = build(mask_mod, None, None, total, total, device=device)
    flex = torch.compile(flex_attention, dynamic=False)

    def fn(q, k, v, seg):
        out = flex(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1],
        )  # fmt: skip
        return out[0].transpose(0, 1)

    return fn


ATTENTION_BACKENDS = ("segment", "fa4")


def cp_attention(cu, cup, group, backend: str, launches: int = 1, head_groups: int = 1):
    """``fn(q, k, v)``: causal ``ag_thd_attention`` on ``group`` (None: W = 1) with the attention
    ``backend`` given instead of resolved (the op's decomposition, as the public op traces it);
    the ``fa4`` backend raises :class:`NotInstalled` without flash-attn-4."""
    if backend == "fa4" and fa4_version() is None:
        raise NotInstalled("flash-attn-4 not installed (the fa4 extra)")
    group_name, world = resolve_group(group)

    def fn(q, k, v):
        return _ag_thd_attention(q, k, v, cu, cup, True, -1, -1, None, group_name, world, launches, head_groups,
                                 backend)  # fmt: skip

    return fn


@dataclasses.dataclass(frozen=True)
class InLayout:
    """An implementation with a row layout of its own: ``fn(q, k, v)`` on rows that ``place``
    puts there (zeros between) and ``take`` takes back. Called as any row's ``fn(q, k, v, seg)``
    (the error checks) it moves the packed rows in and the output out; :func:`measure` times ``fn``
    on inputs placed beforehand, as a caller whose batches come in that layout runs it."""

    fn: Callable
    place: Callable
    take: Callable

    def __call__(self, q, k, v, seg):
        return self.take(self.fn(self.place(q), self.place(k), self.place(v)))


def backend_fn(lens, device, backend: str):
    """:func:`cp_attention` at W = 1 on the packed documents ``lens``, as ``fn(q, k, v, seg)``. The
    op takes each document padded to an even length (``cu_seqlens_padded``), so where a document is
    odd it is an :class:`InLayout` over that layout."""
    cu, cup = pad_cu_seqlens(lens, 1, device=device)
    fn = cp_attention(cu, cup, None, backend)
    if all(n % 2 == 0 for n in lens):  # the packed rows are the padded layout
        return lambda q, k, v, seg: fn(q, k, v)
    rows = torch.cat([torch.arange(s, s + n, device=device) for s, n in zip(cup.tolist(), lens)])
    padded_rows = int(cup[-1])
    return InLayout(fn, lambda t: t.new_zeros(padded_rows, *t.shape[1:]).index_copy(0, rows, t),
                    lambda t: t.index_select(0, rows))  # fmt: skip


def implementations(lens, device, ours_name: str = "varlen_attention", ours=varlen_fn,
                    attention_backends=()) -> list[tuple[str, object]]:  # fmt: skip
    """``[(row name, make)]`` of one case, ``make()`` returning the implementation's
    ``fn(q, k, v, seg)``: ours; SDPA flash and cuDNN on a dense case, SDPA flash per document
    on a packed one; FlexAttention, FlashAttention 4 and cuDNN's varlen SDPA on every case; then
    ``ag_thd_attention`` at W = 1 on each of ``attention_backends``. Each is built when its row
    runs, so a library that is missing fails its own row only."""
    if len(set(lens)) == 1:
        sdpa = [("SDPA flash", lambda: sdpa_dense_fn(SDPBackend.FLASH_ATTENTION, len(lens), lens[0])),
                ("SDPA cuDNN", lambda: sdpa_dense_fn(SDPBackend.CUDNN_ATTENTION, len(lens), lens[0]))]  # fmt: skip
    else:
        sdpa = [("SDPA flash, loop over docs", lambda: sdpa_loop_fn(SDPBackend.FLASH_ATTENTION, lens))]
    return [
        (ours_name, lambda: ours), *sdpa,
        ("FlexAttention doc mask", lambda: flex_fn(lens, device)),
        ("FlashAttention 4 varlen", lambda: fa4_varlen_fn(lens, device)),
        ("cuDNN frontend varlen", lambda: cudnn_varlen_fn(lens, device)),
        *((f"ag_thd_attention W=1, {b} backend", lambda b=b: backend_fn(lens, device, b)) for b in attention_backends),
    ]  # fmt: skip


# --- kernel: measuring ----------------------------------------------------------------------------


def do_bench_ms(fn) -> float:
    """do_bench median of ``fn()`` in ms, with the warm-up and repetition budgets of every row."""
    return median_ms(fn, 25, 200)


def note_for(e: Exception) -> str:
    """A failure as a row's note: a missing package's message, else the exception's type and the
    first line of its message."""
    if isinstance(e, NotInstalled):
        return str(e)
    first = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {first[:100]}"


def measure(make, q, k, v, seg, ref, dout, timer=do_bench_ms) -> dict:
    """One implementation on one case: the max error of its output and of its gradients against
    ``ref`` (:func:`fp32_reference`'s ``(out, dq, dk, dv)``), then, where each relative error is
    within bf16's tolerance, ``timer``'s ms of its forward and of its forward + backward.

    A failure is the row's note, not an exception: building it (its package missing), its
    forward (nothing measured) or its backward (the forward's figures kept)."""
    row = {"fwd ms": None, "fwd+bwd ms": None, "err out": None, "err grads": None}
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    try:
        fn = make()
        out = fn(*leaves, seg)
    except Exception as e:  # a library missing, or refusing this shape
        return {**row, "note": note_for(e)}
    row["err out"], rel = compare(out, ref[0])
    notes, rels = [], [rel]
    try:
        errors = [compare(g, r) for g, r in zip(torch.autograd.grad(out, leaves, dout), ref[1:])]
        row["err grads"] = max(err for err, _ in errors)
        rels += [r for _, r in errors]
    except Exception as e:  # the backward alone may refuse a shape (D = 256, GQA)
        notes.append("backward: " + note_for(e))
    del out, leaves
    if max(rels) >= TOLERANCE[DTYPE]:
        return {**row, "note": "; ".join(notes + [f"disagrees with the fp32 reference (rel err {max(rels):.1e})"])}
    if isinstance(fn, InLayout):  # timed on inputs already in its layout
        fwd, step = _fwd_and_step(fn.fn, *(fn.place(t) for t in (q, k, v, dout)))
    else:
        fwd, step = _fwd_and_step(lambda *qkv: fn(*qkv, seg), q, k, v, dout)
    try:
        row["fwd ms"] = timer(fwd)
        if row["err grads"] is not None:
            row["fwd+bwd ms"] = timer(step)
    except Exception as e:  # out of memory in the timing loop, say
        notes.append("timing: " + note_for(e))
    return {**row, "note": "; ".join(notes)}


# The kernel table's columns after case, D and implementation, with their formats
MEASURED = {"fwd ms": "{:.3f}", "fwd TFLOP/s": "{:.0f}", "fwd+bwd ms": "{:.3f}", "fwd+bwd TFLOP/s": "{:.0f}",
            "max err vs fp32: out": "{:.1e}", "max err vs fp32: dq dk dv": "{:.1e}", "note": None}  # fmt: skip


def bench_case(case: str, lens, d: int, gqa: int, impls, device, timer=do_bench_ms) -> list[list]:
    """The table rows of one case at head dim ``d``: each of ``impls`` (:func:`implementations`)
    measured (:func:`measure`) on the same inputs against one float32 reference, a progress line
    printed for each as it ends."""
    q, k, v = (t.detach() for t in make_inputs(sum(lens), HEADS, HEADS // gqa, d, device))
    seg = segments_for(lens, device)
    dout = torch.randn(q.shape, generator=torch.Generator(device=device).manual_seed(1), device=device).to(q.dtype)
    pairs = visible_pairs(lens)
    print(f"D={d} {case} ({len(lens)} docs, {pairs / 1e6:.1f}M visible pairs per head)", flush=True)
    ref = fp32_reference(q, k, v, lens, dout)
    rows = []
    for name, make in impls:
        start = time.perf_counter()
        r = measure(make, q, k, v, seg, ref, dout, timer)
        fwd, both = (None if ms is None else tflops(pairs, HEADS, d, ms, f)
                     for ms, f in ((r["fwd ms"], 1.0), (r["fwd+bwd ms"], 3.5)))  # fmt: skip
        rows.append([case, d, name, r["fwd ms"], fwd, r["fwd+bwd ms"], both, r["err out"], r["err grads"], r["note"]])
        shown = [f"{col} {format_cell(x, fmt)}" if fmt else x for (col, fmt), x in zip(MEASURED.items(), rows[-1][3:])
                 if x not in (None, "")]
        print(f"  {name}: {', '.join(shown)} ({time.perf_counter() - start:.0f} s)", flush=True)
    return rows


def _suffix(gqa: int, head_dims, tokens=(ATTENTION_TOKENS,)) -> str:
    """The result-name suffix of a run at other heads or token totals than the default's."""
    heads = "" if gqa == 1 and tuple(head_dims) == HEAD_DIMS else f"-gqa{gqa}-d" + "-".join(map(str, head_dims))
    totals = "" if tuple(tokens) == (ATTENTION_TOKENS,) else "-t" + "-".join(map(tokens_label, tokens))
    return heads + totals


def bench(gqa: int = 1, head_dims=HEAD_DIMS, settings: AttentionSettings = DEFAULT_SETTINGS,
          label: str = "", tokens=(ATTENTION_TOKENS,), attention_backends=()) -> list[Result]:  # fmt: skip
    device = torch.device("cuda")
    ours = varlen_fn if settings == DEFAULT_SETTINGS else settings_fn(settings)
    versions = {**package_versions(*BASELINE_PACKAGES), "cuDNN": torch.backends.cudnn.version()}
    libraries = ", ".join(f"{p} {v}" for p, v in versions.items())
    print(libraries, flush=True)
    rows = []
    with recompile_limit(64):  # FlexAttention compiles once per case, head dim and grad mode
        for d in head_dims:
            for case, lens in attention_cases(tuple(tokens)):
                impls = implementations(lens, device, "varlen_attention" + label, ours, attention_backends)
                rows += bench_case(case, lens, d, gqa, impls, device)
                torch.cuda.empty_cache()
    columns = ["case", "D", "implementation", *MEASURED]
    formats = {"D": "{:d}", **{col: fmt for col, fmt in MEASURED.items() if fmt}}
    notes = (f"bf16, causal, H = {HEADS}, Hkv = {HEADS // gqa}; TFLOP/s on visible pairs; median of do_bench; max "
             "|error| against float32 attention per document, of the output and of the worst of dq, dk, dv; "
             f"{libraries}")  # fmt: skip
    if attention_backends:
        notes += ("; ag_thd_attention rows: the op at W = 1 on the backend named, timed on inputs already in its "
                  "layout (documents padded to even lengths), checked through copies into it and back")  # fmt: skip
    title = "Segment attention against SDPA, FlexAttention, FlashAttention 4 and cuDNN"
    return [Result("varlen_attention", title, columns, rows, notes, environment(),
                   name="attention" + _suffix(gqa, head_dims, tokens) + _backends_suffix(attention_backends),
                   formats=formats)]  # fmt: skip


def _backends_suffix(attention_backends) -> str:
    return "-backends-" + "-".join(attention_backends) if attention_backends else ""


# --- tune ---------------------------------------------------------------------------------------

# The tiles ``tune`` tries for each kernel, as (BLOCK_M, BLOCK_N, num_warps, num_stages[, PARTS]):
# the forward tries each with K_ROWS True, then False; PARTS = 2 computes a key tile's dk and dv in
# two programs. "wide" is D = 256 (Qwen3-Next's attention heads), where the other tiles do not fit
# an SM's shared memory or registers: smaller tiles and fewer stages.
CANDIDATE_TILES = {
    "default": {
        "fwd": [
            (128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3),
            (64, 64, 4, 4), (128, 64, 8, 2),
        ],
        "bwd_dkdv": [
            (64, 128, 8, 2), (32, 128, 8, 2), (32, 128, 8, 3), (32, 128, 4, 3), (64, 64, 4, 2),
            (64, 64, 4, 3), (64, 64, 8, 3), (32, 64, 4, 3), (64, 128, 8, 3), (16, 128, 4, 3),
            (64, 64, 4, 2, 2), (64, 128, 8, 2, 2), (64, 128, 8, 3, 2), (32, 64, 4, 3, 2),
        ],
        "bwd_dq": [
            (128, 64, 8, 2), (128, 32, 8, 2), (128, 32, 8, 3), (128, 32, 4, 3), (64, 64, 4, 2),
            (64, 64, 4, 3), (64, 32, 4, 3), (128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2),
        ],
    },
    "wide": {
        "fwd": [
            (64, 32, 4, 2), (64, 32, 8, 2), (64, 64, 4, 2), (64, 64, 8, 2), (128, 32, 8, 2),
            (128, 64, 8, 2), (64, 32, 4, 3), (128, 32, 8, 3), (64, 64, 8, 3),
        ],
        "bwd_dkdv": [
            (64, 64, 8, 1, 1), (32, 32, 4, 2, 1), (32, 64, 8, 2, 1), (64, 64, 8, 1, 2), (64, 128, 8, 1, 2),
            (32, 64, 8, 2, 2), (32, 128, 8, 2, 2), (64, 64, 8, 2, 2), (64, 64, 4, 2, 2), (32, 64, 4, 2, 2),
            (16, 128, 8, 2, 2), (16, 128, 8, 3, 2), (32, 128, 8, 1, 2),
        ],
        "bwd_dq": [
            (64, 32, 8, 1), (64, 32, 8, 2), (64, 64, 8, 2), (128, 32, 8, 2), (32, 64, 4, 2),
            (64, 32, 4, 2), (128, 64, 8, 1),
        ],
    },
}  # fmt: skip


def candidates_for(kind: str, d: int) -> list[dict]:
    """The configs ``tune`` tries for ``kind`` at head dim ``d`` (:data:`CANDIDATE_TILES`)."""
    names = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "PARTS")
    configs = [dict(zip(names, tile)) for tile in CANDIDATE_TILES["wide" if d > 128 else "default"][kind]]
    return [{**c, "K_ROWS": k_rows} for k_rows in (True, False) for c in configs] if kind == "fwd" else configs


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
        return median_ms(fn, 10, 100)
    except Exception as e:  # e.g. out of shared memory for this tile shape
        print(f"    {cfg}: {type(e).__name__}")
        return float("inf")


def tune(
    gqa: int = 1, kinds=("fwd", "bwd_dkdv", "bwd_dq"), head_dims=HEAD_DIMS, rounds: int = 1,
    base: AttentionSettings = DEFAULT_SETTINGS,
) -> None:
    """Time the candidate configs of each kernel on both cases at each of ``head_dims``; print
    the best, as entries of the config tables.

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
                q, k, v, seg, out, lse, dout, dlse = attention_op_inputs(lens, d, gqa, device)
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
    print("\n# paste into custom_ops/segment_attention/configs.py")
    for kind in kinds:
        entries = ", ".join(f"{d}: dict({_fmt(best[(kind, d)])})" for d in sorted(head_dims))
        print(f'{tables[kind]} "{kind}": {{{entries}}},')


def profile(gqa: int = 1, head_dims=HEAD_DIMS, settings: AttentionSettings = DEFAULT_SETTINGS,
            tokens=(ATTENTION_TOKENS,)) -> list[Result]:  # fmt: skip
    """CUDA time per kernel of the forward and backward launches (torch.profiler, mean over 5 calls)."""
    device = torch.device("cuda")
    rows = []
    for case, lens in attention_cases(tuple(tokens))[::-1]:
        for d in head_dims:
            q, k, v, seg, out, lse, dout, dlse = attention_op_inputs(lens, d, gqa, device)
            fwd, bwd = launchers(settings, q, k, v, seg, out, lse, dout, dlse)

            def step():
                fwd()
                bwd()

            rows += [[case, d, name[:60], ms] for name, ms in kernel_breakdown(step, runs=5, warmup=1)]
    notes = f"bf16, causal, H = {HEADS}, Hkv = {HEADS // gqa}; CUDA ms per call (torch.profiler, mean of 5 calls)"
    return [Result("varlen_attention", "Segment attention: CUDA time per kernel, one forward and one backward",
                   ["case", "D", "kernel", "ms"], rows, notes, environment(),
                   name="attention-profile" + _suffix(gqa, head_dims, tokens))]  # fmt: skip


def _fmt(cfg):
    return ", ".join(f"{k}={v}" for k, v in cfg.items())


# --- cp ------------------------------------------------------------------------------------------

TOTALS = (32768, 65536)
HEAD_DIM = HEAD_DIMS[0]
DEFAULT_HEAD_GROUPS = (2, 4)  # --head-groups without the flag, where they divide Hkv
# --smoke: the same code path on 2 gloo ranks, at sizes a CPU runs in seconds
SMOKE_TOTALS, SMOKE_HEADS, SMOKE_HEAD_DIM = (1024,), 4, 16  # two documents: 1008 and 16 tokens


# --profile: besides the timeline, the kernel time of each attention kernel and of NCCL (common.profile_step)
PROFILED_KERNELS = ("varlen_attn_fwd", "varlen_attn_bwd_dq", "varlen_attn_bwd_dkdv", "gather_rows", "nccl")
PROFILE_RUNS = 5


def _rank(
    rank: int, world: int, device, gqa: int, out: str | None, smoke: bool, profile: bool, cudagraphs: bool,
    head_groups: tuple[int, ...] = (), head_dim: int = HEAD_DIM, tokens: tuple[int, ...] = TOTALS,
    attention_backends: tuple[str, ...] = (),
) -> None:
    totals, heads, head_dim = (SMOKE_TOTALS, SMOKE_HEADS, SMOKE_HEAD_DIM) if smoke else (tokens, HEADS, head_dim)
    warmup, runs = (1, 3) if smoke else (5, 40)

    def timed(fn):
        return median_ms_counted(fn, warmup, runs, device)

    kv_heads = heads // gqa
    rows = []
    profiles = {}

    # the op as called runs the segment kernels, as the one-GPU baseline does; the other backends
    # are forms of their own (--backends), named, not resolved
    set_attention_backend("segment")
    named = [f"fa4 {fa4_version()}"] if "fa4" in attention_backends and fa4_version() else []
    env = environment(world, attention=", ".join(["segment", *named])) if rank == 0 else None

    def tables() -> list[Result]:
        return _tables(rows, profiles, env, world, heads, kv_heads, head_dim, runs, gqa, smoke, cudagraphs,
                       head_groups, attention_backends)  # fmt: skip

    for total in totals:
        lens = packed_lengths(total)
        cu, cup = pad_cu_seqlens(lens, world, device=device)
        num_rows = int(cup[-1])
        gen = torch.Generator(device=device).manual_seed(0)  # one global batch on every rank

        def rand(h):
            return torch.randn(num_rows, h, head_dim, device=device, generator=gen).to(DTYPE)

        q, k, v, dout = rand(heads), rand(kv_heads), rand(kv_heads), rand(heads)
        seg = _one_gpu_segments(cu, cup)

        def one_gpu(q_, k_, v_):
            return varlen_fn(q_, k_, v_, seg)

        local = [shard_thd(t, cup, world, rank) for t in (q, k, v, dout)]
        with torch.no_grad():
            want = shard_thd(one_gpu(q, k, v), cup, world, rank)

        # one GPU: rank 0 alone; the other ranks wait at the barrier. The op as called, and
        # compiled as the CP forms are (with CUDA graphs under --cudagraphs): the baseline
        # of the compiled CP forms, like for like
        # and the op at W = 1 on each backend of --backends, compiled as its CP form is
        t1, t1c, t1b = [0.0, 0.0], [0.0, 0.0], {b: [0.0, 0.0] for b in attention_backends}
        if rank == 0:
            fwd, step = _fwd_and_step(one_gpu, q, k, v, dout)
            t1 = [timed(fwd), timed(step)]
            fwd_c, step_c = _fwd_and_step(_compiled(one_gpu, cudagraphs), q, k, v, dout)
            t1c = [timed(fwd_c), timed(step_c)]
            for b in attention_backends:
                fwd_b, step_b = _fwd_and_step(_compiled(cp_attention(cu, cup, None, b), cudagraphs, COMPILE_OPTIONS),
                                              q, k, v, dout)  # fmt: skip
                t1b[b] = [timed(fwd_b), timed(step_b)]
            if profile:
                profiles[(total, "1 GPU")] = profile_step(step, named=PROFILED_KERNELS, runs=PROFILE_RUNS)
                profiles[(total, "1 GPU compiled")] = profile_step(step_c, named=PROFILED_KERNELS, runs=PROFILE_RUNS)
        dist.barrier()
        del q, k, v, dout
        torch.cuda.empty_cache()
        times, t_ag = _time_cp_forms(dist.group.WORLD, cu, cup, local, want, head_groups, cudagraphs, timed,
                                     attention_backends)  # fmt: skip
        # every rank runs the profiled steps (they meet in the all-gathers); rank 0's figures
        profiled = {"compiled": f"W={world} compiled, rank 0"}
        if head_groups:
            g = max(head_groups)
            profiled[f"G={g}"] = f"W={world} compiled, {g} head groups, rank 0"
        for form, label in profiled.items() if profile else ():
            step = _fwd_and_step(times[form]["fn"], *local)[1]
            profiles[(total, label)] = profile_step(step, device, PROFILED_KERNELS, PROFILE_RUNS)
        for label, idx in (("fwd", 0), ("fwd+bwd", 1)):
            w1, w2, wc = (times[form]["ms"][idx] for form in (1, 2, "compiled"))
            row = [total, len(lens), label, t1[idx], w1, w2,
                   t1[idx] / (world * w1), t1[idx] / (world * w2), w2 / w1,
                   t_ag if idx == 0 else "", wc, t1[idx] / (world * wc),
                   t1c[idx], t1c[idx] / (world * wc)]  # fmt: skip
            for g in head_groups:  # compiled: against the compiled one-GPU step
                tg = times[f"G={g}"]["ms"][idx]
                row += [tg, t1c[idx] / (world * tg)]
            for b in attention_backends:  # against the op at W = 1 on the same backend
                tb = times[b]["ms"][idx]
                row += [t1b[b][idx], tb, t1b[b][idx] / (world * tb)]
            rows.append(row)
        if rank == 0:  # a line and the tables so far, so a run cut short by a time limit still reports
            print(f"T={total}: " + ", ".join(
                f"{form} {t['ms'][0]:.3f}/{t['ms'][1]:.3f}" for form, t in times.items()), flush=True)
            emit(tables(), out, quiet=True)
        del times, local
        torch.cuda.empty_cache()

    if rank == 0:
        emit(tables(), out)


def _tables(rows, profiles, env, world, heads, kv_heads, head_dim, runs, gqa, smoke, cudagraphs,
            head_groups, attention_backends=()) -> list[Result]:  # fmt: skip
    """The timing table and, with --profile, the profile table, as results (``env``: the run's
    :func:`~benchmarks.runner.environment`)."""
    name = f"ag-attention{'-smoke' if smoke else ''}-w{world}"
    if not smoke and (gqa != 1 or head_dim != HEAD_DIM):
        name += f"-gqa{gqa}-d{head_dim}"
    name += "-cudagraphs" * cudagraphs + _backends_suffix(attention_backends)
    notes = (
        f"ag_thd_attention, {str(DTYPE).removeprefix('torch.')}, causal, H = {heads}, Hkv = {kv_heads}, "
        f"D = {head_dim}; T = real tokens of the global batch (packed documents); times in ms, median "
        f"over {runs} runs, max over ranks; eff = T_1 / (W * T_W)"
        + ("; the compiled forms, one GPU's too, with CUDA graphs (--cudagraphs)" if cudagraphs else "")
        + ("; a backend's eff: against the op at W = 1 on that backend" if attention_backends else "")
    )
    ms, eff = "{:.3f}", "{:.2f}"
    columns = {"T": None, "docs": None, "pass": None, "1 GPU": ms, f"W={world} 1 launch": ms,
               f"W={world} 2 launches": ms, "eff 1L": eff, "eff 2L": eff, "2L / 1L": eff, "KV all-gather": ms,
               f"W={world} 1L compiled": ms, "eff 1L compiled": eff, "1 GPU compiled": ms,
               "eff 1L compiled vs 1 GPU compiled": eff}  # fmt: skip
    for g in head_groups:
        columns.update({f"W={world} compiled, {g} head groups": ms, f"eff, {g} groups": eff})
    for b in attention_backends:
        columns.update({f"1 GPU compiled, {b} backend": ms, f"W={world} compiled, {b} backend": ms,
                        f"eff, {b} backend": eff})  # fmt: skip
    title = f"All-gather CP attention, W = {world}, against segment attention on one GPU"
    results = [Result("ag_attention", title, list(columns), rows, notes, env, name=name,
                      formats=list(columns.values()))]  # fmt: skip
    if profiles:
        keys = list(dict.fromkeys(k for p in profiles.values() for k in p))  # W columns add rank rows
        results.append(Result(
            "ag_attention",
            f"Profile of one compiled fwd+bwd step (--profile; kernel timeline, mean of {PROFILE_RUNS} steps, ms)",
            [""] + [f"T={t} {who}" for t, who in profiles],
            [[k] + ["" if p.get(k) is None else f"{p[k]:.3f}" for p in profiles.values()] for k in keys],
            env=env, name=f"{name}-profile",
        ))  # fmt: skip
    return results


def _time_cp_forms(group, cu, cup, local, want, head_groups, cudagraphs, timed,
                   attention_backends=()) -> tuple[dict, float]:  # fmt: skip
    """The CP forms on ``group``, each checked against the one-GPU result ``want`` and timed:
    ``({form: {"fn": fn, "ms": [fwd, fwd+bwd]}}, all-gather ms)``, times max over ranks. With
    ``attention_backends``, also the compiled one-launch form on each (form: the backend's name)."""
    group_name, world = resolve_group(group)

    def cp_fn(launches, groups=1):
        def fn(q_, k_, v_):
            return ag_thd_attention(q_, k_, v_, cu, cup, causal=True, group=group, launches=launches,
                                    head_groups=groups)  # fmt: skip

        return fn

    # compiled as the layers and the recipe compile: with COMPILE_OPTIONS, whose scheduling pass
    # overlaps the exchanges with independent work (and, with head groups, one group's with the next)
    forms = {1: cp_fn(1), 2: cp_fn(2), "compiled": _compiled(cp_fn(1), cudagraphs, COMPILE_OPTIONS)}
    for g in head_groups:
        forms[f"G={g}"] = _compiled(cp_fn(1, g), cudagraphs, COMPILE_OPTIONS)
    for b in attention_backends:
        forms[b] = _compiled(cp_attention(cu, cup, group, b), cudagraphs, COMPILE_OPTIONS)
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


def tile_pairs(q_len, q_pos, k_len, block_m: int, block_n: int) -> int:
    """(query tile, key tile) pairs the causal forward visits over segments ``[S]`` of q rows
    (``block_m``-row tiles per segment, cut as the kernels cut them: ending at the segment's end,
    moved onto the key-tile grid where the partial tile has the rows) whose keys start at
    position 0 of the sequence."""
    q_len, q_pos, k_len = (t.to(torch.int64) for t in (q_len, q_pos, k_len))
    stop = q_pos + q_len
    pad = (-stop) % block_n
    end = torch.where((q_len > 0) & (stop > 0) & (pad <= (-q_len) % block_m), q_len + pad, q_len)
    tiles = (q_len + block_m - 1) // block_m
    seg = torch.repeat_interleave(torch.arange(len(q_len)), tiles)
    from_end = torch.arange(len(seg)) - torch.repeat_interleave(torch.cumsum(tiles, 0) - tiles, tiles)
    # last query position of each tile, and the keys it may see (causal)
    last = q_pos[seg] + torch.minimum(end[seg] - from_end * block_m, q_len[seg]) - 1
    keys = torch.minimum(k_len[seg], last + 1)
    return int(((keys + block_n - 1) // block_n).sum())


def work_model(head_dim: int = HEAD_DIM) -> Result:
    """The --work-model table (CPU only, no kernels run): at the forward's query tile for
    ``head_dim`` and at half of it, the same key tile."""
    from custom_ops import ag_thd_segments
    from benchmarks.internals import kernel_config

    cfg = kernel_config("fwd", head_dim, interpreting=False)
    bn = cfg["BLOCK_N"]
    notes = (f"causal forward, BLOCK_N = {bn}, BLOCK_M the D = {head_dim} config's ({cfg['BLOCK_M']}) and half of it; "
             "tile pairs visited; ratio = W * (most loaded rank) / (one GPU): the kernel work CP adds, 1.00 = none")  # fmt: skip
    rows = []
    for bm in (cfg["BLOCK_M"], cfg["BLOCK_M"] // 2):
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
                rows.append([bm, total, len(lens), one, world, f"{min(per)}-{max(per)}", world * max(per) / one])
    columns = ["BLOCK_M", "T", "docs", "one GPU", "W", "per rank (min-max)", "ratio"]
    return Result("ag_attention", "Kernel tiles per rank against one GPU (work model)", columns, rows, notes,
                  environment(), name=f"ag-attention-work-model-d{head_dim}", formats={"ratio": "{:.3f}"})  # fmt: skip


RANK_KERNELS = ("varlen_attn_fwd", "varlen_attn_bwd_dq", "varlen_attn_bwd_dkdv")


def rank_kernels(
    gqa: int, head_dim: int, worlds: tuple[int, ...], tokens: tuple[int, ...], runs: int = 10, device="cuda"
) -> Result:
    """The --ranks table: on one GPU, the attention kernels' time for one GPU's segments and for
    each rank's segments of all-gather CP at each W (the rank's query rows against the whole
    batch's K/V in sequence order, as ``varlen_attention_kv`` runs them): the layout's extra
    kernel work per rank, without the collectives and at any W."""
    from benchmarks.common import named_kernels_ms, profile_kernels
    from custom_ops import ag_thd_segments

    kv_heads = HEADS // gqa
    rows = []
    for total in tokens:
        lens = packed_lengths(total)
        one = None
        for world in (1, *worlds):
            cu, cup = pad_cu_seqlens(lens, world, device=device)
            num_rows = int(cup[-1])
            gen = torch.Generator(device=device).manual_seed(0)
            k, v = (torch.randn(num_rows, kv_heads, head_dim, device=device, generator=gen).to(DTYPE) for _ in "kv")
            for rank in range(world):
                seg = _one_gpu_segments(cu, cup) if world == 1 else ag_thd_segments(cu, cup, world, rank, causal=True)
                q, dout = (torch.randn(num_rows // world, HEADS, head_dim, device=device, generator=gen).to(DTYPE)
                           for _ in "qd")  # fmt: skip
                step = _fwd_and_step(lambda q_, k_, v_: varlen_fn(q_, k_, v_, seg), q, k, v, dout)[1]
                kernels, calls = profile_kernels(step, runs=runs, warmup=3)
                ms = [named_kernels_ms(kernels, calls, name) for name in RANK_KERNELS]
                if world == 1:
                    one = ms
                row = [total, len(lens), world, "-" if world == 1 else rank, *ms, sum(ms)]
                rows.append(row + [world * a / b for a, b in zip(ms + [sum(ms)], one + [sum(one)])])
                print(f"T={total} W={world} rank {rank}: " + " ".join(f"{m:.3f}" for m in ms), flush=True)
    ratio = "{:.3f}"
    columns = {"T": None, "docs": None, "W": None, "rank": None, "fwd": "{:.3f}", "dq": "{:.3f}", "dk/dv": "{:.3f}",
               "sum": "{:.3f}", "W x fwd / 1 GPU": ratio, "W x dq / 1 GPU": ratio, "W x dk/dv / 1 GPU": ratio,
               "W x sum / 1 GPU": ratio}  # fmt: skip
    notes = (f"segment attention kernels on one GPU (torch.profiler, mean of {runs} fwd+bwd calls), "
             f"{str(DTYPE).removeprefix('torch.')}, causal, H = {HEADS}, Hkv = {kv_heads}, D = {head_dim}; W = 1: one "
             "GPU's segments; W > 1: rank r's segments of all-gather CP (ag_thd_segments), its T/W query rows against "
             "the T rows of K/V; ratios: W x the rank's time / one GPU's, 1.000 = no extra work")  # fmt: skip
    return Result("ag_attention", "Attention kernels per CP rank against one GPU (--ranks, one GPU)", list(columns),
                  rows, notes, environment(), name=f"ag-attention-rank-kernels-gqa{gqa}-d{head_dim}",
                  formats=list(columns.values()))  # fmt: skip


def _run_kernel(args) -> None:
    base = dataclasses.replace(DEFAULT_SETTINGS, tma=False) if args.pointer_loads else DEFAULT_SETTINGS
    if args.mode == "tune":
        if set(args.head_dims) - set(CONFIGS["fwd"]):
            raise SystemExit(f"tune tunes the config table's head dims {sorted(CONFIGS['fwd'])}, got {args.head_dims}")
        tune(args.gqa, args.kinds, args.head_dims, args.rounds, base)
        return
    if HEADS % args.gqa:
        raise SystemExit(f"--gqa must divide {HEADS}")
    if min(args.tokens) < 1:
        raise SystemExit(f"--tokens must be positive, got {args.tokens}")
    if args.profile:
        results = profile(args.gqa, args.head_dims, base, args.tokens)
    else:  # other settings than the ops': their own row label and result names
        results = bench(args.gqa, args.head_dims, base, ", pointer loads" * args.pointer_loads, args.tokens,
                        tuple(args.backends))  # fmt: skip
    for r in results:
        r.name += "-pointer-loads" * args.pointer_loads
    emit(results, args.out)


def _run_cp(args) -> None:
    if args.work_model:
        emit([work_model(args.head_dim)], args.out)
        return
    heads = SMOKE_HEADS if args.smoke else HEADS
    if heads % args.gqa:
        raise SystemExit(f"--gqa must divide {heads}")
    world = args.world or (2 if args.smoke else default_world())
    if args.profile and args.smoke:
        raise SystemExit("--profile needs GPUs")
    if args.smoke and args.cudagraphs:
        raise SystemExit("--cudagraphs needs GPUs, not --smoke")
    if args.smoke and "fa4" in args.backends:
        raise SystemExit("--backends fa4 needs GPUs, not --smoke")
    if args.head_groups is None:  # the default: those of 2 and 4 that divide Hkv
        args.head_groups = [g for g in DEFAULT_HEAD_GROUPS if (heads // args.gqa) % g == 0]
    bad = [g for g in args.head_groups if g < 2 or (heads // args.gqa) % g]
    if bad:
        raise SystemExit(f"--head-groups must be divisors of Hkv = {heads // args.gqa} above 1, got {bad}")
    if args.smoke and args.head_dim != HEAD_DIM:
        raise SystemExit(f"--smoke runs D = {SMOKE_HEAD_DIM}; --head-dim is for the GPU runs")
    spawn_ranks(_rank, world, args.gqa, args.out, args.smoke, args.profile, args.cudagraphs,
                tuple(args.head_groups), args.head_dim, tuple(args.tokens), tuple(args.backends),
                device="cpu" if args.smoke else "cuda", keep_group=args.cudagraphs)  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    shared = argparse.ArgumentParser(add_help=False)
    shared.add_argument("--gqa", type=int, default=1, help="query heads per kv head (Hkv = H / gqa; default 1)")
    one_gpu = argparse.ArgumentParser(add_help=False, parents=[shared])
    one_gpu.add_argument("--head-dims", type=int, nargs="+", default=list(HEAD_DIMS),
                         help="head dims D to run (default 128 64; 256 is Qwen3-Next's)")  # fmt: skip
    one_gpu.add_argument("--pointer-loads", action="store_true",
                         help="no TMA loads: run (and tune) the pointer-load kernels and CONFIGS")  # fmt: skip
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    modes = parser.add_subparsers(dest="mode", required=True)

    kernel = modes.add_parser("kernel", parents=[one_gpu], help="segment attention against library kernels")
    kernel.add_argument("--tokens", type=int, nargs="+", default=[ATTENTION_TOKENS],
                        help=f"the packed cases' total tokens, one case each, besides the dense case "
                        f"(default {ATTENTION_TOKENS})")  # fmt: skip
    kernel.add_argument("--profile", action="store_true", help="CUDA time per kernel instead of the table")
    kernel.add_argument("--backends", nargs="+", default=[], choices=ATTENTION_BACKENDS,
                        help="also time ag_thd_attention at W = 1 on each attention backend (rows of their own)")
    add_out_argument(kernel)

    tuner = modes.add_parser("tune", parents=[one_gpu], help="time the kernels' candidate configs")
    tuner.add_argument("--kinds", nargs="+", default=["fwd", "bwd_dkdv", "bwd_dq"], help="kernels to tune")
    tuner.add_argument("--rounds", type=int, default=1, help="rounds of timing every candidate in turn")

    ranks = modes.add_parser("ranks", parents=[shared], help="each CP rank's attention kernels on one GPU")
    ranks.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8], help="CP sizes W (default 2 4 8)")
    ranks.add_argument("--tokens", type=int, nargs="+", default=list(TOTALS),
                       help=f"global real tokens per batch (default {' '.join(map(str, TOTALS))})")  # fmt: skip
    ranks.add_argument("--head-dim", type=int, default=HEAD_DIM, help=f"D (default {HEAD_DIM})")
    add_out_argument(ranks)

    cp = modes.add_parser("cp", parents=[shared], help="all-gather CP attention on W GPUs against one GPU")
    cp.add_argument("--world", type=int, help="ranks, one GPU each (default: every visible GPU, at least 2)")
    cp.add_argument("--tokens", type=int, nargs="+", default=list(TOTALS),
                    help=f"global real tokens per batch (default {' '.join(map(str, TOTALS))}; not with --smoke)")
    cp.add_argument("--head-dim", type=int, default=HEAD_DIM, help=f"D (default {HEAD_DIM}; not with --smoke)")
    cp.add_argument("--smoke", action="store_true", help="2 gloo ranks on the CPU, tiny shapes, few runs")
    cp.add_argument("--work-model", action="store_true", help="print the kernel-tile work model (CPU) and exit")
    cp.add_argument("--profile", action="store_true", help="also profile one fwd+bwd step: one GPU, compiled CP")
    cp.add_argument("--head-groups", type=int, nargs="*", default=None, metavar="G",
                    help="also time the compiled one-launch form with head_groups=G (the KV heads in G all-gathers, "
                    "overlapped by cp_ops.COMPILE_OPTIONS); each G must divide Hkv (default: those of 2 and 4 that "
                    "do; none given: none)")  # fmt: skip
    cp.add_argument("--backends", nargs="+", default=[], choices=ATTENTION_BACKENDS,
                    help="also time the compiled one-launch form on each attention backend (segment: the package's "
                    "kernels, fa4: FlashAttention 4's; columns of their own)")  # fmt: skip
    cp.add_argument("--cudagraphs", action="store_true",
                    help="compile the CP form with CUDA graphs (Inductor's triton.cudagraphs)")  # fmt: skip
    add_out_argument(cp)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    checks_off()
    args = parse_args(argv)
    if args.mode == "cp":
        _run_cp(args)
        return
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA device")
    if args.mode == "ranks":
        if HEADS % args.gqa:
            raise SystemExit(f"--gqa must divide {HEADS}")
        emit([rank_kernels(args.gqa, args.head_dim, tuple(args.worlds), tuple(args.tokens))], args.out)
        return
    _run_kernel(args)


if __name__ == "__main__":
    main()
