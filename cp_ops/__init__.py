"""Context-parallel building blocks for hybrid linear-attention models on packed THD sequences.

``cp_ops`` is the public Python API (layout helpers, collectives, layers);
the torch.library ops it builds on live in ``custom_ops`` and are registered as
``torch.ops.cp_ops.*`` on import. ``COMPILE_OPTIONS`` are the Inductor options that keep the
layers' all-to-alls overlapped with work: ``torch.compile(model, options=COMPILE_OPTIONS)``.
"""

import custom_ops  # noqa: F401  (registers torch.ops.cp_ops.*)
from cp_ops.attention import Attention
from cp_ops.exchange import thd_cp2hp_blocks, thd_cp2hp_overlap, thd_hp2cp_blocks
from cp_ops.gdn import GatedDeltaNet, from_qwen3_next_state_dict
from cp_ops.gdn_strategies import StatePassing
from cp_ops.layout import (
    local_cu_seqlens,
    local_positions,
    pack,
    pad_cu_seqlens,
    rank_to_seq_index,
    seq_to_rank_index,
    shard_thd,
    unshard_thd,
    validate_offsets,
    validate_thd,
)
from cp_ops.scheduling import COMPILE_OPTIONS
from custom_ops import (
    ag_thd_attention,
    ag_thd_attention_reference,
    ag_thd_segments,
    all_gather_rows,
    all_to_all_rows,
    group_rank,
    group_size,
    reduce_scatter_rows,
    resolve_group,
    thd_cp2hp,
    thd_cp2hp_reference,
    thd_hp2cp,
    thd_hp2cp_reference,
)
from custom_ops.validation import checks_enabled, set_checks

__version__ = "0.1.0"

__all__ = [
    "set_checks",
    "checks_enabled",
    "pad_cu_seqlens",
    "validate_thd",
    "validate_offsets",
    "local_cu_seqlens",
    "local_positions",
    "shard_thd",
    "unshard_thd",
    "pack",
    "seq_to_rank_index",
    "rank_to_seq_index",
    "resolve_group",
    "group_size",
    "group_rank",
    "all_gather_rows",
    "reduce_scatter_rows",
    "all_to_all_rows",
    "thd_cp2hp",
    "thd_cp2hp_overlap",
    "thd_cp2hp_blocks",
    "COMPILE_OPTIONS",
    "thd_hp2cp",
    "thd_hp2cp_blocks",
    "thd_cp2hp_reference",
    "thd_hp2cp_reference",
    "GatedDeltaNet",
    "StatePassing",
    "Attention",
    "ag_thd_attention",
    "ag_thd_attention_reference",
    "ag_thd_segments",
    "from_qwen3_next_state_dict",
]
