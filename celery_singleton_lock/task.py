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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import partial
from typing import Any, ClassVar, NoReturn

from celery import Task, states
from celery.exceptions import Ignore, Retry
from celery.result import EagerResult
from kombu.utils.uuid import uuid

from . import signals
from .config import Options, read_options
from .core._pid import current_pid
from .core.backend import REDIS_ERRORS, Acquired, Contended, ReleaseStatus
from .core.connection import renewer_for, store_for
from .core.keys import LockKeys, args_preview, derive_keys
from .core.renewer import HeldLock, Renewer
from .errors import DuplicateTaskError, LockUnavailableError, SingletonKeyError
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

__all__ = ["LockHandle", "SingletonTask", "SkipInfo", "skip_info"]

logger = logging.getLogger(__name__)

#: Key of the result a skipped duplicate stores (its value is True).
SKIP_MARKER = "__singleton_skipped__"

#: Pauses (seconds) between the tries of a message whose lock is held by the run that published
#: it (a chain step, a link callback); after them it is requeued like a redelivered message.
PARENT_WAITS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16)


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


class _Skipped(Ignore):  # type: ignore[misc]
    """Ignore that carries the skip marker, so an eager run can return it as its result."""

    def __init__(self, marker: Mapping[str, Any]) -> None:
        super().__init__(dict(marker))  # args = (marker,): pickles from a pool child
        self.marker = dict(marker)


@dataclass(frozen=True)
class SkipInfo:
    """Why a duplicate was skipped: its lock key and the task id holding it."""

    key: str
    holder: str
    task_id: str


def skip_info(value: Any) -> SkipInfo | None:
    """The :class:`SkipInfo` when ``value`` (a result or an AsyncResult) is a skipped duplicate."""
    if hasattr(value, "ready") and hasattr(value, "result"):
        value = value.result if value.ready() else None
    if isinstance(value, Mapping) and value.get(SKIP_MARKER) is True:
        return SkipInfo(str(value["key"]), str(value["holder"]), str(value["task_id"]))
    return None


