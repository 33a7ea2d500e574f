"""SingletonScheduler with real ``celery beat`` and ``celery worker`` processes.

Every test runs beats of ``tests.support.beat_app`` (``-S singleton``, 1 s max interval) and
prefork workers on a private key prefix. Each execution records its run label
``<entry>@<run id ms>``, so the history says how often each nominal run executed. Entries:
``every-second`` (1 s interval), ``remote-every-2s`` (2 s interval, published with
``send_task``: the beats do not know the task) and ``every-minute`` (crontab).
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Iterator
from itertools import pairwise

import pytest
import redis
from celery import Celery

from celery_singleton_lock.core.keys import run_claim_key
from tests.support.basic_app import BEAT_APP, close_app, history_key, make_app
from tests.support.beats import BeatFactory, BeatHistory, BeatProcess
from tests.support.history import load_history
from tests.support.servers import RedisServer, free_port
from tests.support.waiting import wait_for
from tests.support.workers import WorkerFactory, WorkerProcess

#: publishing lags the slot start by a few ms; a slot due this close to a beat's end may be lost
PUBLISH_MARGIN_S = 0.5
#: how long in-flight tasks get to finish after the last beat stopped
DRAIN_S = 3.0
LEASE_S = 3.0


@pytest.fixture
def control_app(redis_url: str, key_prefix: str) -> Iterator[Celery]:
    """A client app on the workers' private broker space (to ping them)."""
    app = make_app(redis_url, key_prefix)
    yield app
    close_app(app)


def start_workers(
    worker_factory: WorkerFactory, app: Celery, count: int = 2
) -> list[WorkerProcess]:
    """``count`` prefork workers (-c 2) of beat_app, ready to run tasks."""
    workers = [worker_factory.start(BEAT_APP, pool="prefork", concurrency=2) for _ in range(count)]
    for worker in workers:
        worker.wait_ready(app)
    return workers


def sleep_until(deadline: float) -> None:
    """Sleep until ``time.time()`` reaches ``deadline``."""
    delay = deadline - time.time()
    if delay > 0:
        time.sleep(delay)


def latest_publisher(beats: list[BeatProcess]) -> BeatProcess:
    """The running beat that published a run most recently (the first running one if none)."""
    alive = [b for b in beats if b.is_running() and b.killed_at is None]
    published = [(b.published()[-1:], b) for b in alive]
    recent = [(p[0].ts, b) for p, b in published if p]
    return max(recent, key=lambda pair: pair[0])[1] if recent else alive[0]


def history(redis_client: redis.Redis, key_prefix: str) -> BeatHistory:
    """Everything beat_app's tasks recorded under ``key_prefix``."""
    return BeatHistory(load_history(redis_client, history_key(key_prefix)))


def slot_ms(when: float, step_s: float) -> int:
    """Start (epoch ms) of the ``step_s`` slot containing ``when``."""
    return math.floor(when / step_s) * round(step_s * 1000)


def first_slot_after_ms(when: float, step_s: float) -> int:
    """Start (epoch ms) of the first ``step_s`` slot that starts after ``when``."""
    return slot_ms(when, step_s) + round(step_s * 1000)


def assert_exactly_once(hist: BeatHistory, beats: list[BeatProcess], context: str) -> None:
    """Every run label executed once, and no beat log shows one run published twice."""
    published = [p.label for b in beats for p in b.published()]
    twice = sorted({label for label in published if published.count(label) > 1})
    detail = f"{context}\n{hist.summary()}"
    assert not hist.duplicates(), f"runs executed twice {hist.duplicates()}: {detail}"
    assert not hist.unlabelled(), f"runs without a run label {hist.unlabelled()}: {detail}"
    assert not twice, f"runs published by two beats {twice}: {detail}"


