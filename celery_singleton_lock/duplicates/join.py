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
Celery's tracer completes a run (duplicates/join_completion.py): with its return value, the
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

from typing import Any

from celery import Task, states
from celery.app.task import Context
from celery.exceptions import Ignore

from .. import signals
from ..beat.crons import close_skipped
from ..core.backend import Contended
from ..core.connection import store_for
from ..core.joiners import STALE, join, unjoin
from ..core.keys import LockKeys
from ..core.renewer import HeldLock, Renewer
from ..errors import SingletonKeyError
from ..run.events import on_released
from ..run.log import LOGGED_ERRORS, about, logger
from ..run.task_events import EventSink, run_sink
from ..settings.options import Options
from .copies import (
    JOINED_HEADER,
    RECHECK_HEADER,
    publish_watch_copy,
    watch_countdown,
    watch_serial,
)
from .join_completion import (
    complete_joiners,
    keep_ms,
    mark_taken,
    record_of,
    take_ended_joiners,
)
from .policy import Action, Call, Fate, Policy, Why

__all__ = [
    "JOINED_HEADER",
    "JoinPolicy",
    "Joined",
    "complete_joiners",
    "join_holder",
    "runs_in_place",
    "take_ended_joiners",
]


#: What withdrawing a revoked joiner may meet: logged, its REVOKED state still guards it.
_WITHDRAW_ERRORS: tuple[type[Exception], ...] = (SingletonKeyError, *LOGGED_ERRORS)


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
            run, lock_key, holder, request.id, record_of(task, request), keep_ms(opts), serial
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


class JoinPolicy(Policy):
    """A duplicate ends with the outcome of the run it met."""

    name = "join"
    publishes_canvas = True
    owes_waiting_calls = True

    def refuse(self, opts: Options) -> str | None:
        if opts.permits > 1 or opts.lock_at_least > 0:
            return (
                "singleton_on_duplicate 'join' does not go with singleton_permits > 1 or "
                "singleton_lock_at_least (a duplicate joins the one run that holds its key; with "
                "several, or after a window, there is no such run)"
            )
        if opts.permits == 0 and opts.rate_limit is not None:
            return (
                "singleton_rate_limit with singleton_on_duplicate 'join' needs a limit on runs "
                "at once (singleton_permits 1): with singleton_permits 'unlimited' no run holds "
                "a lock to join"
            )
        return None

    def on_contended(self, call: Call, held: Contended, opts: Options) -> Action:
        if call.eager:  # nothing can wait beside an eager call
            return Action(Fate.RAISE, Why.DUPLICATE, holder=held.holder, policy=self.name)
        return Action(Fate.POLICY, Why.DUPLICATE, holder=held.holder, policy=self.name)

    def carry_out(
        self, task: Any, action: Action, keys: LockKeys, held: Contended, request: Any
    ) -> Action:
        """Join the holder's run (raises :class:`Joined`); requeued when it could not."""
        countdown = join_holder(task, keys.lock, held.holder, held.pttl_ms)
        return Action(Fate.REQUEUE, Why.DUPLICATE, countdown, held.holder, policy=self.name)

    def on_acquired(self, task: Any, key: str, request: Any) -> bool:
        return runs_in_place(task, key, request)

    def on_withdrawn(self, task: Any, request: Any) -> None:
        """A joiner's watch copy revoked or expired (the worker discards it): its record is
        withdrawn at once, so no run's end completes a call that ended REVOKED."""
        if not request.get(JOINED_HEADER):
            return
        try:
            keys = task.singleton_keys(request.args, request.kwargs)
            unjoin(store_for(task.singleton_options().redis_url).run_script, keys.lock, request.id)
        except _WITHDRAW_ERRORS as exc:  # its REVOKED state guards it still
            logger.warning(
                "singleton: could not withdraw a revoked joined duplicate, its holder's end "
                "leaves it: %s[%s]: %s",
                task.name,
                request.id,
                exc,
                extra=about(task.name, request.id),
            )

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
        """Released now, and the joiners completed at once with the run's outcome: taken while
        the lock is held and recorded as completed before the release (a copy of a joiner's
        message that takes the released lock is dropped, or finds its record gone and waits for
        its completion, instead of running itself), and again after the release (those that
        joined in the round trip between)."""
        ends = state in (states.SUCCESS, states.FAILURE) and not eager
        taken = take_ended_joiners(task, held.key, held.owner) if ends else []
        if taken:
            mark_taken(task, held.key, taken)
        on_released(held, renewer.release_now(held), state)
        if ends:
            taken += take_ended_joiners(task, held.key, held.owner)
        if taken:
            complete_joiners(
                task, held.key, held.owner, taken, state, retval, send_events=run_sink(task)
            )

    def on_lost(  # noqa: PLR0917 - as Policy's
        self,
        task: Any,
        task_id: str,
        keys: LockKeys,
        state: str,
        exc: BaseException,
        send_events: EventSink | None,
    ) -> None:
        """The duplicates that joined the run end as its own caller sees it."""
        taken = take_ended_joiners(task, keys.lock, task_id)
        complete_joiners(task, keys.lock, task_id, taken, state, exc, send_events=send_events)
