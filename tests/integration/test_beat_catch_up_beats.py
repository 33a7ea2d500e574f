"""Catch-up after downtime with real ``celery beat`` processes (tests/support/catch_up_app.py:
2 s interval entries, one per choice). A beat publishes, every beat stops for several slots,
then a beat starts again: on the schedule file it kept, on an empty one (another node), or two
at once. The runs published are read from the beats' logs (no worker runs) and checked against
what each choice says (tests/support/catch_up_checks.py)."""

from __future__ import annotations

import time

import pytest

from tests.support.beats import BeatFactory
from tests.support.catch_up_app import CHOICES
from tests.support.catch_up_checks import check_after_restart, published_twice_then_stop

APP = "tests.support.catch_up_app"
#: how long every beat stays down: several slots
DOWN_S = 9.0


def run_then_stop(beat_factory: BeatFactory, name: str) -> dict[str, int]:
    """Beat ``name`` publishes each entry at least twice, then stops (SIGTERM, its schedule
    file written); the last run it published of each entry."""
    beat = beat_factory.start(APP, name=name)
    return published_twice_then_stop(beat, list(CHOICES))


@pytest.mark.slow(seconds=30)
@pytest.mark.parametrize("file", ["kept", "empty"])
def test_a_beat_back_after_downtime_publishes_what_each_choice_says(
    beat_factory: BeatFactory, file: str
) -> None:
    """The same on the schedule file the beat kept as on an empty disk."""
    before = run_then_stop(beat_factory, "first")
    time.sleep(DOWN_S)  # every beat down for several slots
    schedule = "first" if file == "kept" else None
    again = beat_factory.start(APP, name="again", schedule_file=schedule)
    check_after_restart(beat_factory, CHOICES, before, [again])


@pytest.mark.slow(seconds=30)
def test_two_beats_back_after_downtime_publish_each_run_once(beat_factory: BeatFactory) -> None:
    """One on the file it kept, one on an empty disk, at once."""
    before = run_then_stop(beat_factory, "first")
    time.sleep(DOWN_S)
    pair = [
        beat_factory.start(APP, name="kept", schedule_file="first"),
        beat_factory.start(APP, name="fresh"),
    ]
    check_after_restart(beat_factory, CHOICES, before, pair)
