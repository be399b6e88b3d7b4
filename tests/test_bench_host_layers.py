"""The CPU parts of benchmarks/bench_layer_host.py and benchmarks/bench_cold_start.py: the
layer-host smoke run writes its table, the profiler events are counted as the docstring
defines, and the cold-start benchmark reads a child's output as it comes and parses the
demo's real output. The smoke runs (the layer-host one compiles and profiles both layers; the
cold-start one starts fresh processes that compile from empty caches) take minutes on the CPU:
they are slow tests (make test-all); the tables' arithmetic and the parsing are tested here in
the fast tier, the layers themselves in tests/cp_ops."""

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from benchmarks import bench_cold_start as cold
from benchmarks import bench_layer_host as host
from benchmarks.runner import load

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env() -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("TRITON_INTERPRET", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    return env


def _run(module: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    run = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=_env(), capture_output=True, text=True,
                         timeout=timeout)  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    return run


# --- bench_layer_host -------------------------------------------------------------------------------


@pytest.mark.slow  # both layers compiled and profiled; the layers' compile tests are in the fast tier
def test_layer_host_smoke_writes_its_table(tmp_path):
    _run("benchmarks.bench_layer_host", "--smoke", "--out", str(tmp_path))
    result = load(tmp_path / "layer-host-smoke.json")
    assert result.columns == list(host.COLUMNS)
    rows = result.records()
    assert [(r["layer"], r["B"]) for r in rows] == [(n, b) for n in host.LAYERS for b in host.SMOKE_SEQS]
    for r in rows:
        assert r["rows"] >= host.SMOKE_TOKENS and r["lengths"].startswith("random ")
        assert r["step ms"] > 0 and r["host ms"] > 0
        assert r["host / step"] == pytest.approx(r["host ms"] / r["step ms"])
        assert r["host <= step / 4"] == ("yes" if r["host / step"] <= host.TARGET else "no")
        assert r["ops"] > 0 and r["GPU waited"] == 0
        assert r["kernels ms"] is None and r["launches"] is None and r["GPU kernels"] is None and r["copies"] is None
    assert "|---" in result.markdown() and result.env["device"]


@pytest.mark.slow  # two fresh processes that each compile a layer
def test_layer_host_rounds_write_one_table_of_the_runs(tmp_path):
    _run("benchmarks.bench_layer_host", "--smoke", "--layers", "attention", "--seqs", "2", "--rounds", "2",
         "--out", str(tmp_path))  # fmt: skip
    result = load(tmp_path / "layer-host-smoke-runs.json")
    assert result.columns == ["code", *host.COLUMNS, "host ms, each run"]
    (row,) = result.records()
    runs = [float(h) for h in row["host ms, each run"].split(", ")]
    assert len(runs) == 2 and row["host ms"] == pytest.approx(min(runs), abs=0.005)
    assert (row["layer"], row["B"]) == ("attention", 2) and "--rounds 2" in result.notes


def _table(rows, columns=tuple(host.COLUMNS)):
    return {"columns": list(columns), "rows": [[dict(r).get(c) for c in columns] for r in rows]}


def test_merge_runs_keeps_each_codes_least_host_time():
    def case(layer, b, host_ms, waited=0):
        return {"layer": layer, "B": b, "step ms": 20.0, "host ms": host_ms, "GPU waited": waited, "launches": 83.0}

    old_columns = [c for c in host.COLUMNS if c != "ops"]  # an older script's table
    runs = [
        ("old", [_table([case("gdn", 8, 9.0), case("gdn", 64, 6.0, 1)], old_columns),
                 _table([case("gdn", 64, 7.0), case("gdn", 8, 4.0)], old_columns)]),
        ("new", [_table([case("gdn", 8, 8.0)]), _table([case("gdn", 8, 5.5)])]),
    ]  # fmt: skip
    columns, rows = host.merge_runs(runs)
    records = [dict(zip(columns, r)) for r in rows]
    assert [(r["code"], r["B"], r["host ms"], r["host ms, each run"]) for r in records] == [
        ("old", 8, 4.0, "9.00, 4.00"), ("old", 64, 6.0, "6.00, 7.00"), ("new", 8, 5.5, "8.00, 5.50")
    ]  # fmt: skip
    assert records[0]["host / step"] == pytest.approx(0.2) and records[0]["host <= step / 4"] == "yes"
    assert records[2]["host <= step / 4"] == "no" and records[1]["GPU waited"] == 1
    assert records[0]["ops"] is None and records[2]["launches"] == 83.0


def _event(name, parent=None, device_type="DeviceType.CPU"):
    return SimpleNamespace(name=name, cpu_parent=parent, device_type=device_type)


def test_event_names_are_classified():
    for name in ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
                 "cudaLaunchCooperativeKernel"):  # fmt: skip
        assert host.is_launch(name), name
    for name in ("cudaMemcpyAsync", "cudaMemsetAsync", "cuMemsetD32Async", "triton_poi_fused_0", "aten::mm"):
        assert not host.is_launch(name), name
    assert host.is_copy("cudaMemcpyAsync") and host.is_copy("cudaMemsetAsync") and not host.is_copy("cudaLaunchKernel")
    assert host.is_op("aten::mm") and host.is_op("cp_ops::causal_conv1d") and host.is_op("_c10d_functional::wait")
    for name in ("autograd::engine::evaluate_function: CompiledFunctionBackward", "torch::autograd::AccumulateGrad",
                 "Torch-Compiled Region: 0/0", "## Call CompiledFxGraph f1 ##", "triton_poi_fused_mul_0",
                 "void at::native::vectorized_elementwise_kernel<4>", "cudaLaunchKernel"):  # fmt: skip
        assert not host.is_op(name), name


