"""Three real ``celery beat`` processes of the example Django project, one SQLite database.

``examples/django_beat`` with ``SingletonDatabaseScheduler`` (django-celery-beat's database
scheduler behind the run claims; one beat is SIGKILLed halfway), a prefork worker, and a
schedule of every kind: interval, crontab, solar, clocked, one-off, an entry with a start time
and an expiry, an expired one, one that starts in an hour and a disabled one. While the beats
run, the test adds, edits, disables and deletes entries through the ORM, as the admin does.
Each execution notes its run label (``<entry>@<run id>``, the header the scheduler sets); every
run must execute exactly once, be published by one beat, and nothing the database scheduler
would not run may run.
"""

from __future__ import annotations

import json
import math
import subprocess
import time
from collections import Counter
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from celery_singleton_lock.beat.catch_up import CATCH_UP_HEADER
from tests.support.basic_app import close_app
from tests.support.beats import BeatFactory
from tests.support.catch_up_checks import check_after_restart, published_twice_then_stop
from tests.support.cli import singleton_cli
from tests.support.servers import free_port
from tests.support.waiting import wait_for
from tests.support.workers import WorkerFactory, WorkerProcess

APP = "examples.django_beat"
#: two beats by the documented class path, one by the entry point's alias
SCHEDULERS = ("celery_singleton_lock.beat:SingletonDatabaseScheduler",) * 2 + ("singleton-django",)
#: a change made through the ORM reaches every beat within its next tick (--max-interval 1);
#: a run whose slot began before that may still go out
PICKUP_S = 4.0
#: how long after the last beat stopped the worker gets to run what was published
DRAIN_S = 15.0


@dataclass(frozen=True)
class Note:
    """One execution, as examples/django_beat/tasks.py notes it."""

    entry: str
    version: int
    run: str
    at: float

    @property
    def run_ms(self) -> int:
        """The run id in epoch ms (a one-off run's ``once-<ms>`` too)."""
        return int(self.run.rsplit("@", 1)[1].removeprefix("once-"))


def notes(client: redis.Redis, key_prefix: str) -> list[Note]:
    return [
        Note(d["entry"], d["version"], d["run"], d["at"])
        for d in map(json.loads, client.lrange(f"{key_prefix}runs", 0, -1))
    ]


def runs_of(found: list[Note], entry: str) -> list[Note]:
    return sorted((n for n in found if n.entry == entry), key=lambda n: n.run_ms)


def contiguous(ids: list[int], step_ms: int) -> bool:
    return all(b - a == step_ms for a, b in pairwise(ids))


def slot_ms(when: float, step_s: int) -> int:
    return math.floor(when / step_s) * step_s * 1000


@pytest.fixture
def example_env(django_database: Path, redis_url: str, key_prefix: str) -> dict[str, str]:
    """The environment the example's beats and workers read (examples/django_beat/settings)."""
    return {
        "DJANGO_SETTINGS_MODULE": f"{APP}.settings",
        "EXAMPLE_DB": str(django_database),
        "EXAMPLE_REDIS_URL": redis_url,
        "EXAMPLE_PREFIX": key_prefix,
    }


@pytest.fixture
def example_worker(
    worker_factory: WorkerFactory, redis_url: str, key_prefix: str, example_env: dict[str, str]
) -> WorkerProcess:
    """A prefork worker of the example, answering pings (worker_factory kills it)."""
    worker = worker_factory.start(APP, pool="prefork", concurrency=2, env=example_env)
    control = Celery("control", broker=redis_url, set_as_current=False)
    control.conf.broker_transport_options = {"global_keyprefix": key_prefix}
    try:
        worker.wait_ready(control)
    finally:
        close_app(control)
    return worker


def solar_noon_longitude(at: datetime) -> float:
    """A longitude (6 decimals, as SolarSchedule keeps it) whose solar noon is about ``at``."""
    import ephem

    def transit(longitude: float) -> datetime:
        observer = ephem.Observer()
        observer.lat, observer.lon = "0", str(longitude)
        observer.date = ephem.Date(at.replace(tzinfo=None) - timedelta(hours=12))
        found: datetime = observer.next_transit(ephem.Sun()).datetime()
        return found.replace(tzinfo=timezone.utc)

    longitude = ((12 - at.hour - at.minute / 60 - at.second / 3600) * 15 + 180) % 360 - 180
    for _ in range(4):  # the sun crosses 1 degree of longitude in 240 s
        longitude -= (at - transit(longitude)).total_seconds() / 240
        longitude = (longitude + 180) % 360 - 180
    return round(longitude, 6)


