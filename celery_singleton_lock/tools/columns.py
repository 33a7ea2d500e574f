"""The table ``celery singleton list`` prints: aligned in a terminal, tab-separated when piped.

In a terminal the columns are padded to their widest cell, three spaces apart (as ``kubectl
get`` and ``docker ps`` print), and the arguments preview is cut to :data:`PREVIEW_WIDTH`
display cells. The widths come from the first :data:`BATCH` rows, so a long listing still
streams in bounded memory: a later, wider cell only pushes the rest of its own row. Piped, each
row is the cells joined by tabs, as before (``cut -f``, ``awk -F'\\t'``).

Either way a cell never carries a control character: a tab or a newline (an ``argsrepr`` can
hold any string) would break the row, an escape sequence would reach the operator's terminal.
Such a character is shown escaped, as ``repr`` shows it (``\\t``, ``\\x1b``).
"""

from __future__ import annotations

import unicodedata
from collections.abc import Iterable, Iterator, Sequence
from itertools import islice

__all__ = ["BATCH", "PREVIEW_WIDTH", "aligned", "cell", "cut", "tab_separated", "width"]

#: Display cells the arguments preview keeps in a terminal (the stored preview has up to 100).
PREVIEW_WIDTH = 40
#: Rows read before the widths are fixed.
BATCH = 500
_GAP = "   "
_ELLIPSIS = "..."


def cell(value: str) -> str:
    """``value`` with each control or otherwise unprintable character escaped."""
    if value.isprintable():
        return value
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in value)


def width(text: str) -> int:
    """Display cells ``text`` takes in a terminal: wide East Asian characters take two,
    combining marks none."""
    if text.isascii():
        return len(text)
    return sum(
        0 if unicodedata.combining(ch) else 2 if unicodedata.east_asian_width(ch) in "WF" else 1
        for ch in text
    )


def cut(text: str, cells: int) -> str:
    """``text`` cut to at most ``cells`` display cells, ending in ``...`` when cut."""
    if width(text) <= cells:
        return text
    room = cells - len(_ELLIPSIS)
    kept: list[str] = []
    for ch in text:
        room -= width(ch)
        if room < 0:
            break
        kept.append(ch)
    return "".join(kept) + _ELLIPSIS


def tab_separated(header: Sequence[str], rows: Iterable[Sequence[str]]) -> Iterator[str]:
    """The header and each row, cells joined by tabs."""
    yield "\t".join(header)
    for cells in rows:
        yield "\t".join(cell(value) for value in cells)


def aligned(
    header: Sequence[str], rows: Iterable[Sequence[str]], preview: int | None = None
) -> Iterator[str]:
    """The header and each row, padded into columns; column ``preview`` (an index) cut to
    :data:`PREVIEW_WIDTH`. The last column is not padded (no trailing spaces)."""

    def clean(cells: Sequence[str]) -> list[str]:
        found = [cell(value) for value in cells]
        if preview is not None:
            found[preview] = cut(found[preview], PREVIEW_WIDTH)
        return found

    source = iter(rows)
    first = [list(header), *(clean(cells) for cells in islice(source, BATCH))]
    widths = [max(width(cells[i]) for cells in first) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        padded = [
            value + " " * (size - width(value)) for value, size in zip(cells, widths, strict=True)
        ]
        return _GAP.join([*padded[:-1], cells[-1]])

    yield from (line(cells) for cells in first)
    yield from (line(clean(cells)) for cells in source)
