"""Where two mechanisms of the lock protocol meet inside one process, against real Redis:

- a renewal already on the wire and the retry hand-over's longer ttl: a renewal never shortens
  a lock;
- a release the renewer thread has taken out of its queue and the same process's next acquire
  on another connection: the acquire never overtakes it, on every kind of store.

The interleavings are forced with gates in a store subclass (the Redis calls are real)."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import redis

from celery_singleton_lock.core.backend import (
    Acquired,
    ReleaseItem,
    ReleaseStatus,
    RenewItem,
    RenewStatus,
)
from celery_singleton_lock.core.keys import lock_keys
from celery_singleton_lock.core.redlock import RedlockStore
from celery_singleton_lock.core.renewer import HeldLock, Renewer
from celery_singleton_lock.core.store import LockStore
from tests.support.servers import RedisServer


class Gate:
    """Holds one call of a store at its door until the test opens it."""

    def __init__(self) -> None:
        self.arrived = threading.Event()
        self.open = threading.Event()

    def pass_through(self) -> None:
        self.arrived.set()
        assert self.open.wait(10), "the gate was never opened"


def _held(store: LockStore, prefix: str, name: str, ttl_ms: int) -> HeldLock:
    keys = lock_keys(prefix, "tests.order", name.encode())
    outcome = store.acquire(keys, f"run-{name}", 0, ttl_ms)
    assert isinstance(outcome, Acquired)
    return HeldLock(keys.lock, f"run-{name}", 0, ttl_ms, outcome.token, acquired_at=0.0)


class _RenewGated(LockStore):
    """Renewals of ``gated_ttl_ms`` wait at the gate before they go to Redis."""

    gate: Gate
    gated_ttl_ms: int

    def renew(self, items: Sequence[RenewItem]) -> list[RenewStatus]:
        if items and items[0].ttl_ms == self.gated_ttl_ms:
            self.gate.pass_through()
        return super().renew(items)


def test_a_renewal_on_the_wire_does_not_undo_the_hand_over(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    """The renewer has sent (snapshotted) a renewal to the plain ttl; meanwhile retry() hands the
    lock over with ttl countdown + ttl; then the renewal lands. The lock keeps the longer ttl,
    so no duplicate gets in during the countdown."""
    store = _RenewGated(redis_client)
    store.gate, store.gated_ttl_ms = Gate(), 3000
    renewer = Renewer(store)
    held = _held(store, key_prefix, "handed", 3000)
    renewer.add(held)
    ticking = threading.Thread(target=renewer.run_due, args=(5.0,))  # due: renews all
    ticking.start()
    assert store.gate.arrived.wait(10)
    renewer.hand_over(held, 23_000)  # retry(countdown=20) with a ttl of 3 s
    assert redis_client.pttl(held.key) > 20_000
    store.gate.open.set()
    ticking.join(10)
    assert redis_client.pttl(held.key) > 20_000, "the late renewal shortened the handed-over lock"


def test_renewal_extends_but_never_shortens(redis_client: redis.Redis, key_prefix: str) -> None:
    """renew.lua sets the expiry only upwards, on one call of several locks of one ttl."""
    store = LockStore(redis_client)
    short = _held(store, key_prefix, "short", 1000)
    long = _held(store, key_prefix, "long", 1000)
    assert store.renew([RenewItem(long.key, long.owner, 0, 60_000)]) == [RenewStatus.RENEWED]
    items = [RenewItem(h.key, h.owner, 0, 5000) for h in (short, long)]
    assert store.renew(items) == [RenewStatus.RENEWED, RenewStatus.RENEWED]
    assert 1000 < redis_client.pttl(short.key) <= 5000
    assert redis_client.pttl(long.key) > 50_000


class _ReleaseGated(LockStore):
    """Queued releases (``release_many``) wait at the gate before they go to Redis."""

    gate: Gate

    def release_many(self, items: Sequence[ReleaseItem]) -> list[ReleaseStatus | Any]:
        self.gate.pass_through()
        return super().release_many(items)


class _RedlockReleaseGated(RedlockStore):
    gate: Gate

    def release_many(self, items: Sequence[ReleaseItem]) -> list[ReleaseStatus | Any]:
        self.gate.pass_through()
        return super().release_many(items)


@pytest.fixture
def masters() -> Iterator[list[redis.Redis]]:
    servers = [RedisServer() for _ in range(3)]
    clients = [redis.Redis(host="127.0.0.1", port=s.port) for s in servers]
    yield clients
    for client in clients:
        client.close()
    for server in servers:
        server.close()


def _store(kind: str, redis_url: str, masters: list[redis.Redis]) -> LockStore:
    if kind == "wait_replicas":  # no send-ahead connection: releases are queued
        return _ReleaseGated(redis.Redis.from_url(redis_url), wait_replicas=1, wait_timeout_ms=1)
    return _RedlockReleaseGated(masters)


@pytest.mark.parametrize("kind", ["wait_replicas", "redlock"])
def test_next_acquire_waits_for_the_release_the_thread_is_sending(
    kind: str, redis_url: str, key_prefix: str, request: pytest.FixtureRequest
) -> None:
    """Run 1 ends; its release is queued and the renewer thread takes it and starts sending.
    Run 2 of the same key, in the same process, acquires on another connection before that
    release reached Redis. Run 2 must not find run 1's lock (it would be skipped as a duplicate
    of a run that has ended): it waits for the release, then takes the lock."""
    masters = request.getfixturevalue("masters") if kind == "redlock" else []
    store = _store(kind, redis_url, masters)
    store.gate = Gate()  # type: ignore[attr-defined]
    renewer = Renewer(store)
    first = _held(store, key_prefix, "k", 30_000)
    renewer.add(first)
    renewer.release_later(first, "SUCCESS")  # queued: this store cannot write ahead
    sender = threading.Thread(target=renewer.flush_releases)  # what the thread does
    sender.start()
    assert store.gate.arrived.wait(10)  # type: ignore[attr-defined]
    outcomes: list[Any] = []
    acquiring = threading.Thread(
        target=lambda: outcomes.append(
            renewer.acquire(lock_keys(key_prefix, "tests.order", b"k"), "run-next", 0, 30_000)
        )
    )
    acquiring.start()
    acquiring.join(0.3)  # it must wait for the release on the wire, not go past it
    store.gate.open.set()  # type: ignore[attr-defined]
    sender.join(10)
    acquiring.join(10)
    assert len(outcomes) == 1
    assert isinstance(outcomes[0], Acquired), f"run 2 met its own predecessor: {outcomes[0]}"
