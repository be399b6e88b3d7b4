"""README.md matches the code: its op table against the registered schemas and the Python
functions, and every Python code block runs.

A block runs as written in a fresh interpreter, unless the HTML comment on the line before it
names it (``<!-- readme-test: NAME -->``) and :data:`VARIANTS` says how: on several gloo ranks,
and with the listed replacements for a block written for GPUs (each replacement must match, so
a README edit cannot silently skip one).
"""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import cp_ops
import custom_ops
from tests._dist import run_ranks

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()

# name -> (ranks, [(GPU text, CPU text)], text the block must print)
VARIANTS = {
    "own-model": (
        2,
        [
            ('torch.device("cuda", torch.cuda.current_device()), torch.bfloat16', 'torch.device("cpu"), torch.float64'),
            ("cp_ops.GatedDeltaNet(2048, 16, 32, 128, 128)", "cp_ops.GatedDeltaNet(64, 2, 4, 16, 16)"),
            ("cp_ops.Attention(2048, 16, 2, 256, partial_rotary_factor=0.25)",
             "cp_ops.Attention(64, 4, 2, 16, partial_rotary_factor=0.25)"),
            ("torch.randn(n, 2048, ", "torch.randn(n, 64, "),
            ("[3000, 0, 1, 517, 4096]", "[30, 0, 1, 17, 41]"),
            # compiling both layers on two CPU ranks takes minutes; the layers' compile tests cover it
            ("torch.compile(block, fullgraph=True, options=cp_ops.COMPILE_OPTIONS)", "block"),
        ],
        None,
    ),
    "checked-mode": (1, [], "cu_seqlens_padded[-1] = 12 but the tensor has 14 rows"),
}


def code_blocks() -> list[tuple[str, str]]:
    """``(name, code)`` of every ```python block; the name from the comment before it, else
    ``line-N``."""
    blocks = []
    for m in re.finditer(r"(?:<!-- readme-test: ([\w-]+) -->\n)?```python\n(.*?)```", README, re.S):
        line = README.count("\n", 0, m.start()) + 1
        blocks.append((m.group(1) or f"line-{line}", m.group(2)))
    return blocks


BLOCKS = code_blocks()


def _variant(name: str, code: str) -> tuple[int, str, str | None]:
    ranks, replacements, prints = VARIANTS.get(name, (1, [], None))
    for old, new in replacements:
        assert old in code, f"README block {name!r} no longer contains {old!r}; update VARIANTS"
        code = code.replace(old, new)
    return ranks, code, prints


def _run_block_on_rank(rank: int, world: int, code: str) -> None:
    exec(compile(code, "README.md", "exec"), {"__name__": "__readme__"})


@pytest.mark.parametrize("name,code", BLOCKS, ids=[b[0] for b in BLOCKS])
def test_readme_block_runs(name, code):
    ranks, code, prints = _variant(name, code)
    if ranks > 1:
        run_ranks(ranks, _run_block_on_rank, code)
        return
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("TRITON_INTERPRET", None)
    env.pop("CP_OPS_CHECKS", None)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"README block {name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    if prints is not None:
        assert prints in proc.stdout, proc.stdout


def test_variants_name_existing_blocks():
    names = {name for name, _ in BLOCKS}
    assert set(VARIANTS) <= names, set(VARIANTS) - names
    assert len(BLOCKS) >= 4


# --- the op table ----------------------------------------------------------------------------------

# registered ops that are pieces of the public ones, not API of their own
INTERNAL_OPS = {
    "causal_conv1d_backward",
    "causal_conv1d_gather_backward",
    "chunk_gated_delta_rule_forward",
    "chunk_gated_delta_rule_backward",
    "varlen_attention_backward",
    "group_rank_tensor",
    "check_layout",
}


def _op_table() -> list[list[str]]:
    section = README[README.index("## The ops") :]
    section = section[: section.index("\n## ", 1)]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    return [[cell.strip() for cell in row.strip("|").split(" | ")] for row in rows]


def _call(cell: str) -> tuple[str, list[str] | None]:
    """```mod.name(a, b)``` -> ("mod.name", ["a", "b"]); ```mod.name``` -> ("mod.name", None)."""
    m = re.match(r"`([\w.]+)(?:\(([^)]*)\))?`", cell)
    assert m, cell
    args = None if m.group(2) is None else [a.strip() for a in m.group(2).split(",")]
    return m.group(1), args


def _resolve(dotted: str):
    module, _, name = dotted.partition(".")
    return getattr({"cp_ops": cp_ops, "custom_ops": custom_ops}[module], name)


def _registered_ops() -> set[str]:
    return {n.split("::")[1].split(".")[0] for n in torch._C._dispatch_get_all_op_names() if n.startswith("cp_ops::")}


def test_op_table_lists_every_public_op():
    listed = {_call(row[0])[0] for row in _op_table()}
    assert listed == _registered_ops() - INTERNAL_OPS


@pytest.mark.parametrize("row", _op_table(), ids=lambda row: _call(row[0])[0])
def test_op_table_row_matches_the_code(row):
    op_cell, fn_cell, ref_cell, _ = row
    name, args = _call(op_cell)
    schema = getattr(torch.ops.cp_ops, name).default._schema
    assert args == [a.name for a in schema.arguments], f"README's {name} arguments differ from {schema}"

    fn_name, fn_args = _call(fn_cell)
    fn = _resolve(fn_name)
    if fn_cell.endswith("(same arguments)"):
        assert fn_args is None
        assert getattr(fn, "_qualname", None) == f"cp_ops::{name}" or [
            p for p in inspect.signature(fn).parameters
        ] == args, f"{fn_name} is neither the op nor a function of its arguments"
    else:
        assert fn_args == list(inspect.signature(fn).parameters), f"README's {fn_name} arguments differ from the code"

    if ref_cell != "-":
        ref = _resolve(_call(ref_cell)[0])
        assert callable(ref)


def test_quickstart_commands_are_what_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text()
    quick = README[README.index("## Quickstart") :]
    quick = quick[: quick.index("```", quick.index("```bash") + 3)]
    assert "make test" in quick and re.search(r"^make test$", ci, re.M), "README and .ci/run must both run `make test`"
    assert "python3 -m venv" in quick and "python3 -m venv" in ci


def test_readme_has_no_unfilled_placeholder():
    assert "DEMO_TIMES" not in README and "MAKE_TEST_TIME" not in README
