"""The gate: the one place a run's lock is taken, and the one function that decides what a call
does when it does not get it.

Every path of a call goes through here: a worker's run, in front of Celery's tracer
(task/tracer.py); an eager ``apply()`` or a direct call, in ``before_start``
(task/start.py); and the worker's main process, which asks the same question of a read-only
probe (worker/mainskip.py).

- :func:`take` makes the acquire (the run's one blocking round trip); while the run that
  published this message (a chain step, a link callback) still holds the key, it tries again a
  few times (:data:`PARENT_WAITS`): that run lets go in a moment.
- :func:`decide` is pure: from the acquire's outcome, what the call is (:class:`Call`) and the
  task's settings and policy, it returns an :class:`Action`. It makes no round trip and logs
  nothing (tests/unit/test_gate.py asks it directly). What is not the policy's to answer is
  answered here, the same for every policy: the lock taken (it runs), Redis down
  (``singleton_on_redis_error``), a message that already ran to its end (dropped), a message
  whose own earlier delivery or parent holds the key (not a duplicate: requeued until that lets
  go), and a run's own retry over the rate limit (requeued to the next allowed start). The
  rest is its policy's (duplicates/policy.py).
- :func:`abandon` gives back a lock taken for a run that never started.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..core._pid import current_pid
from ..core.backend import Acquired, Completed, Contended, RateLimited, release_lost_slot
from ..core.connection import renewer_for, store_for
from ..core.keys import LockKeys
from ..core.renewer import Renewer
from ..errors import LockUnavailableError
from ..run.callrepr import preview_of, request_field
from ..run.events import configure_renewer
from ..run.log import logger
from ..settings.options import Options
from .copies import FOLLOW_UP_HEADER, WAITING_HEADER, is_follow_up, waiting_since
from .policy import DROP, RUN, Action, Call, Fate, Policy, Why, parts_of
from .retry import RetryPolicy

__all__ = [
    "PARENT_WAITS",
    "Outcome",
    "abandon",
    "call_of",
    "decide",
    "meta_of",
    "take",
    "worker_call",
]

#: Pauses (seconds) between the tries of a message whose lock is held by the run that published
#: it (a chain step, a link callback); after them it is requeued like a redelivered message.
PARENT_WAITS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16)

#: What asking for the lock gave: the lock, another's, or the Redis error.
Outcome = Acquired | Contended | LockUnavailableError


def call_of(request: Any) -> Call:
    """The :class:`Call` of a Celery request: a Context, or the dict a worker's tracer gets
    (both have ``get``); the library's headers are read only when there."""
    get = request.get
    return Call(
        get("id") or "",
        get("parent_id"),
        int(get("retries") or 0),
        bool(get("is_eager")),
        (get(FOLLOW_UP_HEADER) is not None or get("headers") is not None) and is_follow_up(request),
        get(WAITING_HEADER) is not None and waiting_since(request) is not None,
    )


def worker_call(task_id: str, generation: int, request: dict[str, Any]) -> Call:
    """The :class:`Call` of a worker's request dict (in front of Celery's tracer, or in the
    worker's main process), whose task id and retries count its caller has read already: never
    eager, and the library's headers are fields of the dict itself."""
    return Call(
        task_id,
        request.get("parent_id"),
        generation,
        False,
        FOLLOW_UP_HEADER in request and is_follow_up(request),
        WAITING_HEADER in request and waiting_since(request) is not None,
    )


