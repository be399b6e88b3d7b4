"""torch.library ops (namespace ``cp_ops``) for context parallelism on packed THD sequences.

Importing this package registers every op, reachable as ``custom_ops.<name>`` and
``torch.ops.cp_ops.<name>`` (:data:`custom_ops.ops.OPS` lists them), each family a folder
``custom_ops/<family>/``, its shared machinery in ``custom_ops/runtime/`` (docs/design.md section
6), the THD layout (index maps, checks, checked mode) in ``custom_ops/thd/``. This module is the
public API: op wrappers, references and the helpers the layers in ``cp_ops`` build on, each
defined in one module and exported here alone; beside it :mod:`custom_ops.env` (environment
variables, docs/environment.md) and :mod:`custom_ops.testing`. ``NAMESPACE`` is the ops'
namespace, ``"cp_ops"``; ``L2NORM_EPS`` the q/k l2 norm's epsilon (FLA's and Qwen3-Next's, 1e-6)
that ``causal_conv1d_gather`` applies. Importing it tags torch.compile's caches with the
library's source (:mod:`custom_ops.runtime.compile_cache`).
"""

from custom_ops import env
from custom_ops.ag_attention.op import ag_thd_attention
from custom_ops.ag_attention.reference import ag_thd_attention_reference
from custom_ops.ag_attention.segments import ag_thd_segments
from custom_ops.all_to_all.op import check_cp2hp, check_hp2cp, thd_cp2hp, thd_hp2cp
from custom_ops.all_to_all.reference import thd_cp2hp_reference, thd_hp2cp_reference
from custom_ops.check_layout import op as _check_layout  # noqa: F401  (registers cp_ops::check_layout)
from custom_ops.conv1d.op import causal_conv1d, causal_conv1d_gather
from custom_ops.conv1d.reference import L2NORM_EPS, causal_conv1d_gather_reference, causal_conv1d_reference
from custom_ops.cross_entropy.op import default_chunk_rows, linear_cross_entropy
from custom_ops.cross_entropy.reference import linear_cross_entropy_reference
from custom_ops.fla.adapter import fla_module
from custom_ops.gated_delta_rule.dual_chunks import chunk_gated_delta_rule_dual_chunks, state_maps
from custom_ops.gated_delta_rule.op import chunk_gated_delta_rule, chunk_gated_delta_rule_with_state
from custom_ops.gated_delta_rule.reference import (
    chunk_gated_delta_rule_reference,
    chunk_gated_delta_rule_with_state_reference,
    state_dtype,
)
from custom_ops.grouped_matmul.op import segment_matmul
from custom_ops.grouped_matmul.reference import segment_matmul_reference
from custom_ops.mlp.op import default_tile_rows, swiglu_mlp
from custom_ops.mlp.reference import swiglu_mlp_reference
from custom_ops.runtime.collectives import all_gather_rows, all_to_all_rows, overlapped_exchange, reduce_scatter_rows
from custom_ops.runtime.compile_cache import tag_compile_caches
from custom_ops.runtime.groups import group_rank, group_size, resolve_group
from custom_ops.runtime.registration import NAMESPACE, kernels_visible_to_compiler
from custom_ops.sections.op import (
    permute_sections,
    rank_blocks_to_sections,
    sections_to_rank_blocks,
    unpermute_sections,
)
from custom_ops.sections.reference import permute_sections_reference, unpermute_sections_reference
from custom_ops.segment_attention.op import check_gqa_heads, varlen_attention
from custom_ops.segment_attention.reference import varlen_attention_reference
from custom_ops.thd.checked_mode import call_checked, checks_enabled, set_checks
from custom_ops.thd.checks import check_cp_size, check_index_tensor
from custom_ops.thd.index import (
    chunk_rows,
    chunk_spans,
    local_chunk_bounds,
    local_chunks,
    local_offsets,
    local_positions,
    padding_multiple,
    rank_to_seq_index,
    seq_to_rank_index,
    shard_rows,
    valid_rows,
)
from custom_ops.thd.validation import (
    checked,
    validate_cumulative,
    validate_offsets,
    validate_padded,
    validate_permutation,
    validate_thd,
    validate_varlen_segments,
)
from custom_ops.thd_reorder.op import thd_rank_to_seq_order, thd_seq_to_rank_order
from custom_ops.thd_reorder.reference import thd_rank_to_seq_order_reference, thd_seq_to_rank_order_reference
from custom_ops.valid_tokens.op import thd_copy_valid_tokens, thd_copy_valid_tokens_
from custom_ops.valid_tokens.reference import thd_copy_valid_tokens_reference

tag_compile_caches()  # compiled graphs cached by another version of these ops are not loaded

__all__ = [
    "fla_module",
    # layout ops
    "thd_seq_to_rank_order",
    "thd_rank_to_seq_order",
    "thd_copy_valid_tokens",
    "thd_copy_valid_tokens_",
    "permute_sections",
    "unpermute_sections",
    "sections_to_rank_blocks",
    "rank_blocks_to_sections",
    # CP exchanges and attention
    "thd_cp2hp",
    "thd_hp2cp",
    "varlen_attention",
    "ag_thd_attention",
    "ag_thd_segments",
    # Gated DeltaNet core
    "causal_conv1d",
    "causal_conv1d_gather",
    "chunk_gated_delta_rule",
    "chunk_gated_delta_rule_with_state",
    "chunk_gated_delta_rule_dual_chunks",
    "state_maps",
    "state_dtype",
    "segment_matmul",
    # the loss
    "linear_cross_entropy",
    "default_chunk_rows",
    "swiglu_mlp",
    "default_tile_rows",
    # references
    "thd_seq_to_rank_order_reference",
    "thd_rank_to_seq_order_reference",
    "thd_copy_valid_tokens_reference",
    "permute_sections_reference",
    "unpermute_sections_reference",
    "thd_cp2hp_reference",
    "thd_hp2cp_reference",
    "varlen_attention_reference",
    "ag_thd_attention_reference",
    "causal_conv1d_reference",
    "L2NORM_EPS",
    "causal_conv1d_gather_reference",
    "chunk_gated_delta_rule_reference",
    "chunk_gated_delta_rule_with_state_reference",
    "segment_matmul_reference",
    "linear_cross_entropy_reference",
    "swiglu_mlp_reference",
    # the THD layout: index maps, checks, the checked mode
    "padding_multiple",
    "local_chunks",
    "local_offsets",
    "chunk_rows",
    "local_chunk_bounds",
    "valid_rows",
    "local_positions",
    "shard_rows",
    "seq_to_rank_index",
    "rank_to_seq_index",
    "chunk_spans",
    "check_index_tensor",
    "check_cp_size",
    "validate_cumulative",
    "validate_padded",
    "validate_thd",
    "validate_offsets",
    "validate_permutation",
    "validate_varlen_segments",
    "set_checks",
    "checks_enabled",
    "checked",
    "call_checked",
    # helpers: groups, collectives, op checks
    "resolve_group",
    "group_size",
    "group_rank",
    "all_gather_rows",
    "reduce_scatter_rows",
    "all_to_all_rows",
    "overlapped_exchange",
    "check_gqa_heads",
    "check_cp2hp",
    "check_hp2cp",
    "kernels_visible_to_compiler",
    "NAMESPACE",
    "env",
]
