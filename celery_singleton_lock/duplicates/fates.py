"""How a call that did not get its lock ends, by its :class:`~.policy.Action`: skipped,
requeued, raised, dropped, left waiting, or run without the lock. Each end has its one log line
and its signal (docs/configuration.md, "Log lines" and "Signals").

The gate (gate.py) decides; this carries out, for every policy alike. :func:`carry_out` runs
inside Celery's tracer (``before_start``), where an end raises what Celery ends the run with:
:class:`~.skips.Skipped` (a skip: an ``Ignore``, the marker its result), ``Retry`` (a requeue),
the error (a raise), an ``Ignore`` (a drop, a wait). A skip decided in front of Celery's tracer
or in the worker's main process stores and reports the same way (:func:`store_skip`,
:func:`report_skip`), and ends there.
"""

from __future__ import annotations

import time
from typing import Any, NoReturn

from celery.exceptions import Ignore, Retry

from .. import signals
from ..beat.crons import close_skipped, requeued
from ..core.backend import Completed, Contended
from ..core.connection import store_for
from ..core.joiners import record_done
from ..core.keys import LockKeys
from ..errors import DuplicateTaskError, LockUnavailableError, RateLimitedError
from ..run.completion import drop_completed
from ..run.log import LOGGED_ERRORS, logger
from .canvas import store_skip as store_canvas_skip
from .copies import WAITING_HEADER, publish_copy, seconds_left, waiting_since
from .gate import Outcome
from .policy import Action, Fate, Policy, Why
from .raising import RaisePolicy
from .rate import rate_text
from .skips import Skipped, skip_marker

__all__ = [
    "carry_out",
    "record_ended",
    "report_skip",
    "requeue",
    "skip_marker_of",
    "store_skip",
]


def carry_out(  # noqa: PLR0917 - the call, and what it met
    task: Any,
    action: Action,
    keys: LockKeys,
    outcome: Outcome,
    request: Any,
    policy: Policy,
) -> Action:
    """End the current call by ``action`` inside Celery's tracer (it raises), or return the
    action it runs by: RUN (its caller holds the lock for the run) or RUN_UNLOCKED (logged: it
    runs unguarded). A POLICY action is first carried out by ``policy``, which gives the action
    that ends it."""
    while action.fate is Fate.POLICY:
        assert isinstance(outcome, Contended)
        action = policy.carry_out(task, action, keys, outcome, request)
    fate = action.fate
    if fate is Fate.RUN:
        return action
    task_id = request.id
    if fate is Fate.RUN_UNLOCKED:
        assert isinstance(outcome, LockUnavailableError)
        signals.lock_unavailable.send(
            sender=task, key=keys.lock, task_id=task_id, error=outcome, countdown=None
        )
        logger.error(
            "singleton: redis error on acquire, running without the lock: %s[%s] key=%s: %s",
            task.name,
            task_id,
            keys.lock,
            outcome,
        )
        return action
    if fate is Fate.DROP:
        assert isinstance(outcome, Completed)
        drop_completed(task, keys.lock, outcome, task_id)
    if fate is Fate.SKIP:
        marker = store_skip(task, keys, action, task_id, request)
        report_skip(task, keys, action, task_id)
        raise Skipped(marker)
    if fate is Fate.WAIT:
        raise Ignore()
    error = _error(task, action, keys, outcome, task_id)
    if fate is Fate.REQUEUE:
        _report_requeue(task, keys, action, task_id, error)
        # a copy of the running holder's own message: the holder's run owns the task id's
        # result, which this delivery's RETRY could overwrite after the holder's end
        requeue(task, action.countdown, error, store_retry=action.why is not Why.REDELIVERED)
    if isinstance(error, DuplicateTaskError | RateLimitedError) and (
        task.singleton_options().failure_is_final  # its FAILURE ends its message
    ):
        record_ended(task, keys, request)
    _report_raise(task, keys, action, task_id)
    raise error


def _error(task: Any, action: Action, keys: LockKeys, outcome: Outcome, task_id: str) -> Exception:
    """What the call fails with, or is requeued for (the requeue's RETRY names it)."""
    if isinstance(outcome, LockUnavailableError):
        return outcome
    if action.why is Why.QUEUE_FULL:
        return DuplicateTaskError(
            f"{task.name}[{task_id}] is a duplicate, and the queue of {keys.lock} is full "
            f"({action.length} calls wait)",
            key=keys.lock,
            task_id=task_id,
            holder=action.holder,
        )
    if action.why is Why.RATE:
        assert keys.rate is not None
        return RateLimitedError(
            f"{task.name}[{task_id}] is over the rate limit {rate_text(keys.rate)} of "
            f"{keys.lock}: the next start is allowed in {action.countdown:g}s",
            key=keys.lock,
            task_id=task_id,
            holder=action.holder,
        )
    return DuplicateTaskError(
        f"{task.name}[{task_id}] is a duplicate: {keys.lock} is held by {action.holder}",
        key=keys.lock,
        task_id=task_id,
        holder=action.holder,
    )


