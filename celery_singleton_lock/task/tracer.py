"""How a worker runs a SingletonTask message: the lock is taken before Celery's tracer, so a
skipped duplicate ends without it.

A worker runs every message through ``task.__trace__``, the function Celery's
``build_tracer`` makes (assigned by the consumer for the solo and threads pools, and by each
prefork child's initializer). :class:`~celery_singleton_lock.task.singleton_task.SingletonTask`
makes that
attribute a property which wraps Celery's function in :func:`trace_run`:

1. The keys are derived and the lock acquired (one round trip), as the message's task id,
   retries count and host.
2. A duplicate under the skip policy ends here: its result is stored (``SUCCESS``, the skip
   marker), one ``singleton: duplicate skipped`` line is logged, ``duplicate_skipped`` is
   sent, and ``task_prerun``/``task_postrun`` fire around it (state ``SUCCESS``, the marker as
   retval). What is returned is what Celery's tracer returns for a task that succeeded, so the
   worker's main process acknowledges the message and reports a finished task (the
   ``task-succeeded`` event) as for any other.
3. A copy of a message that already ran to its end (its completion record: run/completion.py)
   ends here too, as Celery's tracer ends an ``Ignore``: one ``singleton: already completed``
   line, ``redelivery_dropped``, the message acknowledged, and nothing stored, not even the
   ``STARTED`` a task with ``track_started`` reports before ``before_start``: the first run's
   result stays as it is (a ``FAILURE`` too, which Celery's backends do not protect as they
   protect a ``SUCCESS``). No ``task_prerun``/``task_postrun``: nothing ran.
4. Every other outcome (the lock taken, another policy, the run's own earlier delivery or the
   run that published it, Redis down) waits in a thread-local for ``before_start``, and
   Celery's tracer runs as before. A lock taken for a run that never reached
   ``before_start`` (Celery's tracer returned early) is released at once.

Why: Celery answers an ``Ignore`` by snapshotting and formatting its tracer's frames twice,
which cost several times a no-op task's run (docs/performance.md). Eager runs (``apply()``)
use Celery's tracer directly; their skip still ends in an ``Ignore`` (duplicates/skips.py).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

from billiard.einfo import ExceptionInfo
from celery import signals as celery_signals
from celery import states
from celery._state import _task_stack
from celery.app.task import Context
from celery.app.trace import TraceInfo, trace_ok_t
from celery.exceptions import Ignore
from celery.utils.saferepr import saferepr

from ..core.backend import Acquired, Completed, Contended
from ..core.keys import LockKeys
from ..core.renewer import Renewer
from ..duplicates.coalesce import is_follow_up
from ..duplicates.debounce import debounced
from ..duplicates.rate import rate_skips
from ..errors import LockUnavailableError, SingletonKeyError
from ..run.completion import dropped, report_drop
from ..run.log import about, logger
from ..settings.options import Options

__all__ = [
    "FirstTry",
    "TracedTask",
    "end_skip",
    "follows_threading_local",
    "take_first_try",
    "trace_run",
]

Tracer = Callable[[str, Sequence[Any], Mapping[str, Any], dict[str, Any]], Any]


class TracedTask(Protocol):
    """What the tracer hook asks of a task: TracedTask (task/singleton_task.py), named by what it
    does so
    that the tracer need not import the class it is part of."""

    name: str
    request_stack: Any
    _singleton_opts: Options | None

    def singleton_options(self) -> Options: ...
    def singleton_keys(
        self, args: Sequence[Any] | None, kwargs: Mapping[str, Any] | None
    ) -> LockKeys: ...
    def _singleton_renewer(self, opts: Options) -> Renewer: ...
    def _singleton_meta(
        self, args: Sequence[Any], kwargs: Mapping[str, Any], request: Any
    ) -> dict[str, str]: ...
    def _singleton_skips(
        self, outcome: Acquired | Contended | LockUnavailableError, task_id: str, parent: Any
    ) -> bool: ...
    def _singleton_coalesce(  # noqa: PLR0917 - as DuplicatePolicies' own
        self,
        keys: LockKeys,
        holder: str,
        task_id: str,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        request: Any,
    ) -> float | None: ...
    def _singleton_store_skip(
        self, keys: LockKeys, holder: str, task_id: str, request: Any
    ) -> dict[str, Any]: ...
    def _singleton_forget_queued(self, task_id: str, keys: LockKeys, reason: str) -> None: ...
    def _singleton_report_skip(self, keys: LockKeys, holder: str, task_id: str) -> None: ...
    def _singleton_abandon(
        self, keys: LockKeys, task_id: str, generation: int, slot: int | None = 1
    ) -> None: ...


@dataclass
class FirstTry:
    """The acquire made for a message before Celery's tracer, for its ``before_start``."""

    task_id: str
    keys: LockKeys
    generation: int
    outcome: Acquired | Contended | LockUnavailableError
    renewer: Renewer  # that took it: the run goes on with it (no second lookup)
    taken: bool = False  # the run's handle holds it (set by before_start)


