"""Publish-time dedup (``singleton_lock_on = "publish"`` or ``"both"``).

``delay()``/``apply_async()`` of a task whose lock is held, or whose identical call is
already queued, publishes nothing and returns the AsyncResult of that holder. One Lua round
trip (publish.lua) looks at the lock and at the *queued marker* beside it (same hash tag,
same cluster slot) and, when both are free, marks the new message queued.

The marker never outlives its message for long:

- the run hands it over to the lock: ``before_start`` deletes it once the acquire is done
  (taken or not), so a call made meanwhile finds the lock;
- a revoked or expired message deletes it when a worker discards the message
  (``task_revoked``, worker.py);
- a publish that fails deletes it at once;
- a duplicate that finds a marker whose task has a ready result (SUCCESS, FAILURE, REVOKED)
  takes it over (a second round trip, only then);
- otherwise (a purged queue, a message lost by the broker) it expires after
  ``singleton_publish_ttl`` seconds, counted from the message's countdown or eta.

Every delete is compare-and-delete on the task id. The lock on the worker still guards every
run, so a lapsed or lost marker can at worst let a second message through, which the worker
then handles by ``singleton_on_duplicate``.

The key is derived from the arguments *as the worker will see them*: sent through the
message's serializer and back (:func:`delivered_arguments`), as Celery does for an eager call.
JSON turns a tuple into a list, an int dict key into a str and an ``IntEnum`` into an int; a
key taken from the arguments as given would name a marker no run ever clears.

Messages Celery publishes as part of a canvas are always published, and mark nothing: group
and chord members, and chain steps and link callbacks (the tracer publishes those with the
``parent_id`` of the run that finished, before that run releases its lock). Their ids are
frozen in the canvas the caller waits on, so none may be replaced by another message's result.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from celery import states
from celery.backends.base import DisabledBackend
from kombu import serialization
from kombu.exceptions import DecodeError
from kombu.utils.uuid import uuid

from . import signals
from .core import _wire
from .core._wire import as_text
from .core.backend import REDIS_ERRORS
from .core.connection import store_for
from .core.keys import queued_key
from .errors import DuplicateTaskError, LockUnavailableError, SingletonKeyError

if TYPE_CHECKING:
    from .task import SingletonTask

__all__ = ["delivered_arguments", "forget_queued", "publish_once"]

logger = logging.getLogger("celery_singleton_lock")

#: What forget_queued logs instead of raising: the marker then expires in its ttl.
_FORGET_ERRORS: tuple[type[Exception], ...] = (
    SingletonKeyError,
    LockUnavailableError,
    *REDIS_ERRORS,
)

PUBLISH = _wire.script("publish.lua")
UNQUEUE = _wire.script("unqueue.lua")


def _seconds_until(when: Any) -> float | None:
    """Seconds from now until ``when`` (a number of seconds, a datetime or an ISO string)."""
    if when is None:
        return None
    if isinstance(when, int | float) and not isinstance(when, bool):
        return float(when)
    if isinstance(when, str):
        when = datetime.fromisoformat(when)
    if isinstance(when, datetime):
        now = datetime.now(timezone.utc) if when.tzinfo else datetime.now()
        return (when - now).total_seconds()
    return None


def marker_ttl_ms(publish_ttl: float, options: Mapping[str, Any]) -> int:
    """How long a message's marker lives: its delay plus ``publish_ttl``, cut at its expiry."""
    delay = _seconds_until(options.get("countdown"))
    if delay is None:
        delay = _seconds_until(options.get("eta"))
    ttl = max(delay or 0.0, 0.0) + publish_ttl
    expires = _seconds_until(options.get("expires"))
    if expires is not None:
        ttl = min(ttl, expires)
    return max(1, round(ttl * 1000))


def _finished(task: SingletonTask, task_id: str) -> bool:
    """True when the result backend says ``task_id`` is done (its marker is then stale)."""
    backend = task.backend
    if isinstance(backend, DisabledBackend) or not getattr(backend, "persistent", False):
        return False
    try:
        return bool(backend.get_state(task_id) in states.READY_STATES)
    except Exception:  # the backend is down: keep the marker, it expires anyway
        return False