def assert_no_gaps(
    hist: BeatHistory,
    entry: str,
    *,
    step_s: float,
    ready: float,
    end: float,
    logs: str,
) -> list[int]:
    """Every slot of ``entry`` due after ``ready`` and before ``end`` ran (contiguous run ids).

    ``end`` is when the last beat stopped: a slot due within PUBLISH_MARGIN_S of it may be
    missing, a later one must be. Returns the run ids."""
    ids = hist.run_ids(entry)
    step_ms = round(step_s * 1000)
    assert ids, f"{entry}: no run executed\n{hist.summary()}\n{logs}"
    must_first = first_slot_after_ms(ready, step_s)
    must_last = slot_ms(end - PUBLISH_MARGIN_S, step_s)
    missing = hist.missing_slots(entry, step_ms, min(ids[0], must_first), max(ids[-1], must_last))
    irregular = [b - a for a, b in pairwise(ids) if b - a != step_ms]
    detail = f"(required {must_first}..{must_last})\n{hist.summary()}\n{logs}"
    assert not missing, f"{entry}: runs missing {missing} {detail}"
    assert not irregular, f"{entry}: irregular steps {irregular} {detail}"
    assert ids[0] >= slot_ms(ready, step_s) - step_ms, f"{entry}: ran before the beats: {ids[0]}"
    assert ids[-1] <= slot_ms(end, step_s), f"{entry}: a run after the beats stopped: {ids[-1]}"
    return ids


def minute_boundaries_ms(start: float, end: float) -> list[int]:
    """Epoch ms of every whole minute in (``start``, ``end``]."""
    first = math.floor(start / 60) + 1
    return [m * 60_000 for m in range(first, math.floor(end / 60) + 1)]


# -- active-active ------------------------------------------------------------------------------


@pytest.mark.slow(seconds=55)
def test_three_beats_killed_one_by_one_run_every_nominal_run_exactly_once(
    beat_factory: BeatFactory,
    worker_factory: WorkerFactory,
    control_app: Celery,
    redis_client: redis.Redis,
    key_prefix: str,
) -> None:
    """3 active beats, SIGKILLed one by one (10 s and 20 s in), the last one stopped at 30 s or
    just past the next minute boundary, whichever is later: each run once, no gap, crontab too.

    (It ran a fixed 75 s, to be sure to cross a minute; now 30 to 63 s, 38 on average.)"""
    start_workers(worker_factory, control_app, 2)
    beats = []
    for _ in range(3):  # staggered: every instance has its own phase and its own start time
        beats.append(beat_factory.start())
        time.sleep(0.4)
    ready = min(b.wait_ready() for b in beats)
    launched = min(b.started_at for b in beats)

    kills = []
    for at in (10, 20):
        sleep_until(ready + at)
        victim = latest_publisher(beats)
        victim.kill()
        assert victim.killed_at is not None
        kills.append((victim.name, victim.killed_at))
    # past a minute boundary for the crontab entry: its run is published at the boundary
    sleep_until(max(ready + 30, (math.floor(ready / 60) + 1) * 60 + PUBLISH_MARGIN_S + 2))
    survivor = next(b for b in beats if b.killed_at is None)
    assert survivor.is_running(), f"the last beat died on its own:\n{survivor.log_tail()}"
    survivor.kill()
    end = survivor.killed_at
    assert end is not None
    time.sleep(DRAIN_S)

    hist = history(redis_client, key_prefix)
    logs = f"kills: {kills}\n{beat_factory.logs(400)}"
    assert_exactly_once(hist, beats, "3 beats, killed one by one")
    assert_no_gaps(hist, "every-second", step_s=1.0, ready=ready, end=end, logs=logs)
    assert_no_gaps(hist, "remote-every-2s", step_s=2.0, ready=ready, end=end, logs=logs)
    # every beat published: active-active, no standby
    assert all(b.published() for b in beats), logs

    required = minute_boundaries_ms(ready, end - PUBLISH_MARGIN_S)
    allowed = minute_boundaries_ms(launched - 1, end)
    minutes = hist.run_ids("every-minute")
    assert required, "the run crossed no minute boundary"
    assert set(required) <= set(minutes) <= set(allowed), (
        f"every-minute ran at {minutes}, expected {required} (at most {allowed})\n"
        f"{hist.summary()}\n{logs}"
    )
    # the runs after each kill were published by a survivor, and there was one every second
    for name, killed_at in kills:
        later = [i for i in hist.run_ids("every-second") if killed_at < i / 1000 <= killed_at + 3]
        assert len(later) >= 2, f"no runs right after {name} was killed at {killed_at}\n{logs}"


