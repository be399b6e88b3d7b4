"""The recorded FLA autotuning choices: the record names kernels of the FLA it was recorded with,
seeding fills only keys the autotuners have not seen, and on a Hopper GPU the GDN ops launch
the recorded configurations without autotuning."""

from __future__ import annotations

import json

import pytest
import torch

fla = pytest.importorskip("fla")

from custom_ops.fla.configs import _autotuner, recorded_configs_path, seed_autotuners, use_recorded_configs  # noqa: E402

HOPPER = (9, 0)


def _record(capability=HOPPER) -> dict:
    with open(recorded_configs_path(capability)) as f:
        return json.load(f)


@pytest.fixture
def restore_caches():
    """Every FLA autotuner named by the record gets its cache back after the test."""
    tuners = {e["kernel"]: _autotuner(e["kernel"]) for e in _record()["entries"]}
    saved = {name: dict(t.cache) for name, t in tuners.items() if t is not None}
    yield tuners
    for name, cache in saved.items():
        tuners[name].cache.clear()
        tuners[name].cache.update(cache)


def test_record_names_kernels_of_the_pinned_fla():
    record = _record()
    assert record["fla"] == fla.__version__, "re-record with python -m benchmarks.record_fla_configs after an FLA upgrade"
    assert tuple(record["capability"]) == HOPPER
    assert record["entries"]
    keys = set()
    for entry in record["entries"]:
        tuner = _autotuner(entry["kernel"])
        assert tuner is not None, entry["kernel"]
        # the key holds the values of the autotuner's key arguments that are launch arguments (not
        # the configs' own), then the dtypes of the tensor arguments
        key = entry["key"]
        first_dtype = next(i for i, v in enumerate(key) if isinstance(v, str))
        assert first_dtype <= len(tuner.keys), entry
        assert all(isinstance(d, str) and d.startswith("torch.") for d in key[first_dtype:]), entry
        assert {"num_warps", "num_stages"} <= set(entry["config"]), entry
        keys.add((entry["kernel"], json.dumps(entry["key"])))
    assert len(keys) == len(record["entries"]), "one entry per kernel and key"


def test_seeding_fills_only_unseen_keys(restore_caches):
    tuners = restore_caches
    name = "fla.ops.common.chunk_o.chunk_fwd_kernel_o"
    tuner = tuners[name]
    first, second = tuner.configs[0], tuner.configs[-1]
    seen, unseen = ("seen-key",), ("unseen-key",)
    tuner.cache[seen] = first
    record = {
        "fla": fla.__version__,
        "entries": [
            {"kernel": name, "key": list(seen), "config": second.all_kwargs()},
            {"kernel": name, "key": list(unseen), "config": second.all_kwargs()},
            {"kernel": name, "key": ["other-config"], "config": {"num_warps": 3, "num_stages": 9}},
            {"kernel": "fla.ops.no_such_module.kernel", "key": [1], "config": second.all_kwargs()},
        ],
    }
    assert seed_autotuners(record, fla.__version__) == 1
    assert tuner.cache[seen] is first  # what the process autotuned itself stays
    assert tuner.cache[unseen] is second  # the kernel's own config object, hooks included
    assert ("other-config",) not in tuner.cache  # not one of the kernel's configurations
    assert seed_autotuners(dict(record, fla="0.0.0"), fla.__version__) == 0


def test_no_seeding_off_cuda():
    assert use_recorded_configs(torch.device("cpu")) == 0


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != HOPPER, reason="needs a Hopper GPU"
)
def test_hopper_gdn_launches_recorded_configs(restore_caches):
    """Every recorded configuration is among its kernel's on this GPU, and a GDN fwd+bwd at
    recorded head counts leaves each recorded key with the recorded configuration."""
    import cp_ops

    record = _record()
    tuners = restore_caches
    for entry in record["entries"]:
        assert any(c.all_kwargs() == entry["config"] for c in tuners[entry["kernel"]].configs), entry
    for tuner in tuners.values():
        tuner.cache.clear()
    assert seed_autotuners(record, fla.__version__) == len(record["entries"])
    sizes = {name: len(t.cache) for name, t in tuners.items()}
    seeded = {(e["kernel"], tuple(e["key"])): tuners[e["kernel"]].cache[tuple(e["key"])] for e in record["entries"]}
    layer = cp_ops.GatedDeltaNet(256, 8, 16, 128, 128).to("cuda", torch.bfloat16)
    _, cup = cp_ops.pad_cu_seqlens([700, 1, 300], 1, device="cuda")
    x = torch.randn(int(cup[-1]), 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    layer(x, cup).float().square().mean().backward()
    torch.cuda.synchronize()
    # an autotuned launch would have added its key: every key the layer launched was recorded
    assert {name: len(t.cache) for name, t in tuners.items()} == sizes
    assert all(tuners[name].cache[key] is config for (name, key), config in seeded.items())
