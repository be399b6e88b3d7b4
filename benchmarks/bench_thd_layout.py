"""THD layout ops on one GPU against the copy floor and the two usual ways of doing it.

For each shape and CP size W:
  clone        x.clone(): the copy floor (every op reads T rows and writes T rows)
  index_select x.index_select(0, perm) with the permutation built on the host beforehand
               (building it costs a host round trip per packing, not counted here)
  loop         a Python loop over (rank, sequence) slicing chunks and concatenating them
  ops          thd_seq_to_rank_order, thd_rank_to_seq_order, thd_copy_valid_tokens
               (functional: T rows in and out) and thd_copy_valid_tokens_ (in place:
               valid rows only), eager and inside torch.compile

    python -m benchmarks.bench_thd_layout [--out DIR] [--sweep]

Writes the results ``layout``, ``layout-in-graph`` and, with --sweep, ``layout-tile-sweep``
(benchmarks/runner.py). --sweep also times the reorder's kernel under a few tile shapes
(custom_ops._common.RowTile; the ops launch with ROW_TILE).
"""

from __future__ import annotations

import argparse

import torch

import custom_ops
from benchmarks.cases import layout_shapes as shapes
from benchmarks.runner import Result, add_out_argument, emit, environment
from benchmarks.timing import median_ms
from cp_ops import pad_cu_seqlens, seq_to_rank_index
from custom_ops.thd_reorder.reference import thd_seq_to_rank_order_loop


def run(sweep: bool) -> list[Result]:
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
            t["seq_to_rank (compiled)"] = median_ms(lambda: compiled_fn(x))
            t["copy_valid (compiled)"] = median_ms(lambda: compiled_copy(x, src))
            t["copy_valid_ (compiled)"] = median_ms(lambda: compiled_inplace(dst_inplace, src))
            rows.append(
                [name, w, t["clone"], t["index_select"], t["loop"], t["seq_to_rank"], t["rank_to_seq"],
                 t["copy_valid"], t["copy_valid_"], t["seq_to_rank (compiled)"], t["copy_valid (compiled)"],
                 t["copy_valid_ (compiled)"],
                 max(t["seq_to_rank"], t["rank_to_seq"], t["copy_valid"]) / t["clone"],
                 gbytes / t["seq_to_rank"]]
            )
    header = ["shape (bf16)", "W", "clone ms", "index_select ms", "loop ms", "seq_to_rank ms", "rank_to_seq ms",
              "copy_valid ms", "copy_valid_ ms", "seq_to_rank compiled ms", "copy_valid compiled ms",
              "copy_valid_ compiled ms",
              "worst op / clone", "seq_to_rank TB/s"]
    env = environment()
    results = [
        Result("thd_layout", "THD layout ops against the copy floor", header, rows, env=env, name="layout",
               formats={"W": "{:d}", "worst op / clone": "{:.2f}x", "seq_to_rank TB/s": "{:.2f}"}),
        inplace_in_graph(env),
    ]  # fmt: skip
    if sweep:
        results.append(tile_sweep(env))
    return results


def inplace_in_graph(env: dict) -> Result:
    """Functional vs in-place copy where dst is an intermediate of the compiled graph (as when a
    layer assembles its output from two partial results), not a graph input."""
    rows = []
    for name, seqlens, trailing in shapes()[:2]:
        cu, cup = pad_cu_seqlens(seqlens, 2, device="cuda")
        a = torch.randn((int(cup[-1]),) + trailing, device="cuda", dtype=torch.bfloat16)
        b = torch.randn_like(a)

        def functional(a, b):
            return torch.ops.cp_ops.thd_copy_valid_tokens(a * 2, b * 3, cup, cu)

        def in_place(a, b):
            out = a * 2
            torch.ops.cp_ops.thd_copy_valid_tokens_(out, b * 3, cup, cu)
            return out

        f, g = torch.compile(functional, fullgraph=True), torch.compile(in_place, fullgraph=True)
        assert torch.equal(f(a, b), g(a, b))
        rows.append([name, median_ms(lambda: f(a, b)), median_ms(lambda: g(a, b))])
    header = ["copy inside a compiled graph (dst intermediate), W=2", "functional ms", "in-place ms"]
    return Result("thd_layout", "Functional against in-place copy inside a compiled graph", header, rows, env=env,
                  name="layout-in-graph")  # fmt: skip