def create_schedule(now: float) -> dict[str, Any]:
    """Every kind of entry, through the ORM; returns the instants the checks need."""
    from django_celery_beat.models import (
        ClockedSchedule,
        CrontabSchedule,
        IntervalSchedule,
        PeriodicTask,
        SolarSchedule,
    )

    def at(offset: float) -> datetime:
        return datetime.fromtimestamp(now + offset, timezone.utc)

    def every(seconds: int) -> IntervalSchedule:
        found, _ = IntervalSchedule.objects.get_or_create(every=seconds, period="seconds")
        return found

    def task(name: str, version: int = 1, **fields: Any) -> None:
        kwargs = json.dumps({"entry": name, "version": version})
        PeriodicTask.objects.create(name=name, task="example.record", kwargs=kwargs, **fields)

    solar_at = at(26)
    minute = CrontabSchedule.objects.create(minute="*", hour="*", timezone="UTC")
    clocked = ClockedSchedule.objects.create(clocked_time=at(22))
    noon = SolarSchedule.objects.create(
        event="solar_noon", latitude=0, longitude=solar_noon_longitude(solar_at)
    )
    task("every-2s", interval=every(2))
    task("crontab", crontab=minute)
    task("solar", solar=noon)
    task("clocked", clocked=clocked, one_off=True)
    task("one-off", interval=every(3), one_off=True)
    task("window", interval=every(2), start_time=at(20), expires=at(32))
    task("expired", interval=every(2), expires=at(-60))
    task("future", interval=every(2), start_time=at(3600))
    task("disabled", interval=every(2), enabled=False)
    task("edited", interval=every(2))
    task("to-disable", interval=every(2))
    task("to-delete", interval=every(2))
    return {
        "solar": solar_at.timestamp(),
        "clocked": now + 22,
        "window": (now + 20, now + 32),
    }


def change(what: str) -> float:
    """One change through the ORM, as the admin makes it; returns when it was saved."""
    from django_celery_beat.models import IntervalSchedule, PeriodicTask

    if what == "add":
        schedule, _ = IntervalSchedule.objects.get_or_create(every=2, period="seconds")
        PeriodicTask.objects.create(
            name="added",
            task="example.record",
            kwargs=json.dumps({"entry": "added"}),
            interval=schedule,
        )
    elif what == "edit":
        edited = PeriodicTask.objects.get(name="edited")
        edited.kwargs = json.dumps({"entry": "edited", "version": 2})
        edited.save()
    elif what == "disable":
        disabled = PeriodicTask.objects.get(name="to-disable")
        disabled.enabled = False
        disabled.save()
    elif what == "delete":
        PeriodicTask.objects.get(name="to-delete").delete()
    return time.time()


@dataclass
class Run:
    """What happened: when the beats were all ready and stopped, the changes, the executions
    and the beats' publishes, and the failure details."""

    ready: float
    stopped: float
    killed: float
    plan: dict[str, Any]
    changed: dict[str, float]
    found: list[Note]
    published: list[str]
    detail: str

    @property
    def last_full_ms(self) -> int:
        """The last 2 s slot surely published: due a second before the beats were told to
        stop."""
        return slot_ms(self.stopped - 1, 2)

    def ids(self, entry: str) -> list[int]:
        return [n.run_ms for n in runs_of(self.found, entry)]


