"""``singleton_on_duplicate="cancel"``: latest wins. A newer call of a key asks the run holding
it to stop, and runs after that run's release; the calls that waited before it, older, end as
skips naming it.

A newer call that meets its key held (core/queue.py ``supersede.lua``, one round trip):

1. takes the place of every call waiting for the key: each ends at once as a skip naming the
   newer call (``skip_info(result).holder``), as a coalesced follow-up a newer run supersedes;
2. waits in line, alone, as a queued call does (duplicates/queue.py: a record beside the lock,
   its message acknowledged), and is handed the key at the holder's release;
3. asks the holder to stop: the lock's field ``cancel`` names it. The holder's renewer reads it
   in its next renewal (renew.lua: no round trip of the run's own), at most a third of the ttl
   later, and ``self.singleton.cancelled`` turns True. The body decides: it may finish, or end
   with ``self.singleton.end_cancelled()`` (``REVOKED``, no link called).

With ``singleton_cancel_grace=S`` a holder that has not stopped S seconds after it was asked is
ended with Celery's ``revoke(terminate=True)`` (SIGTERM): the newer call publishes, beside its
wait, a *stop check* (a copy of its message under a task id of its own, header
:data:`STOP_HEADER`, due in S seconds) which, if that holder still holds the key then, sends the
revoke, and ends without running. Only pools that can terminate a run take the setting
(prefork, gevent, eventlet): a solo or threads worker refuses it at start (worker/pools.py).

A call that finds the key free while older calls wait (its last run was lost with its node)
runs, and the waiting calls make way for it. Under ``singleton_lock_on="publish"`` a newer
call also takes the place of an older one still in the broker's queue: the older message is
revoked, and never runs.
"""

from __future__ import annotations

import contextlib
from typing import Any

from celery.app.task import Context
from kombu.utils.uuid import uuid

from .. import signals
from ..core._wire import as_text
from ..core.backend import Contended
from ..core.connection import store_for
from ..core.keys import LockKeys
from ..core.queue import Handed, supersede
from ..run.log import LOGGED_ERRORS, about, logger
from ..settings.options import Options
from .canvas import store_skip
from .copies import publish_copy
from .policy import WAIT, Action, Fate, Why
from .queue import QUEUE_KEEP_MS, QUEUED_HEADER, QueuePolicy, _call_of, _record
from .skips import skip_marker

__all__ = ["STOP_HEADER", "CancelPolicy"]

#: Message header of a stop check: the holder a newer call asked to stop.
STOP_HEADER = "singleton_stop_check"


