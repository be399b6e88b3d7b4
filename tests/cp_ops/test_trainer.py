"""cp_ops.integrations.trainer: transformers' Trainer and TRL's SFTTrainer with context parallelism.

The oracle is one process: examples/sft_qwen3_next_trainer.py's tiny Qwen3-Next (float32, or
float64 where float32's rounding exceeds the tolerance: _dtype),
patched without a group and trained by the unmodified trainer class on the same packed data,
each step's batch the union of the data-parallel replicas' batches. The CP runs (gloo ranks,
a (dp, cp) mesh, DDP over the world as the Trainer sets it up) must log the same loss at every
step and end with the same weights, within 1e-5, over 5 steps with gradient accumulation 2. The
collator is checked against shard_batch on drawn packings; the refusals by their messages. The
example's benchmark options: its rows of the recipe's synthetic batches (drawn dp and gradient
accumulation) and the step log it writes at (dp 1, cp 2), its real tokens a step counted once.
Needs accelerate (the test extra); the SFTTrainer tests need TRL too (the trainer extra).
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
from pathlib import Path

import pytest
import torch
from hypothesis import given, strategies as st

pytest.importorskip("transformers")
pytest.importorskip("accelerate", reason="accelerate is not installed (pip install -e '.[test,hf]')")

from cp_ops.integrations.trainer import ContextParallelCollator, ContextParallelTrainer  # noqa: E402
from cp_ops.integrations.transformers import apply_context_parallel, shard_batch  # noqa: E402
from tests._dist import run_ranks  # noqa: E402

_SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "sft_qwen3_next_trainer.py"
_spec = importlib.util.spec_from_file_location("sft_qwen3_next_trainer", _SCRIPT)
example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)

STEPS, GRAD_ACCUM, BATCH = 5, 2, {"hf": 2, "sft": 1}  # SFT rows are TRL's packed bins of several sequences
TOL = 1e-5


def _dtype(kind: str, dp: int) -> torch.dtype:
    """float32 where its rounding stays within TOL, float64 where it does not (TRL's loss; AdamW's
    step on a gradient near zero at dp 2): docs/transformers.md gives the sizes."""
    return torch.float32 if (kind, dp) == ("hf", 1) else torch.float64


def _needs(kind: str) -> None:
    if kind == "sft":
        pytest.importorskip("trl", reason="TRL is not installed (the trainer extra: pip install -e '.[hf,trainer]')")


def _accelerate_env(rank: int, world: int) -> None:
    """What accelerate reads to join the ranks' process group (already started), one thread a rank."""
    os.environ.update(OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    if world > 1:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))


def _train_rank(rank, world, kind, cp, batch, out, save_steps, dtype):
    _accelerate_env(rank, world)
    logs, state = example.train(kind, cp, f"{out}/trainer", steps=STEPS, grad_accum=GRAD_ACCUM, batch_size=batch,
                                save_steps=save_steps, dtype=dtype)  # fmt: skip
    if rank == 0:
        torch.save({"logs": logs, "state": state}, f"{out}/result.pt")


def _train(tmp_path: Path, kind: str, world: int, cp: int, batch: int, dtype: torch.dtype, save_steps: int = 0) -> dict:
    out = tmp_path / f"{kind}-w{world}"
    out.mkdir()
    run_ranks(world, _train_rank, kind, cp, batch, str(out), save_steps, dtype)
    return torch.load(out / "result.pt")


def _check_equal(run: dict, reference: dict) -> None:
    assert len(run["logs"]) == len(reference["logs"]) == STEPS
    for key in ("loss", "grad_norm"):  # AdamW's steps hide a wrong gradient scale; the norm does not
        got, want = (torch.tensor([log[key] for log in r["logs"]]) for r in (run, reference))
        torch.testing.assert_close(got, want, rtol=0, atol=TOL, msg=lambda m: f"{key}: {m}")
    assert run["logs"][-1]["loss"] < run["logs"][0]["loss"]  # it learns
    for name, ref in reference["state"].items():
        torch.testing.assert_close(run["state"][name], ref, rtol=0, atol=TOL, msg=lambda m: f"{name}: {m}")


@pytest.mark.dist
@pytest.mark.parametrize("kind", ["hf", "sft"])
@pytest.mark.parametrize("dp", [1, pytest.param(2, marks=pytest.mark.slow)])  # dp 2: the data sharding
def test_cp_trainer_equals_one_process(tmp_path, kind, dp):
    _needs(kind)
    cp = 2
    save = STEPS if kind == "hf" and dp == 1 else 0
    run = _train(tmp_path, kind, dp * cp, cp, BATCH[kind], _dtype(kind, dp), save_steps=save)
    reference = _train(tmp_path, kind, 1, 1, BATCH[kind] * dp, _dtype(kind, dp))
    _check_equal(run, reference)
    if save:  # the checkpoint rank 0 saved is the trained model, under transformers' names
        from safetensors.torch import load_file

        saved = load_file(tmp_path / f"{kind}-w{dp * cp}" / "trainer" / f"checkpoint-{STEPS}" / "model.safetensors")
        for name, ref in reference["state"].items():
            if name in saved:
                torch.testing.assert_close(saved[name], ref, rtol=0, atol=TOL, msg=lambda m: f"{name}: {m}")
        assert "model.layers.0.linear_attn.in_proj_qkvz.weight" in saved


