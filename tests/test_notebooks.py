"""Every notebook in notebooks/ runs top to bottom, so none can rot.

Code cells are joined into one script, written to a file and run by a fresh interpreter (no
Jupyter kernel needed), as a notebook exported as a script runs: the ranks a notebook spawns
import that file, so its cells run under ``if __name__ == "__main__":``. The notebooks' own
asserts are the checks. Plots go to the Agg backend.

Three runs are slow tests (make test-all), their code being tested elsewhere in the fast tier:
02 (the ops under torch.compile: each op's compiled tests in tests/custom_ops), 03 (the
demo's CP training against one rank: tests/cp_ops/test_demo.py) and 04 (transformers' model
with CP on two ranks: tests/cp_ops/test_transformers.py). In the fast tier every
notebook's code still compiles.
"""

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def _script(path: Path) -> str:
    cells = json.loads(path.read_text())["cells"]
    parts = []
    for i, cell in enumerate(cells):
        if cell["cell_type"] == "code":
            parts.append(f"# --- cell {i}\n" + "".join(cell["source"]))
    return "\n\n".join(parts)


# notebooks whose code the fast tier runs in tests of its own
SLOW = {"02_ops_and_compile.ipynb", "03_training_with_cp.ipynb", "04_qwen3_next_transformers.ipynb"}


@pytest.mark.parametrize(
    "path", [pytest.param(p, marks=pytest.mark.slow) if p.name in SLOW else p for p in NOTEBOOKS],
    ids=[p.name for p in NOTEBOOKS],
)  # fmt: skip
def test_notebook_runs(path, tmp_path):
    env = dict(os.environ, MPLBACKEND="Agg", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("TRITON_INTERPRET", None)
    script = tmp_path / f"{path.stem}.py"
    script.write_text(_script(path))
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=path.parent, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, f"{path.name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


def test_there_are_notebooks():
    assert len(NOTEBOOKS) >= 2 and SLOW <= {p.name for p in NOTEBOOKS}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_code_compiles(path):
    compile(_script(path), path.name, "exec")


def _guarded(node: ast.stmt) -> bool:
    return isinstance(node, ast.If) and ast.unparse(node.test) == "__name__ == '__main__'"


def _harmless(node: ast.stmt) -> bool:
    """Imports, definitions and the path set-up: what a spawned rank may run on importing the script."""
    if isinstance(node, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.ClassDef)) or _guarded(node):
        return True
    return isinstance(node, ast.Expr) and ast.unparse(node).startswith("sys.path.insert(")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_a_notebook_that_spawns_ranks_runs_its_cells_in_the_main_process_only(path):
    script = _script(path)
    if not re.search(r'"--cp-size", "[2-9]"|cp=[2-9]', script):
        return
    loose = [ast.unparse(node).splitlines()[0] for node in ast.parse(script).body if not _harmless(node)]
    assert not loose, f"{path.name}: as a script, the spawned ranks would run these again: {loose}"
