"""Host time to issue one compiled fwd+bwd step of each layer, against the step's GPU time.

    python -m benchmarks.bench_layer_host [--tokens 32768] [--seqs 8 64] [--layers gdn attention]
                                          [--dynamic] [--compiled-autograd] [--runs 20]
                                          [--host-profile DIR] [--out DIR]
    python -m benchmarks.bench_layer_host --smoke    # the CPU, tiny widths, in seconds
    python -m benchmarks.bench_layer_host --baseline DIR --rounds 3 [the options above]

Layers on one GPU (``group=None``), bf16, at Qwen3-Next-80B's widths:

  gdn        cp_ops.GatedDeltaNet: hidden 2048, Hk 16, Hv 32, dk = dv = 128, conv kernel 4
  attention  cp_ops.Attention: hidden 2048, 16 query heads, 2 KV heads, head dim 256, gated,
             q/k norm, partial rotary factor 0.25 (64 of 256 features rotated), causal

each under ``torch.compile(layer, fullgraph=True)`` (no CUDA graphs; ``dynamic=None``, so each
case compiles for its own shapes: ``torch._dynamo.reset()`` before each case; ``--dynamic``
compiles with ``dynamic=True`` instead). A batch is T = 32768 real tokens in B = 8 and in
B = 64 sequences of random lengths (``benchmarks.cases.random_lengths``: 0.5 to 1.5 times
T/B, a fixed seed per case, summing to T), laid out by ``cp_ops.pad_cu_seqlens(lens, 1)``
(each sequence padded to a multiple of 2 rows, so ``rows`` may exceed T by up to B).
One step: clear the grads of the parameters and the input, run the compiled layer, and
backward from a fixed random upstream gradient (the loss ``sum(out * g)``), which fills
the gradients of every parameter and of the input. ``--compiled-autograd`` runs the backward
under compiled autograd instead (``torch._dynamo.config.compiled_autograd = True``, the forward
and ``backward()`` inside one function compiled by ``torch.compile``, as PyTorch documents it): the
whole backward, the gradients' accumulation included, is one compiled graph, and the autograd
engine no longer walks the nodes one by one on the host.

Columns, per (layer, B):

  step ms        ``triton.testing.do_bench`` median of the step (GPU time; the host's, where
                 that is longer)
  kernels ms     summed device time of everything one step launches (torch.profiler,
                 ``benchmarks.timing.kernel_ms``)
  host ms        host time to issue one step while the GPU is kept busy, so that issuing never
                 waits for it: a ``torch.cuda._sleep`` (cycles calibrated once against CUDA
                 events) longer than the step is enqueued, ``step()`` is timed with
                 ``time.perf_counter`` without synchronising, then the device is synchronised;
                 median of ``--runs`` runs. A CUDA event recorded after the sleep must still be
                 pending when issuing ends; ``GPU waited`` counts the runs where it was not
                 (the sleep ran out, or the step synchronised: its host time then includes
                 GPU time), after a longer sleep was tried
  host / step    host ms / step ms; ``host <= step / 4`` is the target (yes / no)
  launches       kernel launches per step: CUDA runtime and driver events of the profiler
                 (CPU and CUDA activities) named ``cudaLaunchKernel``, ``cudaLaunchKernelExC``,
                 ``cuLaunchKernel``, ``cuLaunchKernelEx`` or a cooperative launch
                 (:func:`is_launch`), counted over the profiled steps / steps
  GPU kernels    kernels the GPU ran per step (the profiler's device events, copies and memsets
                 left out): a check of ``launches``, which counts host events
  copies         ``cudaMemcpy*`` and ``cudaMemset*`` runtime events per step (:func:`is_copy`)
  ops            Python-dispatched ops per step (:func:`top_level_ops`): the profiler's CPU
                 events named ``namespace::name`` (dispatcher ops: ``aten::``, ``cp_ops::``,
                 ``prims::``, ...; not the ``autograd::`` and ``torch::autograd::`` events of
                 the autograd engine, nor record_function scopes such as
                 ``Torch-Compiled Region`` or Inductor's kernel names, which have no ``::``)
                 that have no such op among their ancestors (``cpu_parent`` chain, per thread):
                 what Inductor's wrapper code and the autograd engine call, without the ops an
                 op calls inside itself

``--smoke`` runs the same code on the CPU: tiny widths in float32, a small T, wall-clock
timing; host ms is the median wall time of a step (the CPU has no queue to keep busy),
kernels ms and the launch counts are null.

Result (benchmarks/runner.py): ``layer-host`` (``layer-host-compiled-autograd`` with
--compiled-autograd; ``-smoke`` appended with --smoke).

Comparing code: the host time of one process differs from the next one's on the same machine
by more than most changes measured (docs/benchmarks.md's history, section "FLA's chunk indices from one
kernel; compiled autograd"). ``--baseline DIR`` (a checkout of older code, with its own copy of this script)
and ``--rounds N`` run the benchmark in a fresh process per checkout and round, the
checkouts interleaved, each from its own folder with its own packages first on the path (the
other options passed on), and write one table (:func:`merge_runs`, result ``<name>-runs``):
a row per checkout and case with the least host time of its runs, and each run's. Each
checkout gets its own Inductor cache: PyTorch's compile caches key a graph by the names of
the ops it calls, not by their code (pytorch/pytorch#144344), so a graph compiled against one
checkout's ops would be loaded for the other's.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch._dynamo

from benchmarks.cases import random_lengths
from benchmarks.runner import ROOT, Result, add_out_argument, emit, environment, git_commit
from benchmarks.timing import kernel_ms, median_ms, median_ms_counted

TOKENS, SEQS = 32768, (8, 64)
LAYERS = ("gdn", "attention")
GDN_DIMS = (2048, 16, 32, 128, 128)  # hidden, Hk, Hv, dk, dv
ATTENTION_DIMS = (2048, 16, 2, 256)  # hidden, Hq, Hkv, head dim
PARTIAL_ROTARY, ROPE_THETA = 0.25, 1e7
SMOKE_GDN_DIMS, SMOKE_ATTENTION_DIMS = (32, 2, 4, 16, 16), (32, 4, 2, 16)
SMOKE_TOKENS, SMOKE_SEQS = 48, (2, 5)
PROFILE_STEPS = 3
TARGET = 0.25  # host time to issue a step at most this share of its GPU time

COLUMNS = {
    "layer": None, "B": "{:d}", "rows": "{:d}", "lengths": None, "step ms": "{:.3f}", "kernels ms": "{:.3f}",
    "host ms": "{:.3f}", "host / step": "{:.3f}", "host <= step / 4": None, "GPU waited": "{:d}",
    "launches": "{:.1f}", "GPU kernels": "{:.1f}", "copies": "{:.1f}", "ops": "{:.1f}",
}  # fmt: skip


# --- what the profiler's events are counted as ------------------------------------------------------

_LAUNCH = re.compile(r"^cu(da)?Launch(Cooperative)?Kernel")
_COPY = re.compile(r"^cu(da)?Mem(cpy|set)")
_OP = re.compile(r"^(\w+)::\w")
# the autograd engine's scopes and nodes: "autograd::engine::evaluate_function: X", "torch::autograd::AccumulateGrad"
NOT_OP_NAMESPACES = frozenset({"autograd", "torch", "profiler"})


def is_launch(name: str) -> bool:
    """A CUDA runtime or driver kernel launch event (``cudaLaunchKernel``, ``cuLaunchKernelEx``, ...)."""
    return bool(_LAUNCH.match(name))


def is_copy(name: str) -> bool:
    """A CUDA runtime or driver copy or memset event (``cudaMemcpyAsync``, ``cudaMemsetAsync``, ...)."""
    return bool(_COPY.match(name))


def is_op(name: str) -> bool:
    """A dispatcher op event (``aten::mm``, ``cp_ops::causal_conv1d``), not an autograd scope or node."""
    m = _OP.match(name)
    return bool(m) and m.group(1) not in NOT_OP_NAMESPACES


def _on_cpu(event) -> bool:
    device_type = getattr(event, "device_type", None)
    return device_type is None or "CPU" in str(device_type)


def is_device_kernel(event) -> bool:
    """A kernel on the GPU (a device event that is not a ``Memcpy ...`` or ``Memset ...``)."""
    return "CUDA" in str(getattr(event, "device_type", "")) and not event.name.startswith(("Memcpy", "Memset"))


def top_level_ops(events) -> list[str]:
    """Names of the CPU op events (:func:`is_op`) none of whose ancestors (``cpu_parent``) is an op."""
    out = []
    for e in events:
        if not _on_cpu(e) or not is_op(e.name):
            continue
        parent = getattr(e, "cpu_parent", None)
        while parent is not None and not is_op(parent.name):
            parent = getattr(parent, "cpu_parent", None)
        if parent is None:
            out.append(e.name)
    return out


def event_counts(events, steps: int, cuda: bool) -> dict[str, float | None]:
    """``{"launches", "GPU kernels", "copies", "ops"}`` per step from the profiler events of
    ``steps`` steps; all but ``ops`` are None without CUDA (the CPU has no such events)."""
    names = [e.name for e in events if _on_cpu(e)]
    return {
        "launches": sum(map(is_launch, names)) / steps if cuda else None,
        "GPU kernels": sum(map(is_device_kernel, events)) / steps if cuda else None,
        "copies": sum(map(is_copy, names)) / steps if cuda else None,
        "ops": len(top_level_ops(events)) / steps,
    }


def profile_counts(step, cuda: bool, steps: int = PROFILE_STEPS) -> dict[str, float | None]:
    """:func:`event_counts` of ``steps`` calls of ``step`` under torch.profiler (CPU activity,
    and CUDA's for the runtime's launch events), after one call outside it."""
    from torch.profiler import ProfilerActivity, profile

    step()
    _sync(cuda)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        _sync(cuda)
    return event_counts(prof.events(), steps, cuda)


# --- host time with the GPU kept busy ---------------------------------------------------------------


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def sleep_cycles_per_ms() -> float:
    """GPU clock cycles of ``torch.cuda._sleep`` per ms, timed with CUDA events (median of 3)."""
    torch.cuda._sleep(1000)
    torch.cuda.synchronize()
    rates = []
    for cycles in (20_000_000, 40_000_000, 80_000_000):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        torch.cuda.synchronize()
        rates.append(cycles / start.elapsed_time(end))
    return statistics.median(rates)


MAX_SLEEP_MS = 2000.0


def host_issue_busy_ms(step, cycles_per_ms: float, runs: int = 20, warmup: int = 3) -> tuple[float, int]:
    """``(median host ms to issue one step, runs where the GPU ran dry)`` with a GPU sleep
    enqueued before each timed ``step()`` (the module docstring's ``host ms``).

    The sleep starts at twice a synchronised step's wall time (which bounds its issue time)
    plus 20 ms; when the event after it is done by the end of issuing, the run is retried with
    a four times longer sleep (up to :data:`MAX_SLEEP_MS`), and counted as waited if it still is.
    """
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    step()
    torch.cuda.synchronize()
    sleep_ms = 2e3 * (time.perf_counter() - start) + 20.0
    times, waited = [], 0
    for _ in range(runs):
        while True:
            torch.cuda.synchronize()
            torch.cuda._sleep(int(sleep_ms * cycles_per_ms))
            slept = torch.cuda.Event()
            slept.record()
            start = time.perf_counter()
            step()
            elapsed = time.perf_counter() - start
            pending = not slept.query()
            if pending or sleep_ms >= MAX_SLEEP_MS:
                break
            sleep_ms = min(4 * sleep_ms, MAX_SLEEP_MS)
        torch.cuda.synchronize()
        times.append(elapsed * 1e3)
        waited += not pending
    return statistics.median(times), waited


def host_profile(step, cycles_per_ms: float, steps: int = PROFILE_STEPS, top: int = 40) -> str:
    """cProfile of issuing ``steps`` steps behind one GPU sleep of :data:`MAX_SLEEP_MS`: the
    ``top`` functions by own time, then by cumulative time (where the host time goes)."""
    import cProfile
    import io
    import pstats

    step()
    torch.cuda.synchronize()
    torch.cuda._sleep(int(MAX_SLEEP_MS * cycles_per_ms))
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    return text.getvalue()


def host_wall_ms(step, runs: int = 20, warmup: int = 2) -> float:
    """Median wall time of ``step()`` in ms: its host time where the work is synchronous (CPU)."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


# --- the layers and their steps ----------------------------------------------------------------------


def build_layer(name: str, smoke: bool, device, dtype) -> torch.nn.Module:
    import cp_ops

    if name == "gdn":
        return cp_ops.GatedDeltaNet(*(SMOKE_GDN_DIMS if smoke else GDN_DIMS)).to(device, dtype)
    hidden, heads, kv_heads, head_dim = SMOKE_ATTENTION_DIMS if smoke else ATTENTION_DIMS
    layer = cp_ops.Attention(hidden, heads, kv_heads, head_dim, gated=True, partial_rotary_factor=PARTIAL_ROTARY,
                             rope_theta=ROPE_THETA, qk_norm=True, causal=True)  # fmt: skip
    return layer.to(device, dtype)


def case_inputs(tokens: int, num_seqs: int, hidden: int, device, dtype) -> dict:
    """The batch of one case: lengths, layout, input (a leaf requiring grad), upstream gradient."""
    import cp_ops

    gen = torch.Generator().manual_seed(tokens + num_seqs)
    lens = random_lengths(tokens, num_seqs, gen)
    cu, cup = cp_ops.pad_cu_seqlens(lens, 1, device=device)
    rows = int(cup[-1])
    x = torch.randn(rows, hidden, generator=gen).to(device, dtype).requires_grad_()
    grad = torch.randn(rows, hidden, generator=gen).to(device, dtype)
    return {"lens": lens, "cu": cu, "cup": cup, "rows": rows, "x": x, "grad": grad}


def make_step(name: str, fn, layer: torch.nn.Module, batch: dict, compiled_autograd: bool = False):
    """One fwd+bwd step of ``fn`` (the layer, compiled or not) on ``batch``: the grads of the
    parameters and the input cleared, the forward, the backward from the fixed gradient. With
    ``compiled_autograd`` the forward and the backward run in one function compiled by
    ``torch.compile``, whose ``backward()`` compiled autograd compiles when
    ``torch._dynamo.config.compiled_autograd`` is set (before this call: ``torch.compile`` keeps
    the config it was called under)."""
    x, cu, cup, grad = batch["x"], batch["cu"], batch["cup"], batch["grad"]
    leaves = [x, *layer.parameters()]
    args = (x, cup) if name == "gdn" else (x, cu, cup)

    def fwd_bwd(*inputs):
        fn(*inputs).backward(grad)

    run = torch.compile(fwd_bwd) if compiled_autograd else fwd_bwd

    def step():
        for t in leaves:
            t.grad = None
        run(*args)

    return step


def bench_case(name: str, tokens: int, num_seqs: int, args, cycles_per_ms: float | None) -> list:
    """One row of the table (:data:`COLUMNS`)."""
    cuda = not args.smoke
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    torch.manual_seed(0)
    layer = build_layer(name, args.smoke, device, dtype)
    batch = case_inputs(tokens, num_seqs, layer.hidden_size, device, dtype)
    torch._dynamo.reset()  # each case compiles for its own shapes, as a fresh run would
    compiled = torch.compile(layer, fullgraph=True, dynamic=True if args.dynamic else None)
    step = make_step(name, compiled, layer, batch, args.compiled_autograd)
    step()  # compiles
    _sync(cuda)
    if cuda:
        step_ms = median_ms(step)
        kernels = kernel_ms(step)
        host, waited = host_issue_busy_ms(step, cycles_per_ms, args.runs)
        if args.host_profile:
            os.makedirs(args.host_profile, exist_ok=True)
            path = os.path.join(args.host_profile, f"host-profile-{name}-{num_seqs}.txt")
            with open(path, "w") as f:
                f.write(host_profile(step, cycles_per_ms))
    else:
        step_ms = median_ms_counted(step, warmup=1, runs=args.runs, device="cpu")
        kernels, (host, waited) = None, (host_wall_ms(step, args.runs), 0)
    counts = profile_counts(step, cuda)
    lens = batch["lens"]
    ratio = host / step_ms
    return [name, num_seqs, batch["rows"], f"random {min(lens)}..{max(lens)}", step_ms, kernels, host, ratio,
            "yes" if ratio <= TARGET else "no", waited, counts["launches"], counts["GPU kernels"], counts["copies"],
            counts["ops"]]  # fmt: skip


def result(rows: list[list], args, tokens: int) -> Result:
    smoke = args.smoke
    gdn = SMOKE_GDN_DIMS if smoke else GDN_DIMS
    attn = SMOKE_ATTENTION_DIMS if smoke else ATTENTION_DIMS
    dtype = "float32 on the CPU" if smoke else "bf16"
    notes = (
        f"one device (group=None), {dtype}, torch.compile(fullgraph=True, dynamic="
        f"{'True' if args.dynamic else 'None'}), no CUDA graphs; T = {tokens} real tokens in B sequences of "
        f"random lengths (0.5 to 1.5 of T/B), padded to 2-row multiples (rows); one step = grads cleared, "
        f"forward, backward from a fixed random gradient (parameters and input); "
        f"gdn: hidden {gdn[0]}, Hk {gdn[1]}, Hv {gdn[2]}, dk {gdn[3]}, dv {gdn[4]}; attention: hidden {attn[0]}, "
        f"Hq {attn[1]}, Hkv {attn[2]}, D {attn[3]}, gated, q/k norm, partial rotary {PARTIAL_ROTARY}; "
        f"step ms: do_bench median; host ms: median of {args.runs} issues behind a GPU sleep; "
        f"launches, GPU kernels, copies, ops: per step (benchmarks/bench_layer_host.py's docstring defines them)"
    )
    if args.compiled_autograd:
        notes += "; the backward under compiled autograd (--compiled-autograd)"
    if smoke:
        notes += "; --smoke: wall-clock times on the CPU, host ms = a step's wall time, no launch counts"
    title = "Host time to issue a compiled fwd+bwd step of each layer, against its GPU time (one GPU)"
    name = "layer-host" + "-compiled-autograd" * args.compiled_autograd + "-smoke" * smoke
    return Result("layer_host", title, list(COLUMNS), rows, notes, _environment(), name=name,
                  formats=dict(COLUMNS))  # fmt: skip


def _environment() -> dict:
    try:
        import fla

        version = getattr(fla, "__version__", "?")
    except ImportError:
        version = "absent"
    return environment(fla=version)


def merge_runs(runs: list[tuple[str, list[dict]]]) -> tuple[list[str], list[list]]:
    """``(columns, rows)`` from ``runs``, ``[(code, [the result of each of its runs, as JSON])]``:
    a row per code and case, the first run's row with ``host ms`` the least over the code's runs
    (``host / step`` and the target recomputed from it), ``GPU waited`` summed, and each run's
    host ms in a last column. Columns are matched by name, so an older checkout's script, whose
    table may lack some, leaves those cells empty."""
    columns = ["code", *COLUMNS, "host ms, each run"]
    rows = []
    for code, results in runs:
        tables = [[dict(zip(r["columns"], row)) for row in r["rows"]] for r in results]
        for i, first in enumerate(tables[0]):
            case = (first["layer"], first["B"])
            same = [next(c for c in t if (c["layer"], c["B"]) == case) for t in tables]
            hosts = [c["host ms"] for c in same]
            cells = dict(first, **{"host ms": min(hosts), "GPU waited": sum(c["GPU waited"] for c in same)})
            cells["host / step"] = cells["host ms"] / cells["step ms"]
            cells["host <= step / 4"] = "yes" if cells["host / step"] <= TARGET else "no"
            rows.append([code, *(cells.get(c) for c in COLUMNS), ", ".join(f"{h:.2f}" for h in hosts)])
    return columns, rows


def _child_args(args) -> list[str]:
    """The options a child run gets: this run's, without the interleaving and output ones."""
    argv = ["--layers", *args.layers]
    if args.tokens is not None:
        argv += ["--tokens", str(args.tokens)]
    if args.seqs is not None:
        argv += ["--seqs", *map(str, args.seqs)]
    if args.runs is not None:
        argv += ["--runs", str(args.runs)]
    flags = {"--dynamic": args.dynamic, "--compiled-autograd": args.compiled_autograd, "--smoke": args.smoke}
    return argv + [flag for flag, on in flags.items() if on]


def run_interleaved(args, command: str) -> Result:
    """``--rounds`` runs of each checkout (``--baseline`` first, then this one), interleaved, each a
    fresh process started in the checkout's folder; their tables merged by :func:`merge_runs`."""
    checkouts = [os.path.abspath(args.baseline)] if args.baseline else []
    checkouts.append(str(ROOT))
    codes = [git_commit(c) or os.path.basename(c) for c in checkouts]
    if len(set(codes)) < len(codes):
        codes[0] += " (baseline)"
    results: list[list[dict]] = [[] for _ in checkouts]
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            for k, folder in enumerate(checkouts):
                out = os.path.join(tmp, f"{k}-{i}")
                env = dict(os.environ, PYTHONUNBUFFERED="1")
                env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tmp, f"inductor-{k}")
                env["PYTHONPATH"] = os.pathsep.join(p for p in (folder, env.get("PYTHONPATH")) if p)
                print(f"===== {codes[k]}, run {i + 1} of {args.rounds}", flush=True)
                cmd = [sys.executable, "-m", "benchmarks.bench_layer_host", *_child_args(args), "--out", out]
                if subprocess.run(cmd, cwd=folder, env=env).returncode != 0:
                    raise SystemExit(f"the run of {folder} failed: {' '.join(cmd)}")
                (path,) = [os.path.join(out, f) for f in os.listdir(out) if f.endswith(".json")]
                with open(path) as f:
                    results[k].append(json.load(f))
    first = results[-1][0]
    columns, rows = merge_runs(list(zip(codes, results)))
    notes = (f"{first['notes']}\n- `{command}`: {args.rounds} run(s) of each checkout, each in its own process, "
             f"the checkouts interleaved; host ms is the least of a checkout's runs (each run's in the last "
             f"column), the other columns its first run's")  # fmt: skip
    formats = {c: f for c, f in COLUMNS.items() if f}
    return Result("layer_host", first["title"], columns, rows, notes, _environment(), name=f"{first['name']}-runs",
                  formats=formats)  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=None, help=f"real tokens per batch (default {TOKENS})")
    parser.add_argument("--seqs", type=int, nargs="+", default=None, help=f"sequences per batch (default {SEQS})")
    parser.add_argument("--layers", nargs="+", choices=LAYERS, default=list(LAYERS), help="layers to time")
    parser.add_argument("--dynamic", action="store_true", help="compile with dynamic=True (default: None)")
    parser.add_argument("--compiled-autograd", action="store_true",
                        help="run the backward under compiled autograd (torch._dynamo.config.compiled_autograd)")
    parser.add_argument("--runs", type=int, default=None, help="timed runs of the host issue (default 20; 3 with --smoke)")
    parser.add_argument("--smoke", action="store_true", help="the CPU, tiny widths in float32, few runs")
    parser.add_argument("--host-profile", metavar="DIR", default=None,
                        help="also write a cProfile of issuing each case's steps to DIR (GPU only)")
    parser.add_argument("--baseline", metavar="DIR", default=None,
                        help="also time the checkout in DIR, each run in a fresh process, interleaved with this one's")
    parser.add_argument("--rounds", type=int, default=1,
                        help="runs of each checkout, interleaved; a row's host ms is the least of them (default 1)")
    add_out_argument(parser)
    args = parser.parse_args(argv)
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be >= 1, got {args.rounds}")
    if args.baseline or args.rounds > 1:
        if args.host_profile:
            raise SystemExit("--host-profile profiles one run: leave out --baseline and --rounds")
        command = "python -m benchmarks.bench_layer_host " + " ".join(sys.argv[1:] if argv is None else argv)
        emit([run_interleaved(args, command)], args.out)
        return
    tokens = args.tokens or (SMOKE_TOKENS if args.smoke else TOKENS)
    seqs = args.seqs or (SMOKE_SEQS if args.smoke else SEQS)
    args.runs = args.runs or (3 if args.smoke else 20)
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("bench_layer_host needs a CUDA device (or --smoke on the CPU)")
    if min(seqs) < 1 or tokens < 2 * max(seqs):
        raise SystemExit(f"--seqs must be >= 1 and --tokens at least 2 per sequence, got {tokens} and {seqs}")
    if args.compiled_autograd:
        torch._dynamo.config.compiled_autograd = True
    cycles_per_ms = None if args.smoke else sleep_cycles_per_ms()
    if cycles_per_ms is not None:
        print(f"torch.cuda._sleep: {cycles_per_ms:,.0f} cycles per ms", flush=True)
    rows = []
    for name in args.layers:
        for num_seqs in seqs:
            rows.append(bench_case(name, tokens, num_seqs, args, cycles_per_ms))
            cells = dict(zip(COLUMNS, rows[-1]))
            print(f"{name} B={num_seqs}: step {cells['step ms']:.3f} ms, host {cells['host ms']:.3f} ms "
                  f"({cells['host / step']:.2f} of the step), ops {cells['ops']:.1f}, "
                  f"launches {cells['launches']}", flush=True)  # fmt: skip
            if args.out is not None:  # the table so far, so a run cut short by a time limit still leaves one
                result(rows, args, tokens).write(args.out)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    emit([result(rows, args, tokens)], args.out)


if __name__ == "__main__":
    main()
