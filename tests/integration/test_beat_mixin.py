"""SingletonSchedulerMixin in front of another scheduler class, against a real Redis.

Two scheduler instances live in one process, each with its own in-memory schedule and its own
injected clock (``singleton_clock``), and share the run claims in Redis. The entries name tasks
the app does not know, so Celery's ``Scheduler.apply_async`` hands them to ``self.send_task``:
the test subclass (tests/support/recording_schedulers.py) records there instead of publishing
(a seam of Celery's scheduler, not of this library), so no broker is involved.
"""

from __future__ import annotations

import logging
import math
import shelve
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from celery.beat import ScheduleEntry, Scheduler, Service
from celery.utils.imports import symbol_by_name

import celery_singleton_lock
from celery_singleton_lock.beat.claims import RUN_HEADER
from celery_singleton_lock.beat.scheduler import (
    SingletonScheduler,
    SingletonSchedulerMixin,
)
from celery_singleton_lock.core._wire import script
from tests.support.recording_schedulers import (
    CRON,
    INTERVAL,
    RENEWAL_FAILS,
    STANDBY_DELAY_S,
    Guarded,
    Monotonic,
    check_leader_hand_over,
    check_leadership_kept_after_a_failed_renewal,
    claimer,
    fire,
    instance,
    interval_labels,
    labels,
    lease_owner,
    long_lease_leader_app,
    make_beat_app,
    set_clock,
    two_instances,
)
from tests.support.servers import RedisServer, paused, server_busy
from tests.support.waiting import wait_for


@pytest.fixture
def beat_app(redis_url: str, key_prefix: str) -> Iterator[Celery]:
    """The mixin test app in active mode, claims under ``key_prefix``."""
    app = make_beat_app(redis_url, key_prefix)
    yield app
    app.close()


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


def test_apply_entry_claims_first_so_what_wraps_it_sees_only_the_won_run(
    beat_app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tick of a scheduler's own that publishes through ``apply_entry`` (as Celery's tick
    does): the mixin claims before Celery's ``apply_entry``, so a wrapper of it (Sentry Crons
    sends its in-progress check-in there) runs once per run, on the instance that publishes it,
    given the entry labelled with the run's headers."""
    wrapped: list[dict[str, Any]] = []
    celerys = Scheduler.apply_entry

    def wrapper(self: Any, entry: ScheduleEntry, producer: Any = None) -> None:
        wrapped.append(dict(entry.options.get("headers") or {}))
        celerys(self, entry, producer=producer)

    monkeypatch.setattr(Scheduler, "apply_entry", wrapper)  # where Sentry's wrapper goes
    slot = math.floor(time.time() / 10) * 10
    a = instance(beat_app, monkeypatch, slot + 0.3)
    b = instance(beat_app, monkeypatch, slot + 6.8)
    for scheduler in (a, b, a):
        scheduler.apply_entry(scheduler.schedule[INTERVAL], producer=None)
    assert labels(a, b) == [f"{INTERVAL}@{slot * 1000}"]
    assert [headers.get(RUN_HEADER) for headers in wrapped] == [f"{INTERVAL}@{slot * 1000}"]


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


