"""SingletonSchedulerMixin in front of another scheduler class, against a real Redis.

Two scheduler instances live in one process, each with its own in-memory schedule and its own
injected clock (``singleton_clock``), and share the run claims in Redis. The entries name tasks
the app does not know, so Celery's ``Scheduler.apply_async`` hands them to ``self.send_task``:
the test subclass records there instead of publishing (a seam of Celery's scheduler, not of
this library), so no broker is involved.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery
from celery.beat import ScheduleEntry, Scheduler, Service
from celery.schedules import crontab
from celery.utils.imports import symbol_by_name

import celery_singleton_lock
from celery_singleton_lock.beat import RUN_HEADER, SingletonScheduler, SingletonSchedulerMixin

INTERVAL = "remote-every-10s"
CRON = "remote-every-5min"


class MemoryScheduler(Scheduler):  # type: ignore[misc]
    """A plain in-memory scheduler: the entries of ``beat_schedule``, nothing persisted."""

    def setup_schedule(self) -> None:
        self.data: dict[str, ScheduleEntry] = {}
        self.merge_inplace(self.app.conf.beat_schedule)

    def sync(self) -> None:
        """Nothing to persist."""


class Guarded(SingletonSchedulerMixin, MemoryScheduler):
    """The mixin in front of MemoryScheduler; records what it would publish."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.sent: list[dict[str, Any]] = []
        super().__init__(*args, **kwargs)

    def send_task(self, name: str, args: Any = None, kwargs: Any = None, **options: Any) -> Any:
        """Record the message beat would send for a task it does not know."""
        self.sent.append({"task": name, "args": args, "headers": options.get("headers", {})})
        return SimpleNamespace(id=str(uuid.uuid4()))


def make_beat_app(redis_url: str, key_prefix: str, mode: str = "active") -> Celery:
    """An app whose schedule holds two entries for tasks it does not register."""
    app = Celery("mixin-test", broker="memory://", set_as_current=False)
    app.conf.update(
        singleton_redis_url=redis_url,
        singleton_key_prefix=f"{key_prefix}lock:",
        singleton_beat_mode=mode,
        singleton_beat_lease=5.0,
        beat_schedule={
            INTERVAL: {"task": "remote.interval", "schedule": 10.0, "args": (1,)},
            CRON: {"task": "remote.cron", "schedule": crontab(minute="*/5")},
        },
    )
    return app


@pytest.fixture
def beat_app(redis_url: str, key_prefix: str) -> Iterator[Celery]:
    """The mixin test app in active mode, claims under ``key_prefix``."""
    app = make_beat_app(redis_url, key_prefix)
    yield app
    app.close()


def instance(app: Celery, monkeypatch: pytest.MonkeyPatch, now: float) -> Guarded:
    """A Guarded scheduler whose wall clock reads ``now`` (epoch seconds)."""
    scheduler = Guarded(app=app, max_interval=1)
    set_clock(scheduler, monkeypatch, now)
    return scheduler


def set_clock(scheduler: Guarded, monkeypatch: pytest.MonkeyPatch, now: float) -> None:
    """Make ``scheduler``'s wall clock read ``now``."""
    monkeypatch.setattr(scheduler, "singleton_clock", lambda: now)


def fire(scheduler: Guarded, name: str) -> Any:
    """Apply ``name``'s due run the way beat does once it found it due (no advance)."""
    entry: ScheduleEntry = scheduler.schedule[name]
    return scheduler.apply_async(entry, advance=False)


def labels(*schedulers: Guarded) -> list[str]:
    """Run labels of everything the schedulers published, in order."""
    return [msg["headers"][RUN_HEADER] for s in schedulers for msg in s.sent]


