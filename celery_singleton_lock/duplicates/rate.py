"""What a run over its key's rate limit (``singleton_rate_limit``, core/rates.py) meets: the
key's duplicate policy, with the moment the next start is allowed.

- ``skip``: ends skipped; :func:`~.skips.skip_info` says ``reason="rate"`` and ``next_start``.
- ``retry`` and ``join`` (over the rate no run of a one-permit key is going: the lock was free):
  requeued to the moment the oldest start leaves the window, not polled.
- ``raise``: fails with :class:`~celery_singleton_lock.errors.RateLimitedError`.
- ``coalesce``: the first call over the rate is requeued to the next allowed moment and is the
  key's one follow-up (``{prefix}{tag}:rate_next`` names it until then); the calls over the rate
  after it end skipped, naming it. A follow-up (or any message the library requeued) is never
  dropped: over the rate again at its moment, it is requeued again.

A message its own task retried (``self.retry()``, ``autoretry_for``: a retries count above 0)
is a run going on, not a new call: over the rate it waits like ``retry`` whatever the policy.

An eager call (``apply()``) cannot be requeued: ``retry``, ``join`` and ``coalesce`` raise
there.
"""

from __future__ import annotations

import time
from typing import Any, NoReturn

from .. import signals
from ..core._wire import as_text
from ..core.backend import RateLimited
from ..core.connection import store_for
from ..core.keys import LockKeys, beside
from ..errors import RateLimitedError
from ..run.log import LOGGED_ERRORS, logger
from ..settings.options import Options
from .coalesce import is_follow_up
from .skips import Skipped

__all__ = ["NEXT_START", "over_rate", "rate_skips", "rate_text", "report_rate_skip"]

#: The request field of a run skipped for the rate: when the next start is allowed (epoch s).
NEXT_START = "_singleton_next_start"

_PERIOD_NAMES = {1000: "s", 60_000: "m", 3_600_000: "h"}


def rate_text(rate: tuple[int, int]) -> str:
    """A rate as it was given: ``(5, 1000)`` is ``"5/s"``."""
    limit, period_ms = rate
    return f"{limit}/{_PERIOD_NAMES.get(period_ms, f'{period_ms}ms')}"


def over_rate(  # noqa: PLR0917 - the run, what it met, and whether it was requeued
    task: Any,
    opts: Options,
    keys: LockKeys,
    held: RateLimited,
    task_id: str,
    requeued: bool = False,
) -> NoReturn:
    """Deal with a run over its key's rate by the key's policy (``task`` a SingletonTask in its
    ``before_start``); raises Retry, :class:`Skipped` or :class:`RateLimitedError`.
    ``requeued``: the message was requeued by the library (coalesce's follow-up coming back
    at its moment, or a duplicate waiting): under coalesce it is requeued again, never
    skipped."""
    request = task.request
    wait = held.pttl_ms / 1000
    assert keys.rate is not None
    error = RateLimitedError(
        f"{task.name}[{task_id}] is over the rate limit {rate_text(keys.rate)} of {keys.lock}: "
        f"the next start is allowed in {wait:g}s",
        key=keys.lock,
        task_id=task_id,
        holder=held.holder,
    )
    policy = opts.on_duplicate
    if request.retries and not request.is_eager:  # its own retry (self.retry, autoretry_for):
        policy = "retry"  # the run goes on at the next allowed start, never dropped
    if policy == "coalesce" and not request.is_eager:
        again = requeued or is_follow_up(request)  # a follow-up already: never dropped
        follow_up = task_id if again else _follow_up(task, opts, keys, held)
        if follow_up == task_id:  # this call is the key's one follow-up: at the next start
            policy = "retry"
        else:
            _skip(task, keys, held, task_id, follow_up)
    if policy in ("retry", "join") and not request.is_eager:
        _report(task, keys, held, task_id, policy, wait)
        logger.info(
            "singleton: over the rate limit, retried in %ss: %s[%s] key=%s",
            round(wait, 3),
            task.name,
            task_id,
            keys.lock,
        )
        task._singleton_requeue(wait, error)
    if policy == "skip":
        _skip(task, keys, held, task_id, None)
    _report(task, keys, held, task_id, "raise", None)
    logger.info(
        "singleton: over the rate limit, raised: %s[%s] key=%s next_start_in=%ss",
        task.name,
        task_id,
        keys.lock,
        round(wait, 3),
    )
    raise error


