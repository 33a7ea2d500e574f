"""``singleton_on_duplicate="queue"``: every call of a key runs, one at a time, in the order it
reached the key (with ``singleton_permits=N``, N at a time).

A call that meets its key held does not run, and takes no worker slot while it waits: it
writes a record of its message into the key's queue (core/queue.py ``enqueue.lua``: only while
every slot is held, at most ``singleton_queue_max`` calls; a copy of a call already waiting is
not queued twice) and ends, acknowledged, its state as it was (PENDING). One ``singleton:
duplicate queued`` line and ``duplicate_queued``.

Nothing polls. Whoever lets a slot of the key go hands it to the call at the head of the queue
in the same script (``queue_release.lua``, ``queue_pass.lua``): the lock is rewritten in that
call's name, and its own message is published again (the same task id, retries, links, chain
and chord, as ``retry()`` would, with the header :data:`QUEUED_HEADER`). When it arrives it
re-enters the lock with a fresh fencing token and runs; its result is its own, and its canvas
goes on from its own run. A newer call that meets the handed-over lock waits behind it.

- The run's end hands over (:meth:`QueuePolicy.release`); so does the worker's main process for
  a run whose child was lost, terminated or timed out, once it released the run's lock
  (:meth:`QueuePolicy.after_release`).
- A call that ended while it waited (revoked: Celery stores REVOKED at once; or its result
  stored some other way) or whose ``expires`` passed is passed over at its turn: it does not
  run, no link is called (an expired one is stored REVOKED, as Celery ends an expired message).
  So is a head whose message the worker discards (revoked or expired after it was published:
  :meth:`QueuePolicy.on_withdrawn`).
- A call that finds the key free while calls wait (the run holding it was lost with its whole
  node, and its lock expired) takes its place at the back and hands the key to the head
  (:meth:`QueuePolicy.on_acquired`): the queue goes on at the key's next call, in order.
- A full queue refuses the call as ``"raise"`` refuses a duplicate: ``DuplicateTaskError``
  saying the queue is full, one ``singleton: queue full, raised`` line, ``queue_full``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from celery import states
from celery.canvas import signature
from kombu.serialization import loads, prepare_accept_content

from .. import signals
from ..core.backend import Contended, ReleaseStatus
from ..core.completion import done_key
from ..core.connection import store_for
from ..core.keys import LockKeys, keys_of
from ..core.queue import Handed, enqueue, pass_to_next, put_back, release_to_next, waiting
from ..core.renewer import HeldLock, Renewer
from ..errors import LockUnavailableError
from ..run.callrepr import copy_options
from ..run.completion import ending_for
from ..run.events import on_released
from ..run.log import LOGGED_ERRORS, about, logger
from ..settings.options import Options
from .coalesce import task_dumps
from .copies import seconds_left
from .policy import WAIT, Action, Call, Fate, Policy, Why

__all__ = ["QUEUED_HEADER", "QueuePolicy"]

#: Message header of a queued call the key was handed to: the lock (or permit slot) that waits
#: in its name until its message comes.
QUEUED_HEADER = "singleton_queued"

#: How long past its ttl a lock waits in the name of the call it was handed to, for that call's
#: message to come through the broker, ms.
HANDOVER_WAIT_MS = 60_000

#: How long a queue outlives its lock, ms: calls that wait behind a run lost with its whole
#: node stay for the key's next call (or a CLI purge).
QUEUE_KEEP_MS = 24 * 3600 * 1000


class QueuePolicy(Policy):
    """Every call runs, in the order it reached its key."""

    name = "queue"
    owes_waiting_calls = True

    def refuse(self, opts: Options) -> str | None:
        if opts.lock_on != "execute":
            return (
                "singleton_on_duplicate 'queue' needs singleton_lock_on 'execute' (every call "
                "must reach a worker to take its place in line)"
            )
        if opts.lock_at_least > 0:
            return (
                "singleton_on_duplicate 'queue' does not go with singleton_lock_at_least (each "
                "release hands the key to the next call; a window would hold it with no run)"
            )
        if opts.permits == 0:
            return (
                "singleton_on_duplicate 'queue' needs a limit on runs at once: with "
                "singleton_permits 'unlimited' there is no run to wait behind"
            )
        if opts.rate_limit is not None:
            return (
                "singleton_on_duplicate 'queue' does not go with singleton_rate_limit (a call "
                "handed the key over the rate would wait out of line); use 'retry' with a rate"
            )
        if opts.store_kind == "redlock":
            return (
                "singleton_on_duplicate 'queue' is not supported with a redis+redlock:// URL "
                "(the hand-over rewrites the lock on one server); use one server, Sentinel or "
                "Cluster"
            )
        return None

    def on_contended(self, call: Call, held: Contended, opts: Options) -> Action:
        if call.eager:  # nothing can wait beside an eager call
            return Action(Fate.RAISE, Why.DUPLICATE, holder=held.holder, policy=self.name)
        return Action(Fate.POLICY, Why.DUPLICATE, holder=held.holder, policy=self.name)

    def carry_out(
        self, task: Any, action: Action, keys: LockKeys, held: Contended, request: Any
    ) -> Action:
        """Queue the call behind the key's runs: it waits (acknowledged, nothing stored); it is
        requeued at once when the key was let go meanwhile, refused when the queue is full."""
        opts: Options = task.singleton_options()
        task_id = request.id
        try:
            queued = enqueue(
                store_for(opts.redis_url).run_script,
                keys,
                task_id,
                int(request.retries or 0),
                _record(task, request),
                opts.queue_max,
                QUEUE_KEEP_MS,
                task.name,
            )
        except LOGGED_ERRORS as exc:
            logger.warning(
                "singleton: could not queue duplicate, requeued: %s[%s] key=%s: %s",
                task.name,
                task_id,
                keys.lock,
                exc,
            )
            countdown = float(opts.retry_countdown)
            return Action(Fate.REQUEUE, Why.DUPLICATE, countdown, held.holder, policy=self.name)
        if queued.status == 0:  # the key was let go meanwhile: it takes it, or meets the next
            countdown = max(queued.pttl_ms, 0) / 1000 if queued.finished else 0.0
            return Action(Fate.REQUEUE, Why.DUPLICATE, countdown, held.holder, policy=self.name)
        if queued.status < 0:
            return Action(
                Fate.RAISE,
                Why.QUEUE_FULL,
                holder=held.holder,
                policy=self.name,
                length=queued.place,
            )
        logger.info(
            "singleton: duplicate queued: %s[%s] key=%s holder=%s place=%d",
            task.name,
            task_id,
            keys.lock,
            held.holder,
            queued.place,
        )
        signals.duplicate_queued.send(
            sender=task, key=keys.lock, task_id=task_id, holder=held.holder, place=queued.place
        )
        return WAIT

    def on_acquired(self, task: Any, key: str, request: Any) -> bool:
        """A call that took a free key while calls wait (the key's last run was lost with its
        node) goes to the back of the line and hands the key to the head; the head's own message
        re-enters the lock it was handed (and runs)."""
        if request.get(QUEUED_HEADER):
            return True
        opts: Options = task.singleton_options()
        store = store_for(opts.redis_url)
        try:
            length, _ = waiting(store.client, key)
        except LOGGED_ERRORS:  # the queue cannot be read: the run goes on (it holds the key)
            return True
        if not length:
            return True
        keys = keys_of(key, opts.permits)
        try:
            queued = enqueue(
                store.run_script,
                keys,
                request.id,
                int(request.retries or 0),
                _record(task, request),
                opts.queue_max + 1,  # its place was taken: never refused now
                QUEUE_KEEP_MS,
                task.name,
            )
        except LOGGED_ERRORS:  # the run goes on: it holds the key, the line goes on after it
            return True
        if queued.status <= 0:
            return True
        logger.info(
            "singleton: calls were waiting, queued behind them: %s[%s] key=%s place=%d",
            task.name,
            request.id,
            key,
            queued.place,
        )
        handle = getattr(request, "_singleton_handle", None)
        if handle is not None and handle._held is not None:  # its lock goes to the head now
            held, renewer = handle._held, handle._renewer
            handle._held = None
            renewer.remove(held)
            self._release(task, held, "queued behind waiting calls")
        return False

    def release(
        self,
        task: Any,
        held: HeldLock,
        renewer: Renewer,
        state: str,
        *,
        eager: bool,
        retval: Any = None,
    ) -> None:
        """Released now and handed to the next call in line, whose message is published. A run
        the key was handed to records its completion as the run of a delayed message does: its
        original message, acknowledged when it was queued, may still come again (an eta or
        countdown message a Redis broker handed out again), and is then dropped, not run."""
        renewer.remove(held)
        was_queued = not eager and bool(task.request.get(QUEUED_HEADER))
        self._release(task, held, state, was_queued=was_queued)

    def _release(self, task: Any, held: HeldLock, state: str, *, was_queued: bool = False) -> None:
        opts: Options = task.singleton_options()
        ending = held.ending
        completion_ms = 0 if ending is None else ending.completion_ttl_ms
        if was_queued and ending is not None:
            delayed = ending_for(opts.completion_ttl_of(True), 0.0, state, opts.failure_is_final)
            completion_ms = max(completion_ms, delayed.completion_ttl_ms)
        try:
            status, handed = release_to_next(
                store_for(opts.redis_url).run_script,
                held.key,
                done_key(held.key, held.owner),
                held.owner,
                held.generation,
                held.token,
                completion_ms,
                opts.ttl_ms + HANDOVER_WAIT_MS,
                QUEUE_KEEP_MS,
            )
        except LOGGED_ERRORS as exc:  # logged as any failed release; the queue goes on later
            on_released(held, LockUnavailableError(str(exc), key=held.key), state)
            return
        on_released(held, ReleaseStatus(min(status, 1)), state)
        if handed is not None:
            _publish(task, held.key, handed, state)

    def after_release(
        self, task: Any, keys: LockKeys, reason: str, releaser: str | None = None
    ) -> None:
        """Each free slot of the key goes to the next call in line."""
        opts: Options = task.singleton_options()
        run = store_for(opts.redis_url).run_script
        for slot in keys.slots:
            try:
                _, handed = pass_to_next(
                    run, slot, None, opts.ttl_ms + HANDOVER_WAIT_MS, QUEUE_KEEP_MS
                )
            except LOGGED_ERRORS as exc:
                _pass_failed(task, slot, reason, exc)
                return
            if handed is not None:
                _publish(task, slot, handed, reason)

    def on_withdrawn(self, task: Any, request: Any) -> None:
        """A queued call the key was handed to, revoked or expired when its message came: the
        key goes to the next call in line."""
        slot = request.get(QUEUED_HEADER)
        if not isinstance(slot, str):
            return
        _pass_over(task, slot, request.id, "its message was discarded")


def _pass_over(task: Any, slot: str, task_id: str, why: str) -> None:
    """The lock ``slot`` waits in the name of ``task_id``, which will not run: to the next."""
    opts: Options = task.singleton_options()
    try:
        _, handed = pass_to_next(
            store_for(opts.redis_url).run_script,
            slot,
            task_id,
            opts.ttl_ms + HANDOVER_WAIT_MS,
            QUEUE_KEEP_MS,
        )
    except LOGGED_ERRORS as exc:
        _pass_failed(task, slot, why, exc)
        return
    if handed is not None:
        _publish(task, slot, handed, why)


def _pass_failed(task: Any, slot: str, why: str, exc: Exception) -> None:
    logger.warning(
        "singleton: could not hand the key to the next queued call after %s, the queue goes "
        "on at the key's next call: %s key=%s: %s",
        why,
        task.name,
        slot,
        exc,
        extra=about(task.name, ""),
    )


def _publish(task: Any, slot: str, handed: Handed, why: str) -> None:
    """Publish the message of ``handed``, the call ``slot`` was handed to; a call that already
    ended, or expired, is passed over (the key goes to the next one)."""
    app = task.app
    try:
        fields = _call_of(task, handed.record)
    except Exception as exc:  # not written by this app: never loaded, the key goes on
        logger.error(
            "singleton: queued call dropped, not a record this app wrote or accepts: [%s] "
            "key=%s: %r",
            handed.task_id,
            slot,
            exc,
        )
        _pass_over(task, slot, handed.task_id, "a record it could not read")
        return
    sig = signature(fields, app=app)
    target = app.tasks.get(sig.task) or task
    ended = _ended_as(target, handed.task_id)
    expires = sig.options.get("expires")
    if ended is None and _expired(expires):
        ended = states.REVOKED
        try:
            target.backend.mark_as_revoked(handed.task_id, "expired", request=None)
        except Exception as exc:  # it is passed over all the same
            logger.warning(
                "singleton: could not store an expired queued call: [%s]: %s", handed.task_id, exc
            )
    if ended is not None:
        logger.info(
            "singleton: queued call already ended, passed over: %s[%s] key=%s state=%s",
            sig.task,
            handed.task_id,
            slot,
            ended,
        )
        _pass_over(task, slot, handed.task_id, "a queued call that ended")
        return
    headers = {**(sig.options.get("headers") or {}), QUEUED_HEADER: slot}
    try:
        sig.apply_async(headers=headers)
    except Exception as exc:  # its record goes back to the head of the line
        try:
            back = put_back(
                store_for(task.singleton_options().redis_url).run_script,
                slot,
                handed,
                QUEUE_KEEP_MS,
            )
        except LOGGED_ERRORS:
            back = False
        (logger.error if not back else logger.warning)(
            "singleton: could not publish the next queued call, %s: %s[%s] key=%s: %s",
            "put back at the head of the line" if back else "LOST",
            sig.task,
            handed.task_id,
            slot,
            exc,
        )
        return
    logger.info(
        "singleton: next queued call published after %s: %s[%s] key=%s",
        why,
        sig.task,
        handed.task_id,
        slot,
    )


def _record(task: Any, request: Any) -> bytes:
    """The call's message, as ``retry()`` would publish it again (task id, retries, links,
    chain, chord, route, ``argsrepr``/``kwargsrepr``), in the task's serializer (or the first
    of the app's ``accept_content`` that keeps it), behind a JSON line naming it."""
    sig = task.signature_from_request(request, **copy_options(request))
    fields = dict(sig)
    content_type, encoding, body = task_dumps(task, fields, _check_call)
    head = json.dumps({"ctype": content_type, "cenc": encoding}).encode()
    return head + b"\n" + (body if isinstance(body, bytes) else body.encode())


def _check_call(loaded: Any) -> None:
    if not isinstance(loaded, Mapping) or not loaded.get("task"):
        raise TypeError(f"not a call: {type(loaded).__name__}")


def _call_of(task: Any, record: bytes) -> dict[str, Any]:
    head, _, body = record.partition(b"\n")
    meta = json.loads(head)
    accept = prepare_accept_content(task.app.conf.accept_content)  # type: ignore[no-untyped-call]
    fields = loads(body, meta["ctype"], meta["cenc"], accept=accept)  # type: ignore[no-untyped-call]
    _check_call(fields)
    return dict(fields)


def _ended_as(task: Any, task_id: str) -> str | None:
    """The ready state a queued call ended in while it waited (revoked), else None."""
    try:
        current = task.backend.get_state(task_id)
    except Exception:  # no backend to read, or it failed: published as it is
        return None
    return current if current in states.READY_STATES else None


def _expired(expires: Any) -> bool:
    left = seconds_left(expires)
    return left is not None and left <= 0
