"""Catch-up after downtime with real ``celery beat`` processes (tests/support/catch_up_app.py:
2 s interval entries, one per choice). A beat publishes, every beat stops for several slots,
then a beat starts again: on the schedule file it kept, on an empty one (another node), or two
at once. The runs published are read from the beats' logs (no worker runs) and checked against
what each choice says, computed here from the instant the beat logged it started to watch its
entries (``beat: watching entries: ... since=<ms>``)."""

from __future__ import annotations

import re
import time
from collections import Counter

import pytest

from tests.support.beats import BeatFactory, BeatProcess, Published
from tests.support.catch_up_app import CHOICES
from tests.support.waiting import wait_for

APP = "tests.support.catch_up_app"
STEP_MS = 2000
#: a run within this long of the instant a beat starts to watch is due, not missed
GRACE_MS = 1000
#: how long every beat stays down: several slots
DOWN_S = 9.0
_SINCE = re.compile(r"beat: watching entries: new=\d+ since=(\d+)")


def published(*beats: BeatProcess) -> list[Published]:
    return [p for beat in beats for p in beat.published()]


def runs_of(entry: str, found: list[Published]) -> list[int]:
    return sorted(int(p.run) for p in found if p.entry == entry)


def since_of(beat: BeatProcess) -> int:
    """The instant (epoch ms) ``beat`` started to watch its entries."""
    beat.wait_for_log(_SINCE.pattern, 30)
    match = _SINCE.search(beat.log_text())
    assert match is not None
    return int(match.group(1))


def expected_on_sight(choice: str | float | None, last_ms: int, since_ms: int) -> list[int]:
    """The runs a beat starting to watch at ``since_ms`` publishes at once, the entry's last
    published run being ``last_ms``: the due one (within the grace), and the missed ones its
    choice picks."""
    slots = range(last_ms + STEP_MS, since_ms + 1, STEP_MS)
    due = [s for s in slots if s >= since_ms - GRACE_MS]
    missed = [s for s in slots if s < since_ms - GRACE_MS]
    if choice == "none":
        return due
    if choice is None:  # the app's default: latest
        return missed[-1:] + due
    assert isinstance(choice, float)
    return [s for s in missed if s >= since_ms - choice * 1000] + due


def run_then_stop(beat_factory: BeatFactory, name: str) -> dict[str, int]:
    """Beat ``name`` publishes each entry at least twice, then stops (SIGTERM, its schedule
    file written); the last run it published of each entry."""
    beat = beat_factory.start(APP, name=name)
    wait_for(
        lambda: all(len(runs_of(e, beat.published())) >= 2 for e in CHOICES),
        30,
        "every entry published twice",
        beat,
        interval=0.2,
    )
    assert beat.terminate() == 0
    return {entry: runs_of(entry, beat.published())[-1] for entry in CHOICES}


def check_after_restart(
    beat_factory: BeatFactory, before: dict[str, int], restarted: list[BeatProcess]
) -> None:
    """Every restarted beat's sight published what the choice says (from the earliest one's
    instant), then every slot came on time, each run once across all beats."""
    since = min(since_of(beat) for beat in restarted)
    end_ms = since + 3 * STEP_MS
    wait_for(
        lambda: all(runs_of(e, published(*restarted))[-1:] >= [end_ms - STEP_MS] for e in CHOICES),
        30,
        "the runs after the restart",
        *restarted,
        interval=0.2,
    )
    after = published(*restarted)
    logs = beat_factory.logs(120)
    counts = Counter((p.entry, p.run) for p in after)
    assert max(counts.values()) == 1, f"a run published twice: {counts}\n{logs}"
    for entry, choice in CHOICES.items():
        runs = runs_of(entry, after)
        on_sight = [r for r in runs if r <= since]
        assert on_sight == expected_on_sight(choice, before[entry], since), (
            f"{entry} ({choice}): last {before[entry]}, since {since}: {runs}\n{logs}"
        )
        later = [r for r in runs if since < r <= end_ms - STEP_MS]
        first_later = (since // STEP_MS + 1) * STEP_MS
        assert later == list(range(first_later, end_ms - STEP_MS + 1, STEP_MS)), (
            f"{entry}: not on time after the restart: {runs}\n{logs}"
        )


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
    check_after_restart(beat_factory, before, [again])


@pytest.mark.slow(seconds=30)
def test_two_beats_back_after_downtime_publish_each_run_once(beat_factory: BeatFactory) -> None:
    """One on the file it kept, one on an empty disk, at once."""
    before = run_then_stop(beat_factory, "first")
    time.sleep(DOWN_S)
    pair = [
        beat_factory.start(APP, name="kept", schedule_file="first"),
        beat_factory.start(APP, name="fresh"),
    ]
    check_after_restart(beat_factory, before, pair)