class CancelPolicy(QueuePolicy):
    """A newer call asks the running one to stop, and runs after it."""

    name = "cancel"
    replaces_queued = True

    def refuse(self, opts: Options) -> str | None:
        if opts.permits != 1:
            return (
                "singleton_on_duplicate 'cancel' does not go with singleton_permits other than 1 "
                "(a newer call asks the one run holding its key to stop)"
            )
        if opts.lock_at_least > 0:
            return (
                "singleton_on_duplicate 'cancel' does not go with singleton_lock_at_least (a "
                "newer call runs at the holder's release; a window would hold it with no run)"
            )
        if opts.rate_limit is not None:
            return (
                "singleton_on_duplicate 'cancel' does not go with singleton_rate_limit (the "
                "newer call handed the key over the rate would wait out of line)"
            )
        if opts.store_kind == "redlock":
            return (
                "singleton_on_duplicate 'cancel' is not supported with a redis+redlock:// URL "
                "(the stop request and the hand-over are written on one server); use one "
                "server, Sentinel or Cluster"
            )
        return None

    def carry_out(
        self, task: Any, action: Action, keys: LockKeys, held: Contended, request: Any
    ) -> Action:
        """Take the place of the waiting calls, wait for the key, ask the holder to stop."""
        opts: Options = task.singleton_options()
        task_id = request.id
        try:
            done, superseded = supersede(
                store_for(opts.redis_url).run_script,
                keys.lock,
                task_id,
                int(request.retries or 0),
                _record(task, request),
                QUEUE_KEEP_MS,
                task.name,
                wait=True,
            )
        except LOGGED_ERRORS as exc:
            logger.warning(
                "singleton: could not ask the holder to stop, requeued: %s[%s] key=%s: %s",
                task.name,
                task_id,
                keys.lock,
                exc,
            )
            countdown = float(opts.retry_countdown)
            return Action(Fate.REQUEUE, Why.DUPLICATE, countdown, held.holder, policy=self.name)
        if not done:  # the key was let go meanwhile: it takes it, or meets the next holder
            return Action(Fate.REQUEUE, Why.DUPLICATE, 0.0, held.holder, policy=self.name)
        _end_superseded(task, keys.lock, superseded, task_id)
        logger.info(
            "singleton: newer call asks the holder to stop: %s[%s] key=%s holder=%s",
            task.name,
            task_id,
            keys.lock,
            held.holder,
        )
        signals.stop_asked.send(sender=task, key=keys.lock, task_id=task_id, holder=held.holder)
        if opts.cancel_grace is not None:
            _publish_stop_check(task, request, keys.lock, held.holder, opts.cancel_grace)
        return WAIT

    def on_acquired(self, task: Any, key: str, request: Any) -> bool:
        """A call that took the key (free, or handed to it) runs; any older call still waiting
        makes way for it."""
        if request.get(QUEUED_HEADER):  # handed the key: it took the place of the others
            return True
        opts: Options = task.singleton_options()
        try:
            _, superseded = supersede(
                store_for(opts.redis_url).run_script,
                key,
                request.id,
                int(request.retries or 0),
                b"",
                QUEUE_KEEP_MS,
                task.name,
                wait=False,
            )
        except LOGGED_ERRORS:  # the run goes on; the waiting calls run after it, as queued
            return True
        _end_superseded(task, key, superseded, request.id)
        return True

    def before_lock(self, task: Any, keys: LockKeys, request: Any) -> Action | None:
        """A stop check (its header): the holder it names still holds the key past its grace:
        terminate it. The check ends there, whatever it found."""
        holder = request.get(STOP_HEADER)
        if not holder:
            return None
        opts: Options = task.singleton_options()
        try:
            owner, asked = store_for(opts.redis_url).client.hmget(keys.lock, "owner", "cancel")
        except LOGGED_ERRORS as exc:
            logger.warning(
                "singleton: could not read the key for a stop check, the holder goes on: "
                "%s key=%s holder=%s: %s",
                task.name,
                keys.lock,
                holder,
                exc,
            )
            return WAIT
        if owner is not None and as_text(owner) == holder and asked is not None:
            logger.warning(
                "singleton: holder did not stop within the grace, terminated: %s[%s] key=%s "
                "by=%s grace=%ss",
                task.name,
                holder,
                keys.lock,
                as_text(asked),
                opts.cancel_grace,
            )
            task.app.control.revoke(holder, terminate=True, signal="SIGTERM")
        return WAIT


def _end_superseded(task: Any, lock_key: str, superseded: list[Handed], newer: str) -> None:
    """End each waiting call a newer one took the place of, as a skip naming it: its result the
    skip marker (a caller waiting on it learns why), one line, ``duplicate_skipped``."""
    for call in superseded:
        name = task.name
        with contextlib.suppress(Exception):  # not a record this app reads: the task at hand's
            name = str(_call_of(task, call.record).get("task") or name)
        target = task.app.tasks.get(name) or task
        marker = skip_marker(lock_key, newer, call.task_id)
        request = Context(id=call.task_id, task=name, ignore_result=bool(target.ignore_result))
        try:
            store_skip(target, call.task_id, marker, request)
        except Exception as exc:  # the backend failed: the call must not run all the same
            logger.error(
                "singleton: could not store the result of a superseded waiting call: %s[%s] "
                "key=%s by=%s: %r",
                name,
                call.task_id,
                lock_key,
                newer,
                exc,
            )
        logger.info(
            "singleton: waiting call superseded by a newer call: %s[%s] key=%s by=%s",
            name,
            call.task_id,
            lock_key,
            newer,
            extra=about(name, call.task_id),
        )
        signals.duplicate_skipped.send(
            sender=target, key=lock_key, task_id=call.task_id, holder=newer, superseded_by=newer
        )


def _publish_stop_check(task: Any, request: Any, lock_key: str, holder: str, grace: float) -> None:
    """The stop check of ``holder``, due in ``grace`` seconds (a copy of this call's message
    under an id of its own: it never runs the body)."""
    try:
        publish_copy(task, request, grace, {STOP_HEADER: holder}, task_id=uuid())
    except Exception as exc:  # the holder is still asked to stop; only the hard stop is lost
        logger.warning(
            "singleton: could not publish the stop check, the holder is not terminated: "
            "%s[%s] key=%s holder=%s: %s",
            task.name,
            request.id,
            lock_key,
            holder,
            exc,
        )
