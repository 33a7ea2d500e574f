"""The docs site: the generated settings reference covers the code's settings table."""

from __future__ import annotations

from pathlib import Path

from celery_singleton_lock.config import SETTINGS
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
