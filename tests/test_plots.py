"""benchmarks/plots.py draws every figure from the JSON results in benchmarks/results/.

Keeps the figures' reader and the results in step (a renamed column or result fails
here, not when someone next regenerates the pictures).
"""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_plots_from_the_results(tmp_path):
    subprocess.run([sys.executable, "-m", "benchmarks.plots", "--out", str(tmp_path)], cwd=ROOT, check=True)
    for name in ("layout.png", "a2a.png", "attention.png", "scaling.png"):
        with open(tmp_path / name, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n", name
