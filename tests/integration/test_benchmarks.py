"""The benchmarks still measure what they say: a smoke run of the fast sections, checked for
what does not depend on timing (the rows, the Redis traffic, the floors' likeness to what they
stand for). Timing targets are read from ``python -m benchmarks.run``, never asserted here.

A benchmark whose floor row drifted from the library (its hand-built script arguments no longer
matching ``acquire.lua``) once measured nothing for a day; this test catches that kind of
breakage in CI, with the peers from the test extra.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _column(table: dict[str, Any], header: str) -> dict[str, Any]:
    index = table["headers"].index(header)
    return {row[0]: row[index] for row in table["rows"]}


@pytest.mark.slow(seconds=45)
def test_the_fast_sections_run_and_count_what_they_claim(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    done = subprocess.run(
        [
            sys.executable,
            *("-m", "benchmarks.run", "--quick", "--no-plot"),
            *("--only", "lock", "work", "contention", "rejections"),
            *("--json", str(out)),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    tables = {t["title"].split(".")[0]: t for t in json.loads(out.read_text())["tables"]}
    assert set(tables) == {"1", "2c", "4", "7"}, list(tables)

    # 1: every contender timed; ours in one round trip when the release rides on the acquire
    cycle = _column(tables["1"], "µs/cycle (median)")
    assert all(us > 0 for us in cycle.values()), cycle
    assert "celery-singleton-lock, release in next acquire" in cycle
    for row in ("3 permits (2 held)", "10 permits (9 held)", "coalesce: release + look for a"):
        assert any(row in name for name in cycle), (row, cycle)

    # 2c: the floor sends exactly SingletonTask's Redis traffic, with (almost) none of its Python
    commands = _column(tables["2c"], "Redis cmds/task")
    library = _column(tables["2c"], "of it in celery_singleton_lock")
    floor = "plain + SingletonTask's Redis traffic (floor, no library Python)"
    assert commands[floor] == commands["SingletonTask"] > commands["plain Task"], commands
    assert library["SingletonTask"] > 10 * library[floor], library
    assert commands["plain + 1 PING (floor, 1 round trip)"] == commands["plain Task"] + 1
    # 2c: the completion record adds no call to the run's path: the same two script
    # calls (acquire, deferred release); release.lua's GET and SET run inside the release
    scripts = _column(tables["2c"], "of them script calls")
    late = "SingletonTask acked late (+ completion record)"
    assert scripts[late] == scripts["SingletonTask"] == 2, scripts
    assert commands[late] == commands["SingletonTask"] + 2, commands
    # a scope adds nothing on the wire; permits read their slots in the one acquire;
    # a coalescing run releases in its own call and looks for a follow-up in one more
    assert commands["SingletonTask with singleton_scope"] == commands["SingletonTask"]
    assert commands["SingletonTask with singleton_permits=3"] > commands["SingletonTask"]
    assert commands["SingletonTask with coalesce (no duplicate)"] > commands["SingletonTask"]

    # 4: our acquire is one round trip per attempt (a retried NOSCRIPT aside)
    trips = _column(tables["4"], "round trips/attempt")
    assert 1.0 <= trips["celery-singleton-lock (LockStore)"] < 1.2, trips

    # 7: a rejected publish is one script call (its inner commands counted with it)
    per_call = _column(tables["7"], "Redis cmds/call")
    ours = [name for name in per_call if name.startswith("SingletonTask, lock_on=publish")]
    assert len(ours) == 2, per_call
    assert all(2 <= per_call[name] <= 3.01 for name in ours), per_call
    assert per_call["one PING per call (floor: a round trip)"] == 1


def test_the_rate_check_adds_no_round_trip() -> None:
    """Section 1b's counts (benchmarks/rate.py, on a private server as it runs): a lock cycle
    under a rate is as many round trips as one without, a start under a rate alone one;
    celery-heimdall's check two."""
    from benchmarks import rate
    from benchmarks.server import PrivateRedis

    with PrivateRedis() as server:
        trips = {name: rate.round_trips(server.url, name, calls=20) for name in rate.CONTENDERS}
    assert trips[rate.OURS_LOCK_RATE] == trips[rate.OURS_LOCK] == 2
    assert trips[rate.OURS_RATE] == trips[rate.OURS_OVER] == 1
    assert trips[rate.HEIMDALL] == 2


@pytest.mark.slow(seconds=25)
def test_the_queue_burst_keeps_arrival_order_and_polls_nothing(tmp_path: Path) -> None:
    """Section 9: under "queue" every call of the burst runs in the order it reached the key,
    and each sends two messages in all (its own, and its turn's), none to poll; "retry" polls."""
    out = tmp_path / "bench.json"
    done = subprocess.run(
        [
            sys.executable,
            *("-m", "benchmarks.run", "--quick", "--no-plot", "--only", "queue_burst"),
            *("--json", str(out)),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (table,) = json.loads(out.read_text())["tables"]
    order = _column(table, "runs in the order sent (of 20)")
    messages = _column(table, "broker messages per call")
    queue, retry = '"queue"', '"retry" (countdown 0.5 s)'
    assert order[queue] == "20 to 20", order
    assert messages[queue] == 2.0, messages
    assert messages[retry] > messages[queue], messages
