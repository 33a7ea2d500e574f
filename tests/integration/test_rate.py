"""singleton_rate_limit: at most N runs of a key start within any window of a period, across
the whole cluster (two worker processes here, sharing one queue), each policy over the rate;
singleton_permits="unlimited" (the rate alone, runs overlap); every store kind a worker starts on.

The workers are shared by the module's tests (each test its own tenants). Start times are the
history's (tests/support/history.py: the Redis server's clock, taken in the body right after the
acquire): a window check allows :data:`SLACK_MS` for that gap.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from celery import Celery

from celery_singleton_lock import (
    DuplicateTaskError,
    RateLimitedError,
    SingletonConfigError,
    SingletonTask,
    skip_info,
)
from celery_singleton_lock.beat.claims import CLAIM_HEADER, KEEP_HEADER, RUN_HEADER
from celery_singleton_lock.core.backend import Acquired, RateLimited
from celery_singleton_lock.core.connection import store_for
from celery_singleton_lock.core.keys import lock_keys
from celery_singleton_lock.core.rates import starts
from celery_singleton_lock.settings.options import read_options
from tests.support.basic_app import SINGLETON_APP, close_app, history_key, make_app
from tests.support.history import Execution, load_history
from tests.support.waiting import wait_for
from tests.support.workers import WorkerFactory, WorkerProcess

#: how much later than its acquire a run records its start (a round trip, a busy CPU)
SLACK_MS = 60


@pytest.fixture(scope="module")
def two_workers(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, module_prefix: str
) -> Iterator[tuple[Celery, list[WorkerProcess]]]:
    """Two worker processes of two pool processes each on one queue, and a client app."""
    factory = WorkerFactory(
        Path(tmp_path_factory.mktemp("rate")),
        base_env={"SINGLETON_TEST_REDIS_URL": redis_url, "SINGLETON_TEST_PREFIX": module_prefix},
    )
    app = make_app(redis_url, module_prefix)
    try:
        workers = [factory.start(SINGLETON_APP, pool="prefork", concurrency=2) for _ in range(2)]
        for worker in workers:
            worker.wait_ready(app)
        yield app, workers
    finally:
        close_app(app)
        factory.close()


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    made = redis.Redis.from_url(redis_url)
    yield made
    made.close()


def _starts(client: redis.Redis, prefix: str, task: str, tenant: str) -> list[Execution]:
    key = f"rate:{task}:{tenant}"
    return sorted(
        (e for e in load_history(client, history_key(prefix)) if e.key == key),
        key=lambda e: e.start_us,
    )


def _assert_within_rate(starts: list[Execution], limit: int, period_ms: int) -> None:
    """No window of the period holds more than ``limit`` starts (less the slack)."""
    times = [e.start_us / 1000 for e in starts]  # server time, ms
    for first, last in zip(times, times[limit:], strict=False):
        assert last - first >= period_ms - SLACK_MS, [round(t - times[0]) for t in times]


def _tenant() -> str:
    return uuid.uuid4().hex[:8]


@pytest.mark.slow(seconds=6)
def test_a_flood_across_two_workers_starts_at_most_n_per_window(
    two_workers: tuple[Celery, list[WorkerProcess]], client: redis.Redis, module_prefix: str
) -> None:
    """40 calls of one tenant in 4 bursts over 1.5 s, rate 4/s, skip: at most 4 starts in any
    second, by both workers; every other call ends skipped saying the rate and when the next
    start is allowed (within a second); another tenant has a rate of its own."""
    app, workers = two_workers
    tenant, other = _tenant(), _tenant()
    began = time.time()
    sent = []
    for _ in range(4):
        sent += [app.send_task("t.rate_skip", (tenant,)) for _ in range(10)]
        time.sleep(0.5)
    beside = app.send_task("t.rate_skip", (other,))
    values = [result.get(timeout=30) for result in sent]
    now = time.time()
    skipped = [skip_info(value) for value in values if skip_info(value) is not None]
    ran = [value for value in values if skip_info(value) is None]
    starts = _starts(client, module_prefix, "t.rate_skip", tenant)
    assert len(starts) == len(ran)
    assert len(ran) >= 4
    _assert_within_rate(starts, 4, 1000)
    assert {info.reason for info in skipped} == {"rate"}
    for info in skipped:
        assert info.next_start is not None
        assert began < info.next_start < now + 1.1
        assert info.follow_up is None
    assert skip_info(beside.get(timeout=30)) is None
    # ended in front of Celery's tracer, as a duplicate's skip: a run that succeeded, never an
    # Ignore raised from before_start
    logs = "".join(w.log_text() for w in workers)
    assert not re.search(r"Task t\.rate_skip\[\S+\] ignored", logs)
    assert logs.count("singleton: over the rate limit, skipped: t.rate_skip[") >= len(skipped)


def test_beat_messages_are_limited_like_any_other(
    two_workers: tuple[Celery, list[WorkerProcess]], client: redis.Redis, module_prefix: str
) -> None:
    """Four runs of a beat entry (each message with the headers SingletonScheduler gives a run
    of its own), rate 3/m: three start, the fourth is skipped for the rate."""
    app, _ = two_workers
    tenant = _tenant()
    sent = []
    for index in range(4):
        claim = f"{module_prefix}claim:{uuid.uuid4().hex}"
        headers = {RUN_HEADER: f"entry@{index}", CLAIM_HEADER: claim, KEEP_HEADER: 60_000}
        sent.append(app.send_task("t.rate_alone", (tenant,), headers=headers))
        sent[-1].get(timeout=30)
    infos = [skip_info(result.get(timeout=30)) for result in sent]
    assert [info is None for info in infos] == [True, True, True, False]
    assert infos[3] is not None
    assert infos[3].reason == "rate"
    assert len(_starts(client, module_prefix, "t.rate_alone", tenant)) == 3


def test_a_chain_step_over_the_rate_stops_its_chain(
    two_workers: tuple[Celery, list[WorkerProcess]], client: redis.Redis, module_prefix: str
) -> None:
    """1/m spent by one call; then a chain whose first step is over the rate: it is skipped
    (reason rate) and the step after it never runs, its result the same marker."""
    app, _ = two_workers
    tenant, after = _tenant(), _tenant()
    assert skip_info(app.send_task("t.rate_minute", (tenant,)).get(timeout=30)) is None
    step = app.signature("t.rate_minute", (tenant,), immutable=True)
    last = (step | app.signature("t.rate_minute", (after,), immutable=True)).apply_async()
    info = skip_info(last.get(timeout=30))
    assert info is not None
    assert info.reason == "rate"
    assert info.task_id == last.parent.id
    assert not _starts(client, module_prefix, "t.rate_minute", after)


@pytest.mark.slow(seconds=6)
def test_every_call_under_retry_runs_at_most_n_per_window(
    two_workers: tuple[Celery, list[WorkerProcess]], client: redis.Redis, module_prefix: str
) -> None:
    """10 calls at once under "retry", rate 4/s: every one runs, once, 4 a second: requeued to
    the moment the oldest start leaves the window (not polled: a few requeues each at most)."""
    app, workers = two_workers
    tenant = _tenant()
    began = time.monotonic()
    sent = [app.send_task("t.rate_retry", (tenant,)) for _ in range(10)]
    values = [result.get(timeout=60) for result in sent]
    took = time.monotonic() - began
    assert all(skip_info(value) is None for value in values)
    starts = _starts(client, module_prefix, "t.rate_retry", tenant)
    assert len(starts) == 10
    _assert_within_rate(starts, 4, 1000)
    assert took > 1.8, took  # the 9th and 10th start 2 s after the first
    retried = sum(
        w.log_text().count("over the rate limit, retried in") for w in workers
    )  # every test's retries, this one's most
    assert retried < 80, retried


@pytest.mark.slow(seconds=4)
def test_without_a_concurrency_limit_runs_overlap_under_the_rate(
    two_workers: tuple[Celery, list[WorkerProcess]], client: redis.Redis, module_prefix: str
) -> None:
    """singleton_permits="unlimited" with 3/m: four calls at once (four pool processes) of runs of
    2 s: three run at the same time (no lock between them, no fencing token), one ends
    skipped for the rate."""
    app, _ = two_workers
    tenant = _tenant()
    sent = [app.send_task("t.rate_alone", (tenant,), {"seconds": 2.0}) for _ in range(4)]
    values = [result.get(timeout=30) for result in sent]
    ran = [value for value in values if skip_info(value) is None]
    assert len(ran) == 3
    assert all(value["token"] is None for value in ran)
    assert [skip_info(v).reason for v in values if skip_info(v) is not None] == ["rate"]
    starts = _starts(client, module_prefix, "t.rate_alone", tenant)
    assert max(e.start_us for e in starts) < min(e.end_us for e in starts)  # all three at once


@pytest.mark.slow(seconds=3)
def test_a_retry_of_its_own_waits_for_the_rate_whatever_the_policy(
    two_workers: tuple[Celery, list[WorkerProcess]], client: redis.Redis, module_prefix: str
) -> None:
    """2/s, "skip": two calls start and fail, autoretry_for retries each at once; the retries
    are over the rate but not dropped: they run when the window lets them (max_retries 1 is
    not spent on the wait)."""
    app, _ = two_workers
    tenant = _tenant()
    sent = [app.send_task("t.rate_autoretry", (tenant,)) for _ in range(2)]
    values = [result.get(timeout=30) for result in sent]
    assert all(skip_info(value) is None for value in values)
    starts = _starts(client, module_prefix, "t.rate_autoretry", tenant)
    assert len(starts) == 4
    _assert_within_rate(starts, 2, 1000)


def test_raise_fails_with_rate_limited_error(
    two_workers: tuple[Celery, list[WorkerProcess]],
) -> None:
    """2/m under "raise": the third call fails with RateLimitedError naming the wait."""
    app, _ = two_workers
    tenant = _tenant()

    def start() -> bool:  # a run's result is stored just before its lock is released: a call
        # right after may meet the lock (DuplicateTaskError, not a start), and is sent again
        return skip_info(app.send_task("t.rate_raise", (tenant,)).get(timeout=30)) is None

    for _ in range(2):  # one after the other: one permit, and a run holds it
        wait_for(start, 30, "a start", ignore=(DuplicateTaskError,))
    third = app.send_task("t.rate_raise", (tenant,))
    with pytest.raises(RateLimitedError, match=r"over the rate limit 2/m .*next start is allowed"):
        third.get(timeout=30)


@pytest.mark.slow(seconds=4)
def test_coalesce_gives_one_follow_up_at_the_next_allowed_start(
    two_workers: tuple[Celery, list[WorkerProcess]], client: redis.Redis, module_prefix: str
) -> None:
    """2/s under "coalesce": of eight calls at once two start, the first call over the rate is
    requeued to the next allowed moment and runs then, the five others end skipped naming it."""
    app, _ = two_workers
    tenant = _tenant()
    sent = [app.send_task("t.rate_coalesce", (tenant,)) for _ in range(8)]
    values = {result.id: result.get(timeout=30) for result in sent}
    skipped = [skip_info(v) for v in values.values() if skip_info(v) is not None]
    ran = [task_id for task_id, v in values.items() if skip_info(v) is None]
    assert len(ran) >= 3, values  # 3 when the eight are handled within the first second
    assert skipped
    assert {info.reason for info in skipped} == {"rate"}
    follow_ups = {info.follow_up for info in skipped}
    assert follow_ups <= set(ran)  # each a call over the rate that ran at its moment
    assert len(follow_ups) <= len(ran) - 2
    starts = _starts(client, module_prefix, "t.rate_coalesce", tenant)
    _assert_within_rate(starts, 2, 1000)


@pytest.mark.slow(seconds=4)
def test_join_joins_a_running_run_else_waits_for_the_rate(
    two_workers: tuple[Celery, list[WorkerProcess]], client: redis.Redis, module_prefix: str
) -> None:
    """1/s under "join" (one permit): a call while the first run goes on joins it (its value,
    no start of its own); of two calls one after the other, the second finds the key free but
    the rate spent: it waits like retry, and starts a second after the other."""
    app, workers = two_workers
    tenant = _tenant()
    go = f"{module_prefix}rate-join-go:{tenant}"
    first = app.send_task("t.rate_join", (tenant,), {"until": go})
    wait_for(lambda: _starts(client, module_prefix, "t.rate_join", tenant), 10, "the first run")
    joined = app.send_task("t.rate_join", (tenant,))
    wait_for(
        lambda: any(f"duplicate joined: t.rate_join[{joined.id}]" in w.log_text() for w in workers),
        10,
        "the second call joined the first",
    )
    client.rpush(go, "go")
    value = first.get(timeout=30)
    assert joined.get(timeout=30) == value
    # its result is stored before its lock is released: a call in between would join it
    wait_for(
        lambda: not any(client.scan_iter(f"{module_prefix}*{{t.rate_join:*}}:lock")),
        10,
        "the first run's lock released",
        *workers,
    )
    again = app.send_task("t.rate_join", (tenant,)).get(timeout=30)
    later = app.send_task("t.rate_join", (tenant,)).get(timeout=30)  # within 1 s of again's
    assert skip_info(again) is None
    assert skip_info(later) is None
    starts = _starts(client, module_prefix, "t.rate_join", tenant)
    assert len(starts) == 3
    _assert_within_rate(starts, 1, 1000)


def test_eager_calls_over_the_rate(redis_url: str, module_prefix: str) -> None:
    """apply() over the rate: "skip" ends with the marker (reason rate, the next start), and
    "retry", which cannot requeue an eager call, raises RateLimitedError."""
    app = Celery("eager-rate", broker="memory://", set_as_current=False)
    app.conf.update(
        task_always_eager=True,
        singleton_redis_url=redis_url,
        singleton_key_prefix=module_prefix + "eager:",
        singleton_rate_limit="1/m",  # the app-wide setting
    )

    @app.task(base=SingletonTask, name="e.rate", shared=False)
    def skip(tenant: str) -> str:
        return tenant

    @app.task(base=SingletonTask, name="e.rate_retry", shared=False, singleton_on_duplicate="retry")
    def retry(tenant: str) -> str:
        return tenant

    try:
        tenant = _tenant()
        assert skip.apply((tenant,)).get() == tenant
        info = skip_info(skip.apply((tenant,)).get())
        assert info is not None
        assert info.reason == "rate"
        assert info.next_start is not None
        assert time.time() + 50 < info.next_start <= time.time() + 61
        assert retry.apply((tenant,)).get() == tenant
        with pytest.raises(RateLimitedError):
            retry.apply((tenant,)).get()
    finally:
        app.close()


@pytest.mark.usefixtures("forget_stores")
@pytest.mark.parametrize("store", ["sentinel", "cluster"])
def test_the_rate_holds_on_sentinel_and_cluster(lock_urls: dict[str, str], store: str) -> None:
    """A Sentinel's master and a Cluster count a key's starts in its slot: 3/s lets three
    through and refuses the fourth, with the wait; one permit or none."""
    backend = store_for(lock_urls[store])
    for permits in (1, 0):
        keys = lock_keys("cslt:rate:", "t.stores", _tenant().encode()).with_rate((3, 1000))
        keys = keys.with_permits(permits)
        outcomes = []
        for n in range(4):
            outcome = backend.acquire(keys, f"o{n}", 0, 5000)
            outcomes.append(outcome)
            if permits and isinstance(outcome, Acquired):
                backend.release(keys.lock, f"o{n}", 0)
        assert [type(o) for o in outcomes] == [Acquired] * 3 + [RateLimited], outcomes
        assert 0 < outcomes[-1].pttl_ms <= 1000


@pytest.mark.slow(seconds=5)
@pytest.mark.usefixtures("forget_stores")
@pytest.mark.parametrize("store", ["sentinel", "cluster"])
def test_a_worker_counts_the_rate_on_sentinel_and_cluster(  # noqa: PLR0917 - fixtures
    worker_factory: WorkerFactory,
    client_app: Celery,
    redis_client: redis.Redis,
    key_prefix: str,
    lock_urls: dict[str, str],
    store: str,
) -> None:
    """A worker whose locks are on a Sentinel's master or a Cluster: 1/m lets the first of
    three calls start, the two after it end skipped for the rate; the record is in the store."""
    env = {"SINGLETON_TEST_LOCK_URL": lock_urls[store]}
    worker = worker_factory.start(SINGLETON_APP, pool="prefork", concurrency=2, env=env)
    worker.wait_ready(client_app)
    tenant = _tenant()
    values = [client_app.send_task("t.rate_minute", (tenant,)).get(timeout=30) for _ in range(3)]
    assert skip_info(values[0]) is None
    assert [skip_info(v).reason for v in values[1:] if skip_info(v)] == ["rate", "rate"]
    assert len(_starts(redis_client, key_prefix, "t.rate_minute", tenant)) == 1
    key = skip_info(values[1]).key
    assert len(starts(store_for(lock_urls[store]).client, key)) == 1


def test_redlock_is_refused_at_worker_start() -> None:
    """A rate over Redlock masters: SingletonConfigError when the options are read."""
    conf = {
        "singleton_redis_url": "redis+redlock://127.0.0.1:1,127.0.0.1:2,127.0.0.1:3/0",
        "singleton_rate_limit": "5/s",
    }
    with pytest.raises(SingletonConfigError, match="singleton_rate_limit is not supported"):
        read_options(conf)