def _report_requeue(
    task: Any, keys: LockKeys, action: Action, task_id: str, error: Exception
) -> None:
    """A requeue's one line and its signal."""
    countdown, holder, why = action.countdown, action.holder, action.why
    shown = round(countdown, 3)
    if why is Why.REDIS:
        signals.lock_unavailable.send(
            sender=task, key=keys.lock, task_id=task_id, error=error, countdown=countdown
        )
        logger.error(
            "singleton: redis error on acquire, retrying in %ss: %s[%s] key=%s: %s",
            countdown,
            task.name,
            task_id,
            keys.lock,
            error,
        )
        return
    if why is Why.RATE:
        _rate_signal(task, keys, task_id, action, countdown)
        logger.info(
            "singleton: over the rate limit, retried in %ss: %s[%s] key=%s",
            shown,
            task.name,
            task_id,
            keys.lock,
        )
        return
    if why is Why.REDELIVERED:
        logger.warning(
            "singleton: redelivered while held, retrying in %ss: %s[%s] key=%s",
            shown,
            task.name,
            task_id,
            keys.lock,
        )
    elif why is Why.PARENT:
        logger.info(
            "singleton: waiting for the run that published it, retrying in %ss: "
            "%s[%s] key=%s holder=%s",
            shown,
            task.name,
            task_id,
            keys.lock,
            holder,
        )
    else:
        logger.info(
            "singleton: duplicate retried in %ss: %s[%s] key=%s holder=%s",
            shown,
            task.name,
            task_id,
            keys.lock,
            holder,
        )
    signals.duplicate_retried.send(
        sender=task, key=keys.lock, task_id=task_id, holder=holder, countdown=countdown
    )


def _report_raise(task: Any, keys: LockKeys, action: Action, task_id: str) -> None:
    if action.why is Why.QUEUE_FULL:
        logger.warning(
            "singleton: queue full, raised: %s[%s] key=%s length=%d",
            task.name,
            task_id,
            keys.lock,
            action.length,
        )
        signals.queue_full.send(
            sender=task, key=keys.lock, task_id=task_id, holder=action.holder, length=action.length
        )
        return
    if action.why is Why.RATE:
        _rate_signal(task, keys, task_id, action, None, policy=RaisePolicy.name)
        logger.info(
            "singleton: over the rate limit, raised: %s[%s] key=%s next_start_in=%ss",
            task.name,
            task_id,
            keys.lock,
            round(action.countdown, 3),
        )
        return
    logger.info(
        "singleton: duplicate raised: %s[%s] key=%s holder=%s",
        task.name,
        task_id,
        keys.lock,
        action.holder,
    )
    signals.duplicate_raised.send(sender=task, key=keys.lock, task_id=task_id, holder=action.holder)


def requeue(
    task: Any, countdown: float, reason: Exception, *, store_retry: bool = True
) -> NoReturn:
    """Publish the current message again, retries unchanged, and end this delivery as RETRY
    (``store_retry``; else with nothing stored, as Celery's ``Ignore``); shown as its caller had
    Celery show it (``argsrepr``/``kwargsrepr``: run/callrepr.py). An eager or direct call
    cannot be requeued: it fails with ``reason``."""
    request = task.request
    if request.is_eager or request.called_directly:
        raise reason
    headers: dict[str, Any] = {}
    if isinstance(reason, DuplicateTaskError | RateLimitedError):  # waiting: since when
        since = waiting_since(request) or [time.time(), int(request.retries or 0)]
        headers[WAITING_HEADER] = since
    try:
        publish_copy(task, request, countdown, headers)
    except Exception as exc:  # the broker is down too: fail loudly, never run unguarded
        logger.error(
            "singleton: could not requeue, failing the run: %s[%s]: %s",
            task.name,
            request.id,
            exc,
        )
        raise reason from exc
    requeued(request)  # Sentry Crons: the copy closes the run's check-in
    left = seconds_left(request.expires)
    if not store_retry:
        raise Ignore()
    if left is not None and left <= countdown:
        # the copy comes due after its message expired, and the worker that gets it ends it
        # REVOKED, as Celery ends an expired task, maybe before this delivery's RETRY would
        # be stored: stored after, that RETRY would stay for ever
        raise Ignore()
    raise Retry(f"singleton: requeued: {reason}", exc=reason, when=countdown)


