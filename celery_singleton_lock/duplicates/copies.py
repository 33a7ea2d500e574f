"""A copy of a message the library publishes again: a requeued duplicate, a joiner's watch
copy, a debounced call's wait.

Each is the message of a request published again as ``retry()`` would (the same task id,
retries count and canvas; ``argsrepr``/``kwargsrepr`` as its caller had Celery show them, in
the serializer it came in: run/callrepr.py ``copy_options``),
due in a countdown, with the library's own headers it carried kept (:data:`DEBOUNCE_HEADER`:
a debounced call waiting for the lock is still that call) and any given added.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from celery import Task
from celery.app.task import Context

from ..publish.dedup import seconds_until
from ..run.callrepr import copy_options

__all__ = ["DEBOUNCE_HEADER", "publish_copy", "seconds_left"]

#: Message header of a debounced call's waiting copy (duplicates/debounce.py): the call's
#: retries count when it started to wait. Every copy of that message keeps it.
DEBOUNCE_HEADER = "singleton_debounced"

#: The headers of the library that a copy of a message keeps.
_CARRIED = (DEBOUNCE_HEADER,)


def publish_copy(
    task: Task, request: Context, countdown: float, headers: Mapping[str, Any] | None = None
) -> None:
    """Publish a copy of the message of ``request``, due in ``countdown`` seconds, with
    ``headers`` added to the ones it keeps. Raises what publishing raises."""
    extra = {name: request.get(name) for name in _CARRIED if request.get(name) is not None}
    extra.update(headers or {})
    options: dict[str, Any] = {"countdown": countdown, **copy_options(request)}
    if extra:  # else Celery's own copy of the request's headers (x-death filtered out)
        options["headers"] = {**(request.headers or {}), **extra}
    task.signature_from_request(request, **options).apply_async()


def seconds_left(expires: Any) -> float | None:
    """Seconds until a message's ``expires`` (None: none, or not a time this can read)."""
    try:
        return seconds_until(expires or None)
    except ValueError:
        return None
