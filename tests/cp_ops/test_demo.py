"""``python -m cp_ops demo`` (the demo, :mod:`cp_ops.demo`): the CP training step
matches one device, compiles each region once, no graph breaks.

The spawned test compiles a tiny one-block model (Inductor, fullgraph) on 2 gloo
ranks for 2 steps with a new batch each step: the same shapes, so exactly one graph
and no recompile is expected; step 1's loss and parameter gradients must match the
compiled one-device run within the float32 tolerance. A one-rank run checks the
compiled step against the eager one (``--reference eager``).

The spawned compiled run takes minutes on two CPU cores: a slow test (make test-all). The fast
tier keeps its parts: the demo's CP step on two ranks eagerly against one device (below, with a
float32 check copy of a bfloat16 run), its compiled step on one rank against the eager one,
and both layers compiled on two ranks
(tests/cp_ops/test_gdn_cp.py, test_attention.py). A run with a CP fault injected into its
ranks shows that the check, at the loose bfloat16 tolerance too, fails when CP is wrong.
"""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import cp_ops.demo
from cp_ops.demo.cli import parse_args, run
from cp_ops.demo.data import make_batch
from cp_ops.demo.model import IGNORE_INDEX
from cp_ops.demo.report import verdict
from cp_ops.demo.train import REGIONS, TOLERANCE

TINY = ["--device", "cpu", "--blocks", "1", "--hidden", "32", "--mlp", "64", "--vocab", "64",
        "--seqlens", "37,0,1,20,5", "--quiet"]  # fmt: skip


@pytest.mark.slow
@pytest.mark.dist
def test_compiled_two_ranks_match_one_device():
    res = run(TINY + ["--cp-size", "2", "--steps", "2", "--data", "fresh"])
    assert res["backend"] == "gloo" and res["ranks"] == 2 and res["compiled"]
    assert res["graph_breaks"] == 0
    assert res["compiles"] == REGIONS and res["recompiles"] == 0
    assert res["unique_graphs"] == REGIONS
    assert res["reference"] == "compiled" and res["check_skipped"] is None
    assert res["max_rel_error"] < TOLERANCE["float32"], res["errors"]
    assert set(res["errors"]) >= {"loss", "embed.weight", "blocks.0.gdn.in_proj.weight", "blocks.0.attn.q_proj.weight"}
    assert len(res["losses"]) == 2 and all(torch.isfinite(torch.tensor(res["losses"])))
    assert res["ok"] and not res["failures"]


@pytest.mark.dist
def test_eager_two_ranks_match_one_device():
    """The CP step without the compiler, training in bfloat16: step 1 of a float32 copy on 2 gloo
    ranks (--check-dtype float32) against the eager one-device run at the float32 tolerance."""
    argv = ["--cp-size", "2", "--steps", "2", "--eager", "--dtype", "bfloat16", "--check-dtype", "float32"]
    res = run(TINY + argv)
    assert res["backend"] == "gloo" and res["ranks"] == 2 and not res["compiled"]
    assert res["dtype"] == "bfloat16" and res["check_dtype"] == "float32"
    assert res["reference"] == "eager" and res["check_skipped"] is None
    assert res["max_rel_error"] < TOLERANCE["float32"], res["errors"]
    assert set(res["errors"]) >= {"loss", "embed.weight", "blocks.0.gdn.in_proj.weight", "blocks.0.attn.q_proj.weight"}
    assert len(res["losses"]) == 2 and all(torch.isfinite(torch.tensor(res["losses"])))
    assert res["ok"] and not res["failures"]


# a sitecustomize for the fault test: rank 1 of a CP group rotates q and k one position late
ROTARY_FAULT = """\
import cp_ops.attention as attention

_positions = attention.local_positions


def _one_late(cu_seqlens_padded, world, rank, rows):
    positions = _positions(cu_seqlens_padded, world, rank, rows)
    return positions + 1 if world > 1 and rank == 1 else positions


attention.local_positions = _one_late
"""


@pytest.mark.slow  # the fast tier runs the check on two ranks, passing (test_eager_two_ranks_match_one_device)
@pytest.mark.dist
def test_bfloat16_check_fails_on_rotary_positions_off_by_one(tmp_path, monkeypatch):
    """The bfloat16 tolerance sits above rounding, which moves every gradient by several percent
    at this model's initialisation; a CP fault as small as one rank's rotary positions off by
    one still fails the check. The fault is put into the spawned ranks (not the one-device
    reference, which runs as W = 1) by a sitecustomize on their PYTHONPATH."""
    (tmp_path / "sitecustomize.py").write_text(ROTARY_FAULT)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    out = tmp_path / "res.json"
    argv = [a for a in TINY if a != "--quiet"] + ["--cp-size", "2", "--steps", "1", "--eager", "--dtype", "bfloat16",
                                                   "--json", str(out)]  # fmt: skip
    proc = subprocess.run([sys.executable, "-m", "cp_ops", "demo", *argv], capture_output=True, text=True)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert proc.stdout.splitlines()[-1].startswith("FAIL: max rel error"), proc.stdout[-2000:]
    res = json.loads(out.read_text())
    assert res["check_dtype"] == "bfloat16" and res["tol"] == TOLERANCE["bfloat16"]
    assert res["max_rel_error"] > TOLERANCE["bfloat16"], res["errors"]
    assert res["worst"].startswith("blocks.0.attn.") and not res["ok"]


