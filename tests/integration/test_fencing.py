"""Fenced writes against real Redis: ``fenced_set``/``fenced_get``, and the SQL example
(``examples/fenced_sql.py``, stdlib sqlite3) driven by real tokens from ``LockStore.acquire``."""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from celery_singleton_lock import FencedWrite, fenced_get, fenced_set
from celery_singleton_lock.core.backend import Acquired
from celery_singleton_lock.core.keys import LockKeys, lock_keys
from celery_singleton_lock.core.store import LockStore
from examples.fenced_sql import create_schema, fenced_update, fenced_upsert, read_account
from tests.support.servers import RedisServer


@pytest.fixture
def store(redis_client: redis.Redis) -> LockStore:
    """A lock store on the shared Redis (keys only under ``key_prefix``)."""
    return LockStore(redis_client)


@pytest.fixture
def keys(key_prefix: str) -> LockKeys:
    """The keys of one lock, under ``key_prefix``."""
    return lock_keys(f"{key_prefix}lock:", "t.fenced", b"account-1")


@pytest.fixture
def db(tmp_path: Path) -> Iterator[sqlite3.Connection]:
    """A sqlite database file with the example's ``accounts`` table."""
    conn = sqlite3.connect(tmp_path / "accounts.db")
    create_schema(conn)
    yield conn
    conn.close()


def _acquire(store: LockStore, keys: LockKeys, owner: str, ttl_ms: int = 200) -> int:
    outcome = store.acquire(keys, owner, 0, ttl_ms)
    assert isinstance(outcome, Acquired), outcome
    return outcome.token


def _take_over(store: LockStore, keys: LockKeys, old: str, new: str) -> tuple[int, int]:
    """``old`` takes the lock, loses it (its ttl runs out), ``new`` takes it: both tokens."""
    old_token = _acquire(store, keys, old, ttl_ms=100)
    time.sleep(0.15)
    new_token = _acquire(store, keys, new, ttl_ms=5000)
    assert new_token > old_token
    return old_token, new_token


# -- fenced_set / fenced_get ----------------------------------------------------------------


def test_fenced_set_newer_token_wins(redis_client: redis.Redis, key_prefix: str) -> None:
    """A write with a larger token replaces the record; fenced_get returns value and token."""
    key = f"{key_prefix}record"
    assert fenced_get(redis_client, key) == (None, None)
    assert fenced_set(redis_client, key, "one", 10) == FencedWrite(True, 10)
    assert fenced_set(redis_client, key, b"two", 11) == FencedWrite(True, 11)
    assert fenced_get(redis_client, key) == (b"two", 11)
    assert redis_client.pttl(key) == -1  # no ttl unless asked for


