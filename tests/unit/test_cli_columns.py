"""The table of ``celery singleton list`` (tools/columns.py), without Redis."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from celery_singleton_lock.tools import columns
from celery_singleton_lock.tools.columns import aligned, cell, cut, tab_separated, width


def test_cells_escape_control_characters_and_count_display_width() -> None:
    assert cell("plain 東京") == "plain 東京"
    assert cell("a\tb\nc\x1b[0m\x00") == "a\\tb\\nc\\x1b[0m\\x00"
    assert width("abc") == 3
    assert width("東京") == 4
    assert width("e\u0301") == 1  # e and a combining accent: one cell
    assert cut("abcdef", 6) == "abcdef"
    assert cut("abcdefg", 6) == "abc..."
    assert cut("東京都東京都", 8) == "東京..."  # a wide character that does not fit is left out
    assert width(cut("東京都東京都", 8)) <= 8


def test_aligned_pads_all_but_the_last_column_and_cuts_the_preview() -> None:
    lines = list(
        aligned(("A", "ARGS", "KEY"), [("long-name", "x" * 60, "k1"), ("b", "y", "k2")], 1)
    )
    assert lines[0] == "A" + " " * 8 + "   ARGS" + " " * 36 + "   KEY"
    assert lines[1] == "long-name   " + "x" * 37 + "...   k1"
    assert lines[2] == "b" + " " * 8 + "   y" + " " * 39 + "   k2"
    assert not any(line.endswith(" ") for line in lines)


def test_rows_past_the_first_batch_stream_with_the_batch_widths(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Widths come from the first BATCH rows; a wider cell later pushes only its own row."""
    monkeypatch.setattr(columns, "BATCH", 2)
    rows = [("a", "1"), ("bb", "2"), ("cccc", "3"), ("d", "4")]
    consumed = []

    def source() -> Iterator[tuple[str, str]]:
        for row in rows:
            consumed.append(row)
            yield row

    lines = aligned(("N", "K"), source())
    assert next(lines) == "N    K"
    assert len(consumed) == 2  # the header waited for one batch, not for every row
    assert list(lines) == ["a    1", "bb   2", "cccc   3", "d    4"]


def test_tab_separated_keeps_a_row_per_line() -> None:
    lines = list(tab_separated(("A", "B"), [("x\ty", "z\n")]))
    assert lines == ["A\tB", "x\\ty\tz\\n"]
