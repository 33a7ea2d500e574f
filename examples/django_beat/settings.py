"""Django settings of the example: SQLite, django-celery-beat, Celery under ``CELERY_``.

The database file, the Redis URL and a key prefix come from the environment only so the tests
can give each run its own (``EXAMPLE_DB``, ``EXAMPLE_REDIS_URL``, ``EXAMPLE_PREFIX``).
"""

from __future__ import annotations

import os
from pathlib import Path

import django

BASE_DIR = Path(__file__).resolve().parent

SECRET_KEY = "example-only-not-secret"  # an example project, never deployed
DEBUG = False
USE_TZ = True
TIME_ZONE = "UTC"
INSTALLED_APPS = ["django_celery_beat"]
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": os.environ.get("EXAMPLE_DB", str(BASE_DIR / "db.sqlite3")),
        # several beats and the admin write to one file: wait for its lock instead of failing
        "OPTIONS": {"timeout": 30, "init_command": "PRAGMA journal_mode=WAL;"},
    }
}
if django.VERSION >= (5, 1):
    # Transactions take the write lock when they begin: a transaction that read first and
    # then writes (django-celery-beat's update_or_create) would otherwise fail at once with
    # "database is locked" when another process wrote in between, whatever the timeout.
    DATABASES["default"]["OPTIONS"]["transaction_mode"] = "IMMEDIATE"

_REDIS = os.environ.get("EXAMPLE_REDIS_URL", "redis://localhost:6379/0")
_PREFIX = os.environ.get("EXAMPLE_PREFIX", "django-beat-example:")

CELERY_BROKER_URL = _REDIS
CELERY_BROKER_TRANSPORT_OPTIONS = {"global_keyprefix": _PREFIX}
CELERY_TASK_DEFAULT_QUEUE = f"{_PREFIX}celery"
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_TIMEZONE = TIME_ZONE
CELERY_IMPORTS = ["examples.django_beat.tasks"]
# django-celery-beat's database scheduler, each run published by one beat instance only
CELERY_BEAT_SCHEDULER = "celery_singleton_lock.beat.SingletonDatabaseScheduler"
# the run claims live in the broker's Redis, under this prefix
CELERY_SINGLETON_KEY_PREFIX = f"{_PREFIX}lock:"
#: where tasks.record appends what ran (the example's "work", read by the tests)
EXAMPLE_RUNS_KEY = f"{_PREFIX}runs"
