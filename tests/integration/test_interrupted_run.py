"""A run interrupted before its handle holds the lock never strands it.

``revoke(terminate=True)`` sends a prefork child SIGTERM, which billiard turns into a
SystemExit wherever the child is. When that is between the acquire's write and the moment the
run's handle holds the lock (the reply on its way, or ``before_start`` half done), no
``task_postrun`` knows of the lock: the tracer hook (task/tracer.py) releases it, owner-checked.
A SIGTERM cannot be aimed at that instant in a real child, so the SystemExit is raised here at
each point of the path, through the worker's own tracer (Celery's ``build_tracer``).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery
from celery.app.trace import build_tracer

from celery_singleton_lock import SingletonTask
from celery_singleton_lock.core.connection import flush_releases
from celery_singleton_lock.duplicates.gate import renewer_of
from celery_singleton_lock.task import start, tracer


@pytest.fixture
def app(redis_url: str, key_prefix: str) -> Iterator[Celery]:
    """A worker-side app (not eager): its tasks run through Celery's tracer, as a pool's do."""
    app = Celery("interrupted", broker="memory://", set_as_current=False)
    app.conf.singleton_redis_url = redis_url
    app.conf.singleton_key_prefix = key_prefix

    @app.task(bind=True, base=SingletonTask, name="i.hold", shared=False)
    def hold(self: Any, key: str) -> int:
        return int(self.singleton.fencing_token)

    @app.task(bind=True, base=SingletonTask, name="i.permits", shared=False, singleton_permits=2)
    def permits(self: Any, key: str) -> str:
        return str(self.singleton.key)

    @app.task(bind=True, base=SingletonTask, name="i.exit", shared=False)
    def exit_in_body(self: Any, key: str) -> None:
        raise SystemExit(15)

    for task in (hold, permits, exit_in_body):
        task.__trace__ = build_tracer(task.name, task, app=app, hostname="h")
    yield app
    app.close()


def _run(task: Any, key: str) -> tuple[str, Any]:
    """Run one message of ``task`` as a pool child does; its id and what the tracer returned."""
    task_id = str(uuid.uuid4())
    request = {"id": task_id, "retries": 0, "delivery_info": {}, "hostname": "h"}
    return task_id, task.__trace__(task_id, (key,), {}, request)


def _held(client: redis.Redis, task: Any, key: str) -> list[str]:
    keys = task.singleton_keys((key,), {})
    return [slot for slot in keys.slots if client.exists(slot)]


@pytest.mark.parametrize("name", ["i.hold", "i.permits"])
def test_a_system_exit_while_the_acquire_reply_is_on_its_way_releases_the_lock(
    app: Celery, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    task = app.tasks[name]
    store = renewer_of(task.singleton_options()).store
    real_acquire = store.acquire
    written: list[list[str]] = []

    def acquire_then_exit(*args: Any, **kwargs: Any) -> Any:
        real_acquire(*args, **kwargs)
        written.append(_held(redis_client, task, "k"))
        raise SystemExit(15)

    monkeypatch.setattr(store, "acquire", acquire_then_exit)
    with pytest.raises(SystemExit):
        _run(task, "k")
    assert written == [[task.singleton_keys(("k",), {}).slot(1)]]  # the lock (slot) was written
    assert _held(redis_client, task, "k") == []
    monkeypatch.undo()
    _, outcome = _run(task, "k")  # the key is free for the next run at once
    assert outcome.info is None  # Celery's tracer: a run that succeeded
    assert outcome.retval  # its fencing token, or the slot it held


def test_a_system_exit_in_before_start_before_the_handle_holds_the_lock_releases_it(
    app: Celery, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    task = app.tasks["i.hold"]

    def interrupted(**_: Any) -> None:
        assert _held(redis_client, task, "k") != []  # taken by the tracer hook, not yet handled
        raise SystemExit(15)

    monkeypatch.setattr(start, "HeldLock", interrupted)
    with pytest.raises(SystemExit):
        _run(task, "k")
    assert _held(redis_client, task, "k") == []


def test_a_system_exit_in_the_body_is_released_once_by_the_runs_own_postrun(
    app: Celery, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The control: once the handle holds the lock, the run's ``task_postrun`` releases it,
    and the tracer hook leaves it alone (no second release, no warning)."""
    task = app.tasks["i.exit"]
    abandoned: list[str] = []
    monkeypatch.setattr(tracer, "abandon", lambda *args, **kwargs: abandoned.append("abandon"))
    with pytest.raises(SystemExit):
        _run(task, "k")
    flush_releases()  # what the child's exit does with a release its renewer has not sent yet
    assert abandoned == []
    assert _held(redis_client, task, "k") == []
