"""examples/train_qwen3_next.py: the torchrun recipe (FSDP2 over the flattened dp x cp mesh, CP
over mesh["cp"]) trains like one process, resumes exactly, survives a crash, and refuses bad
settings clearly.

The oracle is :func:`_one_process`: the same seeded tiny model patched without CP, in this
process, no FSDP, fed every dp replica's whole batch and averaging their losses, with the same
AdamW and clipping. The recipe runs under real torchrun on 2 gloo ranks, float32, eager: the
per-step loss and gradient norm (which, unlike the loss under AdamW, shows a wrong gradient
scale at once) must agree within 1e-5, the recipe's fused loss (its default) and its unfused
one against the oracle's unfused transformers loss. Each start of ranks costs their imports: the
fast tier starts the script under torchrun once, at (dp 1, cp 2), 6 steps with rank 1 killed at
step 6; the slow tier 12 steps with a second fault (rank 0 killed while it writes a checkpoint),
then one spawn of two ranks runs the recipe's train() resumed, at (dp 2, cp 1), by chunk states
and with the unfused loss.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from benchmarks.memory_map import load_recipe
from cp_ops.integrations.transformers import apply_context_parallel, shard_batch
from tests._dist import run_ranks

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "train_qwen3_next.py"
TOL = 1e-5
STEPS = 5
FAULT_STEPS = 12  # the torchrun run: a rank killed at step 7, a crash while saving step 8
BASE = ["--preset", "tiny", "--device", "cpu", "--dtype", "fp32", "--no-progress"]
CLIP = ["--clip-grad-norm", "0.3"]  # below the (dp 2) run's gradient norms (about 0.38): clipping acts


recipe = load_recipe()


def _cfg(*argv: str, world: int = 2):
    return recipe.TrainConfig.from_args([*BASE, *argv], world)


def _torchrun_process(*argv: str, restarts: int = 0, timeout: int = 240) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", str(restarts), str(SCRIPT), *BASE, *argv]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _torchrun(tmp_path: Path, name: str, *argv: str, restarts: int = 0, timeout: int = 240) -> dict:
    log = tmp_path / f"{name}.json"
    proc = _torchrun_process("--log-json", str(log), *argv, restarts=restarts, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(log.read_text())


def _check_redone(log: dict, resumed_from: list[int]) -> None:
    """Each restart recorded in ``log`` resumed from the checkpoint given, and the steps it
    trained again match the final run bit for bit."""
    assert [r["resumed_from"] for r in log["restarts"]] == resumed_from
    final = {r["step"]: r for r in log["steps"]}
    for restart in log["restarts"]:
        assert restart["redone"] and restart["lost_s"] > 0
        for old in restart["redone"]:
            new = final[old["step"]]
            assert (old["loss"], old["grad_norm"]) == (new["loss"], new["grad_norm"]), (old, new)


def _one_process(dp: int, *argv: str, steps: int = STEPS) -> list[tuple[float, float]]:
    """(loss, gradient norm) of every step: every replica's batch in this process, averaged."""
    cfg = _cfg("--dp", str(dp), "--cp", "1", *argv, world=dp)
    config = cfg.model_config()
    model = apply_context_parallel(recipe.build_model(config, cfg.seed), None, fused_loss=cfg.loss == "fused")
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, **recipe.ADAMW)
    data = recipe.TokenStream(cfg.tokens_per_step // dp, cfg.max_seqs, config.vocab_size, cfg.seed)
    out = []
    for step in range(1, steps + 1):
        loss = sum(model(**shard_batch(data.sequences(step, d), 1, 0).model_inputs()).loss for d in range(dp)) / dp
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad_norm or math.inf)
        optimizer.step()
        optimizer.zero_grad()
        out.append((loss.item(), norm.item()))
    return out


def _check_steps(log: dict, want: list[tuple[float, float]], first: int = 1) -> None:
    got = [(r["loss"], r["grad_norm"]) for r in log["steps"]]
    assert [r["step"] for r in log["steps"]] == list(range(first, first + len(got)))
    for step, ((loss, norm), (want_loss, want_norm)) in enumerate(zip(got, want), first):
        assert abs(loss - want_loss) < TOL * abs(want_loss), (step, loss, want_loss)
        assert abs(norm - want_norm) < TOL * abs(want_norm), (step, norm, want_norm)