def test_top_level_ops_skip_ops_inside_ops():
    region = _event("Torch-Compiled Region: 0/0")
    graph = _event("## Call CompiledFxGraph f1 ##", region)
    mm = _event("aten::mm", graph)
    conv = _event("cp_ops::causal_conv1d", graph)
    inner = [_event("aten::empty", conv), _event("aten::copy_", _event("aten::_to_copy", conv))]
    node = _event("autograd::engine::evaluate_function: torch::autograd::AccumulateGrad")
    add = _event("aten::add_", _event("torch::autograd::AccumulateGrad", node))
    kernel = _event("aten::kernel_on_the_device", None, "DeviceType.CUDA")
    copy = _event("Memcpy HtoD (Pageable -> Device)", None, "DeviceType.CUDA")
    launches = [_event("cudaLaunchKernel", conv), _event("cuLaunchKernelEx", graph), _event("cudaMemcpyAsync", conv)]
    events = [region, graph, mm, conv, *inner, node, add, kernel, copy, *launches]
    assert host.top_level_ops(events) == ["aten::mm", "cp_ops::causal_conv1d", "aten::add_"]
    counts = host.event_counts(events, steps=2, cuda=True)
    assert counts == {"launches": 1.0, "GPU kernels": 0.5, "copies": 0.5, "ops": 1.5}
    assert host.event_counts(events, steps=1, cuda=False) == dict.fromkeys(["launches", "GPU kernels", "copies"]) | {
        "ops": 3}


# --- bench_cold_start ---------------------------------------------------------------------------------

