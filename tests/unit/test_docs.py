"""The docs site: the generated settings reference covers the code's settings table."""

from __future__ import annotations

from pathlib import Path

from celery_singleton_lock.settings.table import SETTINGS
from scripts.docs_hooks import render_settings_reference

ROOT = Path(__file__).resolve().parents[2]


def test_settings_reference_has_one_row_per_setting() -> None:
    """Every setting of config.SETTINGS is one row, with its CELERY_ spelling and default."""
    page = render_settings_reference()
    rows = [line for line in page.splitlines() if line.startswith("| `singleton_")]
    assert len(rows) == len(SETTINGS)
    for setting, row in zip(SETTINGS.values(), rows, strict=True):
        assert row.startswith(f"| `{setting.conf_key}` | `CELERY_{setting.conf_key.upper()}` |")
        assert f"`{setting.default!r}`" in row
        assert row.count(" | ") == 4  # a "|" in a doc string would break the table


def test_configuration_page_and_nav_know_every_setting() -> None:
    """docs/configuration.md explains each setting; mkdocs.yml uses the hook and lists the page."""
    text = (ROOT / "docs" / "configuration.md").read_text()
    missing = [s.conf_key for s in SETTINGS.values() if f"`{s.conf_key}`" not in text]
    assert missing == []
    mkdocs = (ROOT / "mkdocs.yml").read_text()
    assert "scripts/docs_hooks.py" in mkdocs
    assert "settings-reference.md" in mkdocs


def test_every_example_is_documented_and_tested() -> None:
    """Each examples/*.py is in the quickstart's table and run by a test (or by one it runs)."""
    quickstart = (ROOT / "docs" / "quickstart.md").read_text()
    tests = "\n".join(p.read_text() for p in (ROOT / "tests").rglob("test_*.py"))
    examples = sorted(p for p in (ROOT / "examples").glob("*.py") if p.name != "__init__.py")

    def used_by(text: str, example: Path) -> bool:
        return f"examples.{example.stem}" in text or f'"{example.stem}"' in text

    tested = [e for e in examples if used_by(tests, e)]
    reached = "\n".join([tests, *(e.read_text() for e in tested)])  # the demo runs demo_app
    for example in examples:
        assert f"`{example.name}`" in quickstart, example.name
        assert used_by(reached, example), example.name