@pytest.mark.slow(seconds=19)
def test_paused_beat_neither_duplicates_nor_loses_runs(
    beat_factory: BeatFactory,
    worker_factory: WorkerFactory,
    control_app: Celery,
    redis_client: redis.Redis,
    key_prefix: str,
) -> None:
    """One of two active beats SIGSTOPped 5 s, then SIGCONT: no duplicate, no gap."""
    start_workers(worker_factory, control_app, 1)
    beats = [beat_factory.start(), beat_factory.start()]
    ready = min(b.wait_ready() for b in beats)
    sleep_until(ready + 4)
    victim = latest_publisher(beats)
    # pause it a few ms after a slot starts: when it is most likely between claim and publish
    sleep_until(math.floor(time.time()) + 1.003)
    victim.stop()
    time.sleep(5)
    victim.cont()
    sleep_until(time.time() + 5)
    for beat in beats:
        beat.kill()
    end = max(b.killed_at or 0 for b in beats)
    time.sleep(DRAIN_S)

    hist = history(redis_client, key_prefix)
    logs = f"paused {victim.name} at {victim.stopped_at}\n{beat_factory.logs(200)}"
    assert_exactly_once(hist, beats, "a beat paused 5 s")
    assert_no_gaps(hist, "every-second", step_s=1.0, ready=ready, end=end, logs=logs)
    assert_no_gaps(hist, "remote-every-2s", step_s=2.0, ready=ready, end=end, logs=logs)


@pytest.mark.slow(seconds=14)
def test_run_claimed_by_a_dead_claimer_is_published_late_not_lost(
    beat_factory: BeatFactory,
    worker_factory: WorkerFactory,
    control_app: Celery,
    redis_client: redis.Redis,
    key_prefix: str,
) -> None:
    """A pending claim left by a claimer that died before publishing delays its run, once."""
    start_workers(worker_factory, control_app, 1)
    beats = [beat_factory.start(), beat_factory.start()]
    ready = min(b.wait_ready() for b in beats)
    sleep_until(ready + 2)
    due = math.floor(time.time()) + 3  # an every-second slot 2-3 s ahead
    run = str(due * 1000)
    key = run_claim_key(key_prefix + "lock:", "every-second", run)
    sleep_until(due - 0.5)
    # the ghost claimed the run just before it was due and died: its claim outlives the slot
    assert redis_client.set(key, "pending ghost", px=2000, nx=True)
    ghost_expires = time.time() + 2.0
    sleep_until(due + 5)
    for beat in beats:
        beat.kill()
    end = max(b.killed_at or 0 for b in beats)
    time.sleep(DRAIN_S)

    hist = history(redis_client, key_prefix)
    logs = beat_factory.logs(200)
    label = f"every-second@{run}"
    assert hist.labels[label] == 1, f"{label} ran {hist.labels[label]} times\n{logs}"
    started = hist.starts_of(label)[0]
    assert started >= ghost_expires - 0.2, (
        f"{label} ran at {started}, before the ghost's claim expired at {ghost_expires}\n{logs}"
    )
    saw_ghost = re.compile(rf"run already claimed: entry=every-second run={run} by=ghost ")
    assert any(saw_ghost.search(b.log_text()) for b in beats), logs
    assert_exactly_once(hist, beats, "a ghost claim")
    assert_no_gaps(hist, "every-second", step_s=1.0, ready=ready, end=end, logs=logs)


# -- leader mode --------------------------------------------------------------------------------

LEADER_ENV = {"SINGLETON_TEST_BEAT_MODE": "leader", "SINGLETON_TEST_BEAT_LEASE": f"{LEASE_S:g}"}
BECAME_LEADER = "beat: became leader"


def leader_lines(beat: BeatProcess, start: int = 0) -> list[float]:
    """Log times at which ``beat`` became leader (after byte offset ``start``)."""
    return [ln.ts for ln in beat.lines(start) if BECAME_LEADER in ln.text]


def wait_for_leader(beats: list[BeatProcess], timeout: float, since: float = 0.0) -> BeatProcess:
    """The beat that logged it became leader after ``since`` (epoch s); fails if none."""

    def leader() -> BeatProcess | None:
        return next((b for b in beats if any(ts >= since for ts in leader_lines(b))), None)

    found: BeatProcess = wait_for(leader, timeout, "a beat to become leader", interval=0.05)
    return found