def _follow_up(task: Any, opts: Options, keys: LockKeys, held: RateLimited) -> str:
    """The key's follow-up at its next allowed start: this run's task id when there is none
    yet (it is one now, until that moment), else the one there is. This run's when Redis
    cannot be asked: requeued, never dropped."""
    task_id: str = task.request.id
    key = beside(keys.lock, "rate_next")
    try:
        found = store_for(opts.redis_url).client.set(
            key, task_id, nx=True, px=max(held.pttl_ms, 1), get=True
        )
    except LOGGED_ERRORS as exc:
        logger.warning(
            "singleton: could not coalesce a run over the rate limit, retried: %s[%s] key=%s: %s",
            task.name,
            task_id,
            keys.lock,
            exc,
        )
        return task_id
    return task_id if found is None else as_text(found)  # type: ignore[arg-type]


def _skip(
    task: Any, keys: LockKeys, held: RateLimited, task_id: str, follow_up: str | None
) -> NoReturn:
    """End the run skipped in its ``before_start`` (as a duplicate's skip there)."""
    request = task.request
    setattr(request, NEXT_START, _next_start(held))
    if follow_up is not None:
        request._singleton_follow_up = follow_up
    marker = task._singleton_store_skip(keys, held.holder, task_id, request)
    task._singleton_report_skip(keys, held.holder, task_id)
    raise Skipped(marker)


def rate_skips(task: Any, outcome: Any, request: dict[str, Any]) -> bool:
    """Whether a worker's first acquire ends the run skipped for the rate at once, in front of
    Celery's tracer (as a duplicate's skip): over the rate under "skip", not its own retry.
    The next allowed start is noted on ``request`` for the marker."""
    if type(outcome) is not RateLimited or request.get("retries"):
        return False
    if (task._singleton_opts or task.singleton_options()).on_duplicate != "skip":
        return False
    request[NEXT_START] = _next_start(outcome)
    return True


def _next_start(held: RateLimited) -> float:
    """When the next start is allowed, on this process's clock (epoch seconds)."""
    return round(time.time() + held.pttl_ms / 1000, 3)


def report_rate_skip(  # noqa: PLR0917 - the run, and what it met
    task: Any, keys: LockKeys, holder: str, task_id: str, next_start: float, follow_up: str | None
) -> None:
    """A skip for the rate's one line and its signal."""
    wait = max(next_start - time.time(), 0.0)
    policy = "skip" if follow_up is None else "coalesce"
    _signal(task, keys, task_id, holder, policy, wait, None)
    logger.info(
        "singleton: over the rate limit, skipped: %s[%s] key=%s next_start_in=%ss follow_up=%s",
        task.name,
        task_id,
        keys.lock,
        round(wait, 3),
        follow_up,
    )


def _report(  # noqa: PLR0917 - the run, and what it met
    task: Any, keys: LockKeys, held: RateLimited, task_id: str, policy: str, countdown: float | None
) -> None:
    _signal(task, keys, task_id, held.holder, policy, held.pttl_ms / 1000, countdown)


def _signal(  # noqa: PLR0917 - the signal's fields
    task: Any,
    keys: LockKeys,
    task_id: str,
    holder: str,
    policy: str,
    next_start_in: float,
    countdown: float | None,
) -> None:
    """``rate_limited``, if anyone listens: the one send of every call over the rate."""
    if signals.rate_limited.receivers:
        signals.rate_limited.send(
            sender=task,
            key=keys.lock,
            task_id=task_id,
            holder=holder,
            policy=policy,
            next_start_in=next_start_in,
            countdown=countdown,
        )
