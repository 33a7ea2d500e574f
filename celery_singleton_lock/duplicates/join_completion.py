"""A joined duplicate's completion (``singleton_on_duplicate="join"``, duplicates/join.py):
the record a joiner keeps of its request, and how a run's end completes the joiners it takes,
as Celery's tracer completes a run.

Each joiner is completed with the outcome of the run it joined: with its return value, the
joiner's links and next chain step are sent and its result stored (a chord's header counts
it); with its exception, its result is that failure and its error links are called. Then each
is recorded as a completed run (core/completion.py), so its watch copy is dropped when it
arrives. A joiner whose message expired, or that already ended while it waited (revoked), is
not completed, and is recorded all the same.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from celery import Task, states
from celery.app.task import Context
from celery.canvas import signature
from celery.utils.saferepr import saferepr
from kombu.serialization import loads, prepare_accept_content
from kombu.utils.encoding import safe_repr

from ..core.completion import done_key
from ..core.connection import store_for
from ..core.joiners import Joiner, record_done, take_joiners
from ..run.log import LOGGED_ERRORS, about, logger
from ..run.task_events import EventSink
from .coalesce import task_dumps
from .copies import seconds_left

__all__ = ["complete_joiners", "keep_ms", "mark_taken", "record_of", "take_ended_joiners"]

#: The request fields a joiner's completion needs (Celery's tracer reads the same).
_FIELDS = (
    "id",
    "task",
    "args",
    "kwargs",
    "callbacks",
    "errbacks",
    "chain",
    "chord",
    "group",
    "group_index",
    "root_id",
    "parent_id",
    "reply_to",
    "correlation_id",
    "ignore_result",
    "retries",
    "expires",
    "hostname",
    "priority",
    "delivery_info",
)

#: The delivery fields kept (Celery's backends read them)
_DELIVERY = ("exchange", "routing_key", "priority", "is_eager")

#: How much longer than the lock the joiners are kept: a watch copy, due at the lock's expiry,
#: joins again (and so keeps them) while the holder still runs.
KEEP_PAST_LOCK_MS = 60_000


def take_ended_joiners(task: Task, lock_key: str, ended: str) -> list[Joiner]:
    """The joiners of ``lock_key`` that the end of run ``ended`` takes (``take_joiners.lua``);
    none when Redis fails (logged: their watch copies run them). A run takes them before it
    releases its lock: a watch copy that then takes the free lock finds its record gone and
    waits for its completion (:func:`runs_in_place`) instead of running a second time."""
    run = store_for(task.singleton_options().redis_url).run_script
    try:
        return take_joiners(run, lock_key, ended)
    except LOGGED_ERRORS as exc:
        logger.warning(
            "singleton: could not take joined duplicates, their watch copies run them: "
            "%s[%s] key=%s: %s",
            task.name,
            ended,
            lock_key,
            exc,
            extra=about(task.name, ended),
        )
        return []


def mark_taken(task: Task, lock_key: str, joiners: list[Joiner]) -> None:
    """Record ``joiners`` (just taken) as completed runs before the release that follows, so a
    copy of one's message that comes once the key is free (its original, handed out again by
    the broker; a watch copy) is dropped, not run beside its completion. One whose completion
    then fails has its record taken back (:func:`complete_joiners`): its watch copy runs it.
    Redis failing here leaves them as before: recorded after their completion."""
    done = [(j.task_id, r) for j in joiners if (r := _retries_of(task, j)) is not None]
    if not done:
        return
    opts = task.singleton_options()
    try:
        record_done(store_for(opts.redis_url).run_script, lock_key, done, keep_ms(opts) * 2)
    except LOGGED_ERRORS:  # recorded after their completion, as before
        return


def _retries_of(task: Task, joiner: Joiner) -> int | None:
    try:
        return int(_request_of(task, joiner.record).retries or 0)
    except Exception:  # unreadable: the completion logs it
        return None


def complete_joiners(  # noqa: PLR0917 - the run that ended, its joiners, its outcome
    task: Task,
    lock_key: str,
    ended: str,
    joiners: list[Joiner],
    state: str,
    retval: Any,
    *,
    send_events: EventSink | None,
) -> int:
    """Complete ``joiners``, those of ``lock_key`` that the end of run ``ended`` took
    (:func:`take_ended_joiners`); how many. ``state``: SUCCESS with the value ``retval``;
    FAILURE or REVOKED with the exception ``retval`` (each joiner ends in that state, its error
    links called). Each completed joiner's task event (``task-succeeded``, ``task-failed``,
    ``task-revoked``) goes to ``send_events`` (run/task_events.py), unless that is None.

    A joiner that already ended some other way while it waited (revoked, its result stored) is
    not completed a second time, but recorded as completed all the same: its watch copy is
    dropped when it comes."""
    opts = task.singleton_options()
    run = store_for(opts.redis_url).run_script
    done: list[tuple[str, int]] = []
    completed: list[str] = []
    failed: list[str] = []
    for joiner in joiners:
        outcome = _completed(task, joiner, state, retval, lock_key, ended)
        if outcome is None:
            failed.append(joiner.task_id)
        else:
            request, was_completed = outcome
            done.append((joiner.task_id, int(request.retries or 0)))
            if was_completed:
                completed.append(joiner.task_id)
    if failed:  # recorded before the release (mark_taken): their watch copies must run them
        with contextlib.suppress(*LOGGED_ERRORS):
            store_for(opts.redis_url).client.delete(*(done_key(lock_key, i) for i in failed))
    if completed and send_events is not None:
        event = _event_of(task, state, retval)
        send_events([(event[0], task_id, event[1]) for task_id in completed])
    if done:
        try:
            record_done(run, lock_key, done, keep_ms(opts) * 2)
        except LOGGED_ERRORS as exc:
            logger.warning(
                "singleton: could not record joined duplicates as completed, their watch "
                "copies run again: %s[%s] key=%s: %s",
                task.name,
                ended,
                lock_key,
                exc,
                extra=about(task.name, ended),
            )
    return len(completed)


def _completed(  # noqa: PLR0917 - the joiner, and the outcome it ends with
    task: Task, joiner: Joiner, state: str, retval: Any, lock_key: str, ended: str
) -> tuple[Context, bool] | None:
    """Complete one joiner: its request and True; its request and False when it had ended
    already (not completed, recorded as completed); None when it was not (expired,
    unreadable, or completing it failed)."""
    try:
        request = _request_of(task, joiner.record)
    except Exception as exc:  # not written by this app: never loaded
        logger.error(
            "singleton: joined duplicate dropped, not a record this app wrote or accepts: "
            "[%s] key=%s: %r",
            joiner.task_id,
            lock_key,
            exc,
            extra=about(task.name, ended),
        )
        return None
    if _expired(request.expires):
        return None  # its watch copy, due by then, ends it as expired
    target = task.app.tasks.get(request.task) or task
    already = _ended_as(target, request)
    if already is not None:
        logger.info(
            "singleton: joined duplicate already ended, not completed: %s[%s] key=%s "
            "holder=%s state=%s",
            request.task,
            request.id,
            lock_key,
            ended,
            already,
            extra=about(task.name, ended),
        )
        return request, False
    try:
        if state == states.SUCCESS:
            _succeed(target, request, retval)
        else:
            error = retval if isinstance(retval, BaseException) else RuntimeError(repr(retval))
            target.backend.mark_as_failure(
                request.id, error, None, request=request, call_errbacks=True, state=state
            )
    except Exception as exc:
        logger.error(
            "singleton: could not complete joined duplicate, its watch copy runs it: "
            "%s[%s] key=%s holder=%s: %r",
            request.task,
            request.id,
            lock_key,
            ended,
            exc,
            extra=about(task.name, ended),
        )
        return None
    logger.info(
        "singleton: joined duplicate completed: %s[%s] key=%s holder=%s state=%s",
        request.task,
        request.id,
        lock_key,
        ended,
        state,
        extra=about(task.name, ended),
    )
    return request, True


def _ended_as(task: Task, request: Context) -> str | None:
    """The ready state a joiner already ended in while it waited, else None: revoked (Celery's
    revoke stores REVOKED for a waiting call at once, from 5.6.2 on; a watch copy that came due
    after the revoke was discarded as REVOKED), expired, or a result stored some other way.
    Celery never runs the canvas of a revoked call, nor does a call end twice: such a joiner
    is not completed. One read of the result backend per joiner, at its completion only."""
    try:
        current = task.backend.get_state(request.id)
    except Exception:  # no backend to read, or it failed: completed as before
        return None
    return current if current in states.READY_STATES else None


def _event_of(task: Task, state: str, retval: Any) -> tuple[str, dict[str, Any]]:
    """The task event of a joiner completed in ``state`` with ``retval``, with the fields
    Celery's worker gives the same event."""
    if state == states.SUCCESS:
        return "task-succeeded", {"result": saferepr(retval, task.resultrepr_maxsize)}
    if state == states.REVOKED:
        return "task-revoked", {"terminated": False, "signum": None, "expired": False}
    return "task-failed", {"exception": safe_repr(retval), "traceback": ""}  # type: ignore[no-untyped-call]