@pytest.mark.slow(seconds=16)
def test_leader_killed_a_standby_takes_over_within_the_lease(
    beat_factory: BeatFactory,
    worker_factory: WorkerFactory,
    control_app: Celery,
    redis_client: redis.Redis,
    key_prefix: str,
) -> None:
    """Leader mode, 3 beats: one leads; SIGKILLed, another leads within lease + 1.5 s."""
    start_workers(worker_factory, control_app, 1)
    beats = [beat_factory.start(env=LEADER_ENV) for _ in range(3)]
    ready = min(b.wait_ready() for b in beats)
    leader = wait_for_leader(beats, 10)
    sleep_until(ready + 5)
    logs = beat_factory.logs(200)
    assert [b.name for b in beats if leader_lines(b)] == [leader.name], logs
    assert [b.name for b in beats if b.published()] == [leader.name], logs

    leader.kill()
    killed_at = leader.killed_at
    assert killed_at is not None
    standbys = [b for b in beats if b is not leader]
    successor = wait_for_leader(standbys, LEASE_S + 5, since=killed_at)
    took_over = min(ts for ts in leader_lines(successor) if ts >= killed_at)
    sleep_until(time.time() + 4)
    for beat in standbys:
        beat.kill()
    end = max(b.killed_at or 0 for b in beats)
    time.sleep(DRAIN_S)

    hist = history(redis_client, key_prefix)
    logs = f"leader {leader.name} killed at {killed_at}\n{beat_factory.logs(200)}"
    assert took_over - killed_at <= LEASE_S + 1.5, (
        f"{successor.name} took over {took_over - killed_at:.2f}s after the kill\n{logs}"
    )
    assert [b.name for b in standbys if leader_lines(b)] == [successor.name], logs
    assert_exactly_once(hist, beats, "leader killed")
    ids = hist.run_ids("every-second")
    assert ids, f"no run at all\n{hist.summary()}\n{logs}"
    assert ids[-1] / 1000 > took_over, f"no run after the takeover\n{hist.summary()}"
    assert hist.largest_gap_ms("every-second") <= (LEASE_S + 2) * 1000, (
        f"every-second gap {hist.largest_gap_ms('every-second')} ms\n{hist.summary()}\n{logs}"
    )
    assert ids[0] <= first_slot_after_ms(ready, 1.0) + 3000, hist.summary()
    assert ids[-1] >= slot_ms(end - PUBLISH_MARGIN_S, 1.0), hist.summary()


@pytest.mark.slow(seconds=20)
def test_paused_leader_is_deposed_and_does_not_publish_after_resuming(
    beat_factory: BeatFactory,
    worker_factory: WorkerFactory,
    control_app: Celery,
    redis_client: redis.Redis,
    key_prefix: str,
) -> None:
    """Leader SIGSTOPped 6 s (> lease): a standby leads; the resumed one publishes nothing."""
    start_workers(worker_factory, control_app, 1)
    beats = [beat_factory.start(env=LEADER_ENV) for _ in range(2)]
    ready = min(b.wait_ready() for b in beats)
    leader = wait_for_leader(beats, 10)
    sleep_until(ready + 4)
    leader.stop()
    stopped_at = leader.stopped_at
    assert stopped_at is not None
    standby = next(b for b in beats if b is not leader)
    time.sleep(6)
    leader.cont()
    sleep_until(time.time() + 5)
    for beat in beats:
        beat.kill()
    time.sleep(DRAIN_S)

    hist = history(redis_client, key_prefix)
    logs = f"leader {leader.name} paused at {stopped_at}\n{beat_factory.logs(200)}"
    took_over = [ts for ts in leader_lines(standby) if ts >= stopped_at]
    assert took_over, f"{standby.name} never became leader\n{logs}"
    assert took_over[0] - stopped_at <= LEASE_S + 1.5, logs
    assert leader.log_size_at_cont is not None
    after = leader.log_text(leader.log_size_at_cont)
    resumed_published = leader.published(leader.log_size_at_cont)
    assert not resumed_published, f"the deposed leader published {resumed_published}\n{logs}"
    assert "beat: leadership lost" in after, f"no 'leadership lost' after resuming\n{logs}"
    assert BECAME_LEADER not in after, logs
    assert_exactly_once(hist, beats, "leader paused")
    assert hist.largest_gap_ms("every-second") <= (LEASE_S + 2) * 1000, (
        f"every-second gap {hist.largest_gap_ms('every-second')} ms\n{hist.summary()}\n{logs}"
    )


#: The lease of the stalled-Redis test: long, so that it outlives the stall by far.
LONG_LEASE_S = 30.0
#: the leader's renewal failed (it goes on leading while its lease surely lives; stood by
#: in older versions)
RENEWAL_FAILED = r"beat: redis error, (lease not renewed|standing by)"
KEPT = "beat: leadership kept after a redis error"


