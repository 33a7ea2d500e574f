"""The main-process skip (worker/mainskip.py) on real workers, where it must step aside.

- A key that stops being held mid-flood: the next message runs, later duplicates meet that run
  (turned away by the main process again, once the key is hot again), runs never overlap.
- What the main process leaves to Celery's handler although the key is hot: a countdown, an
  expiry, a revoked id, a rate-limited task, another policy.
- The lock Redis killed mid-flood (a private server): the probe fails, the messages go to the
  pool (requeued while Redis is down), nothing is lost, nothing stays locked, one at a time.

The contract of the skips it does make (result, signals, line, task_prerun/task_postrun) is in
test_skip_contract.py; their events and metrics in test_events.py and test_metrics.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import redis
from celery import Celery
from celery.result import AsyncResult

from celery_singleton_lock import skip_info
from celery_singleton_lock.core.connection import store_for
from celery_singleton_lock.core.keys import LockKeys, derive_keys
from tests.support.basic_app import SINGLETON_APP, history_key
from tests.support.history import Execution, assert_no_overlap, check_history, load_history
from tests.support.mainskip import reached_celery, turn_hot
from tests.support.servers import RedisServer
from tests.support.waiting import wait_for
from tests.support.workers import WorkerFactory, WorkerProcess

TIMEOUT = 30
PROBE_FAILED = "singleton: could not probe lock, duplicates go to the pool"


def _hold_signature(key: str, seconds: float = 0.0, payload: Any = None) -> None:
    """The key parameter of t.hold and t.hold_raise."""


def _keys(prefix: str, task: str, key: str) -> LockKeys:
    return derive_keys(f"{prefix}lock:", task, _hold_signature, (), {"key": key}, ("key",))


def _hold(app: Celery, key: str, seconds: float = 0.0, **options: Any) -> AsyncResult:
    return app.send_task("t.hold", kwargs={"key": key, "seconds": seconds}, **options)


def _runs(client: redis.Redis, prefix: str, key: str) -> list[Execution]:
    return [e for e in load_history(client, history_key(prefix)) if e.key == key]


def _ended(client: redis.Redis, prefix: str, key: str, runs: int) -> bool:
    """Whether ``runs`` runs of ``key`` started and every one ended."""
    done = _runs(client, prefix, key)
    return len(done) == runs and all(e.end_us is not None for e in done)


@pytest.mark.slow(seconds=10)
def test_a_key_let_go_mid_flood_runs_again_one_at_a_time(
    worker_factory: WorkerFactory,
    client_app: Celery,
    key_prefix: str,
    redis_url: str,
    redis_client: redis.Redis,
) -> None:
    """A threads worker (the pool runs two at once, so a run and its duplicates meet): a
    flood turned away by the main process, then the holder lets go. Each later wave meets a
    free lock: one run, its duplicates skipped (by a pool thread, then, hot again, by the main
    process), and no two runs at once (the history checker)."""
    keys = _keys(key_prefix, "t.hold", "mid")
    store = store_for(redis_url)
    store.acquire(keys, "the-holder", 0, 60_000)
    worker = worker_factory.start(SINGLETON_APP, pool="threads", concurrency=2)
    worker.wait_ready(client_app)
    turn_hot(client_app, worker, "t.hold", {"key": "mid", "seconds": 0.5})
    held = [_hold(client_app, "mid", 0.5) for _ in range(20)]
    assert [skip_info(r.get(timeout=TIMEOUT)).holder for r in held] == ["the-holder"] * 20
    store.release(keys.lock, "the-holder", 0)

    ran: list[str] = []
    skipped: list[tuple[str, str]] = []  # (task id, holder)
    for _wave in range(2):  # each wave meets a free lock: a run, and its duplicates
        wave = [_hold(client_app, "mid", 0.5) for _ in range(30)]
        runs_before = len(ran)
        for result in wave:
            info = skip_info(result.get(timeout=TIMEOUT))
            if info is None:
                ran.append(result.id)
            else:
                skipped.append((result.id, info.holder))
        assert len(ran) > runs_before, worker.log_tail(40)
        wait_for(lambda: _ended(redis_client, key_prefix, "mid", len(ran)), TIMEOUT, "the runs")
    assert {holder for _, holder in skipped} <= set(ran)
    # a skip of the new holder made the key hot again: its duplicates were turned away anew
    assert any(not reached_celery(worker, "t.hold", task_id) for task_id, _ in skipped)
    assert_no_overlap(check_history(_runs(redis_client, key_prefix, "mid")), allow_unfinished=False)
    assert "Traceback" not in worker.log_text()


@pytest.fixture
def hot_worker(
    worker_factory: WorkerFactory, client_app: Celery, key_prefix: str, redis_url: str
) -> WorkerProcess:
    """A threads worker whose main process turns duplicates of t.hold(key="busy") away, and
    of t.hold_raise(key="busy") would if that policy allowed it (both locks held)."""
    for task in ("t.hold", "t.hold_raise"):
        store_for(redis_url).acquire(_keys(key_prefix, task, "busy"), "the-holder", 0, 60_000)
    worker = worker_factory.start(SINGLETON_APP, pool="threads", concurrency=2)
    worker.wait_ready(client_app)
    return worker


def _left_to_celery(
    app: Celery, worker: WorkerProcess, send: Any, outcome: Any = skip_info
) -> AsyncResult:
    """Make the key hot, then send the message ``send(app)`` and a plain duplicate after it:
    the plain one is turned away by the main process, the message itself is not."""
    turn_hot(app, worker, "t.hold", {"key": "busy"})
    message, plain = send(app), _hold(app, "busy")
    plain.get(timeout=TIMEOUT)
    wait_for(message.ready, TIMEOUT, "the message", worker)
    assert not reached_celery(worker, "t.hold", plain.id)
    assert reached_celery(worker, "t.hold", message.id)
    return message


@pytest.mark.slow(seconds=8)
def test_what_the_main_process_leaves_to_celery(
    hot_worker: WorkerProcess, client_app: Celery
) -> None:
    worker = hot_worker
    # scheduled, or expiring: Celery's handler times it
    counted_down = _left_to_celery(
        client_app, worker, lambda app: _hold(app, "busy", countdown=0.1)
    )
    assert skip_info(counted_down.get(timeout=TIMEOUT)) is not None
    expiring = _left_to_celery(client_app, worker, lambda app: _hold(app, "busy", expires=60))
    assert skip_info(expiring.get(timeout=TIMEOUT)) is not None

    # revoked: Celery's handler discards it, as REVOKED
    revoked_id = "revoked-" + worker.name
    client_app.control.revoke(revoked_id, destination=[worker.nodename], reply=True, timeout=5)
    revoked = _left_to_celery(
        client_app, worker, lambda app: _hold(app, "busy", task_id=revoked_id)
    )
    assert revoked.state == "REVOKED"

    # a rate limit: every message takes its turn in Celery's bucket
    client_app.control.rate_limit(
        "t.hold", "1000/s", destination=[worker.nodename], reply=True, timeout=5
    )
    limited = [_hold(client_app, "busy") for _ in range(5)]
    assert all(skip_info(r.get(timeout=TIMEOUT)) is not None for r in limited)
    assert all(reached_celery(worker, "t.hold", r.id) for r in limited)

    # another policy: the strategy is Celery's own, every duplicate goes to the pool
    raised = [client_app.send_task("t.hold_raise", kwargs={"key": "busy"}) for _ in range(5)]
    for result in raised:
        wait_for(result.ready, TIMEOUT, "the raised duplicate", worker)
        assert result.state == "FAILURE"
        assert reached_celery(worker, "t.hold_raise", result.id)


@pytest.mark.slow(seconds=12)
def test_lock_redis_killed_mid_flood_loses_nothing_and_locks_nothing(  # noqa: PLR0917 - fixtures
    worker_factory: WorkerFactory,
    client_app: Celery,
    key_prefix: str,
    redis_client: redis.Redis,
    private_redis: RedisServer,
    forget_stores: None,
) -> None:
    """The locks on a private server: the holder's lock held there, a flood turned away by the
    main process, then the server is killed. The next message's probe fails (logged once), the
    hot key is forgotten, every message goes to the pool, which requeues it while Redis is down
    (``singleton_on_redis_error="fail"``). The server comes back empty: the requeued messages
    run one at a time, the rest are skips of those runs; no lock is left."""
    lock_client = private_redis.client(socket_timeout=10)
    store_for(private_redis.url).acquire(_keys(key_prefix, "t.hold", "k"), "the-holder", 0, 60_000)
    worker = worker_factory.start(
        SINGLETON_APP,
        pool="threads",
        concurrency=2,
        env={"SINGLETON_TEST_LOCK_URL": private_redis.url, "SINGLETON_TEST_RETRY_COUNTDOWN": "0.3"},
    )
    worker.wait_ready(client_app)
    turn_hot(client_app, worker, "t.hold", {"key": "k", "seconds": 0.2})
    before = [_hold(client_app, "k", 0.2) for _ in range(10)]
    assert all(skip_info(r.get(timeout=TIMEOUT)).holder == "the-holder" for r in before)

    private_redis.kill()
    during = [_hold(client_app, "k", 0.2) for _ in range(10)]
    wait_for(
        lambda: all(reached_celery(worker, "t.hold", r.id) for r in during),
        TIMEOUT,
        "every message sent while Redis is down to reach Celery's handler",
        worker,
    )
    assert all(not r.ready() for r in during)  # requeued: none ran, none was skipped
    private_redis.restart()  # empty: the holder's lock is gone

    values = [r.get(timeout=TIMEOUT) for r in during]
    ran = [r.id for r, v in zip(during, values, strict=True) if skip_info(v) is None]
    assert ran, worker.log_tail(60)
    assert {skip_info(v).holder for v in values if skip_info(v) is not None} <= set(ran)
    probe_failures = [line for line in worker.log_text().splitlines() if PROBE_FAILED in line]
    assert 1 <= len(probe_failures) <= 2, probe_failures
    wait_for(
        lambda: not list(lock_client.scan_iter(match="*:lock", count=1000)),
        10,
        "no lock left on the lock server",
        worker,
    )
    runs = _runs(redis_client, key_prefix, "k")
    assert len(runs) == len(ran)
    assert_no_overlap(check_history(runs), allow_unfinished=False)
    assert worker.is_running()
    log = worker.log_text()
    assert "CRITICAL" not in log
    assert "Connection to broker lost" not in log  # the probe's error is not the consumer's
