"""Worker-side hooks: release on every path, settings check and the start-up banner.

Connected once, when the package is imported (every SingletonTask import does that).
Each handler acts only for SingletonTask instances.

Where each release happens:

==========================================  ==============================================
run ends (success, failure, Ignore, Reject)  ``task_postrun`` in the executing process
                                              queues it; its renewer thread sends it at
                                              once (or its next acquire, in the same round
                                              trip); flushed at process shutdown
``retry()`` Celery published                 no release: the retried message takes over
``retry()`` Celery refused (max_retries)      as a failure: ``task_postrun``
pool child killed (WorkerLostError)           ``task_failure`` in the main process, at once;
                                              ``task_retry`` with ``retry_on_worker_lost``
hard time limit                               ``task_failure`` in the main process, after a
                                              grace for the child to die
either of these after a ``retry()``           no release: the lock is the retried message's
``revoke(terminate=True)``                    SIGTERM (default): the child's ``task_postrun``
                                              once its ``finally`` blocks ran (before the
                                              handle held it: task/tracer.py); SIGKILL or
                                              SIGQUIT: ``task_revoked`` in the main process,
                                              after the same grace
cold shutdown                                 the child's SIGTERM becomes SystemExit, and its
                                              own ``task_postrun`` releases
whole node killed                             nobody: the lock expires after its ttl
==========================================  ==============================================

Scheduled runs: ``task_received`` hands every message to beat's witness (beat/witness.py),
which drops a scheduled run's second message.
``task_revoked`` also tells the task's parts of a message revoked or expired before it ran
(task/endings.py ``withdraw``: under publish-time dedup its queued marker is dropped).

The main process releases with the task id as owner and the run's retries count as
generation (``release_lost.lua``), so it never deletes a lock another run holds, nor one
the run handed over to its retry; the grace keeps it from freeing a lock while the
terminated child might still be running. ``task_failure`` does not carry the request: the
generation comes from :class:`SingletonRequest`, the request class of every SingletonTask.
"""

from __future__ import annotations

import logging
import signal
import threading
import warnings
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from functools import partial
from typing import Any

from celery import signals as celery_signals
from celery import states
from celery.exceptions import TaskRevokedError, TimeLimitExceeded, WorkerLostError
from celery.local import Proxy
from celery.worker.request import Request
from kombu.utils.imports import symbol_by_name

from ..beat.witness import witness_scheduled_run
from ..core.arguments import check_key_args
from ..core.backend import ReleaseStatus
from ..core.connection import flush_releases
from ..duplicates.rate import rate_text
from ..errors import SingletonConfigError
from ..run.callrepr import CONTENT_TYPE_FIELD
from ..run.log import about
from ..run.log import logger as task_logger
from ..run.task_events import TASK_EVENTS_FIELD, run_sink, sends_task_events
from ..settings.options import describe, read_options, redis_url_defaulted
from ..settings.table import DEFAULT_REDIS_URL, permits_text
from ..task.endings import after_run, end_lost, release_lost, withdraw
from ..task.singleton_task import SingletonTask
from .mainskip import learning
from .pools import check_cancel_grace, check_pool, worker_pool_of
from .reaper import ChildReaper
from .scopes import check_scopes

__all__ = ["SingletonRequest"]

logger = logging.getLogger(__name__)

#: Terminate signals that end a prefork child at once, so its main process may release for
#: it. SIGTERM is not one: billiard turns it into SystemExit in the child, whose ``finally``
#: blocks still run; the child's own ``task_postrun`` releases after them.
_FATAL_SIGNALS = frozenset({signal.SIGKILL, signal.SIGQUIT})

#: Seconds the main process waits before releasing for a child it is terminating
#: (billiard sends SIGKILL 0.1 s after SIGTERM on a hard time limit).
CHILD_EXIT_GRACE_S = 0.5


