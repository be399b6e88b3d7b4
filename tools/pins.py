"""The pinned test environment (constraints.txt) against what is installed.

    python tools/pins.py check constraints.txt   exit 1 unless every pin is installed at its version
    python tools/pins.py diff constraints.txt    list the installed versions that differ from the pins
    python tools/pins.py freeze                  print a constraints file of what is installed
    python tools/pins.py freeze-optional constraints.txt EXTRA
                                                 print the optional section: what is installed
                                                 beyond those pins, for the extra EXTRA

Pins after an ``# optional: ...`` line belong to an extra that make does not install: check and
diff skip those whose package is not installed. Local version labels (``2.13.0+cpu``) compare
equal to their public version, as pip matches them.
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


OPTIONAL = "# optional:"

# never pinned: the package itself and the installers
SKIP = {"cp-ops", "pip", "setuptools", "wheel"}


def read_pins(path: str, optional: bool = True) -> dict[str, str]:
    """The pins of ``path``, the optional section's too unless ``optional`` is False."""
    pins = {}
    with open(path) as f:
        for line in f:
            if line.startswith(OPTIONAL) and not optional:
                break
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


def differences(pins: dict[str, str], optional: set[str] = frozenset()) -> list[str]:
    """The pins not installed at their version; of ``optional`` only those installed at another."""
    have = installed()
    lines = []
    for key, want in sorted(pins.items()):
        got = have.get(key, (key, None))[1]
        if got is None and key in optional:
            continue
        if got != _public(want):
            lines.append(f"{key}: pinned {want}, installed {got or 'nothing'}")
    return lines


def main(argv: list[str]) -> int:
    if argv[:1] == ["freeze"] and len(argv) == 1:
        body = "".join(f"{name}=={version}\n" for key, (name, version) in sorted(installed().items()) if key not in SKIP)
        sys.stdout.write(HEADER + body)
        return 0
    if argv[:1] == ["freeze-optional"] and len(argv) == 3:
        base = read_pins(argv[1], optional=False)
        body = "".join(f"{name}=={version}\n" for key, (name, version) in sorted(installed().items())
                       if key not in base and key not in SKIP)  # fmt: skip
        sys.stdout.write(f"{OPTIONAL} the {argv[2]} extra, which make does not install (pip install -e '.[{argv[2]}]' "
                         "-c constraints.txt)\n" + body)  # fmt: skip
        return 0
    if len(argv) != 2 or argv[0] not in ("check", "diff"):
        raise SystemExit(__doc__)
    pins = read_pins(argv[1])
    lines = differences(pins, set(pins) - set(read_pins(argv[1], optional=False)))
    if argv[0] == "check":
        if lines:
            print(f"the installed packages do not match {argv[1]}:\n  " + "\n  ".join(lines), file=sys.stderr)
            return 1
        return 0
    print(f"versions that differ from {argv[1]}:" + ("\n  " + "\n  ".join(lines) if lines else " none"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
