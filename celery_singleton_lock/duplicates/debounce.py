"""``singleton_debounce=S``: a burst of calls of a key runs once, S seconds after its last
call, with that call's arguments (``singleton_debounce_max=M``: at the latest M seconds after
its first call).

Decided on the worker, in front of the lock (task/tracer.py), so ``delay``, ``send_task``,
canvas and beat messages are all debounced. A call's message, when it arrives:

1. tells the key's debounce state that it is its burst's latest call (core/debounce.py
   ``debounce.lua``: one round trip), and learns how long to wait;
2. publishes a copy of its own message due then (the same task id, retries and canvas,
   duplicates/copies.py; header :data:`DEBOUNCE_HEADER`), and ends acknowledged, nothing
   stored: the call waits as a countdown message, in no worker slot.

The copy, when it comes due, asks again: still the latest, it goes on to take the lock and
runs as any call (the key's duplicate policy applies if another run holds it); a later call
came, it ends as a skipped duplicate whose ``skip_info()`` names that call
(``superseded_by``), and its canvas stops as a skip's does. A copy whose state expired waits
again. A retry of a run (``self.retry()``), a coalesced follow-up, a joined call's watch copy
(duplicates/join.py: its call was debounced before it joined, and a newer burst must not end it
while the run it joined still counts it) and an eager call are not debounced. Redis down at
the decision: ``singleton_on_redis_error`` ("fail": the message is published again after
``retry_countdown``; "run": it goes on to the lock at once).
"""

from __future__ import annotations

from typing import Any

from celery.app.task import Context

from .. import signals
from ..core.connection import store_for
from ..core.debounce import Verdict, debounce
from ..core.keys import LockKeys
from ..run.log import LOGGED_ERRORS, logger
from ..run.task_events import run_sink
from ..settings.options import Options
from .copies import DEBOUNCE_HEADER, JOINED_HEADER, is_follow_up, publish_copy
from .policy import WAIT, Action, Fate, Part, Why, modifier

__all__ = ["DEBOUNCE_HEADER", "Debounce", "debounced"]


class Debounce(Part):
    """A burst of calls of a key runs once, after its last call."""

    setting = "singleton_debounce"

    def applies(self, opts: Options) -> bool:
        return opts.debounce is not None or opts.debounce_max is not None

    def refuse(self, opts: Options) -> str | None:
        window, cap = opts.debounce, opts.debounce_max
        if cap is not None and (window is None or cap < window):
            return (
                f"singleton_debounce_max ({cap:g}) needs a singleton_debounce no longer than "
                f"it, got {window!r}"
            )
        if opts.lock_on != "execute":
            return (
                "singleton_debounce needs singleton_lock_on 'execute' (the latest call of a "
                f"burst must reach a worker), got {opts.lock_on!r}"
            )
        return None

    def before_lock(self, task: Any, keys: LockKeys, request: Any) -> Action | None:
        """Debounce the call: it waits as a copy of its message, or ends superseded by a later
        call of its burst (a skip naming it), or goes on to its lock (None)."""
        verdict = debounced(task, keys, request)
        if verdict is None or verdict.action == "run":
            return None
        if verdict.action == "wait":
            return WAIT
        return Action(Fate.SKIP, Why.SUPERSEDED, holder=str(verdict.by))


modifier(Debounce())


def debounced(task: Any, keys: LockKeys, request: Context) -> Verdict | None:
    """Debounce the current message of ``task`` (``request``, its Context, current).

    None or a ``"run"`` verdict: the call goes on to its lock now. ``"wait"``: its message is
    waiting as a copy; this delivery ends, acknowledged, nothing stored. ``"superseded"``: it
    ends as a skipped duplicate superseded by ``verdict.by``."""
    opts = task.singleton_options()
    if opts.debounce is None or is_follow_up(request) or request.get(JOINED_HEADER):
        return None
    retries = int(request.retries or 0)
    mark = request.get(DEBOUNCE_HEADER)
    if mark is None and retries:  # a retry of a run: its call was debounced already
        return None
    try:
        due = mark is not None
        if due and int(mark) != retries:  # a self.retry() of a burst's run
            return None
    except (TypeError, ValueError):  # not ours: never fail a run over a header
        return None
    try:
        verdict = debounce(
            store_for(opts.redis_url).run_script,
            keys,
            request.id,
            retries,
            due=due,
            window_s=opts.debounce,
            max_s=opts.debounce_max,
        )
    except LOGGED_ERRORS as exc:
        return _redis_down(task, keys, request, exc)
    if verdict.action == "wait":
        return _wait(task, keys, request, verdict, again=due)
    if verdict.action == "run":
        logger.info(
            "singleton: debounced call runs: %s[%s] key=%s", task.name, request.id, keys.lock
        )
    return verdict


def _wait(
    task: Any, keys: LockKeys, request: Context, verdict: Verdict, *, again: bool
) -> Verdict | None:
    """Keep the call waiting as a copy of its message, due when ``verdict`` says."""
    try:
        publish_copy(task, request, verdict.countdown, {DEBOUNCE_HEADER: int(request.retries or 0)})
    except Exception as exc:  # its message must stay somewhere: it runs now instead
        logger.warning(
            "singleton: could not keep debounced call's message, runs now: %s[%s] key=%s: %s",
            task.name,
            request.id,
            keys.lock,
            exc,
        )
        return None
    (logger.warning if again else logger.info)(
        "singleton: debounce state gone, waits again, runs in %ss unless called again: "
        "%s[%s] key=%s calls=%d"
        if again
        else "singleton: debounced, runs in %ss unless called again: %s[%s] key=%s calls=%d",
        round(verdict.countdown, 3),
        task.name,
        request.id,
        keys.lock,
        verdict.calls,
    )
    signals.call_debounced.send(
        sender=task,
        key=keys.lock,
        task_id=request.id,
        countdown=verdict.countdown,
        calls=verdict.calls,
    )
    send_events = run_sink(task, request)
    if send_events is not None:  # Flower: DEBOUNCED (not STARTED) until its copy comes due
        fields = {"key": keys.lock, "countdown": verdict.countdown, "calls": verdict.calls}
        send_events([("task-debounced", request.id, fields)])
    return verdict


def _redis_down(task: Any, keys: LockKeys, request: Context, error: Exception) -> Verdict | None:
    """Redis failed at the decision: by ``singleton_on_redis_error``."""
    opts = task.singleton_options()
    if opts.on_redis_error != "run":
        countdown = opts.retry_countdown
        try:
            publish_copy(task, request, countdown)
        except Exception:  # the broker too: the lock's own acquire decides, by the same policy
            countdown = None
        else:
            logger.error(
                "singleton: redis error on debounce, retrying in %ss: %s[%s] key=%s: %s",
                countdown,
                task.name,
                request.id,
                keys.lock,
                error,
            )
            return Verdict("wait", countdown)
    logger.error(
        "singleton: redis error on debounce, not debounced: %s[%s] key=%s: %s",
        task.name,
        request.id,
        keys.lock,
        error,
    )
    return None
