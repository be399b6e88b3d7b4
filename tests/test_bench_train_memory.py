"""bench_train --fit-context and --memory on the CPU: the search for the longest sequence against
stub trials, its table from stub runs of the recipe; the memory probe's phases and sizes on a toy
model whose forward and backward "allocate" on a stub counter, the map's text and table; the
probe on the recipe's own steps (tiny preset, one gloo rank), where the phases and the counted
sizes come out."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from benchmarks import bench_train
from benchmarks.memory_map import GIB, MemoryProbe, format_reports, load_recipe, local_bytes, measure
from tests._dist import run_ranks


def _fits_up_to(longest: int, tried: list[int]):
    def trial(length: int) -> str:
        tried.append(length)
        return "ok" if length <= longest else "out of memory"

    return trial


@pytest.mark.parametrize(
    "longest, start, limit, want",
    [
        (300_000, 262_144, 2**22, 294_912),  # doubling past it, then bisection
        (100_000, 262_144, 2**22, 98_304),  # the start fails: halving first
        (10**9, 262_144, 1_048_576, 1_048_576),  # everything fits: the limit
        (1_000, 262_144, 2**22, None),  # nothing fits
        (262_144, 262_144, 2**22, 262_144),  # exactly the start
    ],
)
def test_longest_fit(longest, start, limit, want):
    tried = []
    best, attempts = bench_train.longest_fit(_fits_up_to(longest, tried), start, 16_384, limit)
    assert best == want and [n for n, _ in attempts] == tried
    assert len(set(tried)) == len(tried) and all(n % 16_384 == 0 and 0 < n <= limit for n in tried)
    assert all((status == "ok") == (n <= longest) for n, status in attempts)


def test_longest_fit_refuses_a_start_off_the_grid():
    with pytest.raises(ValueError, match="multiple of granularity"):
        bench_train.longest_fit(lambda n: "ok", 100, 64, 1000)


def _recipe_stub(calls, stop_after=None):
    """A stand-in for bench_train's torchrun: W x 300000 tokens fit, more run out of memory; the
    call after ``stop_after`` calls raises, as a run stopped by a time limit ends."""

    def torchrun(world, recipe_args, timeout, entry=None):
        if stop_after is not None and len(calls) == stop_after:
            raise KeyboardInterrupt
        tokens = int(recipe_args[recipe_args.index("--tokens-per-step") + 1])
        calls.append((world, tokens, "--ac" in recipe_args, recipe_args[recipe_args.index("--max-seqs") + 1],
                      recipe_args))  # fmt: skip
        if tokens > 300_000 * world:
            return "out of memory"
        step = {"step_ms": tokens / 1e3, "tokens_per_s": 1e6, "mfu": 0.4, "peak_mem_gib": 100.0}
        log = {"steps": [dict(step, step_ms=9e4)] + [step] * 2, "recompiles": 0}
        Path(recipe_args[recipe_args.index("--log-json") + 1]).write_text(json.dumps(log))
        return "ok"

    return torchrun


FIT_ARGS = ["--fit-context", "1,2", "--vocab-size", "151936", "--fit-start", "131072", "--fit-granularity", "32768"]


def _fit_rows(path):
    result = json.loads((path / "train-fit-context-slice4-v151936.json").read_text())
    return [dict(zip(result["columns"], row)) for row in result["rows"]]


def test_fit_context_table(tmp_path, monkeypatch):
    """Each W and --ac mode searched with its own runs (stubs here), the longest run's numbers in
    its row, every trial listed."""
    calls = []
    monkeypatch.setattr(bench_train, "torchrun", _recipe_stub(calls))
    bench_train.main([*FIT_ARGS, "--out", str(tmp_path)])
    rows = _fit_rows(tmp_path)
    assert [(r["W"], r["ac"]) for r in rows] == [(1, "off"), (1, "on"), (2, "off"), (2, "on")]
    assert [r["longest tokens"] for r in rows] == [294_912, 294_912, 589_824, 589_824]
    assert rows[0]["step ms"] == 294.912 and rows[0]["first step s"] == 90.0 and rows[0]["shortest failed"] == 327_680
    assert rows[0]["trials"].startswith("131072 ok; 262144 ok; 524288 out of memory")
    assert {c[3] for c in calls} == {"1"} and sum(c[2] for c in calls) == len(calls) // 2


def test_fit_context_keeps_the_trials_of_a_run_cut_short(tmp_path, monkeypatch):
    """The table is written after every trial: a run stopped in its second search keeps the first
    search's row and the second's trials so far, its longest run's numbers with them."""
    calls = []
    monkeypatch.setattr(bench_train, "torchrun", _recipe_stub(calls))
    bench_train.main([*FIT_ARGS, "--ac", "off", "--out", str(tmp_path / "whole")])
    first_search = len([c for c in calls if c[0] == 1])
    calls.clear()
    monkeypatch.setattr(bench_train, "torchrun", _recipe_stub(calls, stop_after=first_search + 2))
    with pytest.raises(KeyboardInterrupt):
        bench_train.main([*FIT_ARGS, "--ac", "off", "--out", str(tmp_path / "cut")])
    whole, cut = _fit_rows(tmp_path / "whole"), _fit_rows(tmp_path / "cut")
    assert cut[0] == whole[0]
    assert cut[1]["trials"] == "262144 ok; 524288 ok" and cut[1]["longest tokens"] == 524_288
    assert cut[1]["step ms"] == 524.288 and cut[1]["shortest failed"] is None


