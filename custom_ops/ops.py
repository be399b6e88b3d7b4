"""The one list of the ops this package registers (``torch.ops.cp_ops.<name>``), by family.

``OPS`` names every op, the module whose import registers it, and whether it is public API
(``custom_ops.<name>``, README's op table) or a piece of a public op (a backward, a forward
with auxiliary outputs, a helper of a composite). ``tests/test_registry.py`` checks that the
ops registered in the namespace are exactly these.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["OPS", "Op", "public_ops", "internal_ops"]


class Op(NamedTuple):
    name: str  # the op's name in the cp_ops namespace, and its Python name where public
    module: str  # the module whose import registers it
    public: bool


OPS = (
    Op("thd_seq_to_rank_order", "custom_ops.thd_reorder.op", True),
    Op("thd_rank_to_seq_order", "custom_ops.thd_reorder.op", True),
    Op("thd_copy_valid_tokens", "custom_ops.valid_tokens.op", True),
    Op("thd_copy_valid_tokens_", "custom_ops.valid_tokens.op", True),
    Op("permute_sections", "custom_ops.sections.op", True),
    Op("unpermute_sections", "custom_ops.sections.op", True),
    Op("sections_to_rank_blocks", "custom_ops.sections.op", True),
    Op("rank_blocks_to_sections", "custom_ops.sections.op", True),
    Op("thd_cp2hp", "custom_ops.all_to_all.op", True),
    Op("thd_hp2cp", "custom_ops.all_to_all.op", True),
    Op("varlen_attention", "custom_ops.segment_attention.op", True),
    Op("varlen_attention_backward_dkdv", "custom_ops.segment_attention.op", False),
    Op("varlen_attention_backward_dq", "custom_ops.segment_attention.op", False),
    Op("ag_thd_attention", "custom_ops.ag_attention.op", True),
    Op("group_rank_tensor", "custom_ops.ag_attention.op", False),
    Op("fa4_varlen_forward", "custom_ops.ag_attention.fa4", False),
    Op("fa4_varlen_backward", "custom_ops.ag_attention.fa4", False),
    Op("causal_conv1d", "custom_ops.conv1d.op", True),
    Op("causal_conv1d_backward", "custom_ops.conv1d.op", False),
    Op("causal_conv1d_gather", "custom_ops.conv1d.op", True),
    Op("causal_conv1d_gather_backward", "custom_ops.conv1d.op", False),
    Op("chunk_gated_delta_rule", "custom_ops.gated_delta_rule.op", True),
    Op("chunk_gated_delta_rule_with_state", "custom_ops.gated_delta_rule.op", True),
    Op("chunk_gated_delta_rule_forward", "custom_ops.gated_delta_rule.op", False),
    Op("chunk_gated_delta_rule_backward", "custom_ops.gated_delta_rule.op", False),
    Op("segment_matmul", "custom_ops.grouped_matmul.op", True),
    Op("segment_matmul_weight_grad", "custom_ops.grouped_matmul.op", False),
    Op("linear_cross_entropy", "custom_ops.cross_entropy.op", True),
    Op("linear_cross_entropy_forward", "custom_ops.cross_entropy.op", False),
    Op("swiglu_mlp", "custom_ops.mlp.op", True),
    Op("swiglu_mlp_forward", "custom_ops.mlp.op", False),
    Op("swiglu_mlp_backward", "custom_ops.mlp.op", False),
    Op("check_layout", "custom_ops.check_layout.op", False),
)


def public_ops() -> frozenset[str]:
    """The names of the ops that are API of their own."""
    return frozenset(op.name for op in OPS if op.public)


def internal_ops() -> frozenset[str]:
    """The names of the ops that are pieces of the public ones."""
    return frozenset(op.name for op in OPS if not op.public)
