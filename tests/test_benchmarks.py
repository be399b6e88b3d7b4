"""The benchmarks' CPU parts: results as JSON and their markdown, the docs rendered from them,
and benchmarks/compare_checkouts.py's arguments, ratios, flags and children's imports."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import compare_checkouts as cc
from benchmarks import report
from benchmarks.runner import RESULTS_DIR, Result, env_line, load, load_all, markdown_table

ROOT = Path(__file__).resolve().parent.parent


def _result(**kw):
    base = dict(benchmark="demo", title="A table", columns=["case", "W", "ms", "ratio"],
                rows=[["a", 2, 0.1234, 1.5], ["b", 4, None, 2.0]], notes="times in ms",
                env={"device": "GPU", "torch": "2.11", "triton": "3.6", "cuda": "13.0", "date": "2026-01-01"},
                formats={"W": "{:d}", "ratio": "{:.2f}x"})  # fmt: skip
    return Result(**{**base, **kw})


# --- results -------------------------------------------------------------------------------------


def test_result_round_trips_through_its_file(tmp_path):
    r = _result(name="demo-w2")
    path = r.write(tmp_path)
    assert path == tmp_path / "demo-w2.json"
    back = load(path)
    assert back.to_dict() == r.to_dict()
    assert back.formats == [None, "{:d}", None, "{:.2f}x"]
    d = json.loads(path.read_text())
    assert set(d) >= {"benchmark", "title", "env", "columns", "rows", "notes"}
    assert load_all(tmp_path) == {"demo-w2": back}


def test_result_markdown_formats_cells():
    text = _result().markdown()
    lines = text.splitlines()
    assert lines[0] == "GPU, torch 2.11, triton 3.6, CUDA 13.0, 2026-01-01"
    assert lines[1] == "times in ms"
    assert "| a | 2 | 0.123 | 1.50x |" in lines and "| b | 4 | - | 2.00x |" in lines
    assert _result().markdown(head=False).startswith("| case | W | ms | ratio |\n|---|---|---|---|")
    assert markdown_table(["", "x"], [["", "1"]]) == "| | x |\n|---|---|\n| | 1 |"


def test_result_refuses_ragged_rows_and_unknown_format_columns():
    with pytest.raises(ValueError, match="rows"):
        _result(rows=[["a", 1]])
    with pytest.raises(ValueError, match="formats"):
        _result(formats={"nope": "{}"})


def test_env_line_with_ranks_and_stated_line():
    env = {"device": "H200", "torch": "2.11", "triton": "3.7", "cuda": "13.0", "date": "d", "commit": "abc",
           "ranks": 2, "backend": "nccl", "gpus": 8}  # fmt: skip
    assert env_line(env) == "H200, torch 2.11, triton 3.7, CUDA 13.0, d, commit abc; W = 2 ranks (NCCL), 8 GPU(s) visible"
    assert env_line({**env, "stated": "as the document said"}) == "as the document said"


def test_runner_environment_names_this_checkout():
    from benchmarks.runner import environment

    env = environment(fla="x")
    assert env["torch"] and env["triton"] and env["date"] and env["fla"] == "x"
    assert env["commit"] is None or len(env["commit"].split("+")[0]) >= 7


# --- the document rendered from the results -------------------------------------------------------


def test_report_renders_marked_sections_only():
    r = _result(name="demo")
    text = "prose\n<!-- results:demo -->\nold\n<!-- /results:demo -->\nmore\n<!-- results:demo table -->\n<!-- /results:demo -->\n"
    new, missing = report.render(text, {"demo": r})
    assert not missing
    assert new.startswith("prose\n<!-- results:demo -->\nGPU, torch 2.11")
    assert "more\n<!-- results:demo table -->\n| case | W | ms | ratio |" in new
    assert report.render(new, {"demo": r})[0] == new
    assert report.render(text, {})[1] == ["demo", "demo"]


def test_report_leaves_an_optional_section_empty_until_its_result_exists():
    text = "<!-- results:demo optional -->\n<!-- /results:demo -->\n"
    assert report.render(text, {}) == (text, [])
    new, missing = report.render(text, {"demo": _result(name="demo")})
    assert not missing and "| case | W | ms | ratio |" in new and new.startswith("<!-- results:demo optional -->")


def test_report_check_exit_codes(tmp_path):
    results = tmp_path / "results"
    _result(name="demo").write(results)
    doc = tmp_path / "doc.md"
    doc.write_text("<!-- results:demo -->\n<!-- /results:demo -->\n")
    assert report.main(["--results", str(results), "--doc", str(doc), "--check"]) == 1
    assert report.main(["--results", str(results), "--doc", str(doc)]) == 0
    assert report.main(["--results", str(results), "--doc", str(doc), "--check"]) == 0
    doc.write_text(doc.read_text() + "<!-- results:absent -->\n<!-- /results:absent -->\n")
    assert report.main(["--results", str(results), "--doc", str(doc), "--check"]) == 1


def test_docs_benchmarks_md_is_rendered_from_the_results():
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    new, missing = report.render(text, load_all(RESULTS_DIR))
    assert not missing, f"sections without a result: {missing}"
    assert new == text, "docs/benchmarks.md is stale: run python -m benchmarks.report"


# --- compare_checkouts ----------------------------------------------------------------------------


def test_compare_arguments(tmp_path):
    args = cc.parse_args([str(ROOT), str(ROOT)])
    assert args.suites == ["attention", "layout", "gdn"] and args.rounds == 3 and args.threshold == 0.02
    args = cc.parse_args([str(ROOT), str(ROOT), "--suites", "layout", "--rounds", "5", "--out", str(tmp_path)])
    assert args.suites == ["layout"] and args.rounds == 5 and args.out == str(tmp_path)
    with pytest.raises(SystemExit):
        cc.parse_args([str(tmp_path), str(ROOT)])  # not a checkout
    with pytest.raises(SystemExit):
        cc.parse_args([str(ROOT), str(ROOT), "--suites", "nope"])
    assert cc.parse_args([str(ROOT), str(ROOT), "--suites", "host"]).suites == ["host"]


def test_compare_ratio_and_flag():
    assert cc.compare([1.0, 1.1, 0.9], [1.0, 1.02, 1.01]) == (1.0, 1.01, pytest.approx(1.01), False)
    mb, mn, ratio, slower = cc.compare([1.0, 1.0, 1.0], [1.03, 1.05, 1.02])
    assert ratio == pytest.approx(1.03) and slower
    assert cc.compare([1.0], [1.021])[3] and not cc.compare([1.0], [1.02])[3]
    assert not cc.compare([1.0], [0.5])[3]  # faster is never flagged
    assert cc.compare([1.0], [1.5], threshold=0.6)[3] is False
    assert cc.compare([None, None], [1.0]) == (None, 1.0, None, False)  # a kernel the base lacks


def test_compare_reads_failed_suites():
    out = 'RESULT {"suite": "layout", "case": {}, "metric": "m", "ms": 1.0}\nFAILED {"suite": "gdn"}\n'
    assert cc.tagged(out, "FAILED") == [{"suite": "gdn"}] and len(cc.tagged(out, "RESULT")) == 1


def test_git_commit_only_of_a_checkout_top(tmp_path):
    from benchmarks.runner import git_commit

    assert git_commit(tmp_path) is None
    assert git_commit(ROOT / "benchmarks") is None  # a folder inside the checkout is not a checkout


def test_compare_rounds_alternate():
    assert [cc.round_order(r) for r in range(4)] == [(0, 1), (1, 0), (0, 1), (1, 0)]


def test_compare_tables_and_flags():
    out = "\n".join([
        "noise",
        'RESULT {"suite": "layout", "case": {"shape": "s", "W": 2}, "metric": "seq_to_rank", "ms": 1.0}',
        'RESULT {"suite": "layout", "case": {"shape": "s", "W": 2}, "metric": "copy_valid", "ms": 2.0}',
    ])  # fmt: skip
    times: dict = {}
    cc.collect(cc.tagged(out, "RESULT"), times, 0)
    cc.collect(cc.tagged(out.replace('"ms": 2.0', '"ms": 2.2'), "RESULT"), times, 1)
    results = cc.tables(times, 0.02, {"base": "b", "new": "n"}, rounds=1)
    assert [r.name for r in results] == ["compare-layout"]
    r = results[0]
    assert r.columns == ["shape", "W", "metric", "base ms", "new ms", "new / base", "flag"]
    assert r.rows[0] == ["s", 2, "seq_to_rank", 1.0, 1.0, 1.0, ""]
    assert r.rows[1][:6] == ["s", 2, "copy_valid", 2.0, 2.2, pytest.approx(1.1)] and r.rows[1][6]
    assert cc.flagged(results) == ["compare-layout: s, 2, copy_valid (1.100)"]
    assert "| s | 2 | copy_valid | 2.000 | 2.200 | 1.100 | slower by > 2% |" in r.markdown()


def _fake_checkout(root: Path) -> Path:
    for pkg in ("cp_ops", "custom_ops"):
        (root / pkg).mkdir(parents=True)
        (root / pkg / "__init__.py").write_text("")
    return root


def _child(checkout: Path, env_checkout: Path, cwd: Path):
    cmd = cc.child_command(str(checkout), ["layout"]) + ["--imports-only"]
    env = cc.child_env(str(env_checkout))
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=300)


def test_compare_children_import_the_library_of_their_checkout(tmp_path):
    fake = _fake_checkout(tmp_path / "checkout")
    run = _child(fake, fake, fake)
    assert run.returncode == 0, run.stderr[-3000:]
    [files] = cc.tagged(run.stdout, "IMPORTS")
    assert {k: Path(v).resolve() for k, v in files.items()} == {
        "cp_ops": (fake / "cp_ops" / "__init__.py").resolve(),
        "custom_ops": (fake / "custom_ops" / "__init__.py").resolve(),
    }
    # run from this repository's root, the child still takes the checkout's library
    assert _child(fake, fake, ROOT).returncode == 0


def test_compare_children_refuse_a_library_from_elsewhere(tmp_path):
    fake = _fake_checkout(tmp_path / "checkout")
    other = _fake_checkout(tmp_path / "other")
    run = _child(other, fake, fake)
    assert run.returncode != 0 and "not from the checkout" in run.stderr


@pytest.mark.slow  # a child importing the whole library; the fake checkouts' children stay in the fast tier
def test_compare_child_imports_this_repository_when_asked():
    run = _child(ROOT, ROOT, ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    [files] = cc.tagged(run.stdout, "IMPORTS")
    assert all(Path(f).resolve().is_relative_to(ROOT) for f in files.values()), files


def test_compare_child_finds_a_module_at_either_checkout_s_path():
    from benchmarks.checkout_cases import moved_module
    from custom_ops.thd import validation

    # this checkout's path first; an older checkout's path for the same module after it
    assert moved_module("custom_ops.thd.validation", "custom_ops.runtime.validation") is validation
    assert moved_module("custom_ops.runtime.validation", "custom_ops.thd.validation") is validation
    with pytest.raises(ModuleNotFoundError, match="none of"):
        moved_module("custom_ops.runtime.validation", "custom_ops.varlen_attention.launch")


# --- gpu_suite ------------------------------------------------------------------------------------


def test_gpu_suite_parts_find_the_library_and_the_demo_in_the_checkout(tmp_path):
    from benchmarks import gpu_suite

    path = gpu_suite.child_pythonpath("/elsewhere")
    assert path.split(os.pathsep) == [gpu_suite.ROOT, "/elsewhere"]
    # -I: no site-packages and no environment, so only the checkout's folders can serve the modules
    code = (f"import sys, importlib.util as u; sys.path[:0] = {path.split(os.pathsep)!r}; "
            "print(u.find_spec('cp_ops').origin, u.find_spec('cp_ops.demo').origin)")  # fmt: skip
    out = subprocess.run([sys.executable, "-I", "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    library, demo = out.stdout.split()
    assert library == os.path.join(gpu_suite.ROOT, "cp_ops", "__init__.py")
    assert demo == os.path.join(gpu_suite.ROOT, "cp_ops", "demo", "__init__.py")


def test_gpu_suite_quick_appends_options_its_parts_take():
    from benchmarks import gpu_suite

    root = Path(gpu_suite.ROOT)
    for part, extra in gpu_suite.QUICK_ARGS.items():
        full = gpu_suite.part_command(part, "/out", 2, f"{part}-w2")
        quick = gpu_suite.part_command(part, "/out", 2, f"{part}-w2", quick=True)
        assert gpu_suite.PARTS[part][0] >= 2 and quick == full + extra, part
        module = full[full.index("-m") + 1]
        if module == "cp_ops":  # python -m cp_ops demo: the demo application's options
            source = root / "cp_ops" / "demo" / "cli.py"
        else:
            source = root / (module.replace(".", "/") + ".py")
        text = source.read_text()
        for option in (a for a in extra if a.startswith("--")):
            assert f'"{option}"' in text, f"{part}: {source.name} has no {option}"
    assert gpu_suite.part_command("a2a", "/out", 4, "a2a-w4", quick=True) == gpu_suite.part_command(
        "a2a", "/out", 4, "a2a-w4")


def test_gpu_suite_demo_parts_keep_the_demos_results():
    """The demo parts write the demo's results (each parameter's step-1 error among them) beside
    the other parts' results, the options parsed by the demo itself."""
    from benchmarks import gpu_suite
    from cp_ops.demo.cli import build_parser

    for part, world in (("demo", None), ("demo-cp", 2)):
        name = part if world is None else f"{part}-w{world}"
        command = gpu_suite.part_command(part, "/out", world, name)
        args = build_parser().parse_args(command[command.index("demo") + 1 :])
        assert args.json == f"/out/{name}.json" and args.cp_size == (world or 1), part


