"""Every name the benchmarks take from the op layer's private modules, imported here alone, so a
module moving inside custom_ops changes this file only. The rest of benchmarks/ uses the public
API (``custom_ops``, ``custom_ops.thd.index``, ``custom_ops.testing``, ``cp_ops``)."""

from custom_ops.fla.adapter import fla_varlen_indices
from custom_ops.fla.configs import autotuner_of, recorded_configs_path
from custom_ops.segment_attention import launch as attention_launch
from custom_ops.segment_attention.configs import ATTENTION_SETTINGS as DEFAULT_SETTINGS
from custom_ops.segment_attention.configs import CONFIGS, KERNELS, AttentionSettings, kernel_config
from custom_ops.segment_attention.reference import resolve_scale
from custom_ops.thd_reorder.reference import thd_seq_to_rank_order_loop
from custom_ops.valid_tokens.reference import valid_token_mask

__all__ = [
    "AttentionSettings", "CONFIGS", "DEFAULT_SETTINGS", "KERNELS", "attention_launch", "autotuner_of",
    "fla_varlen_indices", "kernel_config", "recorded_configs_path", "resolve_scale", "thd_seq_to_rank_order_loop",
    "valid_token_mask",
]  # fmt: skip
