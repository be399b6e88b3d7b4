"""custom_ops.ops.OPS is the one list of the registered ops: exactly the ops of the cp_ops
namespace, each registered by the module it names, the public ones reachable as
custom_ops.<name>."""

from __future__ import annotations

from pathlib import Path

import torch

import custom_ops
from custom_ops.ops import OPS, internal_ops, public_ops

ROOT = Path(__file__).resolve().parent.parent


def _registered_ops() -> set[str]:
    return {n.split("::")[1].split(".")[0] for n in torch._C._dispatch_get_all_op_names() if n.startswith("cp_ops::")}


def test_every_registered_op_is_listed_and_every_listed_op_is_registered():
    listed = {op.name for op in OPS}
    assert len(listed) == len(OPS), "an op is listed twice"
    registered = _registered_ops()
    assert registered - listed == set(), f"registered but not in custom_ops.ops.OPS: {registered - listed}"
    assert listed - registered == set(), f"in custom_ops.ops.OPS but not registered: {listed - registered}"


def test_public_ops_are_the_package_api():
    missing = [name for name in public_ops() if name not in custom_ops.__all__]
    assert not missing, f"public ops custom_ops does not export: {missing}"
    leaked = [name for name in internal_ops() if name in custom_ops.__all__]
    assert not leaked, f"internal ops custom_ops exports: {leaked}"


def test_each_op_is_registered_by_the_module_it_names():
    """The module an entry names holds the op's registration (its qualified name)."""
    wrong = []
    for op in OPS:
        path = ROOT.joinpath(*op.module.split(".")).with_suffix(".py")
        if not path.is_file() or f'{{NAMESPACE}}::{op.name}"' not in path.read_text():
            wrong.append(f"{op.name}: {op.module}")
    assert not wrong, f"ops not registered where custom_ops.ops.OPS says: {wrong}"
