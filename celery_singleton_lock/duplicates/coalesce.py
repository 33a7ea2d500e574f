"""``singleton_on_duplicate="coalesce"``: duplicates collapse into one follow-up run.

While a run holds the lock, a duplicate leaves its call as the lock's pending record
(core/pending.py: the latest call wins, owner-checked against the holder) and ends like a skip:
its result is the skip marker with ``coalesced`` and the follow-up's task id. Whoever releases
the lock then takes the record, once, and publishes the follow-up: the run itself
(:meth:`CoalescePolicy.release`), the worker's main process for a lost child
(:meth:`CoalescePolicy.after_release`), or ``celery singleton purge``/``release`` for a lock
whose holder is gone. A publish that fails puts the record back and logs it: nothing is
dropped silently.

The follow-up is a new message of the same task with the latest duplicate's arguments, its
task id fixed by the burst's first duplicate, sent to the exchange and routing key that
duplicate arrived by, in the serializer its call was recorded in (the task's; else the first of
the app's ``accept_content`` that can write it); without the duplicate's countdown, eta, links
or canvas (the duplicate's own canvas stops as a skip's does).

A record taken at the release of a run that is not among the runs its duplicates met (its own
holders' node died and their locks expired: an orphan) is *superseded* by that newer run
(core/pending.py ``superseded_by``): it is not published but ends like a skip naming that run,
its result the skip marker, as a follow-up that meets a newer run on a worker does.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from celery import Task
from celery.app.task import Context
from kombu.exceptions import EncodeError
from kombu.serialization import dumps, loads, prepare_accept_content, registry
from kombu.utils.uuid import uuid

from .. import signals
from ..core._wire import as_text
from ..core.backend import Contended, RateLimited
from ..core.connection import store_for
from ..core.keys import LockKeys, beside, keys_of
from ..core.pending import Run, leave_pending, put_back, superseded_by, take_pending
from ..core.renewer import HeldLock, Renewer
from ..run.callrepr import REPR_OPTIONS, reprs_of, request_field
from ..run.events import on_released
from ..run.log import LOGGED_ERRORS, about
from ..run.log import logger as task_logger
from ..settings.options import Options
from .canvas import store_skip
from .copies import FOLLOW_UP_HEADER, is_follow_up
from .policy import Action, Call, Fate, Policy, Why
from .retry import RetryPolicy
from .skips import skip_marker

__all__ = [
    "FOLLOW_UP_HEADER",
    "CoalescePolicy",
    "Taken",
    "call_record",
    "is_follow_up",
    "publish_follow_up",
    "task_dumps",
]

logger = logging.getLogger(__name__)

#: What a duplicate that cannot be coalesced meets: Redis down, or no serializer the app accepts
#: keeps its call's key; it is requeued instead.
_COALESCE_ERRORS: tuple[type[Exception], ...] = (*LOGGED_ERRORS, EncodeError)


class CoalescePolicy(Policy):
    """Duplicates met while a run holds the key collapse into one follow-up run."""

    name = "coalesce"
    ends_in_front = True
    owes_waiting_calls = True

    def refuse(self, opts: Options) -> str | None:
        if opts.lock_on != "execute":
            return (
                "singleton_on_duplicate 'coalesce' needs singleton_lock_on 'execute' (a "
                "duplicate is coalesced where it runs)"
            )
        if opts.lock_at_least > 0:
            return (
                "singleton_on_duplicate 'coalesce' does not go with singleton_lock_at_least (a "
                "burst met in the window would give two runs after it, not one follow-up); use "
                "'skip' or 'retry' with a window, or coalesce without one"
            )
        return None

    def on_contended(self, call: Call, held: Contended, opts: Options) -> Action:
        if call.follow_up:  # never coalesced again: a newer run holds the key, it ends a skip
            return Action(Fate.SKIP, Why.DUPLICATE, holder=held.holder, policy=self.name)
        return Action(Fate.POLICY, Why.DUPLICATE, holder=held.holder, policy=self.name)

    def over_rate(self, call: Call, held: RateLimited, opts: Options) -> Action:
        wait = held.pttl_ms / 1000
        if call.eager:
            return Action(Fate.RAISE, Why.RATE, wait, held.holder, policy=self.name)
        if call.requeued or call.follow_up:  # the key's follow-up already: never dropped
            return Action(Fate.REQUEUE, Why.RATE, wait, held.holder, policy=RetryPolicy.name)
        return Action(Fate.POLICY, Why.RATE, wait, held.holder, policy=self.name)

    def carry_out(
        self, task: Any, action: Action, keys: LockKeys, held: Contended, request: Any
    ) -> Action:
        """Leave the call as the key's one follow-up (over the rate: the first call is the
        follow-up, requeued to the next allowed start; the others name it); skipped when left,
        requeued when it could not be (never dropped)."""
        if action.why is Why.RATE:
            return self._over_rate(task, action, keys, held, request)
        left = leave_call(task, keys, held.holder, request)
        if isinstance(left, str):
            return Action(Fate.SKIP, Why.DUPLICATE, 0.0, held.holder, left, self.name)
        return Action(Fate.REQUEUE, Why.DUPLICATE, left, held.holder, policy=self.name)

    def _over_rate(
        self, task: Any, action: Action, keys: LockKeys, held: Contended, request: Any
    ) -> Action:
        task_id = str(request_field(request, "id"))
        follow_up = _rate_follow_up(task, keys, held, task_id)
        if follow_up == task_id:  # this call is the key's one follow-up: at the next start
            return Action(
                Fate.REQUEUE, Why.RATE, action.countdown, held.holder, policy=RetryPolicy.name
            )
        return Action(Fate.SKIP, Why.RATE, action.countdown, held.holder, follow_up, self.name)

    def release(
        self,
        task: Any,
        held: HeldLock,
        renewer: Renewer,
        state: str,
        *,
        eager: bool,
        retval: Any = None,
    ) -> None:
        """Released now, not written ahead: the follow-up goes out at once."""
        on_released(held, renewer.release_now(held), state)
        opts = task.singleton_options()
        self.after_release(task, keys_of(held.key, opts.permits), state, held.owner)

    def after_release(
        self, task: Any, keys: LockKeys, reason: str, releaser: str | None = None
    ) -> None:
        """Publish the key's pending follow-up, if it has one and a slot is free."""
        try:
            publish_follow_up(
                task,
                store_for(task.singleton_options().redis_url).run_script,
                keys,
                reason,
                releaser,
            )
        except LOGGED_ERRORS as exc:
            task_logger.warning(
                "singleton: could not take coalesced follow-up, it waits for the next release "
                "or purge: %s key=%s: %s",
                task.name,
                keys.lock,
                exc,
                extra=about(task.name, ""),
            )


