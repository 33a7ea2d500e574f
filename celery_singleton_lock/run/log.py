"""What the task's modules share to log: the task logger, ``extra`` for a line logged outside
its run, and the Redis errors a task logs and lets go.

One logger for every module of a run (task/, run/, duplicates/, publish/):
``celery_singleton_lock.task.singleton_task``, a Celery task logger (a child of ``celery.task``).
In a worker
its lines go through Celery's task handler, so ``worker_task_log_format``'s %(task_name)s and
%(task_id)s name the run that logged them (docs/configuration.md, "Logs").
"""

from __future__ import annotations

import logging

from celery.utils.log import get_task_logger

from ..core.backend import REDIS_ERRORS
from ..errors import LockUnavailableError

__all__ = ["LOGGED_ERRORS", "about", "logger"]

#: The task logger's name: fixed (docs/configuration.md, "Logs"), wherever this module lives.
LOGGER_NAME = "celery_singleton_lock.task"

# The package's logger exists first: one created after the task logger would take it back
# under the package's (logging's placeholder fix-up).
logging.getLogger(LOGGER_NAME.partition(".")[0])
logger = get_task_logger(LOGGER_NAME)

#: What a failed write beside the lock raises (a queued marker's delete, a coalesced call, a
#: follow-up): logged, and the record expires in its ttl or waits for the next release.
LOGGED_ERRORS: tuple[type[Exception], ...] = (LockUnavailableError, *REDIS_ERRORS)


def about(name: str, task_id: str) -> dict[str, str]:
    """``extra`` of a line logged outside the run it is about (the worker's main process, a
    publisher): Celery's task formatter fills %(task_name)s and %(task_id)s from the current
    run, and from these when there is none."""
    return {"task_name": name, "task_id": task_id}
