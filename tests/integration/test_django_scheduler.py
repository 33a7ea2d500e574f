"""SingletonDatabaseScheduler: django-celery-beat's DatabaseScheduler behind the run claims.

Scheduler instances live in this process on one SQLite database (the example project's
settings, tests/support/django_db.py) and share the run claims in a real Redis; each has its
own injected wall clock (``singleton_clock``) for the nominal times. The entries name tasks the
app does not know, so Celery's ``Scheduler.apply_async`` hands them to ``send_task``, which
records instead of publishing. What ``ModelEntry.is_due`` checks itself (enabled,
``start_time``, ``expires``, ``one_off``, the clocked time) uses the real clock, so those
instants are set relative to now.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from celery_singleton_lock.beat.claims import RUN_HEADER
from tests.support.recording_schedulers import recording_scheduler


@pytest.fixture
def app(redis_url: str, key_prefix: str) -> Iterator[Celery]:
    """An app for the schedulers: claims under ``key_prefix``, no broker, no result expiry
    (so no ``celery.backend_cleanup`` entry joins the schedule)."""
    app = Celery("django-scheduler-test", broker="memory://", set_as_current=False)
    app.conf.update(
        singleton_redis_url=redis_url,
        singleton_key_prefix=f"{key_prefix}lock:",
        timezone="UTC",
        result_expires=None,
    )
    yield app
    app.close()


def set_clock(scheduler: Any, now: float) -> None:
    scheduler.singleton_clock = lambda: now


def periodic_task(name: str, **fields: Any) -> Any:
    """Create a PeriodicTask for ``remote.<name>`` (a task the app does not know)."""
    from django_celery_beat.models import PeriodicTask

    return PeriodicTask.objects.create(name=name, task=f"remote.{name}", **fields)


def every(seconds: int) -> Any:
    from django_celery_beat.models import IntervalSchedule

    schedule, _ = IntervalSchedule.objects.get_or_create(
        every=seconds, period=IntervalSchedule.SECONDS
    )
    return schedule


def tick_entry(scheduler: Any, name: str) -> bool:
    """What beat's tick does with ``name`` when it is at the top of the heap: ask ``is_due``,
    then reserve and apply it if due. Returns whether it was due."""
    entry = scheduler.schedule.get(name)
    if entry is None:
        return False
    due, _next = scheduler.is_due(entry)
    if due:
        scheduler.reserve(entry)
        scheduler.apply_entry(entry, producer=None)
    return bool(due)


def labels(*schedulers: Any) -> list[str]:
    return [msg["headers"][RUN_HEADER] for s in schedulers for msg in s.sent]


def slot_now(interval: int) -> int:
    return math.floor(time.time() / interval) * interval


# -- what ModelEntry.is_due decides still counts for interval entries -------------------------


@pytest.mark.usefixtures("django_database")
def test_interval_entry_before_its_start_time_does_not_run(app: Celery) -> None:
    """start_time an hour ahead: the database scheduler would not run it, nor may the mixin."""
    periodic_task(
        "later", interval=every(10), start_time=datetime.now(timezone.utc) + timedelta(hours=1)
    )
    slot = slot_now(10)
    scheduler = recording_scheduler(app, slot + 1.0)
    assert not tick_entry(scheduler, "later")
    set_clock(scheduler, slot + 11.0)  # a new slot has begun
    assert not tick_entry(scheduler, "later")
    assert labels(scheduler) == []


@pytest.mark.usefixtures("django_database")
def test_expired_interval_entry_does_not_run_and_is_disabled(app: Celery) -> None:
    """expires a minute ago: ModelEntry.is_due disables it; nothing is published."""
    from django_celery_beat.models import PeriodicTask

    periodic_task(
        "expired", interval=every(10), expires=datetime.now(timezone.utc) - timedelta(minutes=1)
    )
    slot = slot_now(10)
    scheduler = recording_scheduler(app, slot + 1.0)
    tick_entry(scheduler, "expired")
    set_clock(scheduler, slot + 11.0)
    assert not tick_entry(scheduler, "expired")
    assert labels(scheduler) == []
    assert not PeriodicTask.objects.get(name="expired").enabled


@pytest.mark.usefixtures("django_database")
def test_one_off_interval_entry_runs_once(app: Celery) -> None:
    """one_off: published at its first slot, then disabled, never published again."""
    from django_celery_beat.models import PeriodicTask

    periodic_task("once", interval=every(10), one_off=True)
    slot = slot_now(10)
    scheduler = recording_scheduler(app, slot + 1.0)
    tick_entry(scheduler, "once")
    for step in (11.0, 21.0, 31.0):
        set_clock(scheduler, slot + step)
        tick_entry(scheduler, "once")
    assert len(labels(scheduler)) == 1, labels(scheduler)
    assert not PeriodicTask.objects.get(name="once").enabled


@pytest.mark.usefixtures("django_database")
def test_one_off_entry_is_not_run_again_by_an_instance_that_loaded_it_late(app: Celery) -> None:
    """Instance b loads the one-off entry after a published it but before any sync wrote its
    run count: b sees it never ran and fires it at a later slot. One publish in all."""
    periodic_task("once", interval=every(10), one_off=True)
    slot = slot_now(10)
    a = recording_scheduler(app, slot + 1.0)
    tick_entry(a, "once")
    set_clock(a, slot + 11.0)
    assert tick_entry(a, "once")
    b = recording_scheduler(app, slot + 21.0)  # reads the row: total_run_count still 0
    tick_entry(b, "once")
    set_clock(b, slot + 31.0)
    tick_entry(b, "once")
    assert len(labels(a, b)) == 1, labels(a, b)


@pytest.mark.usefixtures("django_database")
def test_interval_entry_first_runs_at_the_first_slot_from_its_start_time(app: Celery) -> None:
    """start_time inside the current hour slot (just past): that slot is not the entry's;
    the next one is."""
    start = datetime.now(timezone.utc) - timedelta(seconds=1)
    periodic_task("hourly", interval=every(3600), start_time=start)
    hour = math.floor(start.timestamp() / 3600) * 3600
    if start.timestamp() - hour < 2:
        pytest.skip("start_time fell on an hour boundary")  # once in 1800 runs
    scheduler = recording_scheduler(app, time.time())
    assert not tick_entry(scheduler, "hourly"), "a slot that began before start_time ran"
    set_clock(scheduler, hour + 3600 + 0.5)
    assert tick_entry(scheduler, "hourly")
    assert labels(scheduler) == [f"hourly@{(hour + 3600) * 1000}"]


# -- clocked ------------------------------------------------------------------------------------


@pytest.mark.usefixtures("django_database")
def test_clocked_entry_published_once_by_instances_firing_seconds_apart(app: Celery) -> None:
    """Three instances fire one clocked run 0, 3 and 7 s after its time (one reloaded its
    schedule late, one started late): one publish, named by the clocked time."""
    from django_celery_beat.models import ClockedSchedule

    at = datetime.now(timezone.utc) - timedelta(seconds=1)
    clocked = ClockedSchedule.objects.create(clocked_time=at)
    periodic_task("clocked", clocked=clocked, one_off=True)
    instances = [recording_scheduler(app, at.timestamp() + late) for late in (0.0, 3.0, 7.0)]
    for scheduler in instances:
        assert tick_entry(scheduler, "clocked")
    published = labels(*instances)
    assert len(published) == 1, published


# -- what a beat writes back -----------------------------------------------------------------------


def edit_kwargs(name: str, version: int) -> None:
    """Save new arguments for ``name``, as the admin does (the whole row)."""
    import json

    from django_celery_beat.models import PeriodicTask

    edited = PeriodicTask.objects.get(name=name)
    edited.kwargs = json.dumps({"version": version})
    edited.save()


def saved_kwargs(name: str) -> Any:
    import json

    from django_celery_beat.models import PeriodicTask

    return json.loads(PeriodicTask.objects.get(name=name).kwargs)


@pytest.mark.usefixtures("django_database")
def test_an_edit_saved_while_a_beat_writes_its_run_state_is_kept(app: Celery) -> None:
    """A beat's sync writes each entry it ran. django-celery-beat's ModelEntry.save reads the row
    and saves it whole: an edit saved between its read and its write (here, right after the
    beat's first statement on the row) was overwritten with the old arguments. Several beats
    sync at every schedule change, so most edits made in that moment were lost."""
    import json

    from django.db import connection

    periodic_task("edited", interval=every(2), kwargs=json.dumps({"version": 1}))
    slot = slot_now(2)
    scheduler = recording_scheduler(app, slot + 0.5)
    tick_entry(scheduler, "edited")
    for step in (2.5, 4.5):  # the first run's state is written at once (Celery's first sync)
        set_clock(scheduler, slot + step)
        assert tick_entry(scheduler, "edited")
    assert "edited" in scheduler._dirty  # the second's waits for the next sync
    edited_in_between = False

    def edit_after_the_first_statement(execute: Any, sql: str, *args: Any) -> Any:
        nonlocal edited_in_between
        result = execute(sql, *args)
        if not edited_in_between and '"django_celery_beat_periodictask"' in sql:
            edited_in_between = True
            edit_kwargs("edited", 2)
        return result

    with connection.execute_wrapper(edit_after_the_first_statement):
        scheduler.sync()
    assert edited_in_between
    assert saved_kwargs("edited") == {"version": 2}
    from django_celery_beat.models import PeriodicTask

    written = PeriodicTask.objects.get(name="edited")
    assert written.total_run_count == 2  # the run state was written too
    assert written.last_run_at is not None


@pytest.mark.usefixtures("django_database")
def test_an_expired_entry_is_disabled_without_undoing_a_later_edit(app: Celery) -> None:
    """ModelEntry._disable saved the whole row as the beat had loaded it: an edit saved since
    (before the beat reloaded) was undone when the entry expired."""
    import json

    from django_celery_beat.models import PeriodicTask

    periodic_task(
        "expiring",
        interval=every(10),
        kwargs=json.dumps({"version": 1}),
        expires=datetime.now(timezone.utc) - timedelta(seconds=1),
    )
    scheduler = recording_scheduler(app, time.time())
    entry = scheduler.schedule["expiring"]  # loaded: version 1
    edit_kwargs("expiring", 2)
    assert not scheduler.is_due(entry)[0]
    row = PeriodicTask.objects.get(name="expiring")
    assert not row.enabled
    assert json.loads(row.kwargs) == {"version": 2}
    assert labels(scheduler) == []


# -- the named scheduler -------------------------------------------------------------------------


@pytest.mark.usefixtures("django_database")
def test_named_scheduler_resolves_by_alias_and_by_class_path(app: Celery, tmp_path: Path) -> None:
    """``celery beat -S singleton-django`` and the documented class paths load one class."""
    from celery.beat import Service
    from django_celery_beat.schedulers import DatabaseScheduler

    import celery_singleton_lock
    from celery_singleton_lock.beat import SingletonDatabaseScheduler, SingletonSchedulerMixin

    assert celery_singleton_lock.SingletonDatabaseScheduler is SingletonDatabaseScheduler
    assert issubclass(SingletonDatabaseScheduler, SingletonSchedulerMixin)
    assert issubclass(SingletonDatabaseScheduler, DatabaseScheduler)
    for name in (
        "singleton-django",
        "celery_singleton_lock.beat:SingletonDatabaseScheduler",
        "celery_singleton_lock.beat.SingletonDatabaseScheduler",
        "celery_singleton_lock.SingletonDatabaseScheduler",
    ):
        service = Service(app, scheduler_cls=name, schedule_filename=str(tmp_path / "s"))
        try:
            scheduler = service.get_scheduler(lazy=True)
        except (ImportError, AttributeError) as exc:  # an alias unknown to the installed metadata
            pytest.fail(f"{name}: {exc} (pip install -e . registers the entry point)")
        assert type(scheduler) is SingletonDatabaseScheduler, name


@pytest.mark.usefixtures("django_database")
def test_a_change_saved_while_the_beat_starts_is_picked_up(
    app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """django-celery-beat reads the schedule, then (at its next look, still inside its start-up)
    notes the time of the last change: an edit saved in between was never seen as a change, and
    the old arguments ran until its full sync five minutes later. Ours notes the time first."""
    import json

    from django_celery_beat.models import PeriodicTask
    from django_celery_beat.schedulers import DatabaseScheduler

    periodic_task("edited", interval=every(2), kwargs=json.dumps({"version": 1}))
    install = DatabaseScheduler.install_default_entries

    def edit_then_install(self: Any, data: Any) -> None:  # runs right after the initial read
        assert data["edited"].kwargs == {"version": 1}
        time.sleep(0.01)  # the change is later than any time noted before the read
        edited = PeriodicTask.objects.get(name="edited")
        edited.kwargs = json.dumps({"version": 2})
        edited.save()
        install(self, data)

    monkeypatch.setattr(DatabaseScheduler, "install_default_entries", edit_then_install)
    scheduler = recording_scheduler(app, time.time())
    assert scheduler.schedule["edited"].kwargs == {"version": 2}
