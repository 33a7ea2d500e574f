"""mkdocs hooks: the settings reference page, generated from ``config.SETTINGS`` at build time.

The page (``settings-reference.md``) is not committed: every build renders it from the code's
settings table, so it cannot fall behind. ``render_settings_reference()`` is also what the
unit test checks.
"""

from __future__ import annotations

from typing import Any

from celery_singleton_lock.settings.table import SETTINGS

PAGE = "settings-reference.md"


def _default(value: Any) -> str:
    return f"`{value!r}`"


def render_settings_reference() -> str:
    """The page's Markdown: one row per setting of ``SETTINGS``, in table order."""
    lines = [
        "# Settings reference",
        "",
        "Generated from the settings table in `celery_singleton_lock/settings/table.py` when",
        "the site is built. Every setting is a Celery configuration key; with",
        '`Celery(..., namespace="CELERY")` (Django) it is spelled in upper case with the',
        "`CELERY_` prefix. *Task option*: also settable per task, as a keyword of",
        "`@app.task(...)` or a class attribute. The full story of each is in",
        "[Configuration](configuration.md).",
        "",
        "| setting | `CELERY_` spelling | default | task option | meaning |",
        "|---|---|---|---|---|",
    ]
    for setting in SETTINGS.values():
        doc = " ".join(setting.doc.split()).replace("|", "\\|")
        lines.append(
            f"| `{setting.conf_key}` | `CELERY_{setting.conf_key.upper()}` | "
            f"{_default(setting.default)} | {'yes' if setting.task_option else 'no'} | {doc} |"
        )
    return "\n".join(lines) + "\n"


def on_files(files: Any, config: Any) -> Any:
    """Add the generated page to the site."""
    from mkdocs.structure.files import File

    files.append(File.generated(config, PAGE, content=render_settings_reference()))
    return files
