"""Sentry Crons with three SingletonScheduler beats: each scheduled run gets one in-progress
check-in, from the beat that published it, and one closing check-in, from the worker.

The real sentry-sdk runs in the beats and the worker (``CeleryIntegration(monitor_beat_tasks=
True)``), its check-ins recorded in Redis instead of sent (tests/support/sentry_crons.py).
beat_app's Sentry schedule (``SINGLETON_TEST_SENTRY``): ``crons-record`` (succeeds),
``crons-held`` (a SingletonTask holding its lock longer than its 2 s interval: every other run
is a skipped duplicate), ``crons-waits`` (the same lock, policy "retry": requeued while it is
held, it closes its check-in once, when it ran), ``crons-coalesce`` (a lock of its own, policy
"coalesce": every other run is coalesced), ``crons-joins`` (the same, policy "join": every
other run joins the one going on, its check-in closed as it joins) and ``crons-fails``
(raises), each every 2 s.
One worker serves the module's tests; each starts beats of its own.
"""

from __future__ import annotations

import re
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from celery_singleton_lock.beat.claims import CLAIM_HEADER, RUN_HEADER
from celery_singleton_lock.core.keys import run_claim_key
from tests.support.basic_app import BEAT_APP
from tests.support.beats import BeatProcess
from tests.support.bed import Bed
from tests.support.sentry_crons import CheckIn, load_checkins
from tests.support.waiting import wait_for

ENTRIES = (
    "crons-record",
    "crons-held",
    "crons-waits",
    "crons-coalesce",
    "crons-fails",
    "crons-joins",
)
SENTRY_ENV = {"SINGLETON_TEST_SENTRY": "1"}
DUPLICATE_LINES = (
    "singleton: duplicate skipped: b.crons_held",
    "singleton: duplicate retried in 0.5s: b.crons_waits",
    "singleton: duplicate coalesced: b.crons_coalesce",
    "singleton: duplicate joined: b.crons_joins",
)


def checkins_of(bed: Bed) -> list[CheckIn]:
    """The check-ins recorded since the test began."""
    return load_checkins(bed.client, bed.prefix)


@pytest.fixture(scope="module")
def crons_bed(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, module_prefix: str
) -> Iterator[Bed]:
    """One prefork worker of beat_app with Sentry on, for the module's tests."""
    work_dir = tmp_path_factory.mktemp("crons")
    with Bed(redis_url, module_prefix, work_dir, env=SENTRY_ENV) as made:
        made.start(BEAT_APP, concurrency=4)
        yield made


@pytest.fixture
def bed(tmp_path: Path, crons_bed: Bed) -> Iterator[Bed]:
    """The module's worker, beats of the test's own (Sentry on: :attr:`Bed.beats`), and the
    check-ins recorded so far cleared."""
    crons_bed.client.delete(f"{crons_bed.prefix}sentry-checkins")
    beats = crons_bed.new_beats(tmp_path / "beats")
    try:
        yield crons_bed
    finally:
        beats.close()


def killed(beat: BeatProcess) -> tuple[float, float]:
    """The moment ``beat`` was SIGKILLed, as a stop window for :func:`check_one_checkin_per_run`."""
    assert beat.killed_at is not None, beat
    return beat.killed_at, beat.killed_at


def terminate(*beats: BeatProcess) -> tuple[float, float]:
    """SIGTERM each of ``beats`` and wait for its exit: from the first SIGTERM to the last exit,
    a stop window for :func:`check_one_checkin_per_run`."""
    told = time.time()
    for beat in beats:
        beat.terminate()
    return told, time.time()


