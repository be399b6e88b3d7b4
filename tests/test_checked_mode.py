"""The checked mode: every op and layer refuses an invalid layout with an error naming the
argument, where it otherwise returns finite, wrong rows. Each op on its torch reference (the
CPU pass) and on its Triton kernel (the interpreter pass); the CP ops and layers on two gloo
ranks; compiled graphs too. In the default mode ("eager") eager calls check and compiled graphs
read nothing on the host; off, nothing is read anywhere."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import cp_ops
import custom_ops
from custom_ops import checks_enabled, env, set_checks
from custom_ops.testing import rel_error
from custom_ops.thd import validation
from tests._dist import run_ranks

PATHS = [pytest.param("reference", id="reference"), pytest.param("kernel", id="kernel", marks=pytest.mark.interpret)]


@pytest.fixture(autouse=True)
def checks_on():
    assert checks_enabled() == "eager", "eager calls are checked unless asked otherwise"
    set_checks(True)
    yield
    set_checks("eager")


def _idx(values):
    return torch.tensor(values, dtype=torch.int32)


# (cu_seqlens_padded for a 12-row tensor at W = 2, the error it must raise)
BAD_PADDED = [
    ([0, 8, 4, 12], "cu_seqlens_padded must be non-decreasing: sequence 1"),
    ([0, 6, 12], "sequence 0 has padded length 6, not a multiple of 2\\*cp_size = 4"),
    ([0, 4, 8], "cu_seqlens_padded\\[-1\\] = 8 but the tensor has 12 rows"),
    ([0, 5, 12], "sequence 0 has padded length 5"),  # real lengths where padded ones belong
]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("cup,message", BAD_PADDED)
@pytest.mark.parametrize("op", [custom_ops.thd_seq_to_rank_order, custom_ops.thd_rank_to_seq_order])
def test_reorder_refuses_bad_padded_layouts(path, cup, message, op):
    x = torch.randn(12, 3)
    with pytest.raises(ValueError, match=message):
        op(x, _idx(cup), 2)
    op(x, _idx([0, 4, 12]), 2)  # a valid layout still runs


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    "offsets,cu,message",
    [
        ([0, 2], [0, 3, 5], "sequence 1 starts at row 2, inside sequence 0"),
        ([0, 7], [0, 3, 5], "sequence 1 ends at row 9, past the 8 rows"),
        ([-1, 4], [0, 3, 5], "negative row"),
        ([0, 4], [0, 3, 2], "cu_seqlens must be non-decreasing"),
    ],
)
def test_copy_valid_tokens_refuses_bad_segments(path, offsets, cu, message):
    dst, src = torch.randn(8, 2), torch.randn(8, 2)
    with pytest.raises(ValueError, match=message):
        custom_ops.thd_copy_valid_tokens(dst, src, _idx(offsets), _idx(cu))
    with pytest.raises(ValueError, match=message):
        custom_ops.thd_copy_valid_tokens_(dst, src, _idx(offsets), _idx(cu))


@pytest.mark.parametrize("path", PATHS)
def test_varlen_attention_refuses_bad_segments(path):
    q, k, v = torch.randn(10, 2, 16), torch.randn(12, 1, 16), torch.randn(12, 1, 16)
    ok = dict(q_start=[0, 5], q_len=[5, 5], q_pos=[0, 0], k_start=[0, 6], k_len=[6, 6])
    for change, message in (
        (dict(q_start=[0, 3]), "the query rows of segments 0 and 1 overlap"),
        (dict(k_len=[6, 7]), "segment 1: key rows \\[6, 13\\) are not inside \\[0, 12\\)"),
        (dict(q_len=[-1, 5]), "segment 0: q_len = -1"),
    ):
        seg = [_idx(v_) for v_ in {**ok, **change}.values()]
        with pytest.raises(ValueError, match=message):
            custom_ops.varlen_attention(q, k, v, *seg)
    custom_ops.varlen_attention(q, k, v, *[_idx(v_) for v_ in ok.values()])


@pytest.mark.parametrize("path", PATHS)
def test_conv_refuses_bad_cumulative_lengths_and_rows(path):
    x, w = torch.randn(10, 4), torch.randn(4, 3)
    for cu, message in (([0, 4, 9], "cu_seqlens\\[-1\\] = 9 but the tensor has 10 rows"),
                        ([0, 6, 4, 10], "cu_seqlens must be non-decreasing"),
                        ([1, 4, 10], "must start at 0")):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            custom_ops.causal_conv1d(x, w, None, _idx(cu))
    rows = torch.arange(10)
    with pytest.raises(ValueError, match="rows must be a permutation of range\\(10\\): 3 appears 2 times"):
        custom_ops.causal_conv1d_gather(x, torch.where(rows == 4, 3, rows), w, None, _idx([0, 4, 10]))
    custom_ops.causal_conv1d_gather(x, rows.flip(0), w, None, _idx([0, 4, 10]))
    custom_ops.causal_conv1d_gather(x, None, w, None, _idx([0, 4, 10]))  # sequence order: nothing to check
    with pytest.raises(ValueError, match="cu_seqlens\\[-1\\] = 9 but the tensor has 10 rows"):
        custom_ops.causal_conv1d_gather(x, None, w, None, _idx([0, 4, 9]))


def test_gated_delta_rule_refuses_bad_cumulative_lengths():
    t, h, d = 10, 2, 8
    q, k, v = (torch.randn(t, h, d) for _ in range(3))
    g, beta = -torch.rand(t, h), torch.rand(t, h)
    with pytest.raises(ValueError, match="cu_seqlens\\[-1\\] = 12 but the tensor has 10 rows"):
        custom_ops.chunk_gated_delta_rule(q, k, v, g, beta, _idx([0, 4, 12]))
    with pytest.raises(ValueError, match="cu_seqlens\\[-1\\] = 12 but the tensor has 10 rows"):
        custom_ops.chunk_gated_delta_rule_with_state(q, k, v, g, beta, _idx([0, 4, 12]), None, torch.zeros(2, h, d, d))


def test_gdn_layer_refuses_bad_padded_layouts():
    layer = cp_ops.GatedDeltaNet(32, 2, 4, 8, 8)
    cu, cup = cp_ops.pad_cu_seqlens([5, 7], 1)  # padded lengths 6 and 8
    x = torch.randn(14, 32)
    with pytest.raises(ValueError, match="cu_seqlens_padded\\[-1\\] = 12 but the input has 14 rows"):
        layer(x, cu)  # real lengths where the padded ones belong
    with pytest.raises(ValueError, match="non-decreasing"):
        layer(x, _idx([0, 14, 6]))


def test_attention_layer_refuses_swapped_and_short_layouts():
    layer = cp_ops.Attention(32, 4, 2, 8)
    cu, cup = cp_ops.pad_cu_seqlens([5, 7], 1)
    x = torch.randn(14, 32)
    with pytest.raises(ValueError, match="swapped"):
        layer(x, cup, cu)
    with pytest.raises(ValueError, match="cu_seqlens_padded\\[-1\\] = 14 but the input has 16 rows"):
        layer(torch.randn(16, 32), cu, cup)


def test_compiled_layer_checks_when_the_graph_runs():
    layer = cp_ops.GatedDeltaNet(32, 2, 4, 8, 8)
    _, cup = cp_ops.pad_cu_seqlens([5, 7], 1)
    x = torch.randn(14, 32)
    compiled = torch.compile(layer, fullgraph=True)
    compiled(x, cup)
    with pytest.raises(ValueError, match="non-decreasing"):
        compiled(x, _idx([0, 14, 6]))


def _count_validations(monkeypatch) -> list[str]:
    calls = []
    for kind in list(validation._VALIDATORS):
        monkeypatch.setitem(validation._VALIDATORS, kind, lambda *args, kind=kind: calls.append(kind))
    return calls


def test_checks_off_read_nothing(monkeypatch):
    calls = _count_validations(monkeypatch)
    _, cup = cp_ops.pad_cu_seqlens([5, 7], 2)
    set_checks(False)
    custom_ops.thd_seq_to_rank_order(torch.randn(16, 2), cup, 2)
    cp_ops.GatedDeltaNet(32, 2, 4, 8, 8)(torch.randn(16, 32), cup)
    assert calls == []
    set_checks(True)
    custom_ops.thd_seq_to_rank_order(torch.randn(16, 2), cup, 2)
    assert calls == ["padded"]


def test_eager_mode_checks_eager_calls_and_not_compiled_graphs(monkeypatch):
    set_checks("eager")
    calls = _count_validations(monkeypatch)
    _, cup = cp_ops.pad_cu_seqlens([5, 7], 1)
    x = torch.randn(16, 32)
    custom_ops.thd_seq_to_rank_order(x, cup, 1)  # the op's Python object: an eager call
    assert calls == ["padded"]
    torch.ops.cp_ops.thd_seq_to_rank_order(x, cup, 1)  # the form a compiled graph calls
    assert calls == ["padded"]
    layer = cp_ops.GatedDeltaNet(32, 2, 4, 8, 8)
    layer(x, cup)
    assert calls[1] == "padded_shard"
    del calls[:]
    compiled = torch.compile(lambda x, cup: layer(x, cup) + custom_ops.thd_seq_to_rank_order(x, cup, 1), fullgraph=True)
    compiled(x, cup)
    assert calls == [], "a compiled graph in the eager mode reads nothing on the host"
    torch._dynamo.reset()


@pytest.mark.gpu
def test_eager_mode_reads_nothing_in_a_cuda_graph_capture(monkeypatch):
    set_checks("eager")
    layer = cp_ops.GatedDeltaNet(64, 2, 4, 16, 16).cuda()
    _, cup = cp_ops.pad_cu_seqlens([50, 70], 1)
    cup = cup.cuda()
    x = torch.randn(int(cup[-1]), 64, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (FLA's autotuning) outside the capture
        want = layer(x, cup)
    torch.cuda.current_stream().wait_stream(side)
    calls = _count_validations(monkeypatch)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(x, cup)
    assert calls == [], "a capture reads nothing on the host"
    graph.replay()
    torch.cuda.synchronize()
    assert rel_error(out, want) < 1e-5


def test_environment_variable_and_bad_values(monkeypatch):
    with pytest.raises(TypeError, match="True, False or 'eager'"):
        set_checks(1)
    monkeypatch.delenv("CP_OPS_CHECKS", raising=False)
    assert env.checks() == "eager"
    for value, want in (("1", True), ("0", False), ("eager", "eager")):
        monkeypatch.setenv("CP_OPS_CHECKS", value)
        assert env.checks() == want
    # read on import: a process that starts with it set is in that mode
    probe = "import custom_ops; print(custom_ops.checks_enabled())"
    out = subprocess.run([sys.executable, "-c", probe], env={**os.environ, "CP_OPS_CHECKS": "0"},
                         capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    assert out == "False"


# --- on two ranks: the CP exchanges, the all-gather attention and both layers ---------------------


def _cp_checks(rank, world):
    import torch.distributed as dist

    set_checks(True)
    group = dist.group.WORLD
    cu, cup = cp_ops.pad_cu_seqlens([5, 7], world)  # padded 8 and 8: 16 rows, 8 per rank
    bad_cup = _idx([0, 8, 4, 16])
    x = torch.randn(8, 4)
    for fn in (custom_ops.thd_cp2hp, custom_ops.thd_hp2cp):
        src = x if fn is custom_ops.thd_cp2hp else torch.randn(16, 2)
        sections = [4] if fn is custom_ops.thd_cp2hp else [2]
        with pytest.raises(ValueError, match="non-decreasing"):
            fn(src, bad_cup, sections, group)
        fn(src, cup, sections, group)
    q, k = torch.randn(8, 2, 8), torch.randn(8, 1, 8)
    with pytest.raises(ValueError, match="swapped"):
        custom_ops.ag_thd_attention(q, k, k, cup, cu, group=group)
    gdn = cp_ops.GatedDeltaNet(32, 2, 4, 8, 8)
    with pytest.raises(ValueError, match="input has 8 rows, but its shard of the layout has cu_seqlens_padded\\[-1\\] / cp_size = 12 / 2"):
        gdn(torch.randn(8, 32), cu, group=group)  # real lengths where the padded ones belong
    attn = cp_ops.Attention(32, 4, 2, 8)
    with pytest.raises(ValueError, match="swapped"):
        attn(torch.randn(8, 32), cup, cu, group=group)
    set_checks("eager")


@pytest.mark.dist
def test_cp_ops_and_layers_check_on_two_ranks():
    set_checks("eager")  # the ranks turn it on themselves
    run_ranks(2, _cp_checks)


# --- the default mode: eager calls refuse the layouts that otherwise give output, no error -------


def _layers():
    return cp_ops.GatedDeltaNet(32, 2, 4, 8, 8), cp_ops.Attention(32, 4, 2, 8)


def test_default_mode_refuses_a_padded_end_other_than_the_row_count():
    set_checks("eager")
    gdn, attn = _layers()
    x, cu, cup = cp_ops.pack([torch.randn(n, 32) for n in (5, 7)], 1)  # 14 rows
    long = cup.clone()
    long[-1] += 2
    message = "cu_seqlens_padded\\[-1\\] = 16 but the (input|tensor) has 14 rows"
    for call in (lambda: gdn(x, long), lambda: attn(x, cu, long),
                 lambda: custom_ops.thd_seq_to_rank_order(x, long, 1)):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            call()


def test_default_mode_refuses_swapped_cumulative_lengths():
    set_checks("eager")
    _, attn = _layers()
    x, cu, cup = cp_ops.pack([torch.randn(n, 32) for n in (5, 7)], 1)
    q, kv = torch.randn(14, 4, 8), torch.randn(14, 2, 8)
    for call in (lambda: attn(x, cup, cu), lambda: custom_ops.ag_thd_attention(q, kv, kv, cup, cu)):
        with pytest.raises(ValueError, match="are cu_seqlens and cu_seqlens_padded swapped"):
            call()


def _default_mode_on_two_ranks(rank, world, case):
    import torch.distributed as dist

    assert checks_enabled() == "eager"
    group = dist.group.WORLD
    gdn, attn = _layers()
    seqs = [torch.randn(n, 32) for n in (6, 10)]
    if case == "unsharded":  # the whole batch where this rank's shard belongs
        x, cu, cup = cp_ops.pack(seqs, world)
        message = "input has 20 rows, but its shard of the layout has cu_seqlens_padded\\[-1\\] / cp_size = 20 / 2"
    else:  # a batch packed for cp 1 (padded lengths 6, 10), its first half as a shard at cp 2
        x, cu, cup = cp_ops.pack(seqs, 1)
        x = x[: x.shape[0] // world]
        message = "padded length 6, not a multiple of 2\\*cp_size = 4 \\(pack the batch for cp_size = 2"
    for call in (lambda: gdn(x, cup, group), lambda: attn(x, cu, cup, group)):
        with pytest.raises(ValueError, match=message):
            call()


@pytest.mark.dist
@pytest.mark.parametrize("case", ["unsharded", "packed_for_cp1"])
def test_default_mode_refuses_a_layout_that_does_not_fit_the_group(case):
    set_checks("eager")
    run_ranks(2, _default_mode_on_two_ranks, case)


def test_checks_off_name_the_mode_where_a_reference_indexes_out_of_range():
    set_checks(False)
    x, _, cup = cp_ops.pack([torch.randn(n, 4) for n in (5, 7)], 2)
    long = cup.clone()
    long[-1] += 4
    with pytest.raises(ValueError, match="CP_OPS_CHECKS=1 or custom_ops.set_checks\\(True\\)"):
        custom_ops.thd_rank_to_seq_order(x, long, 2)
