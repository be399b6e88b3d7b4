"""Library comments and docstrings say what code does and why; measurements live in docs/benchmarks.md."""

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("custom_ops", "cp_ops")

DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")
MEASURE = re.compile(r"\b\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)? ?(?:ms|us|µs|TFLOP/s|TB/s|GB/s)(?![\w/])")

# (relative path, text of the hit) -> reason; kept empty unless a legitimate hit remains.
ALLOWED: dict[tuple[str, str], str] = {}


def _texts(path: Path):
    """Yield (line, text) for every comment and docstring of a source file."""
    src = path.read_text(encoding="utf-8")
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string
    for node in ast.walk(ast.parse(src, filename=str(path))):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = node.body[0] if node.body else None
            if isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str):
                for i, line in enumerate(doc.value.value.splitlines()):
                    yield doc.lineno + i, line


def test_no_measurements_in_comments():
    files = sorted(f for pkg in PACKAGES for f in (ROOT / pkg).rglob("*.py"))
    assert files
    bad = []
    for f in files:
        rel = f.relative_to(ROOT).as_posix()
        for line, text in _texts(f):
            for m in (*DATE.finditer(text), *MEASURE.finditer(text)):
                if (rel, m.group()) not in ALLOWED:
                    bad.append(f"{rel}:{line}: {m.group()!r} in {text.strip()!r}")
    assert not bad, "measurements belong in docs/benchmarks.md:\n" + "\n".join(bad)
