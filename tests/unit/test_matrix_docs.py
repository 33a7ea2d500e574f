"""docs/compatibility.md's "Our features together" tables say what tests/support/matrix.py
declares, cell by cell: what the integration tests (tests/integration/test_matrix*.py) run and
check is what the page promises."""

from __future__ import annotations

from pathlib import Path

from tests.support.matrix import CELLS, LABELS, TABLES

PAGE = Path(__file__).resolve().parents[2] / "docs" / "compatibility.md"
SECTION = "## Our features together"


def _tables() -> list[list[list[str]]]:
    """The section's Markdown tables, in order, each a list of rows of cells."""
    text = PAGE.read_text()
    assert SECTION in text, f"{PAGE.name} has no {SECTION!r}"
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    tables: list[list[list[str]]] = []
    current: list[list[str]] | None = None
    for line in section.splitlines():
        if not line.startswith("|"):
            current = None
            continue
        if set(line.strip()) <= set("|-: "):  # the header's rule
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split(" | ")]
        if current is None:
            current = []
            tables.append(current)
        current.append(cells)
    return tables


def _documented() -> dict[str, str]:
    """Each cell's text in the page, by the cell's id."""
    names = {label: name for name, label in LABELS.items()}
    tables = _tables()
    assert len(tables) == len(TABLES), f"{len(tables)} tables under {SECTION!r}"
    found = {}
    for (name, rows, cols), table in zip(TABLES, tables, strict=True):
        header, *body = table
        assert [names.get(label) for label in header[1:]] == list(cols), (name, header)
        assert [names.get(row[0]) for row in body] == list(rows), (name, [r[0] for r in body])
        for row in body:
            assert len(row) == len(cols) + 1, (name, row)
            for col, text in zip(cols, row[1:], strict=True):
                found[f"{name}-{names[row[0]]}-{col}"] = text
    return found


def test_the_page_says_what_each_cell_declares() -> None:
    documented = _documented()
    assert set(documented) == {cell.id for cell in CELLS}
    wrong = {
        cell.id: (documented[cell.id], cell.doc)
        for cell in CELLS
        if documented[cell.id] != cell.doc
    }
    assert not wrong, "docs/compatibility.md (page, declared) differ:\n" + "\n".join(
        f"{cell}: {page!r} != {declared!r}" for cell, (page, declared) in wrong.items()
    )


def test_each_cell_says_works_refused_or_not_yet_as_it_is_declared() -> None:
    for cell in CELLS:
        if not cell.allowed:
            assert cell.doc.startswith("refused: "), cell
            assert len(cell.refused) == 2, cell
            assert not cell.expect, cell
        elif cell.known_failure is not None:
            assert cell.doc.startswith("not yet: "), cell
        else:
            assert cell.doc == "works" or cell.doc.startswith("works: "), cell
            assert cell.expect, cell