def publish_once(
    task: SingletonTask,
    args: Sequence[Any] | None,
    kwargs: Mapping[str, Any] | None,
    task_id: str | None,
    options: dict[str, Any],
    *,
    send: Callable[..., Any],
) -> Any:
    """Publish unless the lock is held or the same call is queued; return the AsyncResult.

    ``send(args, kwargs, task_id, **options)`` is Celery's own ``apply_async``.
    """
    request = task.request
    if (
        task.app.conf.task_always_eager
        or (task_id is not None and task_id == request.id)
        or options.get("group_id")
        or options.get("chord")
        or options.get("parent_id")
    ):
        # eager: the run is the call, the lock guards it; the current message published
        # again (retry(), a requeued duplicate) is never its own duplicate; a canvas waits for
        # the ids it froze, so its members are always published: group and chord members,
        # chain steps and link callbacks (published by the tracer with the parent's id)
        return send(args, kwargs, task_id, **options)
    opts = task.singleton_options()
    task_id = task_id or uuid()
    try:
        keys = task.singleton_keys(*delivered_arguments(task, args, kwargs, options))
    except SingletonKeyError as exc:
        raise SingletonKeyError(f"{task.name}[{task_id}]: {exc}", task_id=task_id) from exc
    marker = queued_key(keys.lock)
    ttl_ms = marker_ttl_ms(opts.publish_ttl, options)
    try:
        client = store_for(opts.redis_url).client
        reply = _wire.evalsha(client, PUBLISH, [2, keys.lock, marker, task_id, ttl_ms, ""])
        if reply[0] == 0 and as_text(reply[2]) == "queued" and _finished(task, as_text(reply[1])):
            args = [2, keys.lock, marker, task_id, ttl_ms, as_text(reply[1])]
            reply = _wire.evalsha(client, PUBLISH, args)
    except REDIS_ERRORS as exc:
        logger.warning(
            "singleton: redis error at publish, publishing without dedup: %s[%s] key=%s: %s",
            task.name,
            task_id,
            keys.lock,
            exc,
        )
        return send(args, kwargs, task_id, **options)
    if reply[0] == 1:
        try:
            return send(args, kwargs, task_id, **options)
        except BaseException:
            forget_queued(task, task_id, args, kwargs, "publish failed")
            raise
    holder, state = as_text(reply[1]), as_text(reply[2])
    return _duplicate(task, opts.on_duplicate, keys.lock, task_id, holder=holder, state=state)


def delivered_arguments(
    task: SingletonTask,
    args: Sequence[Any] | None,
    kwargs: Mapping[str, Any] | None,
    options: Mapping[str, Any],
) -> tuple[Sequence[Any], Mapping[str, Any]]:
    """``args`` and ``kwargs`` as a worker will receive them: through the message's serializer.

    The serializer is the one Celery picks for the message (the ``serializer`` option, else the
    task's, else ``task_serializer``); pydantic arguments are dumped first as Celery dumps them.
    Raises kombu's ``EncodeError`` for arguments the serializer refuses (Celery would refuse to
    publish them too), and :class:`SingletonKeyError` for arguments it writes but cannot read
    back (a worker could not decode the message either); either before anything is marked.
    """
    serializer = options.get("serializer") or task.serializer or task.app.conf.task_serializer
    args, kwargs = tuple(args or ()), dict(kwargs or {})
    dump_pydantic = getattr(task, "_dump_pydantic_arguments", None)
    if dump_pydantic is not None and serializer != "pickle":
        args, kwargs = dump_pydantic(args, kwargs)
    dumps, loads = serialization.dumps, serialization.loads
    content_type, encoding, data = dumps((args, kwargs), serializer)  # type: ignore[no-untyped-call]
    try:
        args, kwargs = loads(data, content_type, encoding, accept=[content_type])  # type: ignore[no-untyped-call]
    except DecodeError as exc:  # e.g. msgpack refuses the int dict keys it wrote
        raise SingletonKeyError(
            f"the {serializer} serializer cannot bring these arguments to a worker: {exc}"
        ) from exc
    return args, kwargs


def _duplicate(
    task: SingletonTask, policy: str, key: str, task_id: str, *, holder: str, state: str
) -> Any:
    logger.info(
        "singleton: duplicate not published: %s[%s] key=%s holder=%s (%s)",
        task.name,
        task_id,
        key,
        holder,
        state,
    )
    signals.duplicate_not_published.send(
        sender=task, key=key, task_id=task_id, holder=holder, state=state
    )
    if policy == "raise":
        raise DuplicateTaskError(
            f"{task.name}[{task_id}] is a duplicate: {key} is {state} as {holder}",
            key=key,
            task_id=task_id,
            holder=holder,
        )
    return task.AsyncResult(holder)


def forget_queued(
    task: SingletonTask,
    task_id: str,
    args: Sequence[Any] | None,
    kwargs: Mapping[str, Any] | None,
    reason: str,
) -> None:
    """Delete the queued marker of this call if it still names ``task_id``."""
    try:
        opts = task.singleton_options()
        marker = queued_key(task.singleton_keys(args, kwargs).lock)
        _wire.evalsha(store_for(opts.redis_url).client, UNQUEUE, [1, marker, task_id])
    except _FORGET_ERRORS as exc:
        logger.warning(
            "singleton: could not clear queued marker after %s, it expires in its ttl: %s[%s]: %s",
            reason,
            task.name,
            task_id,
            exc,
        )