def test_recipe_settings_name_the_result(tmp_path, monkeypatch):
    """--extra reaches every trial's recipe and names the result, so runs with other settings
    keep their own files."""
    calls = []
    monkeypatch.setattr(bench_train, "torchrun", _recipe_stub(calls))
    bench_train.main([*FIT_ARGS, "--ac", "on", "--out", str(tmp_path), "--extra", "--tiled-mlp"])
    assert [p.name for p in tmp_path.iterdir()] == ["train-fit-context-slice4-v151936-tiled-mlp.json"]
    assert calls and all(c[2] and "--tiled-mlp" in c[4] for c in calls)


class _Counter:
    """A stub allocator: bytes now and the peak since the last reset."""

    def __init__(self, now: int):
        self.now = self.top = now

    def add(self, n: int) -> None:
        self.now += n
        self.top = max(self.top, self.now)

    def reset(self) -> None:
        self.top = self.now


class _Toy(nn.Module):
    """Three layers, a norm and a head; each forward "allocates" on the counter what it keeps."""

    def __init__(self, counter: _Counter):
        super().__init__()
        self.counter = counter
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        self.norm, self.head = nn.LayerNorm(4), nn.Linear(4, 2)
        for i, layer in enumerate(self.layers):
            layer.register_forward_hook(lambda *_, i=i: counter.add(100 * (i + 1)))
        self.norm.register_forward_hook(lambda *_: counter.add(30))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        loss = self.head(self.norm(x)).square().sum()
        self.counter.add(20)  # the loss's own saved tensors
        return loss


def test_memory_probe_phases_and_sizes():
    counter = _Counter(1000)
    model = _Toy(counter)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(5, 4)).backward()
    optimizer.step()  # the optimizer state exists from the first step on
    optimizer.zero_grad(set_to_none=True)
    counter.now = counter.top = 1000  # the first step's activations freed
    probe = MemoryProbe(lambda: counter.now, lambda: counter.top, counter.reset)
    probe.install(model, model.layers, model.norm, optimizer)
    loss = model(torch.randn(5, 4))
    counter.add(700)  # the backward's temporaries: the step's peak
    counter.add(-700 - 650)
    loss.backward()
    optimizer.step()
    probe.remove()
    report = probe.report(0)
    names = [p[0] for p in report["phases"]]
    assert names == ["embedding", "layer 0", "layer 1", "layer 2", "head and loss", "backward", "optimizer step"]
    assert [round(v * GIB) for v in report["activations by layer"].values()] == [100, 200, 300]
    assert round(report["head and loss"] * GIB) == 50
    assert report["peak phase"] == "backward" and round(report["peak"] * GIB) == 2350
    assert round(report["held at its start"] * GIB) == 1650 and round(report["transient"] * GIB) == 700
    params = local_bytes(model.parameters())
    assert report["parameters"] * GIB == params and report["gradients"] * GIB == params
    assert report["optimizer state"] * GIB == local_bytes(t for s in optimizer.state.values() for t in s.values())
    assert round(report["activations and loss held"] * GIB) == 1650 - params - report["optimizer state"] * GIB
    text = format_reports([report])
    assert text.startswith("rank 0: peak 0.00 GiB in backward") and "left by each layer's forward" in text
    settings = argparse.Namespace(preset="slice4", vocab_size=None, steps=3, compile=True, extra=[])
    table = bench_train.memory_result(settings, 32768, {1: {"ranks": [report]}, 4: "out of memory"})
    rows = table.records()
    assert rows[0]["peak in"] == "backward" and rows[0]["activations by layer"].count(" ") == 2
    assert rows[1] == {**{c: None for c in bench_train.MEMORY_COLUMNS}, "W": 4, "status": "out of memory"}
    assert "|---" in table.markdown()


def _recipe_rank(rank: int, world: int) -> None:
    recipe = load_recipe()
    cfg = recipe.TrainConfig.from_args(["--preset", "tiny", "--device", "cpu", "--dtype", "fp32", "--steps", "2",
                                        "--no-progress"], world)  # fmt: skip
    report = measure(recipe, cfg, rank, world, torch.device("cpu"))
    names = [p[0] for p in report["phases"]]
    assert names == ["embedding", "layer 0", "layer 1", "layer 2", "layer 3", "head and loss", "backward",
                     "optimizer step"], names  # fmt: skip
    assert report["parameters"] > 0 and report["gradients"] == report["parameters"]
    assert report["optimizer state"] >= 2 * report["parameters"]


@pytest.mark.slow  # the fast tier checks the probe's phases and sizes on one process
@pytest.mark.dist
def test_memory_map_runs_the_recipes_steps():
    run_ranks(1, _recipe_rank)