def skip_marker_of(
    keys: LockKeys, action: Action, task_id: str, now: float | None = None
) -> dict[str, Any]:
    """The result a call skipped by ``action`` stores (duplicates/skips.py)."""
    if action.why is Why.SUPERSEDED:
        return skip_marker(keys.lock, action.holder, task_id, superseded_by=action.holder)
    next_start = None
    if action.why is Why.RATE:  # when the next start is allowed, on this process's clock
        next_start = round((time.time() if now is None else now) + action.countdown, 3)
    return skip_marker(keys.lock, action.holder, task_id, action.follow_up, next_start)


def store_skip(
    task: Any, keys: LockKeys, action: Action, task_id: str, request: Any
) -> dict[str, Any]:
    """Store a skipped call's result (SUCCESS, the skip marker) and return it; so is that of
    each canvas task that will not run after it (duplicates/canvas.py). Then its message is
    recorded as completed (:func:`record_ended`; not when storing failed: Celery's tracer,
    which then takes the call over, must not find it completed). ``request`` is the call's,
    current."""
    marker = skip_marker_of(keys, action, task_id)
    if not request.is_eager or task.app.conf.task_store_eager_result:
        stopped = store_canvas_skip(task, task_id, marker, request)
        if stopped:
            logger.info(
                "singleton: skipped duplicate stops its canvas, %d later tasks marked "
                "skipped: %s[%s] key=%s holder=%s",
                stopped,
                task.name,
                task_id,
                keys.lock,
                action.holder,
            )
    record_ended(task, keys, request)
    return marker


def record_ended(task: Any, keys: LockKeys, request: Any) -> None:
    """Record the message of a call that ended without running (skipped, raised) as
    completed, as a run's release records its own (run/completion.py): a copy of it that a
    broker delivers later (an eta or ``acks_late`` message handed out again) is then dropped,
    not run once the key is free. Only where a run would record one (its completion ttl);
    never for an eager call. A Redis error is logged: the call ends all the same."""
    opts = task._singleton_opts or task.singleton_options()
    keep_s = opts.delayed_completion_ttl if request.eta else opts.completion_ttl
    if not keep_s or request.is_eager:  # most skips: a task acked early, no eta
        return
    done = [(request.id, int(request.retries or 0))]
    try:  # as a run's release writes it: a larger generation recorded is kept
        record_done(store_for(opts.redis_url).run_script, keys.lock, done, round(keep_s * 1000))
    except LOGGED_ERRORS as exc:
        logger.warning(
            "singleton: could not record ended duplicate as completed, a copy of it may run: "
            "%s[%s] key=%s: %s",
            task.name,
            request.id,
            keys.lock,
            exc,
        )


def report_skip(task: Any, keys: LockKeys, action: Action, task_id: str) -> None:
    """A skip's one log line and its signal (and its Sentry Crons check-in closed); the call's
    request is current."""
    close_skipped(task)
    holder, follow_up = action.holder, action.follow_up
    if action.why is Why.SUPERSEDED:
        logger.info(
            "singleton: debounced call superseded: %s[%s] key=%s by=%s",
            task.name,
            task_id,
            keys.lock,
            holder,
        )
        signals.duplicate_skipped.send(
            sender=task, key=keys.lock, task_id=task_id, holder=holder, superseded_by=holder
        )
        return
    if action.why is Why.RATE:
        _rate_signal(task, keys, task_id, action, None)
        logger.info(
            "singleton: over the rate limit, skipped: %s[%s] key=%s next_start_in=%ss follow_up=%s",
            task.name,
            task_id,
            keys.lock,
            round(action.countdown, 3),
            follow_up,
        )
        return
    if follow_up is not None:
        logger.info(
            "singleton: duplicate coalesced: %s[%s] key=%s holder=%s follow_up=%s",
            task.name,
            task_id,
            keys.lock,
            holder,
            follow_up,
        )
        signals.duplicate_skipped.send(
            sender=task, key=keys.lock, task_id=task_id, holder=holder, follow_up=follow_up
        )
        return
    logger.info(
        "singleton: duplicate skipped: %s[%s] key=%s holder=%s",
        task.name,
        task_id,
        keys.lock,
        holder,
    )
    signals.duplicate_skipped.send(sender=task, key=keys.lock, task_id=task_id, holder=holder)


def _rate_signal(  # noqa: PLR0917 - the call, and what it met
    task: Any,
    keys: LockKeys,
    task_id: str,
    action: Action,
    countdown: float | None,
    policy: str | None = None,
) -> None:
    """``rate_limited``, if anyone listens: the one send of every call over the rate."""
    if signals.rate_limited.receivers:
        signals.rate_limited.send(
            sender=task,
            key=keys.lock,
            task_id=task_id,
            holder=action.holder,
            policy=policy or action.policy,
            next_start_in=action.countdown,
            countdown=countdown,
        )
