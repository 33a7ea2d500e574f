"""Locks through Redis Sentinel: a private master, one replica and three sentinels
(``down-after-milliseconds`` 1000, ``failover-timeout`` 3000), reached with a
``redis+sentinel://`` URL; the data nodes and the sentinels each require a password.

What a failover may do to a lock (docs/deployments.md): a lock the replica had survives it; a
lock the replica had not received is gone from the new master. Either way the lock store must
tell the truth: a renewal reports ``RENEWED`` only for a lock the new master holds for that
owner, and a new acquire there gets a larger fencing token than the lost lock had.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterator

import pytest
import redis

from celery_singleton_lock import LockUnavailableError
from celery_singleton_lock.core._wire import script
from celery_singleton_lock.core.backend import (
    FENCE_MARGIN_MS,
    Acquired,
    Contended,
    ReleaseStatus,
    RenewItem,
    RenewStatus,
    acquire_args,
)
from celery_singleton_lock.core.connection import new_store, prober_for, reset, store_for
from celery_singleton_lock.core.keys import LockKeys, lock_keys
from celery_singleton_lock.core.probe import probe
from celery_singleton_lock.core.store import LockStore
from tests.support.recording_schedulers import (
    RENEWAL_FAILS,
    check_leadership_kept_after_a_failed_renewal,
    long_lease_leader_app,
)
from tests.support.servers import paused
from tests.support.store_checks import check_pending_scripts, check_permit_slots
from tests.support.topologies import SentinelSet, wait_until

#: store_for caches per URL and process: every test starts and ends without any
pytestmark = pytest.mark.usefixtures("forget_stores")

PREFIX = "cslt:sentinel:"
TTL_MS = 30_000


@pytest.fixture(scope="module")
def sentinels() -> Iterator[SentinelSet]:
    """One Sentinel set for the tests that do not kill anything."""
    with SentinelSet() as topology:
        yield topology


def new_keys(name: str) -> LockKeys:
    return lock_keys(PREFIX, f"t.{name}", uuid.uuid4().bytes)


def close(store: LockStore) -> None:
    store.client.close()


def test_lock_cycle_through_sentinel(sentinels: SentinelSet) -> None:
    """Acquire, contend, renew and release through the sentinel URL; the lock is on the master."""
    store = store_for(sentinels.url())
    master = sentinels.master().client()
    try:
        keys = new_keys("cycle")
        taken = store.acquire(keys, "owner-a", 0, TTL_MS)
        assert isinstance(taken, Acquired)
        assert master.hget(keys.lock, "owner") == b"owner-a"  # on the master sentinels name
        contended = store.acquire(keys, "owner-b", 0, TTL_MS)
        assert isinstance(contended, Contended)
        assert contended.holder == "owner-a"
        item = RenewItem(keys.lock, "owner-a", 0, TTL_MS)
        assert store.renew([item]) == [RenewStatus.RENEWED]
        assert store.release(keys.lock, "owner-a", 0) is ReleaseStatus.RELEASED
        assert master.exists(keys.lock) == 0
    finally:
        master.close()
        close(store)


def test_a_closed_store_leaves_no_connection_to_the_sentinels(sentinels: SentinelSet) -> None:
    """``close()`` of a store (and of a prober) on a sentinel URL closes its connections to the
    sentinels too, not only the master's: redis-py's Sentinel keeps a client per sentinel that
    closing the master's client leaves open (a socket left to the garbage collector)."""
    watchers = [sentinels.sentinel_client(i) for i in range(len(sentinels.sentinels))]

    def ours(watcher: redis.Redis) -> set[str]:
        """The sentinel's clients, less the other sentinels' links (named ``sentinel-...``),
        which a busy machine may still be opening while this test runs."""
        return {
            c["id"]
            for c in watcher.client_list()
            if not str(c.get("name", "")).startswith("sentinel-")
        }

    try:
        before = [ours(w) for w in watchers]
        store = new_store(sentinels.url())
        prober = prober_for(sentinels.url())
        assert isinstance(store, LockStore)
        assert prober is not None
        keys = new_keys("close")
        assert isinstance(store.acquire(keys, "owner", 0, TTL_MS), Acquired)
        assert probe(prober, keys, "other", 0) is not None
        assert store.release(keys.lock, "owner", 0) is ReleaseStatus.RELEASED
        now = [ours(w) for w in watchers]
        opened = [ids - b for ids, b in zip(now, before, strict=True)]
        assert any(opened), "the store and the prober asked the sentinels"
        store.close()
        prober.close()

        def left() -> list[set[str]]:
            now = [ours(w) for w in watchers]
            return [ids & o for ids, o in zip(now, opened, strict=True)]

        wait_until(lambda: not any(left()), 5, "the sentinel connections to close")
    finally:
        reset()
        for watcher in watchers:
            watcher.close()


