"""The documents stay in step with the code and the results.

docs/design.md, which the code's docstrings cite, exists, describes every public op of README's
op table, and has a numbered section for every "docs/design.md section <number>" the code
cites (a renumbered section fails here, not when someone next follows a citation).
docs/benchmarks.md holds exactly the tables `python -m benchmarks.report` generates from
benchmarks/results/, and stays short; docs/README.md indexes every document.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DESIGN = ROOT / "docs" / "design.md"
BENCHMARKS = ROOT / "docs" / "benchmarks.md"

# a citation, possibly broken over a docstring's or comment's line
CITATION = re.compile(r"docs/design\.md,?\s+(?:#\s*)?section\s+(\d+)")


def _design() -> str:
    assert DESIGN.is_file(), "docs/design.md is missing"
    return DESIGN.read_text()


def _readme_ops() -> list[str]:
    """The op names of the first column of README's op table (section "## What each piece does")."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## What each piece does") :]
    section = section[: section.index("\n## ", 1)]
    names = re.findall(r"^\| `(\w+)\(", section, re.M)
    assert names, "README's op table has no rows"
    return names


def _python_files() -> list[Path]:
    """The repository's Python files (hidden folders, such as virtual environments, left out)."""
    files = []
    for top in ROOT.iterdir():
        if top.name.startswith(".") or top.name.endswith(".egg-info"):
            continue
        if top.is_file() and top.suffix == ".py":
            files.append(top)
        elif top.is_dir():
            files.extend(p for p in top.rglob("*.py") if not any(part.startswith(".") for part in p.parts))
    return files


def test_design_document_exists():
    assert _design().startswith("# "), "docs/design.md should start with its title"


def test_every_public_op_is_described():
    text = _design()
    missing = [name for name in _readme_ops() if not re.search(rf"(?<![\w.]){re.escape(name)}(?!\w)", text)]
    assert not missing, f"ops of README's table that docs/design.md never names: {missing}"


def test_cited_sections_exist():
    headings = set(re.findall(r"^## (\d+)\. ", _design(), re.M))
    cited = {}
    for path in _python_files():
        for m in CITATION.finditer(path.read_text(errors="replace")):
            cited.setdefault(m.group(1), []).append(str(path.relative_to(ROOT)))
    assert cited, "no code cites docs/design.md: has the citation form changed?"
    dangling = {n: sorted(set(paths)) for n, paths in cited.items() if n not in headings}
    assert not dangling, f"cited sections with no '## N.' heading in docs/design.md: {dangling}"


def test_no_code_cites_the_old_design_notes():
    old = re.compile(r"\bDESIGN(?:\.md)?\s+(?:section\s+)?\d")
    stale = [str(p.relative_to(ROOT)) for p in _python_files() if old.search(p.read_text(errors="replace"))]
    assert not stale, f"citations of a design document outside the repository: {stale}"


def test_linked_images_exist_and_are_small():
    for link in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", _design()):
        image = DESIGN.parent / link
        assert image.is_file(), f"docs/design.md shows {link}, which does not exist"
        assert image.stat().st_size < 200_000, f"{link} is {image.stat().st_size} bytes; keep pictures under 200 KB"


# --- docs/benchmarks.md: the tables generated from the results ------------------------------------


def test_benchmarks_tables_are_what_the_generator_writes(tmp_path):
    """The command docs/benchmarks.md names regenerates it; its check mode finds it up to date."""
    from benchmarks import report

    assert report.main(["--doc", str(BENCHMARKS), "--check"]) == 0, "run python -m benchmarks.report"
    copy = tmp_path / "benchmarks.md"
    copy.write_text(BENCHMARKS.read_text())
    assert report.main(["--doc", str(copy)]) == 0 and copy.read_text() == BENCHMARKS.read_text()


def test_benchmarks_shows_each_result_once_with_its_command():
    from benchmarks import report

    text = BENCHMARKS.read_text()
    names = report.section_names(text)
    assert len(names) == len(set(names)), "a result shown twice"
    assert len(text.splitlines()) <= 940, "docs/benchmarks.md holds the current tables only"
    for section in re.split(r"^## ", text, flags=re.M)[1:]:
        if "<!-- results:" in section:
            assert "python -m benchmarks." in section, f"section {section.splitlines()[0]!r} names no command"


def test_docs_index_names_every_document():
    index = (ROOT / "docs" / "README.md").read_text()
    linked = set(re.findall(r"\]\(([\w.-]+\.md)\)", index))
    documents = {p.name for p in (ROOT / "docs").glob("*.md")} - {"README.md"}
    assert documents <= linked, f"documents docs/README.md does not list: {documents - linked}"
    assert "../CHANGELOG.md" in index and (ROOT / "CHANGELOG.md").is_file()


def test_testing_page_example_runs():
    """docs/testing.md's example property test runs as written and passes."""
    import subprocess
    import sys

    text = (ROOT / "docs" / "testing.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) == 1, "docs/testing.md has one example"
    proc = subprocess.run([sys.executable, "-c", blocks[0]], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "my_shard matches thd_seq_to_rank_order" in proc.stdout


def test_code_cites_sections_the_benchmarks_page_has():
    """A comment or docstring that cites docs/benchmarks.md by section names a heading the page
    has today; a measurement the page no longer shows is cited as its history (git)."""
    lines = (ROOT / "docs" / "benchmarks.md").read_text().splitlines()
    heads = [line[3:].strip() for line in lines if line.startswith("## ")]
    cite = re.compile(r'docs/benchmarks\.md,\s*(?:#\s*)?(?:sections?\s*(?:#\s*)?)?"([^"]*)"')
    stale = []
    for folder in ("custom_ops", "cp_ops", "examples", "benchmarks"):
        for path in (ROOT / folder).rglob("*.py"):
            for name in cite.findall(path.read_text()):
                name = re.sub(r"\s*\n\s*#?\s*", " ", name)
                if not any(h.startswith(name) for h in heads):
                    stale.append(f"{path.relative_to(ROOT)}: {name!r}")
    assert not stale, "citations of sections docs/benchmarks.md no longer has:\n" + "\n".join(stale)
