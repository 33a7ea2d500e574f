"""Nominal run instants of beat schedules: the same answer on every beat instance.

Several ``celery beat`` instances run side by side, each with its own state and its own clock.
When one finds an entry due it claims the run under the entry name plus the run's *nominal*
instant, so every instance must derive the same nominal instant for the same run from its own
clock, at the moment it fires (at or shortly after the run by its own clock). Pure module: it
imports Celery's schedule classes, never redis, and never reads the clock.

Interval schedules (:class:`celery.schedules.schedule`)
    Slots aligned to the Unix epoch, like cron: slot ``k`` is ``[k * interval, (k + 1) *
    interval)``. Times are taken on a whole-microsecond grid (the resolution of ``datetime``),
    so a boundary computed in floats (``0.3`` for a ``0.1`` s interval) still lands in its slot.
    Celery itself runs an interval ``run_every`` after each instance's own ``last_run_at``;
    instances only agree if they fire inside the same slot, so the scheduler must fire on the
    epoch grid.

Crontab (:class:`celery.schedules.crontab`), matching exactly as Celery 5.7 does
    - The five fields are combined with AND: a day runs only when its day of month, its month
      AND its day of week are all listed (``day_of_week`` 0 = Sunday, from
      ``isoweekday() % 7``). This is unlike Vixie cron, which ORs day of month and day of week
      when both are restricted: Celery's ``crontab(day_of_week=1, day_of_month="1-7")`` is
      "the first Monday", cron's ``0 0 1-7 * 1`` is "days 1-7 and every Monday".
    - Fields are read on the wall clock of the schedule's timezone (``sched.tz``, by default the
      app's ``timezone``), whatever the timezone of the ``now`` given.
    - Spring forward (a wall-clock gap): Celery builds the next run on the wall clock and keeps
      the ``fold`` of ``last_run_at`` (0), so a wall time inside the gap maps with the offset
      from before the gap, i.e. to the same wall time plus the gap length. ``30 2 * * *`` in
      Europe/Berlin runs at 03:30 CEST (01:30 UTC) on the spring-forward day, and nominal is that
      instant. Other wall times inside the gap that are not reached first (``*/20``: 02:20,
      02:40) are dropped by Celery.
    - Fall back (a repeated wall-clock hour): Celery runs only the FIRST occurrence (``fold=0``)
      and skips the whole repeated hour: ``30 1 * * *`` in America/New_York runs once, at
      01:30 EDT (05:30 UTC); ``*/20`` goes 01:40 EDT -> 02:00 EST. Both 01:30s are distinct real
      instants here, so a run fired in the second hour would get its own nominal instant.

Solar (:class:`celery.schedules.solar`)
    Computed with Celery's own observer (``sched.cal``, a copy of it) and ephem, like Celery.
    ephem's rising/setting search stops at 0.1 s and its result depends on the start of the
    search by tens of milliseconds, so the event is recomputed from a start that depends only on
    the event (the minute after the previous anti-transit) before it is rounded down to the
    whole second: instances on the same ephem version get the same float, not merely a close one.

Clocked (django-celery-beat's ``clocked``, recognised by its aware ``clocked_time``)
    Runs once, at ``clocked_time``: that instant is the nominal time, whenever an instance fires
    it (an instance that loads the entry later fires it late, under the same claim).

Cost: a crontab whose run is the current minute is answered at once; otherwise the search steps
back one real minute at a time, up to ``lookback`` (figures: docs/performance.md, "Figures
behind the code").
"""

from __future__ import annotations

import math
from collections.abc import Callable
from datetime import datetime, timedelta, timezone, tzinfo
from typing import Any, Final
from zoneinfo import ZoneInfo

from celery.schedules import BaseSchedule, crontab, schedule, solar

__all__ = [
    "EPOCH",
    "SOLAR_WINDOW",
    "crontab_matches",
    "interval_slot",
    "nominal_run",
    "recent_runs",
    "run_id",
    "slot_start",
]

#: The Unix epoch, aware UTC: interval slots and run ids count from it.
EPOCH: Final = datetime(1970, 1, 1, tzinfo=timezone.utc)
#: A solar run is the event nearest to ``now`` within this much either side.
SOLAR_WINDOW: Final = timedelta(hours=12)

