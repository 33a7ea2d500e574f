"""Catch-up: which of an entry's runs a beat publishes when it starts to watch the entry.

A beat instance publishes the runs that come due while it watches an entry. It starts to
watch when it starts, when it takes the lead (leader mode) and when Redis answers again after
an outage. Runs whose nominal time passed before that, and that no beat published, were
*missed*: every beat was down, or none could reach Redis. Which of them it publishes at once
is the entry's catch-up choice (``singleton_beat_catch_up``, or the entry's message header of
that name):

``"none"``
    none of them: the entry's next run comes on time;
``"latest"``
    the latest of them, once, at once;
a number of seconds
    each of them whose nominal time lies within that long before now, oldest first (at most
    :data:`CATCH_UP_MAX`, the latest).

Which runs were missed is read from the entry's record in Redis (claims.py), which the beats
keep together, never from a beat's local schedule file: the same on a beat that kept its
file and on one that starts on an empty disk. An entry without a record (new, or not run for
longer than the record is kept) missed nothing. A run whose nominal time came at most
:func:`grace` before the beat started to watch is not missed but due: it is published whatever
the choice, as the beat that was about to publish it would have.

Pure: reads no clock and no Redis.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, Final

from ..errors import SingletonConfigError
from ..settings.table import SETTINGS
from .schedules import recent_runs

__all__ = [
    "CATCH_UP_HEADER",
    "CATCH_UP_MAX",
    "CatchUp",
    "OnSight",
    "catch_up_of",
    "grace",
    "runs_on_sight",
]

#: The message header an entry sets in its options to override the app's catch-up choice:
#: ``options={"headers": {"singleton_beat_catch_up": "none"}}`` (django-celery-beat's
#: entries carry it in their headers too).
CATCH_UP_HEADER: Final = "singleton_beat_catch_up"
#: The most missed runs of one entry published when a beat starts to watch it (the latest).
CATCH_UP_MAX: Final = 1000

_MS: Final = timedelta(milliseconds=1)
_EPOCH: Final = datetime(1970, 1, 1, tzinfo=timezone.utc)


@dataclass(frozen=True)
class CatchUp:
    """A checked catch-up choice: ``"none"``, ``"latest"`` or a window in seconds."""

    choice: str | float

    @property
    def reach_s(self) -> float:
        """How far back the choice can reach (an entry's record is kept at least this long)."""
        return 0.0 if isinstance(self.choice, str) else float(self.choice)

    def __str__(self) -> str:
        return self.choice if isinstance(self.choice, str) else f"{self.choice:g}s"


@dataclass(frozen=True)
class OnSight:
    """The runs a beat publishes as it starts to watch an entry (nominal times, oldest
    first): the ``missed`` runs its catch-up picks (``capped``: more were missed within its
    window than :data:`CATCH_UP_MAX`), and the run ``due`` now, if any."""

    missed: list[datetime]
    due: list[datetime]
    capped: bool = False


def catch_up_of(options: Mapping[str, Any] | None, default: str | float) -> tuple[CatchUp, str]:
    """An entry's catch-up choice: its header :data:`CATCH_UP_HEADER` in ``options`` (an
    entry's options) if it has one, else ``default`` (the app's). The second item is why the
    header was not used ("" when it was, or there is none): then the app's choice applies."""
    headers = (options or {}).get("headers") or {}
    if not isinstance(headers, Mapping) or CATCH_UP_HEADER not in headers:
        return CatchUp(default), ""
    check = SETTINGS["beat_catch_up"].check
    try:
        return CatchUp(check(CATCH_UP_HEADER, headers[CATCH_UP_HEADER])), ""
    except SingletonConfigError as exc:
        return CatchUp(default), str(exc)


def _s(seconds: float) -> timedelta:
    return timedelta(seconds=seconds)


def grace(skew_s: float) -> float:
    """How long after its nominal time a run is still due, not missed, when a beat starts to
    watch its entry: the clock difference allowed between beats, at least a second."""
    return max(skew_s, 1.0)


def runs_on_sight(
    sched: Any,
    catch_up: CatchUp,
    through_ms: int | None,
    now: datetime,
    grace_s: float,
    *,
    deadline_s: float | None = None,
) -> OnSight:
    """The runs of ``sched`` a beat publishes as it starts to watch the entry at ``now``.

    ``through_ms``: the entry's record's ``through`` (its runs up to that nominal time, epoch
    ms, are accounted for); None for an entry without a record, which missed nothing. A run
    not after ``through_ms`` is never published again. The run due is the one whose nominal
    time lies within ``grace_s`` before ``now``; the missed ones lie before it, and no more
    than ``deadline_s`` before ``now`` if given (Celery's ``beat_cron_starting_deadline``, for
    a crontab).
    """
    due_since = now - timedelta(seconds=grace_s)
    if through_ms is None:
        return OnSight([], recent_runs(sched, now, due_since, 1))
    since = _EPOCH + timedelta(milliseconds=through_ms) + _MS
    due_since = max(since, due_since)
    due = recent_runs(sched, now, due_since, 1) if due_since <= now else []
    if catch_up.choice == "none":
        return OnSight([], due)
    until = now - timedelta(seconds=grace_s) - _MS
    reach = since if catch_up.choice == "latest" else max(since, now - _s(catch_up.reach_s))
    if deadline_s is not None:
        reach = max(reach, now - _s(deadline_s))
    if until < reach:
        return OnSight([], due)
    limit = 1 if catch_up.choice == "latest" else CATCH_UP_MAX
    missed = recent_runs(sched, until, reach, limit + 1)
    capped = len(missed) > limit
    return OnSight(sorted(missed[:limit]), due, capped and catch_up.choice != "latest")
