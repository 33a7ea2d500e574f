"""The per-process renewer against real Redis, driven by an injected clock."""

from __future__ import annotations

import gc
import time

import pytest
import redis

from celery_singleton_lock.core.backend import Acquired, ReleaseStatus, RenewStatus
from celery_singleton_lock.core.keys import lock_keys
from celery_singleton_lock.core.renewer import HeldLock, Renewer
from celery_singleton_lock.core.store import LockStore
from tests.support.waiting import wait_for


def _hold(store: LockStore, prefix: str, name: str, ttl_ms: int, now: float) -> HeldLock:
    keys = lock_keys(prefix, "tests.renew", name.encode())
    outcome = store.acquire(keys, f"owner-{name}", 0, ttl_ms)
    assert isinstance(outcome, Acquired)
    return HeldLock(keys.lock, f"owner-{name}", 0, ttl_ms, outcome.token, acquired_at=now)


def test_nothing_due_before_a_third_of_the_ttl(redis_client: redis.Redis, key_prefix: str) -> None:
    """A fresh lock is first renewed a third of its ttl after it was taken."""
    store = LockStore(redis_client)
    renewer = Renewer(store)
    held = _hold(store, key_prefix, "a", 3000, now=100.0)
    renewer.add(held)
    assert renewer.run_due(100.0) == 1.0
    assert renewer.round_trips == 0
    assert renewer.run_due(101.0) == 1.0
    assert renewer.round_trips == 1
    assert held.renewals == 1


def test_one_round_trip_for_many_locks(redis_client: redis.Redis, key_prefix: str) -> None:
    """Ten thousand locks are renewed in one round trip per interval."""
    store = LockStore(redis_client)
    renewer = Renewer(store)
    held = [_hold(store, key_prefix, str(i), 30_000, now=0.0) for i in range(10_000)]
    for h in held:
        renewer.add(h)
    for tick in range(1, 4):
        renewer.run_due(10.0 * tick)
    assert renewer.round_trips == 3
    assert all(h.renewals == 3 for h in held)
    assert redis_client.pttl(held[-1].key) > 20_000


def test_lost_lock_is_reported_once(redis_client: redis.Redis, key_prefix: str) -> None:
    """A lock taken by someone else is flagged lost, reported, and no longer renewed."""
    store = LockStore(redis_client)
    lost: list[tuple[HeldLock, RenewStatus]] = []
    renewer = Renewer(store, on_lost=lambda h, s: lost.append((h, s)))
    mine = _hold(store, key_prefix, "mine", 3000, now=0.0)
    stolen = _hold(store, key_prefix, "stolen", 3000, now=0.0)
    gone = _hold(store, key_prefix, "gone", 3000, now=0.0)
    for h in (mine, stolen, gone):
        renewer.add(h)
    redis_client.hset(stolen.key, "owner", "thief")
    redis_client.unlink(gone.key)
    renewer.run_due(1.0)
    assert dict((h.key, s) for h, s in lost) == {
        stolen.key: RenewStatus.TAKEN,
        gone.key: RenewStatus.GONE,
    }
    assert stolen.lost
    assert gone.lost
    assert not mine.lost
    assert len(renewer) == 1
    renewer.run_due(2.0)
    assert len(lost) == 2
    assert not redis_client.exists(gone.key)


def test_released_while_renewing_is_not_lost(redis_client: redis.Redis, key_prefix: str) -> None:
    """A lock removed before its renewal result arrives is not reported lost."""
    store = LockStore(redis_client)
    lost: list[HeldLock] = []
    renewer = Renewer(store, on_lost=lambda h, s: lost.append(h))
    held = _hold(store, key_prefix, "x", 3000, now=0.0)
    renewer.add(held)
    original = store.renew

    def renew_then_release(items):  # type: ignore[no-untyped-def]
        renewer.remove(held)
        store.release(held.key, held.owner, held.generation)
        return original(items)

    store.renew = renew_then_release  # type: ignore[method-assign]
    renewer.run_due(1.0)
    assert lost == []
    assert not held.lost


def test_max_hold_stops_renewal(redis_client: redis.Redis, key_prefix: str) -> None:
    """After max_hold seconds a lock is no longer renewed and the callback fires."""
    store = LockStore(redis_client)
    stopped: list[HeldLock] = []
    renewer = Renewer(store, on_max_hold=stopped.append)
    held = _hold(store, key_prefix, "hung", 3000, now=0.0)
    held.max_hold_s = 5.0
    renewer.add(held)
    renewer.run_due(1.0)
    renewer.run_due(5.0)
    assert stopped == [held]
    assert len(renewer) == 0
    assert held.renewals == 1
    assert held.lost  # no longer renewed: the run cannot count on the lock any more


