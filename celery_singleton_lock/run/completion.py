"""A finished message is not run again; a finished run may hold its key for a window.

The Celery side of :mod:`celery_singleton_lock.core.completion`:

- :func:`ending_for`: what a run's release leaves behind, by the state it ended in. A
  completion record only for a run that will not run again (``SUCCESS``, or a ``FAILURE``:
  Celery retries through ``RETRY``, which does not release; not a ``FAILURE`` of a task acked
  late whose failures are not acknowledged, which the broker may deliver again); the at-least
  window for every end that releases.
- :func:`drop_completed`: a delivery whose message already ran to its end (the acquire found
  its completion record) is acknowledged and dropped: one ``singleton: ...`` line, the
  ``redelivery_dropped`` signal, and no result written (the first run's stays).

The stores write and read both records inside the release and acquire scripts, so a run makes
no round trip for them (docs/internals.md, "A finished message is not run again").
"""

from __future__ import annotations

import functools
from typing import Any, NoReturn

from celery import states
from celery.exceptions import Ignore

from .. import signals
from ..core.backend import Completed
from ..core.completion import NO_ENDING, Ending
from .log import logger

__all__ = ["FINAL_STATES", "drop_completed", "dropped", "ending_for", "report_drop"]

#: The states after which the message will not run again: a completion is recorded. REVOKED is
#: a run that ended cancelled (``self.singleton.end_cancelled()``), whose copy must not run.
FINAL_STATES = frozenset({states.SUCCESS, states.FAILURE, states.REVOKED})


@functools.lru_cache(maxsize=256)
def ending_for(
    completion_ttl: float | None, at_least: float, state: str, failure_is_final: bool = True
) -> Ending:
    """What the release of a run that ended in ``state`` leaves behind (worked out once per
    task settings and state: an :class:`Ending` does not change). ``failure_is_final`` False:
    a ``FAILURE`` records nothing, its message is left to the broker to deliver again
    (``Options.failure_is_final``)."""
    final = state in FINAL_STATES and (failure_is_final or state != states.FAILURE)
    keep_ms = round((completion_ttl or 0) * 1000) if final else 0
    at_least_ms = round(at_least * 1000)
    if not keep_ms and not at_least_ms:
        return NO_ENDING
    return Ending(completion_ttl_ms=keep_ms, at_least_ms=at_least_ms)


class _Dropped(Ignore):  # type: ignore[misc]
    """Ends a delivery whose message already completed: acked, no state written."""


def report_drop(task: Any, key: str, outcome: Completed, task_id: str, retries: Any) -> None:
    """The drop's one ``singleton: ...`` line and its ``redelivery_dropped`` signal."""
    generation = int(retries or 0)
    logger.warning(
        "singleton: already completed, redelivery dropped: %s[%s] key=%s retries=%d "
        "completed_retries=%d",
        task.name,
        task_id,
        key,
        generation,
        outcome.holder_generation,
    )
    signals.redelivery_dropped.send(
        sender=task,
        key=key,
        task_id=task_id,
        generation=generation,
        completed_generation=outcome.holder_generation,
    )


def dropped(task_id: str) -> _Dropped:
    """The exception a dropped delivery ends with (an ``Ignore``: acknowledged, nothing
    stored)."""
    return _Dropped(f"singleton: {task_id} already completed")


def drop_completed(task: Any, key: str, outcome: Completed, task_id: str) -> NoReturn:
    """Drop this delivery inside Celery's tracer (an eager run, or an acquire made in
    ``before_start``): its message (same task id, generation ``outcome.holder_generation`` or
    later) already ran to its end. Logged, signalled, acknowledged; the result the first run
    stored is left as it is. A worker drops most copies before Celery's tracer (task/tracer.py),
    where not even ``STARTED`` is written."""
    report_drop(task, key, outcome, task_id, task.request.retries)
    raise dropped(task_id)
