"""The lock core against real Redis: acquire, re-entry, fencing, renew and release."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import redis
from redis.connection import AbstractConnection
from redis.crc import key_slot

from celery_singleton_lock.core import backend as lock_module
from celery_singleton_lock.core._wire import script
from celery_singleton_lock.core.backend import (
    Acquired,
    Contended,
    ReleaseStatus,
    RenewItem,
    RenewStatus,
)
from celery_singleton_lock.core.keys import LockKeys, lock_keys
from celery_singleton_lock.core.store import LockStore
from celery_singleton_lock.errors import LockUnavailableError
from tests.support.servers import RedisServer


def _keys(prefix: str, name: str = "job") -> LockKeys:
    return lock_keys(prefix, f"tests.{name}", name.encode())


def test_acquire_free_lock(redis_client: redis.Redis, key_prefix: str) -> None:
    """A free lock is taken with a positive token and the owner written into its hash."""
    store = LockStore(redis_client)
    keys = _keys(key_prefix)
    outcome = store.acquire(keys, "task-1", 0, 5000, {"host": "h1"})
    assert isinstance(outcome, Acquired)
    assert outcome.token > 0
    assert not outcome.reentered
    fields = store.holder(keys.lock)
    assert fields["owner"] == "task-1"
    assert fields["gen"] == "0"
    assert fields["token"] == str(outcome.token)
    assert fields["host"] == "h1"
    assert 0 < redis_client.pttl(keys.lock) <= 5000


def test_second_owner_is_contended(redis_client: redis.Redis, key_prefix: str) -> None:
    """Another owner gets Contended with the holder's id, generation and token."""
    store = LockStore(redis_client)
    keys = _keys(key_prefix)
    first = store.acquire(keys, "task-1", 2, 5000)
    assert isinstance(first, Acquired)
    second = store.acquire(keys, "task-2", 0, 5000)
    assert second == Contended("task-1", 2, first.token, second.pttl_ms)  # type: ignore[union-attr]
    assert 0 < second.pttl_ms <= 5000  # type: ignore[union-attr]


def test_same_generation_does_not_reenter(redis_client: redis.Redis, key_prefix: str) -> None:
    """The same owner and generation again (a redelivery) does not get the lock."""
    store = LockStore(redis_client)
    keys = _keys(key_prefix)
    assert isinstance(store.acquire(keys, "task-1", 1, 5000), Acquired)
    assert isinstance(store.acquire(keys, "task-1", 1, 5000), Contended)
    assert isinstance(store.acquire(keys, "task-1", 0, 5000), Contended)


