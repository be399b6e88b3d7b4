"""examples/train_qwen3_next.py: the torchrun recipe (FSDP2 over the flattened dp x cp mesh, CP
over mesh["cp"]) trains like one process, resumes exactly, and refuses bad settings clearly.

The oracle is :func:`_one_process`: the same seeded tiny model patched without CP, in this
process, no FSDP, fed every dp replica's whole batch and averaging their losses, with the same
AdamW and clipping. The recipe runs under real torchrun on 2 gloo ranks, float32, eager: the
per-step loss and gradient norm (which, unlike the loss under AdamW, shows a wrong gradient
scale at once) must agree within 1e-5, the recipe's fused loss (its default) and its unfused
one against the oracle's unfused transformers loss. Each start of ranks costs their imports, so torchrun
starts the script once, at (dp 1, cp 2), saving checkpoints; one spawn of two ranks then runs
the recipe's train() resumed from step 2 and at (dp 2, cp 1).
"""

from __future__ import annotations

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
BASE = ["--preset", "tiny", "--device", "cpu", "--dtype", "fp32", "--no-progress"]
CLIP = ["--clip-grad-norm", "0.3"]  # below the (dp 2) run's gradient norms (about 0.38): clipping acts


recipe = load_recipe()


def _args(*argv: str, world: int = 2):
    args = recipe.parser().parse_args([*BASE, *argv])
    recipe.check_args(args, world)
    return args


def _torchrun(tmp_path: Path, name: str, *argv: str) -> dict:
    log = tmp_path / f"{name}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(SCRIPT),
           *BASE, "--log-json", str(log), *argv]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(log.read_text())


def _one_process(dp: int, *argv: str, steps: int = STEPS) -> list[tuple[float, float]]:
    """(loss, gradient norm) of every step: every replica's batch in this process, averaged."""
    args = _args("--dp", str(dp), "--cp", "1", *argv, world=dp)
    config = recipe.model_config(args.preset, args.num_layers, args.vocab_size)
    model = apply_context_parallel(recipe.build_model(config, args.seed), None, fused_loss=args.loss == "fused")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, **recipe.ADAMW)
    batches = recipe.Batches(args.tokens_per_step // dp, args.max_seqs, config.vocab_size, args.seed)
    out = []
    for step in range(1, steps + 1):
        loss = sum(model(**shard_batch(batches(step, d), 1, 0).model_inputs()).loss for d in range(dp)) / dp
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad_norm or math.inf)
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
    checkpoint of step 2, a run at (dp 2, cp 1) keeping the layers' parameters unsharded from
    forward to backward, one at cp 2 with the Gated DeltaNet layers by chunk states and one at
    cp 2 with the unfused loss, through the recipe's own train()."""
    resume = ["--cp", "2", "--steps", "3", "--checkpoint-dir", ckpt, "--resume", f"{ckpt}/step-00000002"]
    dp2 = ["--dp", "2", "--steps", str(STEPS), "--reshard-after-forward", "never", *CLIP]
    states = ["--cp", "2", "--gdn-cp", "states", "--steps", str(STEPS)]
    unfused = ["--cp", "2", "--loss", "unfused", "--steps", str(STEPS)]
    for name, argv in (("resumed", resume), ("dp2", dp2), ("states", states), ("unfused", unfused)):
        recipe.train(_args(*argv, "--log-json", f"{out}/{name}.json"), rank, world, torch.device("cpu"))


