"""``celery singleton beat status|run|pause|resume`` against real running beats.

Two active beats of tests/support/catch_up_app.py (three 2 s interval entries, published with
``send_task``, no worker) run for the whole module; the verbs run as real ``celery`` processes.
What the beats published is read from their logs (``beat: published run: ...``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_singleton_lock.core.keys import beat_entry_key, beat_group_key
from tests.support.beats import BeatFactory, BeatProcess, Published
from tests.support.cli import app_env, singleton_cli
from tests.support.documented import documented_block
from tests.support.waiting import wait_for
from tests.support.workers import REPO_ROOT

APP = "tests.support.catch_up_app"
GROUP = APP  # the app's main name
STEP_MS = 2000


class Beats:
    """The module's beats and where they keep their keys."""

    def __init__(self, factory: BeatFactory, redis_url: str, prefix: str) -> None:
        self.factory, self.redis_url, self.prefix = factory, redis_url, prefix
        self.beats: list[BeatProcess] = [factory.start(APP, name=f"b{i}") for i in (1, 2)]
        for beat in self.beats:
            beat.wait_for_log(r"beat: published run: entry=", 30)

    def published(self, entry: str) -> list[Published]:
        return sorted(
            (p for beat in self.beats for p in beat.published() if p.entry == entry),
            key=lambda p: p.ts,
        )

    def nominal_runs(self, entry: str) -> list[int]:
        return sorted(int(p.run) for p in self.published(entry) if p.run.isdigit())

    def logs(self) -> str:
        return self.factory.logs(60)


