"""Time the same benchmark cases against the library of two checkouts, in alternating processes.

    git worktree add /tmp/base e532a3b
    python -m benchmarks.compare_checkouts /tmp/base . [--suites attention layout gdn host] [--rounds 3]
                                           [--threshold 0.02] [--fail-on-slower] [--out DIR]

Prints and writes (``compare-SUITE``) each suite's medians over rounds, ``new / base`` and a
flag on every case slower by more than the threshold; docs/benchmarks.md says how it works.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from benchmarks.checkout_cases import DEFAULT_SUITES, SUITES
from benchmarks.runner import Result, add_out_argument, emit, environment, git_commit

CHILD = Path(__file__).resolve().with_name("checkout_cases.py")
THRESHOLD = 0.02


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("base", help="the checkout to compare against")
    parser.add_argument("new", help="the checkout to time against it")
    parser.add_argument("--suites", nargs="+", choices=SUITES, default=list(DEFAULT_SUITES),
                        help=f"default: {' '.join(DEFAULT_SUITES)}")
    parser.add_argument("--rounds", type=int, default=3, help="processes per checkout, in alternation")
    parser.add_argument("--threshold", type=float, default=THRESHOLD,
                        help="flag a case whose new / base exceeds 1 + this (default 0.02)")  # fmt: skip
    parser.add_argument("--fail-on-slower", action="store_true", help="exit 1 if any case is flagged")
    add_out_argument(parser)
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    for tree in (args.base, args.new):
        if not (Path(tree) / "cp_ops" / "__init__.py").is_file():
            parser.error(f"{tree} is not a checkout of this repository (no cp_ops/__init__.py)")
    return args


def child_command(checkout: str, suites) -> list[str]:
    return [sys.executable, str(CHILD), "--checkout", str(checkout), "--suites", *suites]


def child_env(checkout: str) -> dict[str, str]:
    """The environment of a child timing ``checkout``: its library first on the import path,
    then this process's PYTHONPATH (where packages such as FLA or a newer triton may be
    installed) without the entries that hold a library of their own."""
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
            if p and not (Path(p) / "cp_ops" / "__init__.py").is_file()]  # fmt: skip
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(checkout).resolve()), *rest])}


def round_order(round_index: int) -> tuple[int, int]:
    """The order of the two checkouts (0: base, 1: new) in a round: swapped every round."""
    return (0, 1) if round_index % 2 == 0 else (1, 0)


def tagged(stdout: str, tag: str) -> list:
    """What a child printed as ``TAG <json>`` lines (``IMPORTS``, ``RESULT``, ``FAILED``), decoded."""
    return [json.loads(line[len(tag) + 1 :]) for line in stdout.splitlines() if line.startswith(tag + " ")]


def run_child(checkout: str, suites) -> list[dict]:
    run = subprocess.run(child_command(checkout, suites), env=child_env(checkout), cwd=checkout,
                         capture_output=True, text=True)  # fmt: skip
    if run.returncode:
        raise SystemExit(f"{checkout}: exit {run.returncode}\n{run.stdout[-2000:]}\n{run.stderr[-4000:]}")
    imports = tagged(run.stdout, "IMPORTS")
    print(f"{checkout}: {imports[0] if imports else 'no import line'}", flush=True)
    for failed in tagged(run.stdout, "FAILED"):
        print(f"{checkout}: suite {failed['suite']} failed\n{run.stderr[-3000:]}", flush=True)
    return tagged(run.stdout, "RESULT")


def collect(records_by_checkout: list[list[dict]], times: dict, index: int) -> None:
    """Add one child's records to ``times``: ``{(suite, case json, metric): [[base ms...], [new ms...]]}``."""
    for r in records_by_checkout:
        key = (r["suite"], json.dumps(r["case"]), r["metric"])
        times.setdefault(key, [[], []])[index].append(r["ms"])


def compare(base: list, new: list, threshold: float = THRESHOLD) -> tuple[float | None, float | None, float | None, bool]:
    """``(base median, new median, new / base, slower)`` of one case's timings over rounds
    (``None`` timings, a kernel a checkout does not have, are left out; no ratio without both)."""
    b = [t for t in base if t is not None]
    n = [t for t in new if t is not None]
    mb = statistics.median(b) if b else None
    mn = statistics.median(n) if n else None
    ratio = mn / mb if mb and mn is not None else None
    return mb, mn, ratio, ratio is not None and ratio > 1 + threshold


def tables(times: dict, threshold: float, env: dict, rounds: int) -> list[Result]:
    """One result per suite: the case's labels, the metric, base and new medians, new / base, flag."""
    results = []
    for suite in dict.fromkeys(k[0] for k in times):
        keys = [k for k in times if k[0] == suite]
        labels = list(dict.fromkeys(label for _, case, _ in keys for label in json.loads(case)))
        rows = []
        for _, case, metric in keys:
            values = json.loads(case)
            mb, mn, ratio, slower = compare(*times[(suite, case, metric)], threshold)
            rows.append([values.get(label) for label in labels]
                        + [metric, mb, mn, ratio, f"slower by > {threshold:.0%}" if slower else ""])  # fmt: skip
        columns = labels + ["metric", "base ms", "new ms", "new / base", "flag"]
        ms = "{:.4f}" if suite == "host" else "{:.3f}"  # a host time per call is tens of us
        notes = (f"base {env['base']}, new {env['new']}; medians of {rounds} rounds, alternating processes; "
                 f"new / base above 1: new is slower")  # fmt: skip
        results.append(Result("compare_checkouts", f"{suite}: base against new", columns, rows, notes, env,
                              name=f"compare-{suite}", formats={"base ms": ms, "new ms": ms, "new / base": "{:.3f}"}))
    return results


def flagged(results: list[Result]) -> list[str]:
    out = []
    for r in results:
        for row in r.rows:
            if row[-1]:
                out.append(f"{r.name}: " + ", ".join(str(v) for v in row[:-4]) + f" ({row[-2]:.3f})")
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    trees = [str(Path(args.base).resolve()), str(Path(args.new).resolve())]
    times: dict = {}
    for r in range(args.rounds):
        for i in round_order(r):
            collect(run_child(trees[i], args.suites), times, i)
    env = environment(base=f"{trees[0]} ({git_commit(trees[0])})", new=f"{trees[1]} ({git_commit(trees[1])})")
    results = tables(times, args.threshold, env, args.rounds)
    emit(results, args.out)
    slow = flagged(results)
    print(f"\n{len(slow)} case(s) slower by more than {args.threshold:.0%}" + "".join(f"\n  {s}" for s in slow))
    return 1 if slow and args.fail_on_slower else 0


if __name__ == "__main__":
    sys.exit(main())
