"""tools/pins.py: the pins make deps installs are checked exactly; the optional extras' pins only
where installed, and regenerating the file keeps them."""

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
    path = _write(tmp_path, "torch==2.13.0+cpu\n# [optional]\n# what the GPU path adds\nflash-qla==0.1.3\n")
    assert pins.read_pins(path) == {"torch": "2.13.0+cpu"}
    assert pins.read_pins(path, optional=True) == {"flash-qla": "0.1.3"}
    assert pins.main(["check", path]) == 0
    path = _write(tmp_path, "torch==2.13.0\n# [optional]\ntilelang==0.1.15\n")
    assert pins.main(["check", path]) == 1  # installed at another version
    path = _write(tmp_path, "torch==2.13.0\nnumpy==2.4.6\n")
    assert pins.main(["check", path]) == 1  # a required pin missing


def test_freeze_keeps_the_optional_section(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(pins, "installed", lambda: {"torch": ("torch", "2.13.0"), "tilelang": ("tilelang", "0.1.15")})
    section = "# [optional]\n# the GPU path\ntilelang==0.1.15\n"
    path = _write(tmp_path, "torch==2.12.0\n" + section)
    assert pins.main(["freeze", path]) == 0
    out = capsys.readouterr().out
    assert out == pins.HEADER + "torch==2.13.0\n" + section
    assert pins.main(["freeze"]) == 0
    assert capsys.readouterr().out == pins.HEADER + "tilelang==0.1.15\ntorch==2.13.0\n"

