"""django-celery-beat's DatabaseScheduler with each scheduled run published by one instance.

``celery beat -S singleton-django``, or ``beat_scheduler =
"celery_singleton_lock.beat.SingletonDatabaseScheduler"``. This module imports
django_celery_beat, and so Django and the project's models: it is loaded only when a beat asks
for it, never by the rest of the package nor by a worker.

What it adds to the mixin in front of the database scheduler (docs/django.md):

- ``ModelEntry.is_due`` keeps deciding ``enabled``, ``start_time``, ``expires`` and
  ``one_off`` for interval entries too (the mixin stands in for the schedule only);
- an interval entry's first run is the first epoch-aligned slot that starts at or after its
  ``start_time``;
- a schedule change saved while the beat starts is picked up (upstream misses it for five
  minutes);
- a one-off entry (every clocked entry is one) is claimed once per enabling, under the
  ``last_run_at`` it had before it ran, not per nominal time: an instance that learns late
  that it ran (its schedule not reloaded yet) finds it claimed;
- a beat writes back only the columns it owns (:class:`SingletonModelEntry`): upstream reads
  the whole row and saves it whole, so an edit saved in between (the admin's, or another
  beat's) was lost.
"""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Any

from .scheduler import SingletonSchedulerMixin

try:
    from django.db import DatabaseError
    from django.utils import timezone
    from django_celery_beat.schedulers import DatabaseScheduler, ModelEntry
except ImportError as exc:  # pragma: no cover - the message is the point
    raise ImportError(
        "celery_singleton_lock.beat.SingletonDatabaseScheduler needs django-celery-beat "
        f"(pip install django-celery-beat): {exc}"
    ) from exc

__all__ = ["SingletonDatabaseScheduler", "SingletonModelEntry"]

logger = logging.getLogger(__name__)


class SingletonModelEntry(ModelEntry):  # type: ignore[misc]
    """django-celery-beat's ``ModelEntry``, writing only the columns a beat owns, in one UPDATE.

    Upstream's ``save`` (each sync, for every entry the beat ran) reads the row, sets the run
    state on it and saves the whole row; ``_disable`` (an expired entry) saves the whole row as
    the beat loaded it. An edit saved in between, in the admin or by another beat, was
    overwritten with the old values: with several beats syncing at every schedule change, most
    edits made in that moment were lost. Here both write their own columns and nothing else.
    A row disabled meanwhile is not written (upstream cleared its ``last_run_at``).
    """

    def save(self) -> None:
        model = self.model
        type(model)._default_manager.filter(pk=model.pk, enabled=True).update(
            last_run_at=model.last_run_at, total_run_count=model.total_run_count
        )

    def _disable(self, model: Any) -> None:
        model.no_changes = True  # as upstream: the other beats disable it at their own check
        model.enabled, model.last_run_at = False, None
        type(model)._default_manager.filter(pk=model.pk).update(enabled=False, last_run_at=None)


class SingletonDatabaseScheduler(SingletonSchedulerMixin, DatabaseScheduler):  # type: ignore[misc]
    """django-celery-beat's database scheduler, publishing each scheduled run once."""

    Entry = SingletonModelEntry
    #: its schedule is a new dict whenever it reloaded it from the database (ticks.py)
    singleton_schedule_tracked = True

    def setup_schedule(self) -> None:
        """django-celery-beat's, with the time of the last schedule change read first.

        Its own scheduler notes that time only at its first check after the initial read of the
        schedule, so a change saved in between (an edit in the admin while beat starts) is never
        seen as a change, until its full sync five minutes later. Noted before the read, any
        change after it is picked up at the next tick.
        """
        try:
            self._last_timestamp = self.Changes.last_change()
        except DatabaseError as exc:  # the first check reads it then, as upstream does
            logger.warning("beat: could not read the schedule's last change at start: %s", exc)
        super().setup_schedule()

    def singleton_not_before(self, entry: Any) -> datetime | None:
        """The entry's ``start_time``: no interval slot that starts before it runs.

        A naive one (``USE_TZ = False``) is read in Django's default timezone.
        """
        start: datetime | None = getattr(getattr(entry, "model", None), "start_time", None)
        if start is not None and timezone.is_naive(start):
            start = timezone.make_aware(start)
        return start

    def singleton_once(self, entry: Any) -> datetime | None:
        """A one-off entry's run, named by the ``last_run_at`` it had before it ran."""
        model = getattr(entry, "model", None)
        if model is None or not model.one_off:
            return None
        last_run_at: datetime | None = entry.last_run_at
        return last_run_at
