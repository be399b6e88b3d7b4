"""The gated delta rule's kernel backends: how a call's backend is chosen, and FlashQLA's varlen
metadata built on the device (the GPU tests of each backend are in test_gdn_ops.py)."""

import types

import pytest
import torch

import custom_ops
from custom_ops import env
from custom_ops.gated_delta_rule import backends
from custom_ops.fla.adapter import fla_varlen_indices
from custom_ops.gated_delta_rule.flash_qla import _prepared
from custom_ops.gated_delta_rule.reference import chunk_gated_delta_rule_reference
from tests.custom_ops.test_gdn_ops import _cu, _gdn_case


def _cuda_like(rows, heads, dim, dtype=torch.bfloat16, index=0):
    """What resolve reads of a CUDA tensor (device, shape, dtype), without a GPU."""
    return types.SimpleNamespace(device=torch.device("cuda", index), shape=(rows, heads, dim), dtype=dtype)


def _machine(version="0.1.3", capability=(9, 0)):
    """FlashQLA installed (or not: None), on GPUs of this compute capability."""
    return backends.Machine(version, lambda index: capability)


HOPPER = _machine()


@pytest.fixture(autouse=True)
def no_override():
    yield
    backends.set_backend(None)


def test_cpu_tensors_take_the_reference_whatever_is_asked(monkeypatch):
    q = torch.zeros(3, 1, 4)
    for asked in ("auto", "fla", "flashqla"):
        monkeypatch.setenv("CP_OPS_GDN_BACKEND", asked)
        assert backends.resolve(q, q) == "reference"
        for given in ("auto", "reference", "fla", "flashqla"):
            assert backends.resolve(q, q, given) == "reference"


def test_auto_takes_flash_qla_where_the_call_fits_it():
    q, v = _cuda_like(256, 4, 128), _cuda_like(256, 8, 128)
    assert backends.resolve(q, v, machine=HOPPER) == "flashqla"
    few_q, few_v = _cuda_like(256, backends.AUTO_FLA_MAX_KEY_HEADS, 128), _cuda_like(256, 4, 128)
    assert backends.resolve(few_q, few_v, machine=HOPPER) == "fla"  # where FLA's kernels are faster
    assert backends.resolve(few_q, few_v, "flashqla", HOPPER) == "flashqla"
    backends.set_backend("fla")
    assert backends.resolve(q, v, machine=HOPPER) == "fla"
    backends.set_backend("flashqla")
    assert backends.resolve(q, v, machine=HOPPER) == "flashqla"
    assert backends.resolve(q, v, "fla", HOPPER) == "fla"  # a backend given (a traced graph's) is kept


@pytest.mark.parametrize(
    "q, v, capability, reason",
    [
        (_cuda_like(64, 2, 64), _cuda_like(64, 4, 128), (9, 0), "dk = dv = 128, got dk = 64"),
        (_cuda_like(64, 2, 128, torch.float32), _cuda_like(64, 4, 128, torch.float32), (9, 0), "bfloat16 or float16"),
        (_cuda_like(64, 2, 128), _cuda_like(64, 4, 128), (8, 0), "compute capability 9.0, 10.0 or 10.3, got (8, 0)"),
        (_cuda_like(64, 2, 128), _cuda_like(64, 4, 128), (12, 0), "got (12, 0)"),
    ],
)
def test_calls_flash_qla_cannot_run_fall_back_or_raise(q, v, capability, reason):
    machine = _machine(capability=capability)
    assert reason in backends.flash_qla_unfit(q, v, machine)
    assert backends.resolve(q, v, machine=machine) == "fla"
    backends.set_backend("flashqla")
    with pytest.raises(ValueError, match="CP_OPS_GDN_BACKEND=flashqla, but .*use 'auto'"):
        backends.resolve(q, v, machine=machine)


def test_flash_qla_missing():
    q, machine = _cuda_like(64, 2, 128), _machine(version=None)
    assert "pip install 'cp-ops[flashqla]'" in backends.flash_qla_unfit(q, q, machine)
    assert backends.resolve(q, q, machine=machine) == "fla"


def test_no_rows_take_the_reference():
    q = _cuda_like(0, 2, 128)
    assert backends.resolve(q, q, machine=HOPPER) == "reference"


def test_bad_names(monkeypatch):
    with pytest.raises(ValueError, match="'auto', 'fla' or 'flashqla', got 'triton'"):
        backends.set_backend("triton")
    with pytest.raises(ValueError, match="backend must be one of"):
        backends.resolve(torch.zeros(1, 1, 1), torch.zeros(1, 1, 1), "triton")
    q, k, v, g, beta, cu = _gdn_case([3, 2], 1, 2, 4, 3, torch.float32)
    with pytest.raises(ValueError, match="backend must be one of"):
        torch.ops.cp_ops.chunk_gated_delta_rule_forward(q, k, v, g, beta, cu, None, backend="triton")
    monkeypatch.setenv("CP_OPS_GDN_BACKEND", "triton")
    with pytest.raises(ValueError, match="CP_OPS_GDN_BACKEND must be auto, fla or flashqla, got 'triton'"):
        env.gdn_backend()