def test_gpu_suite_parts_run_existing_benchmark_modules():
    from benchmarks import gpu_suite

    for part, (_, template) in gpu_suite.PARTS.items():
        module = gpu_suite._module_file(template)
        if module is not None:
            assert (ROOT / module).is_file(), (part, module)
        assert "{out}" in " ".join(template) or not module or "tune" in template, part
    assert gpu_suite.runs_of("a2a", [2, 4], 8) == [("a2a-w2", 2, 2), ("a2a-w4", 4, 4)]
    assert gpu_suite.runs_of("layout", None, 0) == [("layout", 1, None)]
    # {world} inside an argument ("-k W{world}") makes a part multi-rank too
    assert gpu_suite.runs_of("tests-dist", [2], 4) == [("tests-dist-w2", 2, 2)]
    assert gpu_suite.runs_of("tests-dist", None, 4) == [("tests-dist-w2", 2, 2), ("tests-dist-w4", 4, 4)]
    assert gpu_suite.runs_of("train-curves", [2], 4) == [("train-curves", 4, None)]


def test_compare_children_keep_other_packages_on_the_path(tmp_path, monkeypatch):
    other = _fake_checkout(tmp_path / "other")
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), str(other)]))
    checkout = tmp_path / "checkout"
    path = cc.child_env(str(checkout))["PYTHONPATH"].split(os.pathsep)
    assert path == [str(checkout.resolve()), str(site)]


