"""What every benchmark shares besides timing: the environment it ran in, its results as JSON
files (:class:`Result`, one table of one run: its fields are the file's keys), their markdown,
and the ``--out`` option. A result's ``name`` is its file's stem and the key of the docs'
``<!-- results:NAME -->`` section that ``python -m benchmarks.report`` renders from it.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "benchmarks" / "results"


def git_commit(root: str | os.PathLike = ROOT) -> str | None:
    """The short commit of the checkout at ``root`` (``+dirty`` with uncommitted changes to
    tracked files); None where ``root`` is not the top of a git checkout."""
    try:
        top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=root, capture_output=True, text=True,
                             check=True).stdout.strip()  # fmt: skip
        if Path(top).resolve() != Path(root).resolve():  # a copy inside another checkout: not its commit
            return None
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()  # fmt: skip
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+dirty" if dirty else "")


def checks_off() -> None:
    """The checked mode off in this process and the processes it starts (``CP_OPS_CHECKS=0``):
    the benchmarks time the ops as production steps run them, so an eager figure is the op's own
    and holds no layout check's host sync (docs/environment.md). Each benchmark's ``main`` calls it."""
    os.environ["CP_OPS_CHECKS"] = "0"
    from custom_ops import set_checks

    set_checks(False)


def package_versions(*packages: str) -> dict[str, str]:
    """``{package: its installed version, or "absent"}``: the libraries a benchmark compares against."""
    import importlib.metadata

    found = {}
    for package in packages:
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            found[package] = "absent"
    return found


def environment(world: int | None = None, **extra) -> dict:
    """Device, software versions, date and commit of this run; with ``world``, the ranks, their
    backend and the visible GPUs. ``extra`` entries (e.g. ``fla="0.6.0"``) are added as given."""
    import torch
    import triton

    cuda = torch.cuda.is_available()
    env = {
        "device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "date": datetime.date.today().isoformat(),
        "commit": git_commit(),
    }
    if world is not None:
        import torch.distributed as dist

        backend = dist.get_backend() if dist.is_initialized() else ("nccl" if cuda else "gloo")
        env.update(ranks=world, backend=backend, gpus=torch.cuda.device_count())
    env.update(extra)
    return env


def fla_environment(world: int | None = None, **extra) -> dict:
    """:func:`environment` with FLA's version (``absent`` where FLA is not installed), the gated
    delta rule's backend for Qwen3-Next's head dims in bf16 (``gdn``) and all-gather CP
    attention's (``attention``)."""
    from custom_ops.ag_attention import backends as attention_backends
    from custom_ops.gated_delta_rule.backends import describe

    try:
        import fla

        version = getattr(fla, "__version__", "?")
    except ImportError:
        version = "absent"
    return environment(world, fla=version, gdn=describe(), attention=attention_backends.describe(), **extra)


def env_line(env: dict) -> str:
    """The one-line form of an environment for the head of a table. A result converted from an
    older document keeps the line that document stated (``env["stated"]``)."""
    if env.get("stated"):
        return env["stated"]
    parts = [env.get("device") or "unknown device"]
    parts += [f"{key} {env[key]}" for key in ("torch", "triton", "fla") if env.get(key)]
    if env.get("gdn"):
        parts.append(f"GDN core {env['gdn']}")
    if env.get("attention"):
        parts.append(f"CP attention {env['attention']}")
    if env.get("cuda"):
        parts.append(f"CUDA {env['cuda']}")
    parts += [env[key] for key in ("date",) if env.get(key)]
    if env.get("commit"):
        parts.append(f"commit {env['commit']}")
    line = ", ".join(parts)
    if env.get("ranks") is not None:
        line += f"; W = {env['ranks']} ranks ({str(env.get('backend', '')).upper()}), {env.get('gpus')} GPU(s) visible"
    return line


def format_cell(value, fmt: str | None = None) -> str:
    if value is None:
        return "-"
    if fmt and not isinstance(value, str):
        return fmt.format(value)
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


def markdown_table(columns: list[str], rows: list[list], formats: list[str | None] | None = None) -> str:
    fmts = formats or [None] * len(columns)

    def line(cells):
        return "|" + "|".join(f" {c} " if c else " " for c in cells) + "|"

    lines = [line(columns), "|" + "---|" * len(columns)]
    lines += [line(format_cell(v, f) for v, f in zip(row, fmts)) for row in rows]
    return "\n".join(lines)


