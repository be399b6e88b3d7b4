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


def rows_within(elements: int, width: int) -> int:
    """The most rows of ``width`` entries within ``elements`` entries (at least 1), a multiple of
    64 where that is at least 64 (row counts the GEMMs tile evenly): the default chunk of the
    ops that run over row chunks."""
    rows = max(1, elements // max(width, 1))
    return rows // 64 * 64 if rows >= 64 else rows


@dataclass(frozen=True)
class RowSettings:
    """Tile shape of the row-moving kernels (reorder, valid-token copy): a program moves whole
    rows of up to ``max_row_bytes`` bytes, about ``tile_bytes`` in all, with ``num_warps``."""

    tile_bytes: int = 16384
    max_row_bytes: int = 8192
    num_warps: int = 4


# the settings the ops launch with (docs/benchmarks.md, "THD layout ops"); a benchmark passes others
ROW_SETTINGS = RowSettings()


def row_tile(cols: int, word_bytes: int, settings: RowSettings = ROW_SETTINGS) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_D, num_warps) for a row-moving kernel over ``[T, cols]`` words.

    A program moves BLOCK_R whole rows of up to ``settings.max_row_bytes`` bytes, about
    ``settings.tile_bytes`` in all; wider rows are split over a second grid axis.
    """
    if type(cols) is int:  # not a SymInt of a traced graph: the answer is cached
        return _cached_row_tile(cols, word_bytes, settings)
    return _row_tile(cols, word_bytes, settings)


@functools.lru_cache(maxsize=1024)
def _cached_row_tile(cols: int, word_bytes: int, settings: RowSettings) -> tuple[int, int, int]:
    return _row_tile(cols, word_bytes, settings)


def _row_tile(cols, word_bytes: int, settings: RowSettings) -> tuple[int, int, int]:
    block_d = max(1, min(next_power_of_2(max(cols, 1)), settings.max_row_bytes // word_bytes))
    block_r = max(1, min(64, settings.tile_bytes // (block_d * word_bytes)))
    return block_r, block_d, settings.num_warps