_US: Final = timedelta(microseconds=1)
_MS: Final = timedelta(milliseconds=1)
_MINUTE: Final = timedelta(minutes=1)
_ZERO: Final = timedelta(0)
# Longest wall-clock gap looked for beyond the lookback (DST gaps are 30 min to 2 h).
_GAP_HORIZON: Final = timedelta(hours=3)
# Longest a canonical recomputation of a solar event may differ from the first estimate.
_SOLAR_TOLERANCE_S: Final = 10.0
# Events examined in a solar window (two fit in 24 h; twilight searches can skip circuits).
_SOLAR_MAX_STEPS: Final = 8


# --- interval schedules ---------------------------------------------------------------------


def _interval_us(interval_s: float) -> int:
    if isinstance(interval_s, bool) or not math.isfinite(interval_s):
        raise ValueError(f"interval must be a finite number of seconds, got {interval_s!r}")
    interval_us = round(interval_s * 1_000_000)
    if interval_us < 1:
        raise ValueError(f"interval must be at least 1 microsecond, got {interval_s!r}")
    return interval_us


def interval_slot(interval_s: float, now_epoch_s: float) -> int:
    """floor(now / interval): interval schedules are aligned to the Unix epoch, like cron.

    Both values are taken to the nearest microsecond first, so a boundary computed in floating
    point (``3 * 0.1``) falls in the slot it starts. Raises ValueError for an interval shorter
    than 1 microsecond or a non-finite value.
    """
    interval_us = _interval_us(interval_s)
    if isinstance(now_epoch_s, bool) or not math.isfinite(now_epoch_s):
        raise ValueError(f"now must be a finite number of seconds, got {now_epoch_s!r}")
    return round(now_epoch_s * 1_000_000) // interval_us


def slot_start(interval_s: float, slot: int) -> datetime:
    """The instant slot ``slot`` of an ``interval_s`` schedule starts, as an aware UTC datetime."""
    return EPOCH + timedelta(microseconds=slot * _interval_us(interval_s))


