"""SingletonTask: take the lock right before the task body runs, keep it renewed, free it after.

The lock is taken in :meth:`SingletonTask.before_start`, on the worker, so every way a
message can arrive (``delay``, ``send_task``, canvas, beat) is covered. Its owner is the
task id and its generation the retries count, so:

- a retried message (same id, one more retry) takes the lock over from the run that
  called ``retry()``, once Celery published it (its base
  :class:`~celery_singleton_lock.run.handover.RetryHandOver`);
- the worker's main process can release a lock its dead pool child held (see worker/hooks.py).

A subclass's own ``before_start`` is wrapped so that the lock is taken before it, whether or
not it calls ``super()``.

The release runs from the ``task_postrun`` signal (worker/hooks.py), which fires for every
outcome of a traced run: success, failure, Ignore, Reject and Retry; how a run ends is in its
base :class:`~celery_singleton_lock.task.endings.RunEndings`. What a run does when it does not
get the lock (the duplicate policies, Redis down) is in its base
:class:`~celery_singleton_lock.duplicates.policies.DuplicatePolicies`; publish-time dedup in
its base :class:`~celery_singleton_lock.publish.dedup.PublishDedup`.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from functools import partial, wraps
from typing import Any, ClassVar

from celery import states
from celery.result import EagerResult

from .. import signals
from ..core._pid import current_pid
from ..core.arguments import scope_key_names
from ..core.backend import Acquired, Completed, Contended, RateLimited, release_lost_slot
from ..core.connection import renewer_for, store_for
from ..core.keys import KeyDeriver, LockKeys
from ..core.renewer import HeldLock, Renewer
from ..duplicates.join import Joined, runs_in_place
from ..duplicates.policies import DuplicatePolicies, waited
from ..duplicates.skips import Skipped
from ..errors import LockUnavailableError, SingletonKeyError
from ..publish.dedup import PublishDedup
from ..run.callrepr import REPR_OPTIONS, preview_of, request_field
from ..run.completion import drop_completed
from ..run.events import configure_renewer
from ..run.handle import LockHandle, handle_of
from ..run.handover import RetryHandOver
from ..run.log import logger
from ..settings.options import Options, read_options
from .endings import RunEndings
from .tracer import FirstTry, Tracer, take_first_try, trace_run

__all__ = ["LockHandle", "SingletonTask"]


class SingletonTask(PublishDedup, DuplicatePolicies, RetryHandOver, RunEndings):
    """A Celery task that never runs twice at once for the same logical arguments.

    Options (each falls back to the app setting ``singleton_<option>``, then to the
    default in docs/configuration.md): ``singleton_on_duplicate``,
    ``singleton_on_redis_error``, ``singleton_key_args``, ``singleton_key``,
    ``singleton_ttl``, ``singleton_retry_countdown``, ``singleton_max_hold``,
    ``singleton_lock_on``, ``singleton_publish_ttl``, ``singleton_completion_ttl``,
    ``singleton_permits``, ``singleton_rate_limit``;
    ``singleton_lock_at_least`` is read from the task only. The option spellings of
    celery-singleton and celery-once are read too, with a DeprecationWarning (settings/legacy.py).
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
    singleton_debounce: ClassVar[float | None] = None
    singleton_debounce_max: ClassVar[float | None] = None

    #: Celery's worker-side request class for this task: tells the worker's main process which
    #: generation a lost child held (worker/hooks.py). A custom one must subclass it.
    Request = "celery_singleton_lock.worker.hooks:SingletonRequest"
    #: Celery's default strategy, with the main-process skip in front of it (worker/mainskip.py).
    Strategy = "celery_singleton_lock.worker.mainskip:singleton_strategy"

    _singleton_opts: Options | None = None
    #: the key deriver of this task, and the options it was made from (singleton_keys)
    _singleton_keyed: tuple[Options, KeyDeriver] | None = None

    # The function a worker runs each message through (Celery's ``build_tracer``), wrapped so
    # that the lock is taken before it and a skipped duplicate ends without it (task/tracer.py).
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
        return handle_of(self.request)

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
        deriver = KeyDeriver(
            opts.key_prefix, name, self.run, key_args, opts.key, opts.permits, opts.rate_limit
        )
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

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A subclass's own ``before_start`` is wrapped so that the lock is taken before it runs,
        whether or not it calls ``super()`` (Celery documents the hook as an empty one to
        override: safety cannot depend on a ``super()`` call)."""
        super().__init_subclass__(**kwargs)
        hook = cls.__dict__.get("before_start")
        if callable(hook) and not getattr(hook, "_singleton_locks_first", False):
            cls.before_start = _lock_first(hook)  # type: ignore[method-assign,assignment]

    def before_start(self, task_id: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        """Take the lock, or deal with the duplicate by policy, before the body runs."""
        super().before_start(task_id, args, kwargs)
        self._singleton_start(task_id, args, kwargs)

    def _singleton_start(
        self, task_id: str, args: Sequence[Any], kwargs: Mapping[str, Any]
    ) -> None:
        """``before_start``'s work, once per run (a subclass's hook and this class's both call
        it when the subclass's calls ``super()``)."""
        request = self.request
        if request.get("_singleton_started") == task_id:
            return
        request._singleton_started = task_id
        first = take_first_try(task_id)  # a worker run: acquired before Celery's tracer
        if first is not None:
            keys = first.keys
        else:  # the keys are derived once per run: the lock, its marker, its release
            try:
                keys = self.singleton_keys(args, kwargs)
            except SingletonKeyError as exc:
                raise SingletonKeyError(f"{self.name}[{task_id}]: {exc}", task_id=task_id) from exc
        opts = self._singleton_opts or self.singleton_options()
        try:
            try:
                self._singleton_acquire(
                    task_id, keys, args, kwargs, first, opts=opts, request=request
                )
            except Skipped as skip:
                marker = skip.marker
            else:
                return
        finally:  # the queued marker is handed over to the lock (publish/dedup.py)
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
        """Celery's eager apply; a skipped duplicate's result is its skip marker (SUCCESS).

        ``argsrepr``/``kwargsrepr``, which Celery's eager request drops, go on in its headers:
        the lock shows the call as the caller has Celery show it (run/callrepr.py)."""
        shown = {name: kwargs.pop(name) for name in REPR_OPTIONS if kwargs.get(name)}
        if shown:
            kwargs["headers"] = {**(kwargs.get("headers") or {}), **shown}
        result = super().apply(*args, **kwargs)
        if result.state == states.IGNORED and isinstance(result.result, Skipped):
            return EagerResult(result.id, result.result.marker, states.SUCCESS, name=self.name)
        return result

    # -- acquire ------------------------------------------------------------------------------

    def _singleton_renewer(self, opts: Options) -> Renewer:
        """This process's renewer for the task's lock store (it takes, renews and releases):
        ``renewer.acquire(keys, task_id, generation, opts.ttl_ms, meta)`` is a run's one
        blocking round trip."""
        return renewer_for(opts.redis_url, configure_renewer)

    def _singleton_meta(
        self, args: Sequence[Any], kwargs: Mapping[str, Any], request: Any
    ) -> dict[str, str]:
        """What the lock hash tells about its holder (``celery singleton show``); ``request``
        is the run's (a Context, or the dict a worker's tracer gets): its arguments are shown
        as the caller has Celery show them (run/callrepr.py)."""
        return {
            "task": self.name,
            "host": str(request_field(request, "hostname") or socket.gethostname()),
            "pid": str(current_pid()),
            "args": preview_of(request, args, kwargs),
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
        if not keys.permits:  # a rate alone: the run started and holds no lock (core/rates.py)
            if first is not None:
                first.taken = True
            return
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
        if first is not None:  # from here the run's postrun releases it, not trace_run
            first.taken = True
        renewer.add(held)
        if opts.on_duplicate == "join" and not runs_in_place(self, key, request):
            raise Joined()  # a watch copy whose joiner a run's end is completing: released
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
                waited=waited(request),
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
                meta = self._singleton_meta(args, kwargs, request)
                outcome = renewer.acquire(keys, task_id, generation, opts.ttl_ms, meta)
            elif isinstance(first.outcome, LockUnavailableError):
                raise first.outcome
            else:
                outcome = first.outcome
            if (  # the run that published it holds the key: it lets go in a moment
                isinstance(outcome, Contended)
                and outcome.holder == request.parent_id
                and not isinstance(outcome, RateLimited)  # a start of the rate stays counted
            ):
                meta = self._singleton_meta(args, kwargs, request)
                outcome = self._singleton_wait_for_parent(renewer, keys, outcome, generation, meta)
        except LockUnavailableError as exc:
            self._singleton_redis_down(opts, keys, task_id, exc)
            return None
        if isinstance(outcome, Completed):  # this message already ran to its end
            drop_completed(self, keys.lock, outcome, task_id)
        if isinstance(outcome, Contended):
            self._singleton_duplicate(opts, keys, outcome, task_id)
        return outcome, generation, renewer

    def _singleton_abandon(
        self, keys: LockKeys, task_id: str, generation: int, slot: int | None = 1
    ) -> None:
        """Release a lock (permit ``slot``; None: whichever slot is the run's, if any) taken for
        a run that Celery's tracer ended before ``before_start``, or whose acquire a SystemExit
        interrupted, and publish the follow-up a duplicate left beside it meanwhile."""
        if not keys.permits:  # a rate alone: a run holds no lock
            return
        key = keys.lock if slot is None else keys.slot(slot)
        store = store_for(self.singleton_options().redis_url)
        try:
            if slot is None:  # owner-checked, slot by slot: another run's is left alone
                key, _ = release_lost_slot(store, keys, task_id, generation, 0)
            else:
                store.release(key, task_id, generation)
        except LockUnavailableError as exc:
            logger.warning(
                "singleton: could not release lock of a run that did not start, "
                "it expires in its ttl: %s[%s] key=%s: %s",
                self.name,
                task_id,
                key,
                exc,
            )
            return
        self._singleton_follow_up(keys, "a run that did not start")  # it ran nothing: no newer run


Hook = Callable[[Any, str, Sequence[Any], Mapping[str, Any]], None]


def _lock_first(hook: Hook) -> Hook:
    """``hook`` (a SingletonTask subclass's ``before_start``), the lock taken before it."""

    @wraps(hook)
    def before_start(
        self: SingletonTask, task_id: str, args: Sequence[Any], kwargs: Mapping[str, Any]
    ) -> None:
        self._singleton_start(task_id, args, kwargs)
        hook(self, task_id, args, kwargs)

    before_start._singleton_locks_first = True  # type: ignore[attr-defined]
    return before_start
