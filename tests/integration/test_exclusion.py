"""Mutual exclusion proven from a recorded history: across real workers of every pool type, and
for the bare lock under a race of 100 processes."""

from __future__ import annotations

import multiprocessing
import os
import random
import time
from collections import Counter
from typing import Any

import pytest
import redis
from celery import Celery

from celery_singleton_lock.core.backend import Acquired, ReleaseStatus
from celery_singleton_lock.core.keys import lock_keys
from celery_singleton_lock.core.store import LockStore
from tests.support.basic_app import SINGLETON_APP, history_key
from tests.support.history import (
    assert_no_overlap,
    check_history,
    load_history,
    record_end,
    record_start,
)
from tests.support.workers import WorkerFactory

# -- through Celery -------------------------------------------------------------------------


@pytest.mark.slow(seconds=24)
def test_exclusion_across_prefork_threads_and_solo_workers(
    worker_factory: WorkerFactory,
    client_app: Celery,
    redis_client: redis.Redis,
    key_prefix: str,
) -> None:
    """48 retry-policy runs over 4 keys on 4 workers: no overlap, tokens rise, each ran once.

    The lock ttl is 1 s and every run lasts 1.3 to 2.0 s, so only renewal keeps them apart.
    """
    env = {"SINGLETON_TEST_TTL": "1"}
    workers = [
        worker_factory.start(SINGLETON_APP, pool="prefork", concurrency=3, env=env),
        worker_factory.start(SINGLETON_APP, pool="prefork", concurrency=2, env=env),
        worker_factory.start(SINGLETON_APP, pool="threads", concurrency=3, env=env),
        worker_factory.start(SINGLETON_APP, pool="solo", concurrency=1, env=env),
    ]
    for worker in workers:
        worker.wait_ready(client_app)

    rng = random.Random(20240611)
    keys = [f"k{i}" for i in range(4)]
    results = []
    for burst in range(6):  # 6 bursts of 8: two runs per key each
        if burst:
            time.sleep(2.0)
        for key in keys * 2:
            seconds = round(rng.uniform(1.3, 2.0), 3)
            results.append(
                client_app.send_task("t.hold_retry", kwargs={"key": key, "seconds": seconds})
            )
    assert len(results) == 48

    deadline = time.monotonic() + 90
    values: list[dict[str, Any]] = []
    try:
        for result in results:
            values.append(result.get(timeout=max(1.0, deadline - time.monotonic())))
    except Exception:
        print(worker_factory.logs())
        raise

    executions = load_history(redis_client, history_key(key_prefix))
    report = check_history(executions)
    assert_no_overlap(report, allow_unfinished=False)

    # every task ran exactly once, and held its lock throughout
    assert len(report.finished()) == 48
    assert Counter(e.key for e in executions) == dict.fromkeys(keys, 12)
    assert all(value["lost"] is False for value in values), values
    assert sorted(value["token"] for value in values) == sorted(e.token for e in executions)
    assert len({value["token"] for value in values}) == 48
    assert all(result.state == "SUCCESS" for result in results)

    # tokens strictly increase per key in start order (also checked by assert_no_overlap)
    for key in keys:
        tokens = [e.token for e in executions if e.key == key]
        assert tokens == sorted(tokens)
        assert len(set(tokens)) == len(tokens)

    # the runs really competed, and every pool type took part
    logs = worker_factory.logs()
    assert "singleton: duplicate retried" in logs
    assert "singleton: lock lost" not in logs
    ran_on = Counter(e.worker for e in executions)
    assert set(ran_on) == {w.nodename for w in workers}, ran_on


# -- the bare lock --------------------------------------------------------------------------

RACE_PROCESSES = 100
RACE_ROUNDS = 5
RACE_TASK = "tests.race"
RACE_IDENTITY = b"one key for everybody"


def _race_worker(  # noqa: PLR0917 - a multiprocessing target
    url: str, prefix: str, hkey: str, index: int, start: Any, errors: Any
) -> None:
    """Take the one lock RACE_ROUNDS times, each time holding it for ~5 ms."""
    client = redis.Redis.from_url(url)
    store = LockStore(client)
    keys = lock_keys(prefix, RACE_TASK, RACE_IDENTITY)
    rng = random.Random(index)
    start.wait()
    try:
        for n in range(RACE_ROUNDS):
            owner = f"p{index}-{n}"
            while True:
                outcome = store.acquire(keys, owner=owner, generation=0, ttl_ms=2000)
                if isinstance(outcome, Acquired):
                    break
                client.incr(f"{prefix}race-contended")
                time.sleep(rng.uniform(0.01, 0.05))
            exec_id = record_start(client, hkey, keys.lock, outcome.token, owner, os.getpid())
            time.sleep(0.005)
            record_end(client, hkey, exec_id)
            status = store.release(keys.lock, owner, 0)
            if status is not ReleaseStatus.RELEASED:
                errors.put(f"{owner}: release found {status!r}")
    except Exception as exc:  # reported to the test, not lost in a child's stderr
        errors.put(f"p{index}: {type(exc).__name__}: {exc}")
        raise
    finally:
        client.close()


# the racers only use what they create after the fork: a threaded parent is harmless here
@pytest.mark.filterwarnings("ignore:.*fork.*:DeprecationWarning")
def test_lock_race_between_100_processes(
    redis_url: str, redis_client: redis.Redis, key_prefix: str
) -> None:
    """100 processes each take one key 5 times: 500 runs, none overlapping, tokens rising."""
    ctx = multiprocessing.get_context("fork")
    hkey = f"{key_prefix}race-history"
    start = ctx.Event()
    errors = ctx.Queue()
    processes = [
        ctx.Process(
            target=_race_worker,
            args=(redis_url, key_prefix, hkey, i, start, errors),
            daemon=True,
        )
        for i in range(RACE_PROCESSES)
    ]
    for process in processes:
        process.start()
    try:
        start.set()
        deadline = time.monotonic() + 120
        for process in processes:
            process.join(max(0.1, deadline - time.monotonic()))
        still_running = [p.pid for p in processes if p.is_alive()]
        assert not still_running, f"{len(still_running)} racers did not finish"
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join(5)

    problems = []
    while not errors.empty():
        problems.append(errors.get_nowait())
    assert not problems, problems
    assert [p.exitcode for p in processes] == [0] * RACE_PROCESSES

    executions = load_history(redis_client, hkey)
    report = check_history(executions)
    assert_no_overlap(report, allow_unfinished=False)
    assert len(report.finished()) == RACE_PROCESSES * RACE_ROUNDS
    owners = Counter(e.worker.split("-")[0] for e in executions)
    assert owners == {f"p{i}": RACE_ROUNDS for i in range(RACE_PROCESSES)}
    tokens = [e.token for e in executions]
    assert all(isinstance(t, int) for t in tokens)
    assert len(set(tokens)) == len(tokens)
    assert tokens == sorted(tokens)
    # the racers really contended (each run waited for others many times)
    assert int(redis_client.get(f"{key_prefix}race-contended") or 0) > RACE_PROCESSES
    # the lock is free again
    assert not redis_client.exists(lock_keys(key_prefix, RACE_TASK, RACE_IDENTITY).lock)
