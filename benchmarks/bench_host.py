"""What the host costs: the time per eager call of every cp_ops op in both registration forms
(a subprocess each), and with --cold-start the demo's and a GatedDeltaNet layer's first steps in
fresh processes on empty caches (cold), then on the caches they left (warm).

    python -m benchmarks.bench_host [--ops NAME ...] [--layout-sweep] [--raw FILE.json] [--out DIR]
    python -m benchmarks.bench_host --cold-start [--parts demo layer] [--keep-autotuning] [--unseeded] [--timeout S]
    python -m benchmarks.bench_host [--cold-start] --smoke     # the CPU: tiny shapes, the torch references

Results (benchmarks/runner.py): ``host`` (``host-smoke``), with --layout-sweep also
``host-layout-sweep``; ``cold-start`` (``-smoke``, ``-keep-autotuning``). Two checkouts are
compared with ``python -m benchmarks.compare_checkouts BASE NEW --suites host``.
docs/benchmarks.md says what each figure measures.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FORMS = {"0": "triton_op", "1": "opaque"}


# --- host time per call: what is timed ------------------------------------------------------------


class Case:
    """One op ``fn(*inputs)``: ``fwd()`` is one eager call; ``make_bwd()`` (None where the op is not
    differentiable) runs one forward with the inputs requiring grad, not timed, and returns a
    function that runs its backward (``torch.autograd.grad``, so no gradient accumulates between
    calls) from ``grads(outputs that require grad)``, ones by default. ``main`` is the input a clone
    of which moves the same bytes (None: no clone row). ``calls`` is N per timed batch."""

    def __init__(self, name, group, fn, inputs, main=None, calls=50, grads=None, differentiable=True):
        self.name, self.group, self.main, self.calls = name, group, main, calls
        self.fwd = lambda: fn(*inputs)
        self.make_bwd = _backward_factory(fn, inputs, grads) if differentiable else None
        self.reference = None  # what fwd() must return, bit for bit (the layout ops)


def _backward_factory(fn, inputs, grads):
    import torch

    leaves = [t.detach().requires_grad_() for t in inputs]

    def make():
        out = fn(*leaves)
        outs = [o for o in (out if isinstance(out, tuple) else (out,)) if o.requires_grad]
        dout = grads(outs) if grads else [torch.ones_like(o) for o in outs]
        return lambda: torch.autograd.grad(outs, leaves, dout)

    return make


def build_cases(device, smoke: bool, only=None):
    import torch

    import custom_ops

    bf16 = torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(*shape, dtype=bf16):
        return torch.randn(shape, generator=gen, device=device).to(dtype)

    def wanted(group, *names):
        """Whether ``--ops`` asks for the group or one of its ops (everything without ``--ops``)."""
        return not only or group in only or any(name in only for name in names)

    def cu(lengths):
        return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)

    w = 4
    seqs, seq_len = (4, 16) if smoke else (16, 4096)
    rows = seqs * seq_len
    real = [seq_len - 3 * (i % 3) for i in range(seqs)]  # a few padding rows per sequence
    cup, cur = cu([seq_len] * seqs), cu(real)
    trailing = (2, 4) if smoke else (16, 64)
    x = rand(rows, *trailing)
    src = rand(rows, *trailing)
    dst = x.clone()
    feats = 8 * w if smoke else 1024
    sections = [feats // 4, feats // 4, feats // 2]
    xf = rand(rows, feats)
    blocks = rand(w, rows, feats // w)
    cases = [
        Case("clone (floor)", "floor", lambda a: a.clone(), [x], x),
        Case("thd_seq_to_rank_order", "layout", lambda a: custom_ops.thd_seq_to_rank_order(a, cup, w), [x], x),
        Case("thd_rank_to_seq_order", "layout", lambda a: custom_ops.thd_rank_to_seq_order(a, cup, w), [x], x),
        Case("thd_copy_valid_tokens", "layout", lambda a, b: custom_ops.thd_copy_valid_tokens(a, b, cup, cur),
             [dst, src], x),
        Case("thd_copy_valid_tokens_", "layout", lambda a, b: custom_ops.thd_copy_valid_tokens_(a, b, cup, cur),
             [dst, src], x, differentiable=False),
        Case("permute_sections", "layout", lambda a: custom_ops.permute_sections(a, sections, w), [xf], xf),
        Case("unpermute_sections", "layout", lambda a: custom_ops.unpermute_sections(a, sections, w), [xf], xf),
        Case("sections_to_rank_blocks", "layout", lambda a: custom_ops.sections_to_rank_blocks(a, sections, w),
             [xf], xf),
        Case("rank_blocks_to_sections", "layout", lambda a: custom_ops.rank_blocks_to_sections(a, sections, w),
             [blocks], blocks),
    ]  # fmt: skip

    references = {
        "thd_seq_to_rank_order": lambda: custom_ops.thd_seq_to_rank_order_reference(x, cup, w),
        "thd_rank_to_seq_order": lambda: custom_ops.thd_rank_to_seq_order_reference(x, cup, w),
        "thd_copy_valid_tokens": lambda: custom_ops.thd_copy_valid_tokens_reference(dst, src, cup, cur),
        "permute_sections": lambda: custom_ops.permute_sections_reference(xf, sections, w),
        "unpermute_sections": lambda: custom_ops.unpermute_sections_reference(xf, sections, w),
        "sections_to_rank_blocks": lambda: custom_ops.permute_sections_reference(xf, sections, w)
        .unflatten(-1, (w, -1)).movedim(-2, 0),
        "rank_blocks_to_sections": lambda: custom_ops.unpermute_sections_reference(
            blocks.movedim(0, -2).flatten(-2), sections, w),
    }  # fmt: skip
    for c in cases:
        c.reference = references.get(c.name)
    if not (wanted("attention", "varlen_attention") or wanted("conv", "causal_conv1d", "causal_conv1d_gather")
            or wanted("gdn", "chunk_gated_delta_rule")):  # fmt: skip
        return _select(cases, only)
    # attention: 4 causal segments, 16 heads, D = 128
    a_seqs, a_len, heads, dim = (2, 16, 2, 16) if smoke else (4, 4096, 16, 128)
    a_rows = a_seqs * a_len
    q, k, v = (rand(a_rows, heads, dim) for _ in range(3))
    starts = torch.arange(a_seqs, dtype=torch.int32, device=device) * a_len
    lens = torch.full((a_seqs,), a_len, dtype=torch.int32, device=device)
    seg = (starts, lens, torch.zeros_like(starts), starts, lens)

    def out_grad_only(outs):  # ones for the output, zeros for the log-sum-exp
        return [torch.ones_like(outs[0])] + [torch.zeros_like(o) for o in outs[1:]]

    cases.append(Case("varlen_attention", "attention",
                      lambda q_, k_, v_: custom_ops.varlen_attention(q_, k_, v_, *seg, causal=True), [q, k, v],
                      calls=30, grads=out_grad_only))  # fmt: skip

    if not (wanted("conv", "causal_conv1d", "causal_conv1d_gather") or wanted("gdn", "chunk_gated_delta_rule")):
        return _select(cases, only)
    # the GDN layer's conv: C = 2048 channels of K = 4 taps over the layout above
    channels = 16 if smoke else 2048
    xc = rand(rows, channels)
    weight = rand(channels, 4)
    xg = rand(rows, channels + channels // 4)
    perm = custom_ops.thd_seq_to_rank_order(torch.arange(rows, device=device), cup, w)

    cases.append(Case("causal_conv1d", "conv", lambda a, wt: custom_ops.causal_conv1d(a, wt, None, cup, "silu"),
                      [xc, weight], calls=30))
    cases.append(Case("causal_conv1d_gather", "conv",
                      lambda a, wt: custom_ops.causal_conv1d_gather(a, perm, wt, None, cup, "silu"), [xg, weight],
                      calls=30))  # fmt: skip

    # gated delta rule: Hk = 4, Hv = 8, d = 128 over 4 sequences of 4096 (FLA's kernels on CUDA)
    if device == "cpu" or importlib.util.find_spec("fla") is not None:
        g_seqs, g_len, hk, hv, dk = (2, 8, 1, 2, 8) if smoke else (4, 4096, 4, 8, 128)
        g_rows = g_seqs * g_len
        gq, gk = rand(g_rows, hk, dk), rand(g_rows, hk, dk)
        gq, gk = (torch.nn.functional.normalize(t.float(), dim=-1).to(bf16) for t in (gq, gk))
        gv = rand(g_rows, hv, dk)
        gg = torch.nn.functional.logsigmoid(rand(g_rows, hv, dtype=torch.float32))
        gb = torch.sigmoid(rand(g_rows, hv, dtype=torch.float32)).to(bf16)
        gcu = cu([g_len] * g_seqs)

        cases.append(Case("chunk_gated_delta_rule", "gdn",
                          lambda *qkvgb: custom_ops.chunk_gated_delta_rule(*qkvgb, gcu), [gq, gk, gv, gg, gb],
                          calls=10))  # fmt: skip
    return _select(cases, only)


def _select(cases, only):
    return [c for c in cases if not only or c.name in only or c.group in only or c.group == "floor"]


# --- host time per call: timing -------------------------------------------------------------------


def host_us(prepare, calls: int, cuda: bool, reps: int = 7) -> dict:
    """Host microseconds per call of what ``prepare()`` returns (a case's ``lambda: fwd``, or its
    ``make_bwd``: the N calls of a batch are prepared before it, not timed): ``{"us": median over
    reps, "min": best rep, "gpu_waited": whether the sleep ran out in any rep}``. On CUDA each
    batch is issued behind a GPU sleep, so that the GPU never waits (a batch whose sleep ran out
    is issued again behind a 4x longer one, twice at most); on the CPU, plain wall time."""
    import torch

    def sync():
        if cuda:
            torch.cuda.synchronize()

    prepare()()  # compiles, allocates
    sync()
    start = time.perf_counter()
    prepare()()
    sync()
    cycles = _sleep_cycles(calls, time.perf_counter() - start)  # GPU time included: an upper bound
    times, waited = [], False
    for rep in range(reps + 1):  # the first round warms the allocator for N live results
        for _attempt in range(3):
            batch = [prepare() for _ in range(calls)]
            sync()
            if cuda:
                torch.cuda._sleep(cycles)
                slept = torch.cuda.Event()
                slept.record()
            start = time.perf_counter()
            keep = [call() for call in batch]
            elapsed = time.perf_counter() - start
            pending = not cuda or not slept.query()
            del keep, batch
            if pending:
                break
            cycles *= 4
        waited |= not pending
        if rep:
            times.append(elapsed / calls * 1e6)
    sync()
    return {"us": statistics.median(times), "min": min(times), "gpu_waited": waited}


def _sleep_cycles(calls: int, seconds_per_call: float) -> int:
    """GPU clock cycles (at most 2 GHz) that outlast issuing ``calls`` calls twice over, capped at
    2 s: a row whose sleep still runs out says so."""
    return int(min(2 * calls * seconds_per_call, 2.0) * 2e9) + 2_000_000


def consistent(fn) -> bool | None:
    """Whether two calls give the same bits: the first goes through Triton's own launch path
    (a new launch key), the second through the cached launch. None for in-place ops."""
    import torch

    a, b = fn(), fn()
    if a is None:
        return None
    a, b = (a if isinstance(a, tuple) else (a,)), (b if isinstance(b, tuple) else (b,))
    return all(torch.equal(x, y) for x, y in zip(a, b))


def run_child(args) -> dict:
    import torch

    cuda = not args.smoke
    if cuda and not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device (or --smoke)")
    device = "cuda" if cuda else "cpu"
    torch.manual_seed(0)
    import custom_ops
    from benchmarks.timing import kernel_ms, median_ms

    result = {"form": "triton_op" if custom_ops.kernels_visible_to_compiler() else "opaque", "rows": []}
    for case in build_cases(device, args.smoke, args.ops):
        calls = min(case.calls, 5) if args.smoke else case.calls
        row = {"op": case.name, "group": case.group}
        with torch.no_grad():
            row["same bits twice"] = consistent(case.fwd) if cuda else None
            if case.reference is not None:
                row["matches reference"] = bool(torch.equal(case.fwd(), case.reference()))
            fwd = host_us(lambda: case.fwd, calls, cuda)
        row["fwd host us"], row["fwd host us min"], row["fwd gpu waited"] = fwd["us"], fwd["min"], fwd["gpu_waited"]
        if case.make_bwd is not None:
            bwd = host_us(case.make_bwd, calls, cuda, reps=5)
            row["bwd host us"], row["bwd host us min"], row["bwd gpu waited"] = bwd["us"], bwd["min"], bwd["gpu_waited"]
        if cuda:
            with torch.no_grad():
                row["call ms"] = median_ms(case.fwd, 25, 100)
                row["kernels ms"] = kernel_ms(case.fwd, warmup=1)
                if case.main is not None:
                    main = case.main
                    row["clone ms"] = median_ms(lambda: main.clone(), 25, 100)
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
    if args.layout_sweep and cuda:
        result["layout_sweep"] = layout_sweep()
    return result


def layout_sweep() -> list[list]:
    """The four THD layout ops against a clone, do_bench, at bench_thd_layout.py's row widths: a
    row of shape, W, clone ms and each op's time over the clone's per (shape, W)."""
    import torch

    import custom_ops
    from benchmarks.timing import median_ms

    out = []
    for trailing, seqs, seq_len in (((16, 64), 16, 4096), ((32, 128), 8, 8192)):
        for w in (2, 4, 8):
            cup = torch.arange(seqs + 1, dtype=torch.int32, device="cuda") * seq_len
            cur = cup  # all rows valid
            x = torch.randn((seqs * seq_len,) + trailing, device="cuda", dtype=torch.bfloat16)
            src, dst = torch.randn_like(x), x.clone()
            clone = median_ms(lambda: x.clone(), 25, 100)
            ops = (lambda: custom_ops.thd_seq_to_rank_order(x, cup, w),
                   lambda: custom_ops.thd_rank_to_seq_order(x, cup, w),
                   lambda: custom_ops.thd_copy_valid_tokens(x, src, cup, cur),
                   lambda: custom_ops.thd_copy_valid_tokens_(dst, src, cup, cur))  # fmt: skip
            row = [f"{seqs}x{seq_len} tok, {trailing[0]}x{trailing[1]}", w, clone]
            out.append(row + [median_ms(fn, 25, 100) / clone for fn in ops])
            print(json.dumps(out[-1]), flush=True)
    return out


# --- host time per call: the parent, one subprocess per form --------------------------------------


def spawn(form: str, args, tmp: str) -> dict:
    out = os.path.join(tmp, f"{form}.json")
    env = dict(os.environ, CP_OPS_OPAQUE_KERNELS=form, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    env.pop("TRITON_INTERPRET", None)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--child-out", out]
    cmd += ["--smoke"] * args.smoke + ["--layout-sweep"] * args.layout_sweep
    if args.ops:
        cmd += ["--ops", *args.ops]
    print(f"===== {FORMS[form]} form", flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"the {FORMS[form]} run failed (rc {proc.returncode})")
    with open(out) as f:
        return json.load(f)


def table(runs: dict, smoke: bool) -> tuple[list[str], list[list]]:
    """``(columns, rows)``: one row per op and form (``runs``: ``{form: a child's result}``)."""
    header = ["op", "form", "fwd host us (this tree)", "bwd host us (this tree)"]
    header += [] if smoke else ["call ms", "kernels ms", "clone ms", "call / clone"]
    rows = []
    for form in ("triton_op", "opaque"):
        for row in runs.get(form, {}).get("rows", []):
            cells = [row["op"], form, _fmt_us(row, "fwd"), _fmt_us(row, "bwd")]
            if not smoke:
                call, kernels, clone = row.get("call ms"), row.get("kernels ms"), row.get("clone ms")
                cells += [_fmt_ms(call), _fmt_ms(kernels), _fmt_ms(clone), f"{call / clone:.2f}x" if call and clone else ""]
            rows.append(cells)
    return header, rows


def _fmt_ms(ms) -> str:
    return "" if ms is None else f"{ms:.3f}"


def _fmt_us(row: dict, which: str) -> str:
    us = row.get(f"{which} host us")
    if us is None:
        return ""
    return f"{us:.1f}" + (" (GPU waited)" if row.get(f"{which} gpu waited") else "")


# --- cold start: a fresh process's first steps ----------------------------------------------------

DEMO_ARGS = ["--cp-size", "1"]
SMOKE_DEMO_ARGS = ["--device", "cpu", "--steps", "2", "--blocks", "1", "--seqlens", "64,0,1,40"]
STEP1_TARGET_S = 60.0
LAYER_DIMS = (2048, 16, 32, 128, 128)  # hidden, Hk, Hv, dk, dv
LAYER_TOKENS, LAYER_SEQS = 32768, 8
SMOKE_LAYER_DIMS, SMOKE_LAYER_TOKENS, SMOKE_LAYER_SEQS = (32, 2, 4, 16, 16), 32, 3
STEADY_STEPS = 3
RESULT_PREFIX = "COLD_START_RESULT "  # the line a child prints its figures on, as JSON
T0_VARIABLE = "COLD_START_T0"  # the parent's time.time() just before it starts the child


# --- cold start: reading a child's output as it comes ---------------------------------------------


class Stamper:
    """Splits a byte stream fed in chunks into pieces ended by ``\\n`` or ``\\r``, each with the
    time its last byte came in. A progress bar redraws its line as ``\\r`` then the text, so
    a piece is stamped when its text arrives, not when the next redraw ends it."""

    def __init__(self):
        self.pending, self.pending_t = b"", 0.0

    def feed(self, data: bytes, t: float) -> list[tuple[float, str]]:
        parts = re.split(rb"[\r\n]", data)
        if parts[0]:
            self.pending, self.pending_t = self.pending + parts[0], t
        if len(parts) == 1:
            return []
        done = [(self.pending_t, self.pending)] + [(t, p) for p in parts[1:-1]]
        self.pending, self.pending_t = parts[-1], t
        return [(at, p.decode(errors="replace")) for at, p in done if p.strip()]

    def close(self) -> list[tuple[float, str]]:
        rest, self.pending = self.pending, b""
        return [(self.pending_t, rest.decode(errors="replace"))] if rest.strip() else []


def stamp_output(cmd: list[str], env: dict, timeout: float, cwd: str = ROOT) -> dict:
    """Run ``cmd`` and stamp its output (stdout and stderr together) with the seconds since it
    was started: ``{"pieces": [(s, text), ...], "rc": exit status or None when it ran past
    ``timeout``, "total_s": start to exit}``. The child runs in a session of its own, which is
    killed at the end, so that no process it started outlives it."""
    env = dict(env)
    env[T0_VARIABLE] = repr(time.time())
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, bufsize=0,
                            start_new_session=True)  # fmt: skip
    stamper, pieces = Stamper(), []

    def read():
        while True:
            data = os.read(proc.stdout.fileno(), 65536)
            now = time.perf_counter() - start
            if not data:
                pieces.extend(stamper.close())
                return
            pieces.extend(stamper.feed(data, now))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        rc = None
    total = time.perf_counter() - start
    try:  # the child's own session: it (past its limit) and compile workers it left behind
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    reader.join(timeout=10)
    proc.stdout.close()
    # output read after the exit was written before it: its stamp is at most the exit's
    pieces = [(min(t, total), text) for t, text in pieces]
    return {"pieces": pieces, "rc": rc, "total_s": total}


# --- cold start: the demo's output ----------------------------------------------------------------

_STEP1 = re.compile(r"\btrain\b.*?(?<![\d/])1/(\d+)\b")
_TRAINING = re.compile(r"\[\s*[\d.]+ s\] training on ")
_TABLE = {
    "step_ms": re.compile(r"^step time\s+([\d.,]+) ms"),
    "compile_s": re.compile(r"^compile time\s+([\d.,]+) s"),
    "tokens_per_s": re.compile(r"^tokens/s\s+([\d.,]+)"),
    "graph_breaks": re.compile(r"^graph breaks\s+(\d+)"),
}


def parse_demo(pieces: list[tuple[float, str]]) -> dict:
    """The figures of one demo run from its stamped output (:func:`stamp_output`):
    ``to_step1_s`` (the first progress update counting step 1 done: ``train ... 1/N``),
    ``to_training_s`` (its "training on ..." line), and from its table ``step_ms``,
    ``compile_s``, ``tokens_per_s``, ``graph_breaks``; None for what the output lacks."""
    out = dict.fromkeys(["to_step1_s", "to_training_s", *_TABLE])
    for t, text in pieces:
        line = text.strip()
        if out["to_step1_s"] is None and _STEP1.search(line):
            out["to_step1_s"] = t
        if out["to_training_s"] is None and _TRAINING.search(line):
            out["to_training_s"] = t
        for key, pattern in _TABLE.items():
            m = pattern.match(line)
            if m and out[key] is None:
                value = float(m.group(1).replace(",", ""))
                out[key] = int(value) if key == "graph_breaks" else value
    return out


# --- cold start: the layer children ---------------------------------------------------------------


def _since_start() -> float:
    """Seconds since the parent started this process (its ``COLD_START_T0``)."""
    return time.time() - float(os.environ[T0_VARIABLE])


def layer_child(mode: str, smoke: bool) -> dict:
    """One layer child's figures (docs/benchmarks.md, "Cold and warm start"); runs in the fresh process."""
    import torch

    import cp_ops
    from benchmarks.cases import random_lengths

    out = {"import_s": _since_start()}
    cuda = not smoke
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    dims, tokens, seqs = (SMOKE_LAYER_DIMS, SMOKE_LAYER_TOKENS, SMOKE_LAYER_SEQS) if smoke else (
        LAYER_DIMS, LAYER_TOKENS, LAYER_SEQS)  # fmt: skip
    torch.manual_seed(0)
    layer = cp_ops.GatedDeltaNet(*dims).to(device, dtype)
    gen = torch.Generator().manual_seed(0)
    _, cup = cp_ops.pad_cu_seqlens(random_lengths(tokens, seqs, gen), 1, device=device)
    rows = int(cup[-1])
    x = torch.randn(rows, dims[0], generator=gen).to(device, dtype).requires_grad_()
    grad = torch.randn(rows, dims[0], generator=gen).to(device, dtype)
    leaves = [x, *layer.parameters()]

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def timed(fn) -> float:
        sync()
        start = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - start

    fn = layer if mode == "eager" else torch.compile(layer, fullgraph=True)

    def step():
        for t in leaves:
            t.grad = None
        fn(x, cup).backward(grad)

    sync()
    if mode == "eager":
        start = time.perf_counter()
        y = fn(x, cup)
        sync()
        out["first_fwd_s"] = time.perf_counter() - start
        out["first_bwd_s"] = timed(lambda: y.backward(grad))
    else:
        out["first_step_s"] = timed(step)
    out["to_first_step_s"] = _since_start()
    out["steady_ms"] = statistics.median(timed(step) for _ in range(STEADY_STEPS)) * 1e3
    return out


def run_layer_child(mode: str, env: dict, smoke: bool, timeout: float) -> tuple[dict | None, str]:
    """A layer child in a fresh process: ``(figures, "")``, or ``(None, why)`` when it failed."""
    cmd = [sys.executable, "-m", "benchmarks.bench_host", "--layer-child", mode] + ["--smoke"] * smoke
    run = stamp_output(cmd, env, timeout)
    for _, text in run["pieces"]:
        if text.startswith(RESULT_PREFIX):
            figures = json.loads(text[len(RESULT_PREFIX) :])
            figures["total_s"] = run["total_s"]
            return figures, ""
    return None, failure(run)


def failure(run: dict) -> str:
    """Why a run of :func:`stamp_output` failed, and the end of its output."""
    tail = " | ".join(text for _, text in run["pieces"][-3:])
    return ("ran past the time limit" if run["rc"] is None else f"exited with rc={run['rc']}") + f": {tail[-300:]}"


# --- cold start: the parent -----------------------------------------------------------------------


def child_environment(caches: str, keep_autotuning: bool) -> dict:
    """The children's environment: this one with new cache directories under ``caches``, the
    repository first on PYTHONPATH, and TRITON_CACHE_AUTOTUNING as --keep-autotuning says."""
    env = dict(os.environ)
    for name, sub in (("TRITON_CACHE_DIR", "triton"), ("TORCHINDUCTOR_CACHE_DIR", "inductor"),
                      ("CUDA_CACHE_PATH", "cuda")):  # fmt: skip
        env[name] = os.path.join(caches, sub)
        os.makedirs(env[name], exist_ok=True)
    env.pop("TRITON_INTERPRET", None)
    env.pop("TRITON_CACHE_AUTOTUNING", None)
    if keep_autotuning:
        env["TRITON_CACHE_AUTOTUNING"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    return env


def runs_and_environments(args, part: str):
    """``(which, environment)`` of each run of a part, in order: cold and warm on one set of new
    cache directories, then with ``--unseeded`` a cold run on another with
    ``CP_OPS_FLA_CONFIGS=0``; the directories are removed after the part's last run."""
    with tempfile.TemporaryDirectory(prefix=f"cold-start-{part}-") as caches:
        env = child_environment(caches, args.keep_autotuning)
        yield "cold", env
        yield "warm", env
    if args.unseeded:
        with tempfile.TemporaryDirectory(prefix=f"cold-start-{part}-unseeded-") as caches:
            yield "unseeded", dict(child_environment(caches, args.keep_autotuning), CP_OPS_FLA_CONFIGS="0")


def demo_rows(runs: dict[str, dict]) -> list[list]:
    """Table rows of the demo's runs (``{"cold": figures, "warm": figures, "unseeded": figures}``)."""
    step1 = runs.get("cold", {}).get("to_step1_s")
    verdict = "-" if step1 is None else ("yes" if step1 <= STEP1_TARGET_S else "no")
    return _rows("demo", runs, [
        ("process start to end of step 1, s", "to_step1_s", f"<= {STEP1_TARGET_S:.0f} s cold: {verdict}"),
        ("process start to training start, s", "to_training_s", ""),
        ("compile time (the demo's), s", "compile_s", ""),
        ("steady step (the demo's), ms", "step_ms", ""),
        ("process start to exit, s", "total_s", ""),
    ])  # fmt: skip


def layer_rows(mode: str, runs: dict[str, dict]) -> list[list]:
    if mode == "eager":
        first = [("first forward, s", "first_fwd_s", ""), ("first backward, s", "first_bwd_s", "")]
    else:
        first = [("first fwd+bwd (compiles), s", "first_step_s", "")]
    return _rows(f"GatedDeltaNet {mode}", runs, [
        ("process start to cp_ops imported, s", "import_s", ""), *first,
        ("process start to end of first fwd+bwd, s", "to_first_step_s", ""), ("steady fwd+bwd, ms", "steady_ms", ""),
    ])  # fmt: skip


def _rows(part: str, runs: dict[str, dict], figures) -> list[list]:
    """A row per ``(label, key, target)`` of ``figures``: the figure in the cold, warm and unseeded runs."""
    return [[part, label, *(runs.get(which, {}).get(key) for which in ("cold", "warm", "unseeded")), target]
            for label, key, target in figures]  # fmt: skip


def cold_start_result(rows: list[list], notes: list[str], args):
    from benchmarks.runner import Result, environment

    name = "cold-start" + "-smoke" * args.smoke + "-keep-autotuning" * args.keep_autotuning
    where = "the CPU (--smoke)" if args.smoke else "one GPU"
    dims = SMOKE_LAYER_DIMS if args.smoke else LAYER_DIMS
    tokens, seqs = (SMOKE_LAYER_TOKENS, SMOKE_LAYER_SEQS) if args.smoke else (LAYER_TOKENS, LAYER_SEQS)
    demo = " ".join(DEMO_ARGS + SMOKE_DEMO_ARGS * args.smoke)
    text = [
        f"fresh processes on {where}; cold: empty TRITON_CACHE_DIR, TORCHINDUCTOR_CACHE_DIR, CUDA_CACHE_PATH; "
        f"warm: the same caches after the cold run; TRITON_CACHE_AUTOTUNING "
        f"{'= 1' if args.keep_autotuning else 'unset'}; demo: python -m cp_ops demo {demo}; layer: "
        f"GatedDeltaNet (hidden {dims[0]}, Hk {dims[1]}, Hv {dims[2]}, dk {dims[3]}, dv {dims[4]}), "
        f"{'float32' if args.smoke else 'bf16'}, T = {tokens} in {seqs} random-length sequences; steady: "
        f"median of {STEADY_STEPS} synchronised steps; cold, CP_OPS_FLA_CONFIGS=0: a third, cold run on caches "
        f"of its own without the recorded FLA autotuning choices (--unseeded; empty where not run)"
    ] + notes
    return Result("cold_start", "Cold and warm start: the demo and a GatedDeltaNet layer in fresh processes",
                  ["part", "figure", "cold", "warm", "cold, CP_OPS_FLA_CONFIGS=0", "target"], rows,
                  "\n".join(f"- {n}" for n in text), environment(), name=name,
                  formats=[None, None, "{:.2f}", "{:.2f}", "{:.2f}", None])  # fmt: skip


def cold_start(args) -> None:
    """The --cold-start run: each part cold, then warm (then unseeded), each run a fresh process."""
    import torch

    from benchmarks.runner import emit

    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("bench_host --cold-start needs a CUDA device (or --smoke on the CPU)")
    # a compiled demo takes minutes on the CPU: --smoke leaves it out unless asked for
    parts = args.parts or (["layer"] if args.smoke else ["demo", "layer"])
    timeout = args.timeout or (300.0 if args.smoke else 600.0)
    rows, notes = [], []

    def write():
        if args.out is not None:  # the table so far, so a run cut short by a time limit still leaves one
            cold_start_result(rows, notes, args).write(args.out)

    if "demo" in parts:
        cmd = [sys.executable, "-m", "cp_ops", "demo", *DEMO_ARGS, *SMOKE_DEMO_ARGS * args.smoke]
        runs = {}
        for which, env in runs_and_environments(args, "demo"):
            run = stamp_output(cmd, env, timeout)
            runs[which] = {**parse_demo(run["pieces"]), "total_s": run["total_s"]}
            if run["rc"] != 0:
                notes.append(f"demo, {which}: {failure(run)}")
            print(f"demo {which}: " + ", ".join(f"{k} {v}" for k, v in runs[which].items()), flush=True)
        rows += demo_rows(runs)
        write()
    if "layer" in parts:
        for mode in ("eager", "compiled"):
            runs = {}
            for which, env in runs_and_environments(args, mode):
                figures, why = run_layer_child(mode, env, args.smoke, timeout)
                if figures is None:
                    notes.append(f"GatedDeltaNet {mode}, {which}: {why}")
                    figures = {}
                runs[which] = figures
                print(f"GatedDeltaNet {mode} {which}: " + (", ".join(f"{k} {v:.3f}" for k, v in figures.items())
                                                           or why), flush=True)  # fmt: skip
            rows += layer_rows(mode, runs)
            write()
    emit([cold_start_result(rows, notes, args)], args.out)
    if notes:
        raise SystemExit("some runs failed: " + "; ".join(notes))


def main(argv: list[str] | None = None) -> None:
    # the checked mode off in the children that time the calls (benchmarks.runner.checks_off, which
    # a child of another checkout may lack): an eager call's host time is the op's own
    os.environ["CP_OPS_CHECKS"] = "0"
    # the parent's only: the checkout comparison loads this file in a child with another checkout's packages
    from benchmarks.runner import Result, add_out_argument, emit, env_line, environment

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_out_argument(parser)
    parser.add_argument("--raw", help="also write every subprocess's figures to this JSON file")
    parser.add_argument("--ops", nargs="+", help="only these ops (names or groups: layout, attention, conv, gdn)")
    parser.add_argument("--layout-sweep", action="store_true", help="the THD layout ops against a clone, W = 2, 4, 8")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes on the CPU (--cold-start: a tiny layer, and a short demo with --parts)")
    parser.add_argument("--cold-start", action="store_true", help="the demo's and a layer's first steps, cold and warm")
    parser.add_argument("--parts", nargs="+", choices=["demo", "layer"], default=None,
                        help="--cold-start: what to run (default: both; the layer alone with --smoke)")
    parser.add_argument("--keep-autotuning", action="store_true",
                        help="--cold-start: TRITON_CACHE_AUTOTUNING=1 in the children (autotuning results kept)")
    parser.add_argument("--unseeded", action="store_true",
                        help="--cold-start: also a cold run of each part with CP_OPS_FLA_CONFIGS=0 (FLA autotunes)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="--cold-start: seconds per child run (default 600; 300 with --smoke)")
    parser.add_argument("--layer-child", choices=["eager", "compiled"], help=argparse.SUPPRESS)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.layer_child:
        print(RESULT_PREFIX + json.dumps(layer_child(args.layer_child, args.smoke)), flush=True)
        return
    if args.cold_start:
        return cold_start(args)
    if args.parts or args.keep_autotuning or args.unseeded or args.timeout:
        raise SystemExit("--parts, --keep-autotuning, --unseeded and --timeout go with --cold-start")
    if args.child:
        result = run_child(args)
        with open(args.child_out, "w") as f:
            json.dump(result, f)
        return
    env = environment()
    print(env_line(env), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        runs = {FORMS[form]: spawn(form, args, tmp) for form in FORMS}
    command = "python -m benchmarks.bench_host " + " ".join(sys.argv[1:])
    name = "host" + "-smoke" * args.smoke
    results = [Result("host", "Host time per op call, both registration forms", *table(runs, args.smoke),
                      notes=f"`{command}`", env=env, name=name)]  # fmt: skip
    if args.layout_sweep and not args.smoke:
        ops = ["seq_to_rank", "rank_to_seq", "copy_valid", "copy_valid_"]
        rows = [[form, *row] for form, run in runs.items() for row in run.get("layout_sweep", [])]
        formats = {"clone ms": "{:.3f}", **dict.fromkeys(ops, "{:.2f}x")}
        results.append(Result("host", "The four THD layout ops against a clone, both forms",
                              ["form", "shape", "W", "clone ms", *ops], rows, f"`{command}`", env,
                              name=f"{name}-layout-sweep", formats=formats))  # fmt: skip
    if args.raw:
        with open(args.raw, "w") as f:
            json.dump({"environment": env, "command": command, "runs": {"this tree": runs}}, f, indent=1)
    emit(results, args.out)


if __name__ == "__main__":
    main()