def test_the_last_line_says_pass_or_fail():
    base = dict(ok=True, failures=[], compiled=True, check_skipped=None, tol=1e-4)
    assert verdict(base) == "PASS: no graph break, step 1 within 0.0001 of one device"
    assert verdict({**base, "compiled": False, "check_skipped": "W = 1"}) == "PASS (nothing checked: W = 1)"
    failed = {**base, "ok": False, "failures": ["2 graph breaks", "max rel error 0.3 > tol 0.0001 (loss)"]}
    assert verdict(failed) == "FAIL: 2 graph breaks; max rel error 0.3 > tol 0.0001 (loss)"


def test_one_rank_eager_in_process():
    """W = 1 runs here, group=None; the loss falls on the memorised batch."""
    res = run(TINY + ["--cp-size", "1", "--steps", "4", "--eager", "--lr", "1e-2"])
    assert res["ranks"] == 1 and not res["compiled"] and res["compiles"] == 0
    assert res["check_skipped"] == "W = 1: the run is the one-device run" and not res["errors"]
    assert res["losses"][-1] < res["losses"][0]
    assert res["num_targets"] == 36 + 19 + 4 and res["num_real_tokens"] == 63


def _assert_compiled_float32_check(res: dict) -> None:
    assert res["tol"] == TOLERANCE["float32"]
    assert 0 < res["max_rel_error"] < TOLERANCE["float32"], res["errors"]
    assert res["compiles"] == REGIONS and res["recompiles"] == 0 and res["graph_breaks"] == 0
    assert res["ok"]


@pytest.mark.slow
def test_compiled_step_matches_eager():
    """--reference eager on one rank: the compiled step 1 (float32) against the eager one-device
    run at the float32 tolerance, each region compiled once."""
    res = run(TINY + ["--cp-size", "1", "--steps", "2", "--dtype", "float32", "--reference", "eager"])
    assert res["dtype"] == "float32" and res["check_dtype"] == "float32" and res["reference"] == "eager"
    _assert_compiled_float32_check(res)


@pytest.mark.slow
def test_float32_check_of_a_bfloat16_run():
    """--check-dtype float32: a float32 copy runs step 1 compiled (not counted as training's
    compile) and is checked against the eager one-device run at the float32 tolerance;
    training then compiles afresh and runs in bfloat16. Two compiles: the slow tier; the fast
    one covers the copy eagerly on two ranks and the compiled check in one dtype."""
    argv = ["--cp-size", "1", "--steps", "2", "--dtype", "bfloat16", "--check-dtype", "float32", "--reference", "eager"]
    res = run(TINY + argv)
    assert res["dtype"] == "bfloat16" and res["check_dtype"] == "float32" and res["reference"] == "eager"
    _assert_compiled_float32_check(res)


def test_batch_labels_and_padding():
    tokens, labels, cu, cup = make_batch([5, 0, 1, 3], 2, 50, seed=0)
    assert cup.tolist() == [0, 8, 8, 12, 16] and cu.tolist() == [0, 5, 5, 6, 9]
    assert torch.equal(labels[0:4], tokens[1:5]) and (labels[4:8] == IGNORE_INDEX).all()
    assert (labels[8:12] == IGNORE_INDEX).all()  # a one-token sequence has no target
    assert torch.equal(labels[12:14], tokens[13:15]) and (labels[14:] == IGNORE_INDEX).all()
    assert (tokens[5:8] == 0).all() and (tokens[9:12] == 0).all()  # padding rows
    # a zero-length first sequence, and the real tokens do not depend on the CP size
    tokens2, labels2, _, cup2 = make_batch([0, 5, 0, 1, 3], 1, 50, seed=0)
    assert cup2.tolist() == [0, 0, 6, 6, 8, 12]
    assert torch.equal(tokens2[:5], tokens[:5]) and torch.equal(labels2[:4], labels[:4])
    assert (labels2[4:6] == IGNORE_INDEX).all() and (labels2[6:8] == IGNORE_INDEX).all()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--cp-size", "0"], "--cp-size must be >= 1"),
        (["--cp-size", "3", "--gdn-k-heads", "2"], "must be divisible by --cp-size 3"),
        (["--gdn-k-heads", "2", "--gdn-v-heads", "3"], "must be a multiple of --gdn-k-heads 2"),
        (["--heads", "3", "--kv-heads", "2"], "must be a multiple of --kv-heads 2"),
        (["--head-dim", "15"], "must be even"),
        (["--seqlens", "4,-1"], "lengths must be >= 0"),
        (["--seqlens", "1,0,1"], "no targets"),
        (["--seqlens", "a,b"], "comma-separated integers"),
    ],
)
def test_bad_options_are_argparse_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as err:
        parse_args(["--device", "cpu"] + argv)
    assert err.value.code == 2
    assert message in capsys.readouterr().err


