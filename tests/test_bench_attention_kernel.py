"""benchmarks/bench_attention.py kernel on the CPU: its cases and result names, the float32
reference and error measure the library kernels are checked with, and the rows of baselines that
are missing or refuse a shape (a note each, never an exception)."""

import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from benchmarks import bench_attention as ba
from benchmarks.attention_baselines import NotInstalled, compare, fp32_reference, require
from benchmarks.cases import attention_cases, attention_inputs, packed_lengths, tokens_label
from custom_ops import varlen_attention


def test_the_default_run_keeps_its_cases_and_name_and_tokens_add_packed_cases():
    assert ba.parse_args(["kernel"]).tokens == [32768]
    assert attention_cases() == [("packed 32k", packed_lengths(32768)), ("dense B8 x 4096", [4096] * 8)]
    assert ba._suffix(1, (128, 64), [32768]) == ""
    args = ba.parse_args(["kernel", "--gqa", "8", "--head-dims", "256", "--tokens", "32768", "131072", "524288"])
    assert ba._suffix(args.gqa, args.head_dims, args.tokens) == "-gqa8-d256-t32k-128k-512k"
    assert ba._suffix(1, (128, 64), [131072]) == "-t128k" and tokens_label(1000) == "1000"
    cases = attention_cases((32768, 524288))
    assert [name for name, _ in cases] == ["packed 32k", "packed 512k", "dense B8 x 4096"]
    assert [sum(lens) for _, lens in cases] == [32768, 524288, 32768]


@pytest.mark.parametrize("argv, message", [(["--gqa", "3"], "--gqa must divide 16"),
                                           (["--tokens", "0"], "--tokens must be positive")])  # fmt: skip
def test_bad_arguments_are_refused_before_any_gpu_work(argv, message):
    with pytest.raises(SystemExit, match=message):
        ba._run_kernel(ba.parse_args(["kernel", *argv]))


def test_each_case_has_ours_sdpa_and_the_library_baselines():
    libraries = ["FlexAttention doc mask", "FlashAttention 4 varlen", "cuDNN frontend varlen"]
    names = [name for name, _ in ba.implementations([4096] * 8, "cpu")]
    assert names == ["varlen_attention", "SDPA flash", "SDPA cuDNN", *libraries]
    names = [name for name, _ in ba.implementations([100, 28], "cpu", "ours, pointer loads")]
    assert names == ["ours, pointer loads", "SDPA flash, loop over docs", *libraries]


@given(st.lists(st.integers(1, 24), min_size=1, max_size=4), st.sampled_from([1, 2, 4]))
def test_fp32_reference_is_sdpa_per_document_in_float64(lens, gqa):
    q, k, v = (t.detach() for t in attention_inputs(sum(lens), 4, 4 // gqa, 8, "cpu"))
    dout = torch.randn(q.shape).to(q.dtype)
    got = fp32_reference(q, k, v, lens, dout)
    assert all(t.dtype == torch.float32 for t in got)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    outs, start = [], 0
    for n in lens:
        qd, kd, vd = (t[start : start + n].transpose(0, 1) for t in leaves)
        outs.append(F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=gqa > 1).transpose(0, 1))
        start += n
    out = torch.cat(outs)
    want = (out, *torch.autograd.grad(out, leaves, dout.double()))
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5)


def test_compare_gives_the_max_and_relative_error_in_chunks():
    ref = torch.tensor([[3.0, 0.0], [0.0, 4.0], [0.0, 0.0]])
    out = ref + torch.tensor([[0.0, 0.5], [0.0, 0.0], [-1.0, 0.0]])
    assert compare(out, ref) == compare(out, ref, rows=1) == pytest.approx((1.0, (1.25**0.5) / 5))
    assert compare(out.bfloat16(), ref)[0] == 1.0
    assert compare(ref.clone().fill_(float("nan")), ref) == (float("inf"), float("inf"))
    assert compare(ref, ref) == (0.0, 0.0)


class _RefusingBackward(torch.autograd.Function):
    """The forward of the op; a backward that refuses, as a library does at a shape it lacks."""

    @staticmethod
    def forward(ctx, q, k, v, *seg):
        return ba.varlen_fn(q, k, v, seg)

    @staticmethod
    def backward(ctx, dout):
        raise NotImplementedError("no backward at this head dim")


def _broken_forward(q, k, v, seg):
    raise ValueError("head dim 16 unsupported\nsecond line")


def _refusing_backward(q, k, v, seg):
    return _RefusingBackward.apply(q, k, v, *seg)


def _not_causal(q, k, v, seg):
    return varlen_attention(q, k, v, *seg, causal=False)[0]