# --- the collator ----------------------------------------------------------------------------------


# a batch of one-token sequences only has no label, which shard_batch refuses
@given(st.lists(st.integers(1, 30), min_size=1, max_size=6).filter(lambda lens: max(lens) > 1),
       st.sampled_from([1, 2, 3, 4]), st.data())  # fmt: skip
def test_collator_shards_like_shard_batch(lengths, cp_size, data):
    from transformers import DataCollatorWithFlattening

    rank = data.draw(st.integers(0, cp_size - 1))
    gen = torch.Generator().manual_seed(sum(lengths))
    sequences = [torch.randint(1, 50, (n,), generator=gen) for n in lengths]
    features = [{"input_ids": s.tolist()} for s in sequences]
    for collator in (DataCollatorWithFlattening(), DataCollatorWithFlattening(return_flash_attn_kwargs=True)):
        got = ContextParallelCollator(collator, cp_size, rank)(features)
        if max(lengths) < 2:
            # a micro-batch without targets is legal under gradient accumulation (shard_batch refuses it)
            assert (got["shift_labels"] == -100).all() and got["labels"] is got["shift_labels"]
            continue
        want = shard_batch(sequences, cp_size, rank)
        assert torch.equal(got["input_ids"][0], want.input_ids)
        assert torch.equal(got["shift_labels"][0], want.shift_labels) and got["labels"] is got["shift_labels"]
        assert torch.equal(got["cu_seq_lens_q"], want.cu_seqlens) and got["cu_seq_lens_k"] is got["cu_seq_lens_q"]
        assert got["position_ids"].shape == got["input_ids"].shape  # TRL counts tokens by it; the model reads none


def test_collator_keeps_the_collators_labels():
    """Labels masked by the collator (a prompt, -100) stay masked after the shift; the last
    token of each sequence has no target."""

    def collator(features):
        return {"input_ids": torch.tensor([[5, 6, 7, 8, 9]]), "labels": torch.tensor([[-100, -100, 7, 8, -100]]),
                "position_ids": torch.tensor([[0, 1, 2, 3, 0]])}  # fmt: skip

    got = ContextParallelCollator(collator, 1, 0)(None)
    assert got["shift_labels"][0].tolist() == [-100, 7, 8, -100, -100, -100]  # 4 + 1 tokens, padded to 4 + 2
    assert got["cu_seq_lens_q"].tolist() == [0, 4, 5]


def test_collator_refuses_padding():
    from transformers import DataCollatorForLanguageModeling, PreTrainedTokenizerFast

    tokenizer = example.tokenizer(64)
    assert isinstance(tokenizer, PreTrainedTokenizerFast)
    features = [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}]
    with pytest.raises(ValueError, match="pads instead of packing.*DataCollatorWithFlattening"):
        ContextParallelCollator(DataCollatorForLanguageModeling(tokenizer, mlm=False), 2, 0)(features)
    with pytest.raises(ValueError, match="attention_mask"):  # one row, but a padding mask
        ContextParallelCollator(lambda f: {"input_ids": torch.ones(1, 4, dtype=torch.long),
                                           "attention_mask": torch.tensor([[1, 1, 1, 0]])}, 2, 0)(features)  # fmt: skip
    with pytest.raises(ValueError, match=r"cp_rank must be in \[0, cp_size = 2\)"):
        ContextParallelCollator(lambda f: f, 2, 2)


# --- refusals on ranks -----------------------------------------------------------------------------


