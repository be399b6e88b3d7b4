"""The Gated DeltaNet core ops (causal depthwise conv1d, chunked gated delta rule) on packed
THD sequences: importing this module registers them. The conv ops are in
:mod:`custom_ops.gdn.conv`, the delta-rule ops in :mod:`custom_ops.gdn.delta_rule`, and how
both call flash-linear-attention (FLA) without host syncs in :mod:`custom_ops.gdn.fla`.
"""

from custom_ops.gdn.conv import causal_conv1d, causal_conv1d_gather
from custom_ops.gdn.delta_rule import chunk_gated_delta_rule
from custom_ops.gdn.fla import fla_varlen_indices

__all__ = ["causal_conv1d", "causal_conv1d_gather", "chunk_gated_delta_rule", "fla_varlen_indices"]