def _more_runs(rank: int, world: int, ckpt: str, out: str) -> None:
    """In one spawn of 2 ranks (the ranks' imports are the cost of a run): a run resumed from the
    checkpoint of step 4, a run at (dp 2, cp 1) keeping the layers' parameters unsharded from
    forward to backward, one at cp 2 with the Gated DeltaNet layers by chunk states, one at
    cp 2 with the unfused loss and one at cp 2 with the MLPs over row tiles, through the recipe's
    own train()."""
    resume = ["--cp", "2", "--steps", "5", "--checkpoint-dir", ckpt, "--resume", f"{ckpt}/step-00000004"]
    dp2 = ["--dp", "2", "--steps", str(STEPS), "--reshard-after-forward", "never", *CLIP]
    states = ["--cp", "2", "--gdn-cp", "states", "--steps", str(STEPS)]
    unfused = ["--cp", "2", "--loss", "unfused", "--steps", str(STEPS)]
    tiled = ["--cp", "2", "--tiled-mlp", "--steps", str(STEPS)]
    runs = (("resumed", resume), ("dp2", dp2), ("states", states), ("unfused", unfused), ("tiled", tiled))
    for name, argv in runs:
        recipe.train(_cfg(*argv, "--log-json", f"{out}/{name}.json"), rank, world, torch.device("cpu"))


@pytest.mark.dist
def test_recipe_resumes_a_killed_rank_exactly(tmp_path):
    """Under torchrun --max-restarts 1 with --resume auto: rank 1 killed as step 6 of 6 starts
    (a checkpoint every 3 steps), the job resumed from step 3. The 6 steps equal one process's,
    and step 4, read back before the kill and trained again after it, gives the same loss and
    gradient norm bit for bit. The two-fault run and the other meshes and modes: the slow test
    below."""
    ckpt = tmp_path / "ckpt"
    run = _torchrun(tmp_path, "cp2", "--cp", "2", "--steps", "6", "--checkpoint-dir", str(ckpt),
                    "--save-every", "3", "--resume", "auto", "--fault", "kill:6:1", restarts=1)  # fmt: skip
    _check_steps(run, _one_process(1, "--loss", "unfused", steps=6))
    assert run["resumed_from"] == 3 and run["recompiles"] == 0
    _check_redone(run, [3])
    assert [[r["step"] for r in restart["redone"]] for restart in run["restarts"]] == [[4]]
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-00000003", "step-00000006"]


@pytest.mark.slow  # three torchrun attempts and four more runs; the fast tier: the test above
@pytest.mark.dist
def test_recipe_equals_one_process_and_resumes_exactly(tmp_path):
    """Under torchrun --max-restarts 2 with --resume auto: rank 1 killed at step 7 of 12 (the
    checkpoints of steps 4 and 8 saved every 4), the job resumed from step 4; in that attempt
    rank 0 killed while the step-8 checkpoint is written (its shards are, recipe.json is not yet),
    the job resumed from step 4 again. The 12 steps equal one process's; every step trained twice
    gives the same loss and gradient norm bit for bit, the first time (step 5, the last read back
    before the kill) uninterrupted."""
    ckpt = tmp_path / "ckpt"
    run = _torchrun(tmp_path, "cp2", "--cp", "2", "--steps", str(FAULT_STEPS), "--checkpoint-dir", str(ckpt),
                    "--save-every", "4", "--resume", "auto", "--fault", "kill:7:1", "--fault", "kill-in-save:8:0:1",
                    restarts=2, timeout=480)  # fmt: skip
    one = _one_process(1, "--loss", "unfused", steps=FAULT_STEPS)
    _check_steps(run, one)  # the recipe's fused loss, all 12 steps
    assert run["resumed_from"] == 4
    _check_redone(run, [4, 4])
    assert [[r["step"] for r in restart["redone"]] for restart in run["restarts"]] == [[5], [5, 6, 7, 8]]
    assert run["num_tokens"] == 280 and run["recompiles"] == 0
    assert all(r["tokens"] == 256 and r["step_ms"] > 0 and not r["skipped"] for r in run["steps"])
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-00000004", "step-00000008", "step-00000012"]
    run_ranks(2, _more_runs, str(ckpt), str(tmp_path))
    resumed = json.loads((tmp_path / "resumed.json").read_text())
    assert resumed["resumed_from"] == 4
    _check_steps(resumed, [(r["loss"], r["grad_norm"]) for r in run["steps"][4:5]], first=5)
    _check_steps(json.loads((tmp_path / "dp2.json").read_text()), _one_process(2, *CLIP))
    _check_steps(json.loads((tmp_path / "states.json").read_text()), one)
    _check_steps(json.loads((tmp_path / "unfused.json").read_text()), one)
    _check_steps(json.loads((tmp_path / "tiled.json").read_text()), one)
    assert run["settings"]["loss"] == "fused"
    # --resume without a path takes the latest complete checkpoint; other settings are refused
    # with the command line, before any rank starts
    latest = _cfg("--cp", "2", "--checkpoint-dir", str(ckpt), "--resume")
    assert latest.resume_from == ckpt / "step-00000012"
    assert recipe.check_resume(latest.resume_from, latest) == 12
    with pytest.raises(ValueError, match=r"trained with other settings: --max-seqs 8 -> 4; --lr 0.0003 -> 0.001"):
        _cfg("--cp", "2", "--checkpoint-dir", str(ckpt), "--resume", "--lr", "1e-3", "--max-seqs", "4")


