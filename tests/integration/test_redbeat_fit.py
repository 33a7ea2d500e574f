"""Why SingletonSchedulerMixin does not fit celery-redbeat's RedBeatScheduler: the evidence.

RedBeat keeps one schedule in Redis for every beat instance and serialises the instances
itself: its ``beat_init`` handler takes a blocking Redis lock (``redbeat_lock_key``), so by
default only one instance ever ticks. These tests put the mixin in front of RedBeatScheduler
with that lock switched off (``redbeat_lock_key = None``, the only way several instances tick)
and show what breaks, against a real Redis (docs/beat.md, "celery-redbeat"):

1. RedBeat's ``tick`` asks the entry (``entry.is_due()``), never the scheduler's ``is_due``,
   where the mixin puts interval entries on the epoch grid: instances that fire one due run at
   the same moment, their clocks either side of a slot boundary, claim two runs and publish
   both;
2. RedBeat advances the shared schedule (``reserve``) before the mixin claims the run: once an
   instance has claimed a run and died before publishing it, no other instance finds the entry
   due again until its next period, so the run is lost (with Celery's schedulers the others
   claim it again when the claim's lease ends).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery

from celery_singleton_lock.beat.claims import RUN_HEADER
from celery_singleton_lock.beat.scheduler import SingletonSchedulerMixin
from tests.support.recording_schedulers import close_clients

ENTRY = "remote-every-10s"
#: the schedulers a test made: their clients closed after it
_MADE: list[Any] = []


@pytest.fixture
def app(redis_url: str, key_prefix: str) -> Iterator[Celery]:
    """RedBeat's schedule and the run claims under ``key_prefix``; RedBeat's lock off."""
    app = Celery("redbeat-fit", broker="memory://", set_as_current=False)
    app.conf.update(
        redbeat_redis_url=redis_url,
        redbeat_key_prefix=f"{key_prefix}redbeat:",
        redbeat_lock_key=None,
        singleton_redis_url=redis_url,
        singleton_key_prefix=f"{key_prefix}lock:",
        beat_schedule={ENTRY: {"task": "remote.interval", "schedule": 10.0}},
    )
    yield app
    close_clients(*_MADE)
    _MADE.clear()
    redbeat_client = getattr(app, "redbeat_redis", None)
    if redbeat_client is not None:
        redbeat_client.close()
    app.close()


def guarded(app: Celery, now: float) -> Any:
    """The mixin in front of RedBeatScheduler, recording what it would publish; its wall clock
    (for the nominal times) reads ``now``."""
    from redbeat import RedBeatScheduler

    class GuardedRedBeat(SingletonSchedulerMixin, RedBeatScheduler):  # type: ignore[misc]
        def send_task(self, name: str, args: Any = None, kwargs: Any = None, **opts: Any) -> Any:
            self.sent.append(opts.get("headers", {})[RUN_HEADER])
            return SimpleNamespace(id=str(uuid.uuid4()))

    scheduler = GuardedRedBeat(app=app, max_interval=1)
    _MADE.append(scheduler)
    scheduler.sent = []
    scheduler.singleton_clock = lambda: now
    return scheduler


def make_due(app: Celery) -> None:
    """Make ENTRY due in RedBeat's shared schedule: its last run a period and more ago."""
    from datetime import datetime, timedelta, timezone

    from redbeat.schedulers import RedBeatSchedulerEntry

    key = RedBeatSchedulerEntry.generate_key(app, ENTRY)
    entry = RedBeatSchedulerEntry.from_key(key, app=app)
    entry.reschedule(last_run_at=datetime.now(timezone.utc) - timedelta(seconds=15))


def test_redbeat_ticks_past_the_mixins_is_due_and_two_instances_publish_one_run(
    app: Celery,
) -> None:
    """Two instances load the due entry in the same moment, their clocks 20 ms apart across a
    slot boundary: RedBeat asks the entry, not the scheduler, so both fire and each claims
    the slot its own clock is in. One run, published twice."""
    boundary = (int(time.time()) // 10 + 1) * 10
    a, b = guarded(app, boundary - 0.01), guarded(app, boundary + 0.01)
    make_due(app)
    asked: list[str] = []
    for scheduler in (a, b):
        scheduler.is_due = lambda entry, asked=asked: asked.append(entry.name)  # a spy
    due_a, due_b = a.schedule[ENTRY], b.schedule[ENTRY]  # both find it due
    a.maybe_due(due_a, producer=None)
    b.maybe_due(due_b, producer=None)
    assert asked == [], "RedBeat's tick asked the scheduler's is_due"
    assert a.sent + b.sent == [f"{ENTRY}@{(boundary - 10) * 1000}", f"{ENTRY}@{boundary * 1000}"]


def test_a_run_claimed_by_an_instance_that_died_is_lost(app: Celery) -> None:
    """Instance a does what the mixin's apply_async does up to the claim (reserve, then claim
    with a short lease) and dies. RedBeat's shared schedule no longer has the entry due, so
    instance b never looks at that run again: nothing publishes it."""
    a = guarded(app, time.time())
    make_due(app)
    entry = a.schedule[ENTRY]
    state = a._singleton_state()
    run = a._run(entry, state.opts)
    a.reserve(entry)  # RedBeat writes last_run_at to the shared schedule
    assert state.claims.claim(run.key, 200).won
    # a dies here; its claim expires 200 ms later

    b = guarded(app, time.time())
    time.sleep(0.3)  # past the lease: with Celery's schedulers, b would claim the run now
    b.tick()
    assert ENTRY not in b.schedule, "RedBeat still had the entry due"
    assert state.claims.peek([run.key]) == [None], "the claim did not expire"
    assert b.sent == [], "b published the run"