def test_missing_refusing_and_wrong_baselines_are_rows_with_notes(monkeypatch, tmp_path):
    for package in ("flash_attn", "cudnn"):
        monkeypatch.setitem(sys.modules, package, None)  # not importable, whatever is installed
    (tmp_path / "broken_baseline_pkg.py").write_text("import a_dependency_that_is_missing_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    ours, sdpa, _flex, fa4, cudnn = ba.implementations([40, 24], "cpu")
    impls = [ours, fa4, cudnn,
             ("broken install", lambda: require("broken_baseline_pkg", "broken")),
             ("forward refuses", lambda: _broken_forward), ("backward refuses", lambda: _refusing_backward),
             ("no causal mask", lambda: _not_causal)]  # fmt: skip
    timed = []
    rows = ba.bench_case("tiny", [40, 24], 16, 4, impls, "cpu", timer=lambda fn: (timed.append(fn), fn(), 2.0)[-1])
    keys = ["fwd ms", "fwd+bwd ms", "err out", "err grads", "note"]
    by_name = {row[2]: dict(zip(keys, row[3:4] + row[5:6] + row[7:])) for row in rows}
    assert len(rows) == len(impls) and all(len(row) == 3 + len(ba.MEASURED) for row in rows)
    assert by_name["varlen_attention"]["fwd ms"] == by_name["varlen_attention"]["fwd+bwd ms"] == 2.0
    assert 0 < by_name["varlen_attention"]["err out"] < 0.05 and 0 < by_name["varlen_attention"]["err grads"] < 0.2
    assert by_name["varlen_attention"]["note"] == ""
    assert by_name["FlashAttention 4 varlen"]["note"] == "flash-attn-4 not installed (the attention-baselines extra)"
    assert by_name["cuDNN frontend varlen"]["note"].startswith("nvidia-cudnn-frontend not installed (the attention")
    assert by_name["broken install"]["note"].startswith("ModuleNotFoundError: No module named 'a_dependency")
    assert by_name["forward refuses"]["note"] == "ValueError: head dim 16 unsupported"
    refusing = by_name["backward refuses"]
    assert refusing["fwd ms"] == 2.0 and refusing["fwd+bwd ms"] is None and refusing["err grads"] is None
    assert refusing["note"] == "backward: NotImplementedError: no backward at this head dim"
    wrong = by_name["no causal mask"]
    assert wrong["fwd ms"] is None and wrong["note"].startswith("disagrees with the fp32 reference (rel err")
    assert len(timed) == 3  # ours' forward and step, the refusing backward's forward: nothing else timed
    assert ba.note_for(NotInstalled("x not installed")) == "x not installed"


def test_layout_rows_are_checked_through_copies_and_timed_in_their_layout():
    """An :class:`InLayout` row (the op where a document is odd) is checked against the reference
    through its copies, and timed on inputs placed before the timer runs: no copy is timed."""
    lens = [5, 12, 1, 7]
    q, k, v = (t.detach() for t in attention_inputs(sum(lens), 4, 2, 8, "cpu", dtype=torch.float32))
    dout = torch.randn(q.shape)
    inner, placed, copies_timed = ba.backend_fn(lens, "cpu", "segment"), [], []
    assert isinstance(inner, ba.InLayout)
    row = ba.InLayout(inner.fn, lambda t: (placed.append(t.shape[0]), inner.place(t))[1], inner.take)

    def timer(fn):
        before = len(placed)
        fn()
        copies_timed.append(len(placed) - before)
        return 3.0

    r = ba.measure(lambda: row, q, k, v, None, fp32_reference(q, k, v, lens, dout), dout, timer)
    assert r["note"] == "" and r["fwd ms"] == r["fwd+bwd ms"] == 3.0 and r["err grads"] < 1e-4
    assert copies_timed == [0, 0] and placed == [sum(lens)] * 7  # 3 for the check, q k v dout before timing


@pytest.mark.parametrize("lens", [[5, 12, 1, 7], [4, 6, 2]])  # odd lengths: padded rows between the documents
def test_backend_rows_take_packed_documents_of_any_length(lens):
    """The ``ag_thd_attention`` rows move the packed rows into the op's padded layout and back
    where a document is odd: the segment backend's row equals the float32 reference, output and
    gradients."""
    q, k, v = (t.detach() for t in attention_inputs(sum(lens), 4, 2, 8, "cpu", dtype=torch.float32))
    dout = torch.randn(q.shape)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = ba.backend_fn(lens, "cpu", "segment")(*leaves, None)
    got = (out, *torch.autograd.grad(out, leaves, dout))
    for a, b in zip(got, fp32_reference(q, k, v, lens, dout)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