# --- faults ---------------------------------------------------------------------------------------


def _checkpoint(folder: Path, cfg) -> None:
    """A folder that passes for a complete checkpoint of ``cfg`` (its recipe.json; no shards)."""
    folder.mkdir(parents=True)
    meta = {"format": 1, "step": int(folder.name.split("-")[1].split(".")[0]), "config": cfg.resume_config()}
    (folder / "recipe.json").write_text(json.dumps(meta, default=str))


def test_resume_finds_complete_checkpoints_only(tmp_path):
    """``--resume`` resolves with the command line: a missing path is named as such, folders
    without recipe.json and partial saves are passed over, ``auto`` starts afresh without one."""
    root = tmp_path / "ckpt"
    cfg = _cfg("--checkpoint-dir", str(root))
    with pytest.raises(ValueError, match=f"--resume {tmp_path / 'nowhere'}: no such directory"):
        _cfg("--resume", str(tmp_path / "nowhere"))
    assert _cfg("--checkpoint-dir", str(root), "--resume", "auto").resume_from is None
    with pytest.raises(ValueError, match="no complete checkpoint"):
        _cfg("--checkpoint-dir", str(root), "--resume")
    for name in ("step-00000002", "step-00000004", "step-00000006.partial", "step-00000008.old", "step-10"):
        _checkpoint(root / name, cfg)
    (root / "step-00000005").mkdir()  # shards without recipe.json: a save that did not finish
    for how in ("auto", None):
        assert _cfg("--checkpoint-dir", str(root), "--resume", *([how] if how else [])).resume_from == (
            root / "step-00000004"
        )
    with pytest.raises(ValueError, match="step-00000005: not a complete checkpoint of this recipe"):
        _cfg("--resume", str(root / "step-00000005"))
    with pytest.raises(ValueError, match="--resume need --checkpoint-dir"):
        _cfg("--resume", "auto")
    # a save of a step already saved replaces it whole
    (root / "step-00000004.partial").mkdir()
    (root / "step-00000004.partial" / "new").write_text("")
    recipe.replace_folder(root / "step-00000004.partial", root / "step-00000004")
    assert sorted(p.name for p in (root / "step-00000004").iterdir()) == ["new"]
    assert not (root / "step-00000004.partial").exists() and not (root / "step-00000004.old").exists()


def test_faults_parse_and_act_in_their_attempt(monkeypatch):
    cfg = _cfg("--fault", "kill:7:1", "--fault", "kill-in-save:8:0:1")
    assert cfg.fault == (recipe.Fault("kill", 7, 1, 0), recipe.Fault("kill-in-save", 8, 0, 1))
    assert recipe.fault_here(cfg, "kill", 7, 1) and not recipe.fault_here(cfg, "kill", 7, 0)
    assert not recipe.fault_here(cfg, "kill-in-save", 8, 0)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # torchrun's first restart
    assert recipe.fault_here(cfg, "kill-in-save", 8, 0) and not recipe.fault_here(cfg, "kill", 7, 1)
    for bad in ("kill:7", "crash:7:1", "kill:x:1"):
        with pytest.raises(ValueError, match="expected KIND:STEP:RANK"):
            _cfg("--fault", bad)


