"""Catch-up after downtime, with SingletonScheduler (PersistentScheduler, a shelve file each) in
this process, a real Redis and a driven clock (``app.now`` and ``singleton_clock``).

The beats publish an interval and a crontab entry for each choice, stop, stay down while runs
come due, and start again: on the schedule file they kept, on an empty one (another node), or
both at once. Each choice publishes the same runs whichever file the beat had, each once. Real
beat processes go through the same in test_beat_catch_up_beats.py.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from celery.beat import ScheduleEntry
from celery.schedules import crontab, schedstate

from celery_singleton_lock.beat.catch_up import CATCH_UP_HEADER
from celery_singleton_lock.beat.claims import RUN_HEADER
from celery_singleton_lock.core.keys import beat_entry_key
from tests.support.recording_schedulers import (
    Monotonic,
    RecordingPersistent,
    clock_at,
    close_clients,
    driven,
)
from tests.support.servers import RedisServer

#: entry -> (schedule, catch-up header or None for the app's "latest")
ENTRIES: dict[str, tuple[Any, Any]] = {
    "i-none": (10.0, "none"),
    "i-latest": (10.0, None),
    "i-window": (10.0, 25),
    "c-none": (crontab(), "none"),
    "c-latest": (crontab(), None),
    "c-window": (crontab(), 150),
}


def catch_up_app(url: str, prefix: str, name: str) -> Celery:
    app = Celery(name, broker="memory://", set_as_current=False)
    schedule: dict[str, Any] = {}
    for entry, (sched, choice) in ENTRIES.items():
        options = {} if choice is None else {"headers": {CATCH_UP_HEADER: choice}}
        schedule[entry] = {"task": f"remote.{entry}", "schedule": sched, "options": options}
    app.conf.update(
        singleton_redis_url=url,
        singleton_key_prefix=prefix,
        beat_schedule=schedule,
        result_expires=None,
    )
    return app


class Beats:
    """The beats of one app, each a scheduler on its own schedule file, on one driven clock."""

    def __init__(self, app: Celery, tmp_path: Path, now: float) -> None:
        self.app = app
        self.tmp_path = tmp_path
        self.clock = clock_at(now)
        self.monotonic = Monotonic()
        app.now = lambda: datetime.fromtimestamp(self.clock(), timezone.utc)  # new entries too
        self.running: dict[str, RecordingPersistent] = {}
        self.published: Counter[str] = Counter()

    def start(self, name: str) -> RecordingPersistent:
        """Start beat ``name`` on schedule file ``name`` (kept from its last run, if any)."""
        scheduler = RecordingPersistent(app=self.app, schedule_filename=str(self.tmp_path / name))
        driven(scheduler, self.clock)
        scheduler.singleton_monotonic = self.monotonic
        self.running[name] = scheduler
        return scheduler

    def stop(self, name: str) -> None:
        scheduler = self.running.pop(name)
        scheduler.close()  # syncs its schedule file, as beat's shutdown does
        close_clients(scheduler)

    def tick_at(self, now: float) -> dict[str, list[int]]:
        """Move the clock to ``now``; tick every running beat; the runs they published, by
        entry, as seconds from epoch."""
        self.clock.now = now
        self.monotonic.now += 1.0
        runs: dict[str, list[int]] = {}
        for scheduler in self.running.values():
            scheduler.sent.clear()
            scheduler.tick()
            for message in scheduler.sent:
                label = message["headers"][RUN_HEADER]
                self.published[label] += 1
                entry, _, run = label.partition("@")
                runs.setdefault(entry, []).append(int(run) // 1000)
        return runs

    def close(self) -> None:
        for name in list(self.running):
            self.stop(name)


@pytest.fixture
def beats(
    redis_url: str, key_prefix: str, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[Beats]:
    app = catch_up_app(redis_url, f"{key_prefix}lock:", request.node.name[:40])
    app.set_current()  # the shelve's entries come back from a sync with the current app
    t = (math.floor(time.time() / 60) + 1) * 60.0  # a whole minute: every entry's run
    group = Beats(app, tmp_path, t)
    yield group
    group.close()
    app.close()


def run_up_to_a_downtime(beats: Beats, t: float) -> None:
    """Beat "a" publishes every entry's run at t and the intervals' at t + 10, then stops."""
    beats.start("a")
    assert beats.tick_at(t + 0.2) == {name: [int(t)] for name in ENTRIES}
    assert beats.tick_at(t + 10.2) == {name: [int(t) + 10] for name in ENTRIES if name[0] == "i"}
    beats.stop("a")


#: Down from t + 10.2 to t + 125.5: interval runs t+20 .. t+120 and the crontab's t+60 and
#: t+120 missed (t+120 came 5.5 s before the restart: missed, not due).
RESTART = 125.5


def expected_after_restart(t: int) -> dict[str, list[int]]:
    return {
        "i-latest": [t + 120],
        "i-window": [t + 110, t + 120],  # within 25 s of t+125.5, oldest first
        "c-latest": [t + 120],
        "c-window": [t + 60, t + 120],  # within 150 s
    }


@pytest.mark.parametrize("restarted", [["a"], ["fresh"], ["a", "fresh"]])
def test_each_choice_publishes_the_same_runs_whatever_file_the_beat_kept(
    beats: Beats, restarted: list[str]
) -> None:
    """The beat that kept its file ("a"), one on an empty disk ("fresh"), both at once."""
    t = beats.clock.now
    run_up_to_a_downtime(beats, t)
    for name in restarted:
        beats.start(name)
    assert beats.tick_at(t + RESTART) == expected_after_restart(int(t))
    # then on time, on the grid, for every choice (none: the next run is the first)
    assert beats.tick_at(t + 130.1) == {name: [int(t) + 130] for name in ENTRIES if name[0] == "i"}
    for second in range(140, 180, 10):
        beats.tick_at(t + second + 0.1)
    assert beats.tick_at(t + 180.1) == {name: [int(t) + 180] for name in ENTRIES}
    assert max(beats.published.values()) == 1, "a run published twice"


def test_a_restart_while_another_beat_kept_the_schedule_catches_up_nothing(
    beats: Beats,
) -> None:
    t = beats.clock.now
    beats.start("a")
    beats.start("b")
    beats.tick_at(t + 0.2)
    beats.stop("a")
    for second in range(10, 130, 10):
        beats.tick_at(t + second + 0.2)  # "b" publishes every run
    beats.start("a")
    assert beats.tick_at(t + RESTART) == {}
    assert beats.tick_at(t + 130.1) == {name: [int(t) + 130] for name in ENTRIES if name[0] == "i"}
    assert max(beats.published.values()) == 1


def test_runs_passed_over_while_paused_are_not_caught_up(
    beats: Beats, redis_url: str, key_prefix: str
) -> None:
    """A beat that tried to publish a paused entry's runs accounted for them in the record:
    a later restart does not publish them."""
    t = beats.clock.now
    client = redis.Redis.from_url(redis_url)
    pause = beat_entry_key(f"{key_prefix}lock:", "i-window", "paused")
    beats.start("a")
    beats.tick_at(t + 0.2)
    client.set(pause, "operator 1")
    try:
        for second in range(10, 60, 10):
            runs = beats.tick_at(t + second + 0.2)
            assert "i-window" not in runs
    finally:
        client.delete(pause)
    beats.stop("a")
    beats.start("a")
    runs = beats.tick_at(t + 75.5)  # down from t+50.2: t+60 and t+70 missed
    assert runs["i-window"] == [int(t) + 60, int(t) + 70]
    client.close()


def test_an_entry_with_a_bad_header_gets_the_apps_choice_and_says_so(
    beats: Beats, caplog: pytest.LogCaptureFixture
) -> None:
    beats.app.conf.beat_schedule["i-none"]["options"] = {"headers": {CATCH_UP_HEADER: "al"}}
    t = beats.clock.now
    run_up_to_a_downtime(beats, t)
    beats.start("a")
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="celery_singleton_lock.beat.scheduler"):
        runs = beats.tick_at(t + RESTART)
    assert runs["i-none"] == [int(t) + 120], "the app's choice: latest"
    assert [r.getMessage() for r in caplog.records] == [
        "beat: invalid catch-up header, the app's choice applies: entry=i-none: "
        f"{CATCH_UP_HEADER} must be one of 'none', 'latest', got 'al'"
    ]


def test_a_beat_on_an_empty_disk_runs_an_interval_entry_at_its_next_slot(beats: Beats) -> None:
    """No record, no schedule file: nothing to catch up, and the next run is the next slot,
    not one interval after the start (Celery's own due logic counts from the start)."""
    t = beats.clock.now
    beats.clock.now = t + 3.5
    delay = beats.start("fresh").tick()
    assert delay <= 6.5 + 0.01, "the tick sleeps past the next slot"
    assert beats.tick_at(t + 10.1) == {name: [int(t) + 10] for name in ENTRIES if name[0] == "i"}


def test_a_standby_that_takes_the_lead_catches_up_the_runs_no_leader_published(
    beats: Beats,
) -> None:
    beats.app.conf.update(singleton_beat_mode="leader", singleton_beat_lease=5.0)
    t = beats.clock.now
    beats.start("a")
    beats.start("b")
    assert beats.tick_at(t + 0.2) == {name: [int(t)] for name in ENTRIES}
    assert beats.tick_at(t + 10.2) == {name: [int(t) + 10] for name in ENTRIES if name[0] == "i"}
    beats.stop("a")  # gives up its lease: "b" leads at its next tick
    assert beats.tick_at(t + 45.5) == {
        "i-latest": [int(t) + 40],
        "i-window": [int(t) + 30, int(t) + 40],  # within 25 s of t+45.5
    }
    assert beats.tick_at(t + 50.1) == {name: [int(t) + 50] for name in ENTRIES if name[0] == "i"}
    assert max(beats.published.values()) == 1


@pytest.mark.parametrize("outage", ["paused", "restarted-empty"])
def test_runs_due_while_no_beat_reached_redis_are_caught_up_as_each_entry_says(
    private_redis: RedisServer, key_prefix: str, tmp_path: Path, outage: str
) -> None:
    """The beat runs on while Redis is paused (calls time out), or killed and back without its
    data (the records gone: the beat goes by the runs it saw claimed)."""
    app = catch_up_app(f"{private_redis.url}?socket_timeout=0.3", f"{key_prefix}lock:", outage)
    app.set_current()
    t = (math.floor(time.time() / 60) + 1) * 60.0
    beats = Beats(app, tmp_path, t)
    try:
        beats.start("a")
        assert beats.tick_at(t + 0.2) == {name: [int(t)] for name in ENTRIES}
        assert beats.tick_at(t + 10.2) == {n: [int(t) + 10] for n in ENTRIES if n[0] == "i"}
        if outage == "paused":
            private_redis.pause()
        else:
            private_redis.kill()
        try:
            for second in (20, 30, 40):
                assert beats.tick_at(t + second + 0.2) == {}
        finally:
            if outage == "paused":
                private_redis.resume()
            else:
                private_redis.restart()
        assert beats.tick_at(t + 45.5) == {
            "i-latest": [int(t) + 40],
            "i-window": [int(t) + 30, int(t) + 40],  # within 25 s of t+45.5
        }
        after = beats.tick_at(t + 50.1)
        assert after == {name: [int(t) + 50] for name in ENTRIES if name[0] == "i"}
        assert max(beats.published.values()) == 1
    finally:
        beats.close()
        app.close()


def test_an_entry_its_own_checks_refuse_gets_no_run_on_sight(
    beats: Beats, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An entry whose own ``is_due`` says no whatever its schedule (django-celery-beat's
    expired, disabled or not started entries) is published nothing as a beat starts to watch
    it: neither its missed runs nor the run due then. The others catch up as usual."""
    t = beats.clock.now
    run_up_to_a_downtime(beats, t)
    refused = {"i-latest", "c-window"}
    real = ScheduleEntry.is_due

    def is_due(entry: ScheduleEntry) -> Any:
        return schedstate(False, 5.0) if entry.name in refused else real(entry)

    monkeypatch.setattr(ScheduleEntry, "is_due", is_due)
    beats.start("fresh")
    expected = {k: v for k, v in expected_after_restart(int(t)).items() if k not in refused}
    assert beats.tick_at(t + RESTART) == expected
    assert "i-latest" not in beats.tick_at(t + 130.1)