@pytest.mark.slow(seconds=20)
def test_leader_keeps_leading_after_its_lock_redis_stalls_once(  # noqa: PLR0917 - fixtures
    beat_factory: BeatFactory,
    worker_factory: WorkerFactory,
    control_app: Celery,
    redis_client: redis.Redis,
    key_prefix: str,
    private_redis: RedisServer,
) -> None:
    """Leader mode, 2 beats, the lease and the claims on a private Redis that is paused (past
    the 0.2 s socket timeout) when the leader's lease is due for renewal, until the leader
    logged that its renewal failed. The lease (30 s) outlives the stall: the leader renews it
    once Redis answers and goes on publishing, the runs due during the stall a little late;
    the standby never leads; no run is lost or published twice."""
    lock_env = {
        "SINGLETON_TEST_LOCK_URL": f"{private_redis.url}?socket_timeout=0.2",
        "SINGLETON_TEST_BEAT_MODE": "leader",
        "SINGLETON_TEST_BEAT_LEASE": f"{LONG_LEASE_S:g}",
    }
    workers = [worker_factory.start(BEAT_APP, pool="prefork", concurrency=2, env=lock_env)]
    for worker in workers:
        worker.wait_ready(control_app)
    beats = [beat_factory.start(env=lock_env) for _ in range(2)]
    ready = min(b.wait_ready() for b in beats)
    leader = wait_for_leader(beats, 10)
    standby = next(b for b in beats if b is not leader)
    became = leader_lines(leader)[0]
    # the leader renews at its first tick a third of the lease after it took it: stall then
    sleep_until(became + LONG_LEASE_S / 3 - 0.5)
    offset = leader.log_size()
    private_redis.pause()
    stalled_at = time.time()
    try:
        leader.wait_for_log(RENEWAL_FAILED, timeout=10, start=offset)
    finally:
        private_redis.resume()
    resumed_at = time.time()
    # a claim the server ran after the stall whose reply was lost is the leader's own: taken
    # again at its next try, a second later (claim.lua), not after the publish lease
    sleep_until(resumed_at + 4)
    # the leader last: it is the one publisher, so the end is its kill (killed first, the
    # standby's kill a loaded second later was taken as the end, and a slot was required)
    for beat in (standby, leader):
        beat.kill()
    end = max(b.killed_at or 0 for b in beats)
    time.sleep(DRAIN_S)

    hist = history(redis_client, key_prefix)
    logs = (
        f"lock redis paused at {stalled_at:.3f}, resumed at {resumed_at:.3f}\n"
        f"{beat_factory.logs(200)}"
    )
    assert_exactly_once(hist, beats, "the lock Redis stalled once")
    for entry, step_s in (("every-second", 1.0), ("remote-every-2s", 2.0)):
        assert_no_gaps(hist, entry, step_s=step_s, ready=ready, end=end, logs=logs)
    assert not leader_lines(standby), f"{standby.name} led beside {leader.name}\n{logs}"
    assert not standby.published(), logs
    after = leader.log_text(offset)
    assert f"{KEPT}: instance=" in after, f"the leader did not take its lease back\n{logs}"
    assert BECAME_LEADER not in after, logs


# -- banner -------------------------------------------------------------------------------------

BANNER = re.compile(r"\. singleton -> mode=(\S+) redis=(\S+) prefix=(\S+)")


def test_banner_shows_mode_redis_without_password_and_prefix(
    beat_factory: BeatFactory, redis_url: str, key_prefix: str
) -> None:
    """Beat's banner names the mode, the Redis URL (password hidden) and the key prefix."""
    plain = beat_factory.start()
    port = free_port()  # nothing listens there: the beat never talks to a server with it
    secret = beat_factory.start(
        env={"SINGLETON_TEST_LOCK_URL": f"redis://:s3cret@127.0.0.1:{port}/0"}
    )
    shown = plain.wait_for_log(BANNER.pattern)
    assert shown.groups() == ("active", redis_url, f"{key_prefix}lock:"), plain.log_tail()
    hidden = secret.wait_for_log(BANNER.pattern)
    assert hidden.groups() == (
        "active",
        f"redis://:***@127.0.0.1:{port}/0",
        f"{key_prefix}lock:",
    ), secret.log_tail()
    # the first tick logs the settings again, then fails to reach that server: still hidden
    secret.wait_for_log(r"singleton scheduler started: mode=active redis=redis://:\*\*\*@")
    secret.wait_for_log(r"beat: redis unreachable, publishing nothing until it answers")
    plain.kill()
    secret.kill()
    assert "s3cret" not in secret.log_text(), secret.log_text()