# An excerpt of ``python -m cp_ops demo --cp-size 1`` on the CPU with empty caches, as
# stamp_output read it: (seconds since the process started, piece of output)
DEMO_SAMPLE = [
    (2.581, "[   0.0 s] compiling: the first run on a machine compiles for minutes (Inductor, Triton, autotuning); "
            "later runs reuse the caches and start in seconds"),
    (2.59, "[   0.0 s] training on 1 rank(s), float32; step 1 compiles"),
    (17.593, "train:   0%|          | 0/6 [00:00<?, ?step/s][  15.0 s] still compiling (15 s in this step)"),
    (47.599, "[  45.0 s] still compiling (45 s in this step)"),
    (51.293, "train:  17%|█▋        | 1/6 [00:48<04:03, 48.70s/step, loss 5.7248]"),
    (54.79, "train:  33%|███▎      | 2/6 [00:52<01:28, 22.11s/step, loss 5.2018]"),
    (68.961, "train: 100%|██████████| 6/6 [01:06<00:00, 11.06s/step, loss 3.6723]"),
    (68.962, "---------------------------------------------------------------------------------"),
    (68.962, "ranks          1"),
    (68.962, "mode           torch.compile(fullgraph=True); ops run torch references on the CPU"),
    (68.962, "tokens / step  690 real, 692 rows padded"),
    (68.962, "tokens/s       195 (real tokens of the global batch)"),
    (68.962, "step time      3534.9 ms (median after step 1)"),
    (68.962, "compile time   45.2 s (step 1 - median)"),
    (68.962, "graph breaks   0"),
    (68.962, "recompiles     0"),
    (68.962, "max rel error  n/a (W = 1: the run is the one-device run)"),
    (68.962, "peak memory    616 MiB (peak RSS)"),
]  # fmt: skip


def test_parse_demo_reads_the_demos_output():
    figures = cold.parse_demo(DEMO_SAMPLE)
    assert figures == {"to_step1_s": 51.293, "to_training_s": 2.59, "step_ms": 3534.9, "compile_s": 45.2,
                       "tokens_per_s": 195.0, "graph_breaks": 0}  # fmt: skip


def test_parse_demo_reads_the_demos_own_bar_and_missing_figures():
    pieces = [(1.0, "train [..............................] 0/12 "), (9.5, "train [##............................] 1/12 "
              "loss 5.1"), (10.0, "train [#####.........................] 11/12 loss 4.0"),
              (11.0, "step time      n/a (one step)"), (11.0, "tokens/s       12,345 (real tokens)")]  # fmt: skip
    figures = cold.parse_demo(pieces)
    assert figures["to_step1_s"] == 9.5 and figures["tokens_per_s"] == 12345.0
    assert figures["step_ms"] is None and figures["compile_s"] is None and figures["to_training_s"] is None
    assert cold.parse_demo([(3.0, "train [#####] 11/12 loss 4.0")])["to_step1_s"] is None


def test_stamper_stamps_a_redrawn_line_when_its_text_arrives():
    s = cold.Stamper()
    assert s.feed(b"[   0.0 s] training on 1 rank", 1.0) == []
    assert s.feed(b"(s)\n\rtrain:   0%| 0/6", 2.0) == [(2.0, "[   0.0 s] training on 1 rank(s)")]
    assert s.feed(b"\rtrain:  17%|\xe2\x96", 5.0) == [(2.0, "train:   0%| 0/6")]
    assert s.feed(b"\x8b| 1/6", 6.0) == []
    assert s.feed(b"\rtrain:  33%| 2/6\n", 9.0) == [(6.0, "train:  17%|▋| 1/6"), (9.0, "train:  33%| 2/6")]
    assert s.feed(b"step time      1.0 ms", 9.5) == [] and s.close() == [(9.5, "step time      1.0 ms")]


def test_stamp_output_streams_and_stops_a_run_past_its_limit():
    script = ("import sys, time\nsys.stderr.write('\\rtrain 0/2'); sys.stderr.flush(); time.sleep(0.5)\n"
              "sys.stderr.write('\\rtrain 1/2'); sys.stderr.flush(); time.sleep(0.5)\nprint('\\nstep time  2.0 ms')\n")  # fmt: skip
    run = cold.stamp_output([sys.executable, "-c", script], _env(), timeout=60)
    assert run["rc"] == 0 and [text for _, text in run["pieces"]] == ["train 0/2", "train 1/2", "step time  2.0 ms"]
    (t0, _), (t1, _), (t2, _) = run["pieces"]
    assert t0 < t1 < t2 <= run["total_s"] and t1 - t0 > 0.3
    assert cold.parse_demo(run["pieces"])["to_step1_s"] == t1
    stuck = cold.stamp_output([sys.executable, "-c", "print('up', flush=True); import time; time.sleep(60)"], _env(),
                              timeout=2)  # fmt: skip
    assert stuck["rc"] is None and stuck["total_s"] < 30 and stuck["pieces"][0][1] == "up"


