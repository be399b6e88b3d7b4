"""The depthwise causal conv1d of the GDN layer: our Triton kernels against FLA's, one GPU.

    python -m benchmarks.bench_conv [--out DIR] [--gather]

At the layer's shapes (Qwen3-Next-80B: the q, k, v channels, 8192 on one GPU and 4096 on one
rank of W = 2; kernel 4; silu; bf16; x a column slice of the projection output, as the layer
passes it), T = 32768 and 65536 rows in 8 and 64 sequences. Per shape, forward and
forward+backward (dx, dweight):

  ours   custom_ops.causal_conv1d and its backward (custom_ops.gdn.kernels)
  FLA    fla.modules.causal_conv1d.ops causal_conv1d_fwd / causal_conv1d_bwd, called as this
         package called them before (sync-free chunk indices, custom_ops.gdn.op.fla_varlen_indices)

Times: median of triton.testing.do_bench (ms); "GB/s": the bytes a fused kernel must move
(forward: read x, write y; forward+backward: that plus read x and dy, write dx) over the time.
Before timing, our outputs and gradients are checked against FLA's (bf16 rel_error).

``--gather`` times the conv of one rank of the W = 2 layer on rows that arrive permuted (the
all-to-all's rank order; the 4096 q, k, v channels and the 32 b, a columns beside them),
compiled, forward+backward: ``thd_rank_to_seq_order`` then the conv (the gradient assembled
for both column ranges, then ``thd_seq_to_rank_order``), against ``causal_conv1d_gather``,
which reads the rows where they are and writes their gradient back the same way. Both as
wall time (at these sizes partly the host's: two compiled graphs and autograd) and as the
device time of their kernels (torch.profiler, summed).

Results (benchmarks/runner.py): ``conv`` or ``conv-gather``.
"""

from __future__ import annotations

import argparse

import torch

import custom_ops
from benchmarks.cases import random_lengths as _lengths
from benchmarks.internals import fla_varlen_indices
from benchmarks.runner import Result, add_out_argument, emit, environment
from benchmarks.timing import kernel_ms, median_ms
from custom_ops.testing import rel_error

CHANNELS = (8192, 4096)  # 2*Hk*dk + Hv*dv on one GPU, and on one rank of W = 2
EXTRA = 64  # the b, a columns beside the conv channels in the projection output (one GPU)
KERNEL = 4
TOKENS, SEQS = (32768, 65536), (8, 64)
TOLERANCE = 1e-2  # bf16, two kernels summing in different orders


def fla_conv(x, w, cu):
    """FLA's forward and backward as a pair of callables, with sync-free chunk indices."""
    from fla.modules.causal_conv1d.ops import causal_conv1d_bwd, causal_conv1d_fwd

    cu_ext, idx = fla_varlen_indices(cu, x.shape[0])
    kw = dict(weight=w, bias=None, residual=None, initial_state=None, activation="silu", cu_seqlens=cu_ext,
              chunk_indices=idx, chunk_size=64)  # fmt: skip

    def fwd():
        return causal_conv1d_fwd(x=x.unsqueeze(0), output_final_state=False, **kw)[0].view(x.shape)

    def bwd(dy):
        dx, dw, *_ = causal_conv1d_bwd(x=x.unsqueeze(0), dy=dy.unsqueeze(0), dht=None, **kw)
        return dx.view(x.shape), dw

    return fwd, bwd


def ours_conv(x, w, cu):
    def fwd():
        return custom_ops.causal_conv1d(x, w, None, cu, "silu")

    def bwd(dy):
        dx, dw, _ = torch.ops.cp_ops.causal_conv1d_backward(dy, x, w, None, cu, "silu")
        return dx, dw

    return fwd, bwd


def bench_shape(total: int, num_seqs: int, channels: int) -> dict[str, float]:
    lens = _lengths(total, num_seqs, torch.Generator().manual_seed(total + num_seqs))
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    proj = torch.randn(total, channels + EXTRA, device="cuda", dtype=torch.bfloat16)
    x = proj[:, :channels]
    w = (torch.randn(channels, KERNEL, device="cuda") / KERNEL**0.5).to(torch.bfloat16)
    dy = torch.randn(total, channels, device="cuda", dtype=torch.bfloat16)
    forms = {"ours": ours_conv(x, w, cu), "FLA": fla_conv(x, w, cu)}
    (of, ob), (ff, fb) = forms["ours"], forms["FLA"]
    out = {"err y": rel_error(of(), ff())}
    (odx, odw), (fdx, fdw) = ob(dy), fb(dy)
    out["err dx"], out["err dw"] = rel_error(odx, fdx), rel_error(odw, fdw.to(odw.dtype))
    worst = max(out.values())
    if not worst < TOLERANCE:
        raise AssertionError(f"T={total} B={num_seqs} C={channels}: ours against FLA rel_error {worst:.3g}")
    tensor_gb = total * channels * 2 / 1e9
    for name, (fwd, bwd) in forms.items():
        out[f"{name} fwd"] = median_ms(fwd)
        out[f"{name} fwd+bwd"] = median_ms(lambda: (fwd(), bwd(dy)))
        out[f"{name} fwd GB/s"] = 2 * tensor_gb / out[f"{name} fwd"] * 1e3
        out[f"{name} fwd+bwd GB/s"] = 5 * tensor_gb / out[f"{name} fwd+bwd"] * 1e3
    out["FLA / ours, fwd+bwd"] = out["FLA fwd+bwd"] / out["ours fwd+bwd"]
    return out


