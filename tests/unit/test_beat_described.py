"""A beat entry as the beats register it for operators (beat/described.py)."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

from celery import Celery
from celery.beat import ScheduleEntry
from celery.schedules import crontab, solar
from django_celery_beat.clockedschedule import clocked

from celery_singleton_lock.beat.catch_up import CATCH_UP_HEADER
from celery_singleton_lock.beat.described import describe, next_due, schedule_text

NOW = datetime(2026, 11, 28, 2, 30, 7, tzinfo=timezone.utc)


def entry(app: Celery, sched: object, **options: object) -> ScheduleEntry:
    return ScheduleEntry(
        name="e",
        task="proj.job",
        schedule=sched,
        args=("s3cret-token",),
        kwargs={"password": "s3cret"},
        options=options,
        app=app,
    )


def test_an_interval_entry_is_its_task_schedule_and_catch_up_never_its_arguments() -> None:
    app = Celery("d", set_as_current=False)
    described = describe(entry(app, 10.0), "latest")
    assert json.loads(described) == {
        "task": "proj.job",
        "schedule": {"every": 10.0},
        "catch_up": "latest",
    }
    assert "s3cret" not in described
    assert schedule_text(described) == "every 10s"
    assert next_due(described, NOW, app) == datetime(2026, 11, 28, 2, 30, 10, tzinfo=timezone.utc)


def test_a_crontab_entry_comes_due_by_the_apps_time_zone() -> None:
    app = Celery("d", set_as_current=False)
    app.conf.timezone = "Europe/Berlin"
    described = describe(entry(app, crontab(minute="0", hour="4", app=app)), "none")
    assert schedule_text(described) == "crontab(0 4 * * *)"
    # 02:30 UTC is 03:30 in Berlin: 04:00 there comes at 03:00 UTC
    assert next_due(described, NOW, app) == datetime(2026, 11, 28, 3, 0, tzinfo=timezone.utc)


def test_the_entrys_catch_up_header_is_shown_and_an_invalid_one_is_the_apps() -> None:
    app = Celery("d", set_as_current=False)
    window = entry(app, 60.0, headers={CATCH_UP_HEADER: 300})
    assert json.loads(describe(window, "latest"))["catch_up"] == "300s"
    invalid = entry(app, 60.0, headers={CATCH_UP_HEADER: "sometimes"})
    assert json.loads(describe(invalid, "none"))["catch_up"] == "none"


def test_a_solar_entry_and_one_that_runs_once() -> None:
    app = Celery("d", set_as_current=False)
    sunset = describe(entry(app, solar("sunset", 52.5, 13.4, app=app)), "latest")
    assert schedule_text(sunset) == "solar(sunset, 52.5, 13.4)"
    due = next_due(sunset, NOW, app)
    assert due is not None
    assert NOW < due < NOW + timedelta(days=1)
    once = describe(entry(app, clocked(NOW + timedelta(hours=1))), "latest")
    assert schedule_text(once) == "clocked"
    assert next_due(once, NOW, app) is None