def _after_grace(release: Callable[[], object]) -> None:
    """Run ``release`` once a terminated child has had time to die (in a timer thread)."""
    timer = threading.Timer(CHILD_EXIT_GRACE_S, release)
    timer.daemon = True
    timer.start()


def _release_after_run(
    task: Any = None, state: str | None = None, retval: Any = None, **_: Any
) -> None:
    if isinstance(task, SingletonTask):
        if isinstance(task, Proxy):  # a task proxy (an app's decorator result): the task, once
            task = task._get_current_object()
        after_run(task, state or "", retval)


#: The request whose failure the worker's main process reports right now (SingletonRequest
#: sets it around Celery's own handler); ``_TIMED_OUT`` during a hard time limit's report.
_reporting: ContextVar[Request | str | None] = ContextVar("singleton_reporting", default=None)
_TIMED_OUT = "timed out"


class SingletonRequest(Request):  # type: ignore[misc]
    """The worker-side request of a SingletonTask (``SingletonTask.Request``).

    Celery's own, except that while it reports a failure the request is known to the
    ``task_failure`` handler below, which so learns the generation (retries count) of a
    lost child's run; and that a duplicate the pool skipped makes its key hot, so the main
    process turns the next ones away itself (worker/mainskip.py). A task with its own Request class
    must subclass this one; otherwise the main process cannot tell which generation a lost
    child held and leaves its lock to the ttl, and every duplicate goes to the pool.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Celery's; the request handed to the pool also says whether this worker sends task
        events now (run/task_events.py: a joined duplicate's events are sent by its run), and
        the message's content type (run/callrepr.py: a copy of it is sent in the same)."""
        super().__init__(*args, **kwargs)
        self._request_dict[TASK_EVENTS_FIELD] = sends_task_events(self._eventer, self._task)
        self._request_dict[CONTENT_TYPE_FIELD] = self._content_type

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Celery makes a subclass per task (``create_request_cls``) whose ``on_success``
        does not call this one's: each subclass's own learns skips too (worker/mainskip.py)."""
        super().__init_subclass__(**kwargs)
        if "on_success" in cls.__dict__:
            cls.on_success = learning(cls.__dict__["on_success"])  # type: ignore[method-assign]

    @learning
    def on_success(self, failed__retval__runtime: Any, **kwargs: Any) -> Any:
        """Celery's on_success; a skipped duplicate's key becomes hot first (worker/mainskip.py)."""
        return super().on_success(failed__retval__runtime, **kwargs)

    def on_failure(self, *args: Any, **kwargs: Any) -> Any:
        """Celery's on_failure; its ``task_failure`` (sent when the message will not come back)
        releases the lock a lost child held."""
        reset = _reporting.set(self)
        try:
            return super().on_failure(*args, **kwargs)
        finally:
            _reporting.reset(reset)

    def on_timeout(self, *args: Any, **kwargs: Any) -> Any:
        """Celery's on_timeout; its ``task_failure`` (Celery 5.7, also when the message comes
        back) is not acted on: on_failure reported the same hard time limit just before."""
        reset = _reporting.set(_TIMED_OUT)
        try:
            return super().on_timeout(*args, **kwargs)
        finally:
            _reporting.reset(reset)


def _release_after_child_loss(
    sender: Any = None,
    task_id: str | None = None,
    exception: BaseException | None = None,
    args: Any = None,
    kwargs: Any = None,
    **_: Any,
) -> None:
    if not isinstance(sender, SingletonTask) or task_id is None:
        return
    if isinstance(exception, WorkerLostError):
        reason = "worker lost"
    elif isinstance(exception, TimeLimitExceeded):
        reason = "hard time limit"
    else:
        return
    request = _reporting.get()
    if request == _TIMED_OUT:
        return
    if not isinstance(request, Request) or request.id != task_id:
        if not _knows_generation(sender):
            task_logger.warning(
                "singleton: not released by main process after %s, generation unknown "
                "(its Request class is not a SingletonRequest), lock expires in its ttl: "
                "%s[%s]",
                reason,
                sender.name,
                task_id,
                extra=about(sender.name, task_id),
            )
        # else: the executing process reports its own run (its task_postrun releases)
        return
    generation = int(request.request_dict.get("retries") or 0)
    release = partial(release_lost, sender, task_id, args, kwargs, generation, reason)
    if reason == "worker lost":
        release()
        return
    end_waiting = partial(  # the calls waiting on it fail as its own caller sees it
        end_lost,
        sender,
        task_id,
        args,
        kwargs,
        states.FAILURE,
        exception,
        send_events=run_sink(sender, request.request_dict),
    )
    end_waiting()
    _after_grace(partial(_release_then_end_waiting, release, end_waiting))


def _release_then_end_waiting(
    release: Callable[[], ReleaseStatus | None], end_waiting: Callable[[], object]
) -> None:
    """``release`` a lost run's lock after the grace; if that freed it, ``end_waiting`` once
    more: the calls that joined the run during the grace end as the others did."""
    if release() is ReleaseStatus.RELEASED:
        end_waiting()


def _release_after_retried_loss(
    sender: Any = None, request: Any = None, reason: Any = None, **_: Any
) -> None:
    """``task_retry_on_worker_lost`` (Celery 5.7): the main process published a retry of a lost
    child's run and sends ``task_retry``, not ``task_failure``. The dead run's lock is released
    at once; the retry takes the key when it comes, like any other run."""
    if not (
        isinstance(sender, SingletonTask)
        and isinstance(getattr(reason, "exc", None), WorkerLostError)
        and getattr(request, "id", None)
    ):
        return
    release_lost(
        sender, request.id, request.args, request.kwargs, int(request.retries or 0), "worker lost"
    )


def _knows_generation(task: Any) -> bool:
    """Whether the worker's requests of ``task`` are SingletonRequests (they know its retries)."""
    cls = task.Request
    try:
        cls = symbol_by_name(cls) if isinstance(cls, str) else cls  # type: ignore[no-untyped-call]
    except (ImportError, AttributeError, ValueError):
        return False
    return isinstance(cls, type) and issubclass(cls, SingletonRequest)