def _nonfinite_runs(rank: int, world: int, out: str) -> None:
    """Rank 1's loss of step 3 made NaN: with --nonfinite skip the run goes on, saving every
    step; with stop (the default) it stops at step 3 on both ranks, before saving it."""
    run = ["--cp", "2", "--steps", "4", "--save-every", "1", "--fault", "nan:3:1", "--tokens-per-step", "64",
           "--max-seqs", "4"]  # fmt: skip
    skip = _cfg(*run, "--checkpoint-dir", f"{out}/skip", "--nonfinite", "skip", "--log-json", f"{out}/skip.json")
    recipe.train(skip, rank, world, torch.device("cpu"))
    with pytest.raises(recipe.NonFiniteStep, match=r"step 3: loss nan, gradient norm nan; its update was not "
                                                   r"applied\. The run stops \(--nonfinite skip"):  # fmt: skip
        recipe.train(_cfg(*run, "--checkpoint-dir", f"{out}/stop"), rank, world, torch.device("cpu"))


def _saved_state(folder: Path, tmp_path: Path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(folder, tmp_path / f"{folder.name}.pt")
    return torch.load(tmp_path / f"{folder.name}.pt", weights_only=False)


def _same_state(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_state(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return a == b


@pytest.mark.dist
def test_nonfinite_loss_never_updates(tmp_path):
    """A step whose loss is NaN on one rank applies no update on any rank: skipped, the model and
    the optimizer state (moments, step count) saved after it are those saved before it."""
    run_ranks(2, _nonfinite_runs, str(tmp_path))
    log = json.loads((tmp_path / "skip.json").read_text())
    assert [r["skipped"] for r in log["steps"]] == [False, False, True, False]
    assert math.isnan(log["steps"][2]["loss"]) and math.isfinite(log["steps"][3]["loss"])
    states = [_saved_state(tmp_path / "skip" / f"step-{s:08d}", tmp_path) for s in (2, 3, 4)]
    assert _same_state(states[0], states[1]) and not _same_state(states[1], states[2])
    assert sorted(p.name for p in (tmp_path / "stop").iterdir()) == ["step-00000001", "step-00000002"]


def test_bad_command_line_reported_once(monkeypatch, capsys):
    """Every rank of a torchrun job refuses the same command line; rank 0 says why, the others
    wait for torchrun to stop them and say it only if it does not (an error of their own)."""
    monkeypatch.setattr(recipe, "REFUSAL_WAIT_S", 0.0)
    for rank in (0, 1):
        for name, value in (("RANK", rank), ("WORLD_SIZE", 2), ("LOCAL_RANK", rank), ("LOCAL_WORLD_SIZE", 2)):
            monkeypatch.setenv(name, str(value))
        for argv, message in ((["--resume", "/nowhere/ckpt"], "--resume /nowhere/ckpt: no such directory"),
                              (["--presett", "tiny"], "unrecognized arguments: --presett tiny")):  # fmt: skip
            with pytest.raises(SystemExit) as exit_info:
                recipe.main([*BASE, *argv])
            err = capsys.readouterr().err
            assert exit_info.value.code == 2 and err.count("error") == 1 and "usage" not in err, err
            assert message in err and ("(rank 1)" in err) == (rank == 1), err


@pytest.mark.slow  # test_bad_command_line_reported_once covers the recipe's side in this process
def test_torchrun_reports_a_bad_command_line_once():
    proc = _torchrun_process("--resume", "/nowhere/ckpt", timeout=120)
    assert proc.returncode != 0
    assert (proc.stdout + proc.stderr).count("--resume /nowhere/ckpt: no such directory") == 1, proc.stderr
    assert "usage:" not in proc.stdout + proc.stderr


@pytest.mark.slow  # a compile of both layer kinds; the compiled recipe runs on GPUs with --cuda-graphs
def test_parameters_as_graph_inputs():
    """The --cuda-graphs form of a compiled layer (its parameters passed in as non-static graph
    inputs) computes what the eager layers do, and Inductor marks none of them static."""
    import copy
    import logging

    import cp_ops

    config = recipe.model_config("tiny", 4)
    eager = apply_context_parallel(recipe.build_model(config, 0), None)
    model = copy.deepcopy(eager)
    for layer in (model.model.layers[0], model.model.layers[-1]):  # one of each kind: GDN, attention
        layer.forward = recipe.with_parameters_as_inputs(layer, layer.forward, dict(cp_ops.COMPILE_OPTIONS))
    batch = shard_batch([torch.arange(n) % config.vocab_size for n in (13, 20, 0, 7)], 1, 0).model_inputs()
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    torch._logging.set_logs(cudagraph_static_inputs=True)
    logging.getLogger("torch._inductor.compile_fx").addHandler(handler)
    try:
        # compiled afresh, not loaded from a cache, so that Inductor logs its static inputs
        with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(
            enable_autograd_cache=False
        ):
            got = model(**batch).loss
    finally:
        torch._logging.set_logs()
        logging.getLogger("torch._inductor.compile_fx").removeHandler(handler)
    want = eager(**batch).loss
    got.backward()
    want.backward()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    for a, b in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7)
    forward_static = [r.getMessage() for r in records if "static input idxs" in r.getMessage()]
    assert forward_static and forward_static[0].endswith(": []"), forward_static


def test_cudagraph_recordings_counts_inductors_recording_events():
    """The per-step count of recorded CUDA graphs listens to Inductor's recording trigger only."""
    from torch._dynamo.callback import CallbackTrigger, callback_handler

    with recipe.cudagraph_recordings() as recordings:
        for trigger in ("CUDAGRAPH_RECORDING", "DYNAMO", "CUDAGRAPH_RECORDING"):
            with callback_handler.install_callbacks(CallbackTrigger[trigger], "0/0"):
                pass
    with callback_handler.install_callbacks(CallbackTrigger.CUDAGRAPH_RECORDING, "0/1"):
        pass  # after the block: not counted
    assert recordings() == 2


def test_static_batches_and_their_stream():
    """Every step's shard has one shape; a step's batch depends on (seed, step, dp rank) only."""
    cfg = _cfg("--cp", "2")
    data = recipe.TokenStream(256, 8, 64, seed=0)
    assert [len(s) for s in data.sequences(3, 1)] == [len(s) for s in recipe.TokenStream(256, 8, 64, 0).sequences(3, 1)]
    assert sum(map(len, data.sequences(3, 0))) == 256 and data.lengths(3, 0) != data.lengths(3, 1)
    num_tokens = 280  # 256 real tokens, at most 2W - 1 = 3 padding rows for each of 8 sequences
    assert recipe.static_num_tokens(256, cfg.max_seqs, 2) == num_tokens
    shapes = {tuple(shard_batch(data.sequences(step, 0), 2, 1, num_tokens=num_tokens, max_sequences=cfg.max_seqs)
                    .input_ids.shape) for step in range(1, 6)}  # fmt: skip
    assert shapes == {(num_tokens // 2,)}


def test_batch_shards_give_every_layout_the_same_data():
    """With --batch-shards K, dp = 1 trains on the K shards that dp = K's replicas split, in order,
    with a static maximum of the shards' sequences together; K must be a multiple of dp."""
    tokens = ("--tokens-per-step", "512")
    one = _cfg("--dp", "1", "--cp", "2", "--batch-shards", "2", *tokens)
    two = _cfg("--dp", "2", "--cp", "1", *tokens)
    assert one.tokens_per_step == two.tokens_per_step == 512 and two.batch_shards == 2
    assert list(one.replica_shards(0)) == [0, 1]
    assert [list(two.replica_shards(d)) for d in (0, 1)] == [[0], [1]]
    assert one.replica_max_seqs == 2 * one.max_seqs and two.replica_max_seqs == two.max_seqs
    with pytest.raises(ValueError, match="--batch-shards 3 must be a positive multiple of --dp 2"):
        _cfg("--dp", "2", "--cp", "1", "--batch-shards", "3")


def test_data_file(tmp_path):
    good = tmp_path / "tokens.npy"
    np.save(good, np.arange(1000, dtype=np.uint16) % 64)
    data = recipe.TokenStream(256, 8, 64, seed=0, data=str(good))
    for seq in data.sequences(1, 0):
        assert torch.equal(seq[1:], (seq[:-1] + 1) % 64)  # consecutive windows of the file
    for name, array in (("two_d.npy", np.zeros((4, 4), np.int32)), ("floats.npy", np.zeros(300, np.float32))):
        np.save(tmp_path / name, array)
        with pytest.raises(ValueError, match="expected one 1-D integer array of token ids, got shape"):
            _cfg("--data", str(tmp_path / name))
    (tmp_path / "tokens.bin").write_bytes(b"\0" * 64)
    with pytest.raises(ValueError, match="expected a .npy file"):
        _cfg("--data", str(tmp_path / "tokens.bin"))
    (tmp_path / "broken.npy").write_bytes(b"not an array")
    with pytest.raises(ValueError, match="not a readable .npy array"):
        _cfg("--data", str(tmp_path / "broken.npy"))
    np.save(tmp_path / "short.npy", np.zeros(100, np.int64))
    with pytest.raises(ValueError, match="100 tokens, fewer than one batch shard"):
        recipe.TokenStream(256, 8, 64, seed=0, data=str(tmp_path / "short.npy"))
    with pytest.raises(ValueError, match=r"100 tokens, fewer than one batch shard \(256\)"):  # with the command line
        _cfg("--data", str(tmp_path / "short.npy"), "--dp", "2", "--cp", "1")
    np.save(tmp_path / "big_ids.npy", np.full(1000, 64, np.int64))
    with pytest.raises(ValueError, match=r"token ids outside \[0, 64\)"):
        recipe.TokenStream(256, 8, 64, seed=0, data=str(tmp_path / "big_ids.npy")).sequences(1, 0)


def test_bad_settings(capsys):
    with pytest.raises(ValueError, match="--cp 3 must divide the Gated DeltaNet's 4 key and 8 value heads"):
        _cfg("--cp", "3", world=3)
    with pytest.raises(ValueError, match="--dp 2 x --cp 2 must equal the world size 2"):
        _cfg("--dp", "2", "--cp", "2")
    with pytest.raises(ValueError, match="--steps must be at least 5"):
        _cfg("--profile", "prof", "--steps", "3")
    with pytest.raises(ValueError, match="--cuda-graphs needs --compile and --device cuda"):
        _cfg("--cuda-graphs")
    with pytest.raises(ValueError, match="--save-every and --resume need --checkpoint-dir"):
        _cfg("--save-every", "2")
    with pytest.raises(ValueError, match="--vocab-size must be >= 2, got 1"):
        _cfg("--vocab-size", "1")
    with pytest.raises(ValueError, match=r"shards of more than --max-seqs 8 .* one-token sequences has no label"):
        _cfg("--tokens-per-step", "8", "--cp", "2")
    with pytest.raises(SystemExit) as exit_info:  # the command line reports it before any group starts
        recipe.main([*BASE, "--cp", "3"])
    assert exit_info.value.code == 2 and "must equal the world size 1" in capsys.readouterr().err


def test_one_flag_per_setting_and_dry_run(tmp_path):
    """Every TrainConfig field but ``resume_from`` is a flag whose default is the field's;
    --dry-run writes the checked settings (the defaults that depend on others filled in) and the
    model's configuration, and trains nothing."""
    flags = {a.dest: a.default for a in recipe.parser()._actions if a.dest != "help"}
    fields = {f.name: f.default for f in dataclasses.fields(recipe.TrainConfig) if f.name != "resume_from"}
    assert flags == dict(fields, fault=[])
    log = tmp_path / "dry.json"
    recipe.main([*BASE, "--dry-run", "--num-layers", "8", "--log-json", str(log)])
    written = json.loads(log.read_text())
    cfg = _cfg("--dry-run", "--num-layers", "8", "--log-json", str(log), world=1)
    assert written["settings"] == json.loads(json.dumps(dataclasses.asdict(cfg), default=str))
    assert written["settings"]["dp"] == 1 and written["settings"]["batch_shards"] == 1
    assert written["model"]["num_hidden_layers"] == 8 and written["model"]["vocab_size"] == 64
    assert written["world"] == 1 and "steps" not in written


def test_flop_count():
    """6 x the parameters a token passes through: for a MoE only the active experts' share."""
    for preset in recipe.PRESETS:
        config = recipe.model_config(preset, 4)
        model = recipe.build_model(config, 0, "meta")
        total = sum(p.numel() for p in model.parameters()) - model.model.embed_tokens.weight.numel()
        experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
        inactive = experts - experts * config.num_experts_per_tok // config.num_experts if config.num_experts else 0
        assert recipe.active_params(config) == total - inactive, preset
    for preset, vocab in (("tiny", 64), ("slice4", 32000), ("qwen3-next-80b", 151936)):
        assert recipe.model_config(preset, 4).vocab_size == vocab
        assert recipe.model_config(preset, 4, 151936).vocab_size == 151936
    config = recipe.model_config("slice4", 4)
    attention = 6 * 16 * 256 * (1000**2 + 24**2)  # one full-attention layer of four
    gdn = 6 * 3 * 32 * (2 * 128 * 128 + 64 * 256) * 1024
    assert math.isclose(recipe.count_flops_per_step(config, [[1000, 24]]),
                        6 * recipe.active_params(config) * 1024 + attention + gdn)  # fmt: skip
