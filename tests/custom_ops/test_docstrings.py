"""The op layer's docstrings are contracts of about ten lines (shapes, dtypes, what is
differentiable, errors); the reasoning behind them lives in docs/design.md."""

import ast
from pathlib import Path

import custom_ops

ROOT = Path(custom_ops.__file__).parent
MAX_LINES = 12


def test_docstrings_are_short_contracts():
    long = []
    for path in sorted(ROOT.rglob("*.py")):
        tree = ast.parse(path.read_text())
        nodes = [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef)))]
        for node in nodes:
            doc = ast.get_docstring(node)
            if doc and len(doc.splitlines()) > MAX_LINES:
                name = getattr(node, "name", "<module>")
                long.append(f"{path.relative_to(ROOT.parent)}:{getattr(node, 'lineno', 1)} {name}")
    assert not long, f"docstrings over {MAX_LINES} lines (move the reasoning to docs/design.md):\n" + "\n".join(long)