def test_child_environment_has_empty_caches_and_no_kept_autotuning(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_AUTOTUNING", "1")
    env = cold.child_environment(str(tmp_path), keep_autotuning=False)
    assert "TRITON_CACHE_AUTOTUNING" not in env and env["PYTHONPATH"].split(os.pathsep)[0] == cold.ROOT
    for name in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "CUDA_CACHE_PATH"):
        assert env[name].startswith(str(tmp_path)) and os.listdir(env[name]) == []
    assert cold.child_environment(str(tmp_path), keep_autotuning=True)["TRITON_CACHE_AUTOTUNING"] == "1"


def test_cold_start_runs_cold_warm_then_unseeded():
    runs = [(which, dict(env)) for which, env in cold.runs_and_environments(SimpleNamespace(
        keep_autotuning=False, unseeded=True), "demo")]  # fmt: skip
    assert [which for which, _ in runs] == ["cold", "warm", "unseeded"]
    (_, first), (_, warm), (_, unseeded) = runs
    assert warm["TRITON_CACHE_DIR"] == first["TRITON_CACHE_DIR"] != unseeded["TRITON_CACHE_DIR"]
    assert "CP_OPS_FLA_CONFIGS" not in first and unseeded["CP_OPS_FLA_CONFIGS"] == "0"
    seeded_only = cold.runs_and_environments(SimpleNamespace(keep_autotuning=False, unseeded=False), "demo")
    assert [which for which, _ in seeded_only] == ["cold", "warm"]


def test_cold_start_rows_and_target():
    runs = {"cold": {**cold.parse_demo(DEMO_SAMPLE), "total_s": 70.6}, "warm": {"to_step1_s": 9.0}}
    rows = cold.demo_rows(runs)
    assert rows[0] == ["demo", "process start to end of step 1, s", 51.293, 9.0, None, "<= 60 s cold: yes"]
    assert cold.demo_rows({"cold": {"to_step1_s": 75.0}})[0][-1] == "<= 60 s cold: no"
    assert cold.demo_rows({})[0][2:] == [None, None, None, "<= 60 s cold: -"]
    assert cold.demo_rows({"unseeded": {"to_step1_s": 190.0}})[0][4] == 190.0
    args = SimpleNamespace(smoke=True, keep_autotuning=False)
    layer = cold.layer_rows("compiled", {"cold": {"first_step_s": 15.0}})
    result = cold.build_result(rows + layer, ["demo, warm: exited with rc=1"], args)
    assert result.name == "cold-start-smoke" and "rc=1" in result.notes and "| 51.29 | 9.00 |" in result.markdown()


@pytest.mark.slow
def test_cold_start_smoke_runs_the_demo_and_the_layer(tmp_path):
    _run("benchmarks.bench_cold_start", "--smoke", "--parts", "demo", "layer", "--out", str(tmp_path), timeout=900)
    result = load(tmp_path / "cold-start-smoke.json")
    cells = {(r["part"], r["figure"]): (r["cold"], r["warm"]) for r in result.records()}
    assert all(v is not None and v >= 0 for pair in cells.values() for v in pair), cells
    step1 = cells[("demo", "process start to end of step 1, s")]
    assert step1[0] <= cells[("demo", "process start to exit, s")][0]
    compiled = cells[("GatedDeltaNet compiled", "first fwd+bwd (compiles), s")]
    assert compiled[1] < compiled[0]  # the warm run reuses the cold run's caches