@dataclass
class Result:
    """One table of one benchmark run. ``formats``: each column's format string or None (a cell
    without one prints as it is, floats to 3 decimals; a None cell prints as ``-``)."""

    benchmark: str
    title: str
    columns: list[str]
    rows: list[list]
    notes: str = ""
    env: dict = field(default_factory=dict)
    name: str = ""
    formats: list[str | None] | dict[str, str] = field(default_factory=list)

    def __post_init__(self):
        self.name = self.name or self.benchmark
        bad = [i for i, row in enumerate(self.rows) if len(row) != len(self.columns)]
        if bad:
            raise ValueError(f"result {self.name}: rows {bad} do not have the {len(self.columns)} columns")
        if isinstance(self.formats, dict):  # {column: format}, for results built in code
            unknown = set(self.formats) - set(self.columns)
            if unknown:
                raise ValueError(f"result {self.name}: formats for columns it does not have: {sorted(unknown)}")
            self.formats = [self.formats.get(c) for c in self.columns] if self.formats else []
        if self.formats and len(self.formats) != len(self.columns):
            raise ValueError(f"result {self.name}: {len(self.formats)} formats for {len(self.columns)} columns")

    def to_dict(self) -> dict:
        out = {"benchmark": self.benchmark, "name": self.name, "title": self.title, "env": self.env,
               "columns": self.columns, "rows": self.rows, "notes": self.notes}  # fmt: skip
        if any(self.formats):
            out["formats"] = self.formats
        return out

    @classmethod
    def from_dict(cls, d: dict) -> Result:
        return cls(benchmark=d["benchmark"], title=d["title"], columns=list(d["columns"]),
                   rows=[list(r) for r in d["rows"]], notes=d.get("notes", ""), env=d.get("env", {}),
                   name=d.get("name", ""), formats=d.get("formats", []))  # fmt: skip

    def table(self) -> str:
        return markdown_table(self.columns, self.rows, self.formats)

    def markdown(self, head: bool = True) -> str:
        """The table under its environment line and notes (``head``), as the docs show it."""
        if not head:
            return self.table()
        lines = [env_line(self.env)] if self.env else []
        if self.notes:
            lines.append(self.notes)
        return "\n".join(lines + ([""] if lines else []) + [self.table()])

    def column(self, name: str) -> list:
        i = self.columns.index(name)
        return [row[i] for row in self.rows]

    def records(self) -> list[dict]:
        """The rows as ``{column: cell}`` dicts."""
        return [dict(zip(self.columns, row)) for row in self.rows]

    def write(self, out: str | os.PathLike = RESULTS_DIR) -> Path:
        """Write the result to ``out/<name>.json`` (``out``: a directory, made if missing, or a
        ``.json`` file path) and return the path."""
        path = Path(out)
        if path.suffix != ".json":
            path.mkdir(parents=True, exist_ok=True)
            path = path / f"{self.name}.json"
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as f:
            f.write(dumps(self.to_dict()))
        return path


def dumps(d: dict) -> str:
    """JSON of a result with one line per key and per row, so a changed number shows as a
    changed row in a diff."""
    items = []
    for key, value in d.items():
        if key == "rows":
            rows = ",\n".join(f"  {json.dumps(row)}" for row in value)
            items.append(f' "rows": [\n{rows}\n ]' if value else ' "rows": []')
        else:
            items.append(f" {json.dumps(key)}: {json.dumps(value)}")
    return "{\n" + ",\n".join(items) + "\n}\n"


def load(path: str | os.PathLike) -> Result:
    with open(path) as f:
        return Result.from_dict(json.load(f))


def load_all(directory: str | os.PathLike = RESULTS_DIR) -> dict[str, Result]:
    """``{name: result}`` of every ``*.json`` result in ``directory``."""
    results = {}
    for path in sorted(Path(directory).glob("*.json")):
        result = load(path)
        if result.name in results:
            raise ValueError(f"{path}: a second result named {result.name!r}")
        results[result.name] = result
    return results


def add_out_argument(parser, default: str | os.PathLike | None = RESULTS_DIR) -> None:
    """The ``--out`` option: the directory the run's JSON results go to."""
    parser.add_argument("--out", default=None if default is None else str(default), metavar="DIR",
                        help=f"write the run's results as JSON files to DIR (default: {default})")  # fmt: skip


def emit(results: list[Result], out: str | os.PathLike | None, quiet: bool = False) -> list[Path]:
    """Print each result as markdown (title first) and write it under ``out`` (nothing is
    written when ``out`` is None); returns the paths written."""
    paths = []
    for result in results:
        if not quiet:
            print(f"\n## {result.title}\n\n{result.markdown()}\n", flush=True)
        if out is not None:
            paths.append(result.write(out))
            if not quiet:
                print(f"written {paths[-1]}", flush=True)
    return paths
