"""The Celery app the catch-up tests run as real ``celery beat`` processes.

Configured from the environment like ``basic_app``. Its schedule has one entry per catch-up
choice (``singleton_beat_catch_up``): the app's default (``"latest"``, no header), ``"none"``
and a window, each given as the entry's header, the way docs/beat.md shows. The entries name
tasks no process registers: the beats publish them with ``send_task`` and the tests read what
they published from their logs; no worker runs. ``SINGLETON_TEST_CATCH_UP=cron`` makes them
every-minute crontab entries (the window 150 s), else 2 s interval entries (the window 5 s).
"""

from __future__ import annotations

import os
from typing import Any

from celery.schedules import crontab

from celery_singleton_lock.beat.catch_up import CATCH_UP_HEADER
from tests.support.basic_app import make_app

__test__ = False

CRON = os.environ.get("SINGLETON_TEST_CATCH_UP") == "cron"
#: every entry's schedule, and each entry's choice (None: the app's default, "latest")
SCHEDULE: Any = crontab() if CRON else 2.0
CHOICES: dict[str, str | float | None] = {
    "default": None,
    "none": "none",
    "window": 150.0 if CRON else 5.0,
}

app = make_app()
app.main = "tests.support.catch_up_app"
app.conf.singleton_redis_url = app.conf.singleton_test_redis_url
app.conf.singleton_key_prefix = app.conf.singleton_test_prefix + "lock:"
app.conf.beat_scheduler = "celery_singleton_lock.SingletonScheduler"
app.conf.beat_schedule = {
    name: {
        "task": "catch_up.remote",
        "schedule": SCHEDULE,
        "options": {} if choice is None else {"headers": {CATCH_UP_HEADER: choice}},
    }
    for name, choice in CHOICES.items()
}