# --- bench_train ----------------------------------------------------------------------------------


def test_bench_train_reads_the_recipes_settings_from_a_dry_run(tmp_path):
    """bench_train learns the recipe's model from a ``--dry-run`` process (its --log-json), not by
    importing it."""
    from benchmarks import bench_train

    got = bench_train.dry_run(["--preset", "slice4", "--vocab-size", "1000"], tmp_path / "dry.json")
    assert got["model"]["vocab_size"] == 1000 and got["settings"]["tokens_per_step"] == 32768


def _train_log(losses, recordings, lengths):
    steps = [{"step": i + 1, "loss": loss, "step_ms": 100.0 + i, "cudagraph_recordings": r, "lengths": [n]}
             for i, (loss, r, n) in enumerate(zip(losses, recordings, lengths))]  # fmt: skip
    return {"world": 2, "num_tokens": 24, "settings": {"tokens_per_step": 40}, "recompiles": 0,
            "cudagraph_skips": 0, "steps": steps}  # fmt: skip


def test_replay_result_pairs_the_runs_steps():
    from benchmarks.bench_train import replay_result

    lengths = [[30, 10, 0], [40, 0, 0], [30, 10, 0]]
    graphs = _train_log([3.0, 2.5, 2.0], [0, 8, 0], lengths)
    eager = _train_log([3.0, 2.5, 2.25], [0, 0, 0], lengths)
    r = replay_result(graphs, eager, "tiny", {"device": "cpu"})
    assert r.name == "train-replay-tiny-w2"
    col = {c: [row[i] for row in r.rows] for i, c in enumerate(r.columns)}
    assert col["sequences"] == [2, 1, 2] and col["graphs recorded"] == [0, 8, 0]
    assert col["difference"] == [0.0, 0.0, -0.25]
    assert "2 distinct packings" in r.notes
    with pytest.raises(SystemExit, match="failed"):
        replay_result(graphs, None, "tiny", {})


