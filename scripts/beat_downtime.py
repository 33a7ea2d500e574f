#!/usr/bin/env python3
"""What a beat does about scheduled runs whose time passed while no beat ran.

A measurement tool for contributors (not part of the test suite). It starts REAL
``celery beat`` processes (``python -m celery -A beat_downtime beat ...``), stops them for a
while, starts them again and reads, from their own log lines, which runs they published and
when. Run it from anywhere with the project's venv::

    python scripts/beat_downtime.py                 # everything, about 8 minutes
    python scripts/beat_downtime.py --schedules interval --schedulers plain   # about 3 minutes
    python scripts/beat_downtime.py --json out.json --logs /tmp/bd-logs
    python scripts/beat_downtime.py --table-from out.json     # the table again, no beats

and it prints a markdown table (scripts/beat_downtime.md has one, with the conclusions).

Every scenario is one schedule entry, one scheduler and one way of coming back:

- schedule ``interval``: an entry every 5 s; ``crontab``: ``crontab()``, every minute;
- scheduler ``plain``: Celery's own PersistentScheduler; ``singleton``:
  ``celery_singleton_lock.SingletonScheduler``;
- ``A``: the beat is stopped (SIGTERM, or SIGKILL in the ``A-kill`` rows) and started again
  with the schedule file it had (``-s file``: the shelve PersistentScheduler keeps
  ``last_run_at`` in); ``B``: the same downtime, then a FRESH beat with a new, empty schedule
  file (a rescheduled container with an empty disk).

The timeline of a scenario:

1. beat 1 starts with a new schedule file and runs until it has published 2 runs (interval)
   or 1 run (crontab); it is stopped 1 s (interval) or 5 s (crontab) after its last run;
2. downtime: 5 slot boundaries (interval) or 3 minute boundaries (crontab) pass;
3. beat 2 starts so that it is ready ("beat: Starting..." logged) 1.5 s after a slot boundary
   (interval) or ~20 s into a minute (crontab), with beat 1's file (A) or a new one (B);
4. beat 2 runs for 3 more periods (interval) or 2 more minutes (crontab), then is stopped.

What is measured (times from the beats' own log lines, millisecond precision):

- the *grid* a scenario is measured against: for a crontab, the minutes; for the singleton
  scheduler's interval, the epoch-aligned 5 s slots it fires on; for plain Celery's interval,
  the cadence beat 1 had (its last run + k * 5 s: plain beat runs an interval ``run_every``
  after each ``last_run_at``, so it has no grid of its own);
- "missed": the grid's instants during the downtime (after beat 1 stopped, up to beat 2's
  start);
- "published for the downtime": the runs beat 2 published after it started and BEFORE the
  first grid instant after its start (a run published at or after that instant is that
  instant's own run);
- the first run after the restart, in seconds from beat 2's start ("beat: Starting...") and
  from the first grid instant after it; the runs after it: on the grid, or shifted (by how
  much, and how far apart);
- in A, the ``last_run_at`` that beat 1's schedule file held when beat 2 started (read with
  :mod:`shelve` between the two beats), relative to beat 1's stop;
- as a check, the messages beat 2 left in its broker queue (no worker runs): they must be as
  many as the runs its log shows.

The scenarios run in parallel: the crontab ones all at once (each needs about 7 minutes), the
interval ones one after the other beside them. Every beat uses a private Redis server started
here (``celery_singleton_lock._dev.server.DevServer``) as broker and lock store, with a key
prefix of its scenario's own; nothing else is touched.

The same file is the beats' Celery app: imported by ``celery -A beat_downtime`` with
``BEAT_DOWNTIME_SCHEDULE`` set, it builds ``app`` from the ``BEAT_DOWNTIME_*`` variables
(see :func:`make_beat_app`).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import re
import shelve
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

SCRIPTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = SCRIPTS_DIR.parent
if str(REPO_ROOT) not in sys.path:  # use this checkout's celery_singleton_lock
    sys.path.insert(0, str(REPO_ROOT))

# --------------------------------------------------------------------------------------------
# The beats' Celery app (used by the beat subprocesses only)
# --------------------------------------------------------------------------------------------

#: the entry of each schedule: name and its ``schedule`` (built in make_beat_app)
ENTRY_NAMES = {"interval": "every-5s", "crontab": "every-minute"}
INTERVAL_S = 5.0
TASK_NAME = "beat_downtime.tick"  # registered nowhere: beat publishes it with send_task


def make_beat_app() -> Any:
    """The Celery app of a beat subprocess, from its environment.

    - ``BEAT_DOWNTIME_SCHEDULE``: ``interval`` (one entry, every 5 s) or ``crontab`` (one
      entry, ``crontab()``: every minute);
    - ``BEAT_DOWNTIME_REDIS``: the broker URL, also the singleton scheduler's lock store;
    - ``BEAT_DOWNTIME_PREFIX``: the prefix of every broker key (kombu's ``global_keyprefix``)
      and of the singleton scheduler's keys;
    - ``BEAT_DOWNTIME_QUEUE``: the queue the runs are published to.

    ``result_expires`` is off so that Celery adds no ``celery.backend_cleanup`` entry.
    """
    from celery import Celery
    from celery.schedules import crontab

    kind = os.environ["BEAT_DOWNTIME_SCHEDULE"]
    url = os.environ["BEAT_DOWNTIME_REDIS"]
    prefix = os.environ["BEAT_DOWNTIME_PREFIX"]
    schedule: Any = INTERVAL_S if kind == "interval" else crontab()
    app = Celery("beat_downtime")
    app.conf.update(
        broker_url=url,
        broker_transport_options={"global_keyprefix": prefix},
        broker_connection_retry_on_startup=True,
        task_default_queue=os.environ["BEAT_DOWNTIME_QUEUE"],
        result_expires=None,
        timezone="UTC",
        enable_utc=True,
        singleton_redis_url=url,
        singleton_key_prefix=prefix + "lock:",
        beat_schedule={
            ENTRY_NAMES[kind]: {"task": TASK_NAME, "schedule": schedule, "args": (kind,)},
        },
    )
    return app


if os.environ.get("BEAT_DOWNTIME_SCHEDULE"):  # imported by `celery -A beat_downtime`
    app = make_beat_app()


# --------------------------------------------------------------------------------------------
# Starting and reading beats
# --------------------------------------------------------------------------------------------

SCHEDULERS = {
    "plain": "celery.beat:PersistentScheduler",
    "singleton": "celery_singleton_lock.SingletonScheduler",
}

_LINE = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}): (\w+)/[\w-]+\] (.*)$")
#: a run published: plain Celery's line (every scheduler logs it) and the singleton's own
_SENDING = re.compile(r"Scheduler: Sending due task (\S+) ")
_PUBLISHED = re.compile(r"beat: published run: entry=(\S+) run=(\d+) task_id=(\S+)")
_READY = "beat: Starting..."


@dataclass(frozen=True)
class LogRun:
    """A run a beat logged as published: when (epoch s) and, for the singleton scheduler, its
    run id (the nominal instant it claimed the run under, epoch s)."""

    ts: float
    run_id: float | None = None


def log_lines(text: str) -> list[tuple[float, str]]:
    """(epoch seconds, message) of every timestamped line of a Celery log.

    Celery logs local time with milliseconds; ``datetime.timestamp`` reads it back as local.
    """
    found = []
    for raw in text.splitlines():
        match = _LINE.match(raw.strip("\x00 "))
        if match:
            stamp, _level, message = match.groups()
            ts = datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()
            found.append((ts, message))
    return found


class Beat:
    """One ``celery beat`` subprocess (a DevProcess: own session, log file, killed at exit)."""

    def __init__(
        self,
        name: str,
        *,
        work_dir: Path,
        schedule_file: Path,
        schedule: str,
        scheduler: str,
        redis_url: str,
        prefix: str,
        queue: str,
    ) -> None:
        from celery_singleton_lock._dev.process import DevProcess

        args = [
            sys.executable, "-m", "celery", "-A", "beat_downtime", "beat",
            "-S", SCHEDULERS[scheduler], "-s", str(schedule_file),
            "--max-interval", "1", "--loglevel", "INFO",
        ]  # fmt: skip
        path = os.pathsep.join(
            p for p in (str(REPO_ROOT), str(SCRIPTS_DIR), os.environ.get("PYTHONPATH")) if p
        )
        env = {
            "PYTHONPATH": path,
            "BEAT_DOWNTIME_SCHEDULE": schedule,
            "BEAT_DOWNTIME_REDIS": redis_url,
            "BEAT_DOWNTIME_PREFIX": prefix,
            "BEAT_DOWNTIME_QUEUE": queue,
        }
        self.scheduler = scheduler
        self.launched_at = time.time()
        self.proc = DevProcess(args, work_dir / f"{name}.log", name=name, env=env, cwd=REPO_ROOT)
        self.stopped_at: float | None = None

    def wait_ready(self, timeout: float = 60.0) -> float:
        """Wait for "beat: Starting..."; return its log time."""
        self.proc.wait_for_log(re.escape(_READY), timeout)
        return next(ts for ts, msg in log_lines(self.proc.log_text()) if msg.startswith(_READY))

    def runs(self) -> list[LogRun]:
        """The runs this beat logged as published, in order."""
        found = []
        for ts, message in log_lines(self.proc.log_text()):
            if self.scheduler == "singleton":
                match = _PUBLISHED.search(message)
                if match:
                    found.append(LogRun(ts, int(match.group(2)) / 1000))
            elif _SENDING.search(message):
                found.append(LogRun(ts))
        return found

    def wait_runs(self, count: int, timeout: float) -> list[LogRun]:
        """Wait until the beat has published ``count`` runs; return them all."""
        deadline = time.monotonic() + timeout
        while len(runs := self.runs()) < count:
            if time.monotonic() > deadline or not self.proc.is_running():
                raise TimeoutError(f"{self.proc.name}: {len(runs)} runs\n{self.proc.log_tail()}")
            time.sleep(0.1)
        return runs

    def stop(self, how: str) -> float:
        """SIGTERM (beat syncs its schedule file and exits) or SIGKILL; return when."""
        self.stopped_at = time.time()
        if how == "SIGKILL":
            self.proc.kill()
        else:
            self.proc.terminate(timeout=15)
        return self.stopped_at


def stored_last_run_at(schedule_file: Path, entry: str) -> float | None:
    """The entry's ``last_run_at`` in a PersistentScheduler shelve (epoch s), or None."""
    try:
        with shelve.open(str(schedule_file), flag="r") as store:
            return float(store["entries"][entry].last_run_at.timestamp())
    except Exception:  # no file, no entry: reported as "-"
        return None


def sleep_until(epoch_s: float) -> None:
    while (left := epoch_s - time.time()) > 0:
        time.sleep(min(left, 0.5))


# --------------------------------------------------------------------------------------------
# One scenario
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Scenario:
    """``schedule`` interval|crontab, ``scheduler`` plain|singleton, ``variant`` A|B (schedule
    file kept | new), ``stop`` SIGTERM|SIGKILL (how beat 1 ends)."""

    schedule: str
    scheduler: str
    variant: str
    stop: str = "SIGTERM"

    @property
    def label(self) -> str:
        return self.variant + ("-kill" if self.stop == "SIGKILL" else "")

    @property
    def key(self) -> str:
        return f"{self.schedule}-{self.scheduler}-{self.label}"

    @property
    def period(self) -> float:
        return INTERVAL_S if self.schedule == "interval" else 60.0


@dataclass
class Result:
    """The raw times of a scenario (epoch s) and what they say (filled by :func:`analyse`)."""

    scenario: Scenario
    beat1_ready: float = 0.0
    beat1_runs: list[float] = field(default_factory=list)
    stopped: float = 0.0
    stored_last_run_at: float | None = None
    beat2_ready: float = 0.0
    beat2_runs: list[float] = field(default_factory=list)
    beat2_run_ids: list[float | None] = field(default_factory=list)
    broker_messages: int | None = None
    grid_anchor: float = 0.0
    error: str | None = None
    summary: dict[str, Any] = field(default_factory=dict)


def grid_after(anchor: float, period: float, t: float) -> float:
    """The first instant ``anchor + k * period`` strictly after ``t``."""
    return anchor + (math.floor((t - anchor) / period) + 1) * period


def run_scenario(sc: Scenario, redis_url: str, work_dir: Path) -> Result:
    """Run one scenario's two beats (see the module docstring); return their times."""
    res = Result(sc)
    prefix = f"bd:{sc.key}:"
    beats: list[Beat] = []

    def start(phase: int, schedule_file: Path) -> Beat:
        beat = Beat(
            f"{sc.key}-beat{phase}",
            work_dir=work_dir,
            schedule_file=schedule_file,
            schedule=sc.schedule,
            scheduler=sc.scheduler,
            redis_url=redis_url,
            prefix=prefix,
            queue=f"phase{phase}",
        )
        beats.append(beat)
        return beat

    try:
        # 1. beat 1, with a new schedule file, until it has published its runs
        file1 = work_dir / f"{sc.key}-schedule1"
        beat1 = start(1, file1)
        res.beat1_ready = beat1.wait_ready()
        startup = res.beat1_ready - beat1.launched_at  # launch -> ready, to aim the restart
        if sc.schedule == "interval":
            runs1 = beat1.wait_runs(2, timeout=3 * sc.period + 10)
            sleep_until(runs1[-1].ts + 1.0)
        else:
            runs1 = beat1.wait_runs(1, timeout=sc.period + 30)
            sleep_until(runs1[-1].ts + 5.0)
        res.stopped = beat1.stop(sc.stop)
        res.beat1_runs = [r.ts for r in beat1.runs()]

        # the grid the scenario is measured against (see the module docstring)
        if sc.schedule == "interval" and sc.scheduler == "plain":
            res.grid_anchor = res.beat1_runs[-1]  # plain beat's own cadence
        else:
            res.grid_anchor = 0.0  # epoch-aligned slots, or minutes
        # 2. downtime: 5 slot boundaries or 3 minutes pass; beat 2 ready 1.5 s / 20 s after one
        first_missed = grid_after(res.grid_anchor, sc.period, res.stopped)
        if sc.schedule == "interval":
            target_ready = first_missed + 4 * sc.period + 1.5
        else:
            target_ready = first_missed + 2 * sc.period + 20.0
        sleep_until(target_ready - startup)

        # 3. beat 2: beat 1's file (A) or a new one (B)
        res.stored_last_run_at = stored_last_run_at(file1, ENTRY_NAMES[sc.schedule])
        file2 = file1 if sc.variant == "A" else work_dir / f"{sc.key}-schedule2"
        beat2 = start(2, file2)
        res.beat2_ready = beat2.wait_ready()

        # 4. three more periods / two more minutes, then stop it
        next_slot = grid_after(res.grid_anchor, sc.period, res.beat2_ready)
        extra = 2 * sc.period + 2.0 if sc.schedule == "interval" else sc.period + 5.0
        sleep_until(max(next_slot + extra, res.beat2_ready + 3 * sc.period + 2.0))
        beat2.stop("SIGTERM")
        runs2 = beat2.runs()
        res.beat2_runs = [r.ts for r in runs2]
        res.beat2_run_ids = [r.run_id for r in runs2]
        res.broker_messages = broker_count(redis_url, f"{prefix}phase2")
        res.summary = analyse(res)
    except Exception:  # reported after the table, with the logs' tails
        res.error = traceback.format_exc(limit=3)
        for beat in beats:
            res.error += f"\n--- {beat.proc.name} ---\n{beat.proc.log_tail(15)}"
    finally:
        for beat in beats:
            beat.proc.kill()
    return res


def broker_count(redis_url: str, key: str) -> int:
    """Messages waiting in a Redis broker queue (a list)."""
    import redis

    client = redis.Redis.from_url(redis_url)
    try:
        return int(client.llen(key))
    finally:
        client.close()


# --------------------------------------------------------------------------------------------
# What the times say
# --------------------------------------------------------------------------------------------

#: a run within this of a grid instant is "on the grid" (beats tick at least every second)
ON_GRID_S = 0.5
#: the file's last_run_at is "the last run" when this close to its published line (the singleton
#: scheduler logs "published" after the publish is confirmed, ~0.1 s after reserve())
SAME_RUN_S = 0.25


def phase(t: float, anchor: float, period: float) -> float:
    """Offset of ``t`` from the nearest grid instant, in (-period/2, period/2]."""
    off = (t - anchor) % period
    return off - period if off > period / 2 else off


def analyse(res: Result) -> dict[str, Any]:
    """The figures of a scenario (see the module docstring for what each means)."""
    p, a = res.scenario.period, res.grid_anchor
    ready, runs = res.beat2_ready, res.beat2_runs
    next_slot = grid_after(a, p, ready)
    first_missed = grid_after(a, p, res.stopped)
    missed = 0 if first_missed > ready else int((ready - first_missed) // p) + 1
    catch_up = [t for t in runs if t < next_slot - 0.05]
    out: dict[str, Any] = {
        "downtime_s": ready - res.stopped,
        "missed": missed,
        "ready_into_slot_s": (ready - a) % p,
        "catch_up": len(catch_up),
        "runs_after_restart": len(runs),
        "broker_ok": res.broker_messages == len(runs),
    }
    if res.stored_last_run_at is not None:
        out["stored_last_run_at_vs_stop_s"] = res.stored_last_run_at - res.stopped
        out["last_run_before_stop_vs_stop_s"] = res.beat1_runs[-1] - res.stopped
    if runs:
        out["first_vs_ready_s"] = runs[0] - ready
        out["first_vs_next_slot_s"] = runs[0] - next_slot
        later = runs[1:]
        out["later_phases_s"] = [phase(t, a, p) for t in later]
        out["later_gaps_s"] = [b - t for t, b in itertools.pairwise(runs)]
    ids = res.beat2_run_ids  # the singleton scheduler's: the nominal instant of each run
    if ids and ids[0] is not None:
        out["first_run_id_vs_ready_s"] = ids[0] - ready
        if catch_up:
            out["catch_up_run_id_vs_ready_s"] = ids[0] - ready
    return out


# --------------------------------------------------------------------------------------------
# The table
# --------------------------------------------------------------------------------------------

COLUMNS = (
    "scenario",
    "schedule",
    "scheduler",
    "downtime (grid instants missed)",
    "file's last_run_at at restart",
    "runs published for the downtime",
    "first run after restart: from start / vs next slot",
    "later runs",
)


def _s(x: float) -> str:
    return f"{x:+.1f} s"


def row(res: Result) -> list[str]:
    """One line of the table (see COLUMNS)."""
    sc, s = res.scenario, res.summary
    scenario = {"A": "A kept file, SIGTERM", "A-kill": "A kept file, SIGKILL", "B": "B new file"}
    schedule = "every 5 s" if sc.schedule == "interval" else "crontab() every minute"
    cells = [scenario[sc.label], schedule, sc.scheduler]
    if res.error or not s:
        return [*cells, "error (see stderr)", "", "", "", ""]

    unit, into = ("slots", "a slot") if sc.schedule == "interval" else ("minutes", "a minute")
    cells.append(
        f"{s['downtime_s']:.1f} s ({s['missed']} {unit}); start {s['ready_into_slot_s']:.1f} s "
        f"into {into}"
    )

    if sc.variant == "A" and "stored_last_run_at_vs_stop_s" in s:
        stored, last = s["stored_last_run_at_vs_stop_s"], s["last_run_before_stop_vs_stop_s"]
        same = abs(stored - last) < SAME_RUN_S
        note = "(the last run)" if same else f"(last run {_s(last)})"
        cells.append(f"stop {_s(stored)} {note}")
    else:
        cells.append("- (new file)")

    catch = str(s["catch_up"])
    if s["catch_up"] and s["first_vs_ready_s"] < 1.0:
        catch += " (at once)"
    if "catch_up_run_id_vs_ready_s" in s:
        catch += f", run id = slot at start {_s(s['catch_up_run_id_vs_ready_s'])}"
    if not s["broker_ok"]:
        catch += " (broker count differs!)"
    cells.append(catch)

    if "first_vs_ready_s" in s:
        first = f"{_s(s['first_vs_ready_s'])} / {_s(s['first_vs_next_slot_s'])}"
        if "first_run_id_vs_ready_s" in s and not s["catch_up"]:
            first += f" (run id = slot at start {_s(s['first_run_id_vs_ready_s'])})"
        cells.append(first)
    else:
        cells.append("no run")

    phases, gaps = s.get("later_phases_s", []), s.get("later_gaps_s", [])
    if not phases:
        cells.append("-")
        return cells
    steady = gaps[1:] or gaps  # the gap after a catch-up run is not the cadence
    every = f"every {sum(steady) / len(steady):.1f} s"
    if all(abs(x) < ON_GRID_S for x in phases):
        cells.append(f"on grid ({every})")
    else:
        cells.append(f"shifted {_s(sum(phases) / len(phases))} from grid ({every})")
    return cells


def table(results: list[Result]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(row(r)) + " |" for r in results]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def load_results(path: Path) -> list[Result]:
    """The results written by ``--json`` (their figures recomputed from the raw times)."""
    results = []
    for data in json.loads(path.read_text()):
        res = Result(**{**data, "scenario": Scenario(**data["scenario"])})
        if not res.error:
            res.summary = analyse(res)
        results.append(res)
    return results


def scenarios(schedules: list[str], schedulers: list[str]) -> list[Scenario]:
    return [
        Scenario(schedule, scheduler, variant, stop)
        for schedule in schedules
        for scheduler in schedulers
        for variant, stop in (("A", "SIGTERM"), ("A", "SIGKILL"), ("B", "SIGTERM"))
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--schedules", default="interval,crontab")
    parser.add_argument("--schedulers", default="plain,singleton")
    parser.add_argument("--json", help="write the raw times and figures here")
    parser.add_argument("--logs", help="keep the beats' logs and schedule files in this dir")
    parser.add_argument("--table-from", help="print the table of an earlier --json; run nothing")
    args = parser.parse_args(argv)
    if args.table_from:
        print(table(load_results(Path(args.table_from))))
        return 0

    from celery_singleton_lock._dev.server import DevServer

    work_dir = Path(args.logs or tempfile.mkdtemp(prefix="beat-downtime-"))
    work_dir.mkdir(parents=True, exist_ok=True)
    todo = scenarios(args.schedules.split(","), args.schedulers.split(","))
    results: dict[Scenario, Result] = {}
    started = time.time()
    with DevServer() as server:
        print(f"redis {server.url}, logs in {work_dir}", file=sys.stderr)

        def one(sc: Scenario) -> None:
            print(f"  {time.time() - started:5.0f} s  start {sc.key}", file=sys.stderr)
            results[sc] = run_scenario(sc, server.url, work_dir)
            print(f"  {time.time() - started:5.0f} s  done  {sc.key}", file=sys.stderr)

        def in_turn(group: list[Scenario]) -> None:
            for sc in group:
                one(sc)

        # crontab scenarios all at once; interval ones one after the other beside them
        threads = [threading.Thread(target=one, args=(sc,)) for sc in todo if sc.period == 60]
        interval = [sc for sc in todo if sc.period != 60]
        threads.append(threading.Thread(target=in_turn, args=(interval,)))
        for thread in threads:
            thread.start()
            time.sleep(0.5)  # not every beat imports Celery in the same instant
        for thread in threads:
            thread.join()

    ordered = [results[sc] for sc in todo]
    print(f"\n{len(todo)} scenarios in {time.time() - started:.0f} s\n", file=sys.stderr)
    print(table(ordered))
    for res in ordered:
        if res.error:
            print(f"\n{res.scenario.key}: {res.error}", file=sys.stderr)
    if args.json:
        data = [{**asdict(r), "scenario": asdict(r.scenario)} for r in ordered]
        Path(args.json).write_text(json.dumps(data, indent=1))
    return 1 if any(r.error for r in ordered) else 0


if __name__ == "__main__":
    sys.exit(main())