def test_interval_run_published_once_by_two_instances(
    beat_app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two instances, same 10 s slot at different phases: one publish; the next slot: one."""
    slot = math.floor(time.time() / 10) * 10  # a real slot, so the keys look like real ones
    a = instance(beat_app, monkeypatch, slot + 0.3)
    b = instance(beat_app, monkeypatch, slot + 6.8)

    fire(a, INTERVAL)
    fire(b, INTERVAL)
    fire(a, INTERVAL)  # the same run again on the winner: still once
    assert labels(a, b) == [f"{INTERVAL}@{slot * 1000}"]
    assert len(a.sent) == 1, "the first instance to claim the run publishes it"
    assert a.sent[0]["task"] == "remote.interval"
    assert list(a.sent[0]["args"]) == [1]

    set_clock(a, monkeypatch, slot + 10.9)
    set_clock(b, monkeypatch, slot + 10.1)
    fire(b, INTERVAL)
    fire(a, INTERVAL)
    assert labels(a, b) == [f"{INTERVAL}@{slot * 1000}", f"{INTERVAL}@{(slot + 10) * 1000}"]
    assert len(b.sent) == 1


def test_interval_due_on_the_epoch_grid_whatever_the_start(
    beat_app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """is_due then apply_async, as beat's tick does: both instances agree on the slot."""
    slot = math.floor(time.time() / 10) * 10
    a = instance(beat_app, monkeypatch, slot + 2.0)
    b = instance(beat_app, monkeypatch, slot + 7.5)
    # first look: nothing due yet, next run at the next slot start
    for scheduler, wait in ((a, 8.0), (b, 2.5)):
        due, next_in = scheduler.is_due(scheduler.schedule[INTERVAL])
        assert not due
        assert next_in == pytest.approx(wait)

    set_clock(a, monkeypatch, slot + 10.02)
    set_clock(b, monkeypatch, slot + 10.4)
    for scheduler in (b, a):
        due, _next = scheduler.is_due(scheduler.schedule[INTERVAL])
        assert due
        fire(scheduler, INTERVAL)
    assert labels(a, b) == [f"{INTERVAL}@{(slot + 10) * 1000}"]


def test_crontab_run_published_once_by_two_instances(
    beat_app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two instances firing one cron run 0.7 s apart: one publish; the next run: one."""
    boundary = math.floor(time.time() / 300) * 300  # the last */5 minute
    a = instance(beat_app, monkeypatch, boundary + 0.2)
    b = instance(beat_app, monkeypatch, boundary + 0.9)
    fire(a, CRON)
    fire(b, CRON)
    set_clock(a, monkeypatch, boundary + 300.8)
    set_clock(b, monkeypatch, boundary + 300.05)
    fire(b, CRON)
    fire(a, CRON)
    assert labels(a, b) == [f"{CRON}@{boundary * 1000}", f"{CRON}@{(boundary + 300) * 1000}"]
    assert [len(a.sent), len(b.sent)] == [1, 1]


def test_leader_mode_mixin_only_the_leader_publishes(
    redis_url: str, key_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Leader mode: the standby publishes nothing; once the leader closes, it takes over."""
    app = make_beat_app(redis_url, key_prefix, mode="leader")
    try:
        check_leader_hand_over(app, monkeypatch)
    finally:
        app.close()


def check_leader_hand_over(app: Celery, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the leader publishes; once it closes, the standby takes over (also for Redlock)."""
    slot = math.floor(time.time() / 10) * 10
    a = instance(app, monkeypatch, slot + 1.0)
    b = instance(app, monkeypatch, slot + 1.0)
    fire(a, INTERVAL)
    fire(b, INTERVAL)
    assert labels(a) == [f"{INTERVAL}@{slot * 1000}"]
    assert b.sent == []

    a.close()  # gives up the lease
    set_clock(b, monkeypatch, slot + 11.0)
    fire(b, INTERVAL)
    assert labels(b) == [f"{INTERVAL}@{(slot + 10) * 1000}"]
    b.close()


def test_scheduler_resolves_by_dotted_path_and_by_alias(beat_app: Celery, tmp_path: Path) -> None:
    """``beat_scheduler = "celery_singleton_lock.SingletonScheduler"`` and ``-S singleton``."""
    assert celery_singleton_lock.SingletonScheduler is SingletonScheduler
    beat_app.conf.beat_scheduler = "celery_singleton_lock.SingletonScheduler"
    assert symbol_by_name(beat_app.conf.beat_scheduler) is SingletonScheduler
    for name in (beat_app.conf.beat_scheduler, "singleton"):
        service = Service(
            beat_app, scheduler_cls=name, schedule_filename=str(tmp_path / "schedule")
        )
        scheduler = service.get_scheduler(lazy=True)
        assert type(scheduler) is SingletonScheduler, name
        assert isinstance(scheduler, SingletonSchedulerMixin)