@pytest.mark.dist
def test_recipe_equals_one_process_and_resumes_exactly(tmp_path):
    ckpt = tmp_path / "ckpt"
    run = _torchrun(tmp_path, "cp2", "--cp", "2", "--steps", str(STEPS), "--checkpoint-dir", str(ckpt),
                    "--save-every", "2")  # fmt: skip
    one = _one_process(1, "--loss", "unfused")
    _check_steps(run, one)  # the recipe's fused loss
    assert run["num_tokens"] == 280 and run["recompiles"] == 0
    assert all(r["tokens"] == 256 and r["step_ms"] > 0 for r in run["steps"])
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-00000002", "step-00000004"]
    run_ranks(2, _more_runs, str(ckpt), str(tmp_path))
    resumed = json.loads((tmp_path / "resumed.json").read_text())
    assert resumed["resumed_from"] == 2
    _check_steps(resumed, [(r["loss"], r["grad_norm"]) for r in run["steps"][2:3]], first=3)
    _check_steps(json.loads((tmp_path / "dp2.json").read_text()), _one_process(2, *CLIP))
    _check_steps(json.loads((tmp_path / "states.json").read_text()), one)
    _check_steps(json.loads((tmp_path / "unfused.json").read_text()), one)
    assert run["settings"]["loss"] == "fused"
    # --resume without a path takes the latest complete checkpoint; other settings are refused
    latest = _args("--cp", "2", "--checkpoint-dir", str(ckpt), "--resume")
    assert recipe.find_checkpoint(latest) == ckpt / "step-00000004"
    assert recipe.check_resume(recipe.find_checkpoint(latest), latest) == 4
    other = _args("--cp", "2", "--checkpoint-dir", str(ckpt), "--resume", "--lr", "1e-3", "--max-seqs", "4")
    with pytest.raises(ValueError, match=r"trained with other settings: --max-seqs 8 -> 4; --lr 0.0003 -> 0.001"):
        recipe.check_resume(recipe.find_checkpoint(other), other)
    with pytest.raises(ValueError, match="no complete checkpoint"):
        recipe.find_checkpoint(_args("--checkpoint-dir", str(tmp_path / "empty"), "--resume"))


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
    args = _args("--cp", "2")
    batches = recipe.Batches(256, 8, 64, seed=0)
    assert [len(s) for s in batches(3, 1)] == [len(s) for s in recipe.Batches(256, 8, 64, seed=0)(3, 1)]
    assert sum(map(len, batches(3, 0))) == 256 and batches.lengths(3, 0) != batches.lengths(3, 1)
    num_tokens = 280  # 256 real tokens, at most 2W - 1 = 3 padding rows for each of 8 sequences
    assert recipe.static_num_tokens(256, args.max_seqs, 2) == num_tokens
    shapes = {tuple(shard_batch(batches(step, 0), 2, 1, num_tokens=num_tokens, max_sequences=args.max_seqs)
                    .input_ids.shape) for step in range(1, 6)}  # fmt: skip
    assert shapes == {(num_tokens // 2,)}


def test_batch_shards_give_every_layout_the_same_data():
    """With --batch-shards K, dp = 1 trains on the K shards that dp = K's replicas split, in order,
    with a static maximum of the shards' sequences together; K must be a multiple of dp."""
    tokens = ("--tokens-per-step", "512")
    one = _args("--dp", "1", "--cp", "2", "--batch-shards", "2", *tokens)
    two = _args("--dp", "2", "--cp", "1", *tokens)
    assert one.tokens_per_step == two.tokens_per_step == 512 and two.batch_shards == 2
    assert list(recipe.replica_shards(one, 0)) == [0, 1]
    assert [list(recipe.replica_shards(two, d)) for d in (0, 1)] == [[0], [1]]
    assert recipe.replica_max_seqs(one) == 2 * one.max_seqs and recipe.replica_max_seqs(two) == two.max_seqs
    with pytest.raises(ValueError, match="--batch-shards 3 must be a positive multiple of --dp 2"):
        _args("--dp", "2", "--cp", "1", "--batch-shards", "3")


def test_data_file(tmp_path):
    good = tmp_path / "tokens.npy"
    np.save(good, np.arange(1000, dtype=np.uint16) % 64)
    batches = recipe.Batches(256, 8, 64, seed=0, data=str(good))
    for seq in batches(1, 0):
        assert torch.equal(seq[1:], (seq[:-1] + 1) % 64)  # consecutive windows of the file
    for name, array in (("two_d.npy", np.zeros((4, 4), np.int32)), ("floats.npy", np.zeros(300, np.float32))):
        np.save(tmp_path / name, array)
        with pytest.raises(ValueError, match="expected one 1-D integer array of token ids, got shape"):
            _args("--data", str(tmp_path / name))
    (tmp_path / "tokens.bin").write_bytes(b"\0" * 64)
    with pytest.raises(ValueError, match="expected a .npy file"):
        _args("--data", str(tmp_path / "tokens.bin"))
    (tmp_path / "broken.npy").write_bytes(b"not an array")
    with pytest.raises(ValueError, match="not a readable .npy array"):
        _args("--data", str(tmp_path / "broken.npy"))
    np.save(tmp_path / "short.npy", np.zeros(100, np.int64))
    with pytest.raises(ValueError, match="100 tokens, fewer than one batch shard"):
        recipe.Batches(256, 8, 64, seed=0, data=str(tmp_path / "short.npy"))
    np.save(tmp_path / "big_ids.npy", np.full(1000, 64, np.int64))
    with pytest.raises(ValueError, match=r"token ids outside \[0, 64\)"):
        recipe.Batches(256, 8, 64, seed=0, data=str(tmp_path / "big_ids.npy"))(1, 0)


def test_bad_settings(capsys):
    with pytest.raises(ValueError, match="--cp 3 must divide the Gated DeltaNet's 4 key and 8 value heads"):
        _args("--cp", "3", world=3)
    with pytest.raises(ValueError, match="--dp 2 x --cp 2 must equal the world size 2"):
        _args("--dp", "2", "--cp", "2")
    with pytest.raises(ValueError, match="--steps must be at least 5"):
        _args("--profile", "prof", "--steps", "3")
    with pytest.raises(ValueError, match="--cuda-graphs needs --compile and --device cuda"):
        _args("--cuda-graphs")
    with pytest.raises(ValueError, match="--save-every and --resume need --checkpoint-dir"):
        _args("--save-every", "2")
    with pytest.raises(ValueError, match="--vocab-size must be >= 2, got 1"):
        _args("--vocab-size", "1")
    with pytest.raises(SystemExit) as exit_info:  # the command line reports it before any group starts
        recipe.main([*BASE, "--cp", "3"])
    assert exit_info.value.code == 2 and "must equal the world size 1" in capsys.readouterr().err


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
