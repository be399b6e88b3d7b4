"""Render the tables of docs/benchmarks.md from the JSON results in benchmarks/results/.

    python -m benchmarks.report [--results DIR] [--doc docs/benchmarks.md] [--check]
    python -m benchmarks.report --show NAME [NAME ...]     # print results as markdown

Everything between ``<!-- results:NAME -->`` and ``<!-- /results:NAME -->`` is replaced by
the result NAME (``<!-- results:NAME table -->``: the table without its environment line
and notes; ``optional``: a section of a run still to come, left empty while its result is
absent); the rest is left as it is. ``--check`` rewrites nothing and exits 1 when a
section differs from its result or names none.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from benchmarks.runner import RESULTS_DIR, ROOT, Result, load_all

DOC = ROOT / "docs" / "benchmarks.md"
SECTION = re.compile(
    r"^<!-- results:(?P<name>[\w.-]+)(?P<opts>(?: [\w-]+)*) -->\n(?P<body>.*?)^<!-- /results:(?P=name) -->$",
    re.M | re.S,
)
OPTIONS = {"table", "optional"}


def render_section(result: Result, opts: set[str]) -> str:
    unknown = opts - OPTIONS
    if unknown:
        raise ValueError(f"results:{result.name}: unknown options {sorted(unknown)}")
    return result.markdown(head="table" not in opts)


def render(text: str, results: dict[str, Result]) -> tuple[str, list[str]]:
    """``text`` with every marked section rendered from ``results``, and the names of the
    sections whose result is missing (left as they are; an ``optional`` one is not missing)."""
    missing = []

    def replace(m: re.Match) -> str:
        name, opts = m.group("name"), set(m.group("opts").split())
        if name not in results:
            if "optional" not in opts:
                missing.append(name)
            return m.group(0)
        body = render_section(results[name], opts)
        return f"<!-- results:{name}{m.group('opts')} -->\n{body}\n<!-- /results:{name} -->"

    return SECTION.sub(replace, text), missing


def section_names(text: str) -> list[str]:
    return [m.group("name") for m in SECTION.finditer(text)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", default=str(RESULTS_DIR), help="directory of JSON results")
    parser.add_argument("--doc", default=str(DOC), help="the markdown document to rewrite")
    parser.add_argument("--check", action="store_true", help="rewrite nothing; exit 1 if the document is stale")
    parser.add_argument("--show", nargs="+", metavar="NAME", help="print these results as markdown and exit")
    args = parser.parse_args(argv)
    results = load_all(args.results)
    if args.show:
        for name in args.show:
            if name not in results:
                parser.error(f"no result named {name!r} in {args.results}")
            print(f"## {results[name].title}\n\n{results[name].markdown()}\n")
        return 0
    doc = Path(args.doc)
    text = doc.read_text()
    new, missing = render(text, results)
    for name in missing:
        print(f"{doc}: no result {name!r} in {args.results}", file=sys.stderr)
    if args.check:
        stale = new != text
        if stale:
            print(f"{doc} differs from the results in {args.results}: run python -m benchmarks.report", file=sys.stderr)
        return 1 if stale or missing else 0
    if new != text:
        doc.write_text(new)
        print(f"{doc}: {len(section_names(new))} result sections rendered")
    else:
        print(f"{doc}: up to date")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
