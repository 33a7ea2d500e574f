"""Catch-up of crontab entries with real ``celery beat`` processes (tests/support/catch_up_app.py
with ``SINGLETON_TEST_CATCH_UP=cron``: every-minute entries, one per choice, the window 150 s).

A beat publishes minute M and stops. No beat runs through minute M+1. Two beats start 25 s
into M+1: one on the schedule file the first kept, one on an empty disk. M+1 was missed, so
the default ("latest") and the window publish it at once and "none" does not. Then minute
M+2 comes on time for every entry, each run once. The test waits on real minutes: about
2.5 minutes, most of them asleep.
"""

from __future__ import annotations

import time
from collections import Counter

import pytest

from tests.support.beats import BeatFactory
from tests.support.catch_up_app import CHOICES
from tests.support.catch_up_checks import published, runs_of, since_of
from tests.support.waiting import wait_for

APP = "tests.support.catch_up_app"
CRON = {"SINGLETON_TEST_CATCH_UP": "cron"}
MINUTE_MS = 60_000


@pytest.mark.slow(seconds=170)
def test_crontab_entries_back_after_a_missed_minute(beat_factory: BeatFactory) -> None:
    first = beat_factory.start(APP, env=CRON, name="first")
    wait_for(
        lambda: all(runs_of(e, first.published()) for e in CHOICES),
        75,
        "a minute's runs",
        first,
        interval=0.5,
    )
    assert first.terminate() == 0
    minute = max(runs_of(e, first.published())[-1] for e in CHOICES)
    # no beat runs through the next minute; two start 25 s into the one after
    time.sleep(max(0.0, (minute + MINUTE_MS + 25_000) / 1000 - time.time()))
    pair = [
        beat_factory.start(APP, env=CRON, name="kept", schedule_file="first"),
        beat_factory.start(APP, env=CRON, name="fresh"),
    ]
    since = min(since_of(beat) for beat in pair)
    assert minute + MINUTE_MS + 1000 < since < minute + 2 * MINUTE_MS, "started in M+1"
    next_minute = minute + 2 * MINUTE_MS
    wait_for(
        lambda: all(next_minute in runs_of(e, published(*pair)) for e in CHOICES),
        75,
        "minute M+2's runs",
        *pair,
        interval=0.5,
    )
    after = published(*pair)
    logs = beat_factory.logs(80)
    assert max(Counter((p.entry, p.run) for p in after).values()) == 1, logs
    expected = {
        "default": [minute + MINUTE_MS, next_minute],
        "none": [next_minute],
        "window": [minute + MINUTE_MS, next_minute],
    }
    assert {e: runs_of(e, after) for e in CHOICES} == expected, logs
