"""Every notebook in notebooks/ runs top to bottom, so none can rot.

Code cells are joined into one script and run in a fresh interpreter (no Jupyter
kernel needed): the notebooks' own asserts are the checks. Plots go to the Agg backend.

Two runs are slow tests (make test-all), their code being tested elsewhere in the fast tier:
02 (the ops under torch.compile: each op's compiled tests in tests/custom_ops) and 03 (the
demo's CP training against one rank: tests/examples/test_demo.py). In the fast tier every
notebook's code still compiles.
"""

import json
import os
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
SLOW = {"02_ops_and_compile.ipynb", "03_training_with_cp.ipynb"}


@pytest.mark.parametrize(
    "path", [pytest.param(p, marks=pytest.mark.slow) if p.name in SLOW else p for p in NOTEBOOKS],
    ids=[p.name for p in NOTEBOOKS],
)  # fmt: skip
def test_notebook_runs(path):
    env = dict(os.environ, MPLBACKEND="Agg", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(
        [sys.executable, "-c", _script(path)], cwd=path.parent, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, f"{path.name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


def test_there_are_notebooks():
    assert len(NOTEBOOKS) >= 2 and SLOW <= {p.name for p in NOTEBOOKS}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_code_compiles(path):
    compile(_script(path), path.name, "exec")