def test_leader_wakes_up_to_renew_its_lease_not_only_for_its_next_run(
    redis_url: str, key_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Beat's default max interval is 300 s: a tick returns the time to the next due run. A
    leader's tick returns by the time its lease needs renewing (a third of the 5 s lease), not
    when the next run is due (up to 10 s away): asleep that long, its lease would end and a
    standby take it at every run."""
    app = make_beat_app(redis_url, key_prefix, mode="leader")
    scheduler = Guarded(app=app, max_interval=300)
    scheduler.singleton_monotonic = Monotonic()  # still: the ticks' own time not counted
    try:
        set_clock(scheduler, monkeypatch, math.floor(time.time() / 10) * 10 + 1.0)
        for _ in range(3):
            delay = scheduler.tick()
            assert lease_owner(scheduler) == claimer(scheduler)
            assert 0 < delay <= 5.0 / 3
    finally:
        scheduler.close()
        state = scheduler._singleton
        assert state is not None
        state.store.client.close()  # type: ignore[attr-defined]
        app.close()


# -- leader mode after a Redis error ------------------------------------------------------------


@pytest.mark.parametrize("when", list(RENEWAL_FAILS))
def test_leader_takes_its_lease_back_after_a_failed_renewal(
    private_redis: RedisServer,
    key_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    when: str,
) -> None:
    """One server, paused past the client's socket timeout (0.2 s) while the leader renews."""
    app = long_lease_leader_app(f"{private_redis.url}?socket_timeout=0.2", key_prefix)
    try:
        check_leadership_kept_after_a_failed_renewal(
            app, monkeypatch, caplog, lambda: paused(private_redis), when
        )
    finally:
        app.close()


#: A script that keeps the server busy for ARGV[1] milliseconds (it answers nobody meanwhile).
BUSY_SCRIPT = """
local t = redis.call('TIME')
local stop = t[1] * 1000000 + t[2] + ARGV[1] * 1000
repeat t = redis.call('TIME') until t[1] * 1000000 + t[2] >= stop
return 1
"""


def test_leader_whose_acquire_reply_was_lost_takes_its_lease(
    private_redis: RedisServer,
    key_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The server runs a standby's acquire after the client gave up waiting for the reply
    (a busy server, 0.2 s socket timeout): the lease is the standby's, which learns it at its
    next tick and leads at once; the other instance never leads meanwhile."""
    caplog.set_level(logging.INFO, logger="celery_singleton_lock.beat.scheduler")
    # the script is loaded beforehand: an EVALSHA that found it missing would not run at all
    loader = private_redis.client()
    loader.script_load(script("acquire.lua").text)
    loader.close()
    app = long_lease_leader_app(f"{private_redis.url}?socket_timeout=0.2", key_prefix)
    busy = redis.Connection(host="127.0.0.1", port=private_redis.port)
    try:
        slot = math.floor(time.time() / 10) * 10
        with two_instances(app, monkeypatch, slot + 1.0) as (a, b):
            fire(b, INTERVAL)
            assert a.tick() == STANDBY_DELAY_S  # b leads; a stands by, its connection open
            assert lease_owner(a) == claimer(b)
            b.close()  # b gives the lease up: a takes it at its next tick

            busy.send_command("EVAL", BUSY_SCRIPT, 0, 1500)
            wait_for(lambda: server_busy(private_redis.url), 5, "the server to be busy")
            assert a.tick() == STANDBY_DELAY_S, "a's acquire timed out: a stands by"
            assert "beat: redis unreachable, publishing nothing until it answers" in caplog.text
            assert busy.read_response() == 1  # the server is answering again
            wait_for(lambda: lease_owner(a) == claimer(a), 5, "a's acquire to have run")

            set_clock(a, monkeypatch, slot + 11.0)
            set_clock(b, monkeypatch, slot + 11.0)
            fire(b, INTERVAL)
            fire(a, INTERVAL)
            assert interval_labels(b) == [f"{INTERVAL}@{slot * 1000}"], "b published beside a"
            assert interval_labels(a) == [f"{INTERVAL}@{(slot + 10) * 1000}"], (
                f"a did not lead with the lease its lost acquire took\n{caplog.text}"
            )
            kept = [m for m in caplog.messages if "beat: leadership kept after a redis error" in m]
            assert kept == [f"beat: leadership kept after a redis error: instance={claimer(a)}"]
            assert lease_owner(a) == claimer(a)
    finally:
        busy.disconnect()
        app.close()


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


def test_a_sigterm_while_an_interval_entry_is_checked_saves_the_schedule_and_stops(
    beat_app: Celery, tmp_path: Path
) -> None:
    """Beat's SIGTERM handler (``celery.apps.beat``: ``service.sync()``, then SystemExit) can
    land while ``is_due`` stands the epoch-grid schedule in for an interval entry's. The
    schedule file is written then: the entry must be written with its own schedule, and the
    beat must stop. Found in the chaos run: the stand-in (holding the scheduler and its locks)
    could not be pickled, the TypeError came out of the handler instead of SystemExit, the beat
    went on running after its SIGTERM and that tick's run was not published."""
    filename = str(tmp_path / "schedule")
    scheduler = SingletonScheduler(app=beat_app, schedule_filename=filename, max_interval=1)
    entry = scheduler.schedule[INTERVAL]
    original = entry.schedule

    def sigterm_now() -> float:
        # what beat's handler does, at the moment is_due reads the clock
        scheduler.close()
        raise SystemExit

    scheduler.singleton_clock = sigterm_now  # type: ignore[method-assign]
    with pytest.raises(SystemExit):
        scheduler.is_due(entry)
    assert entry.schedule is original  # given back, whatever ended the call

    with shelve.open(filename) as saved:
        written = saved["entries"][INTERVAL].schedule
    assert type(written) is type(original)
    assert written.run_every == original.run_every
