"""The pinned test environment (constraints.txt) against what is installed.

    python tools/pins.py check constraints.txt   exit 1 unless every pin is installed at its version
    python tools/pins.py diff constraints.txt    list the installed versions that differ from the pins
    python tools/pins.py freeze [constraints.txt]
                                                 print a constraints file of what is installed (and the
                                                 given file's optional section, as it is)

Local version labels (``2.13.0+cpu``) compare equal to their public version, as pip matches them.
The pins after the line ``# [optional]`` are the optional extras that ``make deps`` does not
install (GPU packages): checked only where installed, and kept as they are by ``freeze``.
"""

from __future__ import annotations

import importlib.metadata
import re
import sys

HEADER = """\
# The versions the CPU test suite is tested with: make deps installs exactly these (pip -c).
# make test-latest runs the suite against the newest versions pyproject.toml allows and prints
# which differ from these. Regenerate after a change there: make pins.
"""


def _key(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _public(version: str) -> str:
    return version.split("+", 1)[0]


OPTIONAL = "# [optional]"


def optional_section(path: str) -> str:
    """The text of ``path`` from its ``# [optional]`` line on ("" where it has none)."""
    with open(path) as f:
        text = f.read()
    start = text.find(OPTIONAL + "\n")
    return "" if start < 0 else text[start:]


def read_pins(path: str, optional: bool = False) -> dict[str, str]:
    """The pins of ``path`` before its optional section, or (``optional``) those in it."""
    pins = {}
    with open(path) as f:
        text = f.read()
    required, _, extras = text.partition(OPTIONAL + "\n")
    for line in (extras if optional else required).splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9_.\-]+)\s*==\s*(\S+)", line)
        if m is None:
            raise SystemExit(f"{path}: not a 'name==version' pin: {line!r}")
        pins[_key(m.group(1))] = m.group(2)
    return pins


def installed() -> dict[str, tuple[str, str]]:
    """{normalised name: (name as published, public version)} of every installed distribution."""
    found = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            found[_key(name)] = (name, _public(dist.version))
    return found


def differences(pins: dict[str, str], optional: dict[str, str] | None = None) -> list[str]:
    """What differs from ``pins`` (each must be installed at its version) and from the ``optional``
    pins that are installed."""
    have = installed()
    lines = []
    wanted = {**{k: v for k, v in (optional or {}).items() if k in have}, **pins}
    for key, want in sorted(wanted.items()):
        got = have.get(key, (key, None))[1]
        if got != _public(want):
            lines.append(f"{key}: pinned {want}, installed {got or 'nothing'}")
    return lines


def main(argv: list[str]) -> int:
    if argv[:1] == ["freeze"] and len(argv) <= 2:
        extras = optional_section(argv[1]) if len(argv) == 2 else ""
        skip = {"cp-ops", "pip", "setuptools", "wheel"} | (set(read_pins(argv[1], optional=True)) if extras else set())
        body = "".join(f"{name}=={version}\n" for key, (name, version) in sorted(installed().items()) if key not in skip)
        sys.stdout.write(HEADER + body + extras)
        return 0
    if len(argv) != 2 or argv[0] not in ("check", "diff"):
        raise SystemExit(__doc__)
    lines = differences(read_pins(argv[1]), read_pins(argv[1], optional=True))
    if argv[0] == "check":
        if lines:
            print(f"the installed packages do not match {argv[1]}:\n  " + "\n  ".join(lines), file=sys.stderr)
            return 1
        return 0
    print(f"versions that differ from {argv[1]}:" + ("\n  " + "\n  ".join(lines) if lines else " none"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
