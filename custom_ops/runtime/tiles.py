"""Host arithmetic for grids and the tile of the row-moving kernels (reorder, valid-token copy)."""

from __future__ import annotations

import functools
from dataclasses import dataclass


# Host arithmetic for grids and tiles. Triton's own ``triton.cdiv`` and
# ``triton.next_power_of_2`` are constexpr functions, which unwrap their arguments at every
# host call and cost microseconds each.
def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of 2 >= n, for n >= 1 (0 for 0, as Triton's)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


@dataclass(frozen=True)
class RowTile:
    """Tile shape of the row-moving kernels (reorder, valid-token copy): a program moves whole
    rows of up to ``max_row_bytes`` bytes, about ``tile_bytes`` in all, with ``num_warps``."""

    tile_bytes: int = 16384
    max_row_bytes: int = 8192
    num_warps: int = 4


# The tile the ops launch with; a benchmark sweeps others by passing them to :func:`row_tile`.
# The defaults were picked on an H100 (docs/benchmarks.md, section "THD layout ops").
ROW_TILE = RowTile()


def row_tile(cols: int, word_bytes: int, tile: RowTile = ROW_TILE) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_D, num_warps) for a row-moving kernel over ``[T, cols]`` words.

    A program moves BLOCK_R whole rows of up to ``tile.max_row_bytes`` bytes, about
    ``tile.tile_bytes`` in all; wider rows are split over a second grid axis.
    """
    if type(cols) is int:  # not a SymInt of a traced graph: the answer is cached
        return _cached_row_tile(cols, word_bytes, tile)
    return _row_tile(cols, word_bytes, tile)


@functools.lru_cache(maxsize=1024)
def _cached_row_tile(cols: int, word_bytes: int, tile: RowTile) -> tuple[int, int, int]:
    return _row_tile(cols, word_bytes, tile)


def _row_tile(cols, word_bytes: int, tile: RowTile) -> tuple[int, int, int]:
    block_d = max(1, min(next_power_of_2(max(cols, 1)), tile.max_row_bytes // word_bytes))
    block_r = max(1, min(64, tile.tile_bytes // (block_d * word_bytes)))
    return block_r, block_d, tile.num_warps
