"""Whether a joined duplicate's task events are sent follows the worker's own dispatcher, as
Celery's worker decides for a task's events (run/task_events.py): sent with ``-E`` or after
``enable_events``; not with worker events only, with events off, with the task's
``send_events=False``, or in an eager run."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery.app.task import Context

from celery_singleton_lock.run.task_events import TASK_EVENTS_FIELD, run_sink, sends_task_events


@pytest.fixture
def app() -> Iterator[Celery]:
    app = Celery("task-events", broker="memory://", set_as_current=False)
    yield app
    app.close()


class _Task:
    def __init__(self, app: Celery, send_events: bool = True) -> None:
        self.app = app
        self.send_events = send_events
        self.request = Context()


def _dispatcher(app: Celery, *, enabled: bool, groups: list[str] | None) -> Any:
    return app.events.Dispatcher(app.connection_for_write(), enabled=enabled, groups=groups)


@pytest.mark.parametrize(
    ("enabled", "groups", "send_events", "expected"),
    [
        (True, None, True, True),  # -E: every group
        (True, ["worker", "task"], True, True),  # enable_events on a worker without -E
        (True, ["worker"], True, False),  # heartbeats only
        (False, None, True, False),  # --without-heartbeat --without-gossip, no -E
        (True, None, False, False),  # the task's send_events=False
    ],
)
def test_a_request_says_whether_its_worker_sends_task_events(
    app: Celery, enabled: bool, groups: list[str] | None, send_events: bool, expected: bool
) -> None:
    dispatcher = _dispatcher(app, enabled=enabled, groups=groups)
    try:
        assert sends_task_events(dispatcher, _Task(app, send_events)) is expected
    finally:
        dispatcher.close()
    assert sends_task_events(None, _Task(app)) is False


def test_a_run_sends_only_when_its_request_says_so(app: Celery) -> None:
    task = _Task(app)
    assert run_sink(task) is None  # an eager run, or a worker sending no task events
    task.request = Context({TASK_EVENTS_FIELD: False, "hostname": "w@h"})
    assert run_sink(task) is None
    task.request = Context({TASK_EVENTS_FIELD: True, "hostname": "w@h"})
    assert run_sink(task) is not None
    assert run_sink(_Task(app, send_events=False), {TASK_EVENTS_FIELD: True}) is None
    # a worker's main process passes the request it reports on (a dict or a Context)
    assert run_sink(_Task(app), {TASK_EVENTS_FIELD: True, "hostname": "w@h"}) is not None