def test_defaults():
    args = parse_args(["--device", "cpu"])
    assert args.cp_size == 2 and args.dtype == "float32" and args.tol == TOLERANCE["float32"]
    assert args.check_dtype == "float32" and args.reference == "same"
    args = parse_args(["--device", "cpu", "--dtype", "bfloat16"])
    assert args.check_dtype == "bfloat16" and args.tol == TOLERANCE["bfloat16"]
    assert 0 in args.seqlens and 1 in args.seqlens
    assert args.gdn_k_heads % args.cp_size == 0 and args.gdn_v_heads % args.gdn_k_heads == 0
    assert parse_args(["--device", "cpu", "--cp-size", "3"]).gdn_k_heads == 3
    random_lens = parse_args(["--device", "cpu", "--num-seqs", "6", "--max-len", "40"]).seqlens
    assert len(random_lens) == 6 and random_lens[:2] == [0, 1] and max(random_lens) <= 40


def test_help_lists_options():
    out = subprocess.run([sys.executable, "-m", "cp_ops", "demo", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    for option in ("--cp-size", "--seqlens", "--steps", "--hidden", "--heads", "--dtype", "--seed", "--lr", "--eager"):
        assert option in out.stdout
    text = " ".join(out.stdout.split())
    for default in ("(default: 0)", "(default: 0.003 on cpu", "(default: 6 on cpu", "(default: 2 on cpu",
                    "(default: float32 on cpu"):
        assert default in text


def test_cp_ops_main_names_its_one_command(capsys):
    from cp_ops.__main__ import _main

    assert _main(["train"]) == 2
    assert "unknown command 'train'" in capsys.readouterr().err
    assert _main([]) == 2 and "demo" in capsys.readouterr().out


# --- the demo is an application of the public API ---------------------------------------------------

DEMO = Path(cp_ops.demo.__file__).resolve().parent
SOURCES = sorted(DEMO.glob("*.py"))


def _imports(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, None
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                yield node.lineno, node.module, alias.name


def test_demo_uses_the_public_api_only():
    import cp_ops
    import cp_ops.local_ranks
    import cp_ops.modules
    import custom_ops

    assert DEMO == Path(cp_ops.__file__).resolve().parent / "demo" and len(SOURCES) >= 4
    public = {"cp_ops": set(cp_ops.__all__), "custom_ops": set(custom_ops.__all__),
              "cp_ops.modules": set(cp_ops.modules.__all__),
              "cp_ops.local_ranks": {"init_local_rank", "leave_local_rank", "local_rendezvous"}}  # fmt: skip
    bad = []
    for path in SOURCES:
        for line, module, name in _imports(ast.parse(path.read_text(), filename=str(path))):
            if module.split(".")[0] not in ("cp_ops", "custom_ops") or module.startswith("cp_ops.demo"):
                continue
            if module not in public or (name is not None and name not in public[module]):
                bad.append(f"{path.name}:{line}: {module} {name or ''}")
    assert not bad, "the demo imports library internals:\n" + "\n".join(bad)


def test_demo_sets_no_global_compiler_config():
    """Compile options are scoped (config.patch around the compiles); nothing assigns to
    torch._inductor.config / torch._dynamo.config or sets attributes of a module."""
    bad = []
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            targets = node.targets if isinstance(node, ast.Assign) else (
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])  # fmt: skip
            for target in targets:
                text = ast.unparse(target)
                if isinstance(target, ast.Attribute) and text.startswith("torch."):
                    bad.append(f"{path.name}:{node.lineno}: {text} = ...")
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "setattr":
                if not ast.unparse(node.args[0]) == "args":  # the parsed options, a Namespace
                    bad.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    assert not bad, "\n".join(bad)


def test_demo_comments_carry_no_measurements():
    from tests.test_code_comments import DATE, MEASURE, _texts

    bad = [
        f"{path.name}:{line}: {m.group()!r}"
        for path in SOURCES
        for line, text in _texts(path)
        for m in (*DATE.finditer(text), *MEASURE.finditer(text))
    ]
    assert not bad, "measurements belong in docs/benchmarks.md:\n" + "\n".join(bad)
