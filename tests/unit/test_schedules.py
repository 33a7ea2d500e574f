"""Nominal run instants: every beat instance names a run the same way, as Celery runs it."""

from __future__ import annotations

import functools
import random
from datetime import datetime, timedelta, timezone
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from celery import Celery
from celery.schedules import BaseSchedule, crontab, schedule
from freezegun import freeze_time
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from celery_singleton_lock.beat.schedules import (
    EPOCH,
    crontab_matches,
    interval_slot,
    nominal_run,
    recent_runs,
    run_id,
    slot_start,
)

UTC = timezone.utc
BERLIN = "Europe/Berlin"
NEW_YORK = "America/New_York"
# zones with DST: 1 h at 01:00 UTC / 02:00 local, a 30 min shift, a transition at midnight
DST_ZONES = (BERLIN, NEW_YORK, "Australia/Lord_Howe", "America/Santiago")
ZONES = ("UTC", "Asia/Kolkata", *DST_ZONES)
SECOND = timedelta(seconds=1)
MINUTE = timedelta(minutes=1)
PROPERTY = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


class Clock:
    """A settable ``nowfun`` for Celery's schedules (no global clock is touched)."""

    def __init__(self) -> None:
        self.now = datetime(2000, 1, 1, tzinfo=UTC)

    def __call__(self) -> datetime:
        return self.now


@functools.cache
def make_app(tz: str) -> Celery:
    """A Celery app, not set as current, with ``timezone = tz``."""
    app = Celery("schedules-test", set_as_current=False)
    app.conf.timezone = tz
    return app


def cron(tz: str, *args: Any, **kwargs: Any) -> tuple[Any, Clock]:
    """A Celery crontab in ``tz`` and the clock its ``nowfun`` reads."""
    clock = Clock()
    return crontab(*args, app=make_app(tz), nowfun=clock, **kwargs), clock


def celery_next_run(sched: Any, clock: Clock, last_run_at: datetime) -> datetime:
    """The instant Celery runs ``sched`` next after ``last_run_at`` (UTC), checked with is_due."""
    clock.now = last_run_at
    remaining: timedelta = sched.remaining_estimate(last_run_at)
    nxt = last_run_at.astimezone(UTC) + remaining
    clock.now = nxt
    assert sched.is_due(last_run_at)[0]
    clock.now = nxt - timedelta(milliseconds=1)
    assert not sched.is_due(last_run_at)[0]
    return nxt


def celery_runs(sched: Any, clock: Clock, start: datetime, count: int) -> list[datetime]:
    """``count`` successive runs of a beat that fires on time (last_run_at = app.now())."""
    runs = []
    last = start
    for _ in range(count):
        nxt = celery_next_run(sched, clock, last)
        runs.append(nxt)
        last = nxt.astimezone(sched.tz)
    return runs


def utc(  # noqa: PLR0917
    year: int, month: int, day: int, hour: int = 0, minute: int = 0, second: int = 0, us: int = 0
) -> datetime:
    """An aware UTC datetime."""
    return datetime(year, month, day, hour, minute, second, us, tzinfo=UTC)


# --- interval ---------------------------------------------------------------------------------


@pytest.mark.parametrize("interval", [1, 7, 10, 0.5, 0.1, 3600, 86400])
def test_interval_slot_start_is_in_its_slot(interval: float) -> None:
    """A slot's start belongs to it; a microsecond earlier belongs to the slot before."""
    slot = interval_slot(interval, 1_795_320_000.0)
    start = slot_start(interval, slot)
    at = start.timestamp()
    assert interval_slot(interval, at) == slot
    assert interval_slot(interval, at - 1e-6) == slot - 1
    assert interval_slot(interval, slot_start(interval, slot + 1).timestamp() - 1e-6) == slot
    assert start <= datetime.fromtimestamp(1_795_320_000, UTC) < slot_start(interval, slot + 1)


def test_interval_slots_are_epoch_aligned() -> None:
    """Slots count from the Unix epoch, so 7 s slots start at multiples of 7 s since 1970."""
    assert interval_slot(10, 1_795_320_009.999) == 179_532_000
    assert interval_slot(10, 1_795_320_010) == 179_532_001
    assert interval_slot(7, 1_795_320_000) == 1_795_320_000 // 7
    start = slot_start(7, interval_slot(7, 1_795_320_000))
    assert (start - EPOCH) % timedelta(seconds=7) == timedelta(0)
    assert start.tzinfo is UTC
    assert slot_start(0.5, 3) == EPOCH + timedelta(seconds=1.5)
    assert interval_slot(60, -1) == -1  # before 1970: floor, not truncation


