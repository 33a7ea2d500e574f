"""Publish-time dedup where it meets the rest of Celery: the serializer between the publisher
and the worker, and canvas (chains, link callbacks) publishing the next step of a key while the
step before it still holds the lock."""

from __future__ import annotations

import datetime as dt
import decimal
import enum
import itertools
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import pytest
import redis
from celery import Celery, chain
from kombu.exceptions import EncodeError

from celery_singleton_lock import SingletonKeyError, SingletonTask, skip_info
from celery_singleton_lock.core.backend import Acquired, ReleaseStatus
from celery_singleton_lock.core.keys import queued_key
from celery_singleton_lock.core.store import LockStore
from tests.support.basic_app import DEFAULT_QUEUE, SINGLETON_APP, close_app, history_key, make_app
from tests.support.history import Execution, load_history
from tests.support.waiting import wait_for
from tests.support.workers import WorkerFactory

#: Every serializer Celery ships a content type for (msgpack and yaml are test dependencies).
SERIALIZERS = ("json", "pickle", "msgpack", "yaml")
CONTENT_TYPES = [
    "application/json",
    "application/x-python-serialize",
    "application/x-msgpack",
    "application/x-yaml",
]


class Color(enum.Enum):
    RED = "red"


class Level(enum.IntEnum):
    HIGH = 3


class Point(NamedTuple):
    x: int
    y: int


class MyStr(str):
    pass


#: One value of each type family of tests/unit/test_keys.py.
FAMILIES: dict[str, Any] = {
    "none": None,
    "bool": True,
    "int": 7,
    "big int": 2**70,
    "float": 1.5,
    "str": "naïve ☃",
    "bytes": b"\x00\xffraw",
    "list": [1, "a"],
    "tuple": (1, 2),
    "nested tuple": {"a": (1, (2, 3))},
    "dict, str keys": {"b": 1, "a": 2},
    "dict, int keys": {1: "a", 2: "b"},
    "set": {1, 2},
    "uuid": uuid.UUID("12345678-1234-5678-1234-567812345678"),
    "datetime, naive": dt.datetime(2026, 11, 24, 12, 30, 1, 5),
    "datetime, aware": dt.datetime(2026, 11, 24, 12, 30, tzinfo=dt.timezone(dt.timedelta(hours=2))),
    "date": dt.date(2026, 11, 24),
    "time": dt.time(12, 30, 1),
    "timedelta": dt.timedelta(days=1, microseconds=5),
    "decimal": decimal.Decimal("1.10"),
    "enum": Color.RED,
    "int enum": Level.HIGH,
    "str subclass": MyStr("x"),
    "named tuple": Point(1, 2),
}


def _client_app(redis_url: str, prefix: str, serializer: str = "json") -> Celery:
    """The publishing side of singleton_app, with its tasks defined on it (same keys)."""
    app = make_app(redis_url, prefix)
    app.conf.singleton_redis_url = redis_url
    app.conf.singleton_key_prefix = f"{prefix}lock:"
    app.conf.task_serializer = serializer
    app.conf.accept_content = CONTENT_TYPES
    return app


@pytest.fixture
def make_client(redis_url: str, key_prefix: str) -> Iterator[Callable[..., Celery]]:
    apps: list[Celery] = []

    def make(serializer: str = "json") -> Celery:
        app = _client_app(redis_url, key_prefix, serializer)
        apps.append(app)
        return app

    yield make
    for app in apps:
        app.control.purge()
        close_app(app)


def _quiet_task(app: Celery, lock_on: str = "publish") -> Any:
    @app.task(
        bind=True,
        base=SingletonTask,
        name="t.publish_quiet",
        shared=False,
        singleton_key_args=("key",),
        singleton_lock_on=lock_on,
        ignore_result=True,
    )
    def publish_quiet(self: Any, key: Any, seconds: float = 0.0) -> None:
        """Runs on the worker only."""

    return publish_quiet