def test_permits_and_pending_follow_ups_through_sentinel(sentinels: SentinelSet) -> None:
    """singleton_permits and coalesce's pending record work through a sentinel URL as on one
    server (the slots and the record on the master)."""
    store = store_for(sentinels.url())
    try:
        check_permit_slots(store, new_keys("permits").with_permits(3))
        check_pending_scripts(store, new_keys("pending"))
    finally:
        close(store)


@pytest.mark.slow(seconds=11)
def test_sentinel_password_is_needed_and_never_shown(sentinels: SentinelSet) -> None:
    """Without sentinel_password the sentinels refuse: LockUnavailableError, no password in it."""
    store = store_for(sentinels.url(with_sentinel_password=False))
    try:
        with pytest.raises(LockUnavailableError) as info:
            store.acquire(new_keys("nopass"), "owner", 0, TTL_MS)
        assert sentinels.password not in str(info.value)
        assert str(sentinels.sentinel_password) not in str(info.value)
    finally:
        close(store)


def test_wait_replicas_through_sentinel(
    sentinels: SentinelSet, caplog: pytest.LogCaptureFixture
) -> None:
    """wait_replicas=1: the acquire returns once the replica has the lock; with the replica
    stopped it gives up after wait_timeout, logs, and keeps the lock."""
    store = store_for(sentinels.url(query="wait_replicas=1&wait_timeout=0.3"))
    replica_server = sentinels.replica()
    replica = replica_server.client()
    try:
        keys = new_keys("wait")
        taken = store.acquire(keys, "owner-a", 0, TTL_MS)
        assert isinstance(taken, Acquired)
        assert taken.replicas == 1
        assert replica.hget(keys.lock, "owner") == b"owner-a"  # WAIT returned: it is there
        assert store.release(keys.lock, "owner-a", 0) is ReleaseStatus.RELEASED

        replica_server.pause()
        try:
            keys = new_keys("wait-paused")
            started = time.monotonic()
            with caplog.at_level(logging.WARNING, logger="celery_singleton_lock.core.store"):
                taken = store.acquire(keys, "owner-a", 0, TTL_MS)
            waited = time.monotonic() - started
        finally:
            replica_server.resume()
        assert isinstance(taken, Acquired)
        assert taken.replicas == 0
        assert 0.25 <= waited < 3.0
        assert "singleton: only 0 of 1 replicas acknowledged the lock within 300ms" in caplog.text
        assert store.release(keys.lock, "owner-a", 0) is ReleaseStatus.RELEASED
    finally:
        replica.close()
        close(store)


def acquire_unreplicated(client: redis.Redis, keys: LockKeys, owner: str, ttl_ms: int) -> int:
    """Take a lock on the master only, as if the failover came before replication.

    Runs acquire.lua behind ``redis.set_repl(redis.REPL_NONE)``: the master writes the lock and
    its fencing counter but sends neither to the replica. Returns the token.
    """
    text = "redis.set_repl(redis.REPL_NONE)\n" + script("acquire.lua").text
    reply = client.eval(text, *acquire_args(keys, owner, 0, ttl_ms, FENCE_MARGIN_MS, None))
    assert reply[0] == 1, reply
    return int(reply[1])