def test_interval_float_boundaries_land_in_their_slot() -> None:
    """Boundaries computed in floats (k * 0.1, k * 0.7) still start slot k."""
    for interval in (0.1, 0.7, 0.3, 1.1):
        base = round(1_795_320_000 / interval)  # float epoch seconds hold 0.24 us here
        for k in range(base, base + 500):
            assert interval_slot(interval, k * interval) == k
            assert interval_slot(interval, slot_start(interval, k).timestamp()) == k


@given(
    epoch_s=st.integers(min_value=-(10**9), max_value=10**11),
    offsets=st.lists(st.floats(min_value=0, max_value=0.999), min_size=2, max_size=5),
    interval=st.sampled_from([1.0, 7.0, 10.0, 0.5, 60.0, 300.0, 3600.0]),
)
def test_interval_instances_in_one_slot_agree(
    epoch_s: int, offsets: list[float], interval: float
) -> None:
    """Instances computing at different instants within one slot get the same nominal."""
    sched = schedule(timedelta(seconds=interval), app=make_app("UTC"))
    slot = int(epoch_s // interval)
    start = slot_start(interval, slot)
    nominals = set()
    for fraction in offsets:
        now = start + timedelta(microseconds=int(fraction * interval * 1_000_000))
        assert interval_slot(interval, (now - EPOCH) / SECOND) == slot
        nominals.add(nominal_run(sched, now))
    assert nominals == {start}


@pytest.mark.parametrize("interval", [7, 0.5])
def test_interval_nominal_run_matches_slot_functions(interval: float) -> None:
    """nominal_run of an interval schedule is slot_start(interval_slot(now))."""
    sched = schedule(interval, app=make_app(BERLIN))
    rng = random.Random(interval)
    for _ in range(200):
        now = utc(2026, 6, 1) + timedelta(microseconds=rng.randrange(10**12))
        expected = slot_start(interval, interval_slot(interval, now.timestamp()))
        assert nominal_run(sched, now) == expected
        assert nominal_run(sched, now.astimezone(ZoneInfo("Asia/Tokyo"))) == expected


@pytest.mark.parametrize("skew", [-0.9, -0.5, 0.0, 0.5, 0.9])
def test_interval_skewed_clocks_firing_at_their_own_boundaries_agree(skew: float) -> None:
    """1 s interval: an instance whose clock is off by up to 0.9 s, firing at its own boundary
    (plus up to 50 ms), names the slot of that boundary."""
    sched = schedule(1, app=make_app("UTC"))
    rng = random.Random(int(skew * 10))
    for boundary in range(1_795_320_000, 1_795_320_020):
        late = rng.uniform(0, 0.05)
        real_instant = boundary - skew + late  # when its clock reads boundary + late
        with freeze_time(datetime.fromtimestamp(real_instant + skew, UTC)):
            mine = nominal_run(sched, datetime.now(UTC))
        assert mine == datetime.fromtimestamp(boundary, UTC)


def test_interval_invalid_values() -> None:
    """Intervals under a microsecond and non-finite values are refused; a 0 s schedule has none."""
    for bad in (0, -1, 1e-7, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="interval"):
            interval_slot(bad, 1.0)
    with pytest.raises(ValueError, match="now"):
        interval_slot(1, float("nan"))
    assert nominal_run(schedule(0, app=make_app("UTC")), utc(2026, 1, 1)) is None


# --- crontab: matching ------------------------------------------------------------------------


def test_crontab_every_minute_and_every_five() -> None:
    """`* * * * *` names the current minute, `*/5` the last multiple of five."""
    every, _ = cron(BERLIN)
    five, _ = cron(BERLIN, minute="*/5")
    now = utc(2026, 5, 5, 9, 13, 42, 123456)
    assert nominal_run(every, now) == utc(2026, 5, 5, 9, 13)
    assert nominal_run(five, now) == utc(2026, 5, 5, 9, 10)
    assert nominal_run(five, utc(2026, 5, 5, 9, 15)) == utc(2026, 5, 5, 9, 15)


def test_crontab_weekday_mornings() -> None:
    """`0 9 * * mon-fri` in Berlin: the weekday's 09:00 CEST; on Saturday, Friday's."""
    sched, _ = cron(BERLIN, minute=0, hour=9, day_of_week="mon-fri")
    friday_nine = utc(2026, 5, 8, 7, 0)  # 09:00 CEST
    assert nominal_run(sched, friday_nine + timedelta(seconds=3)) == friday_nine
    assert nominal_run(sched, utc(2026, 5, 9, 7, 0, 30)) == friday_nine  # Saturday
    assert nominal_run(sched, utc(2026, 5, 11, 7, 0, 30)) == utc(2026, 5, 11, 7, 0)  # Monday
    assert nominal_run(sched, utc(2026, 5, 9, 7, 0, 30), lookback=timedelta(hours=23)) is None


@pytest.mark.parametrize("late", [0, 0.001, 1, 10, 30, 49.999, 50, 59.999])
def test_crontab_late_firing_names_the_same_minute(late: float) -> None:
    """Firing 0-59 s after the run still names the run's minute."""
    sched, clock = cron(BERLIN, minute=0, hour=9, day_of_week="mon-fri")
    for run in celery_runs(sched, clock, datetime(2026, 5, 1, tzinfo=ZoneInfo(BERLIN)), 5):
        assert nominal_run(sched, run + timedelta(seconds=late)) == run


@pytest.mark.parametrize("skew", [-1.0, -0.4, 0.0, 0.4, 1.0])
def test_crontab_skewed_clocks_firing_at_their_own_boundaries_agree(skew: float) -> None:
    """Instances whose clocks are off by up to 1 s, each firing at its own run instant (plus up to
    0.5 s of scheduling delay), all name the run's minute."""
    sched, clock = cron(NEW_YORK, minute="*/5")
    rng = random.Random(int(skew * 10))
    for run in celery_runs(sched, clock, datetime(2026, 7, 1, tzinfo=ZoneInfo(NEW_YORK)), 20):
        real_instant = run - timedelta(seconds=skew) + timedelta(seconds=rng.uniform(0, 0.5))
        with freeze_time(real_instant + timedelta(seconds=skew)):  # what its clock reads
            assert nominal_run(sched, datetime.now(UTC)) == run


def test_crontab_now_in_any_timezone() -> None:
    """The same instant given in any timezone gives the same nominal instant, in UTC."""
    sched, _ = cron(BERLIN, minute=30, hour="*/3")
    now = utc(2026, 1, 15, 11, 31, 5)
    expected = utc(2026, 1, 15, 11, 30)  # 12:30 CET
    for zone in ("UTC", "Asia/Tokyo", NEW_YORK, "Asia/Kolkata"):
        got = nominal_run(sched, now.astimezone(ZoneInfo(zone)))
        assert got == expected
        assert got is not None
        assert got.utcoffset() == timedelta(0)


def test_crontab_uses_the_schedule_timezone() -> None:
    """Fields are read on the wall clock of the app's timezone, not UTC's."""
    in_utc, _ = cron("UTC", minute=0, hour=9)
    in_kolkata, _ = cron("Asia/Kolkata", minute=0, hour=9)
    now = utc(2026, 3, 3, 12, 0, 30)
    assert nominal_run(in_utc, now) == utc(2026, 3, 3, 9, 0)
    assert nominal_run(in_kolkata, now) == utc(2026, 3, 3, 3, 30)  # 09:00 IST


def test_crontab_lookback_limits() -> None:
    """lookback=0 looks only at floor(now); nothing inside lookback gives None."""
    yearly, _ = cron("UTC", minute=0, hour=0, day_of_month=1, month_of_year=1)
    assert nominal_run(yearly, utc(2026, 1, 1, 0, 0, 59), lookback=timedelta(0)) == utc(2026, 1, 1)
    assert nominal_run(yearly, utc(2026, 1, 1, 0, 1), lookback=timedelta(0)) is None
    assert nominal_run(yearly, utc(2026, 1, 1, 0, 1), lookback=MINUTE) == utc(2026, 1, 1)
    assert nominal_run(yearly, utc(2026, 1, 9)) is None  # default lookback: 7 days
    assert nominal_run(yearly, utc(2026, 1, 8)) == utc(2026, 1, 1)
    with pytest.raises(ValueError, match="lookback"):
        nominal_run(yearly, utc(2026, 1, 8), lookback=-MINUTE)


def test_crontab_day_of_month_and_day_of_week_are_anded() -> None:
    """Celery ANDs day_of_month and day_of_week (cron would OR them): "Mondays 1-7" is the first
    Monday of the month, and Celery agrees."""
    sched, clock = cron("UTC", minute=0, hour=6, day_of_week="mon", day_of_month="1-7")
    runs = celery_runs(sched, clock, utc(2026, 5, 20), 4)
    assert runs == [utc(2026, 6, 1, 6), utc(2026, 7, 6, 6), utc(2026, 8, 3, 6), utc(2026, 9, 7, 6)]
    assert crontab_matches(sched, datetime(2026, 6, 1, 6, 0))  # Monday the 1st
    assert not crontab_matches(sched, datetime(2026, 6, 8, 6, 0))  # a Monday, not in 1-7
    assert not crontab_matches(sched, datetime(2026, 6, 2, 6, 0))  # in 1-7, a Tuesday
    ten_days = timedelta(days=10)
    assert nominal_run(sched, utc(2026, 6, 9, 6, 0, 5), lookback=ten_days) == utc(2026, 6, 1, 6)
    for run in runs:
        assert nominal_run(sched, run + timedelta(seconds=20)) == run


def test_crontab_month_of_year_and_sunday_zero() -> None:
    """month_of_year restricts too; day_of_week 0 is Sunday, as in Celery."""
    sched, clock = cron("UTC", minute=15, hour=0, day_of_week=0, month_of_year="feb")
    runs = celery_runs(sched, clock, utc(2026, 1, 1), 5)
    assert [r.day for r in runs[:4]] == [1, 8, 15, 22]  # Sundays of February 2026
    assert runs[4] == utc(2027, 2, 7, 0, 15)
    assert crontab_matches(sched, datetime(2026, 2, 1, 0, 15))
    assert not crontab_matches(sched, datetime(2026, 3, 1, 0, 15))  # a Sunday in March


# --- crontab: daylight saving time --------------------------------------------------------------


def test_dst_spring_forward_berlin_runs_gap_time_an_hour_later() -> None:
    """Europe/Berlin, 2026-03-29, 02:00 CET -> 03:00 CEST: Celery runs `30 2 * * *` at 03:30 CEST
    (01:30 UTC, the gap time read with the CET offset); nominal names that instant."""
    sched, clock = cron(BERLIN, minute=30, hour=2)
    runs = celery_runs(sched, clock, datetime(2026, 3, 27, 12, tzinfo=ZoneInfo(BERLIN)), 3)
    assert runs == [utc(2026, 3, 28, 1, 30), utc(2026, 3, 29, 1, 30), utc(2026, 3, 30, 0, 30)]
    for run in runs:
        nominals = {nominal_run(sched, run + timedelta(seconds=s)) for s in (0, 0.5, 17, 59.9)}
        assert nominals == {run}
    # a run read inside the gap is found however short the lookback
    assert nominal_run(sched, utc(2026, 3, 29, 1, 30, 9), lookback=timedelta(0)) == runs[1]
    assert nominal_run(sched, utc(2026, 3, 29, 1, 31), lookback=timedelta(0)) is None
    assert nominal_run(sched, utc(2026, 3, 29, 1, 59), lookback=timedelta(minutes=29)) == runs[1]
    # the run before the gap day does not swallow it, nor does the day after
    assert nominal_run(sched, utc(2026, 3, 29, 1, 29, 59)) == utc(2026, 3, 28, 1, 30)
    assert nominal_run(sched, utc(2026, 3, 30, 0, 29)) == utc(2026, 3, 29, 1, 30)


def test_dst_spring_forward_berlin_every_twenty_minutes() -> None:
    """`*/20` over the Berlin gap: Celery runs 01:40 CET, then 03:00 CEST (02:00 read as CET) and
    drops 02:20 and 02:40; nominal names each run."""
    sched, clock = cron(BERLIN, minute="*/20")
    runs = celery_runs(sched, clock, datetime(2026, 3, 29, 1, 30, tzinfo=ZoneInfo(BERLIN)), 4)
    assert runs == [utc(2026, 3, 29, 0, 40), utc(2026, 3, 29, 1), utc(2026, 3, 29, 1, 20),
                    utc(2026, 3, 29, 1, 40)]  # fmt: skip
    for run in runs:
        assert nominal_run(sched, run + timedelta(seconds=45)) == run


def test_dst_spring_forward_new_york() -> None:
    """America/New_York, 2026-03-08, 02:00 EST -> 03:00 EDT: `30 2 * * *` runs at 03:30 EDT."""
    sched, clock = cron(NEW_YORK, minute=30, hour=2)
    runs = celery_runs(sched, clock, datetime(2026, 3, 7, 12, tzinfo=ZoneInfo(NEW_YORK)), 2)
    assert runs == [utc(2026, 3, 8, 7, 30), utc(2026, 3, 9, 6, 30)]
    assert runs[0].astimezone(ZoneInfo(NEW_YORK)).hour == 3
    for run in runs:
        assert nominal_run(sched, run + timedelta(seconds=50)) == run


def test_dst_fall_back_new_york_runs_first_occurrence_only() -> None:
    """America/New_York, 2026-11-01, 02:00 EDT -> 01:00 EST: Celery runs `30 1 * * *` once, at
    01:30 EDT (05:30 UTC), and never at 01:30 EST (06:30 UTC). Both are distinct real instants:
    an instance firing in the repeated hour would name 06:30 UTC, its own run."""
    sched, clock = cron(NEW_YORK, minute=30, hour=1)
    runs = celery_runs(sched, clock, datetime(2026, 10, 31, 12, tzinfo=ZoneInfo(NEW_YORK)), 2)
    assert runs == [utc(2026, 11, 1, 5, 30), utc(2026, 11, 2, 6, 30)]
    assert nominal_run(sched, utc(2026, 11, 1, 5, 30, 40)) == utc(2026, 11, 1, 5, 30)
    assert nominal_run(sched, utc(2026, 11, 1, 6, 29, 59)) == utc(2026, 11, 1, 5, 30)
    assert nominal_run(sched, utc(2026, 11, 1, 6, 30, 1)) == utc(2026, 11, 1, 6, 30)
    assert run_id(utc(2026, 11, 1, 5, 30)) != run_id(utc(2026, 11, 1, 6, 30))


def test_dst_fall_back_new_york_every_twenty_minutes_skips_repeated_hour() -> None:
    """`*/20` over the New York fall-back: Celery goes 01:40 EDT -> 02:00 EST (80 minutes)."""
    sched, clock = cron(NEW_YORK, minute="*/20")
    runs = celery_runs(sched, clock, datetime(2026, 11, 1, 1, 30, tzinfo=ZoneInfo(NEW_YORK)), 3)
    assert runs == [utc(2026, 11, 1, 5, 40), utc(2026, 11, 1, 7), utc(2026, 11, 1, 7, 20)]
    for run in runs:
        assert nominal_run(sched, run + timedelta(seconds=30)) == run


def test_dst_fall_back_berlin() -> None:
    """Europe/Berlin, 2026-10-25, 03:00 CEST -> 02:00 CET: `30 2 * * *` runs at 02:30 CEST only."""
    sched, clock = cron(BERLIN, minute=30, hour=2)
    runs = celery_runs(sched, clock, datetime(2026, 10, 24, 12, tzinfo=ZoneInfo(BERLIN)), 2)
    assert runs == [utc(2026, 10, 25, 0, 30), utc(2026, 10, 26, 1, 30)]
    assert nominal_run(sched, utc(2026, 10, 25, 0, 30, 5)) == utc(2026, 10, 25, 0, 30)
    assert nominal_run(sched, utc(2026, 10, 25, 1, 30, 5)) == utc(2026, 10, 25, 1, 30)


def test_dst_lord_howe_half_hour_gap() -> None:
    """Australia/Lord_Howe jumps 02:00 -> 02:30: `*/20` at 02:00 runs at 02:30 (read before the
    gap) and 02:20 is dropped, as Celery does."""
    zone = "Australia/Lord_Howe"
    sched, clock = cron(zone, minute="*/20")
    start = datetime(2026, 10, 4, 1, 30, tzinfo=ZoneInfo(zone))
    runs = celery_runs(sched, clock, start, 3)
    walls = [r.astimezone(ZoneInfo(zone)).strftime("%H:%M") for r in runs]
    assert walls == ["01:40", "02:30", "02:40"]
    for run in runs:
        assert nominal_run(sched, run + timedelta(seconds=59)) == run


@functools.cache
def transitions(zone: str, year: int) -> tuple[datetime, ...]:
    """UTC instants at which ``zone`` changes its offset during ``year`` (to the minute)."""
    tz = ZoneInfo(zone)
    found = []
    hour = timedelta(hours=1)
    instant = utc(year, 1, 1)
    while instant.year == year:
        nxt = instant + hour
        if instant.astimezone(tz).utcoffset() != nxt.astimezone(tz).utcoffset():
            lo, hi = instant, nxt
            while hi - lo > MINUTE:
                mid = lo + (hi - lo) / 2
                mid -= timedelta(seconds=mid.second, microseconds=mid.microsecond)
                if mid <= lo:
                    break
                if mid.astimezone(tz).utcoffset() == lo.astimezone(tz).utcoffset():
                    lo = mid
                else:
                    hi = mid
            found.append(hi)
        instant = nxt
    return tuple(found)


MINUTE_SPECS = st.sampled_from(["*", "*/5", "*/20", "0", "30", "15,45", "*/7", "59", "0-10"])
HOUR_SPECS = st.sampled_from(["*", "0", "1", "2", "3", "1-3", "0,2", "*/2", "23", "0-4"])
DOW_SPECS = st.sampled_from(["*", "*", "sun", "sat,sun", "mon-fri", "0-6/3"])
DOM_SPECS = st.sampled_from(["*", "*", "*", "1-15", "*/2", "4,5,6,25,26,27,28"])


@PROPERTY
@given(
    zone=st.sampled_from(DST_ZONES),
    year=st.integers(min_value=2024, max_value=2030),
    which=st.integers(min_value=0, max_value=1),
    shift_s=st.integers(min_value=-36 * 3600, max_value=36 * 3600),
    minute=MINUTE_SPECS,
    hour=HOUR_SPECS,
    dow=DOW_SPECS,
    dom=DOM_SPECS,
    late_s=st.floats(min_value=0, max_value=59.999),
)
def test_nominal_is_celerys_run_around_dst(
    *,
    zone: str,
    year: int,
    which: int,
    shift_s: int,
    minute: str,
    hour: str,
    dow: str,
    dom: str,
    late_s: float,
) -> None:
    """Around DST transitions, for every run Celery makes, nominal_run at any instant of the
    following minute names exactly that run."""
    found = transitions(zone, year)
    assume(len(found) == 2)
    last_run_at = (found[which] + timedelta(seconds=shift_s)).astimezone(ZoneInfo(zone))
    sched, clock = cron(zone, minute=minute, hour=hour, day_of_week=dow, day_of_month=dom)
    for run in celery_runs(sched, clock, last_run_at, 3):
        assert run.second == 0
        assert run.microsecond == 0
        assert nominal_run(sched, run) == run
        assert nominal_run(sched, run + timedelta(seconds=late_s)) == run


@PROPERTY
@given(
    zone=st.sampled_from(DST_ZONES),
    which=st.integers(min_value=0, max_value=1),
    shift_s=st.integers(min_value=-3 * 3600, max_value=3 * 3600),
    minute=MINUTE_SPECS,
    hour=HOUR_SPECS,
    lookback_min=st.integers(min_value=0, max_value=240),
)
def test_lookback_only_cuts_the_window(
    *, zone: str, which: int, shift_s: int, minute: str, hour: str, lookback_min: int
) -> None:
    """A shorter lookback gives the same run when it reaches it and None otherwise, also when it
    ends inside a DST gap."""
    found = transitions(zone, 2026)
    now = found[which] + timedelta(seconds=shift_s)
    sched, _ = cron(zone, minute=minute, hour=hour)
    full = nominal_run(sched, now, lookback=timedelta(days=2))
    lookback = timedelta(minutes=lookback_min)
    top = now.replace(second=0, microsecond=0)
    expected = full if full is not None and full >= top - lookback else None
    assert nominal_run(sched, now, lookback=lookback) == expected


def test_crontab_celery_runs_over_a_year_in_berlin() -> None:
    """Hourly runs in Berlin from March to November (two DST changes): nominal names each one."""
    sched, clock = cron(BERLIN, minute=30)
    runs = celery_runs(sched, clock, datetime(2026, 3, 20, tzinfo=ZoneInfo(BERLIN)), 230 * 24)
    assert len(set(runs)) == len(runs)
    for run in runs:
        assert nominal_run(sched, run + timedelta(seconds=42)) == run


@st.composite
def crontab_and_instant(draw: st.DrawFn) -> tuple[str, dict[str, Any], datetime]:
    """A zone, crontab fields and a UTC instant (fields drawn to match it about half the time)."""
    zone = draw(st.sampled_from(ZONES))
    instant = draw(st.datetimes(min_value=datetime(1971, 1, 1), max_value=datetime(2099, 1, 1)))
    instant = instant.replace(second=0, microsecond=0, tzinfo=UTC)
    local = instant.astimezone(ZoneInfo(zone))
    actual = {
        "minute": local.minute,
        "hour": local.hour,
        "day_of_month": local.day,
        "month_of_year": local.month,
        "day_of_week": local.isoweekday() % 7,
    }
    bounds = {
        "minute": (0, 59),
        "hour": (0, 23),
        "day_of_month": (1, 31),
        "month_of_year": (1, 12),
        "day_of_week": (0, 6),
    }
    fields: dict[str, Any] = {}
    for name, (lo, hi) in bounds.items():
        kind = draw(st.sampled_from(["star", "with", "random"]))
        if kind == "star":
            fields[name] = "*"
        else:
            values = draw(st.sets(st.integers(lo, hi), min_size=1, max_size=6))
            if kind == "with":
                values.add(actual[name])
            fields[name] = values
    return zone, fields, instant


@PROPERTY
@given(crontab_and_instant())
def test_crontab_matches_agrees_with_celery(case: tuple[str, dict[str, Any], datetime]) -> None:
    """crontab_matches(t) is exactly Celery's "due at t, having last run 30 s before"."""
    zone, fields, instant = case
    try:
        sched, clock = cron(zone, **fields)
    except ValueError:  # e.g. only the 31st in February: Celery refuses it
        assume(False)
        return
    tz = ZoneInfo(zone)
    local = instant.astimezone(tz)
    last_run_at = (instant - timedelta(seconds=30)).astimezone(tz)
    assume(last_run_at.utcoffset() == local.utcoffset())  # DST edges: see the DST tests
    clock.now = local
    celery_due = sched.is_due(last_run_at)[0]
    assert crontab_matches(sched, local) == celery_due
    assert (sched.remaining_estimate(last_run_at) == timedelta(0)) == celery_due
    expected = instant if celery_due else None
    assert nominal_run(sched, instant + timedelta(seconds=30), lookback=timedelta(0)) == expected


@PROPERTY
@given(case=crontab_and_instant(), shift_s=st.integers(min_value=0, max_value=400 * 86400))
def test_crontab_next_run_agrees_with_celery(
    case: tuple[str, dict[str, Any], datetime], shift_s: int
) -> None:
    """From any last run, Celery's next run is a minute that nominal_run names."""
    zone, fields, instant = case
    try:
        sched, clock = cron(zone, **fields)
    except ValueError:
        assume(False)
        return
    last_run_at = (instant + timedelta(seconds=shift_s)).astimezone(ZoneInfo(zone))
    run = celery_next_run(sched, clock, last_run_at)
    assert nominal_run(sched, run + timedelta(seconds=59), lookback=timedelta(0)) == run


# --- solar --------------------------------------------------------------------------------------


@functools.cache
def solar_schedule(event: str, lat: float, lon: float) -> Any:
    """A Celery solar schedule (needs ephem)."""
    pytest.importorskip("ephem")
    from celery.schedules import solar

    return solar(event, lat, lon, app=make_app("UTC"))


def celery_solar_run(sched: Any, last_run_at: datetime) -> datetime:
    """The instant Celery runs a solar schedule next after ``last_run_at``."""
    sched.nowfun = lambda: last_run_at
    try:
        return last_run_at + sched.remaining_estimate(last_run_at)  # type: ignore[no-any-return]
    finally:
        sched.nowfun = None


@pytest.mark.parametrize(
    ("event", "lat", "lon"),
    [
        ("sunrise", 48.8566, 2.3522),  # Paris
        ("sunset", -33.87, 151.21),  # Sydney
        ("solar_noon", 40.71, -74.0),  # New York
        ("dawn_civil", 64.15, -21.94),  # Reykjavik
        ("dusk_astronomical", 52.52, 13.40),  # Berlin
    ],
)
def test_solar_instants_after_the_event_agree(event: str, lat: float, lon: float) -> None:
    """Instances firing at or minutes after Celery's event time, each computed from its own last
    run, all name the event, to the second, within a second of Celery's time."""
    sched = solar_schedule(event, lat, lon)
    rng = random.Random(event)
    for day in range(0, 360, 30):
        first = celery_solar_run(sched, utc(2026, 1, 1) + timedelta(days=day))
        # other instances last ran at other times before the event: same event, within ms
        runs = {first} | {
            celery_solar_run(sched, first - timedelta(hours=rng.uniform(0.01, 10)))
            for _ in range(4)
        }
        assert max(runs) - min(runs) < SECOND
        nominals = {
            nominal_run(sched, run + timedelta(seconds=rng.uniform(0, 600)))
            for run in runs
            for _ in range(3)
        }
        assert len(nominals) == 1
        nominal = nominals.pop()
        assert nominal is not None
        assert nominal.microsecond == 0
        assert nominal.utcoffset() == timedelta(0)
        assert abs(nominal - first) < timedelta(seconds=2)


def test_solar_nominal_is_nearest_event_and_pure() -> None:
    """Just before sunrise names the same sunrise; the schedule's observer is left untouched."""
    sched = solar_schedule("sunrise", 48.8566, 2.3522)
    date_before = float(sched.cal.date)
    after = nominal_run(sched, utc(2026, 3, 10, 6, 20))
    assert after is not None
    assert after.date() == datetime(2026, 3, 10).date()
    assert nominal_run(sched, after - timedelta(minutes=30)) == after
    assert nominal_run(sched, after + timedelta(hours=11)) == after
    tomorrow = nominal_run(sched, after + timedelta(hours=13))  # nearer to the next sunrise
    assert tomorrow is not None
    assert timedelta(hours=23) < tomorrow - after < timedelta(hours=25)
    assert float(sched.cal.date) == date_before


def test_solar_none_in_polar_night() -> None:
    """No sunrise within 12 h in Longyearbyen's polar night gives None."""
    sched = solar_schedule("sunrise", 78.22, 15.65)
    assert nominal_run(sched, utc(2026, 12, 21, 12)) is None


# --- run ids and others -----------------------------------------------------------------------


def test_run_id_is_epoch_milliseconds_in_any_timezone() -> None:
    """run_id is UTC epoch milliseconds, whatever timezone the instant is given in."""
    instant = datetime.fromtimestamp(1_795_320_000, UTC)
    assert run_id(instant) == "1795320000000"
    for zone in ("Asia/Kolkata", NEW_YORK, BERLIN, "Pacific/Chatham"):
        assert run_id(instant.astimezone(ZoneInfo(zone))) == "1795320000000"
    assert run_id(EPOCH) == "0"
    assert run_id(EPOCH + timedelta(milliseconds=1, microseconds=999)) == "1"
    assert run_id(EPOCH - timedelta(microseconds=1)) == "-1"
    assert run_id(slot_start(0.5, 3)) == "1500"


@given(st.datetimes(timezones=st.sampled_from([UTC, ZoneInfo(BERLIN), ZoneInfo(NEW_YORK)])))
def test_run_id_is_stable(instant: datetime) -> None:
    """run_id round-trips to the instant's millisecond and is the same for equal instants."""
    rid = run_id(instant)
    assert rid == run_id(instant.astimezone(UTC))
    assert EPOCH + timedelta(milliseconds=int(rid)) <= instant
    assert instant - (EPOCH + timedelta(milliseconds=int(rid))) < timedelta(milliseconds=1)


def test_naive_datetimes_are_refused() -> None:
    """A naive ``now`` or nominal instant raises ValueError rather than guessing a timezone."""
    every, _ = cron("UTC")
    with pytest.raises(ValueError, match="aware"):
        nominal_run(every, datetime(2026, 1, 1))
    with pytest.raises(ValueError, match="aware"):
        run_id(datetime(2026, 1, 1))


def test_other_schedules_have_no_nominal_run() -> None:
    """A schedule that is none of interval, crontab or solar gives None."""

    class Custom(BaseSchedule):  # type: ignore[misc]
        """A user-defined schedule."""

    assert nominal_run(Custom(app=make_app("UTC")), utc(2026, 1, 1)) is None


def test_schedule_timezone_from_a_name() -> None:
    """A schedule whose ``tz`` is a zone name (as some schedulers set it) is read in that zone."""
    sched, _ = cron("UTC", minute=0, hour=9)
    sched.tz = "Asia/Kolkata"
    assert nominal_run(sched, utc(2026, 3, 3, 3, 30, 1)) == utc(2026, 3, 3, 3, 30)


# --- recent runs (what a beat starting late looks at) -----------------------------------------


def test_recent_interval_runs_newest_first() -> None:
    """Every slot start in the window, newest first, the current slot included."""
    now = utc(2026, 11, 22, 12, 0, 30, 500_000)
    runs = recent_runs(schedule(timedelta(seconds=10)), now, now - timedelta(seconds=25), 32)
    assert runs == [utc(2026, 11, 22, 12, 0, s) for s in (30, 20, 10)]


def test_recent_runs_stop_at_the_limit() -> None:
    """A short interval yields at most ``limit`` runs."""
    now = utc(2026, 11, 22, 12)
    runs = recent_runs(schedule(timedelta(seconds=0.1)), now, now - timedelta(hours=1), 5)
    assert len(runs) == 5
    assert runs[0] == now
    with pytest.raises(ValueError, match="limit"):
        recent_runs(schedule(timedelta(seconds=1)), now, now, 0)


def test_recent_crontab_runs_on_the_schedule_wall_clock() -> None:
    """Every-five-minutes in Berlin: the matching minutes in the window, newest first."""
    sched, _ = cron(BERLIN, minute="*/5")
    now = utc(2026, 11, 22, 12, 11, 3)
    runs = recent_runs(sched, now, now - timedelta(minutes=9), 32)
    assert runs == [utc(2026, 11, 22, 12, 10), utc(2026, 11, 22, 12, 5)]
    assert recent_runs(sched, now, now - timedelta(seconds=30), 32) == []


def test_recent_solar_run_is_the_past_event_only() -> None:
    """A solar schedule yields its event if it is in the window and past, never a future one."""
    sched = solar_schedule("solar_noon", 40.71, -74.0)
    noon = nominal_run(sched, utc(2026, 6, 1, 17))
    assert noon is not None
    assert recent_runs(sched, noon + MINUTE, noon - MINUTE, 32) == [noon]
    assert recent_runs(sched, noon - SECOND, noon - MINUTE, 32) == []
