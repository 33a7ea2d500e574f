"""probe.lua on real Redis: what an acquire would answer, read without writing anything.

For each state a lock can be in (absent, held, in an at-least window, every permit slot held,
one slot free, held by the asking owner, its completion record), the probe's answer is the
acquire's own: the same holder, generation, token and window flag (the remaining time within
the moments between the two calls), or None where the acquire takes the lock; and the probe
changes no key. The main process's decision on top of it (worker/mainskip.py) goes through
the gate's ``decide`` (duplicates/gate.py), as the executing process's does: a skip only when
another run holds it, not the asking message's earlier delivery nor its parent. A probe of a
server that answers nothing fails within the prober's timeout.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from celery import Celery

from celery_singleton_lock import LockUnavailableError, SingletonTask
from celery_singleton_lock.core import connection
from celery_singleton_lock.core.backend import Acquired, Completed, Contended
from celery_singleton_lock.core.completion import Ending
from celery_singleton_lock.core.connection import PROBE_TIMEOUT_S, prober_for
from celery_singleton_lock.core.keys import LockKeys, lock_keys
from celery_singleton_lock.core.probe import probe
from celery_singleton_lock.core.sendahead import SendAhead
from celery_singleton_lock.core.store import LockStore
from celery_singleton_lock.duplicates.gate import decide
from celery_singleton_lock.duplicates.policy import Call, Fate
from tests.support.servers import RedisServer

TTL_MS = 60_000
ME = "the-message"


def _snapshot(client: redis.Redis, prefix: str) -> dict[bytes, tuple[bytes | None, bool]]:
    """Every key under ``prefix``: its serialized value, and whether it expires."""
    return {
        key: (client.dump(key), client.pttl(key) > 0)
        for key in client.scan_iter(match=f"{prefix}*", count=1000)
    }


def _same(probed: Contended | None, acquired: Acquired | Contended) -> bool:
    """Whether the probe answered what the acquire then did."""
    if probed is None:
        return isinstance(acquired, Acquired)
    if type(probed) is not type(acquired):
        return False
    assert isinstance(acquired, Contended)
    return (
        probed.holder,
        probed.holder_generation,
        probed.holder_token,
        probed.finished,
    ) == (
        acquired.holder,
        acquired.holder_generation,
        acquired.holder_token,
        acquired.finished,
    ) and abs(probed.pttl_ms - acquired.pttl_ms) < 5_000


@pytest.fixture
def store(redis_client: redis.Redis) -> LockStore:
    return LockStore(redis_client)


@pytest.fixture
def prober(redis_url: str) -> Iterator[SendAhead]:
    connection.reset()
    prober = prober_for(redis_url)
    assert prober is not None
    yield prober
    connection.reset()


def _held_by_other(store: LockStore, keys: LockKeys) -> None:
    assert isinstance(store.acquire(keys, "another-run", 0, TTL_MS), Acquired)


def _window(store: LockStore, keys: LockKeys) -> None:
    taken = store.acquire(keys, "a-finished-run", 0, TTL_MS)
    assert isinstance(taken, Acquired)
    store.release(keys.lock, "a-finished-run", 0, taken.token, Ending(at_least_ms=TTL_MS))


def _all_slots_held(store: LockStore, keys: LockKeys) -> None:
    for owner in ("run-1", "run-2", "run-3"):
        assert isinstance(store.acquire(keys, owner, 0, TTL_MS), Acquired)


def _one_slot_free(store: LockStore, keys: LockKeys) -> None:
    _all_slots_held(store, keys)
    store.release(keys.slot(2), "run-2", 0)


def _held_by_me(store: LockStore, keys: LockKeys) -> None:
    assert isinstance(store.acquire(keys, ME, 0, TTL_MS), Acquired)


def _completed(store: LockStore, keys: LockKeys) -> None:
    taken = store.acquire(keys, ME, 0, TTL_MS)
    assert isinstance(taken, Acquired)
    store.release(keys.lock, ME, 0, taken.token, Ending(completion_ttl_ms=TTL_MS))


def _absent(store: LockStore, keys: LockKeys) -> None:
    return None


#: each state: how it is made, the permits, and the probe's answer (its type, its holder)
STATES: dict[str, tuple[Callable[[LockStore, LockKeys], None], int, type | None, str | None]] = {
    "held": (_held_by_other, 1, Contended, "another-run"),
    "window": (_window, 1, Contended, "a-finished-run"),
    "permits all held": (_all_slots_held, 3, Contended, "run-1"),
    "permits one free": (_one_slot_free, 3, None, None),
    "own id": (_held_by_me, 1, Contended, ME),
    "own id, one of three permits": (_held_by_me, 3, Contended, ME),
    "completion record": (_completed, 1, Completed, ME),
    "absent": (_absent, 1, None, None),
}


@pytest.mark.parametrize("state", list(STATES))
def test_probe_answers_what_the_acquire_does_and_writes_nothing(
    state: str,
    store: LockStore,
    prober: SendAhead,
    redis_client: redis.Redis,
    key_prefix: str,
) -> None:
    make, permits, kind, holder = STATES[state]
    keys = lock_keys(key_prefix, "t.probe", state.encode()).with_permits(permits)
    make(store, keys)
    before = _snapshot(redis_client, key_prefix)

    probed = probe(prober, keys, ME, 0)

    assert _snapshot(redis_client, key_prefix) == before  # read only
    if kind is None:
        assert probed is None
    else:
        assert type(probed) is kind
        assert probed is not None
        assert probed.holder == holder
        assert probed.finished == (state == "window")
        assert 0 < probed.pttl_ms <= TTL_MS
    # a later generation of the same message re-enters its own slot: no skip either
    if state.startswith("own id"):
        assert probe(prober, keys, ME, 1) is None
    assert _same(probed, store.acquire(keys, ME, 0, TTL_MS))


@pytest.fixture
def task(redis_url: str, key_prefix: str) -> Iterator[Any]:
    app = Celery("tests.probe", broker="memory://", set_as_current=False)
    app.conf.singleton_redis_url = redis_url
    app.conf.singleton_key_prefix = key_prefix

    @app.task(base=SingletonTask, name="t.probe", shared=False)
    def probed(key: str) -> None:
        return None

    yield probed
    app.close()


@pytest.mark.parametrize(
    ("holder", "parent", "skip"),
    [("another-run", "its-parent", True), (ME, None, False), ("its-parent", "its-parent", False)],
    ids=["another run", "own id", "parent id"],
)
def test_only_another_runs_lock_is_a_skip(  # noqa: PLR0917 - parameters and fixtures
    holder: str,
    parent: str | None,
    skip: bool,
    task: Any,
    store: LockStore,
    prober: SendAhead,
) -> None:
    keys = task.singleton_keys(("k",), {})
    assert isinstance(store.acquire(keys, holder, 0, TTL_MS), Acquired)
    probed = probe(prober, keys, ME, 0)
    assert probed is not None
    assert _skips(task, probed, parent) is skip


def test_a_completion_record_is_no_skip(task: Any, store: LockStore, prober: SendAhead) -> None:
    """The executing process drops such a copy: the main process leaves it to it."""
    keys = task.singleton_keys(("done",), {})
    _completed(store, keys)
    _held_by_other(store, keys)  # another run holds the lock now: the record still wins
    probed = probe(prober, keys, ME, 0)
    assert type(probed) is Completed
    assert _skips(task, probed, None) is False


def test_probe_of_a_silent_server_fails_within_its_timeout(
    private_redis: RedisServer, key_prefix: str
) -> None:
    connection.reset()
    try:
        prober = prober_for(private_redis.url)
        assert prober is not None
        keys = lock_keys(key_prefix, "t.probe", b"silent")
        assert probe(prober, keys, ME, 0) is None  # connected, script loaded
        private_redis.pause()
        try:
            started = time.monotonic()
            with pytest.raises(LockUnavailableError, match="could not probe"):
                probe(prober, keys, ME, 0)
            assert time.monotonic() - started < PROBE_TIMEOUT_S + 0.5
        finally:
            private_redis.resume()
        assert probe(prober, keys, ME, 0) is None  # and it connects again
    finally:
        connection.reset()


@pytest.mark.parametrize(
    "url", ["redis+cluster://127.0.0.1:1/0", "redis+redlock://127.0.0.1:1,127.0.0.1:2,127.0.0.1:3"]
)
def test_no_prober_where_a_probe_is_not_one_bounded_round_trip(url: str) -> None:
    assert prober_for(url) is None


def _skips(task: Any, probed: Contended, parent: str | None) -> bool:
    """Whether the gate skips a call of ``ME`` that found ``probed``."""
    opts = task.singleton_options()
    action = decide(probed, Call(ME, parent), opts, task._singleton_parts().policy)
    return action.fate is Fate.SKIP