@pytest.mark.slow(seconds=55)
def test_three_beats_of_a_django_project_publish_every_run_once(
    beat_factory: BeatFactory,
    example_worker: WorkerProcess,
    redis_client: redis.Redis,
    key_prefix: str,
    example_env: dict[str, str],
) -> None:
    # the schedule's instants from an odd whole second: "window" then expires 1 s after its last
    # 2 s slot began (its run there is published well before its message expires; at a random
    # instant, a run published a few ms late was already expired, and Celery discarded it)
    second = math.floor(time.time())
    plan = create_schedule(second - (1 - second % 2))
    beats = [beat_factory.start(APP, env=example_env, scheduler=s) for s in SCHEDULERS]
    ready = max(beat.wait_ready() for beat in beats)
    changed: dict[str, float] = {}
    for what, offset in (("add", 4), ("edit", 6), ("disable", 8), ("delete", 10)):
        time.sleep(max(0.0, ready + offset - time.time()))  # the schedule of changes, not a wait
        changed[what] = change(what)
    time.sleep(max(0.0, ready + 12 - time.time()))
    beats[0].kill()  # SIGKILL one beat: the two others publish every run from here on
    killed = time.time()
    # run past the clocked, solar and window instants, and past a minute boundary (crontab)
    end = max(plan["window"][1] + 4, plan["solar"] + 4, math.floor(ready / 60) * 60 + 64)
    # stopped in the middle of a 2 s slot, when no beat is publishing: a beat stopped at a slot's
    # start (the minute's end above is one) may have published a run and not yet logged it
    end = math.ceil(end / 2) * 2 + 1
    time.sleep(max(0.0, end - time.time()))
    # when the beats are told to stop (stopping them one by one takes seconds on a loaded
    # machine): what was due a second before had been published
    stopped = time.time()
    for beat in beats:
        beat.terminate()
    published = [p.label for beat in beats for p in beat.published()]
    logs = lambda: f"{beat_factory.logs(60)}\n{example_worker.log_tail(60)}"  # noqa: E731

    def not_run() -> str:
        ran = {n.run for n in notes(redis_client, key_prefix)}
        return f"published, not run: {sorted(set(published) - ran)}\n{logs()}"

    wait_for(
        lambda: len(notes(redis_client, key_prefix)) >= len(published),
        DRAIN_S,
        "the worker to run every published run",
        example_worker,
        details=not_run,
    )
    found = notes(redis_client, key_prefix)
    summary = "\n".join(f"{n.run} v{n.version}" for n in sorted(found, key=lambda n: n.run))
    run = Run(ready, stopped, killed, plan, changed, found, published, f"\n{summary}\n{logs()}")

    check_every_run_once(run)
    check_interval_entries(run)
    check_changed_entries(run)
    check_start_time_and_expiry(run)
    check_runs_at_one_instant(run)


def check_every_run_once(run: Run) -> None:
    """Each run executed once and published by one beat; nothing the database scheduler
    would not run ran."""
    executed = Counter(n.run for n in run.found)
    assert not [r for r, k in executed.items() if k > 1], f"runs executed twice{run.detail}"
    labels = Counter(run.published)
    assert not [r for r, k in labels.items() if k > 1], f"runs published twice{run.detail}"
    assert set(labels) <= set(executed), f"published runs not executed{run.detail}"
    # a beat logs a run once it confirmed its claim: the killed one may have published one
    # run it never logged (executed once all the same), and so may the beats stopped at the
    # end, in their last slot (a beat slowed down by a busy machine publishes late in it);
    # none other is missing from the logs
    unlogged = [n for n in run.found if n.run not in labels]
    at_kill = [n for n in unlogged if abs(n.at - run.killed) < 3]
    at_stop = [n for n in unlogged if n not in at_kill and n.run_ms >= run.last_full_ms]
    assert len(at_kill) <= 1, f"{at_kill}{run.detail}"
    assert len(unlogged) == len(at_kill) + len(at_stop), (
        f"executed runs no beat published{run.detail}"
    )
    assert not [r for r in executed if r.endswith("@?")], f"a run without its label{run.detail}"
    entries = Counter(n.entry for n in run.found)
    for never in ("expired", "future", "disabled"):
        assert entries[never] == 0, f"{never} ran{run.detail}"


def check_interval_entries(run: Run) -> None:
    """every-2s: every 2 s slot while the beats ran, none missing; edited: its new arguments
    once the beats reloaded the schedule."""
    every = run.ids("every-2s")
    assert contiguous(every, 2000), f"every-2s: a slot missing{run.detail}"
    assert every[0] <= slot_ms(run.ready, 2) + 2000, f"every-2s: started late{run.detail}"
    assert every[-1] >= run.last_full_ms, f"every-2s: stopped early{run.detail}"

    edited = runs_of(run.found, "edited")
    assert contiguous([n.run_ms for n in edited], 2000), f"edited: a slot missing{run.detail}"
    assert edited[-1].run_ms >= run.last_full_ms, f"edited: stopped{run.detail}"
    for note in edited:
        if note.run_ms / 1000 < run.changed["edit"] - 2:
            assert note.version == 1, f"edited: a new version before the edit{run.detail}"
        if note.run_ms / 1000 > run.changed["edit"] + PICKUP_S:
            assert note.version == 2, f"edited: the old version after the edit{run.detail}"


