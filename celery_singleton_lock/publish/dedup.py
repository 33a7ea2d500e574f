"""Publish-time dedup (``singleton_lock_on = "publish"``).

``delay()``/``apply_async()`` of a task whose lock is held, or whose identical call is
already queued, publishes nothing and returns the AsyncResult of that holder. One Lua round
trip (publish.lua) looks at the lock and at the *queued marker* beside it (same hash tag,
same cluster slot) and, when both are free, marks the new message queued.

The marker never outlives its message for long:

- the run hands it over to the lock: ``before_start`` deletes it once the acquire is done
  (taken or not), so a call made meanwhile finds the lock;
- a revoked or expired message deletes it when a worker discards the message
  (``task_revoked``, worker/hooks.py);
- a publish that fails deletes it at once;
- a duplicate that finds a marker whose task has a ready result (SUCCESS, FAILURE, REVOKED)
  takes it over. Asking the result backend is a second round trip; its answer "not finished"
  is trusted for :data:`UNFINISHED_TRUST_S` per task id in this process, so a burst of
  duplicates of one queued call costs one round trip each;
- otherwise (a purged queue, a message lost by the broker) it expires after
  ``singleton_publish_ttl`` seconds, counted from the message's countdown or eta.

The publish-time dedup part (duplicates/publish_dedup.py) says when to mark, publish and forget;
this module does it with the task's settings and keys, and never imports the task's class.

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
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import partial
from typing import Any

from celery import Task, states
from celery.backends.base import DisabledBackend
from kombu import serialization
from kombu.exceptions import DecodeError
from kombu.utils.uuid import uuid

from .. import signals
from ..core import _wire
from ..core._wire import Script, as_text
from ..core.backend import REDIS_ERRORS
from ..core.connection import store_for
from ..core.keys import LockKeys, queued_key
from ..errors import DuplicateTaskError, SingletonKeyError
from ..run.log import LOGGED_ERRORS, about
from ..run.log import logger as task_logger
from ..settings.options import Options

__all__ = [
    "UNFINISHED",
    "Queued",
    "Unfinished",
    "always_published",
    "delivered_arguments",
    "finished",
    "forget",
    "forget_for",
    "forget_queued",
    "mark_queued",
    "marker_ttl_ms",
    "not_published",
    "publish",
    "seconds_until",
]

logger = logging.getLogger(__name__)

PUBLISH = _wire.script("publish.lua")
UNQUEUE = _wire.script("unqueue.lua")


def seconds_until(when: Any) -> float | None:
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
    delay = seconds_until(options.get("countdown"))
    if delay is None:
        delay = seconds_until(options.get("eta"))
    ttl = max(delay or 0.0, 0.0) + publish_ttl
    expires = seconds_until(options.get("expires"))
    if expires is not None:
        ttl = min(ttl, expires)
    return max(1, round(ttl * 1000))


@dataclass(frozen=True)
class Queued:
    """What kept a message from being published: ``holder`` (a task id) is ``state``
    ("running": it holds the lock; "queued": its identical call waits in the queue)."""

    holder: str
    state: str


def always_published(options: Mapping[str, Any]) -> bool:
    """Whether Celery publishes this message as part of a canvas: group and chord members,
    chain steps and link callbacks (the tracer publishes those with the ``parent_id`` of the
    run that finished). A canvas waits for the ids it froze: they are never deduplicated."""
    return bool(options.get("group_id") or options.get("chord") or options.get("parent_id"))


def _carries_canvas(options: Mapping[str, Any]) -> bool:
    """Whether a call starts a canvas of its own: ``link``/``link_error`` callbacks, or the
    rest of a chain it is the first step of."""
    return bool(options.get("link") or options.get("link_error") or options.get("chain"))


def finished(backend: Any, task_id: str) -> bool:
    """True when the result ``backend`` says ``task_id`` is done (its marker is then stale)."""
    if isinstance(backend, DisabledBackend) or not getattr(backend, "persistent", False):
        return False
    try:
        return bool(backend.get_state(task_id) in states.READY_STATES)
    except Exception:  # the backend is down: keep the marker, it expires anyway
        return False


#: Seconds the result backend's "not finished" for a queued marker's task is trusted.
UNFINISHED_TRUST_S = 1.0


class Unfinished:
    """Task ids the result backend said were not finished, each trusted for ``trust_s``
    (at most ``size`` of them, the oldest forgotten first)."""

    def __init__(
        self,
        trust_s: float = UNFINISHED_TRUST_S,
        clock: Callable[[], float] = time.monotonic,
        size: int = 1024,
    ) -> None:
        self.trust_s = trust_s
        self.clock = clock
        self.size = size
        self._until: OrderedDict[str, float] = OrderedDict()

    def trusted(self, task_id: str) -> bool:
        """Whether ``task_id`` was found not finished less than ``trust_s`` ago."""
        until = self._until.get(task_id)
        return until is not None and self.clock() < until

    def remember(self, task_id: str) -> None:
        self._until[task_id] = self.clock() + self.trust_s
        self._until.move_to_end(task_id)
        while len(self._until) > self.size:
            self._until.popitem(last=False)


#: This process's answers (the publishing process: a web worker, a beat, a task's body).
UNFINISHED = Unfinished()


#: How a script reaches the records beside the locks: ``LockBackend.run_script``.
RunScript = Callable[[Script, Sequence[Any]], Any]


def mark_queued(  # noqa: PLR0917 - where, who, how long, and how to tell a stale marker
    run: RunScript,
    keys: LockKeys,
    task_id: str,
    ttl_ms: int,
    is_finished: Callable[[str], bool],
    unfinished: Unfinished | None = None,
) -> Queued | None:
    """Mark ``task_id`` queued under ``keys`` unless the lock is held or an identical call is
    queued; None when marked (publish it), else what was found. A marker whose task
    ``is_finished`` is taken over (a second round trip, only then; see :class:`Unfinished`).
    Raises Redis's errors."""
    marker = queued_key(keys.lock)
    reply = run(PUBLISH, [2, keys.lock, marker, task_id, ttl_ms, ""])
    if reply[0] == 0 and as_text(reply[2]) == "queued":
        holder = as_text(reply[1])
        unfinished = unfinished or UNFINISHED
        if not unfinished.trusted(holder):
            if is_finished(holder):
                args = [2, keys.lock, marker, task_id, ttl_ms, holder]
                reply = run(PUBLISH, args)
            else:
                unfinished.remember(holder)
    if reply[0] == 1:
        return None
    return Queued(as_text(reply[1]), as_text(reply[2]))


