"""``python -m cp_ops demo [options]``: runs the example application ``cp_ops_demo``
(examples/cp_ops_demo/; ``--help`` lists the options)."""

import sys

USAGE = "usage: python -m cp_ops demo [options]   (python -m cp_ops demo --help for the options)"

NOT_INSTALLED = (
    "python -m cp_ops demo runs the example application cp_ops_demo (examples/cp_ops_demo/ in the "
    "repository), which is not installed: install the repository (pip install -e . or make deps), "
    "or put its examples/ folder on PYTHONPATH"
)


def _main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        print("\ncommands:\n  demo    train a small hybrid GDN / attention stack with context parallelism")
        return 0 if argv else 2
    if argv[0] != "demo":
        print(f"unknown command {argv[0]!r}\n{USAGE}", file=sys.stderr)
        return 2
    try:
        import cp_ops_demo
    except ModuleNotFoundError as err:
        if err.name != "cp_ops_demo":
            raise
        print(f"error: {NOT_INSTALLED}", file=sys.stderr)
        return 2
    return cp_ops_demo.main(argv[1:])


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
