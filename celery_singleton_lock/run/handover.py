"""The retry hand-over: ``self.retry()`` hands the run's lock to the retried message, once
Celery has published it.

``SingletonTask.retry`` is :func:`retry_handing_over`. The lock's
owner is the task id and its generation the retries count, so the retried message (the same
id, one more retry) takes the lock over when it comes (``acquire.lua``); until then the lock is
stretched over the countdown, so nothing slips in between. A retry Celery refuses
(``max_retries`` used up, ``autoretry_for``'s last try) or cannot publish hands nothing over:
the run still holds its lock, and its end releases it (docs/internals.md, "self.retry()").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timezone
from typing import Any

from celery.exceptions import Retry

from ..errors import LockUnavailableError
from .callrepr import copy_options
from .handle import LockHandle, handle_of
from .log import logger

__all__ = ["hand_over", "retry_handing_over"]


def retry_handing_over(  # noqa: PLR0917 - Celery's signature, after the task and its retry
    task: Any,
    celery_retry: Callable[..., Any],
    args: Sequence[Any] | None = None,
    kwargs: Mapping[str, Any] | None = None,
    exc: BaseException | None = None,
    throw: bool = True,
    eta: datetime | None = None,
    countdown: float | None = None,
    max_retries: int | None = None,
    **options: Any,
) -> Any:
    """Celery's retry (``celery_retry``, the task's own); once Celery has published the retried
    message, the lock is handed over to it. A retry Celery refuses (``max_retries`` used up) or
    cannot publish hands nothing over: the run still holds its lock, and its end releases it.
    The same call is published shown as its caller had Celery show it (Celery's own retry drops
    ``argsrepr``/``kwargsrepr``; not for new arguments, which they would not describe)."""
    if args is None and kwargs is None:
        options = {**copy_options(task.request), **options}
    handle = handle_of(task.request)
    held, renewer = handle._held, handle._renewer
    if not handle.held or held is None or renewer is None or task.request.is_eager:
        return celery_retry(args, kwargs, exc, throw, eta, countdown, max_retries, **options)
    renewer.remove(held)  # once published, the retried message may take the lock over
    try:
        ret = celery_retry(args, kwargs, exc, throw, eta, countdown, max_retries, **options)
    except Retry as published:
        if published.sig is None:  # not published (called directly): nothing to hand over
            renewer.add(held)
        else:
            hand_over(task, handle, published.when)
        raise
    except BaseException:  # refused, or the publish failed: the run still holds its lock
        renewer.add(held)
        raise
    hand_over(task, handle, ret.when)  # throw=False: published, the body goes on
    return ret


def hand_over(task: Any, handle: LockHandle, when: datetime | float | None) -> None:
    """Stop renewing and stretch the lock over the countdown of the retry Celery published
    (``when``: its eta or countdown)."""
    held, renewer = handle._held, handle._renewer
    assert held is not None
    assert renewer is not None
    delay = _seconds_until(when)
    ttl_ms = round((max(delay, 0.0) + task.singleton_options().ttl) * 1000)
    handle._handed_over = True  # the run's end (retry(throw=False)) must not release it
    try:
        renewer.hand_over(held, ttl_ms)
    except LockUnavailableError as exc:
        logger.warning("singleton: could not extend lock for retry: key=%s: %s", held.key, exc)
    logger.debug(
        "singleton: handing over to retry in %ss: %s[%s] key=%s",
        delay,
        task.name,
        held.owner,
        held.key,
    )


def _seconds_until(when: datetime | float | None) -> float:
    """Seconds until a retry's ``when`` (Celery's ``Retry.when``: an eta, or a countdown)."""
    if when is None:
        return 0.0
    if isinstance(when, datetime):
        now = datetime.now(timezone.utc) if when.tzinfo else datetime.now()
        return (when - now).total_seconds()
    return float(when)