def test_a_kernel_backend_given_for_cpu_tensors_runs_the_reference():
    q, k, v, g, beta, cu = _gdn_case([5, 0, 3], 1, 2, 4, 3, torch.float64)
    for backend in ("fla", "flashqla"):
        o = torch.ops.cp_ops.chunk_gated_delta_rule_forward(q, k, v, g, beta, cu, None, backend=backend)[0]
        assert torch.equal(o, chunk_gated_delta_rule_reference(q, k, v, g, beta, cu))
    assert torch.equal(custom_ops.chunk_gated_delta_rule(q, k, v, g, beta, cu), o)


@pytest.mark.parametrize("seqlens", [[0], [1], [64], [65, 0, 3], [130, 1, 0, 64, 63], [0, 0, 200]])
def test_flash_qla_metadata_is_built_on_the_device(seqlens):
    """The metadata FlashQLA reads instead of reading ``cu_seqlens`` on the host: each sequence's
    first chunk (the appended empty one's too), a chunk count that bounds the real one, and the
    chunk rows themselves."""
    cu = _cu(seqlens)
    rows = int(cu[-1])
    cu_ext, chunk_indices = fla_varlen_indices(cu, rows)
    prepared = _prepared(cu_ext, chunk_indices)
    chunk, offsets, num_chunks, indices = prepared._flash_qla_prepared_varlen
    counts = [-(-n // 64) for n in seqlens] + [0]
    assert chunk == 64 and indices is chunk_indices
    assert offsets.tolist() == [sum(counts[:i]) for i in range(len(counts) + 1)] and offsets.dtype == cu.dtype
    assert num_chunks == chunk_indices.shape[0] >= sum(counts)
    assert torch.equal(prepared, cu_ext) and not hasattr(cu_ext, "_flash_qla_prepared_varlen")


def test_compile_caches_are_keyed_on_the_backend_asked_for():
    """A graph traced with one backend must not be loaded from Inductor's or AOTAutograd's caches
    by a process that asks for another: the backend is part of torch.compile's cache key tag,
    in place of the one before, beside every other part of the tag."""
    with torch.compiler.config.patch(cache_key_tag="mine+gdn-auto-flashqla-none"):
        backends.set_backend("fla")
        assert torch.compiler.config.cache_key_tag.split("+")[0] == "mine"
        fla_tag = torch.compiler.config.cache_key_tag
        assert [p for p in fla_tag.split("+") if p.startswith("gdn-")] == [f"gdn-fla-flashqla-{_qla()}"]
        backends.set_backend("flashqla")
        assert torch.compiler.config.cache_key_tag != fla_tag
        assert torch.compiler.config.cache_key_tag.count("gdn-") == 1


def _qla():
    return backends.installed_version("flash-qla") or "none"


def test_eager_calls_check_the_layout():
    """In the default (eager) checked mode the delta rule's Python functions validate
    ``cu_seqlens`` on the host: a last bound other than the row count raises, with and without
    states, instead of returning rows."""
    q, k, v, g, beta, cu = _gdn_case([5, 3], 1, 2, 4, 3, torch.float32)
    bad = cu.clone()
    bad[-1] = 7
    with pytest.raises(ValueError, match="cu_seqlens"):
        custom_ops.chunk_gated_delta_rule(q, k, v, g, beta, bad)
    with pytest.raises(ValueError, match="cu_seqlens"):
        custom_ops.chunk_gated_delta_rule_with_state(q, k, v, g, beta, bad)


def test_precompile_command_refuses_malformed_head_counts(capsys):
    from custom_ops.gated_delta_rule.flash_qla import _main

    for argv in ([], ["--states"], ["16-32"], ["16/32", "8"]):
        assert _main(argv) == 2
        assert "usage: python -m custom_ops.gated_delta_rule.flash_qla [--states] HK/HV" in capsys.readouterr().err


def test_the_choice_traces_whole():
    """The state mode resolves its calls' backends while Dynamo traces it: what the choice reads
    (FlashQLA's installed version, the device's capability, the backend asked for) traces under
    fullgraph=True (Dynamo refuses importlib's lookups on some torch releases; they are constants
    to it)."""

    def choose(q):
        return q + len(backends.flash_qla_unfit(q, q)) + len(backends.requested())

    q = torch.zeros(3, 1, 128)
    torch._dynamo.reset()
    assert torch.equal(torch.compile(choose, fullgraph=True, backend="eager")(q), choose(q))
