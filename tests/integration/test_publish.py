"""Publish-time dedup (``singleton_lock_on="publish"``): a duplicate ``delay()`` returns the
holder's AsyncResult; the queued marker never outlives its message for long."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from celery import Celery, group
from celery.result import AsyncResult
from kombu.exceptions import EncodeError

from celery_singleton_lock import DuplicateTaskError, signals, skip_info
from celery_singleton_lock.core.connection import store_for
from celery_singleton_lock.core.keys import derive_keys, queued_key
from celery_singleton_lock.publish import dedup as publish
from celery_singleton_lock.publish.dedup import marker_ttl_ms
from tests.support.basic_app import SINGLETON_APP, close_app, history_key
from tests.support.client_tasks import publish_client_app
from tests.support.history import load_history
from tests.support.waiting import wait_for
from tests.support.workers import WorkerFactory, WorkerProcess


def _signature(key: str, seconds: float = 0.0, retries: int = 0) -> None:
    """Same parameters as t.publish_hold."""


@pytest.fixture
def make_client(redis_url: str, key_prefix: str) -> Iterator[Callable[..., tuple[Celery, Any]]]:
    """Builds client apps with t.publish_hold (task options as keywords); purged and closed
    after the test, once no AsyncResult of the test is left."""
    apps: list[Celery] = []

    def make(**options: Any) -> tuple[Celery, Any]:
        app, task = publish_client_app(redis_url, key_prefix, **options)
        apps.append(app)
        return app, task

    yield make
    for app in apps:
        app.control.purge()
        close_app(app)


@pytest.fixture
def client(make_client: Callable[..., tuple[Celery, Any]]) -> tuple[Celery, Any]:
    """The client app and its t.publish_hold (marker ttl 60 s)."""
    return make_client(singleton_publish_ttl=60)


def _marker(prefix: str, key: str) -> str:
    lock = derive_keys(f"{prefix}lock:", "t.publish_hold", _signature, (), {"key": key}, ("key",))
    return queued_key(lock.lock)


def _new_holder(
    task: Any, old: AsyncResult, key: str, timeout: float, worker: WorkerProcess | None = None
) -> Any:
    """Call ``task.delay(key)`` until it publishes a new message (not ``old``); return it."""

    def published() -> AsyncResult | None:
        result = task.delay(key)
        return result if result.id != old.id else None

    return wait_for(published, timeout, f"a new message for {key!r}", worker)


@pytest.mark.slow(seconds=6)
def test_duplicate_delay_returns_the_holder_until_the_run_is_over(
    worker_factory: WorkerFactory,
    client: tuple[Celery, Any],
    redis_client: redis.Redis,
    key_prefix: str,
) -> None:
    """Queued or running, the holder's id comes back; after the run a new call runs; a
    retrying run is not its own duplicate; revoked and expired messages free their key."""
    app, task = client
    worker: WorkerProcess = worker_factory.start(SINGLETON_APP, pool="prefork", concurrency=2)
    worker.wait_ready(app)
    events: list[tuple[str, str]] = []

    def on_dedup(sender: Any = None, holder: str = "", state: str = "", **_: Any) -> None:
        events.append((holder, state))

    signals.duplicate_not_published.connect(on_dedup, weak=False)
    try:
        first = task.delay("a", 2.5)
        assert task.delay("a", 2.5).id == first.id  # queued, or already running
        wait_for(
            lambda: load_history(redis_client, history_key(key_prefix)), 20, "the run to start"
        )
        assert task.delay("a").id == first.id  # running
        assert first.get(timeout=20)["token"] > 0
        second = _new_holder(task, first, "a", 10, worker)
        assert skip_info(second.get(timeout=20)) is None
        assert len(load_history(redis_client, history_key(key_prefix))) == 2
        assert events
        assert {holder for holder, _ in events} == {first.id}

        # a run that retries itself republishes its own message: not a duplicate
        retried = task.delay("r", 0, 1)
        assert retried.get(timeout=20)["retries"] == 1

        # revoked before it ran: the worker discards it at its eta and drops the marker
        revoked = task.apply_async(("b",), countdown=2)
        assert task.delay("b").id == revoked.id
        revoked.revoke()
        wait_for(lambda: not redis_client.exists(_marker(key_prefix, "b")), 15, "revoke", worker)
        assert revoked.state == "REVOKED"
        fresh = _new_holder(task, revoked, "b", 10, worker)
        assert skip_info(fresh.get(timeout=20)) is None

        # expires before its eta: the marker lives no longer than the message
        expiring = task.apply_async(("c",), countdown=1, expires=0.5)
        assert 0 < redis_client.pttl(_marker(key_prefix, "c")) <= 500
        later = _new_holder(task, expiring, "c", 10, worker)
        assert skip_info(later.get(timeout=20)) is None
    finally:
        signals.duplicate_not_published.disconnect(on_dedup)
    # every run handed its marker over: none is left
    assert not any(redis_client.exists(_marker(key_prefix, k)) for k in "abcr")


@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_a_queued_call_skipped_on_the_worker_drops_its_marker(  # noqa: PLR0917 - fixtures
    pool: str,
    worker_factory: WorkerFactory,
    client: tuple[Celery, Any],
    redis_client: redis.Redis,
    redis_url: str,
    key_prefix: str,
) -> None:
    """A call published while its key was free (its queued marker written) meets a holder that
    took the lock meanwhile: skipped on the worker, in front of Celery's tracer, it drops its
    marker as a run does at its start, so the next delay() is published at once."""
    app, task = client
    queued = task.delay("q")
    assert redis_client.exists(_marker(key_prefix, "q"))
    keys = derive_keys(
        f"{key_prefix}lock:", "t.publish_hold", _signature, (), {"key": "q"}, ("key",)
    )
    store = store_for(redis_url)
    store.acquire(keys, "the-holder", 0, 60_000)
    worker = worker_factory.start(SINGLETON_APP, pool=pool, concurrency=2)
    worker.wait_ready(app)
    info = skip_info(queued.get(timeout=20))
    assert info is not None
    assert info.holder == "the-holder"
    assert not redis_client.exists(_marker(key_prefix, "q"))
    store.release(keys.lock, "the-holder", 0)


def test_purged_message_blocks_the_key_no_longer_than_the_marker_ttl(
    make_client: Callable[..., tuple[Celery, Any]], redis_client: redis.Redis, key_prefix: str
) -> None:
    """With no worker: after a purge the marker lapses after publish_ttl (1 s)."""
    app, task = make_client(singleton_publish_ttl=1)
    first = task.delay("p")
    assert task.delay("p").id == first.id
    assert app.control.purge() == 1
    assert 0 < redis_client.pttl(_marker(key_prefix, "p")) <= 1000
    again = _new_holder(task, first, "p", 10)
    assert again.id != first.id


def test_marker_of_a_finished_task_is_taken_over(
    client: tuple[Celery, Any],
    redis_client: redis.Redis,
    key_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A duplicate whose marker names a task with a ready result publishes at once, once the
    backend's last "not finished" for that task is older than publish.UNFINISHED_TRUST_S."""
    now = [0.0]
    unfinished = publish.Unfinished(trust_s=1.0, clock=lambda: now[0])
    monkeypatch.setattr(publish, "UNFINISHED", unfinished)
    app, task = client
    asked: list[str] = []
    get_state = app.backend.get_state
    monkeypatch.setattr(app.backend, "get_state", lambda tid: asked.append(tid) or get_state(tid))
    first = task.delay("f")
    app.control.purge()
    assert task.delay("f").id == first.id
    assert task.delay("f").id == first.id
    assert asked == [first.id]  # the second duplicate trusted the first's answer
    with warnings.catch_warnings():  # celery's redis backend calls the deprecated setex
        warnings.simplefilter("ignore", DeprecationWarning)
        app.backend.mark_as_revoked(first.id, "test")
    assert task.delay("f").id == first.id  # within the trust: still turned away
    now[0] += 1.0
    taken = task.delay("f")
    assert taken.id != first.id
    assert asked == [first.id, first.id]
    assert redis_client.get(_marker(key_prefix, "f")) == taken.id.encode()


