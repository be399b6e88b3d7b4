"""``python -m cp_ops demo [options]``: runs the demo, :mod:`cp_ops.demo` (``--help`` lists the
options)."""

import sys

USAGE = "usage: python -m cp_ops demo [options]   (python -m cp_ops demo --help for the options)"


def _main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        print("\ncommands:\n  demo    train a small hybrid GDN / attention stack with context parallelism")
        return 0 if argv else 2
    if argv[0] != "demo":
        print(f"unknown command {argv[0]!r}\n{USAGE}", file=sys.stderr)
        return 2
    from cp_ops.demo.cli import main  # the demo's imports are for its command alone

    return main(argv[1:])


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
