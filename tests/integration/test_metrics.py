"""Renewed-late detection, and the Prometheus metrics fed by real lock events (real Redis)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery
from prometheus_client import CollectorRegistry

from celery_singleton_lock import SingletonTask, metrics, signals
from celery_singleton_lock.core.backend import Acquired
from celery_singleton_lock.core.keys import lock_keys
from celery_singleton_lock.core.renewer import HeldLock, Renewer
from celery_singleton_lock.core.store import LockStore
from celery_singleton_lock.events import configure_renewer


def _hold(store: LockStore, prefix: str, ttl_ms: int) -> HeldLock:
    keys = lock_keys(prefix, "tests.late", b"x")
    outcome = store.acquire(keys, "owner-x", 0, ttl_ms)
    assert isinstance(outcome, Acquired)
    return HeldLock(keys.lock, "owner-x", 0, ttl_ms, outcome.token, acquired_at=0.0)


def test_renewal_with_less_than_a_third_left_is_late(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    """On time renewals are quiet; one with under a third of the ttl left sends the signal."""
    store = LockStore(redis_client)
    renewer = Renewer(store)
    configure_renewer(renewer)
    received: list[dict[str, Any]] = []

    def receiver(sender: Any = None, **kwargs: Any) -> None:
        received.append(kwargs)

    signals.lock_renewed_late.connect(receiver, weak=False)
    try:
        held = _hold(store, key_prefix, 3000)
        renewer.add(held)
        renewer.run_due(1.0)  # on time: 2 s were left
        renewer.run_due(3.0)  # 1 s since the last renewal, 2 s left
        assert received == []
        renewer.run_due(5.5)  # 2.5 s since the last renewal: 0.5 s left
    finally:
        signals.lock_renewed_late.disconnect(receiver)
    assert held.renewals == 3
    assert len(received) == 1
    assert received[0]["key"] == held.key
    assert received[0]["task_id"] == "owner-x"
    assert received[0]["left"] == pytest.approx(0.5)


@pytest.fixture
def eager_app(redis_url: str, key_prefix: str) -> Iterator[Celery]:
    """An app whose SingletonTask runs in this process (``apply``) against real Redis."""
    app = Celery("tests.metrics", broker="memory://", set_as_current=False)
    app.conf.singleton_redis_url = redis_url
    app.conf.singleton_key_prefix = key_prefix
    yield app
    app.close()


def test_prometheus_counts_real_lock_events(
    eager_app: Celery, redis_client: redis.Redis, key_prefix: str
) -> None:
    """acquired, released and duplicate_raised are counted; the held gauge goes up and down."""
    registry = CollectorRegistry()
    lock_metrics = metrics.install(registry)
    assert metrics.install(registry) is lock_metrics
    seen: list[float | None] = []

    @eager_app.task(bind=True, base=SingletonTask, name="m.job", singleton_on_duplicate="raise")
    def job(self: Any, account: int) -> int:
        seen.append(registry.get_sample_value("singleton_locks_held", {"task": "m.job"}))
        return int(self.singleton.fencing_token)

    def value(event: str) -> float | None:
        return registry.get_sample_value(
            "singleton_lock_events_total", {"event": event, "task": "m.job"}
        )

    try:
        assert job.apply(args=(1,)).successful()
        assert seen == [1.0]
        assert value("acquired") == 1.0
        assert value("released") == 1.0
        assert registry.get_sample_value("singleton_locks_held", {"task": "m.job"}) == 0.0

        keys = job.singleton_keys((2,), {})
        LockStore(redis_client).acquire(keys, "someone-else", 0, 60_000)
        assert job.apply(args=(2,)).failed()
        assert value("duplicate_raised") == 1.0
        assert value("acquired") == 1.0
    finally:
        lock_metrics.close()
    assert job.apply(args=(3,)).successful()
    assert value("acquired") == 1.0  # closed: no longer counting
