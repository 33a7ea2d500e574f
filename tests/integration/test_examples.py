"""The examples in examples/ run for real: Django-style settings, RabbitMQ, a lost lock."""

from __future__ import annotations

import importlib
import logging
import socket
import sys
import time
import uuid
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest
import redis
from celery.contrib.testing.worker import start_worker

from celery_singleton_lock import skip_info
from tests.support.waiting import wait_for

AMQP_HOST = ("127.0.0.1", 5672)
# the workers run in this process: Celery's Redis result backend calls redis-py's setex
pytestmark = pytest.mark.filterwarnings("ignore:Call to deprecated setex:DeprecationWarning")


def load(monkeypatch: pytest.MonkeyPatch, name: str, **env: str) -> ModuleType:
    """(Re)import ``examples.<name>`` with ``env`` set, so it reads private names."""
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    sys.modules.pop(f"examples.{name}", None)
    return importlib.import_module(f"examples.{name}")


@pytest.fixture
def running() -> Iterator[Any]:
    """Runs an example's app in an in-process worker (threads pool) for the test's duration.

    Celery's test worker sets up logging for the whole process (the root logger's level and a
    stderr handler, and the ``celery.task`` logger that task loggers, the library's
    ``celery_singleton_lock.task`` among them, hang from: its level, handlers and propagation);
    all are put back afterwards, so later tests still see warnings.
    """
    stack: list[Any] = []
    loggers = [logging.getLogger(), logging.getLogger("celery.task")]
    saved = [(lg.level, list(lg.handlers), lg.propagate) for lg in loggers]

    def run(app: Any) -> None:
        context = start_worker(app, pool="threads", concurrency=2, perform_ping_check=False)
        context.__enter__()
        stack.append((context, app))

    yield run
    for context, app in reversed(stack):
        context.__exit__(None, None, None)
        app.close()
    for lg, (level, handlers, propagate) in zip(loggers, saved, strict=True):
        lg.setLevel(level)
        lg.handlers[:] = handlers
        lg.propagate = propagate


def wait_for_lock(redis_url: str, prefix: str) -> list[bytes]:
    """The lock keys under ``prefix`` once there is one (a run has started)."""
    client = redis.Redis.from_url(redis_url)
    try:
        return wait_for(
            lambda: list(client.scan_iter(count=1000, match=f"{prefix}lock:*:lock")),
            20,
            "a run's lock",
        )
    finally:
        client.close()


def duplicates(task: Any, redis_url: str, prefix: str, *args: Any) -> tuple[Any, Any]:
    """Send the same call twice, the second while the first runs; both results."""
    first = task.delay(*args)
    wait_for_lock(redis_url, prefix)
    second = task.delay(*args)
    return outcome(first), outcome(second)


def outcome(result: Any, timeout: float = 30.0) -> Any:
    """The result's value, polled (``get()`` waits on pub/sub, which the key prefix hides)."""
    wait_for(result.ready, timeout, f"the result of {result.id}", interval=0.05)
    return result.result


def test_django_style_settings_configure_the_lock(
    monkeypatch: pytest.MonkeyPatch, redis_url: str, key_prefix: str, running: Any
) -> None:
    """CELERY_SINGLETON_* settings apply: prefix, ttl and the skip policy."""
    load(monkeypatch, "django_settings", EXAMPLE_REDIS_URL=redis_url, EXAMPLE_PREFIX=key_prefix)
    module = load(monkeypatch, "django_celery")
    assert module.app.conf.singleton_ttl == 20
    running(module.app)
    first, second = duplicates(module.rebuild_report, redis_url, key_prefix, 7, 1.5)
    assert first["key"].startswith(f"{key_prefix}lock:")
    assert isinstance(first["token"], int)
    info = skip_info(second)
    assert info is not None
    assert info.key == first["key"]


def test_rabbitmq_broker_with_redis_lock_store(
    monkeypatch: pytest.MonkeyPatch, redis_url: str, key_prefix: str, running: Any
) -> None:
    """Over RabbitMQ (a private queue), a duplicate is skipped by the lock kept in Redis; with
    ``singleton_lock_on="publish"`` a second call is not published while the first is queued
    or running (the queued marker lives in the lock's Redis), and is once it has run."""
    with socket.create_connection(AMQP_HOST, timeout=5):
        pass  # RabbitMQ answers (it runs here and in CI)
    queue = f"singleton-example-{uuid.uuid4().hex[:8]}"
    module = load(
        monkeypatch,
        "rabbitmq_broker",
        EXAMPLE_REDIS_URL=redis_url,
        EXAMPLE_PREFIX=key_prefix,
        EXAMPLE_QUEUE=queue,
    )
    try:
        running(module.app)
        first, second = duplicates(module.import_feed, redis_url, key_prefix, "prices", 1.5)
        assert isinstance(first["token"], int)
        info = skip_info(second)
        assert info is not None
        assert info.key.startswith(f"{key_prefix}lock:")
        # publish-time dedup: the queued marker in Redis, RabbitMQ only carries the message
        running_call = module.refresh_feed.delay("prices", 1.0)
        assert module.refresh_feed.delay("prices", 1.0).id == running_call.id  # not published
        assert isinstance(outcome(running_call)["token"], int)
        # the release follows the result: until then a call returns the first's result
        again = wait_for(
            lambda: (
                (call := module.refresh_feed.delay("prices", 0.0)).id != running_call.id and call
            ),
            10,
            "a call published again",
        )
        assert isinstance(outcome(again)["token"], int)
    finally:
        with module.app.connection_for_write() as conn:
            conn.default_channel.queue_delete(queue)


def test_long_task_stops_when_it_loses_its_lock(
    monkeypatch: pytest.MonkeyPatch, redis_url: str, key_prefix: str, running: Any
) -> None:
    """The lock deleted under a running export: it sees ``lost`` and stops early."""
    module = load(monkeypatch, "lost_lock", EXAMPLE_REDIS_URL=redis_url, EXAMPLE_PREFIX=key_prefix)
    running(module.app)
    client = redis.Redis.from_url(redis_url)
    try:
        result = module.export.delay("orders", 200, 0.1)  # 20 s if nothing happens
        locks = wait_for_lock(redis_url, key_prefix)
        time.sleep(0.5)
        client.delete(*locks)  # as if the ttl ran out during a pause
        value = outcome(result)
    finally:
        client.close()
    assert value["lost"] is True
    assert 0 < value["done"] < 60  # stopped within a renewal interval or two, not at 200
