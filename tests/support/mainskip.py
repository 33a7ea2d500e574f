"""Driving the main-process skip (worker/mainskip.py) from a test: make a key hot, tell where a
message was decided.

A message that reaches Celery's own handler is logged ``Task <name>[<id>] received`` by the
worker's main process (at INFO, the test workers' level); one the main process turns away is
not: its only line is ``singleton: duplicate skipped``.
"""

from __future__ import annotations

from typing import Any

from celery import Celery

from celery_singleton_lock import skip_info
from tests.support.waiting import wait_for
from tests.support.workers import WorkerProcess

__test__ = False


def reached_celery(worker: WorkerProcess, task: str, task_id: str) -> bool:
    """Whether Celery's handler received ``task_id`` (it logged it), i.e. it was not turned
    away by the worker's main process."""
    return f"Task {task}[{task_id}] received" in worker.log_text()


def turn_hot(
    app: Celery, worker: WorkerProcess, task: str, kwargs: dict[str, Any], timeout: float = 20
) -> list[Any]:
    """Send duplicates of ``task(**kwargs)`` (its lock held) one at a time until the worker's
    main process turns one away: the first is skipped by the executing process, which makes the
    key hot. Every duplicate sent, the last one decided in the main process."""
    sent: list[Any] = []

    def one_turned_away() -> bool:
        duplicate = app.send_task(task, kwargs=kwargs)
        sent.append(duplicate)
        assert skip_info(duplicate.get(timeout=timeout)) is not None, duplicate.id
        return not reached_celery(worker, task, duplicate.id)

    wait_for(one_turned_away, timeout, "a duplicate turned away by the main process", worker)
    return sent