def test_later_generation_reenters_with_new_token(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    """A retry (same owner, larger generation) takes the lock over with a larger token."""
    store = LockStore(redis_client)
    keys = _keys(key_prefix)
    first = store.acquire(keys, "task-1", 0, 5000)
    again = store.acquire(keys, "task-1", 1, 5000)
    assert isinstance(first, Acquired)
    assert isinstance(again, Acquired)
    assert again.reentered
    assert again.token > first.token
    assert store.holder(keys.lock)["gen"] == "1"
    # the earlier generation can neither renew nor release it any more
    assert store.renew([RenewItem(keys.lock, "task-1", 0, 5000)]) == [RenewStatus.TAKEN]
    assert store.release(keys.lock, "task-1", 0) is ReleaseStatus.TAKEN


def test_release_is_owner_checked(redis_client: redis.Redis, key_prefix: str) -> None:
    """Only the holder deletes the lock; others leave it alone."""
    store = LockStore(redis_client)
    keys = _keys(key_prefix)
    store.acquire(keys, "task-1", 0, 5000)
    assert store.release(keys.lock, "task-2", 0) is ReleaseStatus.TAKEN
    assert redis_client.exists(keys.lock)
    assert store.release(keys.lock, "task-1", 0) is ReleaseStatus.RELEASED
    assert not redis_client.exists(keys.lock)
    assert store.release(keys.lock, "task-1", 0) is ReleaseStatus.NOT_HELD


def test_release_any_generation(redis_client: redis.Redis, key_prefix: str) -> None:
    """generation=None releases whatever generation of that owner holds the lock."""
    store = LockStore(redis_client)
    keys = _keys(key_prefix)
    store.acquire(keys, "task-1", 3, 5000)
    assert store.release(keys.lock, "task-1", None) is ReleaseStatus.RELEASED


def test_release_lost_only_its_generation_never_a_hand_over(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    """release_lost (a dead holder's main process): owner and generation must match, and a lock
    whose expiry was stretched past its ttl (handed over to a retry) is left alone."""
    store = LockStore(redis_client)
    keys = _keys(key_prefix)
    assert store.release_lost(keys.lock, "task-1", 0) is ReleaseStatus.NOT_HELD
    store.acquire(keys, "task-1", 1, 5000)
    assert store.release_lost(keys.lock, "task-2", 1) is ReleaseStatus.TAKEN
    assert store.release_lost(keys.lock, "task-1", 0) is ReleaseStatus.TAKEN  # the retry took it
    assert store.release_lost(keys.lock, "task-1", 2) is ReleaseStatus.TAKEN

    # SingletonTask.retry's hand-over: the expiry becomes countdown + ttl, the ttl field stays
    assert store.renew([RenewItem(keys.lock, "task-1", 1, 65_000)]) == [RenewStatus.RENEWED]
    assert store.release_lost(keys.lock, "task-1", 1) is ReleaseStatus.HANDED_OVER
    assert store.holder(keys.lock)["owner"] == "task-1"
    assert redis_client.pttl(keys.lock) > 60_000

    redis_client.pexpire(keys.lock, 5000)  # the countdown is over: an ordinary lock again
    assert store.release_lost(keys.lock, "task-1", 1) is ReleaseStatus.RELEASED
    assert not redis_client.exists(keys.lock)


def test_tokens_strictly_increase(redis_client: redis.Redis, key_prefix: str) -> None:
    """Tokens increase across acquire/release cycles, even after the counter is lost."""
    store = LockStore(redis_client)
    keys = _keys(key_prefix)
    tokens = []
    for i in range(50):
        outcome = store.acquire(keys, f"task-{i}", 0, 5000)
        assert isinstance(outcome, Acquired)
        tokens.append(outcome.token)
        store.release(keys.lock, f"task-{i}", 0)
        if i == 25:
            redis_client.unlink(keys.fence)  # as if the counter had expired
    assert all(b > a for a, b in itertools.pairwise(tokens))


def test_counter_ahead_of_clock_still_increases(redis_client: redis.Redis, key_prefix: str) -> None:
    """When the counter is ahead of the server clock, the token is counter + 1."""
    store = LockStore(redis_client)
    keys = _keys(key_prefix)
    ahead = 10**15 * 5
    redis_client.set(keys.fence, ahead)
    outcome = store.acquire(keys, "task-1", 0, 5000)
    assert isinstance(outcome, Acquired)
    assert outcome.token == ahead + 1
    assert redis_client.pttl(keys.fence) > 0


def test_lock_and_fence_share_a_slot(key_prefix: str) -> None:
    """The lock and its fencing counter hash to one Redis Cluster slot."""
    for i in range(20):
        keys = _keys(key_prefix, f"job{i}")
        assert key_slot(keys.lock.encode()) == key_slot(keys.fence.encode())


def test_renew_batch(redis_client: redis.Redis, key_prefix: str) -> None:
    """One call renews held locks and reports gone and taken ones."""
    store = LockStore(redis_client)
    held = [_keys(key_prefix, f"held{i}") for i in range(100)]
    for keys in held:
        store.acquire(keys, "owner", 0, 2000)
    taken = _keys(key_prefix, "taken")
    store.acquire(taken, "someone-else", 0, 2000)
    gone = _keys(key_prefix, "gone")
    items = [RenewItem(k.lock, "owner", 0, 60_000) for k in held]
    items += [RenewItem(taken.lock, "owner", 0, 60_000), RenewItem(gone.lock, "owner", 0, 60_000)]
    statuses = store.renew(items)
    assert statuses[:100] == [RenewStatus.RENEWED] * 100
    assert statuses[100:] == [RenewStatus.TAKEN, RenewStatus.GONE]
    assert all(redis_client.pttl(k.lock) > 2000 for k in held)
    assert redis_client.pttl(taken.lock) <= 2000
    assert not redis_client.exists(gone.lock)  # a renewal never resurrects a lock
    assert "renewals" not in store.holder(held[0].lock)  # the expiry is its only write


def _chunked(
    store: LockStore, client: redis.Redis, prefix: str, count: int
) -> tuple[list[LockKeys], list[RenewItem]]:
    """``count`` locks of one owner, aged to 1 s left, and their renew items (ttl 60 s)."""
    held = [_keys(prefix, f"chunk{i}") for i in range(count)]
    for keys in held:
        store.acquire(keys, "owner", 0, 60_000)
        client.pexpire(keys.lock, 1000)
    return held, [RenewItem(k.lock, "owner", 0, 60_000) for k in held]


def test_renew_writes_every_call_before_it_reads_a_reply(
    redis_client: redis.Redis, key_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four calls: all four are written, then the four replies read; the statuses in order."""
    monkeypatch.setattr(lock_module, "RENEW_CHUNK", 10)
    store = LockStore(redis_client)
    held, items = _chunked(store, redis_client, key_prefix, 35)
    redis_client.hset(held[23].lock, "owner", "thief")  # in the third call
    redis_client.unlink(held[34].lock)  # the last one of the fourth
    # the script is on the server, as after any earlier renewal: no NOSCRIPT round trip (under
    # xdist this test may be the first to renew on its worker's private server)
    redis_client.script_load(script("renew.lua").text)
    events: list[str] = []
    send, parse = AbstractConnection.send_packed_command, redis.Redis.parse_response

    def sending(connection: Any, command: Any, check_health: bool = True) -> Any:
        events.append("write")
        return send(connection, command, check_health)

    def reading(client: redis.Redis, connection: Any, name: str, **options: Any) -> Any:
        events.append("read")
        return parse(client, connection, name, **options)

    monkeypatch.setattr(AbstractConnection, "send_packed_command", sending)
    monkeypatch.setattr(redis.Redis, "parse_response", reading)
    statuses = store.renew(items)
    monkeypatch.undo()
    assert events == ["write"] * 4 + ["read"] * 4
    expected = [RenewStatus.RENEWED] * 35
    expected[23], expected[34] = RenewStatus.TAKEN, RenewStatus.GONE
    assert statuses == expected
    assert all(redis_client.pttl(k.lock) > 1000 for i, k in enumerate(held) if i not in (23, 34))
    assert redis_client.pttl(held[23].lock) <= 1000


def test_renew_loads_its_script_on_a_new_server(monkeypatch: pytest.MonkeyPatch) -> None:
    """After SCRIPT FLUSH (a restarted server) every call is sent again once the script is in."""
    monkeypatch.setattr(lock_module, "RENEW_CHUNK", 10)
    with RedisServer() as server:
        client = server.client()
        try:
            store = LockStore(client)
            held, items = _chunked(store, client, "p:", 25)
            client.script_flush()
            assert store.renew(items) == [RenewStatus.RENEWED] * 25
            assert all(client.pttl(k.lock) > 1000 for k in held)
            assert store.renew(items) == [RenewStatus.RENEWED] * 25
        finally:
            client.close()


def test_a_failed_call_leaves_the_connection_in_step(
    redis_url: str, key_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call that errors (not a hash) fails the batch; the replies after it are still read."""
    monkeypatch.setattr(lock_module, "RENEW_CHUNK", 10)
    # the acquires keep one connection (sendahead.py): every other command goes on the second
    client = redis.Redis.from_url(redis_url, max_connections=2)
    try:
        store = LockStore(client)
        held, items = _chunked(store, client, key_prefix, 25)
        client.unlink(held[12].lock)
        client.set(held[12].lock, "not a hash")  # HMGET fails: the second call errors
        with pytest.raises(LockUnavailableError, match=r"WRONGTYPE|wrong kind"):
            store.renew(items)
        assert all(client.pttl(k.lock) > 1000 for k in held[20:])  # the third call ran
        assert client.get(held[12].lock) == b"not a hash"  # the one connection reads its own reply
        client.unlink(held[12].lock)
        statuses = store.renew(items)
        assert statuses[12] is RenewStatus.GONE
        assert statuses.count(RenewStatus.RENEWED) == 24
    finally:
        client.close()


def test_lock_expires_by_ttl(redis_client: redis.Redis, key_prefix: str) -> None:
    """An unrenewed lock is free again after its ttl."""
    store = LockStore(redis_client)
    keys = _keys(key_prefix)
    store.acquire(keys, "task-1", 0, 50)
    redis_client.execute_command("PEXPIRE", keys.lock, 1)
    while redis_client.exists(keys.lock):
        pass
    assert isinstance(store.acquire(keys, "task-2", 0, 5000), Acquired)


def test_renew_in_chunks_reports_each_lock(redis_client: redis.Redis, key_prefix: str) -> None:
    """A batch over two ttls and several 1,000-lock calls keeps every lock's own status."""
    store = LockStore(redis_client)
    held = [_keys(key_prefix, f"c{i}") for i in range(2100)]
    for keys in held:  # 30 s: none expires while the 2,100 acquires run on a loaded machine
        store.acquire(keys, "owner", 0, 30_000)
    redis_client.hset(held[1500].lock, "owner", "thief")
    redis_client.delete(held[2050].lock)
    items = [RenewItem(k.lock, "owner", 0, 60_000 if i % 2 else 50_000) for i, k in enumerate(held)]
    statuses = store.renew(items)
    assert len(statuses) == len(held)
    # the locks not renewed, by index (a diff of two 2,100-item lists takes pytest minutes)
    not_renewed = {i: s for i, s in enumerate(statuses) if s is not RenewStatus.RENEWED}
    assert not_renewed == {1500: RenewStatus.TAKEN, 2050: RenewStatus.GONE}
    assert 50_000 < redis_client.pttl(held[1].lock) <= 60_000
    assert 30_000 < redis_client.pttl(held[2].lock) <= 50_000


def test_acquire_after_releases_first(redis_client: redis.Redis, key_prefix: str) -> None:
    """Queued releases run before the acquire, in order, each owner-checked."""
    store = LockStore(redis_client)
    keys, other = _keys(key_prefix), _keys(key_prefix, "other")
    store.acquire(keys, "run-1", 0, 5000)
    store.acquire(other, "someone-else", 0, 5000)
    released, outcome = store.acquire_after(
        [(keys.lock, "run-1", 0, None), (other.lock, "run-1", 0, None)], keys, "run-2", 0, 5000
    )
    assert released == [ReleaseStatus.RELEASED, ReleaseStatus.TAKEN]
    assert isinstance(outcome, Acquired)
    assert store.holder(keys.lock)["owner"] == "run-2"
    assert store.holder(other.lock)["owner"] == "someone-else"
    assert store.release_many([(keys.lock, "run-2", 0, None), (keys.lock, "run-2", 0, None)]) == [
        ReleaseStatus.RELEASED,
        ReleaseStatus.NOT_HELD,
    ]


def test_a_run_of_the_same_owner_and_generation_is_told_apart_by_its_token(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    """A redelivered copy of a message (same task id, same retries count) may take the lock
    once the first delivery's lock expired (a pause past the ttl). The first delivery's
    renewal must then find its lock taken, and its release leave the copy's lock alone: both
    carry the run's fencing token."""
    store = LockStore(redis_client)
    keys = _keys(key_prefix)
    first = store.acquire(keys, "task-1", 0, 5000)
    assert isinstance(first, Acquired)
    redis_client.delete(keys.lock)  # expired while its holder was paused
    copy = store.acquire(keys, "task-1", 0, 5000)
    assert isinstance(copy, Acquired)
    assert copy.token > first.token
    assert store.renew([RenewItem(keys.lock, "task-1", 0, 5000, first.token)]) == [
        RenewStatus.TAKEN
    ]
    assert store.release(keys.lock, "task-1", 0, first.token) is ReleaseStatus.TAKEN
    assert store.holder(keys.lock)["token"] == str(copy.token)
    assert store.renew([RenewItem(keys.lock, "task-1", 0, 5000, copy.token)]) == [
        RenewStatus.RENEWED
    ]
    assert store.release(keys.lock, "task-1", 0, copy.token) is ReleaseStatus.RELEASED
