"""What a run does when it does not get its lock: the duplicate policies (skip, retry,
raise, coalesce), the wait for the run that published it, Redis down
(``singleton_on_redis_error``), and the requeue they share.

:class:`DuplicatePolicies` is a base of
:class:`~celery_singleton_lock.task.singleton_task.SingletonTask`;
its methods run inside the task's ``before_start`` (and, for a skip, in front of Celery's
tracer: task/tracer.py), with the task's ``self.request``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from celery import Task
from celery.exceptions import Ignore, Retry
from kombu.exceptions import EncodeError
from kombu.utils.uuid import uuid

from .. import signals
from ..beat.crons import close_skipped, requeued
from ..core.backend import Acquired, Contended, RateLimited
from ..core.connection import store_for
from ..core.keys import LockKeys
from ..core.pending import leave_pending
from ..core.renewer import Renewer
from ..errors import DuplicateTaskError, LockUnavailableError, RateLimitedError
from ..run.callrepr import request_field
from ..run.log import LOGGED_ERRORS, about, logger
from ..settings.options import Options
from .canvas import store_skip
from .coalesce import call_record, is_follow_up
from .copies import publish_copy, seconds_left
from .join import join_holder
from .rate import NEXT_START, over_rate, report_rate_skip
from .skips import Skipped, skip_marker

__all__ = ["PARENT_WAITS", "WAITING_HEADER", "DuplicatePolicies", "waited"]

#: Pauses (seconds) between the tries of a message whose lock is held by the run that published
#: it (a chain step, a link callback); after them it is requeued like a redelivered message.
PARENT_WAITS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16)


#: What a duplicate that cannot be coalesced meets: Redis down, or no serializer the app accepts
#: keeps its call's key (duplicates/coalesce.py); it is requeued instead.
_COALESCE_ERRORS: tuple[type[Exception], ...] = (*LOGGED_ERRORS, EncodeError)


#: Message header of a duplicate requeued to wait for its lock: ``[first requeue, retries]``,
#: the wall clock (epoch s) of its first requeue and its retries count then. The run that
#: finally takes the lock reports the wait (``lock_acquired``'s ``waited``).
WAITING_HEADER = "singleton_waiting_since"


class DuplicatePolicies(Task):  # type: ignore[misc]
    """The duplicate policies of
    :class:`~celery_singleton_lock.task.singleton_task.SingletonTask`."""

    if TYPE_CHECKING:  # given by SingletonTask

        def singleton_options(self) -> Options: ...

        @staticmethod
        def _singleton_sleep(seconds: float) -> None: ...

    def _singleton_wait_for_parent(
        self,
        renewer: Renewer,
        keys: LockKeys,
        held: Contended,
        generation: int,
        meta: Mapping[str, str],
    ) -> Acquired | Contended:
        """Try again while the run that published this message still holds the lock.

        A chain's next step and a link callback are published by the run before them after its
        body returned, and reach another worker process before that run's release does: the
        release follows within milliseconds. Up to the sum of :data:`PARENT_WAITS` in all.
        """
        task_id, ttl_ms = self.request.id, self.singleton_options().ttl_ms
        outcome: Acquired | Contended = held
        for delay in PARENT_WAITS:
            self._singleton_sleep(delay)
            outcome = renewer.acquire(keys, task_id, generation, ttl_ms, meta)
            if not (isinstance(outcome, Contended) and outcome.holder == held.holder):
                break
        return outcome

    def _singleton_duplicate(
        self, opts: Options, keys: LockKeys, held: Contended, task_id: str
    ) -> NoReturn:
        if isinstance(held, RateLimited):  # over the key's rate limit (duplicates/rate.py)
            over_rate(self, opts, keys, held, task_id, waited(self.request) is not None)
        request = self.request
        error = DuplicateTaskError(
            f"{self.name}[{task_id}] is a duplicate: {keys.lock} is held by {held.holder}",
            key=keys.lock,
            task_id=task_id,
            holder=held.holder,
        )
        if held.holder in (task_id, request.parent_id):
            # The same message again while its earlier delivery holds the lock (an acks_late
            # redelivery), or a message published by the run that holds the lock (a chain's
            # next step, a link callback, a call from the body). Neither is a duplicate:
            # skipping would drop the run (or overwrite its result). Wait until the holder
            # releases, or its lock expires because the holder is dead.
            countdown = max(held.pttl_ms, 0) / 1000 + 0.1
            if not held.finished:  # a window ends at its pttl; a running holder may end sooner
                countdown = min(opts.retry_countdown or 1.0, countdown)
            if held.holder == task_id:
                logger.warning(
                    "singleton: redelivered while held, retrying in %ss: %s[%s] key=%s",
                    round(countdown, 3),
                    self.name,
                    task_id,
                    keys.lock,
                )
            else:
                logger.info(
                    "singleton: waiting for the run that published it, retrying in %ss: "
                    "%s[%s] key=%s holder=%s",
                    round(countdown, 3),
                    self.name,
                    task_id,
                    keys.lock,
                    held.holder,
                )
            signals.duplicate_retried.send(
                sender=self, key=keys.lock, task_id=task_id, holder=held.holder, countdown=countdown
            )
            self._singleton_requeue(countdown, error)
        policy = opts.on_duplicate
        if policy == "retry" and not request.is_eager:
            countdown = opts.retry_countdown
            if held.finished:  # an at-least window: nothing can run before it ends, in pttl
                countdown = max(countdown, held.pttl_ms / 1000)
            logger.info(
                "singleton: duplicate retried in %ss: %s[%s] key=%s holder=%s",
                round(countdown, 3),
                self.name,
                task_id,
                keys.lock,
                held.holder,
            )
            signals.duplicate_retried.send(
                sender=self,
                key=keys.lock,
                task_id=task_id,
                holder=held.holder,
                countdown=countdown,
            )
            self._singleton_requeue(countdown, error)
        if policy == "coalesce" and not is_follow_up(request):  # a follow-up: as a skip
            wait = self._singleton_coalesce(
                keys, held.holder, task_id, request.args or (), request.kwargs or {}, request
            )
            if wait is not None:
                self._singleton_requeue(wait, error)
        if policy == "join" and not request.is_eager:  # raises Joined once joined
            self._singleton_requeue(join_holder(self, keys.lock, held.holder, held.pttl_ms), error)
        if policy in ("skip", "coalesce"):
            marker = self._singleton_store_skip(keys, held.holder, task_id, request)
            self._singleton_report_skip(keys, held.holder, task_id)
            raise Skipped(marker)
        logger.info(
            "singleton: duplicate raised: %s[%s] key=%s holder=%s",
            self.name,
            task_id,
            keys.lock,
            held.holder,
        )
        signals.duplicate_raised.send(
            sender=self, key=keys.lock, task_id=task_id, holder=held.holder
        )
        raise error

    def _singleton_skips(
        self, outcome: Acquired | Contended | LockUnavailableError, task_id: str, parent: Any
    ) -> bool:
        """Whether a worker's first acquire ends the run as a skipped duplicate at once: held
        by another run (not this message's earlier delivery, nor the run that published it)
        under the skip policy."""
        return (
            isinstance(outcome, Contended)
            and not isinstance(outcome, RateLimited)  # ended by policy in before_start
            and outcome.holder not in (task_id, parent)
            and self.singleton_options().on_duplicate in ("skip", "coalesce")
        )

    def _singleton_coalesce(  # noqa: PLR0917 - the duplicate's call, and where it is kept
        self,
        keys: LockKeys,
        holder: str,
        task_id: str,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        request: Any,
    ) -> float | None:
        """Leave this duplicate's call as the lock's pending follow-up (duplicates/coalesce.py)
        while
        ``holder`` still holds it; the follow-up's id goes on ``request`` for the marker.

        None when left; else the countdown to requeue the duplicate after, never dropping it:
        the holder let go meanwhile (at once, or after an at-least window's end: it then takes
        the lock or meets its new holder), or Redis failed, or no serializer the app accepts
        keeps the call's key (``retry_countdown``).

        Left, the duplicate's message is recorded as completed (as a run's release records
        it): the follow-up carries its call, so a broker's copy of it is dropped."""
        opts: Options = self.singleton_options()
        try:
            left = leave_pending(
                store_for(opts.redis_url).run_script,
                keys,
                holder,
                uuid(),
                call_record(self, request, args, kwargs, keys.lock),
                (task_id, _retries(request), _completion_ms(opts, request)),
            )
        except _COALESCE_ERRORS as exc:
            logger.warning(
                "singleton: could not coalesce duplicate, requeued: %s[%s] key=%s: %s",
                self.name,
                task_id,
                keys.lock,
                exc,
                extra=about(self.name, task_id),  # called in front of Celery's tracer too
            )
            return opts.retry_countdown
        if left.follow_up is None:
            logger.info(
                "singleton: holder let go before coalescing, requeued: %s[%s] key=%s holder=%s",
                self.name,
                task_id,
                keys.lock,
                holder,
                extra=about(self.name, task_id),
            )
            return max(left.pttl_ms, 0) / 1000 if left.finished else 0.0
        if isinstance(request, dict):
            request["_singleton_follow_up"] = left.follow_up
        else:
            request._singleton_follow_up = left.follow_up
        return None

    def _singleton_store_skip(
        self, keys: LockKeys, holder: str, task_id: str, request: Any
    ) -> dict[str, Any]:
        """Store a skipped duplicate's result (SUCCESS, the skip marker) and return it; so is
        that of each canvas task that will not run after it (duplicates/canvas.py)."""
        marker = skip_marker(
            keys.lock,
            holder,
            task_id,
            getattr(request, "_singleton_follow_up", None),
            getattr(request, NEXT_START, None),  # skipped for the rate (duplicates/rate.py)
            superseded_by=getattr(request, "_singleton_superseded", None),  # duplicates/debounce.py
        )
        if not request.is_eager or self.app.conf.task_store_eager_result:
            stopped = store_skip(self, task_id, marker, request)
            if stopped:
                logger.info(
                    "singleton: skipped duplicate stops its canvas, %d later tasks marked "
                    "skipped: %s[%s] key=%s holder=%s",
                    stopped,
                    self.name,
                    task_id,
                    keys.lock,
                    holder,
                )
        return marker

    def _singleton_report_skip(self, keys: LockKeys, holder: str, task_id: str) -> None:
        """The skip's one log line and its signal (and its Sentry Crons check-in closed)."""
        close_skipped(self)
        if getattr(self.request, "_singleton_superseded", None) is not None:  # debounced
            logger.info(
                "singleton: debounced call superseded: %s[%s] key=%s by=%s",
                self.name,
                task_id,
                keys.lock,
                holder,
            )
            signals.duplicate_skipped.send(
                sender=self, key=keys.lock, task_id=task_id, holder=holder, superseded_by=holder
            )
            return
        follow_up = getattr(self.request, "_singleton_follow_up", None)
        next_start = getattr(self.request, NEXT_START, None)
        if next_start is not None:  # skipped for the rate: its own line
            report_rate_skip(self, keys, holder, task_id, next_start, follow_up)
            return
        if follow_up is not None:
            logger.info(
                "singleton: duplicate coalesced: %s[%s] key=%s holder=%s follow_up=%s",
                self.name,
                task_id,
                keys.lock,
                holder,
                follow_up,
            )
            signals.duplicate_skipped.send(
                sender=self, key=keys.lock, task_id=task_id, holder=holder, follow_up=follow_up
            )
            return
        logger.info(
            "singleton: duplicate skipped: %s[%s] key=%s holder=%s",
            self.name,
            task_id,
            keys.lock,
            holder,
        )
        signals.duplicate_skipped.send(sender=self, key=keys.lock, task_id=task_id, holder=holder)

    def _singleton_redis_down(
        self, opts: Options, keys: LockKeys, task_id: str, error: LockUnavailableError
    ) -> None:
        """Redis failed at acquire: requeue ("fail"), or run without the lock ("run")."""
        run_anyway = opts.on_redis_error == "run"
        countdown = None if run_anyway else opts.retry_countdown
        signals.lock_unavailable.send(
            sender=self, key=keys.lock, task_id=task_id, error=error, countdown=countdown
        )
        if run_anyway:
            logger.error(
                "singleton: redis error on acquire, running without the lock: %s[%s] key=%s: %s",
                self.name,
                task_id,
                keys.lock,
                error,
            )
            return
        logger.error(
            "singleton: redis error on acquire, retrying in %ss: %s[%s] key=%s: %s",
            opts.retry_countdown,
            self.name,
            task_id,
            keys.lock,
            error,
        )
        self._singleton_requeue(opts.retry_countdown, error)

    def _singleton_requeue(self, countdown: float, reason: Exception) -> NoReturn:
        """Publish this message again, retries unchanged, and end this delivery as RETRY; shown
        as its caller had Celery show it (``argsrepr``/``kwargsrepr``: run/callrepr.py)."""
        request = self.request
        if request.is_eager or request.called_directly:
            raise reason
        headers: dict[str, Any] = {}
        if isinstance(reason, DuplicateTaskError | RateLimitedError):  # waiting: since when
            since = _waiting_since(request) or [time.time(), int(request.retries or 0)]
            headers[WAITING_HEADER] = since
        try:
            publish_copy(self, request, countdown, headers)
        except Exception as exc:  # the broker is down too: fail loudly, never run unguarded
            logger.error(
                "singleton: could not requeue, failing the run: %s[%s]: %s",
                self.name,
                request.id,
                exc,
            )
            raise reason from exc
        requeued(request)  # Sentry Crons: the copy closes the run's check-in
        left = seconds_left(request.expires)
        if left is not None and left <= countdown:
            # the copy comes due after its message expired, and the worker that gets it ends it
            # REVOKED, as Celery ends an expired task, maybe before this delivery's RETRY would
            # be stored: stored after, that RETRY would stay for ever
            raise Ignore()
        raise Retry(f"singleton: requeued: {reason}", exc=reason, when=countdown)


def _waiting_since(request: Any) -> list[float] | None:
    """This delivery's :data:`WAITING_HEADER`, if it is a requeued duplicate of this retry."""
    value = request.get(WAITING_HEADER)
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        return None
    try:
        since, retries = float(value[0]), int(value[1])
    except (TypeError, ValueError):  # not ours: never fail a run over a header
        return None
    if retries != int(request.retries or 0):  # a later self.retry() carried it along
        return None
    return [since, retries]


def _retries(request: Any) -> int:
    """The retries count of a Celery request: a Context, or the dict a worker's tracer gets."""
    return int(request_field(request, "retries") or 0)


def _completion_ms(opts: Options, request: Any) -> int:
    """The completion ttl (ms) of a Celery request's message (a Context, or a dict): longer
    for one that carried an eta or countdown (``Options.delayed_completion_ttl``)."""
    return round(opts.completion_ttl_of(bool(request_field(request, "eta"))) * 1000)


def waited(request: Any) -> float | None:
    """Seconds since this message was first requeued to wait for its lock, or None."""
    since = _waiting_since(request)
    return None if since is None else max(0.0, time.time() - since[0])