def _step_task(app: Celery, lock_on: str) -> Any:
    @app.task(
        bind=True,
        base=SingletonTask,
        name="t.tenant_step",
        shared=False,
        singleton_key_args=("tenant",),
        singleton_lock_on=lock_on,
    )
    def tenant_step(self: Any, tenant: str, step: int, seconds: float = 0.0) -> int:
        """Runs on the worker only."""
        return step

    return tenant_step


def _markers(client: redis.Redis, prefix: str) -> list[bytes]:
    return sorted(client.scan_iter(count=1000, match=f"{prefix}lock:*:queued"))


@pytest.mark.parametrize("serializer", SERIALIZERS)
def test_marker_is_set_under_the_key_the_worker_derives(
    make_client: Callable[..., Celery],
    redis_client: redis.Redis,
    key_prefix: str,
    serializer: str,
) -> None:
    """For every type family, the queued marker a delay() sets is under the key a worker derives
    from the message as the broker delivers it (through the task's serializer), so the run
    clears it and the "running" check finds the run; an argument the serializer refuses fails
    the delay() and leaves no marker."""
    app = make_client(serializer)
    task = _quiet_task(app)
    mismatched: dict[str, tuple[list[bytes], bytes]] = {}
    refused: list[str] = []
    with app.connection_for_read() as connection:
        queue = connection.SimpleQueue(DEFAULT_QUEUE, no_ack=True, accept=CONTENT_TYPES)
        try:
            for family, value in FAMILIES.items():
                try:
                    result = task.apply_async((value,))
                except (EncodeError, SingletonKeyError):  # cannot reach a worker intact
                    refused.append(family)
                    assert _markers(redis_client, key_prefix) == [], family
                    continue
                message = queue.get(timeout=10)
                args, kwargs, _embed = message.decode()
                worker_marker = queued_key(task.singleton_keys(args, kwargs).lock)
                if redis_client.get(worker_marker) != result.id.encode():
                    found = _markers(redis_client, key_prefix)
                    mismatched[family] = (found, worker_marker.encode())
                for marker in _markers(redis_client, key_prefix):  # the next value may be equal
                    redis_client.delete(marker)
        finally:
            queue.close()
    assert sorted(mismatched) == [], f"{serializer}: marker elsewhere: {mismatched}"
    if serializer == "pickle":
        assert refused == []  # pickle carries every family as it is


def _runs(client: redis.Redis, prefix: str) -> list[Execution]:
    return sorted(load_history(client, history_key(prefix)), key=lambda e: e.start_us)


def test_a_run_clears_its_marker_when_json_changed_its_argument(
    worker_factory: WorkerFactory,
    make_client: Callable[..., Celery],
    redis_client: redis.Redis,
    key_prefix: str,
) -> None:
    """JSON turns the tuple (1, 2) into [1, 2]: the run must still clear the marker its delay()
    set, so the next delay((1, 2)) after the run is published and runs (ignore_result: nothing
    else would ever let the key go before publish_ttl)."""
    app = make_client("json")
    task = _quiet_task(app)
    worker = worker_factory.start(SINGLETON_APP, pool="prefork", concurrency=1)
    worker.wait_ready(app)
    first = task.delay((1, 2))
    wait_for(lambda: [e for e in _runs(redis_client, key_prefix) if e.finished], 20, "run", worker)
    wait_for(lambda: not _markers(redis_client, key_prefix), 10, "the marker cleared", worker)
    # the release is written after the body: until it lands, the lock is the running holder's
    locks = f"{key_prefix}lock:*:lock"
    wait_for(lambda: not list(redis_client.scan_iter(match=locks)), 10, "the lock released", worker)
    second = task.delay((1, 2))
    assert second.id != first.id
    wait_for(lambda: len(_runs(redis_client, key_prefix)) == 2, 20, "a second run", worker)


