"""A copy of a message the library publishes again: a requeued duplicate, a joiner's watch
copy, a debounced call's wait; and the headers by which the library knows its own messages.

Each is the message of a request published again as ``retry()`` would (the same task id,
retries count and canvas; ``argsrepr``/``kwargsrepr`` as its caller had Celery show them, in
the serializer it came in: run/callrepr.py ``copy_options``),
due in a countdown, with the library's own headers it carried kept (:data:`DEBOUNCE_HEADER`:
a debounced call waiting for the lock is still that call) and any given added.

A joiner's watch copy (duplicates/join.py, :func:`publish_watch_copy`) names the holder it
joined (:data:`JOINED_HEADER`) and its serial (:data:`SERIAL_HEADER`): the joiner's record
names the serial of its one live watch copy (core/joiners.py), so a copy the broker handed out
again is known as stale.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from celery import Task
from celery.app.task import Context

from ..publish.dedup import seconds_until
from ..run.callrepr import copy_options, request_field

__all__ = [
    "DEBOUNCE_HEADER",
    "FOLLOW_UP_HEADER",
    "JOINED_HEADER",
    "RECHECK_HEADER",
    "SERIAL_HEADER",
    "WAITING_HEADER",
    "is_follow_up",
    "publish_copy",
    "publish_watch_copy",
    "seconds_left",
    "waited",
    "waiting_since",
    "watch_countdown",
    "watch_serial",
]

#: Message header of a debounced call's waiting copy (duplicates/debounce.py): the call's
#: retries count when it started to wait. Every copy of that message keeps it.
DEBOUNCE_HEADER = "singleton_debounced"

#: Message header of a coalesced follow-up (duplicates/coalesce.py). A follow-up that meets a
#: run holding its lock (with permits: a full set of slots) is not coalesced again: that run
#: took its slot after the follow-up's call was taken (only a release that left a slot free
#: takes it), so after every duplicate the follow-up carries; it is newer, and the follow-up
#: ends like a skip naming it. Coalesced again, its older call would overwrite a newer one left
#: beside that run, or run after it.
FOLLOW_UP_HEADER = "singleton_follow_up"

#: Message header of a duplicate requeued to wait for its lock: ``[first requeue, retries]``,
#: the wall clock (epoch s) of its first requeue and its retries count then. The run that
#: finally takes the lock reports the wait (``lock_acquired``'s ``waited``).
WAITING_HEADER = "singleton_waiting_since"

#: Message header of a joiner's watch copy: the holder it joined.
JOINED_HEADER = "singleton_joined"

#: Message header of a watch copy's last check (duplicates/join.py ``runs_in_place``).
RECHECK_HEADER = "singleton_joined_recheck"

#: Message header of a watch copy: its serial, which the joiner's record names while it is the
#: live one (core/joiners.py). A copy the broker handed out again carries a stale one.
SERIAL_HEADER = "singleton_joined_serial"

#: The headers of the library that a copy of a message keeps.
_CARRIED = (DEBOUNCE_HEADER,)


def publish_copy(
    task: Task,
    request: Context,
    countdown: float,
    headers: Mapping[str, Any] | None = None,
    *,
    task_id: str | None = None,
) -> None:
    """Publish a copy of the message of ``request``, due in ``countdown`` seconds, with
    ``headers`` added to the ones it keeps (under another ``task_id``, if given: a message of
    the library's own that never runs the body). Raises what publishing raises."""
    extra = {name: request.get(name) for name in _CARRIED if request.get(name) is not None}
    extra.update(headers or {})
    options: dict[str, Any] = {"countdown": countdown, **copy_options(request)}
    if task_id is not None:
        options["task_id"] = task_id
    if extra:  # else Celery's own copy of the request's headers (x-death filtered out)
        options["headers"] = {**(request.headers or {}), **extra}
    task.signature_from_request(request, **options).apply_async()


def seconds_left(expires: Any) -> float | None:
    """Seconds until a message's ``expires`` (None: none, or not a time this can read)."""
    try:
        return seconds_until(expires or None)
    except ValueError:
        return None


def is_follow_up(request: Any) -> bool:
    """Whether the message of ``request`` (a Context, or the dict a worker's tracer gets) is a
    published follow-up (:data:`FOLLOW_UP_HEADER`: a field of a worker's request, in the
    ``headers`` of an eager one)."""
    if request_field(request, FOLLOW_UP_HEADER) is True:
        return True
    headers = request_field(request, "headers")
    return isinstance(headers, Mapping) and headers.get(FOLLOW_UP_HEADER) is True


def waiting_since(request: Any) -> list[float] | None:
    """This delivery's :data:`WAITING_HEADER`, if it is a requeued duplicate of this retry."""
    value = request_field(request, WAITING_HEADER)
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        return None
    try:
        since, retries = float(value[0]), int(value[1])
    except (TypeError, ValueError):  # not ours: never fail a run over a header
        return None
    if retries != int(request_field(request, "retries") or 0):  # a later self.retry() carried it
        return None
    return [since, retries]


def waited(request: Any) -> float | None:
    """Seconds since this message was first requeued to wait for its lock, or None."""
    since = waiting_since(request)
    return None if since is None else max(0.0, time.time() - since[0])


def publish_watch_copy(
    task: Task,
    request: Context,
    countdown: float,
    holder: str,
    serial: int | None,
    *,
    recheck: bool = False,
) -> None:
    """Publish a copy of the message of ``request``, due in ``countdown`` seconds: a watch copy
    of a joiner of ``holder``, the live one of ``serial``, or with ``recheck`` its last check."""
    headers: dict[str, Any] = {JOINED_HEADER: holder, SERIAL_HEADER: serial}
    if recheck:
        headers[RECHECK_HEADER] = True
    publish_copy(task, request, countdown, headers)


def watch_serial(request: Context) -> int | None:
    """The serial of a watch copy (None: the call's own message, or a header not ours)."""
    value = request.get(SERIAL_HEADER)
    if value is None or isinstance(value, bool) or not request.get(JOINED_HEADER):
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def watch_countdown(pttl_ms: int, expires: Any) -> float:
    """When a watch copy is due: just after the lock would expire, or just after the message's
    own ``expires`` if that comes first (Celery then ends it as expired)."""
    countdown = max(pttl_ms, 0) / 1000 + 0.5
    left = seconds_left(expires)
    if left is not None and left < countdown:
        countdown = max(left, 0.0) + 0.05
    return countdown
