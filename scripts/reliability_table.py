#!/usr/bin/env python3
"""Render the chaos and load figures as a markdown table (for docs/reliability.md).

Usage::

    SINGLETON_RELIABILITY_OUT=/tmp/rel.jsonl ./run test -k "chaos or load"
    python scripts/reliability_table.py /tmp/rel.jsonl

Each input line is one JSON object written by ``tests.support.chaos.record_figures``:
``{"scenario", "runs", "overlaps", "stuck_locks", "lost_runs"}`` and, where the scenario
counts it, ``"run_twice"`` (messages run again after they finished; ``-`` in the table
otherwise). Lines are printed in the order they were written; a scenario recorded more than
once gets one row per recording.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

COLUMNS = (
    ("scenario", "scenario"),
    ("runs", "runs"),
    ("overlaps", "overlaps"),
    ("stuck_locks", "stuck locks"),
    ("lost_runs", "lost runs"),
    ("run_twice", "run twice"),
)
#: columns a line may leave out (older figures, scenarios that do not count them)
OPTIONAL = frozenset({"run_twice"})


def read_figures(lines: Iterable[str]) -> list[dict[str, object]]:
    """Parse the JSON lines (blank lines skipped); raise ValueError naming a bad line."""
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"line {number}: not JSON: {exc}") from exc
        missing = [key for key, _ in COLUMNS if key not in row and key not in OPTIONAL]
        if missing:
            raise ValueError(f"line {number}: missing {', '.join(missing)}")
        rows.append(row)
    return rows


def _cell(value: object) -> str:
    if value is None:
        return "-"
    return str(value).replace("|", "\\|").replace("\n", " ")


def render(rows: Sequence[dict[str, object]]) -> str:
    """A markdown table: scenario | runs | overlaps | stuck locks | lost runs | run twice."""
    header = "| " + " | ".join(title for _, title in COLUMNS) + " |"
    align = "|---|" + "---:|" * (len(COLUMNS) - 1)
    body = ["| " + " | ".join(_cell(row.get(key)) for key, _ in COLUMNS) + " |" for row in rows]
    return "\n".join([header, align, *body])


def main(argv: Sequence[str] | None = None) -> int:
    """Print the table for the JSON-lines file given on the command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("figures", type=Path, help="JSON lines written by the chaos/load tests")
    args = parser.parse_args(argv)
    try:
        rows = read_figures(args.figures.read_text(encoding="utf-8").splitlines())
    except (OSError, ValueError) as exc:
        print(f"reliability_table: {args.figures}: {exc}", file=sys.stderr)
        return 1
    print(render(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