def _release_after_terminate(
    sender: Any = None,
    request: Any = None,
    terminated: bool = False,
    signum: Any = None,
    **_: Any,
) -> None:
    if not (terminated and isinstance(sender, SingletonTask) and request is not None):
        return
    end_waiting = partial(  # as its own caller sees it: REVOKED, terminated
        end_lost,
        sender,
        request.id,
        request.args,
        request.kwargs,
        states.REVOKED,
        TaskRevokedError("terminated"),
        send_events=run_sink(sender, request),
    )
    end_waiting()
    try:
        fatal = int(signum) in _FATAL_SIGNALS
    except (TypeError, ValueError):
        fatal = str(signum).upper() in {s.name for s in _FATAL_SIGNALS}
    if fatal:  # other signals leave the child alive; its own postrun releases
        release = partial(
            release_lost,
            sender,
            request.id,
            request.args,
            request.kwargs,
            request.retries,
            "terminate",
        )
        _after_grace(partial(_release_then_end_waiting, release, end_waiting))


def _withdraw_revoked(sender: Any = None, request: Any = None, **_: Any) -> None:
    """A revoked or expired message will not run: its parts let go of what stood for it (its
    queued marker: publish/dedup.py)."""
    if isinstance(sender, SingletonTask) and request is not None and request.id:
        withdraw(sender, request)


def _flush_releases(**_: Any) -> None:
    """Send the releases still queued in this process before it exits (see
    task/singleton_task.py)."""
    flush_releases()