class _Pending(threading.local):
    first: FirstTry | None = None


_pending = _Pending()


def follows_threading_local() -> bool:
    """Whether the per-run state above is local to what ``threading.local`` is now: False once
    gevent or eventlet patched ``threading`` after this module was imported (the state is then
    one per OS thread, shared by all its green threads; worker/pools.py refuses that)."""
    return issubclass(_Pending, threading.local)


def take_first_try(task_id: str) -> FirstTry | None:
    """The acquire :func:`trace_run` made for ``task_id`` in this thread, if any, until the
    run's handle took it over (its ``taken``, set by ``before_start`` once the handle holds the
    lock: until then :func:`trace_run` releases it if the run ends)."""
    first = _pending.first
    if first is None or first.task_id != task_id or first.taken:
        return None
    return first


def trace_run(  # noqa: PLR0917 - Celery's tracer signature, after the two bound first
    task: TracedTask,
    celery_trace: Tracer,
    uuid: str,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    request: dict[str, Any] | None = None,
) -> Any:
    """Run one message of ``task``: ``celery_trace``'s signature and return value."""
    request = request if request is not None else {}
    if request.get("is_eager"):
        return celery_trace(uuid, args, kwargs, request)
    first: FirstTry | None = None
    try:  # from the acquire on: a run's SystemExit (a revoke's SIGTERM) never strands its lock
        keys = _keys(task, args, kwargs)
        if keys is None:  # before_start raises it, in Celery's tracer
            return celery_trace(uuid, args, kwargs, request)
        if (task._singleton_opts or task.singleton_options()).debounce is not None:
            ended = _debounce(task, keys, uuid, args, kwargs, request)
            if ended is not None:  # waiting, or superseded by a later call
                return ended
        first = _first_try(task, keys, uuid, args, kwargs, request)
        if type(first.outcome) is Completed:  # a copy of a message that already ran: dropped
            return _drop(task, first, args, kwargs, request)
        if (
            not isinstance(first.outcome, Acquired)  # the lock taken: the common case goes on
            and (
                task._singleton_skips(first.outcome, uuid, request.get("parent_id"))
                or rate_skips(task, first.outcome, request)  # over the rate (duplicates/rate.py)
            )
            and (
                task.singleton_options().on_duplicate != "coalesce"
                or is_follow_up(request)  # never coalesced again: ends as a skip
                or task._singleton_coalesce(first.keys, _holder(first), uuid, args, kwargs, request)
                is None
            )
        ):  # a duplicate that could not be coalesced goes on to before_start, which requeues it
            try:
                return _skip(task, first, args, kwargs, request)
            except Exception as exc:  # storing the result failed: Celery's tracer reports it
                logger.warning(
                    "singleton: could not end skipped duplicate, handing it to celery: %s[%s]: %s",
                    task.name,
                    uuid,
                    exc,
                    extra=about(task.name, uuid),  # in front of Celery's tracer: no current run
                )
        _pending.first = first
        return celery_trace(uuid, args, kwargs, request)
    finally:
        if first is not None:
            _pending.first = None
            if not first.taken and isinstance(first.outcome, Acquired):
                # the run's handle never held it (Celery's tracer ended before before_start,
                # or a SystemExit came in between): released here
                task._singleton_abandon(first.keys, uuid, first.generation, first.outcome.slot)


def _keys(task: TracedTask, args: Sequence[Any], kwargs: Mapping[str, Any]) -> LockKeys | None:
    try:
        return task.singleton_keys(args, kwargs)
    except (SingletonKeyError, TypeError):  # before_start raises it, in Celery's tracer
        return None


def _first_try(  # noqa: PLR0917 - the message, and its keys
    task: TracedTask,
    keys: LockKeys,
    uuid: str,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    request: Mapping[str, Any],
) -> FirstTry:
    generation = int(request.get("retries") or 0)
    opts = task._singleton_opts or task.singleton_options()
    renewer = task._singleton_renewer(opts)
    outcome: Acquired | Contended | LockUnavailableError
    meta = task._singleton_meta(args, kwargs, request)
    try:  # the run's one blocking round trip
        outcome = renewer.acquire(keys, uuid, generation, opts.ttl_ms, meta)
    except LockUnavailableError as exc:
        outcome = exc
    except BaseException:  # a SystemExit (a revoke's SIGTERM) while the reply was on its way
        task._singleton_abandon(keys, uuid, generation, None)  # the lock may be ours: freed
        raise
    return FirstTry(uuid, keys, generation, outcome, renewer)


