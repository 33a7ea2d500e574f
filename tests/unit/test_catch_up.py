"""Catch-up (beat/catch_up.py): which runs a beat publishes as it starts to watch an entry,
computed from the entry's record and the instant it starts, never from a clock of its own."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from celery import Celery
from celery.schedules import crontab, schedule

from celery_singleton_lock.beat.catch_up import (
    CATCH_UP_HEADER,
    CATCH_UP_MAX,
    CatchUp,
    catch_up_of,
    grace,
    runs_on_sight,
)
from celery_singleton_lock.settings.options import read_beat_options
from tests.support.documented import documented_python

UTC = timezone.utc
#: a slot boundary of a 10 s interval and a whole minute
T0 = datetime(2026, 11, 27, 12, 0, 0, tzinfo=UTC)
EVERY_10S = schedule(timedelta(seconds=10))
EVERY_MINUTE = crontab()


def ms(when: datetime) -> int:
    return int(when.timestamp() * 1000)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def test_an_entry_without_a_record_missed_nothing_and_its_just_begun_run_is_due() -> None:
    sight = runs_on_sight(EVERY_10S, CatchUp("latest"), None, at(100.4), 1.0)
    assert (sight.missed, sight.due) == ([], [at(100)])
    sight = runs_on_sight(EVERY_10S, CatchUp(3600), None, at(101.5), 1.0)
    assert (sight.missed, sight.due) == ([], []), "begun 1.5 s ago: missed, but nothing to miss"


@pytest.mark.parametrize(
    ("choice", "missed"),
    [
        ("none", []),
        ("latest", [at(100)]),
        (25.0, [at(80), at(90), at(100)]),  # within 25 s of 101.5: 80, 90, 100; oldest first
        (3600, [at(40 + 10 * i) for i in range(7)]),  # all after `through` (30)
    ],
)
def test_each_choice_picks_from_the_runs_after_the_record(
    choice: str | float, missed: list[datetime]
) -> None:
    """Published through 30 s, the beats down, one starts at 101.5 s: 40 to 100 were missed."""
    sight = runs_on_sight(EVERY_10S, CatchUp(choice), ms(at(30)), at(101.5), 1.0)
    assert sight.missed == missed
    assert sight.due == []
    assert not sight.capped


def test_the_run_due_within_the_grace_comes_after_the_missed_ones() -> None:
    sight = runs_on_sight(EVERY_10S, CatchUp("latest"), ms(at(30)), at(100.6), 1.0)
    assert (sight.missed, sight.due) == ([at(90)], [at(100)])
    sight = runs_on_sight(EVERY_10S, CatchUp("none"), ms(at(30)), at(100.6), 1.0)
    assert (sight.missed, sight.due) == ([], [at(100)])


def test_a_restart_while_another_beat_kept_the_schedule_missed_nothing() -> None:
    """The record is the other beat's: its last run is the current one."""
    for choice in ("none", "latest", 3600):
        sight = runs_on_sight(EVERY_10S, CatchUp(choice), ms(at(100)), at(105), 1.0)
        assert (sight.missed, sight.due) == ([], [])
        # the current run not published yet by the others (it began 0.3 s ago): due here too
        sight = runs_on_sight(EVERY_10S, CatchUp(choice), ms(at(90)), at(100.3), 1.0)
        assert (sight.missed, sight.due) == ([], [at(100)])


def test_a_record_ahead_of_this_clock_publishes_nothing_twice() -> None:
    sight = runs_on_sight(EVERY_10S, CatchUp(3600), ms(at(110)), at(100.2), 1.0)
    assert (sight.missed, sight.due) == ([], [])


def test_a_window_is_capped_to_the_latest_runs() -> None:
    every_second = schedule(timedelta(seconds=1))
    sight = runs_on_sight(every_second, CatchUp(5000), ms(at(0)), at(3000.5), 0.1)
    assert sight.capped
    assert len(sight.missed) == CATCH_UP_MAX
    assert (sight.missed[0], sight.missed[-1]) == (at(3000 - CATCH_UP_MAX + 1), at(3000))
    assert sight.missed == sorted(sight.missed)


def test_crontab_runs_are_the_minutes_it_matched() -> None:
    """Every minute, published through 12:00, a beat starts at 12:05:20: 12:01 to 12:05 missed."""
    sight = runs_on_sight(EVERY_MINUTE, CatchUp(150), ms(at(0)), at(320), 1.0)
    assert sight.missed == [at(180), at(240), at(300)]
    sight = runs_on_sight(EVERY_MINUTE, CatchUp("latest"), ms(at(0)), at(320), 1.0)
    assert sight.missed == [at(300)]
    hourly = crontab(minute=0)
    sight = runs_on_sight(hourly, CatchUp("latest"), ms(at(-86400)), at(7 * 3600 + 5), 1.0)
    assert (sight.missed, sight.due) == ([at(7 * 3600)], []), "5 s late: missed, not due"


def test_celerys_cron_starting_deadline_bounds_how_far_back_a_crontab_catches_up() -> None:
    """beat_cron_starting_deadline: a crontab run older than that is not published."""
    sight = runs_on_sight(EVERY_MINUTE, CatchUp(150), ms(at(0)), at(320), 1.0, deadline_s=100.0)
    assert sight.missed == [at(240), at(300)]
    hourly = crontab(minute=0)
    sight = runs_on_sight(
        hourly, CatchUp("latest"), ms(at(-86400)), at(7 * 3600 + 200), 1.0, deadline_s=60
    )
    assert sight.missed == []


def test_an_entry_header_overrides_the_app_choice_and_a_bad_one_is_reported() -> None:
    assert catch_up_of(None, "latest") == (CatchUp("latest"), "")
    assert catch_up_of({"queue": "q"}, 60) == (CatchUp(60), "")
    assert catch_up_of({"headers": {CATCH_UP_HEADER: "none"}}, "latest") == (CatchUp("none"), "")
    assert catch_up_of({"headers": {CATCH_UP_HEADER: 300}}, "latest") == (CatchUp(300), "")
    for bad in ("all", True, -5, float("nan"), [1]):
        choice, problem = catch_up_of({"headers": {CATCH_UP_HEADER: bad}}, "latest")
        assert choice == CatchUp("latest")
        assert problem.startswith(CATCH_UP_HEADER), problem
    assert str(CatchUp(300)) == "300s"
    assert str(CatchUp("none")) == "none"


def test_the_grace_is_the_skew_and_at_least_a_second() -> None:
    assert grace(0.0) == 1.0
    assert grace(2.5) == 2.5


def test_the_documented_schedule_gives_each_entry_the_choice_the_page_says() -> None:
    app = Celery("docs", broker="memory://", set_as_current=False)
    exec(documented_python("beat.md", "## When no beat ran"), {"app": app, "crontab": crontab})
    default = read_beat_options(app.conf).catch_up
    choices = {
        name: catch_up_of(entry.get("options"), default)
        for name, entry in app.conf.beat_schedule.items()
    }
    assert choices == {
        "nightly-report": (CatchUp(21600), ""),
        "refresh-cache": (CatchUp("none"), ""),
    }
    assert default == "latest"