class SingletonTask(Task):  # type: ignore[misc]
    """A Celery task that never runs twice at once for the same logical arguments.

    Options (each falls back to the app setting ``singleton_<option>``, then to the
    default in docs/configuration.md): ``singleton_on_duplicate``,
    ``singleton_on_redis_error``, ``singleton_key_args``, ``singleton_key``,
    ``singleton_ttl``, ``singleton_retry_countdown``, ``singleton_max_hold``,
    ``singleton_lock_on``, ``singleton_publish_ttl``. The option spellings of celery-singleton
    and celery-once are read too, with a DeprecationWarning (compat.py).
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

    #: Celery's worker-side request class for this task: tells the worker's main process which
    #: generation a lost child held (worker.py). A custom one must subclass it.
    Request = "celery_singleton_lock.worker:SingletonRequest"

    _singleton_opts: Options | None = None

    @staticmethod
    def _singleton_sleep(seconds: float) -> None:
        """How a run pauses while its parent releases (tests may replace it)."""
        time.sleep(seconds)

    # -- what the task body sees ------------------------------------------------------------

    @property
    def singleton(self) -> LockHandle:
        """This run's lock: ``fencing_token``, ``lost``, ``key``."""
        handle = getattr(self.request, "_singleton_handle", None)
        return handle if isinstance(handle, LockHandle) else NOT_HELD

    def singleton_options(self) -> Options:
        """The checked settings for this task (read from app.conf once, at first use)."""
        opts = self._singleton_opts
        if opts is None:
            opts = self._singleton_opts = read_options(self.app.conf, self)
        return opts

    def singleton_keys(
        self, args: Sequence[Any] | None, kwargs: Mapping[str, Any] | None
    ) -> LockKeys:
        """The lock keys for a call with these arguments."""
        opts = self.singleton_options()
        return derive_keys(
            opts.key_prefix, self.name, self.run, args or (), kwargs or {}, opts.key_args, opts.key
        )

    # -- Celery hooks -----------------------------------------------------------------------

    def before_start(self, task_id: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        """Take the lock, or deal with the duplicate by policy, before the body runs."""
        super().before_start(task_id, args, kwargs)
        try:  # the keys are derived once per run: the lock, its marker, its release
            keys = self.singleton_keys(args, kwargs)
        except SingletonKeyError as exc:
            raise SingletonKeyError(f"{self.name}[{task_id}]: {exc}", task_id=task_id) from exc
        try:
            try:
                self._singleton_acquire(task_id, keys, args, kwargs)
            except _Skipped as skip:
                marker = skip.marker
            else:
                return
        finally:  # the queued marker is handed over to the lock (publish.py)
            if self.singleton_options().lock_on != "execute" and not self.request.is_eager:
                self._singleton_forget_queued(task_id, keys, "start")
        # Raised here, not where the skip was decided: Celery snapshots and formats the
        # traceback of an Ignore twice, and each frame in it costs (docs/performance.md).
        raise _Skipped(marker) from None

    def apply_async(
        self,
        args: Sequence[Any] | None = None,
        kwargs: Mapping[str, Any] | None = None,
        task_id: str | None = None,
        **options: Any,
    ) -> Any:
        """Celery's apply_async; under lock_on "publish"/"both" a duplicate is not published."""
        if self.singleton_options().lock_on == "execute":
            return super().apply_async(args, kwargs, task_id, **options)
        return self._singleton_publish(args, kwargs, task_id, options, super().apply_async)

    def apply(self, *args: Any, **kwargs: Any) -> Any:
        """Celery's eager apply; a skipped duplicate's result is its skip marker (SUCCESS)."""
        result = super().apply(*args, **kwargs)
        if result.state == states.IGNORED and isinstance(result.result, _Skipped):
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
            client = store_for(opts.redis_url).client
            found = mark_queued(client, keys, task_id, ttl_ms, partial(finished, self.backend))
        except REDIS_ERRORS as exc:
            logger.warning(
                "singleton: redis error at publish, publishing without dedup: %s[%s] key=%s: %s",
                self.name,
                task_id,
                keys.lock,
                exc,
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
            forget_queued(store_for(self.singleton_options().redis_url).client, keys.lock, task_id)
        except _FORGET_ERRORS as exc:
            self._singleton_marker_left(reason, task_id, exc)

    def _singleton_marker_left(self, reason: str, task_id: str, exc: Exception) -> None:
        logger.warning(
            "singleton: could not clear queued marker after %s, it expires in its ttl: %s[%s]: %s",
            reason,
            self.name,
            task_id,
            exc,
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

    def _singleton_acquire(
        self, task_id: str, keys: LockKeys, args: Sequence[Any], kwargs: Mapping[str, Any]
    ) -> None:
        opts = self.singleton_options()
        request = self.request
        generation = int(request.retries or 0)
        renewer = renewer_for(opts.redis_url, configure_renewer)
        meta = {
            "task": self.name,
            "host": str(request.hostname or socket.gethostname()),
            "pid": str(current_pid()),
            "args": args_preview(args, kwargs),
        }
        try:
            outcome = renewer.acquire(keys, task_id, generation, opts.ttl_ms, meta)
            if isinstance(outcome, Contended) and outcome.holder == request.parent_id:
                outcome = self._singleton_wait_for_parent(renewer, keys, outcome, generation, meta)
        except LockUnavailableError as exc:
            self._singleton_redis_down(opts, keys, task_id, exc)
            return
        if isinstance(outcome, Contended):
            self._singleton_duplicate(opts, keys, outcome, task_id)
        held = HeldLock(
            key=keys.lock,
            owner=task_id,
            generation=generation,
            ttl_ms=opts.ttl_ms,
            token=outcome.token,
            acquired_at=time.monotonic(),
            max_hold_s=opts.max_hold,
            context=self,
        )
        request._singleton_handle = LockHandle(keys.lock, task_id, held, outcome.reentered, renewer)
        renewer.add(held)
        logger.debug(
            "singleton: acquired %s[%s] key=%s token=%d reentered=%s",
            self.name,
            task_id,
            keys.lock,
            outcome.token,
            outcome.reentered,
        )
        signals.lock_acquired.send(
            sender=self,
            key=keys.lock,
            task_id=task_id,
            token=outcome.token,
            reentered=outcome.reentered,
        )

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
        if policy == "skip":
            logger.info(
                "singleton: duplicate skipped: %s[%s] key=%s holder=%s",
                self.name,
                task_id,
                keys.lock,
                held.holder,
            )
            marker = {
                SKIP_MARKER: True,
                "key": keys.lock,
                "holder": held.holder,
                "task_id": task_id,
            }
            if not request.is_eager or self.app.conf.task_store_eager_result:
                self.backend.mark_as_done(task_id, marker, request=request)
            signals.duplicate_skipped.send(
                sender=self, key=keys.lock, task_id=task_id, holder=held.holder
            )
            raise _Skipped(marker)
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
        signature = self.signature_from_request(request, countdown=countdown)
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
        handle = self.singleton
        held, renewer = handle._held, handle._renewer
        if held is None or renewer is None:
            return
        if state == states.RETRY or handle._handed_over:
            renewer.remove(held)
            return
        handle._held = None
        if not self.request.is_eager:
            renewer.release_later(held, state)
            return
        on_released(held, renewer.release_now(held), state)

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
            status = store_for(self.singleton_options().redis_url).release_lost(
                keys.lock, task_id, generation
            )
        except (SingletonKeyError, LockUnavailableError) as exc:
            logger.warning(
                "singleton: could not release after %s, lock expires in its ttl: %s[%s]: %s",
                reason,
                self.name,
                task_id,
                exc,
            )
            return None
        if status is ReleaseStatus.RELEASED:
            logger.warning(
                "singleton: released by main process after %s: %s[%s] key=%s",
                reason,
                self.name,
                task_id,
                keys.lock,
            )
            signals.lock_released.send(sender=self, key=keys.lock, task_id=task_id, reason=reason)
        elif status is not ReleaseStatus.NOT_HELD:
            handed_over = status is ReleaseStatus.HANDED_OVER
            logger.info(
                "singleton: not released by main process after %s, %s: %s[%s] key=%s",
                reason,
                "handed over to its retry" if handed_over else "held by another run",
                self.name,
                task_id,
                keys.lock,
            )
        return status


def _retry_delay(eta: datetime | None, countdown: float | None, default: float | None) -> float:
    if countdown is not None:
        return float(countdown)
    if eta is not None:
        now = datetime.now(timezone.utc) if eta.tzinfo else datetime.now()
        return (eta - now).total_seconds()
    return float(default or 0)