def check_changed_entries(run: Run) -> None:
    """added: runs from its creation on; to-disable, to-delete: none after the change."""
    added = run.ids("added")
    assert added, f"added: never ran{run.detail}"
    assert contiguous(added, 2000), f"added: a slot missing{run.detail}"
    first = added[0] / 1000
    assert run.changed["add"] - 2 < first <= run.changed["add"] + PICKUP_S + 2, run.detail
    assert added[-1] >= run.last_full_ms, f"added: stopped early{run.detail}"
    for gone, what in (("to-disable", "disable"), ("to-delete", "delete")):
        ids = run.ids(gone)
        assert ids, f"{gone}: never ran before the change{run.detail}"
        assert contiguous(ids, 2000), f"{gone}: a slot missing{run.detail}"
        assert ids[-1] / 1000 <= run.changed[what] + PICKUP_S, f"{gone}: ran after{run.detail}"
        assert ids[-1] / 1000 >= run.changed[what] - 4, f"{gone}: stopped early{run.detail}"


def check_start_time_and_expiry(run: Run) -> None:
    """window: the 2 s slots that start inside [start_time, expires), and no other."""
    start, expires = run.plan["window"]
    window = run.ids("window")
    assert window, f"window: never ran{run.detail}"
    assert window[0] / 1000 >= start, f"window: ran before its start time{run.detail}"
    assert window[-1] / 1000 < expires, f"window: ran after it expired{run.detail}"
    assert contiguous(window, 2000), f"window: a slot missing{run.detail}"
    assert window[0] / 1000 < start + 2, f"window: started late{run.detail}"
    assert window[-1] / 1000 >= expires - 2.5, f"window: stopped early{run.detail}"


def check_runs_at_one_instant(run: Run) -> None:
    """one-off and clocked: once, claimed once; solar: its event once; crontab: each minute.

    A one-off interval entry is disabled at its next check; a clocked one is not checked again
    after it ran (django-celery-beat) and is disabled when the beats next reload the schedule.
    """
    from django_celery_beat.models import PeriodicTask

    for once in ("one-off", "clocked"):
        ran = runs_of(run.found, once)
        assert len(ran) == 1, f"{once}: {len(ran)} runs{run.detail}"
        assert "@once-" in ran[0].run, run.detail
    assert not PeriodicTask.objects.get(name="one-off").enabled, "one-off: still enabled"
    (clocked,) = runs_of(run.found, "clocked")
    assert clocked.at >= run.plan["clocked"], f"clocked: ran early{run.detail}"
    solar = run.ids("solar")
    assert len(solar) == 1, f"solar: {len(solar)} runs{run.detail}"
    assert abs(solar[0] / 1000 - run.plan["solar"]) < 2, f"solar: not its event{run.detail}"
    first_minute, last_minute = math.floor(run.ready / 60) + 1, math.floor(run.stopped / 60)
    minutes = [m * 60_000 for m in range(first_minute, last_minute + 1)]
    assert minutes, "the beats ran across no minute boundary"
    crontab = [ms for ms in run.ids("crontab") if ms / 1000 > run.ready]  # (one before: fine)
    assert crontab == minutes, f"crontab{run.detail}"