def _interval_nominal(sched: Any, now_utc: datetime) -> datetime | None:
    run_every = getattr(sched, "run_every", None)
    if not isinstance(run_every, timedelta):
        return None
    interval_us = run_every // _US
    if interval_us < 1:  # Celery runs a zero interval on every tick: there is no slot
        return None
    slot = ((now_utc - EPOCH) // _US) // interval_us
    return EPOCH + timedelta(microseconds=slot * interval_us)


# --- crontab ----------------------------------------------------------------------------------


def crontab_matches(sched: crontab, local_dt: datetime) -> bool:
    """Whether Celery's ``sched`` runs at the wall-clock minute of ``local_dt``.

    ``local_dt`` is read field by field (its tzinfo is ignored): pass it on the wall clock of the
    schedule's timezone. Seconds are ignored. Minute, hour, day of month, month and day of week
    must ALL be listed, as in Celery (no cron-style OR of day of month and day of week).
    """
    return bool(
        local_dt.minute in sched.minute
        and local_dt.hour in sched.hour
        and local_dt.day in sched.day_of_month
        and local_dt.month in sched.month_of_year
        and local_dt.isoweekday() % 7 in sched.day_of_week
    )


def _schedule_tz(sched: Any) -> tzinfo:
    tz = sched.tz  # the app's timezone unless the schedule carries its own
    if isinstance(tz, str):
        return ZoneInfo(tz)
    if not isinstance(tz, tzinfo):
        raise TypeError(f"schedule timezone must be a tzinfo or a name, got {tz!r}")
    return tz


def _offset(local: datetime) -> timedelta:
    offset = local.utcoffset()
    if offset is None:  # pragma: no cover - astimezone always gives an aware datetime
        raise ValueError(f"timezone of {local!r} gives no UTC offset")
    return offset


def _crontab_nominal(sched: Any, now_utc: datetime, lookback: timedelta) -> datetime | None:
    tz = _schedule_tz(sched)
    minutes: set[int] = sched.minute
    hours: set[int] = sched.hour
    days: set[int] = sched.day_of_month
    months: set[int] = sched.month_of_year
    weekdays: set[int] = sched.day_of_week

    def matches(wall: datetime) -> bool:
        return (
            wall.minute in minutes
            and wall.hour in hours
            and wall.day in days
            and wall.month in months
            and wall.isoweekday() % 7 in weekdays
        )

    top = now_utc - timedelta(seconds=now_utc.second, microseconds=now_utc.microsecond)
    local = top.astimezone(tz)
    if matches(local):  # the common case: fired within the minute of the run
        return top
    earliest = top - lookback
    # a gap is seen when the walk crosses its start: walk on a little past `earliest` so that a
    # gap holding `earliest` is seen too
    detect_until = earliest - _GAP_HORIZON
    later_offset = _offset(local)
    instant = top
    while True:
        instant -= _MINUTE
        local = instant.astimezone(tz)
        offset = _offset(local)
        if offset < later_offset:
            # The offset grows at `instant + 1 min`: a wall-clock gap. Celery maps a wall time
            # inside it with the offset from before the gap (fold=0), i.e. to one of the real
            # minutes [gap start, gap start + gap length), all later than `instant`.
            gap_start = instant + _MINUTE
            last = min(gap_start + (later_offset - offset) - _MINUTE, top)
            hit = _gap_match(matches, gap_start, last, offset)
            if hit is not None:  # the latest run; outside the window means no run in it
                return hit if hit >= earliest else None
        if matches(local):
            return instant if instant >= earliest else None
        if instant < detect_until:
            return None
        later_offset = offset


def _gap_match(
    matches: Callable[[datetime], bool], first: datetime, last: datetime, offset: timedelta
) -> datetime | None:
    """Latest real minute in [first, last] whose wall time under ``offset`` matches."""
    candidate = last
    while candidate >= first:
        if matches((candidate + offset).replace(tzinfo=None)):
            return candidate
        candidate -= _MINUTE
    return None


# --- solar ------------------------------------------------------------------------------------


class _SolarSearch:
    """Celery's search for one solar event, on a private copy of the schedule's observer."""

    def __init__(self, sched: Any) -> None:
        self.eph: Any = sched.ephem  # the ephem module, as Celery imported it
        self.cal: Any = sched.cal.copy()  # never move the schedule's own observer
        self.sun: Any = self.eph.Sun()
        self.method: Any = getattr(self.cal, sched.method)
        self.kwargs: dict[str, Any] = {"use_center": True} if sched.use_center else {}

    def find(self, start: float) -> float:
        """The first event after ``start`` (ephem days); raises ephem.CircumpolarError."""
        return float(self.method(self.sun, start=self.eph.Date(start), **self.kwargs))

    def events(self, start: float, end: float) -> list[float]:
        """Every event in [start, end], as Celery finds them (skipping circumpolar circuits)."""
        found: list[float] = []
        for _ in range(_SOLAR_MAX_STEPS):
            if start > end:
                break
            try:
                event = self.find(start)
            except self.eph.CircumpolarError:
                start = float(self.cal.next_antitransit(self.sun, start=self.eph.Date(start)))
                continue
            if event > end:
                break
            found.append(event)
            start = event + float(self.eph.minute)
        return found

    def canonical(self, event: float) -> float:
        """The same event searched from the minute after its previous anti-transit.

        The first estimate depends on where its search started (by up to ~0.05 s); this start
        depends only on the event, so every instance gets the same float.
        """
        try:
            antitransit = self.cal.previous_antitransit(self.sun, start=self.eph.Date(event))
            anchor = _ephem_datetime(self.eph, float(antitransit)).replace(second=0, microsecond=0)
            result = self.find(float(self.eph.Date(anchor + _MINUTE)))
        except self.eph.CircumpolarError:
            return event
        if abs(result - event) * 86_400.0 > _SOLAR_TOLERANCE_S:
            return event  # the search found another event (polar edge cases): keep the estimate
        return result


def _solar_nominal(sched: Any, now_utc: datetime) -> datetime | None:
    search = _SolarSearch(sched)
    now_naive = now_utc.replace(tzinfo=None)
    start = float(search.eph.Date(now_naive - SOLAR_WINDOW))
    end = float(search.eph.Date(now_naive + SOLAR_WINDOW))
    events = search.events(start, end)
    if not events:
        return None

    def distance(event: float) -> tuple[timedelta, float]:
        return (abs(_ephem_datetime(search.eph, event) - now_naive), event)

    nearest = search.canonical(min(events, key=distance))
    naive = _ephem_datetime(search.eph, nearest).replace(microsecond=0)
    return naive.replace(tzinfo=timezone.utc)


def _ephem_datetime(eph: Any, value: float) -> datetime:
    result = eph.Date(value).datetime()
    if not isinstance(result, datetime):  # pragma: no cover - ephem always returns one
        raise TypeError(f"ephem returned {result!r}")
    return result


# --- entry points -----------------------------------------------------------------------------


def _as_utc(moment: datetime, name: str) -> datetime:
    if moment.tzinfo is None or moment.utcoffset() is None:
        raise ValueError(f"{name} must be an aware datetime, got {moment!r}")
    return moment.astimezone(timezone.utc)


def nominal_run(
    sched: BaseSchedule, now: datetime, *, lookback: timedelta = timedelta(days=7)
) -> datetime | None:
    """The nominal instant of the run that is due at ``now``, as an aware UTC datetime.

    - interval (:class:`~celery.schedules.schedule`): start of the epoch-aligned slot holding
      ``now``; None for an interval under 1 microsecond.
    - :class:`~celery.schedules.crontab`: the latest whole minute at or before ``now``, and no
      more than ``lookback`` before it, at which Celery runs the crontab, on the wall clock of
      the schedule's timezone (see the module docstring for DST); None if there is none.
    - :class:`~celery.schedules.solar`: the event nearest to ``now`` within
      :data:`SOLAR_WINDOW`, rounded down to the whole second; None if there is none.
    - a schedule that runs once at its aware ``clocked_time`` (django-celery-beat's
      ``clocked``): that instant, to the millisecond, whatever ``now`` is.
    - anything else: None.

    ``now`` must be aware (any timezone); naive raises ValueError.
    """
    now_utc = _as_utc(now, "now")
    if lookback < _ZERO:
        raise ValueError(f"lookback must not be negative, got {lookback!r}")
    if isinstance(sched, crontab):
        return _crontab_nominal(sched, now_utc, lookback)
    if isinstance(sched, solar):
        return _solar_nominal(sched, now_utc)
    if isinstance(sched, schedule):
        return _interval_nominal(sched, now_utc)
    return _clocked_nominal(sched)


def _clocked_nominal(sched: Any) -> datetime | None:
    """The ``clocked_time`` of a run-once schedule (duck-typed: no django import here)."""
    clocked_time = getattr(sched, "clocked_time", None)
    if not isinstance(clocked_time, datetime) or clocked_time.utcoffset() is None:
        return None
    at = clocked_time.astimezone(timezone.utc)
    return at - timedelta(microseconds=at.microsecond % 1000)


def recent_runs(sched: BaseSchedule, now: datetime, since: datetime, limit: int) -> list[datetime]:
    """The nominal instants of ``sched``'s runs in ``[since, now]``, newest first.

    At most ``limit`` of them; empty for a schedule :func:`nominal_run` cannot place.
    """
    if limit < 1:
        raise ValueError(f"limit must be at least 1, got {limit!r}")
    now_utc, since_utc = _as_utc(now, "now"), _as_utc(since, "since")
    runs: list[datetime] = []
    at, last = now_utc, None
    while len(runs) < limit and at >= since_utc:
        nominal = nominal_run(sched, at, lookback=at - since_utc)
        if nominal is None or nominal < since_utc or (last is not None and nominal >= last):
            break  # none left; or a solar schedule found the same event again
        if nominal <= now_utc:
            runs.append(nominal)
        at, last = nominal - timedelta(microseconds=1), nominal
    return runs


def run_id(nominal: datetime) -> str:
    """The run's id: UTC epoch milliseconds as a decimal string, e.g. ``"1795320000000"``.

    Independent of the timezone ``nominal`` is expressed in; naive raises ValueError.
    """
    return str((_as_utc(nominal, "nominal") - EPOCH) // _MS)