def leave_call(task: Any, keys: LockKeys, holder: str, request: Any) -> str | float:
    """Leave the call of ``request`` (a Context, or the dict a worker's tracer gets) as the
    follow-up of ``keys`` while ``holder`` still holds it: the follow-up's task id when left.

    Else the countdown to requeue the call after, never dropping it: the holder let go meanwhile
    (at once, or after an at-least window's end: it then takes the lock or meets its new
    holder), or Redis failed, or no serializer the app accepts keeps the call's key
    (``retry_countdown``). Left, the call's message is recorded as completed (as a run's
    release records it): the follow-up carries its call, so a broker's copy of it is dropped."""
    opts: Options = task.singleton_options()
    task_id = str(request_field(request, "id"))
    args = request_field(request, "args") or ()
    kwargs = request_field(request, "kwargs") or {}
    retries = int(request_field(request, "retries") or 0)
    completion_ms = round(opts.completion_ttl_of(bool(request_field(request, "eta"))) * 1000)
    try:
        left = leave_pending(
            store_for(opts.redis_url).run_script,
            keys,
            holder,
            uuid(),
            call_record(task, request, args, kwargs, keys.lock),
            (task_id, retries, completion_ms),
        )
    except _COALESCE_ERRORS as exc:
        task_logger.warning(
            "singleton: could not coalesce duplicate, requeued: %s[%s] key=%s: %s",
            task.name,
            task_id,
            keys.lock,
            exc,
            extra=about(task.name, task_id),  # called in front of Celery's tracer too
        )
        return float(opts.retry_countdown)
    if left.follow_up is None:
        task_logger.info(
            "singleton: holder let go before coalescing, requeued: %s[%s] key=%s holder=%s",
            task.name,
            task_id,
            keys.lock,
            holder,
            extra=about(task.name, task_id),
        )
        return max(left.pttl_ms, 0) / 1000 if left.finished else 0.0
    return left.follow_up


def _rate_follow_up(task: Any, keys: LockKeys, held: Contended, task_id: str) -> str:
    """The key's follow-up at its next allowed start: this call's task id when there is none
    yet (it is one now, until that moment), else the one there is. This call's when Redis
    cannot be asked: requeued, never dropped."""
    key = beside(keys.lock, "rate_next")
    try:
        found = store_for(task.singleton_options().redis_url).client.set(
            key, task_id, nx=True, px=max(held.pttl_ms, 1), get=True
        )
    except LOGGED_ERRORS as exc:
        task_logger.warning(
            "singleton: could not coalesce a run over the rate limit, retried: %s[%s] key=%s: %s",
            task.name,
            task_id,
            keys.lock,
            exc,
        )
        return task_id
    return task_id if found is None else as_text(found)  # type: ignore[arg-type]