def celery(url: str, prefix: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``celery -A tests.support.catch_up_app singleton beat <args>`` as a real process."""
    return singleton_cli(APP, app_env(url, prefix), "beat", *args)


@pytest.fixture(scope="module")
def beats(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, module_prefix: str
) -> Iterator[Beats]:
    factory = BeatFactory(
        Path(tmp_path_factory.mktemp("beat-verbs")),
        base_env={"SINGLETON_TEST_REDIS_URL": redis_url, "SINGLETON_TEST_PREFIX": module_prefix},
    )
    try:
        yield Beats(factory, redis_url, module_prefix)
    finally:
        factory.close()


def verb(beats: Beats, *args: str) -> subprocess.CompletedProcess[str]:
    return celery(beats.redis_url, beats.prefix, *args)


def lock_prefix(prefix: str) -> str:
    return prefix + "lock:"  # catch_up_app's singleton_key_prefix


@pytest.mark.slow(seconds=5)
def test_status_shows_each_entry_its_last_run_the_beat_that_published_it_and_the_next(
    beats: Beats,
) -> None:
    """``status --json``: the three entries with their task, schedule and catch-up choice; each
    one's last run is a run a beat logged as published (its task id, its instance); the next
    due time is the next 2 s slot after it; the two beats are listed. The table says the same."""
    done = verb(beats, "status", "--json")
    assert done.returncode == 0, done.stderr
    status = json.loads(done.stdout)
    assert status["group"] == GROUP
    instances = {b["instance"] for b in status["beats"]}
    assert len(instances) == 2, status["beats"]
    rows = {row["entry"]: row for row in status["entries"]}
    assert set(rows) == {"default", "none", "window"}
    assert {r["catch_up"] for r in rows.values()} == {"latest", "none", "5s"}
    published = {p.task_id: p for entry in rows for p in beats.published(entry)}
    for name, row in rows.items():
        assert (row["task"], row["schedule"], row["paused"]) == (
            "catch_up.remote",
            "every 2s",
            None,
        )
        assert row["last_run_by"] in instances, row
        run = published.get(row["task_id"])
        assert run is not None, (row, beats.logs())
        assert run.entry == name, (row, run)
        last = time.strptime(row["last_run"], "%Y-%m-%dT%H:%M:%SZ")
        assert row["last_run"] == time.strftime(
            "%Y-%m-%dT%H:%M:%SZ", time.gmtime(int(run.run) / 1000)
        )
        nxt = time.strptime(row["next_due"], "%Y-%m-%dT%H:%M:%SZ")
        assert time.mktime(nxt) > time.mktime(last), row
    table = verb(beats, "status")
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0] == f"beat group {GROUP}: 2 beat(s) publishing in the last hour"
    header = next(i for i, line in enumerate(lines) if line.startswith("ENTRY\t"))
    assert [line.split("\t")[0] for line in lines[header + 1 :]] == ["default", "none", "window"]
    states = [line.split("\t")[-1] for line in lines[header + 1 :]]
    assert all(state.startswith("active") for state in states), table.stdout


@pytest.mark.slow(seconds=20)
def test_a_paused_entry_is_skipped_by_every_beat_until_resumed_and_not_caught_up(
    beats: Beats, redis_client: redis.Redis
) -> None:
    """``pause none``: from the next slot on, neither beat publishes a scheduled run of
    ``none`` (each logs it paused), the other entries go on; ``status`` shows who paused it;
    a ``run none`` still goes out. ``resume none``: its runs are published again from the
    next slot, and none of the slots skipped while paused."""
    done = verb(beats, "pause", "none")
    assert done.returncode == 0, done
    assert done.stdout.startswith("paused: entry=none by="), done
    paused_at_ms = int(time.time() * 1000)
    first_skipped = (paused_at_ms // STEP_MS + 1) * STEP_MS
    again = verb(beats, "pause", "none")
    assert again.stdout.startswith("already paused: entry=none"), again
    wait_for(
        lambda: any(
            f"entry paused, run not published: entry=none run={first_skipped + STEP_MS}"
            in beat.log_text()
            for beat in beats.beats
        ),
        15,
        "two slots of none passed over",
    )
    row = next(
        r
        for r in json.loads(verb(beats, "status", "--json").stdout)["entries"]
        if r["entry"] == "none"
    )
    assert row["paused"] is not None, row
    assert "@" in row["paused"]["by"], row
    asked = verb(beats, "run", "none")
    assert asked.returncode == 0, asked
    assert asked.stdout.startswith("published: entry=none run=ask-"), asked
    resume_called_ms = int(time.time() * 1000)  # a run due before this was due while paused
    resumed = verb(beats, "resume", "none")
    assert resumed.stdout == "resumed: entry=none\n", resumed
    resumed_at_ms = int(time.time() * 1000)
    assert verb(beats, "resume", "none").stdout == "not paused: entry=none\n"
    wait_for(
        lambda: any(r > resumed_at_ms for r in beats.nominal_runs("none")),
        15,
        "a run of none after the resume",
    )
    runs = beats.nominal_runs("none")
    during = [r for r in runs if first_skipped <= r <= resume_called_ms]
    assert during == [], (during, beats.logs())
    after = [r for r in runs if r > resumed_at_ms]
    assert after[0] <= (resumed_at_ms // STEP_MS + 2) * STEP_MS, (after, beats.logs())
    for other in ("default", "window"):
        assert any(first_skipped <= r <= resume_called_ms for r in beats.nominal_runs(other))
    assert not redis_client.exists(beat_entry_key(lock_prefix(beats.prefix), "none", "paused"))


@pytest.mark.slow(seconds=10)
def test_run_asked_by_two_operators_at_once_goes_out_once_from_one_beat(beats: Beats) -> None:
    """Two ``run window`` at once (the second within the first's timeout): both report the
    same published task id; across the two beats one message of the asked run went out."""
    env = {
        **os.environ,
        "SINGLETON_TEST_REDIS_URL": beats.redis_url,
        "SINGLETON_TEST_PREFIX": beats.prefix,
    }
    command = [sys.executable, "-m", "celery", "-A", APP, "singleton", "beat", "run", "window"]
    procs = [
        subprocess.Popen(
            command,
            cwd=REPO_ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outs = [proc.communicate(timeout=60) for proc in procs]
    assert all(proc.returncode == 0 for proc in procs), outs
    task_ids = {
        line.rsplit("task_id=", 1)[1].split()[0]
        for out, _err in outs
        for line in out.splitlines()
        if "task_id=" in line
    }
    assert len(task_ids) == 1, outs
    asked = [p for p in beats.published("window") if p.run.startswith("ask-")]
    assert [p.task_id for p in asked if p.task_id in task_ids] == list(task_ids), (
        asked,
        beats.logs(),
    )


@pytest.mark.slow(seconds=5)
@pytest.mark.parametrize("args", [["run", "nosuch"], ["pause", "nosuch"], ["resume", "nosuch"]])
def test_an_entry_not_in_the_schedule_is_refused_and_nothing_written(
    beats: Beats, redis_client: redis.Redis, args: list[str]
) -> None:
    done = verb(beats, *args)
    assert done.returncode == 1, done
    assert "no entry 'nosuch' in the schedule of beat group" in done.stderr, done.stderr
    assert "default, none, window" in done.stderr
    prefix = lock_prefix(beats.prefix)
    assert not redis_client.exists(beat_entry_key(prefix, "nosuch", "paused"))
    assert not redis_client.hexists(beat_group_key(prefix, GROUP, "asks"), "nosuch")


@pytest.mark.slow(seconds=8)
def test_without_a_running_beat_run_fails_and_pause_holds_for_the_next_beat(
    redis_url: str, key_prefix: str, redis_client: redis.Redis
) -> None:
    """No beat on this prefix: the entries come from the app's ``beat_schedule``. ``run`` fails
    after its timeout, nothing published and its ask gone; ``pause`` is kept for the beats to
    come; ``status`` lists the entries, none registered by a beat."""
    done = celery(redis_url, key_prefix, "run", "default", "--timeout", "1")
    assert done.returncode == 1, done
    assert "took the run of default within 1s: nothing was published" in done.stderr
    prefix = lock_prefix(key_prefix)
    assert not redis_client.exists(beat_group_key(prefix, GROUP, "asks"))
    paused = celery(redis_url, key_prefix, "pause", "window")
    assert paused.returncode == 0, paused
    assert redis_client.exists(beat_entry_key(prefix, "window", "paused"))
    status: dict[str, Any] = json.loads(celery(redis_url, key_prefix, "status", "--json").stdout)
    assert status["beats"] == []
    assert [(r["entry"], r["registered"], r["paused"] is not None) for r in status["entries"]] == [
        ("default", False, False),
        ("none", False, False),
        ("window", False, True),
    ]


@pytest.mark.slow(seconds=8)
def test_the_documented_commands_run_as_shown(beats: Beats) -> None:
    """docs/beat.md, "Steering a running schedule": each command, on this module's app and its
    entry ``window`` for the page's ``nightly-report``, exits 0."""
    block = documented_block("beat.md", "## Steering a running schedule", "bash")
    commands = [line.split("#", 1)[0].split() for line in block.splitlines() if line.strip()]
    assert [c[:4] for c in commands] == [["celery", "-A", "proj", "singleton"]] * 4, block
    for command in commands:
        args = ["window" if a == "nightly-report" else a for a in command[4:]]
        assert args[0] == "beat", command
        done = verb(beats, *args[1:])
        assert done.returncode == 0, (command, done)
