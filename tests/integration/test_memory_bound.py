"""What a run leaves in Redis once it ended, against real Redis: every key of its lock expires
within the lock's ttl + the fence margin (unless the task asked for more: a completion record),
checked exactly by each key's PTTL right after the run; and the lock hash stays within its
documented size whatever the metadata (docs/configuration.md, "Memory per key")."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery

from celery_singleton_lock import SingletonTask
from celery_singleton_lock.core.backend import (
    MAX_META_FIELDS,
    MAX_META_NAME_BYTES,
    MAX_META_VALUE_BYTES,
    Acquired,
)
from celery_singleton_lock.core.keys import MAX_PREFIX_CHARS, lock_keys
from celery_singleton_lock.core.store import LockStore

TTL_S = 0.5
MARGIN_S = 0.25
BOUND_MS = round((TTL_S + MARGIN_S) * 1000)
#: the most a held lock's hash takes (MEMORY USAGE), as docs/configuration.md states
LOCK_HASH_MAX_BYTES = 3072
#: the tasks, by their options: acked early, so no completion record unless asked
VARIANTS: dict[str, dict[str, Any]] = {
    "one lock": {},
    "permits": {"singleton_permits": 3},
    "scope": {"singleton_scope": "mem-scope"},
    "publish markers": {"singleton_lock_on": "publish"},
    "coalesce": {"singleton_on_duplicate": "coalesce"},
}


@pytest.fixture
def eager_app(redis_url: str, key_prefix: str) -> Iterator[Celery]:
    app = Celery("memory-bound", broker="memory://", set_as_current=False)
    app.conf.task_always_eager = True
    app.conf.singleton_redis_url = redis_url
    app.conf.singleton_key_prefix = f"{key_prefix}lock:"
    app.conf.singleton_ttl = TTL_S
    app.conf.singleton_fence_margin = MARGIN_S
    yield app
    app.close()


def _left(client: redis.Redis, prefix: str) -> dict[str, int]:
    return {
        key.decode(): client.pttl(key) for key in client.scan_iter(count=1000, match=f"{prefix}*")
    }


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_finished_run_leaves_nothing_past_ttl_and_margin(
    eager_app: Celery, redis_client: redis.Redis, key_prefix: str, forget_stores: None, variant: str
) -> None:
    """Runs of a task acked early, each variant's keys (lock or slots, counter, queued marker):
    right after the runs, every key left expires within ttl + margin, none is kept longer."""

    @eager_app.task(
        bind=True, base=SingletonTask, name=f"m.{variant}", shared=False, **VARIANTS[variant]
    )
    def job(self: Any, account: int) -> int:
        assert self.singleton.held
        return account

    for account in range(5):
        assert job.apply_async((account,)).get() == account
    left = _left(redis_client, key_prefix)
    assert sorted(key.rsplit(":", 1)[1] for key in left) == ["fence"] * 5, left
    assert all(0 < pttl <= BOUND_MS for pttl in left.values()), left


def test_a_completion_record_stays_as_long_as_asked(
    eager_app: Celery, redis_client: redis.Redis, key_prefix: str, forget_stores: None
) -> None:
    """A completion record asked for outlives the bound by exactly what the task asked."""

    @eager_app.task(
        bind=True, base=SingletonTask, name="m.recorded", shared=False, singleton_completion_ttl=30
    )
    def job(self: Any, account: int) -> int:
        return account

    job.apply_async((1,)).get()
    left = _left(redis_client, key_prefix)
    done = [pttl for key, pttl in left.items() if ":done:" in key]
    assert len(done) == 1
    assert 29_000 < done[0] <= 30_000
    assert all(0 < pttl <= BOUND_MS for key, pttl in left.items() if ":done:" not in key), left


def test_the_lock_hash_is_bounded_whatever_the_metadata(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    """A huge hostname, task name and argument preview, and more fields than kept, on the
    longest key there is: each value is cut at its byte bound (never inside a character) and
    the hash takes at most 3 kB."""
    prefix = key_prefix + "p" * (MAX_PREFIX_CHARS - len(key_prefix))
    keys = lock_keys(prefix, "t" * 1000, b"account-1")
    huge = "é" * 50_000  # 100 kB of UTF-8
    meta = {"task": huge, "host": huge, "pid": huge, "args": huge}
    meta.update({f"extra-{i}-" + "n" * 100: huge for i in range(20)})
    store = LockStore(redis_client)
    assert isinstance(
        store.acquire(keys, "8d2d3bce-1f71-4b1f-9a49-31f8d0a1a6f1", 0, 5000, meta), Acquired
    )
    stored = store.holder(keys.lock)
    kept = {
        name: value
        for name, value in stored.items()
        if name not in ("owner", "gen", "token", "since", "ttl")
    }
    assert len(kept) == MAX_META_FIELDS
    assert kept["host"] == "é" * ((MAX_META_VALUE_BYTES - 3) // 2) + "..."
    assert all(len(name.encode()) <= MAX_META_NAME_BYTES for name in kept)
    assert all(len(value.encode()) <= MAX_META_VALUE_BYTES for value in kept.values())
    assert redis_client.memory_usage(keys.lock, samples=0) <= LOCK_HASH_MAX_BYTES
    store.release(keys.lock, "8d2d3bce-1f71-4b1f-9a49-31f8d0a1a6f1", 0)
