"""THD layout ops on one GPU against the copy floor (a clone), an index_select with a
permutation built beforehand, and a Python loop over (rank, sequence); eager and compiled.

    python -m benchmarks.bench_thd_layout [--out DIR]

Writes the result ``layout`` (benchmarks/runner.py).
"""

from __future__ import annotations

import argparse

import torch

import custom_ops
from benchmarks.cases import layout_shapes as shapes
from benchmarks.internals import thd_seq_to_rank_order_loop
from benchmarks.runner import Result, add_out_argument, checks_off, emit, environment
from benchmarks.timing import median_ms
from cp_ops import pad_cu_seqlens
from custom_ops import seq_to_rank_index


def run() -> Result:
    rows = []
    for name, seqlens, trailing in shapes():
        for w in (2, 4, 8):
            cu, cup = pad_cu_seqlens(seqlens, w, device="cuda")
            num_rows = int(cup[-1])
            x = torch.randn((num_rows,) + trailing, device="cuda", dtype=torch.bfloat16)
            src = torch.randn_like(x)
            perm = seq_to_rank_index(cup.cpu(), w, num_rows).cuda()
            gbytes = 2 * x.numel() * x.element_size() / 1e9

            def to_rank():
                return custom_ops.thd_seq_to_rank_order(x, cup, w)

            assert torch.equal(to_rank(), x.index_select(0, perm))
            dst_inplace = x.clone()
            t = {
                "clone": median_ms(lambda: x.clone()),
                "index_select": median_ms(lambda: x.index_select(0, perm)),
                "loop": median_ms(lambda: thd_seq_to_rank_order_loop(x, cup, w), rep_ms=100),
                "seq_to_rank": median_ms(to_rank),
                "rank_to_seq": median_ms(lambda: custom_ops.thd_rank_to_seq_order(x, cup, w)),
                "copy_valid": median_ms(lambda: custom_ops.thd_copy_valid_tokens(x, src, cup, cu)),
                "copy_valid_": median_ms(lambda: custom_ops.thd_copy_valid_tokens_(dst_inplace, src, cup, cu)),
            }
            compiled_fn = torch.compile(lambda a: torch.ops.cp_ops.thd_seq_to_rank_order(a, cup, w), fullgraph=True)
            compiled_copy = torch.compile(
                lambda d, s: torch.ops.cp_ops.thd_copy_valid_tokens(d, s, cup, cu), fullgraph=True
            )

            def compiled_inplace(d, s):
                torch.ops.cp_ops.thd_copy_valid_tokens_(d, s, cup, cu)
                return d

            compiled_inplace = torch.compile(compiled_inplace, fullgraph=True)
            t["seq_to_rank compiled"] = median_ms(lambda: compiled_fn(x))
            t["copy_valid compiled"] = median_ms(lambda: compiled_copy(x, src))
            t["copy_valid_ compiled"] = median_ms(lambda: compiled_inplace(dst_inplace, src))
            worst = max(t["seq_to_rank"], t["rank_to_seq"], t["copy_valid"]) / t["clone"]
            rows.append([name, w, *t.values(), worst, gbytes / t["seq_to_rank"]])
    header = ["shape (bf16)", "W", *(f"{k} ms" for k in t), "worst op / clone", "seq_to_rank TB/s"]
    return Result("thd_layout", "THD layout ops against the copy floor", header, rows, env=environment(),
                  name="layout", formats={"W": "{:d}", "worst op / clone": "{:.2f}x", "seq_to_rank TB/s": "{:.2f}"})


def main() -> None:
    checks_off()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_out_argument(parser)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA device")
    emit([run()], args.out)


if __name__ == "__main__":
    main()