def renew_until_answered(
    store: LockStore, items: list[RenewItem], timeout: float = 30.0
) -> list[RenewStatus]:
    """Renew until the store reaches the new master (errors while the failover runs)."""
    result: list[RenewStatus] = wait_until(
        lambda: store.renew(items), timeout, "a renewal to reach the new master"
    )
    return result


@pytest.mark.slow(seconds=7)
def test_failover_keeps_the_store_working_and_never_lies_about_a_lock() -> None:
    """Kill the master with SIGKILL. After the failover the same store acquires on the new
    master; a renewal of a lock taken before reports RENEWED only where the new master has it
    (the replicated one), and the lost lock's key gets a larger token."""
    with SentinelSet() as topology:
        waiting = store_for(topology.url(query="wait_replicas=1&wait_timeout=2"))
        store = store_for(topology.url())
        old_master = topology.master()
        direct = old_master.client()
        try:
            # A: replicated for sure (WAIT); B: on the old master only; C: plain, either way
            replicated, lost, plain = new_keys("a"), new_keys("b"), new_keys("c")
            taken = waiting.acquire(replicated, "owner-a", 0, TTL_MS)
            assert isinstance(taken, Acquired)
            assert taken.replicas == 1
            lost_token = acquire_unreplicated(direct, lost, "owner-b", TTL_MS)
            assert isinstance(store.acquire(plain, "owner-c", 0, TTL_MS), Acquired)
        finally:
            direct.close()

        old_port = topology.kill_master()
        new_port = topology.wait_failover(old_port)
        assert new_port != old_port

        items = [
            RenewItem(replicated.lock, "owner-a", 0, TTL_MS),
            RenewItem(lost.lock, "owner-b", 0, TTL_MS),
            RenewItem(plain.lock, "owner-c", 0, TTL_MS),
        ]
        statuses = renew_until_answered(store, items)
        new_master = topology.server(new_port).client()
        try:
            for item, status in zip(items, statuses, strict=True):
                owner = new_master.hget(item.key, "owner")
                if status is RenewStatus.RENEWED:  # never RENEWED for a lock it does not have
                    assert owner == item.owner.encode(), (item, status)
                else:
                    assert owner != item.owner.encode(), (item, status)
            assert statuses[0] is RenewStatus.RENEWED  # WAIT saw it on the replica
            assert statuses[1] is RenewStatus.GONE  # never reached the replica

            # the store works on the new master: the lost key is free, with a larger token
            again = store.acquire(lost, "owner-b2", 0, TTL_MS)
            assert isinstance(again, Acquired)
            assert again.token > lost_token
            assert new_master.hget(lost.lock, "owner") == b"owner-b2"
            contended = store.acquire(replicated, "owner-x", 0, TTL_MS)
            assert isinstance(contended, Contended)
            assert contended.holder == "owner-a"
            assert store.release(replicated.lock, "owner-a", 0) is ReleaseStatus.RELEASED
            assert store.release(lost.lock, "owner-b2", 0) is ReleaseStatus.RELEASED
        finally:
            new_master.close()
            close(store)
            close(waiting)


@pytest.mark.parametrize("when", list(RENEWAL_FAILS))
@pytest.mark.slow(seconds=6)
def test_beat_leader_takes_its_lease_back_after_a_failed_renewal_through_sentinel(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, when: str
) -> None:
    """Leader mode through Sentinel, the master paused while the leader renews (past the 0.2 s
    socket timeout, well short of the sentinels' 10 s down-after): the leader keeps its lease."""
    with SentinelSet(down_after_ms=10_000) as topology:
        app = long_lease_leader_app(
            topology.url(query="socket_timeout=0.2"), f"{PREFIX}{uuid.uuid4().hex[:6]}:"
        )
        try:
            check_leadership_kept_after_a_failed_renewal(
                app, monkeypatch, caplog, lambda: paused(topology.master()), when
            )
        finally:
            app.close()
