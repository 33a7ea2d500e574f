"""The contract of a skipped duplicate, on real workers of every pool, and the seams of the
worker-side tracing that ends it (task/tracer.py).

A skip is a SUCCESS whose result is the skip marker; ``duplicate_skipped`` is sent; one
``singleton: duplicate skipped`` line is logged; ``task_prerun`` and ``task_postrun`` (state
SUCCESS) fire; the body, ``on_success`` and ``task_success`` do not run; the holder's lock is
untouched; the worker reports the message as a finished task. The same contract holds for a
flood of duplicates that the worker's main process turns away itself (worker/mainskip.py).
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

import pytest
import redis
from celery import Celery
from celery.app.trace import build_tracer

from celery_singleton_lock import SingletonTask, SkipInfo, skip_info
from celery_singleton_lock.core.connection import store_for
from celery_singleton_lock.core.keys import derive_keys
from celery_singleton_lock.duplicates import fates
from celery_singleton_lock.task import tracer
from tests.support.basic_app import SINGLETON_APP
from tests.support.mainskip import reached_celery, turn_hot
from tests.support.singleton_app import signals_key
from tests.support.waiting import wait_for
from tests.support.workers import WorkerFactory, WorkerProcess


def _contract_signature(key: str, seconds: float = 0.0) -> None:
    """Same parameters as t.contract."""


def _keys(prefix: str, key: str) -> Any:
    return derive_keys(
        f"{prefix}lock:", "t.contract", _contract_signature, (), {"key": key}, ("key",)
    )


def _events(client: redis.Redis, prefix: str, task_id: str) -> list[str]:
    raw = [item.decode() for item in client.lrange(signals_key(prefix), 0, -1)]
    return [e.replace(f" {task_id}", "") for e in raw if f" {task_id}" in e]


def _events_until_postrun(
    client: redis.Redis, prefix: str, task_id: str, worker: WorkerProcess
) -> list[str]:
    """The run's events up to task_postrun, once it was logged (it comes after the result is
    stored). A run's ``lock_released`` may come after it (the release's reply is read later)."""

    def until_postrun() -> list[str] | None:
        events = _events(client, prefix, task_id)
        ends = [i for i, event in enumerate(events) if event.startswith("task_postrun")]
        return events[: ends[0] + 1] if ends else None

    return wait_for(until_postrun, 10, "task_postrun", worker)


@pytest.mark.slow(seconds=8)
@pytest.mark.parametrize("pool", ["solo", "threads", "prefork"])
def test_skip_contract_in_every_pool(  # noqa: PLR0917 - fixtures
    pool: str,
    worker_factory: WorkerFactory,
    client_app: Celery,
    key_prefix: str,
    redis_url: str,
    redis_client: redis.Redis,
) -> None:
    keys = _keys(key_prefix, "contract")
    store = store_for(redis_url)
    store.acquire(keys, "the-holder", 0, 60_000)
    held_before = store.holder(keys.lock)
    worker = worker_factory.start(SINGLETON_APP, pool=pool, concurrency=2, extra_args=["-E"])
    worker.wait_ready(client_app)

    duplicate = client_app.send_task("t.contract", kwargs={"key": "contract"})
    value = duplicate.get(timeout=20)

    assert duplicate.state == "SUCCESS"
    assert skip_info(duplicate) == SkipInfo(keys.lock, "the-holder", duplicate.id)
    assert skip_info(value) == skip_info(duplicate)
    assert store.holder(keys.lock) == held_before  # untouched: owner, token, ttl field
    events = _events_until_postrun(redis_client, key_prefix, duplicate.id, worker)
    # in this order; no body, no on_success, no task_success
    assert events == ["task_prerun", "duplicate_skipped", "task_postrun SUCCESS"], events
    log = worker.log_text()
    assert log.count("singleton: duplicate skipped") == 1
    assert f"t.contract[{duplicate.id}] key={keys.lock} holder=the-holder" in log
    assert "Traceback" not in log

    # and once the holder is gone, the same call runs: nothing was left behind
    store.release(keys.lock, "the-holder", 0)
    again = client_app.send_task("t.contract", kwargs={"key": "contract"})
    assert skip_info(again.get(timeout=20)) is None
    assert _events_until_postrun(redis_client, key_prefix, again.id, worker) == [
        "task_prerun",
        "lock_acquired",
        "body",
        "on_success",
        "task_success",
        "task_postrun SUCCESS",
    ]


#: duplicates in the flood turned away by the main process
FLOOD = 30


@pytest.mark.slow(seconds=8)
@pytest.mark.parametrize("pool", ["solo", "threads"])
def test_a_flood_turned_away_by_the_main_process_keeps_the_contract(  # noqa: PLR0917 - fixtures
    pool: str,
    worker_factory: WorkerFactory,
    client_app: Celery,
    key_prefix: str,
    redis_url: str,
    redis_client: redis.Redis,
) -> None:
    """Once a skip in the executing process made the key hot, the worker's main process turns
    each duplicate away itself (no "received" line: no Request, no pool), with the same
    contract; task_prerun and task_postrun fire there. Once the holder lets go, the next call
    runs as before."""
    keys = _keys(key_prefix, "flood")
    store = store_for(redis_url)
    store.acquire(keys, "the-holder", 0, 60_000)
    held_before = store.holder(keys.lock)
    worker = worker_factory.start(SINGLETON_APP, pool=pool, concurrency=2)
    worker.wait_ready(client_app)
    warm_up = turn_hot(client_app, worker, "t.contract", {"key": "flood"})

    flood = [client_app.send_task("t.contract", kwargs={"key": "flood"}) for _ in range(FLOOD)]
    for duplicate in flood:
        info = skip_info(duplicate.get(timeout=20))
        assert duplicate.state == "SUCCESS"
        assert info == SkipInfo(keys.lock, "the-holder", duplicate.id)
    assert not [d.id for d in flood if reached_celery(worker, "t.contract", d.id)]
    for duplicate in warm_up + flood:
        events = _events_until_postrun(redis_client, key_prefix, duplicate.id, worker)
        assert events == ["task_prerun", "duplicate_skipped", "task_postrun SUCCESS"], events
    lines = [line for line in worker.log_text().splitlines() if "duplicate skipped" in line]
    assert len(lines) == len(warm_up) + FLOOD
    for duplicate in flood:
        (line,) = [line for line in lines if f"t.contract[{duplicate.id}] key=" in line]
        assert line.endswith(f"key={keys.lock} holder=the-holder")
        assert "/MainProcess]" in line
    assert store.holder(keys.lock) == held_before
    assert "Traceback" not in worker.log_text()

    store.release(keys.lock, "the-holder", 0)
    again = client_app.send_task("t.contract", kwargs={"key": "flood"})
    assert skip_info(again.get(timeout=20)) is None
    assert _events_until_postrun(redis_client, key_prefix, again.id, worker)[1:3] == [
        "lock_acquired",
        "body",
    ]


@pytest.mark.slow(seconds=6)
def test_under_prefork_the_children_skip_every_duplicate(
    worker_factory: WorkerFactory,
    client_app: Celery,
    key_prefix: str,
    redis_url: str,
    redis_client: redis.Redis,
) -> None:
    """Under prefork the main process never turns a duplicate away (worker/mainskip.py,
    MAIN_PROCESS_POOLS): every duplicate of a held key reaches Celery's handler and is skipped
    by a pool child, with the same contract."""
    keys = _keys(key_prefix, "prefork-flood")
    store = store_for(redis_url)
    store.acquire(keys, "the-holder", 0, 60_000)
    worker = worker_factory.start(SINGLETON_APP, pool="prefork", concurrency=2)
    worker.wait_ready(client_app)
    kwargs = {"key": "prefork-flood"}
    flood = [client_app.send_task("t.contract", kwargs=kwargs) for _ in range(FLOOD)]
    for duplicate in flood:
        assert skip_info(duplicate.get(timeout=20)) == SkipInfo(
            keys.lock, "the-holder", duplicate.id
        )
        assert reached_celery(worker, "t.contract", duplicate.id)
        events = _events_until_postrun(redis_client, key_prefix, duplicate.id, worker)
        assert events == ["task_prerun", "duplicate_skipped", "task_postrun SUCCESS"], events
    lines = [line for line in worker.log_text().splitlines() if "duplicate skipped" in line]
    assert len(lines) == FLOOD
    assert not [line for line in lines if "/MainProcess]" in line]
    store.release(keys.lock, "the-holder", 0)


@pytest.fixture
def traced_app(client_app: Celery, redis_url: str, key_prefix: str) -> Any:
    """t.contract in this process, on an app whose results and locks are under key_prefix."""
    client_app.conf.singleton_redis_url = redis_url
    client_app.conf.singleton_key_prefix = f"{key_prefix}lock:"

    @client_app.task(
        bind=True, base=SingletonTask, name="t.contract", singleton_key_args=("key",), shared=False
    )
    def contract(self: Any, key: str, seconds: float = 0.0) -> str:
        return "ran"

    return contract


def test_lock_taken_for_a_run_celery_never_started_is_released(
    traced_app: Any, key_prefix: str, redis_url: str
) -> None:
    """Celery's tracer can return before before_start (a redelivered message it already saw
    succeed, a bad message): the lock taken for it in front of the tracer is released."""
    task = traced_app
    task.__trace__ = lambda uuid, args, kwargs, request: "returned early"
    task_id = uuid.uuid4().hex
    reply = task.__trace__(task_id, (), {"key": "early"}, {"id": task_id})
    assert reply == "returned early"
    assert store_for(redis_url).holder(_keys(key_prefix, "early").lock) == {}


@pytest.mark.filterwarnings(
    "ignore:Call to deprecated setex:DeprecationWarning"
)  # Celery's backend
def test_skip_whose_result_cannot_be_stored_is_left_to_celery(
    traced_app: Any,
    key_prefix: str,
    redis_url: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """When storing the skip's result fails, Celery's own tracer ends the message (it records
    the failure its way); the duplicate still never runs its body."""
    task = traced_app
    keys = _keys(key_prefix, "store-fails")
    store_for(redis_url).acquire(keys, "the-holder", 0, 60_000)
    calls: list[str] = []

    def failing_store(*args: Any, **kwargs: Any) -> Any:
        calls.append("store")
        raise redis.ConnectionError("result backend down")

    monkeypatch.setattr(tracer, "store_skip", failing_store)  # in front of the tracer
    monkeypatch.setattr(fates, "store_skip", failing_store)  # in before_start
    task.__trace__ = build_tracer(task.name, task, app=task.app, eager=False)
    task_id = uuid.uuid4().hex
    with caplog.at_level(logging.WARNING, logger="celery_singleton_lock.task"):
        result = task.__trace__(task_id, (), {"key": "store-fails"}, {"id": task_id})
    assert calls == ["store", "store"]  # once in front of the tracer, once in before_start
    assert result.info is not None
    assert result.info.state == "FAILURE"
    assert "singleton: could not end skipped duplicate, handing it to celery" in caplog.text
    assert store_for(redis_url).holder(keys.lock)["owner"] == "the-holder"