def test_scaling_table_is_written_after_every_group(tmp_path, monkeypatch):
    """A bench_train invocation cut short (here: its second group of runs fails) leaves the rows of
    the groups that finished in its result file, with their scaling against W = 1."""
    from benchmarks import bench_train

    def run_one(world, tokens, graphs, args, tmp, backend=None):
        if graphs:
            raise RuntimeError("cut short")
        return {"tokens": tokens, "graphs": "off", "W": world, "dp": 1, "cp": world, "step ms": 100.0 / world ** 0.5,
                "status": "ok"}  # fmt: skip

    monkeypatch.setattr(bench_train, "run_one", run_one)
    with pytest.raises(RuntimeError, match="cut short"):
        bench_train.main(["--worlds", "1,4", "--tokens", "1024", "--graphs", "both", "--out", str(tmp_path)])
    written = json.loads((tmp_path / "train-slice4.json").read_text())
    col = {c: [row[i] for row in written["rows"]] for i, c in enumerate(written["columns"])}
    assert col["W"] == [1, 4] and col["graphs"] == ["off", "off"]
    assert col["scaling"] == [1.0, 0.5]


def test_each_backend_scales_against_its_own_one_gpu_run(tmp_path, monkeypatch):
    """bench_train --backends: every run once with each GDN core backend, the backend named in
    its row, scaling against the one-GPU run of the same backend."""
    from benchmarks import bench_train

    def run_one(world, tokens, graphs, args, tmp, backend=None):
        step = {"fla": 200.0, "flashqla": 100.0}[backend] / world**0.5
        return {"tokens": tokens, "graphs": "off", "GDN core": backend, "W": world, "dp": 1, "cp": world,
                "step ms": step, "status": "ok"}  # fmt: skip

    monkeypatch.setattr(bench_train, "run_one", run_one)
    bench_train.main(["--worlds", "1,4", "--tokens", "1024", "--graphs", "off", "--backends", "fla,flashqla",
                      "--out", str(tmp_path)])  # fmt: skip
    written = json.loads((tmp_path / "train-slice4.json").read_text())
    col = {c: [row[i] for row in written["rows"]] for i, c in enumerate(written["columns"])}
    assert col["GDN core"] == ["fla", "fla", "flashqla", "flashqla"]
    assert col["scaling"] == [1.0, 0.5, 1.0, 0.5]


