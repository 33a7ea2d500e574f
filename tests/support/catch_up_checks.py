"""What real beats published after a downtime, checked against each catch-up choice.

The runs are read from the beats' logs (``beat: published run: ...``) and the instant a beat
started to watch its entries from ``beat: watching entries: ... since=<ms>``. What a choice
publishes is computed here, independently of beat/catch_up.py, for entries every
:data:`STEP_MS` (2 s interval entries, as tests/support/catch_up_app.py and the Django test
have): the run due within :data:`GRACE_MS` of that instant, and the missed ones the choice
picks; then every slot on time, each run once across the beats.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping, Sequence

from tests.support.beats import BeatFactory, BeatProcess, Published
from tests.support.waiting import wait_for

__test__ = False

STEP_MS = 2000
#: a run within this long of the instant a beat starts to watch is due, not missed (the
#: default skew, 1 s)
GRACE_MS = 1000
_SINCE = re.compile(r"beat: watching entries: new=\d+ since=(\d+)")


def published(*beats: BeatProcess) -> list[Published]:
    return [p for beat in beats for p in beat.published()]


def runs_of(entry: str, found: list[Published]) -> list[int]:
    return sorted(int(p.run) for p in found if p.entry == entry)


def since_of(beat: BeatProcess) -> int:
    """The instant (epoch ms) ``beat`` started to watch its entries (its first sight)."""
    beat.wait_for_log(_SINCE.pattern, 30)
    match = _SINCE.search(beat.log_text())
    assert match is not None
    return int(match.group(1))


def expected_on_sight(choice: str | float | None, last_ms: int, since_ms: int) -> list[int]:
    """The runs a beat starting to watch at ``since_ms`` publishes at once, the entry's last
    published run being ``last_ms``: the missed ones its choice (None: the app's default,
    "latest") picks, then the due one."""
    slots = range(last_ms + STEP_MS, since_ms + 1, STEP_MS)
    due = [s for s in slots if s >= since_ms - GRACE_MS]
    missed = [s for s in slots if s < since_ms - GRACE_MS]
    if choice == "none":
        return due
    if choice is None or choice == "latest":
        return missed[-1:] + due
    assert isinstance(choice, float)
    return [s for s in missed if s >= since_ms - choice * 1000] + due


def published_twice_then_stop(beat: BeatProcess, entries: Sequence[str]) -> dict[str, int]:
    """Once ``beat`` published each of ``entries`` twice, stop it (SIGTERM: its schedule
    written); the last run it published of each."""
    wait_for(
        lambda: all(len(runs_of(e, beat.published())) >= 2 for e in entries),
        30,
        "every entry published twice",
        beat,
        interval=0.2,
    )
    assert beat.terminate() == 0
    return {entry: runs_of(entry, beat.published())[-1] for entry in entries}


def check_after_restart(
    beat_factory: BeatFactory,
    choices: Mapping[str, str | float | None],
    before: Mapping[str, int],
    restarted: list[BeatProcess],
) -> None:
    """What the ``restarted`` beats published as they came back: each entry's choice from the
    earliest one's first sight (a later one's picks are the same runs, or later ones the
    earliest publishes anyway), then every slot on time, each run once across the beats."""
    since = min(since_of(beat) for beat in restarted)
    end_ms = since + 3 * STEP_MS
    wait_for(
        lambda: all(runs_of(e, published(*restarted))[-1:] >= [end_ms - STEP_MS] for e in choices),
        30,
        "the runs after the restart",
        *restarted,
        interval=0.2,
    )
    after = published(*restarted)
    logs = beat_factory.logs(120)
    counts = Counter((p.entry, p.run) for p in after)
    assert max(counts.values()) == 1, f"a run published twice: {counts}\n{logs}"
    for entry, choice in choices.items():
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