def call_record(
    task: Task, request: Any, args: Sequence[Any], kwargs: Mapping[str, Any], lock_key: str
) -> dict[str, str | bytes]:
    """A duplicate's call as pending-record fields: enough to publish it again, shown as its
    caller had Celery show it (``argsrepr``/``kwargsrepr``, empty when not given: a later
    duplicate's call overwrites an earlier one's). Written so that it reads back as a call of
    ``lock_key`` (:func:`_dumps`); raises ``EncodeError`` when no serializer can."""
    content_type, encoding, body = _dumps(task, [list(args), dict(kwargs)], lock_key)
    argsrepr, kwargsrepr = reprs_of(request)
    record: dict[str, str | bytes] = {
        "task": task.name,
        "by": str(request_field(request, "id") or ""),
        "body": body,
        "ctype": content_type,
        "cenc": encoding,
        "argsrepr": argsrepr or "",
        "kwargsrepr": kwargsrepr or "",
    }
    delivery = request_field(request, "delivery_info") or {}
    for name in ("exchange", "routing_key"):
        value = delivery.get(name)
        if isinstance(value, str):
            record[name] = value
    return record


def _dumps(task: Task, call: list[Any], lock_key: str) -> tuple[str, str, bytes]:
    """``call`` in the task's serializer; else in the first of the app's ``accept_content``
    that writes it and reads it back as a call of the same lock. A message sent with another
    serializer than its task's (``pickle`` where the task's is ``json``) may carry what only
    that one writes, or keeps: JSON reads a tuple back as a list, which keys differently, so
    the follow-up would take another lock (and the release would drop it as not ours)."""

    def same_lock(loaded: Any) -> None:
        args, kwargs = loaded
        _check_lock(task, list(args), dict(kwargs), lock_key)

    try:
        return task_dumps(task, call, same_lock)
    except EncodeError as exc:
        raise EncodeError(
            f"no serializer the app accepts keeps the call of {lock_key}: {exc}"
        ) from None


def task_dumps(task: Task, data: Any, check: Callable[[Any], None]) -> tuple[str, str, bytes]:
    """``data`` in the task's serializer; else in the first of the app's ``accept_content``
    that writes it and reads back what ``check`` accepts (it raises otherwise). Raises
    ``EncodeError`` when none does."""
    first = task.serializer or task.app.conf.task_serializer
    names = [first]
    for item in task.app.conf.accept_content or ():
        for content_type in sorted(prepare_accept_content([item])):  # type: ignore[no-untyped-call]
            name = registry.type_to_name.get(content_type)
            if name is not None and name not in names:
                names.append(name)
    failed: Exception | None = None
    for name in names:
        try:
            written: tuple[str, str, bytes] = dumps(data, serializer=name)  # type: ignore[no-untyped-call]
            content_type, encoding, body = written
            check(loads(body, content_type, encoding, accept={content_type}))  # type: ignore[no-untyped-call]
        except Exception as exc:  # this serializer cannot keep it: the next one
            failed = failed or exc
            continue
        return written
    raise EncodeError(repr(failed))


@dataclass(frozen=True)
class Taken:
    """A pending record :func:`publish_follow_up` took: its follow-up's task id, and the newer
    run that superseded it (None: published)."""

    follow_up: str
    superseded_by: str | None = None


def publish_follow_up(
    task: Task, run: Run, keys: LockKeys, reason: str, releaser: str | None = None
) -> Taken | None:
    """Take the pending record of ``keys`` if a slot is not held by a run, and publish it; or,
    when ``releaser`` (the task id of the run whose release this is; None: no run's) is a
    newer run than every call the record carries, end it as that run's skip.

    None when there was nothing to publish (or it failed: then logged and put back; or the
    record is no call this app wrote: then logged and dropped)."""
    record = take_pending(run, keys)
    if record is None:
        return None
    follow_up = record.get("id", b"").decode(errors="replace")
    name = record.get("task", b"").decode(errors="replace") or task.name
    target = task.app.tasks.get(name)
    count = record.get("count", b"?").decode(errors="replace")
    try:
        args, kwargs, options = _call_of(task, record)
        _check_lock(target, args, kwargs, keys.lock)
    except Exception as exc:  # not written by this app: never loaded, never put back
        logger.error(
            "singleton: coalesced follow-up dropped, not a call this app wrote or accepts: "
            "%s[%s] key=%s: %r",
            name,
            follow_up,
            keys.lock,
            exc,
        )
        return None
    newer = superseded_by(record, releaser)
    if newer is not None:
        _supersede(task if target is None else target, name, keys.lock, follow_up, newer, count)
        return Taken(follow_up, newer)
    try:
        if target is None:  # a task of the scope this app does not have
            task.app.send_task(name, args, kwargs, task_id=follow_up, **options)
        else:  # Celery's own publish: no publish-time dedup against its own pending call
            Task.apply_async(target, args, kwargs, task_id=follow_up, **options)
    except Exception as exc:
        _put_back(run, keys, record, f"{name}[{follow_up}]", exc)
        return None
    logger.info(
        "singleton: coalesced follow-up published after %s: %s[%s] key=%s duplicates=%s",
        reason,
        name,
        follow_up,
        keys.lock,
        count,
    )
    return Taken(follow_up)


