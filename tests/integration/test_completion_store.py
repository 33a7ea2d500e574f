"""The completion record and the at-least window in every lock store: one server, a Sentinel's
master, a Redis Cluster and Redlock. Each store's scripts, as the renewer and the
worker's main process call them."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest
import redis

from celery_singleton_lock.core.backend import (
    Acquired,
    Completed,
    Contended,
    LockBackend,
    ReleaseStatus,
    RenewItem,
    RenewStatus,
)
from celery_singleton_lock.core.completion import Ending
from celery_singleton_lock.core.connection import new_store
from celery_singleton_lock.core.keys import LockKeys, lock_keys
from tests.support.prefixes import delete_prefix
from tests.support.servers import RedisServer
from tests.support.topologies import sentinels_and_cluster
from tests.support.waiting import wait_for

TTL_MS = 10_000
KEEP = Ending(completion_ttl_ms=60_000)
WINDOW = Ending(at_least_ms=60_000)


@pytest.fixture(scope="module")
def stores(redis_url: str) -> Iterator[dict[str, LockBackend]]:
    """A store of each kind, on private servers (the single server: the shared one)."""
    with sentinels_and_cluster() as (sentinels, cluster):
        masters = [RedisServer() for _ in range(3)]
        try:
            hosts = ",".join(f"127.0.0.1:{m.port}" for m in masters)
            yield {
                "single": new_store(redis_url),
                "sentinel": new_store(sentinels.url()),
                "cluster": new_store(cluster.url),
                "redlock": new_store(f"redis+redlock://{hosts}/0?master_timeout=1"),
            }
        finally:
            for master in masters:
                master.close()


KINDS = ["single", "sentinel", "cluster", "redlock"]


@pytest.fixture
def keys(redis_client: redis.Redis) -> Iterator[LockKeys]:
    """A lock's keys under a private prefix; every key under it deleted afterwards (the private
    servers go with the module)."""
    prefix = f"cslt-done:{uuid.uuid4().hex[:8]}:"
    yield lock_keys(prefix, "t.done", uuid.uuid4().bytes)
    delete_prefix(redis_client, prefix)


@pytest.mark.parametrize("kind", KINDS)
def test_a_finished_message_is_completed_and_its_retry_runs(
    stores: dict[str, LockBackend], keys: LockKeys, kind: str
) -> None:
    """The release records the completion; the same owner and generation is then Completed
    (nothing written), a later generation takes the lock, another owner too."""
    store = stores[kind]
    taken = store.acquire(keys, "m1", 0, TTL_MS)
    assert isinstance(taken, Acquired)
    assert store.release(keys.lock, "m1", 0, taken.token, KEEP) is ReleaseStatus.RELEASED
    again = store.acquire(keys, "m1", 0, TTL_MS)
    assert isinstance(again, Completed)
    assert isinstance(again, Contended)  # not taken: every caller that only knows Contended
    assert (again.holder, again.holder_generation) == ("m1", 0)
    assert 0 < again.pttl_ms <= 60_000
    assert store.holder(keys.lock) == {}
    retried = store.acquire(keys, "m1", 1, TTL_MS)
    assert isinstance(retried, Acquired)
    assert store.release(keys.lock, "m1", 1, retried.token, KEEP) is ReleaseStatus.RELEASED
    assert isinstance(store.acquire(keys, "m1", 0, TTL_MS), Completed)
    other = store.acquire(keys, "m2", 0, TTL_MS)
    assert isinstance(other, Acquired)
    store.release(keys.lock, "m2", 0, other.token)


@pytest.mark.parametrize("kind", KINDS)
def test_a_window_blocks_everyone_and_no_script_extends_or_deletes_it(
    stores: dict[str, LockBackend], keys: LockKeys, kind: str
) -> None:
    """The release keeps the lock as a window: acquires meet a finished holder (the same
    owner's later generation too), renewals and both releases leave it as it is."""
    store = stores[kind]
    taken = store.acquire(keys, "w1", 0, TTL_MS)
    assert isinstance(taken, Acquired)
    assert store.release(keys.lock, "w1", 0, taken.token, WINDOW) is ReleaseStatus.RELEASED
    held = store.holder(keys.lock)
    assert held["owner"] == "w1"
    assert int(held["ended"]) >= int(held["since"])
    for owner, generation in (("w2", 0), ("w1", 1), ("w1", 0)):
        outcome = store.acquire(keys, owner, generation, TTL_MS)
        assert isinstance(outcome, Contended)
        assert not isinstance(outcome, Completed)
        assert outcome.finished
        assert outcome.holder == "w1"
        assert TTL_MS < outcome.pttl_ms <= 60_000
    item = RenewItem(keys.lock, "w1", 0, 120_000, taken.token)
    assert store.renew([item]) == [RenewStatus.GONE]
    assert store.release(keys.lock, "w1", 0, taken.token) is ReleaseStatus.NOT_HELD
    assert store.release_lost(keys.lock, "w1", 0) is ReleaseStatus.NOT_HELD
    assert store.holder(keys.lock)["ended"] == held["ended"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_window_ends_at_least_after_the_run_started(
    stores: dict[str, LockBackend], keys: LockKeys, kind: str
) -> None:
    """A short window expires by itself, measured from the run's start; the main process's
    release of a lost run leaves one too; a run longer than the window deletes its lock."""
    store = stores[kind]
    taken = store.acquire(keys, "s1", 0, TTL_MS)
    assert isinstance(taken, Acquired)
    assert store.release_lost(keys.lock, "s1", 0, 400) is ReleaseStatus.RELEASED
    assert store.holder(keys.lock).get("ended")
    wait_for(lambda: store.holder(keys.lock) == {}, 5, "the window to end")
    late = store.acquire(keys, "s2", 0, TTL_MS)
    assert isinstance(late, Acquired)
    time.sleep(0.01)  # not a wait for an event: the run must outlast its 1 ms window
    assert store.release(keys.lock, "s2", 0, late.token, Ending(0, 1)) is ReleaseStatus.RELEASED
    assert store.holder(keys.lock) == {}
