"""How a run of a SingletonTask ends: its lock released (or handed over to its retry), the
records its ending leaves, and what its policy owes the calls waiting beside the key.

- :func:`after_run`: from the ``task_postrun`` signal (worker/hooks.py), which fires for every
  outcome of a traced run: success, failure, Ignore, Reject and Retry;
- :func:`release_lost`, :func:`end_lost`: from the worker's main process, for a run whose pool
  child was lost, terminated or timed out (worker/hooks.py, worker/reaper.py);
- :func:`withdraw`: from the worker's main process, for a message revoked or expired before it
  ran.

What the release itself does is the policy's (duplicates/policy.py ``Policy.release``): by
default it is written ahead, off the run's path (:func:`release`); coalesce publishes its
follow-up, join completes its joiners.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from celery import states
from celery.exceptions import Retry

from .. import signals
from ..core.backend import ReleaseStatus, release_lost_slot
from ..core.connection import store_for
from ..errors import LockUnavailableError, SingletonKeyError
from ..run.completion import ending_for
from ..run.events import on_released
from ..run.handle import Cancelled, LockHandle, handle_of
from ..run.handover import hand_over
from ..run.log import about, logger
from ..run.task_events import EventSink

__all__ = ["after_run", "end_lost", "release", "release_lost", "withdraw"]


def after_run(task: Any, state: str, retval: Any = None) -> None:
    """Stop renewing and release; after a hand-over (``retry()``, also with ``throw=False`` and
    the body went on), leave the lock for the retried message.

    A run that ends in ``RETRY`` without a hand-over hands over here when Celery published its
    retry (``retval`` is the ``Retry``, with the retried signature: a ``retry()`` override that
    did not call the class's), and releases when nothing was published (a ``Retry`` raised by
    hand, an eager run: its retry, if any, runs after this ending)."""
    request = task.request
    handle = handle_of(request)
    held, renewer = handle._held, handle._renewer
    if held is None or renewer is None:
        return
    if handle._handed_over:
        renewer.remove(held)
        return
    if (  # RETRY, and Celery published the retry (checked only then: every run ends here)
        state == states.RETRY
        and not request.is_eager
        and isinstance(retval, Retry)
        and retval.sig is not None
    ):
        hand_over(task, handle, retval.when)
        return
    if state == states.IGNORED and isinstance(retval, Cancelled):  # stored REVOKED: final
        state = states.REVOKED
    release(task, handle, state, eager=request.is_eager, delayed=bool(request.eta), retval=retval)


def release(
    task: Any,
    handle: LockHandle,
    state: str,
    *,
    eager: bool,
    delayed: bool = False,
    retval: Any = None,
) -> None:
    """Release the lock of a run that ended in ``state`` with ``retval`` (see
    :func:`after_run`); ``delayed``: its message carried an eta or countdown."""
    held, renewer = handle._held, handle._renewer
    assert held is not None
    assert renewer is not None
    handle._held = None
    opts = task._singleton_opts or task.singleton_options()
    held.ending = ending_for(
        opts.completion_ttl_of(delayed),
        opts.lock_at_least,
        state,
        opts.failure_is_final,
    )
    parts = task._singleton_parted
    if parts.own_release:  # coalesce, join, queue: what the end owes the calls waiting on it
        parts.policy.release(task, held, renewer, state, eager=eager, retval=retval)
        return
    # The usual release, off the run's critical path: written at once, its reply read later
    # (``Renewer.release_later``; docs/internals.md, "Deferred release"). One that records a
    # completion and cannot be written ahead (Cluster, Redlock, wait_replicas, a failed write)
    # is made here, before the message's acknowledgement, which follows this hook.
    if not eager and renewer.release_later(held, state, queue=not held.ending.completion_ttl_ms):
        return
    on_released(held, renewer.release_now(held), state)


def release_lost(  # noqa: PLR0917 - the run, and why it is released from outside
    task: Any,
    task_id: str,
    args: Sequence[Any] | None,
    kwargs: Mapping[str, Any] | None,
    generation: int,
    reason: str,
) -> ReleaseStatus | None:
    """Release the lock a lost run of ``task`` held, from outside it (the main process).

    Only that run's generation, and never a lock it handed over to a retry
    (``release_lost.lua``). Whatever became of its own lock or slot (released, expired, taken,
    handed over), the policy's ``after_release`` follows: a follow-up left meanwhile goes out
    if a slot is free (with permits, a lost run's expired slot is free beside held ones)."""
    try:
        keys = task.singleton_keys(args, kwargs)
        opts = task.singleton_options()
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
            task.name,
            task_id,
            exc,
            extra=about(task.name, task_id),
        )
        return None
    if status is ReleaseStatus.RELEASED:
        logger.warning(
            "singleton: released by main process after %s: %s[%s] key=%s",
            reason,
            task.name,
            task_id,
            key,
            extra=about(task.name, task_id),
        )
        signals.lock_released.send(sender=task, key=key, task_id=task_id, reason=reason)
    elif status is not ReleaseStatus.NOT_HELD:
        handed_over = status is ReleaseStatus.HANDED_OVER
        logger.info(
            "singleton: not released by main process after %s, %s: %s[%s] key=%s",
            reason,
            "handed over to its retry"
            if handed_over
            else "no slot of its own left, the others held"
            if keys.permits > 1
            else "held by another run",
            task.name,
            task_id,
            key,
            extra=about(task.name, task_id),
        )
    task._singleton_parts().policy.after_release(task, keys, reason, task_id)
    return status


def end_lost(  # noqa: PLR0917 - the run, and how it ended
    task: Any,
    task_id: str,
    args: Sequence[Any] | None,
    kwargs: Mapping[str, Any] | None,
    state: str,
    exc: BaseException,
    *,
    send_events: EventSink | None,
) -> None:
    """End, from the worker's main process, what a run owes the calls waiting on it (its
    policy's ``on_lost``: join completes its joiners with ``state`` and ``exc``): a run
    terminated by a revoke, or stopped by its hard time limit, whose own process does not end
    it. Their task events go to ``send_events`` (run/task_events.py)."""
    try:
        keys = task.singleton_keys(args, kwargs)
    except SingletonKeyError:
        return
    task._singleton_parts().policy.on_lost(task, task_id, keys, state, exc, send_events)


def withdraw(task: Any, request: Any) -> None:
    """A message of ``task`` revoked or expired before it ran (its Context, as ``task_revoked``
    gives it, in the worker's main process): every part lets go of what stood for it (its
    queued marker; a joiner's record)."""
    for part in task._singleton_parts().all:
        part.on_withdrawn(task, request)