def test_raise_policy_raises_at_publish(make_client: Callable[..., tuple[Celery, Any]]) -> None:
    """Under on_duplicate="raise" the duplicate delay() raises DuplicateTaskError."""
    _app, task = make_client(singleton_on_duplicate="raise")
    first = task.delay("x")
    with pytest.raises(DuplicateTaskError) as caught:
        task.delay("x")
    assert caught.value.holder == first.id
    assert caught.value.key is not None
    assert caught.value.key.endswith(":lock")


def test_marker_shares_the_lock_hash_tag() -> None:
    """The queued marker is in the lock's Redis Cluster slot (same hash tag)."""
    lock = derive_keys("p:", "t.publish_hold", _signature, (), {"key": "k"}, ("key",)).lock
    marker = queued_key(lock)
    assert marker.endswith(":queued")
    assert (
        marker[marker.index("{") : marker.index("}") + 1]
        == lock[lock.index("{") : lock.index("}") + 1]
    )
    with pytest.raises(ValueError, match="not a lock key"):
        queued_key(marker)


def test_marker_ttl_follows_countdown_and_expires() -> None:
    """The marker lives the message's delay plus publish_ttl, never past its expiry."""
    assert marker_ttl_ms(60, {}) == 60_000
    assert marker_ttl_ms(60, {"countdown": 10}) == 70_000
    assert marker_ttl_ms(60, {"countdown": 10, "expires": 5}) == 5_000
    assert marker_ttl_ms(60, {"expires": -3}) == 1


def test_group_members_and_failed_publishes(
    make_client: Callable[..., tuple[Celery, Any]], redis_client: redis.Redis, key_prefix: str
) -> None:
    """Group members are always published; a publish that fails leaves no marker behind."""
    app, task = make_client()
    members = group(task.s("g"), task.s("g")).apply_async()
    assert len({r.id for r in members.results}) == 2
    assert app.control.purge() == 2
    with pytest.raises(EncodeError):  # a set is keyable, but not JSON
        task.delay({"not", "json"})
    assert not list(redis_client.scan_iter(count=1000, match=f"{key_prefix}lock:*:queued"))


def test_redis_error_at_publish_publishes_without_dedup(
    make_client: Callable[..., tuple[Celery, Any]], caplog: pytest.LogCaptureFixture
) -> None:
    """With the lock store unreachable, delay() still publishes, and says so."""
    app, task = make_client()
    app.conf.singleton_redis_url = "redis://127.0.0.1:1/0?socket_connect_timeout=1"
    ids = {task.delay("down").id for _ in range(2)}  # no AsyncResult held by a log record
    assert len(ids) == 2
    assert app.control.purge() == 2
    assert "singleton: redis error at publish, publishing without dedup" in caplog.text
