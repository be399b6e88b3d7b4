"""README.md matches the code: its tables of ops and layers against the registered schemas and
the Python functions, its performance table's links against docs/benchmarks.md, and every
Python code block runs.

A block runs as written in a fresh interpreter, unless the HTML comment on the line before it
names it (``<!-- readme-test: NAME -->``) and :data:`VARIANTS` says how: under ``torchrun`` on
several CPU ranks (gloo), with the listed replacements (each must match, so a README edit
cannot silently skip one), and the text it must print.
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
from custom_ops.ops import internal_ops

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
BENCHMARKS = (ROOT / "docs" / "benchmarks.md").read_text()

# name -> (torchrun ranks, or 1 for a plain interpreter; [(as written, as run)]; text it must print)
VARIANTS = {
    # as written: README's command on the CPU, torchrun with 2 gloo ranks (sizes chosen by device)
    "own-model": (2, [], "rank 0 of 2: loss share"),
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


@pytest.mark.parametrize("name,code", BLOCKS, ids=[b[0] for b in BLOCKS])
def test_readme_block_runs(name, code, tmp_path):
    ranks, code, prints = _variant(name, code)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("TRITON_INTERPRET", None)
    env.pop("CP_OPS_CHECKS", None)
    if ranks > 1:  # as README says to run it: torchrun, which sets the ranks' environment
        script = tmp_path / f"{name}.py"
        script.write_text(code)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", str(script)]
    else:
        cmd = [sys.executable, "-c", code]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"README block {name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    if prints is not None:
        assert prints in proc.stdout, proc.stdout
    if ranks == 1:  # a block prints nothing it does not print itself (torchrun has notices of its own)
        assert proc.stderr == "", f"README block {name} printed:\n{proc.stderr[-3000:]}"


def test_every_python_block_runs_and_variants_name_existing_blocks():
    names = [name for name, _ in BLOCKS]
    assert len(BLOCKS) == README.count("```python"), "a ```python block the pattern does not see"
    assert set(VARIANTS) <= set(names), set(VARIANTS) - set(names)
    assert len(names) == len(set(names)) and len(BLOCKS) >= 3


# --- the op table ----------------------------------------------------------------------------------

# registered ops that are pieces of the public ones, not API of their own
INTERNAL_OPS = internal_ops()


def _section(title: str) -> str:
    section = README[README.index(f"## {title}\n") :]
    return section[: section.index("\n## ", 1)]


def _rows(title: str) -> list[list[str]]:
    rows = [line for line in _section(title).splitlines() if line.startswith("| `")]
    return [[cell.strip() for cell in row.strip("|").split(" | ")] for row in rows]


def _op_table() -> list[list[str]]:
    """The op table's rows: a first cell that is an op's schema (no module in front)."""
    return [row for row in _rows("What each piece does") if re.match(r"`\w+\(", row[0])]


def _layer_table() -> list[list[str]]:
    return [row for row in _rows("What each piece does") if re.match(r"`cp_ops\.", row[0])]


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


def test_layer_table_rows_match_the_code():
    rows = _layer_table()
    assert {row[0] for row in rows} >= {"`cp_ops.GatedDeltaNet`", "`cp_ops.Attention`"}
    for row in rows:
        dotted = row[0].strip("`")
        module, _, name = dotted.rpartition(".")
        obj = getattr(__import__(module, fromlist=[name]), name)
        call, args = _call(row[1])
        fn = obj.forward if inspect.isclass(obj) else obj
        assert call.split(".")[-1] == fn.__name__, row
        params = [p for p in inspect.signature(fn).parameters if p != "self"]
        assert args == params, f"README's {dotted} {call} arguments {args} differ from the code's {params}"


def test_quickstart_commands_are_what_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text()
    install = _section("Install") + _section("Quickstart")
    quick = _section("Quickstart")
    assert re.search(r"^make demo\b", quick, re.M), "the quickstart starts with make demo"
    assert quick.index("make demo") < quick.index("make test"), "make demo comes first"
    assert "make test-all" in quick
    assert re.search(r"^make test$", ci, re.M), "README and .ci/run must both run `make test`"
    assert "python3 -m venv" in install and "python3 -m venv" in ci
    assert "pip install -e '.[hf]'" in install


def test_install_takes_the_cpu_torch_from_the_index_make_uses():
    install, make = _section("Install"), (ROOT / "Makefile").read_text()
    pin = re.search(r"^torch==([\d.]+)$", (ROOT / "constraints.txt").read_text(), re.M).group(1)
    index = re.search(r"^TORCH_INDEX \?= .*?(https://\S+?)\)", make, re.M).group(1)
    assert f"pip install torch=={pin} --index-url {index}" in install, "README's torch line: the pin, make's index"
    assert install.index(f"torch=={pin}") < install.index("pip install -e"), "torch first, then the package"
    assert "PYTHON ?= .venv/bin/python" in make and ".venv" in install


def test_every_extra_is_pinned_and_only_make_s_extras_must_be_installed():
    sys.path.insert(0, str(ROOT / "tools"))
    import pins

    section = (ROOT / "pyproject.toml").read_text().split("[project.optional-dependencies]")[1].split("\n[")[0]
    extras = re.findall(r"^([\w-]+) = \[(.*)\]$", section, re.M)
    assert {"flashqla", "attention-baselines"} <= {name for name, _ in extras}
    required = {pins._key(re.match(r"[\w.-]+", r).group()) for _, reqs in extras for r in re.findall(r'"([^"]+)"', reqs)}
    constraints = str(ROOT / "constraints.txt")
    every, made = pins.read_pins(constraints), pins.read_pins(constraints, optional=False)
    assert required <= set(every), required - set(every)
    optional = set(every) - set(made)
    assert "jupyterlab" in optional and "pytest" in made and "transformers" in made
    assert not [line for line in pins.differences(every, optional) if "installed nothing" in line and
                line.split(":")[0] in optional], "an optional pin that is not installed is no difference"


def test_the_package_is_installed_from_a_clone():
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    bad = [str(p.relative_to(ROOT)) for p in docs if re.search(r"pip install\s+['\"]?cp-ops", p.read_text())]
    assert not bad, f"the package is on no index; install from a clone (pip install -e '.[hf]'): {bad}"


def test_readme_has_no_placeholder():
    assert not re.findall(r"__[A-Z_]+__", README)
    assert "DEMO_TIMES" not in README and "MAKE_TEST_TIME" not in README


def test_readme_is_short_and_undated():
    assert len(README.splitlines()) <= 200, "README is the front door: at most 200 lines"
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", README), "no dates in README: history lives in git and CHANGELOG.md"


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_performance_table_links_to_benchmarks_sections():
    anchors = {github_anchor(h) for h in re.findall(r"^#+ (.+)$", BENCHMARKS, re.M)}
    rows = [line for line in _section("Performance").splitlines() if line.startswith("| ") and not line.startswith("| ---")]
    links = re.findall(r"\(docs/benchmarks\.md#([\w-]+)\)", _section("Performance"))
    assert len(links) == len(rows) - 1 >= 6, "one link to a table per row"
    assert set(links) <= anchors, set(links) - anchors