def test_the_django_beats_banner_and_log_never_show_the_redis_password(
    beat_factory: BeatFactory, example_env: dict[str, str]
) -> None:
    """The example's settings take the broker URL for the run claims too: with a password in it,
    ``celery beat -S singleton-django`` shows it hidden in its banner (Celery's broker line and
    the singleton line) and in its first tick's line, and nowhere else in its log while it fails
    to reach that server (an entry makes it read its record: the outage line quotes the error of
    the Redis client; no run is claimed, so the beat never connects to the broker)."""
    from django_celery_beat.models import IntervalSchedule, PeriodicTask

    every_second = IntervalSchedule.objects.create(every=1, period="seconds")
    PeriodicTask.objects.create(name="due", task="example.record", interval=every_second)
    port = free_port()  # nothing listens there: the beat never talks to a server with it
    password = "s3cret-django-beat"
    env = {**example_env, "EXAMPLE_REDIS_URL": f"redis://:{password}@127.0.0.1:{port}/0"}
    beat = beat_factory.start(APP, env=env, scheduler="singleton-django")
    shown = beat.wait_for_log(r"\. singleton -> mode=(\S+) redis=(\S+) ")
    assert shown.groups() == ("active", f"redis://:***@127.0.0.1:{port}/0"), beat.log_tail()
    beat.wait_for_log(r"singleton scheduler started: mode=active redis=redis://:\*\*\*@")
    beat.wait_for_log(rf"beat: redis unreachable, publishing nothing until it answers: .*{port}")
    beat.kill()
    assert password not in beat.log_text(), beat.log_text()


#: Django entries every 2 s, each with its catch-up choice in its headers (None: the app's)
CATCH_UP_ENTRIES: dict[str, str | float | None] = {"dj-default": None, "dj-none": "none"}


@pytest.mark.slow(seconds=30)
def test_a_django_beat_back_after_downtime_catches_up_as_each_entry_says(
    beat_factory: BeatFactory, example_env: dict[str, str]
) -> None:
    """The database keeps each entry's last run, as a schedule file does: catch-up reads the
    beats' record in Redis instead, and an entry's choice comes from its headers."""
    from django_celery_beat.models import IntervalSchedule, PeriodicTask

    every_2s, _ = IntervalSchedule.objects.get_or_create(every=2, period="seconds")
    for name, choice in CATCH_UP_ENTRIES.items():
        headers = {} if choice is None else {CATCH_UP_HEADER: choice}
        PeriodicTask.objects.create(
            name=name,
            task="example.record",
            kwargs=json.dumps({"entry": name}),
            interval=every_2s,
            headers=json.dumps(headers),
        )
    first = beat_factory.start(APP, env=example_env, scheduler=SCHEDULERS[0], name="first")
    before = published_twice_then_stop(first, list(CATCH_UP_ENTRIES))
    time.sleep(9.0)  # every beat down for several slots
    again = beat_factory.start(APP, env=example_env, scheduler=SCHEDULERS[0], name="again")
    check_after_restart(beat_factory, CATCH_UP_ENTRIES, before, [again])


@pytest.mark.slow(seconds=25)
def test_the_verbs_steer_a_django_beats_entries(
    beat_factory: BeatFactory, example_env: dict[str, str]
) -> None:
    """The entries live in the database, not in the app's ``beat_schedule``: the running beat
    registers them, so ``status`` lists them and ``pause``, ``run`` and ``resume`` accept
    their names (an entry added in the admin too); a paused entry is skipped, an asked run of
    it goes out once."""
    from django_celery_beat.models import IntervalSchedule, PeriodicTask

    every_2s, _ = IntervalSchedule.objects.get_or_create(every=2, period="seconds")
    PeriodicTask.objects.create(
        name="dj-steered",
        task="example.record",
        kwargs=json.dumps({"entry": "dj-steered"}),
        interval=every_2s,
    )
    beat = beat_factory.start(APP, env=example_env, scheduler=SCHEDULERS[0])
    beat.wait_for_log(r"beat: published run: entry=dj-steered ", 30)

    def verb(*args: str) -> subprocess.CompletedProcess[str]:
        return singleton_cli(APP, example_env, "beat", *args)

    status = json.loads(verb("status", "--json").stdout)
    row = next(r for r in status["entries"] if r["entry"] == "dj-steered")
    assert (row["task"], row["schedule"], row["registered"]) == ("example.record", "every 2s", True)
    assert verb("pause", "dj-steered").returncode == 0
    offset = beat.log_size()
    beat.wait_for_log(r"entry paused, run not published: entry=dj-steered ", 10, start=offset)
    asked = verb("run", "dj-steered")
    assert asked.returncode == 0, asked
    task_id = asked.stdout.rsplit("task_id=", 1)[1].split()[0]
    mine = [p for p in beat.published() if p.task_id == task_id]
    assert [p.run.startswith("ask-") for p in mine] == [True], beat.log_tail()
    assert verb("resume", "dj-steered").stdout == "resumed: entry=dj-steered\n"
    assert verb("pause", "not-in-the-database").returncode == 1