def _check_and_announce(
    instance: Any = None, options: Mapping[str, Any] | None = None, **_: Any
) -> None:
    """Fail start-up on a bad setting, or a green pool the library cannot run under
    (worker/pools.py); add the lock settings to the worker banner; warn when the locks go to
    the local default Redis because the broker is not Redis.

    Also adds the ChildReaper bootstep (worker/reaper.py: a killed prefork child is noticed, and
    its lock released, at once); ``celeryd_init`` comes before the worker builds its steps.
    """
    app = getattr(instance, "app", None)
    if app is None:
        return
    tasks = sorted(
        (t for t in app.tasks.values() if isinstance(t, SingletonTask)), key=lambda t: t.name
    )
    if not tasks:
        return
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", DeprecationWarning)
            for task in tasks:
                check_key_args(task.run, task.singleton_options().key_args)
            check_scopes(tasks)
            check_pool(worker_pool_of(app.conf, options or {}))
            check_cancel_grace(tasks, worker_pool_of(app.conf, options or {}))
            banner = banner_lines(app.conf, tasks)  # reads the app-wide settings too
    except SingletonConfigError as exc:
        raise SystemExit(f"celery_singleton_lock: invalid setting: {exc}") from None
    logged: set[str] = set()  # an app-wide old spelling warns once per task that reads it
    for warning in caught:  # Python hides DeprecationWarnings in a worker: log them
        if issubclass(warning.category, DeprecationWarning):
            if str(warning.message) not in logged:
                logged.add(str(warning.message))
                logger.warning("singleton: deprecated option: %s", warning.message)
        else:
            warnings.warn_explicit(
                warning.message, warning.category, warning.filename, warning.lineno
            )
    if redis_url_defaulted(app.conf):
        logger.warning(
            "singleton: locks on the default %s: the broker is not Redis and "
            "singleton_redis_url is not set",
            DEFAULT_REDIS_URL,
        )
    original = instance.extra_info

    def extra_info() -> str:
        return (original() or "") + banner

    instance.extra_info = extra_info
    app.steps["worker"].add(ChildReaper)


def banner_lines(conf: Any, tasks: list[SingletonTask]) -> str:
    """The ``[singleton]`` block of the start-up banner: app-wide settings and the tasks."""
    settings = dict(describe(read_options(conf), conf))
    windows = [
        f"{t.name}={t.singleton_options().lock_at_least:g}s"
        for t in tasks
        if t.singleton_options().lock_at_least
    ]
    if windows:
        settings["lock_at_least"] = ", ".join(windows)
    permits = [f"{t.name}={permits_text(t.singleton_options().permits)}" for t in tasks]
    if any(t.singleton_options().permits != 1 for t in tasks):
        settings["permits"] = ", ".join(p for p in permits if not p.endswith("=1"))
    rates = [(t.name, t.singleton_options().rate_limit) for t in tasks]
    if any(rate for _, rate in rates):
        settings["rate_limit"] = ", ".join(f"{n}={rate_text(r)}" for n, r in rates if r)
    lines = ["", "[singleton]"]
    lines += [f"  .> {name + ':':<17}{value}" for name, value in settings.items()]
    lines.append(f"  .> {'tasks:':<17}{', '.join(t.name for t in tasks)}")
    return "\n".join(lines) + "\n"


celery_signals.task_postrun.connect(_release_after_run, weak=False)
celery_signals.task_failure.connect(_release_after_child_loss, weak=False)
celery_signals.task_retry.connect(_release_after_retried_loss, weak=False)
celery_signals.task_revoked.connect(_release_after_terminate, weak=False)
celery_signals.task_revoked.connect(_withdraw_revoked, weak=False)
celery_signals.celeryd_init.connect(_check_and_announce, weak=False)
celery_signals.task_received.connect(witness_scheduled_run, weak=False)
celery_signals.worker_process_shutdown.connect(_flush_releases, weak=False)  # prefork child
celery_signals.worker_shutdown.connect(_flush_releases, weak=False)  # solo, threads: same process