def forget_queued(run: RunScript, lock_key: str, task_id: str) -> None:
    """Delete the queued marker of ``lock_key`` if it still names ``task_id``."""
    run(UNQUEUE, [1, queued_key(lock_key), task_id])


def delivered_arguments(
    args: Sequence[Any] | None,
    kwargs: Mapping[str, Any] | None,
    serializer: str,
    dump_pydantic: Callable[..., tuple[Any, Any]] | None = None,
) -> tuple[Sequence[Any], Mapping[str, Any]]:
    """``args`` and ``kwargs`` as a worker will receive them: through the message's serializer.

    ``serializer`` is the one Celery picks for the message (the ``serializer`` option, else the
    task's, else ``task_serializer``); pydantic arguments are dumped first as Celery dumps them.
    Raises kombu's ``EncodeError`` for arguments the serializer refuses (Celery would refuse to
    publish them too), and :class:`SingletonKeyError` for arguments it writes but cannot read
    back (a worker could not decode the message either); either before anything is marked.
    """
    args, kwargs = tuple(args or ()), dict(kwargs or {})
    if dump_pydantic is not None and serializer != "pickle":
        args, kwargs = dump_pydantic(args, kwargs)
    if _unchanged_by_any_serializer(args, kwargs):
        return args, kwargs
    dumps, loads = serialization.dumps, serialization.loads
    content_type, encoding, data = dumps((args, kwargs), serializer)  # type: ignore[no-untyped-call]
    try:
        args, kwargs = loads(data, content_type, encoding, accept=[content_type])  # type: ignore[no-untyped-call]
    except DecodeError as exc:  # e.g. msgpack refuses the int dict keys it wrote
        raise SingletonKeyError(
            f"the {serializer} serializer cannot bring these arguments to a worker: {exc}"
        ) from exc
    return args, kwargs


#: Types whose values every serializer Celery ships (json, msgpack, yaml, pickle) brings back
#: as they went (ints within 64 bits: msgpack refuses larger ones).
_STABLE_TYPES = frozenset({str, int, float, bool, type(None)})
_INT64 = range(-(2**63), 2**63)


def _unchanged_by_any_serializer(args: Sequence[Any], kwargs: Mapping[str, Any]) -> bool:
    """Whether the arguments are plain scalars (most calls): no round trip needed."""
    for value in (*args, *kwargs.values()):
        kind = type(value)
        if kind not in _STABLE_TYPES or (kind is int and value not in _INT64):
            return False
    return True


def not_published(  # noqa: PLR0917 - who, what, and what was found
    sender: Any, name: str, refuses: bool, key: str, task_id: str, found: Queued
) -> str:
    """Log and signal a message not published; raise ``DuplicateTaskError`` when the task's
    policy ``refuses`` a duplicate (``"raise"``), else return the holder's task id (the caller
    returns its AsyncResult)."""
    holder, state = found.holder, found.state
    logger.info(
        "singleton: duplicate not published: %s[%s] key=%s holder=%s (%s)",
        name,
        task_id,
        key,
        holder,
        state,
    )
    signals.duplicate_not_published.send(
        sender=sender, key=key, task_id=task_id, holder=holder, state=state
    )
    if refuses:
        raise DuplicateTaskError(
            f"{name}[{task_id}] is a duplicate: {key} is {state} as {holder}",
            key=key,
            task_id=task_id,
            holder=holder,
        )
    return holder


