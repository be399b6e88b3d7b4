"""benchmarks/plots.py draws every figure from the tables in docs/benchmarks.md.

The tables are written by the GPU benchmarks and edited by hand around them; this
keeps the figures' parser and the document in step (a renamed column or section
fails here, not when someone next regenerates the pictures).
"""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_plots_from_the_benchmark_tables(tmp_path):
    subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "plots.py"), "--out", str(tmp_path)], check=True)
    for name in ("layout.png", "a2a.png", "attention.png", "scaling.png"):
        with open(tmp_path / name, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n", name