def _succeed(task: Task, request: Context, retval: Any) -> None:
    """What Celery's tracer does for a run that returned ``retval``: links and the next chain
    step sent, then the result stored (a chord's header member counted)."""
    app = task.app
    for callback in request.callbacks or ():
        signature(callback, app=app).apply_async(
            (retval,), parent_id=request.id, root_id=request.root_id
        )
    chain = list(request.chain or ())
    if chain:
        signature(chain[-1], app=app).apply_async(
            (retval,), chain=chain[:-1], parent_id=request.id, root_id=request.root_id
        )
    task.backend.mark_as_done(request.id, retval, request=request)


def record_of(task: Task, request: Context) -> bytes:
    """The request fields a completion needs, in the task's serializer (or the first of the
    app's ``accept_content`` that keeps them), behind a JSON line naming it."""
    fields = {name: getattr(request, name, None) for name in _FIELDS}
    fields["args"] = list(fields["args"] or ())
    fields["kwargs"] = dict(fields["kwargs"] or {})
    delivery = fields["delivery_info"] or {}
    fields["delivery_info"] = {k: v for k, v in delivery.items() if k in _DELIVERY}
    if isinstance(fields["expires"], datetime):
        fields["expires"] = fields["expires"].isoformat()
    content_type, encoding, body = task_dumps(task, fields, lambda loaded: None)
    head = json.dumps({"ctype": content_type, "cenc": encoding}).encode()
    return head + b"\n" + (body if isinstance(body, bytes) else body.encode())


def _request_of(task: Task, record: bytes) -> Context:
    head, _, body = record.partition(b"\n")
    meta = json.loads(head)
    accept = prepare_accept_content(task.app.conf.accept_content)  # type: ignore[no-untyped-call]
    fields = loads(body, meta["ctype"], meta["cenc"], accept=accept)  # type: ignore[no-untyped-call]
    if not isinstance(fields, Mapping) or not fields.get("id"):
        raise TypeError(f"not a joiner's request: {type(fields).__name__}")
    return Context(dict(fields))


def _expired(expires: Any) -> bool:
    left = seconds_left(expires)
    return left is not None and left <= 0


def keep_ms(opts: Any) -> int:
    return int(opts.ttl_ms) + KEEP_PAST_LOCK_MS