def test_profile_summary_reads_every_ranks_timeline(tmp_path):
    """bench_train --profile: rank 0's figures per step from the recipe's kernel timelines, the
    most idle and collective-only time of any rank and the time ranks wait in collectives for a
    peer; a run without a device timeline has none."""
    from benchmarks import bench_train

    # two steps: rank 0 runs a GEMM 0-4 ms and an all-gather 3-6 ms, then idles to 10; rank 1
    # runs its all-gather alone 0-8 ms
    timelines = {0: [["ampere_gemm", 0, 4000], ["ncclDevKernel_AllGather", 3000, 6000], ["triton_poi_x", 9000, 10000]],
                 1: [["ncclDevKernel_AllGather", 0, 8000], ["triton_poi_x", 9000, 10000]]}  # fmt: skip
    for rank, kernels in timelines.items():
        (tmp_path / f"rank{rank}.kernels.json").write_text(json.dumps({"steps": 2, "kernels": kernels}))
    (tmp_path / "rank0.txt").write_text("op tables")
    got = bench_train.profile_summary(tmp_path)
    assert set(got) == set(bench_train.PROFILE_FIGURES)
    assert got["wall"] == 5.0 and got["GPU busy"] == 3.5 and got["idle"] == 1.5
    assert got["collectives only"] == 1.0 and got["GEMMs"] == 2.0 and got["collectives"] == 1.5
    assert got["idle, most of any rank"] == 1.5 and got["collectives only, most of any rank"] == 4.0
    # rank 1's all-gather lasts 5 ms longer than rank 0's: waiting for rank 0 to join
    assert got["collective wait"] == 0.0 and got["collective wait, most of any rank"] == 2.5
    args = bench_train.argparse.Namespace(preset="tiny", profile=True)
    rows = [{"tokens": 64, "graphs": "off", "W": 2, "profile": got}, {"tokens": 64, "graphs": "off", "W": 1}]
    table = bench_train.profile_result(args, rows, {})
    assert table.name == "train-tiny-profile" and [r[:3] for r in table.rows] == [[64, "off", 2]]
    # ranks that ran different collectives are not matched
    (tmp_path / "rank1.kernels.json").write_text(json.dumps({"steps": 2, "kernels": [["ncclDevKernel_SendRecv", 0, 9]]}))
    got = bench_train.profile_summary(tmp_path)
    assert got["collective wait"] is None and got["collective wait, most of any rank"] is None
    empty = tmp_path / "cpu"
    empty.mkdir()
    (empty / "rank0.kernels.json").write_text(json.dumps({"steps": 2, "kernels": []}))
    assert bench_train.profile_summary(empty) == {}


# --- bench_loss -----------------------------------------------------------------------------------


def test_bench_loss_smoke_writes_its_table(tmp_path):
    """bench_loss --smoke on the CPU: the unfused loss and ours run and agree, the GPU-only
    libraries are rows that say why they were skipped, the table is written."""
    from benchmarks import bench_loss
    from benchmarks.runner import load

    (result,) = bench_loss.main(["--smoke", "--out", str(tmp_path)])
    assert load(tmp_path / "loss-smoke.json").rows == result.rows
    rows = {r["loss"]: r for r in result.records()}
    assert rows["unfused"]["status"] == rows["ours, chunks of 24"]["status"] == "ok"
    assert rows["ours, chunks of 24"]["rel diff vs unfused"] < 1e-5 and rows["ours, chunks of 24"]["time vs ours"] == 1
    assert {rows[name]["status"] for name in ("liger", "cce", "cce exact")} == {"skipped: needs a GPU (Triton kernels)"}
    assert set(result.env) >= {"liger-kernel", "cut-cross-entropy", "device", "date"}
