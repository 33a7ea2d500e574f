"""Small helpers shared by the sections: medians, spreads and plain-text tables."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def paired_ratio(values: Sequence[float], baseline: Sequence[float]) -> float:
    """Median of the per-round ratios ``values[i] / baseline[i]``.

    Each round measures both one after the other, so a load spike on the shared machine
    tends to hit a pair together; pairing keeps it out of the ratio better than a ratio of
    two medians would.
    """
    return median([v / b for v, b in zip(values, baseline, strict=True)])


def spread(values: Sequence[float]) -> str:
    """``min-max`` of the repeats, for the tables (the noise a reader should see)."""
    if not values:
        return "-"
    return f"{fmt(min(values))}-{fmt(max(values))}"


def fmt(value: Any) -> str:
    """Numbers with a precision that fits their size; anything else as str."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if math.isnan(value):
        return "-"
    magnitude = abs(value)
    if magnitude >= 1000:
        return f"{value:,.0f}"
    if magnitude >= 100:
        return f"{value:.0f}"
    if magnitude >= 10:
        return f"{value:.1f}"
    if magnitude >= 1:
        return f"{value:.2f}"
    return f"{value:.3f}"


@dataclass
class Table:
    """One section's results: a title, column headers, rows and notes under the table."""

    title: str
    headers: list[str]
    rows: list[list[Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, *cells: Any) -> None:
        self.rows.append(list(cells))

    def cells(self) -> list[list[str]]:
        return [[fmt(c) for c in row] for row in self.rows]

    def render(self) -> str:
        """A text table for the terminal."""
        cells = self.cells()
        widths = [len(h) for h in self.headers]
        for row in cells:
            widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]
        numeric = [
            all(_looks_numeric(row[i]) for row in cells) if cells else False
            for i in range(len(self.headers))
        ]

        def line(values: list[str]) -> str:
            parts = [
                v.rjust(w) if num else v.ljust(w)
                for v, w, num in zip(values, widths, numeric, strict=True)
            ]
            return "  ".join(parts).rstrip()

        out = [self.title, "=" * len(self.title), line(self.headers)]
        out.append("  ".join("-" * w for w in widths))
        out += [line(row) for row in cells]
        out += [f"  {note}" for note in self.notes]
        return "\n".join(out)

    def markdown(self) -> str:
        """The same table as Markdown (for docs/performance.md)."""
        cells = self.cells()
        numeric = [
            all(_looks_numeric(row[i]) for row in cells) if cells else False
            for i in range(len(self.headers))
        ]
        out = ["| " + " | ".join(self.headers) + " |"]
        out.append("|" + "|".join("---:" if num else "---" for num in numeric) + "|")
        out += ["| " + " | ".join(row) + " |" for row in cells]
        return "\n".join(out)


def _looks_numeric(text: str) -> bool:
    stripped = text.replace(",", "").replace("%", "").replace("x", "").replace("-", "")
    stripped = stripped.replace(".", "").replace("+", "").replace(" ", "")
    return stripped.isdigit() or text == "-"
