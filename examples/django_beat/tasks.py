"""The scheduled task of the example: it notes each run it executes in a Redis list."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from django.conf import settings

from .celery import app

_clients: dict[str, redis.Redis] = {}


@app.task(bind=True, name="example.record")
def record(self: Any, entry: str, version: int = 1) -> str:
    """Note one execution: the entry, its version (an edit changes it) and the run's label.

    ``singleton_beat_run`` (``<entry>@<run id>``) is the header the singleton scheduler puts on
    every message it publishes; ``periodic_task_name`` is django-celery-beat's.
    """
    url = settings.CELERY_BROKER_URL
    client = _clients.get(url) or _clients.setdefault(url, redis.Redis.from_url(url))
    run = str(self.request.get("singleton_beat_run") or f"{entry}@?")
    note = {
        "entry": entry,
        "version": version,
        "run": run,
        "periodic_task_name": self.request.get("periodic_task_name"),
        "task_id": self.request.id,
        "pid": os.getpid(),
        "at": time.time(),
    }
    client.rpush(settings.EXAMPLE_RUNS_KEY, json.dumps(note))
    return run
