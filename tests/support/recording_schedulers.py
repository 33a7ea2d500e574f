"""Beat schedulers in the test process that record what they would publish instead of
publishing, each with an injected clock, sharing their run claims (and leader lease) in a real
Redis; and the checks the topologies' test modules run on them.

:class:`Guarded` is the mixin in front of an in-memory scheduler; :func:`recording_scheduler`
the database scheduler of django-celery-beat. Their entries name tasks the app does not know,
so Celery's ``Scheduler.apply_async`` hands them to ``send_task``, which records (a seam of
Celery's scheduler, not of the library): no broker is involved. :func:`instance` makes one
whose wall clock reads a given time, :func:`fire` applies an entry's due run as beat does, and
:func:`labels` reads back the runs published. :func:`check_leader_hand_over` and
:func:`check_leadership_kept_after_a_failed_renewal` run on one server (test_beat_mixin),
Sentinel, Cluster and Redlock.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery
from celery.beat import ScheduleEntry, Scheduler
from celery.schedules import crontab

from celery_singleton_lock.beat.claims import RUN_HEADER
from celery_singleton_lock.beat.scheduler import (
    ERROR_RETRY_S,
    SingletonScheduler,
    SingletonSchedulerMixin,
)
from celery_singleton_lock.core.keys import leader_keys

__test__ = False

INTERVAL = "remote-every-10s"


CRON = "remote-every-5min"


class MemoryScheduler(Scheduler):  # type: ignore[misc]
    """A plain in-memory scheduler: the entries of ``beat_schedule``, nothing persisted."""

    def setup_schedule(self) -> None:
        self.data: dict[str, ScheduleEntry] = {}
        self.merge_inplace(self.app.conf.beat_schedule)

    def sync(self) -> None:
        """Nothing to persist."""


#: The schedulers made by the test running (their Redis clients closed after it: conftest.py).
MADE: list[Any] = []


def close_made() -> None:
    """Close the Redis clients of the schedulers the test made, however it ended."""
    close_clients(*MADE)
    MADE.clear()


class Guarded(SingletonSchedulerMixin, MemoryScheduler):
    """The mixin in front of MemoryScheduler; records what it would publish."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.sent: list[dict[str, Any]] = []
        MADE.append(self)
        super().__init__(*args, **kwargs)

    def send_task(self, name: str, args: Any = None, kwargs: Any = None, **options: Any) -> Any:
        """Record the message beat would send for a task it does not know."""
        self.sent.append({"task": name, "args": args, "headers": options.get("headers", {})})
        return SimpleNamespace(id=str(uuid.uuid4()))


class RecordingPersistent(SingletonScheduler):  # type: ignore[misc]
    """SingletonScheduler (PersistentScheduler, its shelve file) recording what it would
    publish."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.sent: list[dict[str, Any]] = []
        MADE.append(self)
        super().__init__(*args, **kwargs)

    def send_task(self, name: str, args: Any = None, kwargs: Any = None, **options: Any) -> Any:
        self.sent.append({"args": list(args or ()), "headers": options.get("headers", {})})
        return SimpleNamespace(id=str(uuid.uuid4()))


def driven(scheduler: Any, clock: Monotonic) -> Any:
    """``scheduler`` (and its app) reading ``clock``: ``app.now`` (Celery's side: the heap,
    ``crontab.is_due``) and ``singleton_clock`` (the nominal runs)."""
    app = scheduler.app
    app.now = lambda: datetime.fromtimestamp(clock(), timezone.utc).astimezone(app.timezone)
    scheduler.singleton_clock = clock
    return scheduler


def clock_at(now: float) -> Monotonic:
    """A clock the test moves, reading ``now`` (epoch seconds)."""
    clock = Monotonic()
    clock.now = now
    return clock


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
    close_clients(a, b)


def close_clients(*schedulers: Any) -> None:
    """Close the Redis clients of ``schedulers`` (their claims share them with the store)."""
    for scheduler in schedulers:
        state = getattr(scheduler, "_singleton", None)
        if state is not None:
            for client in getattr(state.store, "clients", None) or (state.store.client,):
                client.close()


#: The lease of the Redis-error tests. Their injected monotonic clock moves up to 0.95 of it
#: while real time moves a few seconds: the lease in Redis (real time) outlives the stall by
#: far, so it is still the leader's when the server answers again.
LONG_LEASE_S = 30.0


#: What ``tick`` returns while the instance stands by: min(max_interval, lease / 10).
STANDBY_DELAY_S = 1.0


class Monotonic:
    """A monotonic clock the test moves forward (``singleton_monotonic``)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def long_lease_leader_app(url: str, key_prefix: str) -> Celery:
    """The mixin test app in leader mode on ``url``, with a lease of LONG_LEASE_S."""
    app = make_beat_app(url, key_prefix, mode="leader")
    app.conf.singleton_beat_lease = LONG_LEASE_S
    return app


def lease_owner(scheduler: Guarded) -> str | None:
    """Who holds the leader lease in Redis, as ``scheduler``'s lock store reads it."""
    state = scheduler._singleton
    assert state is not None
    keys = leader_keys(state.opts.key_prefix, scheduler._group())
    return state.store.holder(keys.lock).get("owner")


def claimer(scheduler: Guarded) -> str:
    """``scheduler``'s instance id (the owner of its lease and claims)."""
    state = scheduler._singleton
    assert state is not None
    return state.claimer


