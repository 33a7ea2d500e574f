"""A run's start, inside Celery's tracer (``SingletonTask.before_start``): the gate's action
carried out, and the lock held for the run.

On a worker the lock was asked for, and the gate decided, in front of Celery's tracer
(task/tracer.py): the action waits in a thread-local for this. An eager ``apply()`` or a direct
call asks and decides here. Either way there is one acquire and one decision
(duplicates/gate.py), and :func:`~celery_singleton_lock.duplicates.fates.carry_out` ends a
call that does not run: skipped, requeued, raised, dropped, joined. A run that goes on holds its
lock through :func:`hold`: its handle (``self.singleton``), the renewer's timer, the
``lock_acquired`` signal.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from celery.exceptions import Ignore

from .. import signals
from ..core.keys import LockKeys
from ..core.renewer import HeldLock, Renewer
from ..duplicates.copies import waited
from ..duplicates.fates import carry_out
from ..duplicates.gate import call_of, decide, take
from ..duplicates.policy import RUN, Fate, Parts
from ..duplicates.skips import Skipped
from ..errors import SingletonKeyError
from ..run.handle import LockHandle
from ..run.log import logger
from ..settings.options import Options
from .tracer import FirstTry, take_first_try

__all__ = ["hold", "start"]


def start(task: Any, task_id: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    """``before_start``'s work, once per run (a subclass's hook and the class's both call it
    when the subclass's calls ``super()``)."""
    request = task.request
    if request.get("_singleton_started") == task_id:
        return
    request._singleton_started = task_id
    opts: Options = task._singleton_opts or task.singleton_options()
    parts: Parts = task._singleton_parted
    first = take_first_try(task_id)  # a worker run: asked and decided before Celery's tracer
    if first is not None:
        keys, outcome, renewer, action = first.keys, first.outcome, first.renewer, first.action
    else:  # the keys are derived once per run: the lock, its marker, its release
        try:
            keys = task.singleton_keys(args, kwargs)
        except SingletonKeyError as exc:
            raise SingletonKeyError(f"{task.name}[{task_id}]: {exc}", task_id=task_id) from exc
        generation = int(request.retries or 0)
        outcome, renewer = take(
            task, keys, task_id, generation, args, kwargs, request, opts, task._singleton_sleep
        )
        action = decide(outcome, call_of(request), opts, parts.policy)
    if action is RUN:  # the common case: the lock is the run's
        try:
            hold(task, task_id, keys, outcome, renewer, request, opts, parts, first)
        finally:  # what stood for the call until now is done with (publish-time dedup's marker)
            if parts.on_decided and not request.is_eager:
                _decided(task, task_id, keys, Fate.RUN, parts)
        return
    fate = Fate.SKIP
    try:
        try:
            action = carry_out(task, action, keys, outcome, request, parts.policy)
            fate = action.fate
        except Skipped as skip:
            marker = skip.marker
        else:
            if fate is Fate.RUN:  # the policy's own answer let it run (a slot came free)
                hold(task, task_id, keys, outcome, renewer, request, opts, parts, first)
            return
    finally:
        if parts.on_decided and not request.is_eager:
            _decided(task, task_id, keys, fate, parts)
    # Raised here, not where the skip was decided: Celery snapshots and formats the
    # traceback of an Ignore twice, and each frame in it costs (docs/performance.md).
    raise Skipped(marker) from None


def _decided(task: Any, task_id: str, keys: LockKeys, fate: Fate, parts: Parts) -> None:
    for part in parts.on_decided:
        part.on_decided(task, task_id, keys, fate)


def hold(  # noqa: PLR0917 - the run, its lock, and who holds it
    task: Any,
    task_id: str,
    keys: LockKeys,
    outcome: Any,
    renewer: Renewer,
    request: Any,
    opts: Options,
    parts: Parts,
    first: FirstTry | None,
) -> None:
    """Hold the lock the run took (``outcome``: the acquire's :class:`Acquired`): its handle,
    renewed from now on until the run's end."""
    if not keys.permits:  # a rate alone: the run started and holds no lock (core/rates.py)
        if first is not None:
            first.taken = True
        return
    key = keys.lock if keys.permits == 1 else keys.slot(outcome.slot)  # or the permit slot
    held = HeldLock(
        key=key,
        owner=task_id,
        generation=int(request.retries or 0),
        ttl_ms=opts.ttl_ms,
        token=outcome.token,
        acquired_at=time.monotonic(),
        max_hold_s=opts.max_hold,
        context=task,
    )
    request._singleton_handle = LockHandle(key, task_id, held, outcome.reentered, renewer)
    if first is not None:  # from here the run's postrun releases it, not trace_run
        first.taken = True
    renewer.add(held)
    if parts.owns_acquired and not parts.policy.on_acquired(task, key, request):
        raise Ignore()  # ended without running (a joiner its holder's end completes): released
    if logger.isEnabledFor(logging.DEBUG):  # the run's path: no call for a line not logged
        logger.debug(
            "singleton: acquired %s[%s] key=%s token=%d reentered=%s",
            task.name,
            task_id,
            key,
            outcome.token,
            outcome.reentered,
        )
    if signals.lock_acquired.receivers:  # nor for a signal nobody receives
        signals.lock_acquired.send(
            sender=task,
            key=key,
            task_id=task_id,
            token=outcome.token,
            reentered=outcome.reentered,
            waited=waited(request),
        )
