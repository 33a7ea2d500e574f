"""SingletonTask: take the lock right before the task body runs, keep it renewed, free it after.

The lock is taken in :meth:`SingletonTask.before_start`, on the worker, so every way a
message can arrive (``delay``, ``send_task``, canvas, beat) is covered. Its owner is the
task id and its generation the retries count, so:

- a retried message (same id, one more retry) takes the lock over from the run that
  called ``retry()``; that run extends the lock to cover the countdown first, so nothing
  can slip in between;
- the worker's main process can release a lock its dead pool child held (see worker.py).

The release runs from the ``task_postrun`` signal (worker.py), which fires for every
outcome of a traced run: success, failure, Ignore, Reject and Retry.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime, timezone
from functools import partial
from typing import Any, ClassVar, NoReturn

from celery import Task, states
from celery.exceptions import Retry
from celery.result import EagerResult
from celery.utils.log import get_task_logger
from kombu.utils.uuid import uuid

from . import signals
from .canvas import store_skip
from .coalesce import call_record, publish_follow_up
from .completion import drop_completed, ending_for
from .config import Options, read_options
from .core._pid import current_pid
from .core.backend import (
    REDIS_ERRORS,
    Acquired,
    Completed,
    Contended,
    ReleaseStatus,
    release_lost_slot,
)
from .core.connection import renewer_for, store_for
from .core.keys import KeyDeriver, LockKeys, args_preview, scope_key_names
from .core.pending import leave_pending
from .core.renewer import HeldLock, Renewer
from .errors import (
    DuplicateTaskError,
    LockUnavailableError,
    SingletonConfigError,
    SingletonKeyError,
)
from .events import configure_renewer, on_released
from .publish import (
    always_published,
    delivered_arguments,
    finished,
    forget_queued,
    mark_queued,
    marker_ttl_ms,
    not_published,
)
from .skips import Skipped, skip_marker
from .tracing import FirstTry, Tracer, take_first_try, trace_run

__all__ = ["LockHandle", "SingletonTask"]

# A Celery task logger named after this module (a child of ``celery.task``): in a worker its
# lines go through Celery's task handler, so ``worker_task_log_format``'s %(task_name)s and
# %(task_id)s name the run that logged them. The package's logger exists first: one created
# after this would take this logger back under it (logging's placeholder fix-up).
logging.getLogger(__package__)
logger = get_task_logger(__name__)

#: Pauses (seconds) between the tries of a message whose lock is held by the run that published
#: it (a chain step, a link callback); after them it is requeued like a redelivered message.
PARENT_WAITS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16)


#: Message header of a duplicate requeued to wait for its lock: ``[first requeue, retries]``,
#: the wall clock (epoch s) of its first requeue and its retries count then. The run that
#: finally takes the lock reports the wait (``lock_acquired``'s ``waited``).
WAITING_HEADER = "singleton_waiting_since"

#: What a failed marker delete raises: logged, and the marker expires in its ttl.
_FORGET_ERRORS: tuple[type[Exception], ...] = (LockUnavailableError, *REDIS_ERRORS)


class LockHandle:
    """What a run knows of its lock: ``self.singleton`` inside a bound task."""

    __slots__ = ("_handed_over", "_held", "_renewer", "key", "reentered", "task_id")

    def __init__(
        self,
        key: str | None = None,
        task_id: str | None = None,
        held: HeldLock | None = None,
        reentered: bool = False,
        renewer: Renewer | None = None,
    ) -> None:
        self.key = key
        self.task_id = task_id
        self.reentered = reentered
        self._held = held
        self._renewer = renewer  # the one renewing it: the release goes through it
        #: retry() handed the lock over to the retried message: the run no longer holds it
        self._handed_over = False

    @property
    def held(self) -> bool:
        """True while this run holds the lock (False outside a worker run, once lost, and once
        ``retry()`` handed it over to the retried message)."""
        return self._held is not None and not self._held.lost and not self._handed_over

    @property
    def fencing_token(self) -> int | None:
        """Strictly increasing per lock key; pass it to writes that must reject stale runs."""
        return None if self._held is None else self._held.token

    @property
    def lost(self) -> bool:
        """True once a renewal found the lock gone or taken, or max_hold stopped renewing it."""
        return self._held is not None and self._held.lost

    @property
    def renewals(self) -> int:
        """How many times this process renewed the lock for this run so far (0 without a lock)."""
        return 0 if self._held is None else self._held.renewals

    def __repr__(self) -> str:
        return (
            f"<LockHandle key={self.key!r} task_id={self.task_id!r} "
            f"token={self.fencing_token!r} lost={self.lost}>"
        )


NOT_HELD = LockHandle()


class SingletonTask(Task):  # type: ignore[misc]
    """A Celery task that never runs twice at once for the same logical arguments.

    Options (each falls back to the app setting ``singleton_<option>``, then to the
    default in docs/configuration.md): ``singleton_on_duplicate``,
    ``singleton_on_redis_error``, ``singleton_key_args``, ``singleton_key``,
    ``singleton_ttl``, ``singleton_retry_countdown``, ``singleton_max_hold``,
    ``singleton_lock_on``, ``singleton_publish_ttl``, ``singleton_completion_ttl``;
    ``singleton_lock_at_least`` is read from the task only. The option spellings of
    celery-singleton and celery-once are read too, with a DeprecationWarning (compat.py).
    """

    singleton_on_duplicate: ClassVar[str | None] = None
    singleton_on_redis_error: ClassVar[str | None] = None
    singleton_key_args: ClassVar[Sequence[str] | None] = None
    singleton_key: ClassVar[Any] = None
    singleton_ttl: ClassVar[float | None] = None
    singleton_retry_countdown: ClassVar[float | None] = None
    singleton_max_hold: ClassVar[float | None] = None
    singleton_lock_on: ClassVar[str | None] = None
    singleton_publish_ttl: ClassVar[float | None] = None
    singleton_completion_ttl: ClassVar[float | None] = None
    singleton_lock_at_least: ClassVar[float | None] = None

    #: Celery's worker-side request class for this task: tells the worker's main process which
    #: generation a lost child held (worker.py). A custom one must subclass it.
    Request = "celery_singleton_lock.worker:SingletonRequest"

    _singleton_opts: Options | None = None
    #: the key deriver of this task, and the options it was made from (singleton_keys)
    _singleton_keyed: tuple[Options, KeyDeriver] | None = None

    # The function a worker runs each message through (Celery's ``build_tracer``), wrapped so
    # that the lock is taken before it and a skipped duplicate ends without it (tracing.py).
    @property
    def __trace__(self) -> Tracer | None:
        tracer: Tracer | None = self.__dict__.get("_singleton_tracer")
        return tracer

    @__trace__.setter
    def __trace__(self, celery_trace: Tracer | None) -> None:
        self.__dict__["_singleton_tracer"] = (
            None if celery_trace is None else partial(trace_run, self, celery_trace)
        )

    @staticmethod
    def _singleton_sleep(seconds: float) -> None:
        """How a run pauses while its parent releases (tests may replace it)."""
        time.sleep(seconds)

    # -- what the task body sees ------------------------------------------------------------

    @property
    def singleton(self) -> LockHandle:
        """This run's lock: ``fencing_token``, ``lost``, ``key``."""
        return _handle_of(self.request)

    def singleton_options(self) -> Options:
        """The checked settings for this task (read from app.conf once, at first use).

        The run's path reads ``self._singleton_opts or self.singleton_options()``: no call
        once they are read."""
        opts = self._singleton_opts
        if opts is None:
            opts = self._singleton_opts = read_options(self.app.conf, self)
        return opts

    def singleton_keys(
        self, args: Sequence[Any] | None, kwargs: Mapping[str, Any] | None
    ) -> LockKeys:
        """The lock keys for a call with these arguments."""
        made = self._singleton_keyed
        if made is None or made[0] is not self._singleton_opts:  # none yet, or options re-read
            made = self._singleton_deriver()
        return made[1].derive(args or (), kwargs or {})

    def _singleton_deriver(self) -> tuple[Options, KeyDeriver]:
        """How this task's calls become keys, and the options it was made from: made again
        whenever the options are read again (core/keys.py)."""
        opts = self.singleton_options()
        if opts.scope is None:
            name, key_args = self.name, opts.key_args
        else:  # the scope's name, and argument names in one order for all its tasks
            name, key_args = opts.scope, self._singleton_scope_names()
        deriver = KeyDeriver(opts.key_prefix, name, self.run, key_args, opts.key, opts.permits)
        made = self._singleton_keyed = (opts, deriver)
        return made

    def _singleton_scope_names(self) -> tuple[str, ...] | None:
        """The sorted argument names this task keys on in its scope (None with a key callable)."""
        names: tuple[str, ...] | None = self.__dict__.get("_singleton_scope_key_names")
        if names is None and self.singleton_options().key is None:
            names = scope_key_names(self.run, self.singleton_options().key_args)
            self.__dict__["_singleton_scope_key_names"] = names
        return names

    # -- Celery hooks -----------------------------------------------------------------------

    def before_start(self, task_id: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        """Take the lock, or deal with the duplicate by policy, before the body runs."""
        super().before_start(task_id, args, kwargs)
        first = take_first_try(task_id)  # a worker run: acquired before Celery's tracer
        if first is not None:
            keys = first.keys
        else:  # the keys are derived once per run: the lock, its marker, its release
            try:
                keys = self.singleton_keys(args, kwargs)
            except SingletonKeyError as exc:
                raise SingletonKeyError(f"{self.name}[{task_id}]: {exc}", task_id=task_id) from exc
        opts, request = self._singleton_opts or self.singleton_options(), self.request
        try:
            try:
                self._singleton_acquire(
                    task_id, keys, args, kwargs, first, opts=opts, request=request
                )
            except Skipped as skip:
                marker = skip.marker
            else:
                return
        finally:  # the queued marker is handed over to the lock (publish.py)
            if opts.lock_on != "execute" and not request.is_eager:
                self._singleton_forget_queued(task_id, keys, "start")
        # Raised here, not where the skip was decided: Celery snapshots and formats the
        # traceback of an Ignore twice, and each frame in it costs (docs/performance.md).
        raise Skipped(marker) from None

    def apply_async(
        self,
        args: Sequence[Any] | None = None,
        kwargs: Mapping[str, Any] | None = None,
        task_id: str | None = None,
        **options: Any,
    ) -> Any:
        """Celery's apply_async; under lock_on "publish"/"both" a duplicate is not published."""
        if (self._singleton_opts or self.singleton_options()).lock_on == "execute":
            return super().apply_async(args, kwargs, task_id, **options)
        return self._singleton_publish(args, kwargs, task_id, options, super().apply_async)

    def apply(self, *args: Any, **kwargs: Any) -> Any:
        """Celery's eager apply; a skipped duplicate's result is its skip marker (SUCCESS)."""
        result = super().apply(*args, **kwargs)
        if result.state == states.IGNORED and isinstance(result.result, Skipped):
            return EagerResult(result.id, result.result.marker, states.SUCCESS, name=self.name)
        return result

    def retry(  # noqa: PLR0917 - Celery's signature
        self,
        args: Sequence[Any] | None = None,
        kwargs: Mapping[str, Any] | None = None,
        exc: BaseException | None = None,
        throw: bool = True,
        eta: datetime | None = None,
        countdown: float | None = None,
        max_retries: int | None = None,
        **options: Any,
    ) -> Any:
        """Celery's retry, handing the lock over to the retried message."""
        handle = self.singleton
        if handle.held:
            delay = _retry_delay(eta, countdown, self.default_retry_delay)
            self._singleton_hand_over(handle, delay)
        return super().retry(
            args=args,
            kwargs=kwargs,
            exc=exc,
            throw=throw,
            eta=eta,
            countdown=countdown,
            max_retries=max_retries,
            **options,
        )

    # -- publish (lock_on "publish"/"both") ------------------------------------------------------

    def _singleton_publish(
        self,
        args: Sequence[Any] | None,
        kwargs: Mapping[str, Any] | None,
        task_id: str | None,
        options: dict[str, Any],
        send: Callable[..., Any],
    ) -> Any:
        """Publish unless the lock is held or the same call is queued (publish.py); return the
        AsyncResult. ``send(args, kwargs, task_id, **options)`` is Celery's own apply_async."""
        if (
            self.app.conf.task_always_eager
            or (task_id is not None and task_id == self.request.id)
            or always_published(options)
        ):
            # eager: the run is the call, the lock guards it; the current message published
            # again (retry(), a requeued duplicate) is never its own duplicate; canvas members
            return send(args, kwargs, task_id, **options)
        opts = self.singleton_options()
        task_id = task_id or uuid()
        serializer = options.get("serializer") or self.serializer or self.app.conf.task_serializer
        try:
            delivered = delivered_arguments(
                args, kwargs, serializer, getattr(self, "_dump_pydantic_arguments", None)
            )
            keys = self.singleton_keys(*delivered)
        except SingletonKeyError as exc:
            raise SingletonKeyError(f"{self.name}[{task_id}]: {exc}", task_id=task_id) from exc
        ttl_ms = marker_ttl_ms(opts.publish_ttl, options)
        try:
            run = store_for(opts.redis_url).run_script
            found = mark_queued(run, keys, task_id, ttl_ms, partial(finished, self.backend))
        except REDIS_ERRORS as exc:
            logger.warning(
                "singleton: redis error at publish, publishing without dedup: %s[%s] key=%s: %s",
                self.name,
                task_id,
                keys.lock,
                exc,
                extra=_about(self.name, task_id),
            )
            return send(args, kwargs, task_id, **options)
        if found is None:
            try:
                return send(args, kwargs, task_id, **options)
            except BaseException:
                self._singleton_forget_queued(task_id, keys, "publish failed")
                raise
        holder = not_published(self, self.name, opts.on_duplicate, keys.lock, task_id, found)
        return self.AsyncResult(holder)

    def _singleton_forget_queued(self, task_id: str, keys: LockKeys, reason: str) -> None:
        """Drop this call's queued marker if it still names ``task_id``; on failure log (the
        marker then expires in its ttl)."""
        try:
            forget_queued(
                store_for(self.singleton_options().redis_url).run_script, keys.lock, task_id
            )
        except _FORGET_ERRORS as exc:
            self._singleton_marker_left(reason, task_id, exc)

    def _singleton_marker_left(self, reason: str, task_id: str, exc: Exception) -> None:
        logger.warning(
            "singleton: could not clear queued marker after %s, it expires in its ttl: %s[%s]: %s",
            reason,
            self.name,
            task_id,
            exc,
            extra=_about(self.name, task_id),
        )

    def singleton_forget_for(
        self, task_id: str, args: Sequence[Any] | None, kwargs: Mapping[str, Any] | None
    ) -> None:
        """Drop the queued marker of a message that will not run (revoked, expired)."""
        try:
            keys = self.singleton_keys(args, kwargs)
        except SingletonKeyError as exc:
            self._singleton_marker_left("revoke", task_id, exc)
            return
        self._singleton_forget_queued(task_id, keys, "revoke")

    # -- acquire ------------------------------------------------------------------------------

    def _singleton_renewer(self, opts: Options) -> Renewer:
        """This process's renewer for the task's lock store (it takes, renews and releases):
        ``renewer.acquire(keys, task_id, generation, opts.ttl_ms, meta)`` is a run's one
        blocking round trip."""
        return renewer_for(opts.redis_url, configure_renewer)

    def _singleton_meta(
        self, args: Sequence[Any], kwargs: Mapping[str, Any], hostname: str | None
    ) -> dict[str, str]:
        """What the lock hash tells about its holder (``celery singleton show``)."""
        return {
            "task": self.name,
            "host": str(hostname or socket.gethostname()),
            "pid": str(current_pid()),
            "args": args_preview(args, kwargs),
        }

    def _singleton_acquire(
        self,
        task_id: str,
        keys: LockKeys,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        first: FirstTry | None,
        *,
        opts: Options,
        request: Any,
    ) -> None:
        if first is not None and isinstance(first.outcome, Acquired):  # a worker's run: taken
            outcome, generation, renewer = first.outcome, first.generation, first.renewer
        else:
            taken = self._singleton_outcome(first, keys, task_id, args, kwargs, request, opts)
            if taken is None:  # Redis failed, and the run goes on without the lock
                return
            outcome, generation, renewer = taken
        key = keys.lock if keys.permits == 1 else keys.slot(outcome.slot)  # or the permit slot
        held = HeldLock(
            key=key,
            owner=task_id,
            generation=generation,
            ttl_ms=opts.ttl_ms,
            token=outcome.token,
            acquired_at=time.monotonic(),
            max_hold_s=opts.max_hold,
            context=self,
        )
        request._singleton_handle = LockHandle(key, task_id, held, outcome.reentered, renewer)
        renewer.add(held)
        if logger.isEnabledFor(logging.DEBUG):  # the run's path: no call for a line not logged
            logger.debug(
                "singleton: acquired %s[%s] key=%s token=%d reentered=%s",
                self.name,
                task_id,
                key,
                outcome.token,
                outcome.reentered,
            )
        if signals.lock_acquired.receivers:  # nor for a signal nobody receives
            signals.lock_acquired.send(
                sender=self,
                key=key,
                task_id=task_id,
                token=outcome.token,
                reentered=outcome.reentered,
                waited=_waited(request),
            )

    def _singleton_outcome(  # noqa: PLR0917 - what before_start has of the run
        self,
        first: FirstTry | None,
        keys: LockKeys,
        task_id: str,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        request: Any,
        opts: Options,
    ) -> tuple[Acquired, int, Renewer] | None:
        """The lock this run holds (and its generation, and the renewer that took it), after
        the acquire :func:`trace_run` made (``first``) or one made now; a duplicate, a message
        that already completed or Redis down are dealt with by policy (they raise), None for a
        run that goes on without the lock."""
        generation = int(request.retries or 0)
        renewer = self._singleton_renewer(opts) if first is None else first.renewer
        try:
            if first is None:
                meta = self._singleton_meta(args, kwargs, request.hostname)
                outcome = renewer.acquire(keys, task_id, generation, opts.ttl_ms, meta)
            elif isinstance(first.outcome, LockUnavailableError):
                raise first.outcome
            else:
                outcome = first.outcome
            if isinstance(outcome, Contended) and outcome.holder == request.parent_id:
                meta = self._singleton_meta(args, kwargs, request.hostname)
                outcome = self._singleton_wait_for_parent(renewer, keys, outcome, generation, meta)
        except LockUnavailableError as exc:
            self._singleton_redis_down(opts, keys, task_id, exc)
            return None
        if isinstance(outcome, Completed):  # this message already ran to its end
            drop_completed(self, keys.lock, outcome, task_id)
        if isinstance(outcome, Contended):
            self._singleton_duplicate(opts, keys, outcome, task_id)
        return outcome, generation, renewer

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
            countdown = min(opts.retry_countdown or 1.0, max(held.pttl_ms, 0) / 1000 + 0.1)
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
            logger.info(
                "singleton: duplicate retried in %ss: %s[%s] key=%s holder=%s",
                opts.retry_countdown,
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
                countdown=opts.retry_countdown,
            )
            self._singleton_requeue(opts.retry_countdown, error)
        if policy == "coalesce":
            wait = self._singleton_coalesce(
                keys, held.holder, task_id, request.args or (), request.kwargs or {}, request
            )
            if wait is not None:
                self._singleton_requeue(wait, error)
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
        """Leave this duplicate's call as the lock's pending follow-up (coalesce.py) while
        ``holder`` still holds it; the follow-up's id goes on ``request`` for the marker.

        None when left; else the countdown to requeue the duplicate after, never dropping it:
        the holder let go meanwhile (at once, or after an at-least window's end: it then takes
        the lock or meets its new holder), or Redis failed (``retry_countdown``).

        Left, the duplicate's message is recorded as completed (as a run's release records
        it): the follow-up carries its call, so a broker's copy of it is dropped."""
        opts = self.singleton_options()
        try:
            left = leave_pending(
                store_for(opts.redis_url).run_script,
                keys.lock,
                holder,
                uuid(),
                call_record(self, request, args, kwargs),
                (task_id, _retries(request), round((opts.completion_ttl or 0) * 1000)),
            )
        except _FORGET_ERRORS as exc:
            logger.warning(
                "singleton: could not coalesce duplicate, requeued: %s[%s] key=%s: %s",
                self.name,
                task_id,
                keys.lock,
                exc,
                extra=_about(self.name, task_id),  # called in front of Celery's tracer too
            )
            return opts.retry_countdown
        if left.follow_up is None:
            logger.info(
                "singleton: holder let go before coalescing, requeued: %s[%s] key=%s holder=%s",
                self.name,
                task_id,
                keys.lock,
                holder,
                extra=_about(self.name, task_id),
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
        that of each canvas task that will not run after it (canvas.py)."""
        marker = skip_marker(
            keys.lock, holder, task_id, getattr(request, "_singleton_follow_up", None)
        )
        if not request.is_eager or self.app.conf.task_store_eager_result:
            stopped = store_skip(self.backend, task_id, marker, request)
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
        """The skip's one log line and its signal."""
        follow_up = getattr(self.request, "_singleton_follow_up", None)
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

    def _singleton_abandon(
        self, keys: LockKeys, task_id: str, generation: int, slot: int = 1
    ) -> None:
        """Release a lock (permit ``slot``) taken for a run that Celery's tracer ended before
        ``before_start``."""
        key = keys.slot(slot)
        try:
            store_for(self.singleton_options().redis_url).release(key, task_id, generation)
        except LockUnavailableError as exc:
            logger.warning(
                "singleton: could not release lock of a run that did not start, "
                "it expires in its ttl: %s[%s] key=%s: %s",
                self.name,
                task_id,
                key,
                exc,
            )

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
        """Publish this message again, retries unchanged, and end this delivery as RETRY."""
        request = self.request
        if request.is_eager or request.called_directly:
            raise reason
        options: dict[str, Any] = {"countdown": countdown}
        if isinstance(reason, DuplicateTaskError):  # waiting for the lock: note since when
            since = _waiting_since(request) or [time.time(), int(request.retries or 0)]
            options["headers"] = {**(request.headers or {}), WAITING_HEADER: since}
        signature = self.signature_from_request(request, **options)
        try:
            signature.apply_async()
        except Exception as exc:  # the broker is down too: fail loudly, never run unguarded
            logger.error(
                "singleton: could not requeue, failing the run: %s[%s]: %s",
                self.name,
                request.id,
                exc,
            )
            raise reason from exc
        raise Retry(f"singleton: requeued: {reason}", exc=reason, when=countdown)

    # -- hand-over and release ----------------------------------------------------------------

    def _singleton_hand_over(self, handle: LockHandle, delay: float) -> None:
        """Stop renewing and stretch the lock over the retry's countdown."""
        held, renewer = handle._held, handle._renewer
        assert held is not None
        assert renewer is not None
        ttl_ms = round((max(delay, 0.0) + self.singleton_options().ttl) * 1000)
        handle._handed_over = True  # the run's end (retry(throw=False)) must not release it
        try:
            renewer.hand_over(held, ttl_ms)
        except LockUnavailableError as exc:
            logger.warning("singleton: could not extend lock for retry: key=%s: %s", held.key, exc)
        logger.debug(
            "singleton: handing over to retry in %ss: %s[%s] key=%s",
            delay,
            self.name,
            held.owner,
            held.key,
        )

    def _singleton_after_run(self, state: str) -> None:
        """Stop renewing and release; on RETRY, or after any hand-over (``retry(throw=False)``
        and the body went on), leave the lock for the retried message.

        Outside eager runs the release leaves the run's critical path: written at once, its
        reply read later (``Renewer.release_later``; "Deferred release" in docs/design.md).
        """
        request = self.request
        handle = _handle_of(request)
        held, renewer = handle._held, handle._renewer
        if held is None or renewer is None:
            return
        if state == states.RETRY or handle._handed_over:
            renewer.remove(held)
            return
        handle._held = None
        opts = self._singleton_opts or self.singleton_options()
        held.ending = ending_for(opts.completion_ttl, opts.lock_at_least, state)
        if opts.on_duplicate == "coalesce":  # released now: the follow-up goes out at once
            on_released(held, renewer.release_now(held), state)
            self._singleton_follow_up(held.key, state)
            return
        if not request.is_eager:
            renewer.release_later(held, state)
            return
        on_released(held, renewer.release_now(held), state)

    def _singleton_follow_up(self, lock_key: str, reason: str) -> None:
        """Publish the lock's pending follow-up, if it has one and no run holds it
        (coalesce.py); only under the coalesce policy."""
        if self.singleton_options().on_duplicate != "coalesce":
            return
        try:
            publish_follow_up(
                self, store_for(self.singleton_options().redis_url).run_script, lock_key, reason
            )
        except _FORGET_ERRORS as exc:
            logger.warning(
                "singleton: could not take coalesced follow-up, it waits for the next release "
                "or purge: %s key=%s: %s",
                self.name,
                lock_key,
                exc,
                extra=_about(self.name, ""),
            )

    def singleton_release_for(
        self,
        task_id: str,
        args: Sequence[Any] | None,
        kwargs: Mapping[str, Any] | None,
        generation: int,
        reason: str,
    ) -> ReleaseStatus | None:
        """Release the lock a lost run of this task held, from outside it (main process).

        Only that run's generation, and never a lock it handed over to a retry
        (``release_lost.lua``).
        """
        try:
            keys = self.singleton_keys(args, kwargs)
            opts = self.singleton_options()
            key, status = release_lost_slot(
                store_for(opts.redis_url),
                keys,
                task_id,
                generation,
                round(opts.lock_at_least * 1000),
            )
        except (SingletonKeyError, LockUnavailableError) as exc:
            logger.warning(
                "singleton: could not release after %s, lock expires in its ttl: %s[%s]: %s",
                reason,
                self.name,
                task_id,
                exc,
                extra=_about(self.name, task_id),
            )
            return None
        if status is ReleaseStatus.RELEASED:
            logger.warning(
                "singleton: released by main process after %s: %s[%s] key=%s",
                reason,
                self.name,
                task_id,
                key,
                extra=_about(self.name, task_id),
            )
            signals.lock_released.send(sender=self, key=key, task_id=task_id, reason=reason)
        elif status is not ReleaseStatus.NOT_HELD:
            handed_over = status is ReleaseStatus.HANDED_OVER
            logger.info(
                "singleton: not released by main process after %s, %s: %s[%s] key=%s",
                reason,
                "handed over to its retry" if handed_over else "held by another run",
                self.name,
                task_id,
                key,
                extra=_about(self.name, task_id),
            )
        if status in (ReleaseStatus.RELEASED, ReleaseStatus.NOT_HELD):  # or it expired
            self._singleton_follow_up(keys.lock, reason)
        return status


def _handle_of(request: Any) -> LockHandle:
    """The lock handle of the run of ``request`` (:data:`NOT_HELD` when it holds none)."""
    handle = getattr(request, "_singleton_handle", None)
    return handle if isinstance(handle, LockHandle) else NOT_HELD


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
    value = request.get("retries") if isinstance(request, dict) else request.retries
    return int(value or 0)


def _waited(request: Any) -> float | None:
    """Seconds since this message was first requeued to wait for its lock, or None."""
    since = _waiting_since(request)
    return None if since is None else max(0.0, time.time() - since[0])


def _about(name: str, task_id: str) -> dict[str, str]:
    """``extra`` of a line logged outside the run it is about (the worker's main process, a
    publisher): Celery's task formatter fills %(task_name)s and %(task_id)s from the current
    run, and from these when there is none."""
    return {"task_name": name, "task_id": task_id}


def check_scopes(tasks: Iterable[SingletonTask]) -> None:
    """Raise :class:`SingletonConfigError` unless the tasks sharing a scope all key on the same
    argument names (or all on a ``singleton_key`` callable), take the same number of permits,
    and all coalesce or none does (checked at worker start)."""
    scopes: dict[str, dict[str, SingletonTask]] = {}
    for task in tasks:
        scope = task.singleton_options().scope
        if scope is not None:
            scopes.setdefault(scope, {})[task.name] = task
    for scope, members in sorted(scopes.items()):
        names = {name: task._singleton_scope_names() for name, task in members.items()}
        if len(set(names.values())) > 1:
            keyed = "; ".join(
                f"{name} on {'a key callable' if keys is None else ', '.join(keys)}"
                for name, keys in sorted(names.items())
            )
            raise SingletonConfigError(
                f"the tasks of scope {scope!r} must key on the same argument names: {keyed}"
            )
        permits = {name: task.singleton_options().permits for name, task in members.items()}
        if len(set(permits.values())) > 1:  # 1 permit locks the key itself, N its N slots
            raise SingletonConfigError(
                f"the tasks of scope {scope!r} must take the same singleton_permits, or they "
                f"never exclude each other: {_listed(permits)}"
            )
        policies = {name: task.singleton_options().on_duplicate for name, task in members.items()}
        if len({p == "coalesce" for p in policies.values()}) > 1:
            raise SingletonConfigError(
                f"the tasks of scope {scope!r} must all use singleton_on_duplicate 'coalesce' or "
                "none of them (only a coalescing run's release publishes the follow-up left "
                f"beside it): {_listed(policies)}"
            )


def _listed(values: Mapping[str, object]) -> str:
    return "; ".join(f"{name} {value}" for name, value in sorted(values.items()))


def _retry_delay(eta: datetime | None, countdown: float | None, default: float | None) -> float:
    if countdown is not None:
        return float(countdown)
    if eta is not None:
        now = datetime.now(timezone.utc) if eta.tzinfo else datetime.now()
        return (eta - now).total_seconds()
    return float(default or 0)