def seq_to_rank_with_tile(x: torch.Tensor, cu_seqlens_padded: torch.Tensor, cp_size: int, tile) -> torch.Tensor:
    """``thd_seq_to_rank_order(x, ...)`` by its kernel launched with the tile shape ``tile`` (a
    ``custom_ops._common.RowTile``) in place of the default ``ROW_TILE``: what the op's launcher
    does, with the tile as an argument."""
    from custom_ops.runtime.tiles import cdiv, row_tile
    from custom_ops.runtime.words import as_words, from_words
    from custom_ops.runtime.launch import launch_direct
    from custom_ops.thd_reorder.kernels import thd_reorder_kernel

    words = as_words(x)
    out = torch.empty_like(words)
    rows, cols = words.shape
    block_r, block_d, num_warps = row_tile(cols, words.element_size(), tile)
    launch_direct(thd_reorder_kernel, (cdiv(rows, block_r), cdiv(cols, block_d)), words, out, cu_seqlens_padded,
                  cu_seqlens_padded.shape[0] - 1, rows, cols, cp_size, TO_RANK=True, BLOCK_R=block_r,
                  BLOCK_D=block_d, num_warps=num_warps)  # fmt: skip
    return from_words(out, x.dtype, x.shape)


def tile_sweep(env: dict) -> Result:
    """Reorder time under several tile shapes, at the first two shapes with W = 4."""
    configs = [
        {"tile_bytes": 8192, "max_row_bytes": 4096, "num_warps": 4},
        {"tile_bytes": 16384, "max_row_bytes": 8192, "num_warps": 4},
        {"tile_bytes": 16384, "max_row_bytes": 8192, "num_warps": 8},
        {"tile_bytes": 32768, "max_row_bytes": 8192, "num_warps": 8},
        {"tile_bytes": 32768, "max_row_bytes": 16384, "num_warps": 8},
        {"tile_bytes": 65536, "max_row_bytes": 16384, "num_warps": 16},
    ]
    from custom_ops.runtime.tiles import RowSettings as RowTile

    rows = []
    for name, seqlens, trailing in shapes()[:2]:
        _, cup = pad_cu_seqlens(seqlens, 4, device="cuda")
        x = torch.randn((int(cup[-1]),) + trailing, device="cuda", dtype=torch.bfloat16)
        clone = median_ms(lambda: x.clone())
        want = custom_ops.thd_seq_to_rank_order(x, cup, 4)
        for cfg in configs:
            tile = RowTile(**cfg)
            if not torch.equal(seq_to_rank_with_tile(x, cup, 4, tile), want):
                raise AssertionError(f"tile {cfg} changes the result")
            ms = median_ms(lambda: seq_to_rank_with_tile(x, cup, 4, tile))
            rows.append([name, cfg["tile_bytes"], cfg["max_row_bytes"], cfg["num_warps"], ms, ms / clone])
    header = ["shape", "tile_bytes", "max_row_bytes", "num_warps", "seq_to_rank ms", "/ clone"]
    return Result("thd_layout", "seq_to_rank under several tile shapes, W = 4", header, rows, env=env,
                  name="layout-tile-sweep", formats={"/ clone": "{:.3f}x"})  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_out_argument(parser)
    parser.add_argument("--sweep", action="store_true", help="also sweep the kernels' tile shapes")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA device")
    emit(run(args.sweep), args.out)


if __name__ == "__main__":
    main()
