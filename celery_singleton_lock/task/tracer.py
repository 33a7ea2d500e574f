"""How a worker runs a SingletonTask message: the lock is taken before Celery's tracer, so a
skipped duplicate ends without it.

A worker runs every message through ``task.__trace__``, the function Celery's
``build_tracer`` makes (assigned by the consumer for the solo and threads pools, and by each
prefork child's initializer). :class:`~celery_singleton_lock.task.singleton_task.SingletonTask`
makes that
attribute a property which wraps Celery's function in :func:`trace_run`:

1. The keys are derived and the lock acquired (one round trip), as the message's task id,
   retries count and host.
   Before it, the parts with a ``before_lock`` (debounce) may end the call: left waiting (as
   an ``Ignore``), or superseded by a later call (as a skip).
2. The gate decides (duplicates/gate.py). A call it skips ends here, and so does the policy's
   own answer when the policy ``ends_in_front`` (coalesce): its result is stored (``SUCCESS``,
   the skip marker), one ``singleton: duplicate skipped`` line is logged,
   ``duplicate_skipped`` is sent, and ``task_prerun``/``task_postrun`` fire around it (state
   ``SUCCESS``, the marker as retval). What is returned is what Celery's tracer returns for a
   task that succeeded, so the worker's main process acknowledges the message and reports a
   finished task (the ``task-succeeded`` event) as for any other.
3. A copy of a message that already ran to its end (its completion record: run/completion.py)
   ends here too, as Celery's tracer ends an ``Ignore``: one ``singleton: already completed``
   line, ``redelivery_dropped``, the message acknowledged, and nothing stored, not even the
   ``STARTED`` a task with ``track_started`` reports before ``before_start``: the first run's
   result stays as it is (a ``FAILURE`` too, which Celery's backends do not protect as they
   protect a ``SUCCESS``). No ``task_prerun``/``task_postrun``: nothing ran.
4. Every other outcome (the lock taken, a requeue, a raise, a join, Redis down) waits in a
   thread-local, with the gate's action, for ``before_start`` (task/start.py), which carries it
   out inside Celery's tracer. A lock taken for a run that never reached ``before_start``
   (Celery's tracer returned early) is released at once.

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
from typing import Any

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
from ..duplicates.fates import report_skip, store_skip
from ..duplicates.gate import Outcome, abandon, decide, take, worker_call
from ..duplicates.policy import RUN, Action, Fate, Parts
from ..errors import SingletonKeyError
from ..run.completion import dropped, report_drop
from ..run.log import about, logger

__all__ = [
    "FirstTry",
    "end_skip",
    "follows_threading_local",
    "take_first_try",
    "trace_run",
]

Tracer = Callable[[str, Sequence[Any], Mapping[str, Any], dict[str, Any]], Any]


@dataclass
class FirstTry:
    """The lock asked for a message before Celery's tracer, and the gate's action, for its
    ``before_start``."""

    task_id: str
    keys: LockKeys
    generation: int
    outcome: Outcome
    renewer: Renewer  # that asked: the run goes on with it (no second lookup)
    action: Action = RUN
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
    """The lock :func:`trace_run` asked for ``task_id`` in this thread, if any, until the run's
    handle took it over (its ``taken``, set by ``before_start`` once the handle holds the lock:
    until then :func:`trace_run` releases it if the run ends)."""
    first = _pending.first
    if first is None or first.task_id != task_id or first.taken:
        return None
    return first


def trace_run(  # noqa: PLR0917 - Celery's tracer signature, after the two bound first
    task: Any,
    celery_trace: Tracer,
    uuid: str,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    request: dict[str, Any] | None = None,
) -> Any:
    """Run one message of ``task`` (a SingletonTask): ``celery_trace``'s signature and return
    value."""
    request = request if request is not None else {}
    if request.get("is_eager"):
        return celery_trace(uuid, args, kwargs, request)
    first: FirstTry | None = None
    opts = task._singleton_opts or task.singleton_options()
    try:  # from the acquire on: a run's SystemExit (a revoke's SIGTERM) never strands its lock
        keys = _keys(task, args, kwargs)
        if keys is None:  # before_start raises it, in Celery's tracer
            return celery_trace(uuid, args, kwargs, request)
        parts: Parts = task._singleton_parted  # read with the options, above
        if parts.before_lock:
            ended = _before_lock(task, parts, keys, uuid, args, kwargs, request)
            if ended is not None:  # waiting, or superseded by a later call
                return ended
        generation = int(request.get("retries") or 0)
        outcome, renewer = take(
            task, keys, uuid, generation, args, kwargs, request, opts, task._singleton_sleep
        )
        first = FirstTry(uuid, keys, generation, outcome, renewer)
        if type(outcome) is not Acquired:  # the lock taken: the common case goes on
            action = decide(outcome, worker_call(uuid, generation, request), opts, parts.policy)
            if action.fate is Fate.POLICY and parts.policy.ends_in_front:
                assert isinstance(outcome, Contended)
                action = parts.policy.carry_out(task, action, keys, outcome, request)
            first.action = action
            if action.fate is Fate.DROP:  # a copy of a message that already ran: dropped
                return _drop(task, parts, first, args, kwargs, request)
            if action.fate is Fate.SKIP:
                try:
                    marker, runtime = end_skip(task, keys, action, uuid, args, kwargs, request)
                    return trace_ok_t(marker, None, runtime, saferepr(marker))
                except Exception as exc:  # storing the result failed: Celery's tracer reports it
                    logger.warning(
                        "singleton: could not end skipped duplicate, handing it to celery: "
                        "%s[%s]: %s",
                        task.name,
                        uuid,
                        exc,
                        extra=about(task.name, uuid),  # in front of Celery's tracer: no run
                    )
        _pending.first = first
        return celery_trace(uuid, args, kwargs, request)
    finally:
        if first is not None:
            _pending.first = None
            if not first.taken and isinstance(first.outcome, Acquired):
                # the run's handle never held it (Celery's tracer ended before before_start,
                # or a SystemExit came in between): released here
                abandon(task, first.keys, uuid, first.generation, first.outcome.slot, opts)


def _keys(task: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> LockKeys | None:
    try:
        return task.singleton_keys(args, kwargs)  # type: ignore[no-any-return]
    except (SingletonKeyError, TypeError):  # before_start raises it, in Celery's tracer
        return None


@contextmanager
def _as_run(
    task: Any, request: dict[str, Any], args: Sequence[Any], kwargs: Mapping[str, Any]
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


def end_skip(  # noqa: PLR0917 - the call, its fate, and its message
    task: Any,
    keys: LockKeys,
    action: Action,
    uuid: str,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    request: dict[str, Any],
) -> tuple[dict[str, Any], float]:
    """End a call skipped by ``action`` without running it: its marker stored (SUCCESS), the
    parts told (publish-time dedup's marker dropped), then ``task_prerun``, its one line and
    signal, ``task_postrun``; the marker and the seconds it took. Where it raises (storing
    failed), nothing was sent yet.

    ``request`` is the message's request dict, as Celery's tracer gets it. In front of
    Celery's tracer (:func:`trace_run`), and in the worker's main process (worker/mainskip.py)."""
    started = time.monotonic()
    with _as_run(task, request, args, kwargs) as context:
        # stored first: if that fails, nothing was sent yet and Celery's tracer takes over
        marker = store_skip(task, keys, action, uuid, context)
        for part in task._singleton_parted.on_decided:
            part.on_decided(task, uuid, keys, Fate.SKIP)
        if celery_signals.task_prerun.receivers:
            celery_signals.task_prerun.send(
                sender=task, task_id=uuid, task=task, args=args, kwargs=kwargs
            )
        report_skip(task, keys, action, uuid)
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


def _drop(  # noqa: PLR0917 - the call, and what it found
    task: Any,
    parts: Parts,
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
        for part in parts.on_decided:
            part.on_decided(task, first.task_id, first.keys, Fate.DROP)
    return _ignored(dropped(first.task_id), started)


def _ignored(reason: Ignore, started: float) -> Any:
    """What Celery's tracer returns for an ``Ignore`` raised by the task (app/trace.py): the
    worker's main process acknowledges the message, and nothing is stored."""
    try:
        raise reason
    except Ignore as exc:
        einfo = ExceptionInfo(internal=True)
        return trace_ok_t(einfo, TraceInfo(states.IGNORED, exc), time.monotonic() - started, None)


def _before_lock(  # noqa: PLR0917 - the call, and its keys
    task: Any,
    parts: Parts,
    keys: LockKeys,
    uuid: str,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    request: dict[str, Any],
) -> Any:
    """Ask the parts with a ``before_lock`` (debounce: duplicates/debounce.py): None when the
    call goes on to its lock; else what ends it: left waiting (as an ``Ignore``), or
    superseded (as a skip)."""
    started = time.monotonic()
    action = None
    with _as_run(task, request, args, kwargs) as context:
        for part in parts.before_lock:
            action = part.before_lock(task, keys, context)
            if action is not None:
                break
    if action is None:
        return None
    if action.fate is not Fate.SKIP:
        return _ignored(Ignore("singleton: waiting"), started)
    try:
        marker, runtime = end_skip(task, keys, action, uuid, args, kwargs, request)
    except Exception as exc:  # storing the result failed: it was superseded all the same
        logger.warning(
            "singleton: could not end superseded debounced call, acknowledged: %s[%s]: %s",
            task.name,
            uuid,
            exc,
            extra=about(task.name, uuid),
        )
        return _ignored(Ignore("singleton: superseded"), started)
    return trace_ok_t(marker, None, runtime, saferepr(marker))
