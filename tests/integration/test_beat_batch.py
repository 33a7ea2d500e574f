"""A tick with many runs due at once, against a real Redis: every due run published once, the
claims in one round trip, a change of schedule still noticed.

The schedulers live in this process and record what they would publish (the entries name tasks
the app does not know, so Celery's ``Scheduler.apply_async`` hands them to ``send_task``). The
clock is driven: ``app.now`` (Celery's side: the heap, ``crontab.is_due``) and
``singleton_clock`` (the nominal runs) read the same moved clock, except in the
django-celery-beat test, whose entries read the real one.
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from celery.schedules import crontab

from celery_singleton_lock.beat.claims import BATCH, CLAIM, CONFIRM, RUN_HEADER
from celery_singleton_lock.beat.steered import POLL_S
from tests.support.recording_schedulers import (
    Guarded,
    Monotonic,
    RecordingPersistent,
    clock_at,
    driven,
    recording_scheduler,
)
from tests.support.servers import RedisServer

MANY = 1200  # three claim.lua calls of BATCH runs, in one pipeline


def many_app(url: str, key_prefix: str, entries: int, mode: str = "active") -> Celery:
    """``entries`` crontab() entries (every minute), each for an unknown task."""
    app = Celery("batch-test", broker="memory://", set_as_current=False)
    app.conf.update(
        singleton_redis_url=url,
        singleton_key_prefix=f"{key_prefix}lock:",
        singleton_beat_mode=mode,
        result_expires=None,
        beat_schedule={
            f"e{i}": {"task": "remote.cron", "schedule": crontab(), "args": (i,)}
            for i in range(entries)
        },
    )
    return app


def sent_runs(*schedulers: Any) -> Counter[str]:
    return Counter(msg["headers"][RUN_HEADER] for s in schedulers for msg in s.sent)


def minute_ahead() -> float:
    return (math.floor(time.time() / 60) + 1) * 60.0


class CountedPipelines:
    """Counts the pipelines a client executes (its round trips for batches of calls)."""

    def __init__(self, client: Any) -> None:
        self.executed = 0
        make = client.pipeline

        def pipeline(*args: Any, **kwargs: Any) -> Any:
            pipe = make(*args, **kwargs)
            execute = pipe.execute

            def counted(*a: Any, **k: Any) -> Any:
                self.executed += 1
                return execute(*a, **k)

            pipe.execute = counted
            return pipe

        client.pipeline = pipeline


def test_a_tick_publishes_every_due_run_once_and_claims_them_in_one_round_trip(
    private_redis: RedisServer, key_prefix: str
) -> None:
    """MANY entries due in the same minute: the minute's tick publishes each once, with two
    round trips to Redis (the claims, then the confirms), ``claim.lua`` and ``confirm.lua``
    each called once per BATCH runs."""
    app = many_app(private_redis.url, key_prefix, MANY)
    minute = minute_ahead()
    clock = clock_at(minute - 5)
    scheduler = driven(Guarded(app=app, max_interval=60), clock)
    scheduler.singleton_monotonic = Monotonic()  # still: the tick's own time not counted
    try:
        # the heap built, nothing due for 5 s: it wakes up in a second to look for asks
        assert scheduler.tick() == pytest.approx(POLL_S, abs=0.1)
        assert scheduler.sent == []
        stats = private_redis.client()
        for lua in (CLAIM, CONFIRM):
            stats.script_load(lua.text)
        stats.config_resetstat()
        pipelines = CountedPipelines(scheduler._singleton.claims.client)

        clock.now = minute + 0.2
        scheduler.tick()
        runs = sent_runs(scheduler)
        assert len(runs) == MANY
        assert set(runs.values()) == {1}
        assert {label.split("@")[1] for label in runs} == {str(int(minute * 1000))}
        assert pipelines.executed == 2, "claims and confirms: one round trip each"
        calls = stats.info("commandstats")["cmdstat_evalsha"]["calls"]
        assert calls == 2 * math.ceil(MANY / BATCH)

        scheduler.tick()  # the same minute again: nothing more
        assert len(scheduler.sent) == MANY
        clock.now = minute + 60.1  # the next minute: every entry once more
        scheduler.tick()
        assert len(sent_runs(scheduler)) == 2 * MANY
        stats.close()
    finally:
        scheduler.close()
        app.close()


def test_two_schedulers_ticking_together_publish_each_run_of_a_crowded_minute_once(
    redis_url: str, key_prefix: str
) -> None:
    """Two instances in claims mode tick the same minute at the same time (threads): every run
    published by exactly one; their rechecks of each other's claims publish nothing more."""
    app = many_app(redis_url, key_prefix, MANY)
    minute = minute_ahead()
    clock = clock_at(minute - 1)
    a = driven(Guarded(app=app, max_interval=60), clock)
    b = driven(Guarded(app=app, max_interval=60), clock)
    monotonic = Monotonic()
    for scheduler in (a, b):
        scheduler.singleton_monotonic = monotonic
        scheduler.tick()
    try:
        clock.now = minute + 0.3
        barrier = threading.Barrier(2)

        def tick(scheduler: Any) -> None:
            barrier.wait()
            scheduler.tick()

        threads = [threading.Thread(target=tick, args=(s,)) for s in (a, b)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        runs = sent_runs(a, b)
        assert len(runs) == MANY
        assert set(runs.values()) == {1}, "a run published twice"

        monotonic.now += 11  # past every pending claim's lease: the rechecks are due
        for scheduler in (a, b):
            scheduler.tick()
        assert not a._rechecks
        assert not b._rechecks
        assert sum(sent_runs(a, b).values()) == MANY
    finally:
        a.close()
        b.close()
        app.close()


def test_persistent_scheduler_notices_entries_added_changed_and_removed(
    redis_url: str, key_prefix: str, tmp_path: Path
) -> None:
    """Through the scheduler's own methods, between two minutes: an entry added, one changed,
    one removed; and a sync of the shelve (a new dict, equal) between two others."""
    app = many_app(redis_url, key_prefix, 3)
    app.set_current()  # the shelve's entries come back from a sync with the current app
    minute = minute_ahead()
    clock = clock_at(minute - 1)
    scheduler = driven(RecordingPersistent(app=app, schedule_filename=str(tmp_path / "s")), clock)

    def at(when: float) -> dict[str, list[Any]]:
        clock.now = when
        scheduler.sent.clear()
        scheduler.tick()
        return {m["headers"][RUN_HEADER].split("@")[0]: m["args"] for m in scheduler.sent}

    try:
        scheduler.tick()
        assert at(minute + 0.1) == {"e0": [0], "e1": [1], "e2": [2]}

        scheduler.add(name="new", task="remote.cron", schedule=crontab(), args=(9,))
        scheduler.update_from_dict(
            {"e1": {"task": "remote.cron", "schedule": crontab(), "args": (11,)}}
        )
        assert at(minute + 60.1) == {"e0": [0], "e1": [11], "e2": [2], "new": [9]}

        beat_schedule = {
            name: {"task": "remote.cron", "schedule": crontab(), "args": (i,)}
            for i, name in ((0, "e0"), (1, "e1"))
        }
        scheduler.merge_inplace(beat_schedule)  # e2 and new are gone
        assert at(minute + 120.1) == {"e0": [0], "e1": [1]}

        scheduler.sync()  # the shelve hands out a new dict from now on: equal, not a change
        assert at(minute + 180.1) == {"e0": [0], "e1": [1]}
    finally:
        scheduler.close()
        app.close()


@pytest.fixture
def app(redis_url: str, key_prefix: str) -> Iterator[Celery]:
    """An app with no schedule of its own (the database's rows are the schedule)."""
    app = many_app(redis_url, key_prefix, 0)
    yield app
    app.close()


@pytest.mark.usefixtures("django_database")
def test_database_scheduler_notices_rows_added_changed_and_disabled(app: Celery) -> None:
    """1 s interval rows in the database, the real clock: a row added, one changed and one
    disabled between two ticks are seen at the next, through django-celery-beat's own check."""
    from django_celery_beat.models import IntervalSchedule, PeriodicTask

    every, _ = IntervalSchedule.objects.get_or_create(every=1, period=IntervalSchedule.SECONDS)
    for name in ("a", "b"):
        PeriodicTask.objects.create(name=name, task="remote.x", interval=every)
    scheduler = recording_scheduler(app, 0.0)
    scheduler.singleton_clock = time.time

    def ticking(seconds: float = 1.5) -> dict[str, str]:
        """What the scheduler publishes while it ticks as beat does for ``seconds``."""
        scheduler.sent.clear()
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            time.sleep(min(scheduler.tick(), 0.05))
        return {m["headers"][RUN_HEADER].split("@")[0]: m["task"] for m in scheduler.sent}

    try:
        assert ticking() == {"a": "remote.x", "b": "remote.x"}
        PeriodicTask.objects.create(name="c", task="remote.x", interval=every)
        b = PeriodicTask.objects.get(name="b")
        b.task = "remote.y"
        b.save()
        PeriodicTask.objects.filter(name="a").update(enabled=False)
        PeriodicTask.objects.get(name="c").save()  # update() sends no signal: a save does
        assert ticking() == {"b": "remote.y", "c": "remote.x"}
    finally:
        scheduler.close()
