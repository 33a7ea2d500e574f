"""A copy of a message the library publishes again: a requeued duplicate, a joiner's watch
copy, a debounced call's wait.

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

from collections.abc import Mapping
from typing import Any

from celery import Task
from celery.app.task import Context

from ..publish.dedup import seconds_until
from ..run.callrepr import copy_options

__all__ = [
    "DEBOUNCE_HEADER",
    "JOINED_HEADER",
    "RECHECK_HEADER",
    "SERIAL_HEADER",
    "publish_copy",
    "publish_watch_copy",
    "seconds_left",
    "watch_countdown",
    "watch_serial",
]

#: Message header of a debounced call's waiting copy (duplicates/debounce.py): the call's
#: retries count when it started to wait. Every copy of that message keeps it.
DEBOUNCE_HEADER = "singleton_debounced"

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
