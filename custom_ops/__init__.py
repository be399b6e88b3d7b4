"""torch.library ops (namespace ``cp_ops``) for context parallelism on packed THD sequences.

Importing this package registers every op, reachable as ``custom_ops.<name>``
and ``torch.ops.cp_ops.<name>``. Each op folder holds ``kernels.py`` (Triton),
``reference.py`` (pure torch, the CPU path and the test oracle) and ``op.py``
(registration, fake, autograd).
"""

from custom_ops.permute_sections.op import (
    permute_sections,
    rank_blocks_to_sections,
    sections_to_rank_blocks,
    unpermute_sections,
)
from custom_ops.permute_sections.reference import permute_sections_reference, unpermute_sections_reference
from custom_ops.gdn.op import causal_conv1d, causal_conv1d_gather, chunk_gated_delta_rule
from custom_ops.gdn.reference import (
    causal_conv1d_gather_reference,
    causal_conv1d_reference,
    chunk_gated_delta_rule_reference,
)
from custom_ops.thd_copy_valid_tokens.op import thd_copy_valid_tokens, thd_copy_valid_tokens_
from custom_ops.thd_copy_valid_tokens.reference import thd_copy_valid_tokens_reference
from custom_ops.thd_reorder.op import thd_rank_to_seq_order, thd_seq_to_rank_order
from custom_ops.thd_reorder.reference import thd_rank_to_seq_order_reference, thd_seq_to_rank_order_reference
from custom_ops.varlen_attention.op import validate_varlen_segments, varlen_attention
from custom_ops.varlen_attention.reference import varlen_attention_reference

__all__ = [
    "thd_seq_to_rank_order",
    "thd_rank_to_seq_order",
    "thd_copy_valid_tokens",
    "thd_copy_valid_tokens_",
    "varlen_attention",
    "thd_seq_to_rank_order_reference",
    "thd_rank_to_seq_order_reference",
    "thd_copy_valid_tokens_reference",
    "permute_sections",
    "unpermute_sections",
    "sections_to_rank_blocks",
    "rank_blocks_to_sections",
    "permute_sections_reference",
    "unpermute_sections_reference",
    "causal_conv1d",
    "causal_conv1d_gather",
    "chunk_gated_delta_rule",
    "causal_conv1d_reference",
    "causal_conv1d_gather_reference",
    "chunk_gated_delta_rule_reference",
    "varlen_attention_reference",
    "validate_varlen_segments",
]
