"""The segment-attention kernels (docs/design.md section 5), gathered from the modules that
define them: the tile schedule (schedule.py), the forward (forward.py) and the backward
(backward.py). Their per-tile pieces are in tiles.py, their launch configurations and settings
in configs.py, their launchers in launch.py."""

from custom_ops.varlen_attention.backward import varlen_attn_bwd_dkdv_kernel, varlen_attn_bwd_dq_kernel
from custom_ops.varlen_attention.configs import has_tma_config, kernel_config
from custom_ops.varlen_attention.forward import varlen_attn_fwd_kernel
from custom_ops.varlen_attention.schedule import key_tile_segments_kernel, segment_tables_kernel

__all__ = [
    "segment_tables_kernel",
    "key_tile_segments_kernel",
    "varlen_attn_fwd_kernel",
    "varlen_attn_bwd_dq_kernel",
    "varlen_attn_bwd_dkdv_kernel",
    "kernel_config",
    "has_tma_config",
]