def _refusals_rank(rank, world, out):
    from accelerate.parallelism_config import ParallelismConfig
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import DataCollatorWithFlattening

    _accelerate_env(rank, world)
    args = example.trainer_arguments("hf", out, STEPS, 1e-3, GRAD_ACCUM, 2, 0)
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "cp"))
    rows = example.dataset(64)
    common = dict(args=args, cp_mesh=mesh, data_collator=DataCollatorWithFlattening(), train_dataset=rows)
    with pytest.raises(ValueError, match=r"is not patched for context parallelism.*apply_context_parallel"):
        ContextParallelTrainer(model=example.build_model(), **common)
    with pytest.raises(ValueError, match="patched for CP size 1 but cp_mesh\\['cp'\\] has 2 ranks"):
        ContextParallelTrainer(model=apply_context_parallel(example.build_model()), **common)
    model = apply_context_parallel(example.build_model(), mesh["cp"])
    with pytest.raises(ValueError, match="dimensions \\('dp', 'cp'\\) or \\('cp',\\)"):
        ContextParallelTrainer(model=model, **dict(common, cp_mesh=init_device_mesh("cpu", (world,))))
    args.parallelism_config = ParallelismConfig(cp_size=2)
    with pytest.raises(ValueError, match="accelerate's own context parallelism \\(cp_size = 2\\)"):
        ContextParallelTrainer(model=model, **common)
    args.parallelism_config, args.average_tokens_across_devices = None, False
    with pytest.raises(ValueError, match="average_tokens_across_devices=False"):
        ContextParallelTrainer(model=model, **common)
    args.average_tokens_across_devices = True
    if importlib.util.find_spec("datasets") is not None:  # TRL's dependency: the trainer extra
        from datasets import IterableDataset

        # a datasets IterableDataset of several shards: accelerate splits its shards over the processes
        stream = IterableDataset.from_generator(lambda shards: (r for s in shards for r in s),
                                                gen_kwargs={"shards": [rows[:10], rows[10:]]})  # fmt: skip
        trainer = ContextParallelTrainer(model=model, **dict(common, train_dataset=stream))
        with pytest.raises(ValueError, match="is not sharded by accelerate's BatchSamplerShard or IterableDataset"):
            trainer.get_train_dataloader()
    trainer = ContextParallelTrainer(model=model, **common)  # a map-style dataset: every CP rank the same rows
    assert trainer.get_train_dataloader().batch_sampler.num_processes == 1
    assert trainer.get_total_train_batch_size(args) == 2 * GRAD_ACCUM
    trainer = ContextParallelTrainer(model=model, **dict(common, cp_mesh=init_device_mesh("cpu", (world,),
                                                                                            mesh_dim_names=("cp",))))
    assert (trainer.dp_size, trainer.cp_size, trainer.cp_rank) == (1, world, rank)
    if rank == 0:
        Path(out, "done").touch()


@pytest.mark.dist
def test_refusals(tmp_path):
    run_ranks(2, _refusals_rank, str(tmp_path))
    assert (tmp_path / "done").exists()


# --- the example's benchmark options: the recipe's batches, the step log -----------------------------


@given(st.integers(1, 3), st.integers(1, 3), st.integers(1, 4), st.integers(0, 5))
def test_packed_batches_are_the_recipes_shards(dp, grad_accum, max_seqs, extra):
    """Row ``i`` is what dp rank ``i % dp`` reads as its ``i // dp``-th micro-batch: step ``s``'s
    rows, over every rank and accumulation step, are the recipe's step ``s + 1`` shards with
    ``--batch-shards dp * grad_accum``, ``tokens`` real tokens in all."""
    from train_qwen3_next import TokenStream

    shards = dp * grad_accum
    tokens = shards * (max_seqs + 1 + extra)
    rows = example.PackedBatches(tokens, max_seqs, 64, 2, dp, grad_accum)
    recipe = TokenStream(tokens // shards, max_seqs, 64, seed=0)
    assert len(rows) == 2 * shards
    for step in range(2):
        got = [rows[(step * grad_accum + a) * dp + r]["sequences"] for r in range(dp) for a in range(grad_accum)]
        want = [[s.tolist() for s in recipe.sequences(step + 1, shard)] for shard in range(shards)]
        assert got == want
        assert sum(len(s) for row in got for s in row) == tokens
        assert all(1 <= len(row) <= max_seqs for row in got)
    with pytest.raises(ValueError, match="must split evenly into dp x grad-accum"):
        example.PackedBatches(shards * max_seqs, max_seqs, 64, 2, dp, grad_accum)  # a shard of max_seqs tokens


def _step_log_rank(rank, world, out, tokens):
    _accelerate_env(rank, world)
    example.main(["--cp", str(world), "--tokens-per-step", str(tokens), "--max-seqs", "4", "--steps", "3",
                  "--grad-accum", "1", "--out", f"{out}/trainer", "--log-json", f"{out}/log.json"])  # fmt: skip


@pytest.mark.dist
def test_step_log_at_cp_2(tmp_path):
    """--tokens-per-step and --log-json under CP: every step trains on that many real tokens
    (each CP rank sees a shard of the same sequences: counted once), and the log has the
    recipe's fields, which bench_train's summary reads."""
    from benchmarks.bench_train import summarise

    tokens = 96
    run_ranks(2, _step_log_rank, str(tmp_path), tokens)
    log = json.loads((tmp_path / "log.json").read_text())
    assert log["world"] == 2 and log["device"] == "cpu"
    assert {k: log["settings"][k] for k in ("preset", "cp", "dp", "tokens_per_step")} == {
        "preset": "tiny", "cp": 2, "dp": 1, "tokens_per_step": tokens}  # fmt: skip
    assert [s["step"] for s in log["steps"]] == [1, 2, 3]
    losses = json.loads((tmp_path / "trainer" / "losses.json").read_text())
    for step, logged in zip(log["steps"], losses):
        assert step["tokens"] == tokens
        assert step["loss"] == logged["loss"] and step["step_ms"] > 0 and step["peak_mem_gib"] > 0
        assert step["tokens_per_s"] == pytest.approx(tokens / (step["step_ms"] / 1e3))
    row = summarise(log, warmup=1)
    assert row["tokens/s"] == statistics.median(s["tokens_per_s"] for s in log["steps"][1:])
    assert row["first step s"] == log["steps"][0]["step_ms"] / 1e3
