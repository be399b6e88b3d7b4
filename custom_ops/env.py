"""Every environment variable the library reads or sets, each described once (:data:`VARIABLES`)
and read through a typed accessor here; docs/environment.md is the table :func:`markdown_table`
renders (a test keeps the two equal).

A malformed value raises ``ValueError`` naming the variable and the accepted values, when the
variable is read: at import for the ones read then, at the call for the others.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = [
    "VARIABLES",
    "Variable",
    "attention_backend",
    "checks",
    "fla_configs",
    "gdn_backend",
    "inductor_compile_threads_set",
    "markdown_table",
    "omp_threads_set",
    "opaque_kernels",
    "parse",
    "precompile",
    "set_nvlink_multicast_off",
    "torchrun_ranks",
    "torchrun_restart_count",
    "triton_interpret",
]


@dataclass(frozen=True)
class Variable:
    """One environment variable: its accepted values (``None``: any value, only whether it is set
    counts), its value when unset (``None``: unset has a meaning of its own, said in ``effect``),
    what it does and when the library reads it."""

    name: str
    values: tuple[str, ...] | None
    default: str | None
    effect: str
    read: str


VARIABLES: tuple[Variable, ...] = (
    Variable(
        "CP_OPS_CHECKS", ("0", "eager", "1"), "eager",
        "the checked mode: ops and layers validate their layout values (a host sync) and raise "
        "`ValueError` where they would return wrong rows; eager: in eager calls only (compiled graphs "
        "and CUDA graph captures stay sync-free), 1: every call, compiled graphs included, 0: never; "
        "`set_checks` changes it later",
        "once, on import",
    ),
    Variable(
        "CP_OPS_OPAQUE_KERNELS", ("0", "1"), None,
        "1: the kernel ops register as opaque `custom_op`s, 0: as `triton_op`s; unset: `triton_op`s "
        "unless the installed triton is newer than the one torch pins (`kernels_visible_to_compiler`)",
        "once, on import",
    ),
    Variable(
        "CP_OPS_PRECOMPILE", ("0", "1"), "1",
        "0: no kernel is compiled in worker threads while `torch.compile` traces a graph "
        "(each compiles at its first launch instead)",
        "each time `torch.compile` traces an op on CUDA tensors",
    ),
    Variable(
        "CP_OPS_FLA_CONFIGS", ("0", "1"), "1",
        "0: FLA's autotuners are not seeded with the choices recorded for the GPU's architecture "
        "(they tune at the first call)",
        "at the first GDN call on each GPU",
    ),
    Variable(
        "CP_OPS_GDN_BACKEND", ("auto", "fla", "flashqla"), "auto",
        "the gated delta rule's CUDA kernels: `flashqla` FlashQLA's (the `flashqla` extra; an error "
        "where a call does not fit it), `fla` FLA's Triton kernels, `auto` FlashQLA's where installed "
        "and the call fits it, else FLA's (FLA's for calls of at most 2 key heads, where they are the faster); "
        "CPU tensors always take the torch reference",
        "each time a GDN op is traced or called eagerly on CUDA tensors (a compiled graph keeps its choice)",
    ),
    Variable(
        "CP_OPS_ATTENTION_BACKEND", ("auto", "segment", "fa4"), "auto",
        "the all-gather CP attention's CUDA kernels: `fa4` FlashAttention 4's varlen kernels (the `fa4` "
        "extra; an error where a call does not fit them), `segment` the package's segment-attention "
        "kernels, `auto` FlashAttention 4's where installed and the call fits them, at any W, else the "
        "segment kernels; CPU tensors always take the segment path (its torch reference)",
        "each time `ag_thd_attention` is traced or called eagerly (a compiled graph keeps its choice)",
    ),
    Variable(
        "TRITON_INTERPRET", None, None,
        "1: the kernels run on CPU tensors in Triton's interpreter (Triton reads it on its import); "
        "any other value or unset: CPU tensors take the torch references",
        "at each op call on CPU tensors",
    ),
    Variable(
        "TORCHINDUCTOR_COMPILE_THREADS", None, None,
        "set (any value): the demo leaves Inductor's compile threads to it; unset: a W-rank demo "
        "gives each rank's compiles the cores divided by W",
        "by the demo, before it compiles",
    ),
    Variable(
        "OMP_NUM_THREADS", None, None,
        "set (any value): torch's host threads are left to it; unset: on CUDA each rank runs torch's "
        "host ops on one thread (`cp_ops.local_ranks.host_threads`), as torchrun sets for several ranks a node",
        "as a rank joins: examples/train_qwen3_next.py and `init_local_rank` (the spawned benchmarks "
        "and the demo; the multi-rank tests give their ranks one thread either way)",
    ),
    Variable(
        "NCCL_NVLS_ENABLE", ("0", "1"), "0",
        "NCCL's NVLink SHARP; `init_local_rank` sets 0 on CUDA when unset (NVLink multicast can put "
        "a shared host's GPUs out of service)",
        "set by `init_local_rank` on CUDA",
    ),
    Variable(
        "TORCH_SYMM_MEM_DISABLE_MULTICAST", ("0", "1"), "1",
        "torch's symmetric-memory multicast; `init_local_rank` sets 1 (off) on CUDA when unset, "
        "for the same reason",
        "set by `init_local_rank` on CUDA",
    ),
    Variable(
        "RANK", None, None,
        "set by `torchrun` with `WORLD_SIZE`, `LOCAL_RANK` and `LOCAL_WORLD_SIZE` (non-negative "
        "integers): the training recipe's place in the job; unset: the recipe runs as a group of one",
        "by examples/train_qwen3_next.py, at its start",
    ),
    Variable(
        "TORCHELASTIC_RESTART_COUNT", None, None,
        "set by `torchrun` (a non-negative integer): how often it has restarted the workers; the training "
        "recipe's test-only `--fault` injections act in the attempt they name; unset: 0",
        "by examples/train_qwen3_next.py, where it injects a fault",
    ),
)

_TORCHRUN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")

_BY_NAME = {v.name: v for v in VARIABLES}


def parse(name: str, value: str | None) -> str | None:
    """``value`` of variable ``name`` checked against its accepted values, its default when
    ``value`` is None; raises ``ValueError`` for a value it does not accept."""
    var = _BY_NAME[name]
    if value is None:
        return var.default
    if var.values is not None and value not in var.values:
        raise ValueError(f"{name} must be {', '.join(var.values[:-1])} or {var.values[-1]}, got {value!r}")
    return value


def _get(name: str) -> str | None:
    return parse(name, os.environ.get(name))


def checks() -> bool | str:
    """``CP_OPS_CHECKS``: the checked mode it starts in, True, False or ``"eager"``."""
    value = _get("CP_OPS_CHECKS")
    return value if value == "eager" else value == "1"


def opaque_kernels() -> bool | None:
    """``CP_OPS_OPAQUE_KERNELS``: True or False when forced, None when unset."""
    value = _get("CP_OPS_OPAQUE_KERNELS")
    return None if value is None else value == "1"


def precompile() -> bool:
    """``CP_OPS_PRECOMPILE``: whether tracing may compile kernels in worker threads."""
    return _get("CP_OPS_PRECOMPILE") == "1"


def fla_configs() -> bool:
    """``CP_OPS_FLA_CONFIGS``: whether FLA's autotuners are seeded with recorded choices."""
    return _get("CP_OPS_FLA_CONFIGS") == "1"