def test_forgotten_lock_drops_out(redis_client: redis.Redis, key_prefix: str) -> None:
    """The registry is weak: a record nobody references any more is not renewed."""
    store = LockStore(redis_client)
    renewer = Renewer(store)
    renewer.add(_hold(store, key_prefix, "orphan", 3000, now=0.0))
    gc.collect()
    assert len(renewer) == 0
    assert renewer.run_due(1.0) is None


def test_thread_renews_in_real_time(redis_client: redis.Redis, key_prefix: str) -> None:
    """The daemon thread keeps a 300 ms lock alive well past its ttl, then stops."""
    store = LockStore(redis_client)
    renewer = Renewer(store)
    held = _hold(store, key_prefix, "live", 300, now=renewer.clock())
    renewer.add(held)
    renewer.ensure_started()
    try:
        time.sleep(1.0)  # three ttls of real time: this test is about the real thread
        assert redis_client.exists(held.key)
        assert held.renewals >= 4
        assert not held.lost
    finally:
        renewer.stop()


def test_release_later_reaches_redis_and_stop_reports_it(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    """A release leaves the registry and reaches Redis at once; stop() reports every outcome."""
    store = LockStore(redis_client)
    outcomes: list[tuple[str, object, str]] = []
    renewer = Renewer(store, on_released=lambda h, s, r: outcomes.append((h.key, s, r)))
    first = _hold(store, key_prefix, "first", 3000, now=renewer.clock())
    renewer.add(first)
    renewer.ensure_started()
    try:
        renewer.release_later(first, "SUCCESS")
        assert len(renewer) == 0
        wait_for(lambda: not redis_client.exists(first.key), 10, "the release", interval=0.01)
        assert not redis_client.exists(first.key)
        second = _hold(store, key_prefix, "second", 3000, now=renewer.clock())
        renewer.release_later(second, "FAILURE")
    finally:
        renewer.stop()
    assert not redis_client.exists(second.key)
    assert outcomes == [
        (first.key, ReleaseStatus.RELEASED, "SUCCESS"),
        (second.key, ReleaseStatus.RELEASED, "FAILURE"),
    ]


def test_thread_is_started_again_after_stop_or_death(redis_client: redis.Redis) -> None:
    """ensure_started() starts a new thread after stop(), and after the thread died."""
    renewer = Renewer(LockStore(redis_client))
    renewer.ensure_started()
    first = renewer._thread
    assert first is not None
    renewer.ensure_started()
    assert renewer._thread is first  # running: not started twice
    renewer.stop()
    assert not first.is_alive()
    renewer.ensure_started()
    second = renewer._thread
    assert second is not None
    assert second is not first
    assert second.is_alive()

    def die() -> None:
        raise SystemExit  # ends a thread without the loop's own error handling

    renewer._loop = die  # type: ignore[method-assign]
    renewer._stop.set()
    renewer._wake.set()
    second.join(5)
    renewer._stop.clear()
    renewer._loop = Renewer._loop.__get__(renewer)  # type: ignore[method-assign]
    renewer.ensure_started()
    try:
        third = renewer._thread
        assert third is not None
        assert third is not second
        assert third.is_alive()
    finally:
        renewer.stop()


@pytest.mark.filterwarnings("ignore:.*multi-threaded.*fork:DeprecationWarning")  # 3.12+
def test_forked_child_gets_a_renewer_and_thread_of_its_own(redis_url: str) -> None:
    """After a fork, renewer_for hands the child its own renewer, thread and pid."""
    import os

    from celery_singleton_lock.core import connection
    from celery_singleton_lock.core._pid import current_pid

    renewer = connection.renewer_for(redis_url, lambda r: None)
    parent = renewer._thread
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, then leave without running pytest's teardown
        mine = connection.renewer_for(redis_url, lambda r: None)
        ok = current_pid() == os.getpid() and mine is not renewer
        ok = ok and mine._thread is not None and mine._thread.is_alive()
        os.write(write, b"1" if ok else b"0")
        os._exit(0)
    try:
        os.close(write)
        assert os.read(read, 1) == b"1"
        assert os.waitpid(pid, 0)[1] == 0
        assert connection.renewer_for(redis_url, lambda r: None) is renewer
        assert renewer._thread is parent
        assert current_pid() == os.getpid()
    finally:
        os.close(read)
        connection.reset()
