"""The index maps of the THD layout with dual-chunk CP sharding (docs/design.md section 1): the
public names of :mod:`custom_ops.runtime.thd_index`."""

from custom_ops.runtime.thd_index import (
    chunk_rows,
    chunk_spans,
    local_chunks,
    local_offsets,
    local_positions,
    padding_multiple,
    rank_to_seq_index,
    seq_to_rank_index,
    shard_rows,
    valid_rows,
)

__all__ = [
    "padding_multiple",
    "local_chunks",
    "local_offsets",
    "chunk_rows",
    "valid_rows",
    "local_positions",
    "shard_rows",
    "seq_to_rank_index",
    "rank_to_seq_index",
    "chunk_spans",
]
