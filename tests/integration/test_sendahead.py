"""Releases written ahead: the lock is free at once, the reply is read later."""

from __future__ import annotations

import multiprocessing
from typing import Any

import pytest
import redis

from celery_singleton_lock.core._wire import script
from celery_singleton_lock.core.backend import Acquired, ReleaseStatus, SequentialReleases
from celery_singleton_lock.core.completion import Ending
from celery_singleton_lock.core.keys import LockKeys, lock_keys
from celery_singleton_lock.core.renewer import HeldLock, Renewer
from celery_singleton_lock.core.store import LockStore
from celery_singleton_lock.errors import LockUnavailableError
from tests.support.servers import RedisServer
from tests.support.waiting import wait_for


def _take(store: LockStore, prefix: str, name: str, owner: str) -> LockKeys:
    keys = lock_keys(prefix, "tests.ahead", name.encode())
    assert isinstance(store.acquire(keys, owner, 0, 30_000), Acquired)
    return keys


def _wait_gone(client: redis.Redis, key: str) -> None:
    wait_for(lambda: not client.exists(key), 5, f"{key} to be gone", interval=0.005)


def test_release_ahead_frees_the_lock_before_its_reply_is_read(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    """The lock is gone from Redis while its reply waits; collect_released then reports it."""
    store = LockStore(redis_client)
    keys = _take(store, key_prefix, "a", "run-1")
    assert store.release_ahead(keys.lock, "run-1", 0, "tag-a")
    _wait_gone(redis_client, keys.lock)
    assert not redis_client.exists(keys.lock)
    assert store.collect_released() == [("tag-a", ReleaseStatus.RELEASED)]
    assert store.collect_released() == []


def test_replies_come_back_in_order_with_their_tags(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    """Released, not held and held by another owner: each tag gets its own status."""
    store = LockStore(redis_client)
    mine = _take(store, key_prefix, "mine", "run-1")
    theirs = _take(store, key_prefix, "theirs", "run-2")
    assert store.release_ahead(mine.lock, "run-1", 0, 1)
    assert store.release_ahead(f"{key_prefix}never-taken", "run-1", 0, 2)
    assert store.release_ahead(theirs.lock, "run-1", 0, 3)
    assert store.collect_released() == [
        (1, ReleaseStatus.RELEASED),
        (2, ReleaseStatus.NOT_HELD),
        (3, ReleaseStatus.TAKEN),
    ]
    assert redis_client.exists(theirs.lock)


def test_the_next_acquire_runs_after_the_releases_and_brings_their_replies(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    """An acquire of the key just released ahead finds it free; the replies wait to be collected."""
    store = LockStore(redis_client)
    keys = _take(store, key_prefix, "k", "run-1")
    assert store.release_ahead(keys.lock, "run-1", 0, "first")
    outcome = store.acquire(keys, "run-2", 0, 30_000)
    assert isinstance(outcome, Acquired)
    assert store.holder(keys.lock)["owner"] == "run-2"
    previous = [(keys.lock, "run-2", 0, None)]
    released, second = store.acquire_after(previous, keys, "run-3", 0, 30_000)
    assert released == [ReleaseStatus.RELEASED]
    assert isinstance(second, Acquired)
    assert store.collect_released() == [("first", ReleaseStatus.RELEASED)]


def test_a_connection_lost_with_replies_on_it_reports_each_as_an_error(
    private_redis: RedisServer, key_prefix: str
) -> None:
    """Server gone before it answered: every release written ahead comes back as an error."""
    store = LockStore(private_redis.client(socket_timeout=2))
    first = _take(store, key_prefix, "one", "run-1")
    second = _take(store, key_prefix, "two", "run-1")
    private_redis.pause()
    assert store.release_ahead(first.lock, "run-1", 0, "one")
    assert store.release_ahead(second.lock, "run-1", 0, "two")
    private_redis.kill()
    outcomes = store.collect_released()
    assert [tag for tag, _ in outcomes] == ["one", "two"]
    assert all(isinstance(outcome, LockUnavailableError) for _, outcome in outcomes), outcomes
    assert not store.release_ahead(first.lock, "run-1", 0, "server down")


def test_a_release_ahead_runs_before_the_next_acquire_on_a_server_without_its_script(
    private_redis: RedisServer, key_prefix: str
) -> None:
    """New or flushed server: a release never sent before still runs before the acquire after it."""
    client = private_redis.client()
    store = LockStore(client)
    keys = _take(store, key_prefix, "k", "run-1")  # the server has acquire.lua, not release.lua
    assert store.release_ahead(keys.lock, "run-1", 0, "k")
    assert isinstance(store.acquire(keys, "run-2", 0, 30_000), Acquired)
    assert store.collect_released() == [("k", ReleaseStatus.RELEASED)]
    client.script_flush()
    client.script_load(script("acquire.lua").text)
    previous = [(keys.lock, "run-2", 0, None)]
    released, outcome = store.acquire_after(previous, keys, "run-3", 0, 30_000)
    assert released == [ReleaseStatus.RELEASED]
    assert isinstance(outcome, Acquired)
    assert store.holder(keys.lock)["owner"] == "run-3"


def _child_collects(store: LockStore, key: str, out: multiprocessing.Queue[object]) -> None:
    parents = store.collect_released()
    taken = store.acquire(lock_keys(key, "tests.ahead", b"child"), "child", 0, 30_000)
    out.put((parents, isinstance(taken, Acquired)))


@pytest.mark.slow(seconds=10)
def test_a_forked_child_does_not_read_its_parents_replies(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    """After a fork the child has its own connection; the parent still collects its own."""
    store = LockStore(redis_client)
    keys = _take(store, key_prefix, "p", "parent")
    assert store.release_ahead(keys.lock, "parent", 0, "parent's")
    context = multiprocessing.get_context("fork")
    out: multiprocessing.Queue[object] = context.Queue()
    child = context.Process(target=_child_collects, args=(store, key_prefix, out))
    child.start()
    result = out.get(timeout=10)
    child.join(10)
    assert result == ([], True)
    assert store.collect_released() == [("parent's", ReleaseStatus.RELEASED)]


class _QueueOnly(SequentialReleases):
    """A store that cannot write releases ahead (as a cluster or Redlock): each call of a
    plain store on its own."""

    def __init__(self, client: redis.Redis) -> None:
        self.inner = LockStore(client)
        self.client = client

    def acquire(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner.acquire(*args, **kwargs)

    def renew(self, items: Any) -> Any:
        return self.inner.renew(items)

    def release(
        self,
        key: str,
        owner: str,
        generation: int | None,
        token: int | None = None,
        ending: Ending | None = None,
    ) -> ReleaseStatus:
        return self.inner.release(key, owner, generation, token, ending)

    def release_lost(
        self, key: str, owner: str, generation: int, at_least_ms: int = 0
    ) -> ReleaseStatus:
        return self.inner.release_lost(key, owner, generation, at_least_ms)

    def holder(self, key: str) -> dict[str, str]:
        return self.inner.holder(key)


def test_renewer_thread_reports_a_release_written_ahead(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    """No acquire follows: the thread reads the reply within idle_s and reports it."""
    outcomes: list[tuple[str, object, str]] = []
    store = LockStore(redis_client)
    renewer = Renewer(
        store, idle_s=0.05, on_released=lambda h, s, r: outcomes.append((h.key, s, r))
    )
    keys = _take(store, key_prefix, "t", "run-1")
    token = int(store.holder(keys.lock)["token"])
    held = HeldLock(keys.lock, "run-1", 0, 30_000, token, acquired_at=renewer.clock())
    renewer.add(held)
    renewer.ensure_started()
    try:
        renewer.release_later(held, "SUCCESS")
        wait_for(lambda: outcomes, 5, "the release's outcome", interval=0.01)
    finally:
        renewer.stop()
    assert outcomes == [(keys.lock, ReleaseStatus.RELEASED, "SUCCESS")]


def test_a_store_that_cannot_write_ahead_queues_for_the_thread(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    """Redlock-like stores: release_ahead declines, the release is queued and sent all the same."""
    outcomes: list[tuple[str, object, str]] = []
    store = _QueueOnly(redis_client)
    renewer = Renewer(store, on_released=lambda h, s, r: outcomes.append((h.key, s, r)))
    keys = _take(store, key_prefix, "q", "run-1")
    assert not store.release_ahead(keys.lock, "run-1", 0, "declined")
    token = int(store.holder(keys.lock)["token"])
    held = HeldLock(keys.lock, "run-1", 0, 30_000, token, acquired_at=renewer.clock())
    renewer.add(held)
    renewer.ensure_started()
    try:
        renewer.release_later(held, "FAILURE")
        _wait_gone(redis_client, keys.lock)
        assert not redis_client.exists(keys.lock)
    finally:
        renewer.stop()
    assert outcomes == [(keys.lock, ReleaseStatus.RELEASED, "FAILURE")]