def check_one_checkin_per_run(
    bed: Bed, publishers: dict[str, int], stops: Sequence[tuple[float, float]] = ()
) -> list[CheckIn]:
    """Wait until every in-progress check-in is closed, then check: per check-in id one
    in-progress (from a beat) and one closing check-in (from the worker, naming its run); per
    run one id; each in-progress sent by the beat that logged the run as published
    (``publishers``: run label -> beat pid, for the runs logged). The check-ins, returned.

    A beat that stops right after a batch went out, before the batch's check-ins, leaves those
    runs with their closing check-in alone (docs/beat.md): a SIGKILL, and also a SIGTERM, whose
    SystemExit (Celery beat's warm shutdown) may come between the two. Allowed for runs of the
    last slot before a stop: ``stops`` are (from, to) windows in which beats were killed or
    told to stop (:func:`killed`, :func:`terminate`)."""

    def all_closed() -> list[CheckIn] | None:
        recorded = checkins_of(bed)
        started = {c.check_in_id for c in recorded if c.status == "in_progress"}
        closed = {c.check_in_id for c in recorded if c.status != "in_progress"}
        return recorded if started <= closed else None

    checkins = wait_for(all_closed, 15, "every check-in closed", bed.worker, *bed.beats.beats)
    detail = "\n".join(map(str, checkins))
    by_id: dict[str, list[CheckIn]] = defaultdict(list)
    for checkin in checkins:
        by_id[checkin.check_in_id].append(checkin)
    ids_of_run: dict[str, set[str]] = defaultdict(set)
    for check_in_id, its in by_id.items():
        started = [c for c in its if c.status == "in_progress"]
        closed = [c for c in its if c.status != "in_progress"]
        if not started and stops:
            assert len(closed) == 1, detail
            assert closed[0].run is not None, detail
            nominal = int(closed[0].run.rsplit("@", 1)[1]) / 1000
            assert any(begin - 2.5 < nominal <= end for begin, end in stops), (stops, detail)
            continue
        assert len(started) == 1, detail
        assert started[0].role == "beat", detail
        assert len(closed) == 1, detail
        assert closed[0].role == "worker", detail
        assert closed[0].status in ("ok", "error"), detail
        assert closed[0].run is not None, detail
        assert closed[0].run.rsplit("@", 1)[0] == closed[0].slug == started[0].slug, detail
        ids_of_run[closed[0].run].add(check_in_id)
        if closed[0].run in publishers:
            assert started[0].pid == publishers[closed[0].run], detail
    assert all(len(ids) == 1 for ids in ids_of_run.values()), detail
    return checkins


def published_by(beats: list[BeatProcess]) -> dict[str, int]:
    """Run label -> pid of the beat that logged it published (the Sentry entries only)."""
    return {p.label: b.pid for b in beats for p in b.published() if p.entry in ENTRIES}


def runs_of(beat: BeatProcess) -> int:
    """How many crons-record runs ``beat`` published."""
    return len([p for p in beat.published() if p.entry == "crons-record"])


def wait_for_duplicates(bed: Bed) -> None:
    """Until the worker has skipped a crons_held run, requeued a crons_waits run, coalesced a
    crons_coalesce run and joined a crons_joins run to the one going on."""
    wait_for(
        lambda: all(line in bed.worker.log_text() for line in DUPLICATE_LINES),
        20,
        "a skipped, a requeued, a coalesced and a joined duplicate",
        bed.worker,
    )


def check_statuses(bed: Bed, checkins: list[CheckIn]) -> None:
    """Each entry has closed runs; crons-fails' are errors, the others' ok, skipped runs and
    runs requeued while the lock was held included."""
    closed = [c for c in checkins if c.status != "in_progress"]
    for entry in ENTRIES:
        assert [c for c in closed if c.slug == entry], entry
    assert {c.status for c in closed if c.slug == "crons-fails"} == {"error"}
    assert {c.status for c in closed if c.slug != "crons-fails"} == {"ok"}
    # the run's start travelled in its headers, as with Sentry's own hook: each has a duration
    assert all(c.duration is not None and c.duration >= 0 for c in closed)