@contextlib.contextmanager
def two_instances(
    app: Celery, monkeypatch: pytest.MonkeyPatch, now: float
) -> Iterator[tuple[Guarded, Guarded]]:
    """Two Guarded schedulers at wall clock ``now``; closed after, their Redis clients too."""
    pair = (instance(app, monkeypatch, now), instance(app, monkeypatch, now))
    try:
        yield pair
    finally:
        for scheduler in pair:
            scheduler.close()
        close_clients(*pair)


def interval_labels(scheduler: Guarded) -> list[str]:
    """Run labels of the INTERVAL runs ``scheduler`` published (a cron run may come due too)."""
    return [label for label in labels(scheduler) if label.startswith(f"{INTERVAL}@")]


#: How long after the leader last confirmed its lease its renewal fails: early (it goes on
#: leading, its lease surely lives) or late (past beat.LEASE_TRUSTED, 0.9 of the lease: it
#: stands by meanwhile, the lease may be about to expire).
RENEWAL_FAILS = {
    "within-the-trusted-lease": LONG_LEASE_S / 3 + 0.5,
    "past-the-trusted-lease": LONG_LEASE_S * 0.95,
}


def check_leadership_kept_after_a_failed_renewal(
    app: Celery,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    stall: Callable[[], contextlib.AbstractContextManager[object]],
    when: str,
) -> None:
    """The leader's renewal fails once (``stall``: Redis does not answer) while its lease still
    lives in Redis, ``RENEWAL_FAILS[when]`` after it was last confirmed. Once Redis answers, the
    leader renews its own lease at its next tick and publishes the run due then; the standby,
    ticking as well, neither leads nor publishes.

    Nothing is claimed during the stall: a claim that reaches a paused server runs when it
    resumes, its reply lost, and stays pending for its publish lease (docs/beat.md), which
    would delay that run here by 10 s whatever the lease does."""
    caplog.set_level(logging.INFO, logger="celery_singleton_lock.beat.scheduler")
    slot = math.floor(time.time() / 10) * 10
    with two_instances(app, monkeypatch, slot + 1.0) as (a, b):
        check_lease_kept(a, b, monkeypatch, caplog, slot, stall, when)


def check_lease_kept(  # noqa: PLR0917 - the steps of the check above
    a: Guarded,
    b: Guarded,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    slot: int,
    stall: Callable[[], contextlib.AbstractContextManager[object]],
    when: str,
) -> None:
    """:func:`check_leadership_kept_after_a_failed_renewal` with leader ``a``, standby ``b``."""
    clock = Monotonic()
    monkeypatch.setattr(a, "singleton_monotonic", clock)
    fire(a, INTERVAL)
    fire(b, INTERVAL)
    assert interval_labels(a) == [f"{INTERVAL}@{slot * 1000}"]
    assert b.sent == []
    assert lease_owner(a) == claimer(a)

    clock.now += RENEWAL_FAILS[when]  # the lease is due for renewal at a's next tick
    with stall():
        delay = a.tick()  # the renewal fails
    if when == "past-the-trusted-lease":
        assert delay == STANDBY_DELAY_S, "a stands by: its lease may be about to expire"
        assert "beat: redis error, standing by" in caplog.text
    assert lease_owner(a) == claimer(a), "the lease outlived the stall"

    # a second later, at the next slot: the lease still has most of its 30 s, and it is a's
    clock.now += ERROR_RETRY_S + 0.1
    for scheduler in (a, b):
        set_clock(scheduler, monkeypatch, slot + 11.0)
    fire(b, INTERVAL)
    fire(a, INTERVAL)
    assert b.sent == [], "the standby published while the leader held its lease"
    assert interval_labels(a) == [
        f"{INTERVAL}@{slot * 1000}",
        f"{INTERVAL}@{(slot + 10) * 1000}",
    ], f"the leader did not take its own lease back after a failed renewal\n{caplog.text}"
    if when == "within-the-trusted-lease":
        assert "beat: redis error, lease not renewed, still leading" in caplog.text
        assert "beat: redis error, standing by" not in caplog.text
    kept = [r for r in caplog.records if "beat: leadership kept after a redis error" in r.message]
    assert [r.getMessage() for r in kept] == [
        f"beat: leadership kept after a redis error: instance={claimer(a)}"
    ]
    assert kept[0].levelno == logging.WARNING
    assert caplog.text.count("beat: became leader") == 1, caplog.text
    assert lease_owner(a) == claimer(a)


# -- django-celery-beat's database scheduler ----------------------------------------------------


def recording_scheduler(app: Celery, now: float) -> Any:
    """A SingletonDatabaseScheduler that records what it would publish; its clock at ``now``."""
    from celery_singleton_lock.beat import SingletonDatabaseScheduler

    class Recording(SingletonDatabaseScheduler):  # type: ignore[misc, valid-type]
        def send_task(self, name: str, args: Any = None, kwargs: Any = None, **opts: Any) -> Any:
            self.sent.append({"task": name, "headers": opts.get("headers", {})})
            return SimpleNamespace(id=str(uuid.uuid4()))

    Recording.sent = []  # type: ignore[attr-defined]
    scheduler = Recording(app=app, max_interval=1)
    scheduler.sent = []
    scheduler.singleton_clock = lambda: now
    return scheduler
