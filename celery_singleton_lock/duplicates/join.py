"""``singleton_on_duplicate="join"``: a duplicate ends with the outcome of the run it met.

A duplicate that meets a run holding its lock does not run, and takes no worker slot while it
waits. In its ``before_start`` it:

1. keeps a record of its request beside the lock (core/joiners.py ``join.lua``, owner-checked:
   only while the run it met still holds the lock): its id, name, arguments, links, error
   links, chain, chord and group, in the task's serializer;
2. publishes a *watch copy* of its own message (the same task id, retries and canvas, as
   ``retry()`` would, due when the lock would expire; never after the message's own
   ``expires``), so that it is not lost if the run it joined dies without ending; the record
   names its serial, so there is one live watch copy per joiner;
3. ends without a result: its message is acknowledged, its state stays as it was (PENDING,
   or STARTED with ``track_started``). One ``singleton: duplicate joined`` line and
   ``duplicate_joined``.

When a run of the key ends for good (not a hand-over to its ``retry()``), it takes the joiners
(core/joiners.py ``take_joiners.lua``) before its release, and after it completes each as
Celery's tracer completes a run (:func:`complete_joiners`): with its return value, the
joiner's links and next chain step are sent and its result stored (a chord's header counts
it); with its exception, its result is that failure and its error links are called. Then each
is recorded as a completed run (core/completion.py), so its watch copy is dropped when it
arrives.

The watch copy, on arrival: dropped (the joiner was completed); joins again (the run still
holds the lock: a long run); or runs, when the run it joined died and no redelivery took its
lock back within the ttl. Its own end then completes the other joiners. A copy that is not
the live one (the broker handed it out again: a Redis ``visibility_timeout`` shorter than the
countdown) is dropped, one ``singleton: stale watch copy dropped`` line. A joiner whose
message expired is not completed: its watch copy, due no later than that, ends as Celery ends
an expired message (REVOKED). Nor is one that already ended while it waited (revoked: Celery
stores REVOKED for it; its state is read from the result backend at the completion): a call
ends once, and Celery runs no canvas of a revoked call. It is recorded as completed all the
same.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from celery import Task, states
from celery.app.task import Context
from celery.canvas import signature
from celery.exceptions import Ignore
from celery.utils.saferepr import saferepr
from kombu.serialization import loads, prepare_accept_content
from kombu.utils.encoding import safe_repr

from .. import signals
from ..beat.crons import close_skipped
from ..core.connection import store_for
from ..core.joiners import STALE, Joiner, join, record_done, take_joiners, unjoin
from ..run.log import LOGGED_ERRORS, about, logger
from ..run.task_events import EventSink, run_sink
from .coalesce import task_dumps
from .copies import (
    JOINED_HEADER,
    RECHECK_HEADER,
    publish_watch_copy,
    seconds_left,
    watch_countdown,
    watch_serial,
)

__all__ = [
    "JOINED_HEADER",
    "Joined",
    "complete_joiners",
    "join_holder",
    "runs_in_place",
    "take_ended_joiners",
]

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
_KEEP_PAST_LOCK_MS = 60_000


class Joined(Ignore):  # type: ignore[misc]
    """How a joined duplicate ends in Celery's tracer: acknowledged, nothing stored."""


def join_holder(task: Task, lock_key: str, holder: str, pttl_ms: int) -> float:
    """Join the run of ``holder`` (the lock's holder, ``pttl_ms`` left) from the current
    request's ``before_start``: raises :class:`Joined` once joined. Returns the countdown to
    requeue this duplicate after when it could not join: the holder let go meanwhile (0: it
    takes the lock or meets the next holder at once), or Redis failed."""
    request = task.request
    opts = task.singleton_options()
    run = store_for(opts.redis_url).run_script
    serial = watch_serial(request)
    try:
        joined = join(
            run, lock_key, holder, request.id, _record(task, request), _keep_ms(opts), serial
        )
    except LOGGED_ERRORS as exc:
        logger.warning(
            "singleton: could not join duplicate, requeued: %s[%s] key=%s: %s",
            task.name,
            request.id,
            lock_key,
            exc,
        )
        return float(opts.retry_countdown)
    if joined == STALE:
        _drop_stale(task, lock_key, request, serial)
        raise Joined()
    if not joined:
        return 0.0
    try:
        countdown = watch_countdown(pttl_ms, request.expires)
        publish_watch_copy(task, request, countdown, holder, joined)
    except Exception as exc:  # its message must stay somewhere: requeued instead
        try:
            withdrawn = unjoin(run, lock_key, request.id, joined) == 1
        except LOGGED_ERRORS:
            withdrawn = False
        logger.warning(
            "singleton: could not keep joined duplicate's message, %s: %s[%s] key=%s: %s",
            "requeued" if withdrawn else "the holder's end completes it",
            task.name,
            request.id,
            lock_key,
            exc,
        )
        if not withdrawn:
            raise Joined() from exc
        return float(opts.retry_countdown)
    logger.info(
        "singleton: duplicate joined: %s[%s] key=%s holder=%s",
        task.name,
        request.id,
        lock_key,
        holder,
    )
    signals.duplicate_joined.send(sender=task, key=lock_key, task_id=request.id, holder=holder)
    close_skipped(task)  # Sentry Crons: the run it joined closes its own check-in
    send_events = run_sink(task)
    if send_events is not None:  # Flower: JOINED, until its holder's end completes it
        send_events([("task-joined", request.id, {"holder": holder, "key": lock_key})])
    raise Joined()


