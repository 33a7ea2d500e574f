"""The project's Celery app (``proj/celery.py`` in Django's Celery docs)."""

from __future__ import annotations

import os

from celery import Celery

# the workers' witness of scheduled runs: a run's second message (its beat died between
# publishing it and confirming its claim) is dropped (docs/beat.md, "Killing an instance")
import celery_singleton_lock  # noqa: F401

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "examples.django_beat.settings")

app = Celery("examples.django_beat")
app.config_from_object("django.conf:settings", namespace="CELERY")
