"""A beat tick whose cost grows with the runs that are due, not with the square of the schedule.

Celery's ``Scheduler.tick`` publishes one due entry per call and, at every call, first compares
the whole schedule with a copy of it (``schedules_equal``) and copies it: with ``n`` entries due
in the same minute, that minute costs ``n`` ticks of ``O(n)`` each. A tick of the singleton
scheduler instead takes every due event off the heap at once (:func:`pop_due`), and the
scheduler claims those runs in one round trip, publishes the ones it won and confirms them in
one more.

A change of schedule is noticed by :class:`ScheduleWatch`, without comparing the schedule whole
at every tick:

- Celery's own schedulers (``Scheduler``, ``PersistentScheduler``) and django-celery-beat's
  ``DatabaseScheduler`` are *tracked*: their schedule changes only through the scheduler's own
  methods (``add``, ``update_from_dict``, ``merge_inplace``; the mixin counts those calls) or by
  becoming another dict (the database scheduler builds a new one whenever its
  ``schedule_changed()`` says so, and every five minutes; a ``PersistentScheduler`` reads a new
  one from its shelve after each sync). The heap is rebuilt after an own-method edit; a new
  dict, or another length, is compared whole once, through the scheduler's ``schedules_equal``
  (the database scheduler's answers "changed" at once after a reload).
- Any other scheduler whose tick is Celery's (its own ``schedule`` property) is compared whole
  once per tick, as Celery does: a tick now handles every due entry, so that is one ``O(n)``
  comparison per due instant, not per due entry.

A scheduler with a tick of its own (celery-redbeat's) keeps it; the mixin then claims each run
as that tick publishes it, one by one.

Knows Celery's beat (``celery.beat``), never redis: the claims are the scheduler's business.
"""

from __future__ import annotations

import copy
import heapq
from collections.abc import Mapping
from typing import Any

from celery.beat import PersistentScheduler, Scheduler, event_t
from celery.utils.functional import is_numeric_value

__all__ = [
    "Due",
    "ScheduleWatch",
    "base_tick_is_celerys",
    "next_delay",
    "pop_due",
    "push_next",
    "tracked_schedule",
]

#: A due event taken off the heap: the event, its entry and the delay to its next run.
Due = tuple[Any, Any, Any]


def base_tick_is_celerys(cls: type, mixin: type) -> bool:
    """Whether the scheduler class behind ``mixin`` in ``cls`` ticks with Celery's tick."""
    mro = cls.__mro__
    for base in mro[mro.index(mixin) + 1 :]:
        if "tick" in base.__dict__:
            return base.__dict__["tick"] is Scheduler.__dict__["tick"]
    return False


def tracked_schedule(cls: type) -> bool:
    """Whether ``cls``'s schedule is Celery's own (a dict changed only by its methods)."""
    schedule = getattr(cls, "schedule", None)
    return schedule in (Scheduler.__dict__["schedule"], PersistentScheduler.__dict__["schedule"])


class ScheduleWatch:
    """Notices a change of a scheduler's schedule (see the module's docstring) and rebuilds
    the scheduler's heap then."""

    def __init__(self) -> None:
        self._seen: object = None
        self._length = -1
        self._edits = -1

    def refresh(self, sched: Any, schedule: Mapping[str, Any], edits: int, tracked: bool) -> bool:
        """Rebuild ``sched``'s heap if ``schedule`` (what ``sched.schedule`` gave this tick)
        changed; True if it was rebuilt. ``edits``: how many own-method edits ``sched`` saw."""
        if sched._heap is None or edits != self._edits:
            changed = True
        elif not tracked or schedule is not self._seen or len(schedule) != self._length:
            changed = not sched.schedules_equal(sched.old_schedulers, schedule)
        else:
            changed = False
        if changed:
            sched.old_schedulers = copy.copy(schedule)
            sched.populate_heap()
        self._seen, self._length, self._edits = schedule, len(schedule), edits
        return changed


def pop_due(sched: Any) -> list[Due]:
    """Take every event whose time has come off ``sched``'s heap; return the due ones.

    Each is asked ``sched.is_due`` as Celery's tick asks the top of the heap. An entry whose
    time has come but that asks to be retried later goes back at that time (Celery's tick does
    the same, one entry per call). Due events are not pushed back here: the caller reserves
    each and pushes its next run (:func:`push_next`).
    """
    heap = sched._heap
    due: list[Due] = []
    later: list[Any] = []
    while heap:
        event = heap[0]
        entry = event[2]
        if event[0] > sched._when(entry, 0):
            break
        heapq.heappop(heap)
        try:
            is_due, next_time_to_run = sched.is_due(entry)
        except Exception:
            is_due, next_time_to_run = sched._is_due_failed(entry)
        if is_due:
            due.append((event, entry, next_time_to_run))
        else:
            delay = next_time_to_run if is_numeric_value(next_time_to_run) else sched.max_interval
            later.append(event_t(sched._when(entry, delay), event[1], entry))
    for event in later:
        heapq.heappush(heap, event)
    return due


def push_next(sched: Any, due: Due, next_entry: Any) -> None:
    """Put the next run of a due event's entry (``next_entry``, from ``reserve``) on the heap."""
    event, _entry, next_time_to_run = due
    heapq.heappush(
        sched._heap, event_t(sched._when(next_entry, next_time_to_run), event[1], next_entry)
    )


def next_delay(sched: Any) -> float:
    """How long until the event at the top of ``sched``'s heap (at most ``max_interval``)."""
    heap = sched._heap
    if not heap:
        return float(sched.max_interval)
    top = heap[0]
    return float(max(min(top[0] - sched._when(top[2], 0), sched.max_interval), 0.0))
