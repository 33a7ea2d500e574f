"""SingletonTask: take the lock right before the task body runs, keep it renewed, free it after.

The lock is taken on the worker, right before the body, so every way a message can arrive
(``delay``, ``send_task``, canvas, beat) is covered. Its owner is the task id and its generation
the retries count, so a retried message (same id, one more retry) takes the lock over from the
run that called ``retry()``, and the worker's main process can release a lock its dead pool
child held (worker/hooks.py).

This file is the class a user reads: its options (each a ``singleton_*`` attribute, falling
back to the app setting of the same name, then to the default in docs/configuration.md) and
the Celery hooks it fills. The work is done by the modules it calls:

- task/tracer.py: how a worker runs a message: the lock asked for in front of Celery's tracer;
- duplicates/gate.py: the one acquire and the one decision of a contended call's fate; the
  policy and modifiers it asks are the task's *parts* (duplicates/policy.py);
- task/start.py: ``before_start``: the decision carried out, the lock held for the run;
- task/endings.py: every way a run ends (``task_postrun``, the worker's main process);
- run/handover.py: ``retry()`` hands the lock to the retried message.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from functools import partial, wraps
from typing import Any, ClassVar

from celery import Task, states
from celery.result import EagerResult

from ..core.arguments import scope_key_names
from ..core.keys import KeyDeriver, LockKeys
from ..duplicates.policy import Part, Parts, parts_of
from ..duplicates.skips import Skipped
from ..run.callrepr import REPR_OPTIONS
from ..run.handle import LockHandle, handle_of
from ..run.handover import retry_handing_over
from ..settings.options import Options, read_options
from .start import start
from .tracer import Tracer, trace_run

__all__ = ["LockHandle", "SingletonTask"]


class SingletonTask(Task):  # type: ignore[misc]
    """A Celery task that never runs twice at once for the same logical arguments.

    Each ``singleton_*`` option below falls back to the app setting of the same name (and
    ``CELERY_SINGLETON_*`` with ``namespace="CELERY"``), then to the default; see
    docs/configuration.md. The option spellings of celery-singleton and celery-once are read
    too, with a DeprecationWarning (settings/legacy.py).
    """

    #: What a run does when another run holds its key: ``"skip"`` (the default: it ends at
    #: once, its result the skip marker), ``"retry"`` (requeued until it gets the key),
    #: ``"raise"`` (fails with DuplicateTaskError), ``"coalesce"`` (ends like a skip; the
    #: duplicates met during one run collapse into one follow-up run), ``"join"`` (ends with
    #: the outcome of the run it met), ``"queue"`` (waits in line; every call runs, in order) or
    #: ``"cancel"`` (latest wins: asks the running holder to stop, and runs after it).
    singleton_on_duplicate: ClassVar[str | None] = None
    #: Under ``"queue"``: the most calls one key's queue holds (default 1000).
    singleton_queue_max: ClassVar[int | None] = None
    #: Under ``"cancel"``: seconds until a holder asked to stop is terminated (None: never).
    singleton_cancel_grace: ClassVar[float | None] = None
    #: What a run does when Redis cannot be asked: ``"fail"`` (requeued) or ``"run"``.
    singleton_on_redis_error: ClassVar[str | None] = None
    #: The names of the arguments that make the key (None: all of them).
    singleton_key_args: ClassVar[Sequence[str] | None] = None
    #: A callable(args, kwargs) -> str giving the key's identity instead of the arguments.
    singleton_key: ClassVar[Any] = None
    #: A lock shared by several tasks: those naming the same scope exclude each other.
    singleton_scope: ClassVar[str | None] = None
    #: How many runs of one key may run at once (``"unlimited"`` with a rate limit).
    singleton_permits: ClassVar[int | str | None] = None
    #: At most N runs of one key start within any second, minute or hour: ``"N/s"``, ...
    singleton_rate_limit: ClassVar[str | int | None] = None
    #: The lock's time-to-live in seconds; renewed every third of it while the run goes on.
    singleton_ttl: ClassVar[float | None] = None
    #: Seconds between the tries of a duplicate under ``"retry"``, and after a Redis error.
    singleton_retry_countdown: ClassVar[float | None] = None
    #: Stop renewing a lock this many seconds after it was taken (a hung run then loses it).
    singleton_max_hold: ClassVar[float | None] = None
    #: Seconds a finished run's completion is kept: a redelivered copy is then dropped.
    singleton_completion_ttl: ClassVar[float | None] = None
    #: Where duplicates are stopped: ``"execute"`` (on the worker) or ``"publish"`` (also at
    #: ``delay()``, which then returns the holder's AsyncResult).
    singleton_lock_on: ClassVar[str | None] = None
    #: Under ``"publish"``: seconds a queued marker lives if its message never starts.
    singleton_publish_ttl: ClassVar[float | None] = None
    #: Keep the key blocked until this many seconds after each run took its lock (read from
    #: the task only).
    singleton_lock_at_least: ClassVar[float | None] = None
    #: Seconds: a burst of calls of a key runs once, this long after its last call.
    singleton_debounce: ClassVar[float | None] = None
    #: Seconds: under debounce, a burst that keeps going runs at the latest this long after
    #: its first call.
    singleton_debounce_max: ClassVar[float | None] = None

    #: Celery's worker-side request class for this task: tells the worker's main process which
    #: generation a lost child held (worker/hooks.py). A custom one must subclass it.
    Request = "celery_singleton_lock.worker.hooks:SingletonRequest"
    #: Celery's default strategy, with the main-process skip in front of it (worker/mainskip.py).
    Strategy = "celery_singleton_lock.worker.mainskip:singleton_strategy"

    _singleton_opts: Options | None = None
    #: the parts the options select (set with them: read it once ``_singleton_opts`` is)
    _singleton_parted: Parts
    #: the key deriver of this task, and the options it was made from (singleton_keys)
    _singleton_keyed: tuple[Options, KeyDeriver] | None = None

    # -- what the task body sees --------------------------------------------------------------

    @property
    def singleton(self) -> LockHandle:
        """This run's lock: ``fencing_token``, ``lost``, ``key``, ``held``."""
        return handle_of(self.request)

    def singleton_options(self) -> Options:
        """The checked settings for this task (read from app.conf once, at first use; a
        combination that cannot work raises SingletonConfigError, at worker start).

        The run's path reads ``self._singleton_opts or self.singleton_options()``: no call
        once they are read."""
        opts = self._singleton_opts
        if opts is None:
            opts = read_options(self.app.conf, self)
            self._singleton_parted = parts_of(opts)  # first: the run's path reads it after opts
            self._singleton_opts = opts
        return opts

    def singleton_keys(
        self, args: Sequence[Any] | None, kwargs: Mapping[str, Any] | None
    ) -> LockKeys:
        """The lock keys for a call with these arguments."""
        made = self._singleton_keyed
        if made is None or made[0] is not self._singleton_opts:  # none yet, or options re-read
            made = self._singleton_deriver()
        return made[1].derive(args or (), kwargs or {})

    # -- Celery's hooks ------------------------------------------------------------------------

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

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A subclass's own ``before_start`` is wrapped so that the lock is taken before it runs,
        whether or not it calls ``super()`` (Celery documents the hook as an empty one to
        override: safety cannot depend on a ``super()`` call)."""
        super().__init_subclass__(**kwargs)
        hook = cls.__dict__.get("before_start")
        if callable(hook) and not getattr(hook, "_singleton_locks_first", False):
            cls.before_start = _lock_first(hook)  # type: ignore[method-assign,assignment]

    def before_start(self, task_id: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        """Take the lock, or deal with the duplicate by policy, before the body runs
        (task/start.py)."""
        super().before_start(task_id, args, kwargs)
        start(self, task_id, args, kwargs)

    def apply_async(
        self,
        args: Sequence[Any] | None = None,
        kwargs: Mapping[str, Any] | None = None,
        task_id: str | None = None,
        **options: Any,
    ) -> Any:
        """Celery's apply_async; under ``singleton_lock_on="publish"`` a duplicate is not
        published (duplicates/publish_dedup.py)."""
        if self._singleton_opts is None:
            self.singleton_options()
        publishing = self._singleton_parted.on_publish
        if not publishing:  # the common case: nothing but Celery's own
            return super().apply_async(args, kwargs, task_id, **options)
        send: Callable[..., Any] = super().apply_async
        for part in reversed(publishing):
            send = partial(_published_by, part, self, send)
        return send(args, kwargs, task_id, **options)

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

    def retry(  # noqa: PLR0917 - Celery's signature
        self,
        args: Sequence[Any] | None = None,
        kwargs: Mapping[str, Any] | None = None,
        exc: BaseException | None = None,
        throw: bool = True,
        eta: Any = None,
        countdown: float | None = None,
        max_retries: int | None = None,
        **options: Any,
    ) -> Any:
        """Celery's retry; once Celery has published the retried message, the lock is handed
        over to it (run/handover.py). A retry Celery refuses (``max_retries`` used up) or cannot
        publish hands nothing over: the run still holds its lock, and its end releases it."""
        return retry_handing_over(
            self, super().retry, args, kwargs, exc, throw, eta, countdown, max_retries, **options
        )

    # -- what the hooks share ----------------------------------------------------------------

    def _singleton_parts(self) -> Parts:
        """The policy and modifiers this task's settings select (duplicates/policy.py); the
        run's path reads ``_singleton_parted`` itself, once the options are read."""
        if self._singleton_opts is None:
            self.singleton_options()
        return self._singleton_parted

    @staticmethod
    def _singleton_sleep(seconds: float) -> None:
        """How a call pauses while the run that published it releases (tests may replace it)."""
        time.sleep(seconds)

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


def _published_by(  # noqa: PLR0917 - the part, the task, the next publish, and the call
    part: Part,
    task: SingletonTask,
    send: Callable[..., Any],
    args: Sequence[Any] | None,
    kwargs: Mapping[str, Any] | None,
    task_id: str | None,
    **options: Any,
) -> Any:
    return part.on_publish(task, args, kwargs, task_id, options, send)


Hook = Callable[[Any, str, Sequence[Any], Mapping[str, Any]], None]


def _lock_first(hook: Hook) -> Hook:
    """``hook`` (a SingletonTask subclass's ``before_start``), the lock taken before it."""

    @wraps(hook)
    def before_start(
        self: SingletonTask, task_id: str, args: Sequence[Any], kwargs: Mapping[str, Any]
    ) -> None:
        start(self, task_id, args, kwargs)
        hook(self, task_id, args, kwargs)

    before_start._singleton_locks_first = True  # type: ignore[attr-defined]
    return before_start