def test_fenced_set_rejects_older_and_equal_tokens(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    """A write with a smaller or equal token is refused and reports the accepted token."""
    key = f"{key_prefix}record"
    assert fenced_set(redis_client, key, "new", 20).written
    assert fenced_set(redis_client, key, "stale", 19) == FencedWrite(False, 20)
    assert fenced_set(redis_client, key, "again", 20) == FencedWrite(False, 20)
    assert fenced_get(redis_client, key) == (b"new", 20)


def test_fenced_set_ttl(redis_client: redis.Redis, key_prefix: str) -> None:
    """ttl_ms sets the record's expiry on every accepted write; a refused write keeps it."""
    key = f"{key_prefix}record"
    assert fenced_set(redis_client, key, "v", 5, ttl_ms=60_000).written
    assert 0 < redis_client.pttl(key) <= 60_000
    assert not fenced_set(redis_client, key, "stale", 4, ttl_ms=100).written
    assert redis_client.pttl(key) > 1000
    assert fenced_set(redis_client, key, "short", 6, ttl_ms=150).written
    time.sleep(0.3)
    assert fenced_get(redis_client, key) == (None, None)


@pytest.mark.parametrize("token", [0, -1, True, "5", 1.5, None])
def test_fenced_set_refuses_a_bad_token(
    redis_client: redis.Redis, key_prefix: str, token: object
) -> None:
    """A token that is not a positive int is a ValueError, and nothing is written."""
    key = f"{key_prefix}record"
    with pytest.raises(ValueError, match="token"):
        fenced_set(redis_client, key, "v", token)  # type: ignore[arg-type]
    assert not redis_client.exists(key)


def test_stale_holder_redis_write_rejected(
    store: LockStore, keys: LockKeys, redis_client: redis.Redis, key_prefix: str
) -> None:
    """With real lock tokens, the holder that lost its lock cannot overwrite the new holder."""
    old, new = _take_over(store, keys, "run-a", "run-b")
    record = f"{key_prefix}balance"
    assert fenced_set(redis_client, record, "from b", new).written
    assert fenced_set(redis_client, record, "from a (stale)", old) == FencedWrite(False, new)
    assert fenced_get(redis_client, record) == (b"from b", new)


def test_tokens_still_increase_after_redis_forgets(private_redis: RedisServer) -> None:
    """A lock Redis restarted without persistence issues a larger token: stale writes lose."""
    client = private_redis.client()
    try:
        store = LockStore(client)
        keys = lock_keys("fenced:", "t.fenced", b"account-1")
        old = _acquire(store, keys, "run-a", ttl_ms=60_000)
        private_redis.restart()  # the lock and its fencing counter are gone
        new = _acquire(store, keys, "run-b", ttl_ms=60_000)
        assert new > old
        assert fenced_set(client, "record", "from b", new).written
        assert not fenced_set(client, "record", "from a", old).written
    finally:
        client.close()


@pytest.mark.parametrize("permits", [1, 3])
def test_the_counter_expires_ttl_and_margin_after_its_token(
    redis_client: redis.Redis, key_prefix: str, permits: int
) -> None:
    """The fencing counter lives the lock's ttl + the fence margin after its token: exactly that
    after an acquire; longer by how far the token is ahead of the server's clock (a counter
    written before the clock stepped back), so when it is gone the clock has passed the token
    by ttl + margin and the next token, taken from the clock, is larger."""
    store = LockStore(redis_client, fence_margin_ms=1000)
    keys = lock_keys(f"{key_prefix}lock:", "t.fenced", b"a").with_permits(permits)
    _acquire(store, keys, "run-a", ttl_ms=2000)
    assert 2900 < redis_client.pttl(keys.fence) <= 3000
    seconds, micros = redis_client.time()
    ahead = (seconds * 10**6 + micros) + 50 * 10**6  # as if the clock stepped back 50 s
    redis_client.set(keys.fence, ahead)
    for slot in keys.slots:
        redis_client.delete(slot)
    assert _acquire(store, keys, "run-b", ttl_ms=2000) == ahead + 1
    assert 52_900 < redis_client.pttl(keys.fence) <= 53_000


# -- SQL (examples/fenced_sql.py) -----------------------------------------------------------


def test_sql_stale_holder_update_rejected(
    store: LockStore, keys: LockKeys, db: sqlite3.Connection
) -> None:
    """UPDATE ... AND fence_token < ? lets the new holder write and refuses the stale one."""
    with db:
        db.execute("INSERT INTO accounts (id, balance) VALUES (1, 0)")
    old = _acquire(store, keys, "run-a", ttl_ms=100)
    assert fenced_update(db, 1, 100, old)  # A writes while it holds the lock
    time.sleep(0.15)  # A stalls past its ttl
    new = _acquire(store, keys, "run-b", ttl_ms=5000)
    assert fenced_update(db, 1, 200, new)
    assert not fenced_update(db, 1, 999, old)  # A resumes: its write is refused
    assert read_account(db, 1) == (200, new)


def test_sql_equal_token_and_missing_row(
    store: LockStore, keys: LockKeys, db: sqlite3.Connection
) -> None:
    """The same token cannot write twice, and fenced_update never creates a row."""
    token = _acquire(store, keys, "run-a")
    assert not fenced_update(db, 7, 1, token)
    assert read_account(db, 7) is None
    with db:
        db.execute("INSERT INTO accounts (id, balance) VALUES (7, 0)")
    assert fenced_update(db, 7, 1, token)
    assert not fenced_update(db, 7, 2, token)
    assert read_account(db, 7) == (1, token)


def test_sql_upsert_creates_then_fences(
    store: LockStore, keys: LockKeys, db: sqlite3.Connection
) -> None:
    """fenced_upsert creates a missing row, then applies the same token rule as the update."""
    old, new = _take_over(store, keys, "run-a", "run-b")
    assert fenced_upsert(db, 3, 50, new)
    assert not fenced_upsert(db, 3, 40, old)
    assert not fenced_upsert(db, 3, 60, new)
    assert read_account(db, 3) == (50, new)


@pytest.mark.parametrize("token", [0, -5, True, None])
def test_sql_refuses_a_bad_token(db: sqlite3.Connection, token: object) -> None:
    """A token that is not a positive int is a ValueError before anything is written."""
    with pytest.raises(ValueError, match="token"):
        fenced_upsert(db, 1, 1, token)  # type: ignore[arg-type]
    assert read_account(db, 1) is None