def publish(  # noqa: PLR0917 - the task, its call, and Celery's own publish
    task: Task,
    args: Sequence[Any] | None,
    kwargs: Mapping[str, Any] | None,
    task_id: str | None,
    options: dict[str, Any],
    send: Callable[..., Any],
    *,
    refuses: bool,
    publishes_canvas: bool,
    replaces: bool = False,
) -> Any:
    """Publish unless the lock is held or the same call is queued; return the AsyncResult.
    ``send(args, kwargs, task_id, **options)`` is Celery's own apply_async. ``refuses``: a
    duplicate raises (the policy's ``refuses_at_publish``); ``publishes_canvas``: a call that
    starts a canvas of its own is always published (its ``publishes_canvas``); ``replaces``: the
    call takes the place of a queued one, which is revoked, and is published while a run holds
    the key (latest wins: the policy's ``replaces_queued``)."""
    if (
        task.app.conf.task_always_eager
        or (task_id is not None and task_id == task.request.id)
        or always_published(options)
        or (publishes_canvas and _carries_canvas(options))
    ):
        # eager: the run is the call, the lock guards it; the current message published
        # again (retry(), a requeued duplicate) is never its own duplicate; canvas members;
        # a call whose own canvas goes on with the holder's outcome on the worker (join)
        return send(args, kwargs, task_id, **options)
    opts: Options = task.singleton_options()
    task_id = task_id or uuid()
    serializer = options.get("serializer") or task.serializer or task.app.conf.task_serializer
    try:
        delivered = delivered_arguments(
            args, kwargs, serializer, getattr(task, "_dump_pydantic_arguments", None)
        )
        keys: LockKeys = task.singleton_keys(*delivered)
    except SingletonKeyError as exc:
        raise SingletonKeyError(f"{task.name}[{task_id}]: {exc}", task_id=task_id) from exc
    ttl_ms = marker_ttl_ms(opts.publish_ttl, options)
    try:
        run = store_for(opts.redis_url).run_script
        found = mark_queued(run, keys, task_id, ttl_ms, partial(finished, task.backend))
    except REDIS_ERRORS as exc:
        task_logger.warning(
            "singleton: redis error at publish, publishing without dedup: %s[%s] key=%s: %s",
            task.name,
            task_id,
            keys.lock,
            exc,
            extra=about(task.name, task_id),
        )
        return send(args, kwargs, task_id, **options)
    if found is not None and replaces:
        found = _replace(task, run, keys, task_id, ttl_ms, found)
        if found is None or found.state == "running":  # a run: the call asks it to stop
            return send(args, kwargs, task_id, **options)
    if found is None:
        try:
            return send(args, kwargs, task_id, **options)
        except BaseException:
            forget(task, task_id, keys, "publish failed")
            raise
    holder = not_published(task, task.name, refuses, keys.lock, task_id, found)
    return task.AsyncResult(holder)


def _replace(  # noqa: PLR0917 - the call, and what it found
    task: Task, run: RunScript, keys: LockKeys, task_id: str, ttl_ms: int, found: Queued
) -> Queued | None:
    """Latest wins: take the queued marker over from the older call it names, and revoke that
    call's message (it never runs); None when taken. A run holding the key is left as found."""
    if found.state != "queued":
        return found
    taken = mark_queued(run, keys, task_id, ttl_ms, lambda holder: True, Unfinished(trust_s=0))
    if taken is None:
        task.app.control.revoke(found.holder)
        task_logger.info(
            "singleton: queued call replaced by a newer one, revoked: %s[%s] key=%s by=%s",
            task.name,
            found.holder,
            keys.lock,
            task_id,
            extra=about(task.name, task_id),
        )
    return taken


def forget(task: Task, task_id: str, keys: LockKeys, reason: str) -> None:
    """Drop the queued marker of ``task_id``'s call if it still names it; on failure log (the
    marker then expires in its ttl). ``reason``: what ends the marker's use, for that line."""
    try:
        forget_queued(store_for(task.singleton_options().redis_url).run_script, keys.lock, task_id)
    except LOGGED_ERRORS as exc:
        _marker_left(task, reason, task_id, exc)


def forget_for(
    task: Task, task_id: str, args: Sequence[Any] | None, kwargs: Mapping[str, Any] | None
) -> None:
    """Drop the queued marker of a message that will not run (revoked, expired)."""
    try:
        keys: LockKeys = task.singleton_keys(args, kwargs)
    except SingletonKeyError as exc:
        _marker_left(task, "revoke", task_id, exc)
        return
    forget(task, task_id, keys, "revoke")


def _marker_left(task: Task, reason: str, task_id: str, exc: Exception) -> None:
    task_logger.warning(
        "singleton: could not clear queued marker after %s, it expires in its ttl: %s[%s]: %s",
        reason,
        task.name,
        task_id,
        exc,
        extra=about(task.name, task_id),
    )
