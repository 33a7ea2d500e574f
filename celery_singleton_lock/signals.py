"""The library's own signals, sent for every lock event.

Connect like any Celery signal::

    from celery_singleton_lock import signals

    @signals.duplicate_skipped.connect
    def on_skip(sender, key, task_id, holder, **kwargs):
        ...

``sender`` is the task (``None`` where no task is at hand). Every signal carries ``key``
and ``task_id``; the others carry what the table in docs/configuration.md lists.
Receivers run in the process where the event happened: the pool child (or the solo or
threads worker), the renewer's thread for ``lock_lost``, ``lock_max_hold`` and
``lock_renewed_late``, the worker's main process for releases after a lost child, a hard
time limit or a terminate, and the ``celery singleton`` command's process for
``lock_force_released`` (and for the ``duplicate_skipped`` of a coalesced follow-up superseded
by the newer run whose lock it released: duplicates/coalesce.py).
"""

from __future__ import annotations

from celery.utils.dispatch import Signal

__all__ = [
    "call_debounced",
    "duplicate_joined",
    "duplicate_not_published",
    "duplicate_queued",
    "duplicate_raised",
    "duplicate_retried",
    "duplicate_skipped",
    "lock_acquired",
    "lock_force_released",
    "lock_lost",
    "lock_max_hold",
    "lock_released",
    "lock_renewed_late",
    "lock_unavailable",
    "queue_full",
    "rate_limited",
    "redelivery_dropped",
    "stop_asked",
]

lock_acquired = Signal(name="singleton_lock_acquired")
lock_released = Signal(name="singleton_lock_released")
lock_unavailable = Signal(name="singleton_lock_unavailable")
lock_lost = Signal(name="singleton_lock_lost")
lock_renewed_late = Signal(name="singleton_lock_renewed_late")
lock_force_released = Signal(name="singleton_lock_force_released")
lock_max_hold = Signal(name="singleton_lock_max_hold")
duplicate_skipped = Signal(name="singleton_duplicate_skipped")
duplicate_retried = Signal(name="singleton_duplicate_retried")
duplicate_raised = Signal(name="singleton_duplicate_raised")
duplicate_joined = Signal(name="singleton_duplicate_joined")
duplicate_queued = Signal(name="singleton_duplicate_queued")
queue_full = Signal(name="singleton_queue_full")
stop_asked = Signal(name="singleton_stop_asked")
duplicate_not_published = Signal(name="singleton_duplicate_not_published")
redelivery_dropped = Signal(name="singleton_redelivery_dropped")
rate_limited = Signal(name="singleton_rate_limited")
call_debounced = Signal(name="singleton_call_debounced")