def _supersede(  # noqa: PLR0917 - the record, and the run that superseded it
    task: Task, name: str, lock_key: str, follow_up: str, newer: str, count: str
) -> None:
    """End the follow-up ``follow_up`` of ``name`` (``task``, or the releasing task for a task
    of the scope this app does not have) without publishing it, like a skip naming ``newer``:
    its result is the skip marker (a caller waiting on it learns why), one INFO line and
    ``duplicate_skipped``."""
    marker = skip_marker(lock_key, newer, follow_up)
    request = Context(id=follow_up, task=name, ignore_result=bool(task.ignore_result))
    try:
        store_skip(task, follow_up, marker, request)
    except Exception as exc:  # the backend failed: the call must not run all the same
        logger.error(
            "singleton: could not store the result of a superseded follow-up: %s[%s] key=%s "
            "holder=%s: %r",
            name,
            follow_up,
            lock_key,
            newer,
            exc,
        )
    logger.info(
        "singleton: coalesced follow-up superseded by a newer run, not published: %s[%s] "
        "key=%s holder=%s duplicates=%s",
        name,
        follow_up,
        lock_key,
        newer,
        count,
    )
    signals.duplicate_skipped.send(sender=task, key=lock_key, task_id=follow_up, holder=newer)


def _call_of(
    task: Task, record: Mapping[str, bytes]
) -> tuple[list[Any], dict[str, Any], dict[str, Any]]:
    """The args, kwargs and publish options (route, serializer, ``argsrepr``/``kwargsrepr``,
    :data:`FOLLOW_UP_HEADER`) of a pending record, read with the app's ``accept_content`` (a
    content type it does not accept raises ``ContentDisallowed``, before any decoding)."""
    accept = prepare_accept_content(task.app.conf.accept_content)  # type: ignore[no-untyped-call]
    args, kwargs = loads(  # type: ignore[no-untyped-call]
        record["body"], record["ctype"].decode(), record["cenc"].decode(), accept=accept
    )
    if not isinstance(args, list | tuple) or not isinstance(kwargs, Mapping):
        raise TypeError(f"not [args, kwargs]: {type(args).__name__}, {type(kwargs).__name__}")
    options: dict[str, Any] = {f: record[f].decode() for f in _ROUTE if f in record}
    if options.get("exchange") == "" and options.get("routing_key"):
        # the default exchange: a queue named by the routing key, which Celery's router must
        # be given as the queue (its own signature_from_request does the same); with the bare
        # routing key it would take the task's default queue's exchange instead
        options = {"queue": options["routing_key"]}
    for name in REPR_OPTIONS:  # the latest duplicate's: its mask stays on (run/callrepr.py)
        shown = record.get(name)
        if shown:
            options[name] = shown.decode(errors="replace")
    options["headers"] = {FOLLOW_UP_HEADER: True}
    serializer = registry.type_to_name.get(record["ctype"].decode())
    if serializer is not None:  # sent as it was written: the task's may not take the call
        options["serializer"] = serializer
    return list(args), dict(kwargs), options


def _check_lock(target: Any, args: list[Any], kwargs: dict[str, Any], lock_key: str) -> None:
    """Raise ValueError unless the call of ``target`` (a task of this app; None: one it does not
    have, not checked) takes the lock at ``lock_key``: a record naming any other task or call
    was not left by a duplicate of this lock, and is not published."""
    if target is None:
        return
    keys_of = getattr(target, "singleton_keys", None)
    if keys_of is None:
        raise ValueError(f"{target.name} is no SingletonTask")
    lock = keys_of(args, kwargs).lock
    if lock[lock.index("{") :] != lock_key[lock_key.find("{") :]:  # the prefix aside
        raise ValueError(f"its call takes another lock, {lock}")


def _put_back(
    run: Run, keys: LockKeys, record: dict[str, bytes], what: str, exc: Exception
) -> None:
    lock_key = keys.lock
    try:
        back = put_back(run, keys, record)
    except Exception as again:
        logger.error(
            "singleton: coalesced follow-up LOST, publish and put-back failed: %s key=%s: %s; %s",
            what,
            lock_key,
            exc,
            again,
        )
        return
    logger.error(
        "singleton: could not publish coalesced follow-up, %s: %s key=%s: %s",
        "put back for the next release" if back else "a newer one is pending",
        what,
        lock_key,
        exc,
    )


#: The delivery fields a follow-up is sent by (the latest duplicate's)
_ROUTE = ("exchange", "routing_key")