def attention_backend() -> str:
    """``CP_OPS_ATTENTION_BACKEND``: ``auto``, ``segment`` or ``fa4``."""
    return _get("CP_OPS_ATTENTION_BACKEND")


def gdn_backend() -> str:
    """``CP_OPS_GDN_BACKEND``: ``auto``, ``fla`` or ``flashqla``."""
    return _get("CP_OPS_GDN_BACKEND")


def triton_interpret() -> bool:
    """``TRITON_INTERPRET``: whether it is ``1``."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def inductor_compile_threads_set() -> bool:
    """Whether ``TORCHINDUCTOR_COMPILE_THREADS`` is set (to any value)."""
    return "TORCHINDUCTOR_COMPILE_THREADS" in os.environ


def omp_threads_set() -> bool:
    """Whether ``OMP_NUM_THREADS`` is set (to any value)."""
    return "OMP_NUM_THREADS" in os.environ


def torchrun_ranks() -> tuple[int, int, int, int] | None:
    """``(RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE)`` as torchrun sets them, or None when
    ``RANK`` is unset (not started by torchrun); ``ValueError`` when one is missing or malformed."""
    if "RANK" not in os.environ:
        return None
    values = []
    for name in _TORCHRUN:
        value = os.environ.get(name)
        if value is None or not value.isdigit():
            raise ValueError(f"{name} must be a non-negative integer (torchrun sets it), got {value!r}")
        values.append(int(value))
    return tuple(values)


def torchrun_restart_count() -> int:
    """``TORCHELASTIC_RESTART_COUNT``: how often torchrun has restarted the workers (0 when unset);
    ``ValueError`` when malformed."""
    value = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if not value.isdigit():
        raise ValueError(f"TORCHELASTIC_RESTART_COUNT must be a non-negative integer (torchrun sets it), got {value!r}")
    return int(value)


def set_nvlink_multicast_off() -> None:
    """Set ``NCCL_NVLS_ENABLE`` and ``TORCH_SYMM_MEM_DISABLE_MULTICAST`` to their defaults here
    where unset, before a process starts NCCL or symmetric memory."""
    for name in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST"):
        os.environ.setdefault(name, _BY_NAME[name].default)


def markdown_table() -> str:
    """The table of docs/environment.md: one row per variable of :data:`VARIABLES`."""
    rows = ["| Variable | Values | Default | Effect | Read |", "|---|---|---|---|---|"]
    for v in VARIABLES:
        values = " or ".join(f"`{x}`" for x in v.values) if v.values else "any"
        default = f"`{v.default}`" if v.default is not None else "unset"
        rows.append(f"| `{v.name}` | {values} | {default} | {v.effect} | {v.read} |")
    return "\n".join(rows) + "\n"