@contextmanager
def _as_run(
    task: TracedTask, request: dict[str, Any], args: Sequence[Any], kwargs: Mapping[str, Any]
) -> Iterator[Context]:
    """The task and its request current, as Celery's tracer makes them for a run."""
    context = Context(request, args=args, called_directly=False, kwargs=kwargs)
    _task_stack.push(task)
    task.request_stack.push(context)
    try:
        yield context
    finally:
        task.request_stack.pop()
        _task_stack.pop()


def _skip(
    task: TracedTask,
    first: FirstTry,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    request: dict[str, Any],
) -> Any:
    """End a skipped duplicate as Celery's tracer ends a run that succeeded."""
    assert isinstance(first.outcome, Contended)
    marker, runtime = end_skip(
        task, first.keys, first.outcome.holder, first.task_id, args, kwargs, request
    )
    return trace_ok_t(marker, None, runtime, saferepr(marker))


def end_skip(  # noqa: PLR0917 - the duplicate, what it met, and its message
    task: TracedTask,
    keys: LockKeys,
    holder: str,
    uuid: str,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    request: dict[str, Any],
) -> tuple[dict[str, Any], float]:
    """End a skipped duplicate without running it: its marker stored (SUCCESS) and its queued
    marker dropped (publish-time dedup), then ``task_prerun``, its one line and
    ``duplicate_skipped``, ``task_postrun``; the marker and the seconds it took. Where it raises
    (storing failed), nothing was sent yet.

    ``request`` is the message's request dict, as Celery's tracer gets it. In front of
    Celery's tracer (:func:`trace_run`), and in the worker's main process (worker/mainskip.py)."""
    started = time.monotonic()
    with _as_run(task, request, args, kwargs) as context:
        # stored first: if that fails, nothing was sent yet and Celery's tracer takes over
        marker = task._singleton_store_skip(keys, holder, uuid, context)
        if (task._singleton_opts or task.singleton_options()).lock_on != "execute":
            task._singleton_forget_queued(uuid, keys, "skip")  # as before_start's, for a run
        if celery_signals.task_prerun.receivers:
            celery_signals.task_prerun.send(
                sender=task, task_id=uuid, task=task, args=args, kwargs=kwargs
            )
        task._singleton_report_skip(keys, holder, uuid)
        if celery_signals.task_postrun.receivers:
            celery_signals.task_postrun.send(
                sender=task,
                task_id=uuid,
                task=task,
                args=args,
                kwargs=kwargs,
                retval=marker,
                state=states.SUCCESS,
            )
    return marker, time.monotonic() - started


def _drop(
    task: TracedTask,
    first: FirstTry,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    request: dict[str, Any],
) -> Any:
    """End a copy of a message that already ran to its end as Celery's tracer ends an
    ``Ignore`` raised by the task: the worker's main process acknowledges it, and nothing is
    stored."""
    assert isinstance(first.outcome, Completed)
    started = time.monotonic()
    with _as_run(task, request, args, kwargs):  # logged as the run: Celery's task logger
        report_drop(task, first.keys.lock, first.outcome, first.task_id, first.generation)
        if (task._singleton_opts or task.singleton_options()).lock_on != "execute":
            task._singleton_forget_queued(first.task_id, first.keys, "start")
    return _ignored(dropped(first.task_id), started)


def _ignored(reason: Ignore, started: float) -> Any:
    """What Celery's tracer returns for an ``Ignore`` raised by the task (app/trace.py): the
    worker's main process acknowledges the message, and nothing is stored."""
    try:
        raise reason
    except Ignore as exc:
        einfo = ExceptionInfo(internal=True)
        return trace_ok_t(einfo, TraceInfo(states.IGNORED, exc), time.monotonic() - started, None)


def _debounce(  # noqa: PLR0917 - the message, and its keys
    task: TracedTask,
    keys: LockKeys,
    uuid: str,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    request: dict[str, Any],
) -> Any:
    """Debounce a message (duplicates/debounce.py): None when it goes on to its lock; else
    what ends it: left waiting (as an ``Ignore``), or superseded (as a skip)."""
    started = time.monotonic()
    with _as_run(task, request, args, kwargs) as context:
        verdict = debounced(task, keys, context)
    if verdict is None or verdict.action == "run":
        return None
    if verdict.action == "wait":
        return _ignored(Ignore("singleton: debounced, waiting"), started)
    request["_singleton_superseded"] = verdict.by  # the marker and the line name it
    try:
        marker, runtime = end_skip(task, keys, str(verdict.by), uuid, args, kwargs, request)
    except Exception as exc:  # storing the result failed: it was superseded all the same
        logger.warning(
            "singleton: could not end superseded debounced call, acknowledged: %s[%s]: %s",
            task.name,
            uuid,
            exc,
            extra=about(task.name, uuid),
        )
        return _ignored(Ignore("singleton: debounced call superseded"), started)
    return trace_ok_t(marker, None, runtime, saferepr(marker))


def _holder(first: FirstTry) -> str:
    assert isinstance(first.outcome, Contended)
    return first.outcome.holder