def decide(outcome: Outcome, call: Call, opts: Options, policy: Policy) -> Action:
    """What ``call`` does after asking for its lock: pure, no round trip, nothing logged."""
    kind = type(outcome)
    if kind is Acquired:
        return RUN
    if kind is Contended and outcome.holder not in (call.task_id, call.parent_id):  # type: ignore[union-attr]
        return policy.on_contended(call, outcome, opts)  # type: ignore[arg-type]
    if not isinstance(outcome, Contended):  # Redis could not be asked
        if opts.on_redis_error == "run":
            return Action(Fate.RUN_UNLOCKED, Why.REDIS)
        return Action(Fate.REQUEUE, Why.REDIS, opts.retry_countdown)
    if isinstance(outcome, Completed):
        return DROP
    if isinstance(outcome, RateLimited):
        if call.retries and not call.eager:  # its own retry: a run going on, never dropped
            wait = outcome.pttl_ms / 1000
            return Action(Fate.REQUEUE, Why.RATE, wait, outcome.holder, policy=RetryPolicy.name)
        return policy.over_rate(call, outcome, opts)
    if outcome.holder in (call.task_id, call.parent_id):
        # Its own earlier delivery (an acks_late redelivery), or the run that published it (a
        # chain's next step, a link callback, a call from the body): not a duplicate, and
        # skipping it would drop the run. It waits until the holder releases, or its lock
        # expires because the holder is dead.
        countdown = max(outcome.pttl_ms, 0) / 1000 + 0.1
        if not outcome.finished:  # a window ends at its pttl; a running holder may end sooner
            countdown = min(opts.retry_countdown or 1.0, countdown)
        why = Why.REDELIVERED if outcome.holder == call.task_id else Why.PARENT
        return Action(Fate.REQUEUE, why, countdown, outcome.holder, policy=RetryPolicy.name)
    return policy.on_contended(call, outcome, opts)


def meta_of(
    task: Any, args: Sequence[Any], kwargs: Mapping[str, Any], request: Any
) -> dict[str, str]:
    """What the lock hash tells about its holder (``celery singleton show``); ``request`` is the
    run's (a Context, or the dict a worker's tracer gets): its arguments are shown as the caller
    has Celery show them (run/callrepr.py)."""
    return {
        "task": task.name,
        "host": str(request_field(request, "hostname") or socket.gethostname()),
        "pid": str(current_pid()),
        "args": preview_of(request, args, kwargs),
    }


def renewer_of(opts: Options) -> Renewer:
    """This process's renewer for a task's lock store: it takes, renews and releases."""
    return renewer_for(opts.redis_url, configure_renewer)


def take(  # noqa: PLR0917 - the task, the call, and how to wait
    task: Any,
    keys: LockKeys,
    task_id: str,
    generation: int,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    request: Any,
    opts: Options,
    sleep: Callable[[float], None],
) -> tuple[Outcome, Renewer]:
    """Ask for the lock of a call (``request``: a Context, or the dict a worker's tracer gets),
    as its task id and retries count (``generation``): the outcome, and the renewer that
    asked. Redis's error is an outcome; a SystemExit (a revoke's SIGTERM) while the reply was on
    its way gives back whatever was taken, and goes on."""
    renewer = renewer_of(opts)
    meta = meta_of(task, args, kwargs, request)
    try:
        outcome: Outcome = renewer.acquire(keys, task_id, generation, opts.ttl_ms, meta)
        if (  # the run that published it holds the key: it lets go in a moment
            type(outcome) is Contended
            and (parent := request.get("parent_id")) is not None
            and outcome.holder == parent
        ):
            for delay in PARENT_WAITS:
                sleep(delay)
                outcome = renewer.acquire(keys, task_id, generation, opts.ttl_ms, meta)
                if not (isinstance(outcome, Contended) and outcome.holder == parent):
                    break
    except LockUnavailableError as exc:
        outcome = exc
    except BaseException:  # the lock may be ours: freed
        abandon(task, keys, task_id, generation, None, opts)
        raise
    return outcome, renewer


def abandon(  # noqa: PLR0917 - the lock, and whose
    task: Any,
    keys: LockKeys,
    task_id: str,
    generation: int,
    slot: int | None,
    opts: Options,
) -> None:
    """Release a lock (permit ``slot``; None: whichever slot is the run's, if any) taken for a
    run that Celery's tracer ended before ``before_start``, or whose acquire a SystemExit
    interrupted; then the policy's :meth:`~.policy.Policy.after_release` (coalesce publishes
    the follow-up a duplicate left meanwhile)."""
    if not keys.permits:  # a rate alone: a run holds no lock
        return
    key = keys.lock if slot is None else keys.slot(slot)
    store = store_for(opts.redis_url)
    try:
        if slot is None:  # owner-checked, slot by slot: another run's is left alone
            key, _ = release_lost_slot(store, keys, task_id, generation, 0)
        else:
            store.release(key, task_id, generation)
    except LockUnavailableError as exc:
        logger.warning(
            "singleton: could not release lock of a run that did not start, "
            "it expires in its ttl: %s[%s] key=%s: %s",
            task.name,
            task_id,
            key,
            exc,
        )
        return
    parts_of(opts).policy.after_release(task, keys, "a run that did not start")
