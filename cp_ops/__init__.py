"""Context-parallel building blocks for hybrid linear-attention models on packed THD sequences.

``cp_ops`` is the public Python API of the layers and of what prepares their data (layout
helpers, overlapped exchanges, layers); the torch.library ops, collectives, index maps and checks
it builds on are exported by ``custom_ops`` and registered as ``torch.ops.cp_ops.*`` on import.
Each name here is defined in one module of this package and exported here alone.
``COMPILE_OPTIONS`` are the Inductor options that keep the layers' all-to-alls overlapped with
work: ``torch.compile(model, options=COMPILE_OPTIONS)``.
"""

import custom_ops  # noqa: F401  (registers torch.ops.cp_ops.*)
from cp_ops.attention import Attention
from cp_ops.exchange import thd_cp2hp_blocks, thd_cp2hp_overlap, thd_hp2cp_blocks
from cp_ops.gdn import GatedDeltaNet, from_qwen3_next_state_dict
from cp_ops.gdn_strategies import StatePassing
from cp_ops.layout import local_cu_seqlens, pack, pad_cu_seqlens, shard_thd, unshard_thd
from cp_ops.scheduling import COMPILE_OPTIONS

__version__ = "0.1.0"

__all__ = [
    "pad_cu_seqlens",
    "local_cu_seqlens",
    "shard_thd",
    "unshard_thd",
    "pack",
    "thd_cp2hp_overlap",
    "thd_cp2hp_blocks",
    "thd_hp2cp_blocks",
    "COMPILE_OPTIONS",
    "GatedDeltaNet",
    "StatePassing",
    "Attention",
    "from_qwen3_next_state_dict",
]