@pytest.mark.parametrize("lock_on", ["execute", "publish"])
def test_chain_steps_and_callbacks_of_one_key_all_run_in_order(
    worker_factory: WorkerFactory,
    make_client: Callable[..., Celery],
    redis_client: redis.Redis,
    key_prefix: str,
    lock_on: str,
) -> None:
    """Each step of (f.si("acme", 1) | f.si("acme", 2) | f.si("acme", 3)) is published while the
    step before it still holds the tenant's lock: every step runs, in order, one at a time; and a
    link callback of the same key runs after its parent."""
    app = make_client("json")
    step = _step_task(app, lock_on)
    worker = worker_factory.start(
        SINGLETON_APP, pool="prefork", concurrency=2, env={"SINGLETON_TEST_LOCK_ON": lock_on}
    )
    worker.wait_ready(app)
    rounds = 4
    for n in range(rounds):
        tenant = f"acme{n}"
        result = chain(step.si(tenant, 1), step.si(tenant, 2), step.si(tenant, 3))()
        assert result.get(timeout=30) == 3
        # another tenant: right after a run's result is ready its lock may still be held, and
        # a new call then meets it (the documented window for callers, not for callbacks)
        parent = step.apply_async((f"{tenant}-link", 1), link=step.si(f"{tenant}-link", 2))
        assert parent.get(timeout=30) == 1
        wait_for(
            lambda t=tenant: [e for e in _runs(redis_client, key_prefix) if e.key == f"{t}-link:2"],
            30,
            f"the link callback of {tenant}",
            worker,
        )
    runs = _runs(redis_client, key_prefix)
    for n in range(rounds):
        for tenant, steps in ((f"acme{n}", 3), (f"acme{n}-link", 2)):
            tenant_runs = [e for e in runs if e.key.rsplit(":", 1)[0] == tenant]
            assert [e.key for e in tenant_runs] == [f"{tenant}:{i}" for i in range(1, steps + 1)]
            for before, after in itertools.pairwise(tenant_runs):
                assert before.end_us is not None
                assert before.end_us <= after.start_us, "two steps of one key overlapped"
    assert _markers(redis_client, key_prefix) == []


@pytest.mark.slow(seconds=8)
def test_a_message_waits_for_the_run_that_published_it(
    worker_factory: WorkerFactory,
    make_client: Callable[..., Celery],
    redis_client: redis.Redis,
    key_prefix: str,
) -> None:
    """On the worker, a lock held by the message's parent (parent_id) is waited for, in place
    while it is released quickly and by requeueing when it takes longer, whatever the policy;
    a lock held by any other run is still a duplicate (skipped)."""
    app = make_client("json")
    step = _step_task(app, "execute")
    worker = worker_factory.start(
        SINGLETON_APP, pool="prefork", concurrency=1, env={"SINGLETON_TEST_LOCK_ON": "execute"}
    )
    worker.wait_ready(app)
    store = LockStore(redis_client)

    def hold(tenant: str, owner: str) -> str:
        keys = step.singleton_keys((tenant, 0), {})
        assert isinstance(store.acquire(keys, owner, 0, 30_000), Acquired)
        return keys.lock

    for tenant, held_for in (("quick", 0.1), ("slow", 1.5)):
        lock = hold(tenant, f"parent-of-{tenant}")
        child = step.apply_async((tenant, 1), parent_id=f"parent-of-{tenant}")
        time.sleep(held_for)  # the parent still runs its last steps after publishing the child
        assert store.release(lock, f"parent-of-{tenant}", 0) is ReleaseStatus.RELEASED
        assert child.get(timeout=20) == 1, tenant
    assert "singleton: waiting for the run that published it" in worker.log_text()

    lock = hold("other", "someone-else")
    stranger = step.apply_async(("other", 1), parent_id="not-the-holder")
    assert skip_info(stranger.get(timeout=20)) is not None
    store.release(lock, "someone-else", 0)