def bench_gather(
    total: int, num_seqs: int, channels: int = 4096, extra: int = 32, world: int = 2, device: str = "cuda"
) -> dict[str, float]:
    """ms of the two forms of the conv on permuted rows (see the module docstring), compiled; on
    a CPU device only their agreement (the ms entries left out)."""
    from cp_ops.layout import pad_cu_seqlens
    from custom_ops.thd_index import rank_to_seq_index

    lens = _lengths(total, num_seqs, torch.Generator().manual_seed(total + num_seqs))
    _, cup = pad_cu_seqlens(lens, world)
    cup = cup.to(torch.int32).to(device)
    rows_total = int(cup[-1])
    recv = torch.randn(rows_total, channels + extra, device=device, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(channels, KERNEL, device=device) / KERNEL**0.5).to(torch.bfloat16).requires_grad_()
    rows = rank_to_seq_index(cup, world, rows_total)
    dy = torch.randn(rows_total, channels, device=device, dtype=torch.bfloat16)
    dtail = torch.randn(rows_total, extra, device=device, dtype=torch.bfloat16)

    def reorder_then_conv(recv, w):
        xs = custom_ops.thd_rank_to_seq_order(recv, cup, world)
        return custom_ops.causal_conv1d(xs[:, :channels], w, None, cup, "silu"), xs[:, channels:]

    def gather_conv(recv, w):
        return custom_ops.causal_conv1d_gather(recv, rows, w, None, cup, "silu")

    out, grads = {}, {}
    for name, form in (("reorder + conv", reorder_then_conv), ("gather conv", gather_conv)):
        fn = torch.compile(form, fullgraph=True)

        def step(fn=fn):
            y, tail = fn(recv, w)
            return (y.detach(), *torch.autograd.grad([y, tail], [recv, w], [dy, dtail]))

        grads[name] = step()
        if device == "cuda":
            out[f"{name} fwd+bwd"] = median_ms(step)
            out[f"{name} fwd+bwd, kernel time"] = kernel_ms(step)
    for label, a, b in zip(("y", "dx", "dw"), *grads.values()):
        out[f"err {label}"] = rel_error(a, b)
    if not max(v for k, v in out.items() if k.startswith("err")) < TOLERANCE:
        raise AssertionError(f"T={total} B={num_seqs}: the two forms disagree: {out}")
    if device == "cuda":
        for suffix in ("", ", kernel time"):
            out[f"reorder + conv / gather conv{suffix}"] = (
                out[f"reorder + conv fwd+bwd{suffix}"] / out[f"gather conv fwd+bwd{suffix}"]
            )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_out_argument(parser)
    parser.add_argument(
        "--gather", action="store_true", help="time the conv on permuted rows: reorder + conv against the gathered conv"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_conv needs a CUDA device")
    torch.manual_seed(0)
    if args.gather:
        cases = [(t, b, 4096) for t in TOKENS for b in SEQS]
        results = [bench_gather(t, b, c) for t, b, c in cases]
        title = "causal conv1d of rows in rank order (one rank of W = 2: 4096 channels + 32 columns), compiled"
        name = "conv-gather"
    else:
        cases = [(t, b, c) for c in CHANNELS for t in TOKENS for b in SEQS]
        results = [bench_shape(*case) for case in cases]
        title = f"causal conv1d (kernel {KERNEL}, silu, bf16), ours against FLA's"
        name = "conv"
    keys = list(results[0])
    rows = [[k] + [r[k] if "err" not in k else f"{r[k]:.1e}" for r in results] for k in keys]
    notes = "times in ms (median, do_bench); GB/s = bytes a fused kernel moves / time"
    header = [""] + [f"T={t} B={b} C={c}" for t, b, c in cases]
    emit([Result("conv", title, header, rows, notes, environment(), name=name)], args.out)


if __name__ == "__main__":
    main()
