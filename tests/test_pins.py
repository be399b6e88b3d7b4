"""tools/pins.py: the pins make deps installs are checked exactly; an optional extra's pins (after
an ``# optional:`` line) only where installed."""

import importlib.util

from tests.test_structure import ROOT

spec = importlib.util.spec_from_file_location("pins", ROOT / "tools" / "pins.py")
pins = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pins)


def _write(tmp_path, text):
    path = tmp_path / "constraints.txt"
    path.write_text(text)
    return str(path)


def test_optional_pins_are_checked_only_where_installed(tmp_path, monkeypatch):
    monkeypatch.setattr(pins, "installed", lambda: {"torch": ("torch", "2.13.0"), "tilelang": ("tilelang", "0.1.14")})
    text = "torch==2.13.0+cpu\n# optional: the gpu extra\nflash-qla==0.1.3\n# optional: another\njupyterlab==4.6.6\n"
    path = _write(tmp_path, text)
    assert pins.read_pins(path, optional=False) == {"torch": "2.13.0+cpu"}
    assert set(pins.read_pins(path)) == {"torch", "flash-qla", "jupyterlab"}
    assert pins.main(["check", path]) == 0
    path = _write(tmp_path, "torch==2.13.0\n# optional: the gpu extra\ntilelang==0.1.15\n")
    assert pins.main(["check", path]) == 1  # installed at another version
    path = _write(tmp_path, "torch==2.13.0\nnumpy==2.4.6\n")
    assert pins.main(["check", path]) == 1  # a required pin missing


def test_the_repository_constraints_parse_with_each_extra_in_its_section():
    path = str(ROOT / "constraints.txt")
    required, everything = pins.read_pins(path, optional=False), pins.read_pins(path)
    assert "torch" in required and "flash-qla" not in required and "jupyterlab" not in required
    assert {"flash-qla", "tilelang", "jupyterlab"} <= set(everything)