@pytest.mark.slow(seconds=35)
def test_three_beats_one_dying_before_publishing_one_killed(bed: Bed) -> None:
    """Active-active. A beat that dies after claiming a run, before publishing it, sent no
    check-in (Sentry's own wrapper sends it before the publish); the run it claimed, published
    by a survivor when the claim's lease ended, gets one pair. A second beat is SIGKILLed
    midway. The beats that lose claims send nothing; every run has one in-progress and one
    closing check-in with the same id."""
    first = bed.beats.start(name="first")
    second = bed.beats.start(name="second")
    # the survivors must already fire every slot, so they see the victim's claim of its run
    for beat in (first, second):
        beat.wait_for_log(r"beat: published run: entry=crons-record ", 30)
    victim = bed.beats.start(
        name="victim", env={"SINGLETON_TEST_DIE_ON_PUBLISH": "before:crons-record"}
    )
    wait_for(lambda: not victim.is_running(), 40, "the victim to win a claim and die", victim)
    label = (bed.client.lindex(f"{bed.prefix}died-on", 0) or b"").decode()
    assert label.startswith("crons-record@"), label
    time.sleep(2.0)  # a run or so more, then one survivor is killed
    second.kill()
    # the victim's claim ends after the 10 s publish lease; the survivor publishes its run then
    wait_for(
        lambda: label in published_by([first]),
        20,
        "the dead claimer's run published by the survivor",
        first,
    )
    wait_for_duplicates(bed)
    stops = [killed(second), terminate(first)]
    beats = [first, second, victim]
    checkins = check_one_checkin_per_run(bed, published_by(beats), stops)
    # the victim's check-ins: the runs it published before the fatal one, none for that one
    from_victim = [c for c in checkins if c.pid == victim.pid]
    assert len(from_victim) == len([p for p in victim.published() if p.entry in ENTRIES])
    (fatal,) = {c.check_in_id for c in checkins if c.run == label}
    assert [c.pid for c in checkins if c.check_in_id == fatal and c.role == "beat"] == [first.pid]
    check_statuses(bed, checkins)
    # every run a surviving log names was closed (its message ran or was skipped)
    closed_runs = {c.run for c in checkins if c.status != "in_progress"}
    assert set(published_by([first])) <= closed_runs


@pytest.mark.slow(seconds=12)
def test_leader_mode_only_the_leader_checks_in(bed: Bed) -> None:
    """Leader mode, two beats: the standby never publishes and sends nothing; the leader is
    SIGKILLed, the standby takes over after the lease; every run has one in-progress and one
    closing check-in, each in-progress from the leader of the moment."""
    env = {"SINGLETON_TEST_BEAT_MODE": "leader", "SINGLETON_TEST_BEAT_LEASE": "2"}
    beats = [bed.beats.start(name=f"beat{i}", env=env) for i in range(2)]
    for beat in beats:
        beat.wait_ready()

    def leader() -> BeatProcess | None:
        return next((b for b in beats if b.is_running() and b.published()), None)

    first = wait_for(leader, 20, "a leader to publish", *beats)
    wait_for(lambda: runs_of(first) >= 2, 20, "the leader's runs", first)
    first.kill()
    second = wait_for(leader, 20, "a standby to take over", *beats)
    wait_for(lambda: runs_of(second) >= 2, 20, "the new leader's runs", second)
    wait_for_duplicates(bed)
    stops = [killed(first), terminate(*beats)]
    checkins = check_one_checkin_per_run(bed, published_by(beats), stops)
    pids = {c.pid for c in checkins if c.status == "in_progress"}
    assert pids <= {first.pid, second.pid}
    assert second.pid in pids
    check_statuses(bed, checkins)


@pytest.mark.slow(seconds=8)
def test_a_runs_second_message_dropped_by_the_worker_closes_its_check_in(bed: Bed) -> None:
    """A run published twice (its beat died between publishing and confirming, and no worker
    had received it within the publish lease): the worker's witness drops the second message
    before it runs, and closes the check-in that message carries as ok, once."""
    beat = bed.beats.start(name="only")
    published = wait_for(
        lambda: [p for p in beat.published() if p.entry == "crons-record"], 20, "a run", beat
    )[0]
    check_one_checkin_per_run(bed, published_by([beat]), [terminate(beat)])
    check_in_id = uuid.uuid4().hex
    second = bed.app.send_task(  # what the instance that publishes the run again sends
        "b.record",
        args=("crons-record",),
        headers={
            RUN_HEADER: published.label,
            CLAIM_HEADER: run_claim_key(f"{bed.prefix}lock:", "crons-record", published.run),
            "sentry-monitor-slug": "crons-record",
            "sentry-monitor-check-in-id": check_in_id,
        },
    )
    dropped = f"duplicate scheduled run dropped: run={published.label} task_id={second.id}"
    bed.worker.wait_for_log(re.escape(dropped), 20)
    closes = wait_for(
        lambda: [c for c in checkins_of(bed) if c.check_in_id == check_in_id],
        10,
        "the dropped message's check-in closed",
        bed.worker,
    )
    assert [(c.role, c.slug, c.status) for c in closes] == [("worker", "crons-record", "ok")]
    assert len(bed.runs(published.label)) == 1  # the run ran once, from its first message