def runs_in_place(task: Task, lock_key: str, request: Context) -> bool:
    """Whether this run may go on, having taken the lock: True for any run but a joiner's watch
    copy. A watch copy took it because the run it joined died: it withdraws its own record
    first, so that no later end completes it a second time, and runs. If its record is gone
    already, a run's end is completing it right now: it does not run (False: the caller ends
    it) but checks once more, one ttl later, with a copy that runs unless that end recorded it
    as completed (then acquire.lua drops the copy). A copy that is not the joiner's live one
    (its record names another) does not run either: the live one comes."""
    holder = request.get(JOINED_HEADER)
    if not holder:
        return True
    opts = task.singleton_options()
    serial = watch_serial(request)
    try:
        withdrawn = unjoin(store_for(opts.redis_url).run_script, lock_key, request.id, serial)
    except LOGGED_ERRORS as exc:  # its own end drops the record; a death before may repeat it
        logger.warning(
            "singleton: could not withdraw a joined duplicate that runs itself: %s[%s] key=%s: %s",
            task.name,
            request.id,
            lock_key,
            exc,
        )
        return True
    if withdrawn == STALE:
        _drop_stale(task, lock_key, request, serial)
        return False
    if withdrawn or request.get(RECHECK_HEADER):
        logger.info(
            "singleton: joined duplicate runs in its holder's place: %s[%s] key=%s holder=%s",
            task.name,
            request.id,
            lock_key,
            holder,
        )
        return True
    countdown = opts.ttl_ms / 1000
    try:
        publish_watch_copy(task, request, countdown, holder, serial, recheck=True)
    except Exception as exc:  # run now rather than risk a call left without an end
        logger.warning(
            "singleton: could not keep joined duplicate's message, runs now: %s[%s] key=%s: %s",
            task.name,
            request.id,
            lock_key,
            exc,
        )
        return True
    logger.info(
        "singleton: joined duplicate is being completed, checks again in %ss: %s[%s] key=%s",
        round(countdown, 3),
        task.name,
        request.id,
        lock_key,
    )
    return False


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
    for joiner in joiners:
        outcome = _completed(task, joiner, state, retval, lock_key, ended)
        if outcome is not None:
            request, was_completed = outcome
            done.append((joiner.task_id, int(request.retries or 0)))
            if was_completed:
                completed.append(joiner.task_id)
    if completed and send_events is not None:
        event = _event_of(task, state, retval)
        send_events([(event[0], task_id, event[1]) for task_id in completed])
    if done:
        try:
            record_done(run, lock_key, done, _keep_ms(opts) * 2)
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


def _record(task: Task, request: Context) -> bytes:
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


def _drop_stale(task: Task, lock_key: str, request: Context, serial: int | None) -> None:
    """The one line of a watch copy that is not its joiner's live one, which ends acknowledged
    with nothing stored: the broker handed a copy out again (Redis restores a countdown message
    the worker holds for longer than ``visibility_timeout``), and the live copy is still to
    come, or joined again already."""
    logger.info(
        "singleton: stale watch copy dropped: %s[%s] key=%s serial=%s",
        task.name,
        request.id,
        lock_key,
        serial,
    )


def _expired(expires: Any) -> bool:
    left = seconds_left(expires)
    return left is not None and left <= 0


def _keep_ms(opts: Any) -> int:
    return int(opts.ttl_ms) + _KEEP_PAST_LOCK_MS
