"""Django for the database-scheduler tests: the example project's settings, one SQLite file each.

The test process configures Django from ``examples.django_beat.settings`` with
``settings.configure`` (never ``DJANGO_SETTINGS_MODULE``: Celery apps created afterwards would
install Celery's Django fixup). Each test gets its own SQLite file, a copy of one migrated once
per process, and beats of the example started by the test use the same file (``EXAMPLE_DB``).
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path

__test__ = False

_template: Path | None = None


def setup_django() -> None:
    """Configure Django from the example's settings (once per process) and set it up."""
    import django
    from django.conf import settings

    if not settings.configured:
        from examples.django_beat import settings as example

        settings.configure(**{k: getattr(example, k) for k in dir(example) if k.isupper()})
    django.setup()


def _migrated_template() -> Path:
    """A SQLite file with django-celery-beat's tables, migrated once per process."""
    global _template  # noqa: PLW0603 - one file per process
    if _template is None or not _template.exists():
        from django.core.management import call_command

        folder = tempfile.mkdtemp(prefix="django-beat-template-")
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        path = Path(folder) / "template.sqlite3"
        _point_at(path)
        call_command("migrate", verbosity=0, interactive=False)
        _point_at(None)
        _template = path
    return _template


def _point_at(path: Path | None) -> None:
    """Point the default connection at ``path`` (closing the current one); None: nowhere."""
    from django.db import connections

    connection = connections["default"]
    connection.close()
    connection.settings_dict["NAME"] = str(path) if path else ":memory:"


def use_database(path: Path) -> Path:
    """A fresh migrated database at ``path``; the test process's ORM now works on it."""
    setup_django()
    template = _migrated_template()
    shutil.copyfile(template, path)
    _point_at(path)
    return path


def release_database() -> None:
    """Close the test process's connection to its database."""
    _point_at(None)
