"""What a run's lock reports from the renewer: released, lost, past max hold, renewed late,
renewal failed. Fixed log lines (docs/configuration.md, "Log lines") and the library's signals;
:func:`configure_renewer` hands these callbacks to a process's renewer once.

A line about one run goes through the task logger (run/log.py) with that run's name and id as
``extra``: the renewer reports from its own thread, where no run is current, and a release made
in the run's thread names the same run. A renewal that failed for a batch names no run and is
logged as ``celery_singleton_lock.run.events``.
"""

from __future__ import annotations

import logging

from .. import signals
from ..core.backend import ReleaseStatus, RenewStatus
from ..core.renewer import HeldLock, Renewer
from ..errors import LockUnavailableError
from .log import about
from .log import logger as task_logger

__all__ = ["configure_renewer", "on_released"]

logger = logging.getLogger(__name__)


def configure_renewer(renewer: Renewer) -> None:
    renewer.on_released = on_released
    renewer.on_lost = _on_lost
    renewer.on_max_hold = _on_max_hold
    renewer.on_error = _on_renew_error
    renewer.on_late = _on_late


def on_released(held: HeldLock, status: ReleaseStatus | LockUnavailableError, reason: str) -> None:
    """Log (and signal) what the release of a run's lock found."""
    task = held.context
    if status is ReleaseStatus.RELEASED:  # the run's path: no call for a line not logged,
        if task_logger.isEnabledFor(logging.DEBUG):  # nor for a signal nobody receives
            _log_run(logging.DEBUG, held, "singleton: released %s[%s] key=%s")
        if signals.lock_released.receivers:
            signals.lock_released.send(sender=task, key=held.key, task_id=held.owner, reason=reason)
    elif isinstance(status, LockUnavailableError):
        _log_run(
            logging.WARNING,
            held,
            "singleton: release failed, lock expires in its ttl: %s[%s] key=%s: %s",
            status,
        )
    elif not held.lost:
        _log_run(
            logging.WARNING, held, "singleton: lock was no longer ours at release: %s[%s] key=%s"
        )


def _on_lost(held: HeldLock, status: RenewStatus) -> None:
    reason = "taken" if status is RenewStatus.TAKEN else "gone"
    _log_run(
        logging.ERROR,
        held,
        "singleton: lock lost: %s[%s] key=%s token=%d reason=%s",
        held.token,
        reason,
    )
    signals.lock_lost.send(
        sender=held.context, key=held.key, task_id=held.owner, token=held.token, reason=reason
    )


def _on_max_hold(held: HeldLock) -> None:
    _log_run(
        logging.ERROR,
        held,
        "singleton: max hold reached, no longer renewing: %s[%s] key=%s held=%ss",
        held.max_hold_s,
    )
    signals.lock_max_hold.send(
        sender=held.context, key=held.key, task_id=held.owner, token=held.token
    )


def _on_late(held: HeldLock, left_s: float) -> None:
    _log_run(
        logging.WARNING,
        held,
        "singleton: lock renewed late: %s[%s] key=%s left=%.3fs ttl=%ss",
        left_s,
        held.ttl_ms / 1000,
    )
    signals.lock_renewed_late.send(
        sender=held.context, key=held.key, task_id=held.owner, token=held.token, left=left_s
    )


def _log_run(level: int, held: HeldLock, message: str, *more: object) -> None:
    """Log ``message`` about ``held``'s run: its task name, task id and key come first, and the
    line names that run in ``worker_task_log_format`` wherever it is logged from."""
    name = getattr(held.context, "name", "?")
    task_logger.log(
        level, message, name, held.owner, held.key, *more, extra=about(name, held.owner)
    )


def _on_renew_error(exc: LockUnavailableError) -> None:
    logger.warning("singleton: renewal failed, retrying: %s", exc)
