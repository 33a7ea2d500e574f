"""Execution history in Redis, and the checker that proves mutual exclusion from it.

Every guarded task body calls :func:`record_start` right after it got the lock and
:func:`record_end` right before it releases it. Timestamps come from the Redis server's ``TIME``
(microseconds), so every worker process, on any pool, writes on one clock. Each record is a JSON
event appended with ``RPUSH`` to one list under ``history_key`` (append-only: no
read-modify-write, nothing to lose between processes).

:func:`check_history` then looks for two executions of one lock key whose intervals intersect,
and for fencing tokens that do not strictly increase in start order.
"""

from __future__ import annotations

import json
import math
import uuid
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import redis

from tests.support.waiting import wait_for

Token = int | str | None


def server_time_us(client: redis.Redis) -> int:
    """The Redis server's clock, in microseconds since the epoch."""
    seconds, micros = client.time()
    return int(seconds) * 1_000_000 + int(micros)


def record_start(  # noqa: PLR0917 - the documented positional API
    client: redis.Redis,
    history_key: str,
    key: str,
    token: Token,
    worker: str,
    pid: int,
) -> str:
    """Append a start event for lock ``key`` (server time) and return its execution id."""
    exec_id = uuid.uuid4().hex
    event = {
        "ev": "start",
        "exec_id": exec_id,
        "key": key,
        "token": token,
        "worker": worker,
        "pid": pid,
        "ts": server_time_us(client),
    }
    client.rpush(history_key, json.dumps(event))
    return exec_id


def record_end(client: redis.Redis, history_key: str, exec_id: str) -> None:
    """Append the end event (server time) of execution ``exec_id``."""
    event = {"ev": "end", "exec_id": exec_id, "ts": server_time_us(client)}
    client.rpush(history_key, json.dumps(event))


@dataclass(frozen=True)
class Execution:
    """One guarded run: [start_us, end_us] on the server clock; end_us None if unfinished."""

    exec_id: str
    key: str
    token: Token
    worker: str
    pid: int
    start_us: int
    end_us: int | None = None

    @property
    def finished(self) -> bool:
        """True once the end was recorded."""
        return self.end_us is not None

    @property
    def end_or_inf(self) -> float:
        """End time, or +infinity for an unfinished (open-ended) execution."""
        return math.inf if self.end_us is None else self.end_us

    def describe(self) -> str:
        """One readable line for assertion messages."""
        end = "unfinished" if self.end_us is None else str(self.end_us)
        return (
            f"{self.exec_id[:8]} key={self.key!r} token={self.token!r} "
            f"worker={self.worker} pid={self.pid} [{self.start_us}, {end}]"
        )


def parse_history(raw_events: Iterable[bytes | str]) -> list[Execution]:
    """Fold start/end events into executions, ordered by start time."""
    starts: dict[str, dict[str, Any]] = {}
    ends: dict[str, int] = {}
    for raw in raw_events:
        event = json.loads(raw)
        if event["ev"] == "start":
            starts[event["exec_id"]] = event
        elif event["ev"] == "end":
            ends[event["exec_id"]] = int(event["ts"])
    executions = [
        Execution(
            exec_id=exec_id,
            key=ev["key"],
            token=ev["token"],
            worker=ev["worker"],
            pid=int(ev["pid"]),
            start_us=int(ev["ts"]),
            end_us=ends.get(exec_id),
        )
        for exec_id, ev in starts.items()
    ]
    executions.sort(key=lambda e: (e.start_us, e.exec_id))
    return executions


def load_history(client: redis.Redis, history_key: str) -> list[Execution]:
    """Every execution recorded under ``history_key``, ordered by start time."""
    return parse_history(client.lrange(history_key, 0, -1))


def wait_started(
    client: redis.Redis,
    history_key: str,
    key: str,
    *workers: Any,
    count: int = 1,
    timeout: float = 20.0,
) -> list[Execution]:
    """Wait until ``count`` runs of ``key`` recorded their start under ``history_key``; return
    the executions of ``key``. ``workers``' log tails are named if they do not.

    This is how a test knows a holder's body started. Its lock is no proof: the lock is taken
    before the body runs, and a run killed in between records nothing."""
    what = "the holder's start" if count == 1 else f"{count} runs of {key} to start"

    def started() -> list[Execution]:
        runs = [e for e in load_history(client, history_key) if e.key == key]
        return runs if len(runs) >= count else []

    found: list[Execution] = wait_for(started, timeout, what, *workers)
    return found


@dataclass
class HistoryReport:
    """What :func:`check_history` found."""

    executions: list[Execution]
    overlaps: list[tuple[Execution, Execution]] = field(default_factory=list)
    token_regressions: list[tuple[Execution, Execution]] = field(default_factory=list)
    unfinished: list[Execution] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when no overlap and no token regression was found."""
        return not self.overlaps and not self.token_regressions

    def finished(self) -> list[Execution]:
        """Executions whose end was recorded."""
        return [e for e in self.executions if e.finished]

    def summary(self) -> str:
        """A readable multi-line account of every problem found."""
        lines = [
            f"{len(self.executions)} executions, {len(self.overlaps)} overlaps, "
            f"{len(self.token_regressions)} token regressions, {len(self.unfinished)} unfinished"
        ]
        for first, second in self.overlaps:
            lines.append("OVERLAP:")
            lines.append(f"  {first.describe()}")
            lines.append(f"  {second.describe()}")
        for previous, current in self.token_regressions:
            lines.append("TOKEN REGRESSION (not strictly greater than the previous run's):")
            lines.append(f"  previous {previous.describe()}")
            lines.append(f"  current  {current.describe()}")
        for execution in self.unfinished:
            lines.append(f"UNFINISHED: {execution.describe()}")
        return "\n".join(lines)


def _token_le(current: Token, previous: Token) -> bool:
    """True if ``current`` is not strictly greater than ``previous`` (None is never compared)."""
    if current is None or previous is None:
        return False
    if isinstance(current, str) and isinstance(previous, str):
        if current.isdigit() and previous.isdigit():
            return int(current) <= int(previous)
        return current <= previous
    return int(current) <= int(previous)


def check_history(executions: Iterable[Execution]) -> HistoryReport:
    """Find overlapping executions of one key and fencing tokens that did not increase.

    Intervals are closed on the server clock but touching ones (one ends at the very microsecond
    the next starts) do not count as overlapping. An unfinished execution is open-ended: it
    overlaps everything of its key that starts after it.
    """
    ordered = sorted(executions, key=lambda e: (e.start_us, e.exec_id))
    report = HistoryReport(executions=ordered)
    by_key: dict[str, list[Execution]] = defaultdict(list)
    for execution in ordered:
        by_key[execution.key].append(execution)
        if not execution.finished:
            report.unfinished.append(execution)

    for runs in by_key.values():
        for i, first in enumerate(runs):
            for second in runs[i + 1 :]:
                # runs are sorted by start, so second.start_us >= first.start_us
                if second.start_us >= first.end_or_inf:
                    break
                report.overlaps.append((first, second))
        previous_with_token: Execution | None = None
        for execution in runs:
            if execution.token is None:
                continue
            if previous_with_token is not None and _token_le(
                execution.token, previous_with_token.token
            ):
                report.token_regressions.append((previous_with_token, execution))
            previous_with_token = execution
    return report


def assert_no_overlap(
    report: HistoryReport, *, check_tokens: bool = True, allow_unfinished: bool = True
) -> None:
    """Raise AssertionError, with a readable account, if mutual exclusion was broken."""
    failed = bool(report.overlaps)
    if check_tokens and report.token_regressions:
        failed = True
    if not allow_unfinished and report.unfinished:
        failed = True
    if failed:
        raise AssertionError("mutual exclusion violated:\n" + report.summary())


def permit_group(key: str) -> str:
    """The key a permit slot ``<lock key>:<i>`` belongs to (a lock key is its own)."""
    head, _, tail = key.rpartition(":")
    return head if tail.isdigit() and head.endswith(":lock") else key


def max_at_once(executions: Iterable[Execution]) -> dict[str, int]:
    """The most executions of one key (all the permit slots of one key together) running at
    the same instant, by key; an unfinished execution runs to the end of time."""
    edges: dict[str, list[tuple[float, int]]] = defaultdict(list)
    for execution in executions:
        group = edges[permit_group(execution.key)]
        group.append((execution.start_us, 1))
        group.append((execution.end_or_inf, -1))
    most: dict[str, int] = {}
    for group, points in edges.items():
        running = peak = 0
        for _, step in sorted(points):  # an end sorts before a start at the same instant
            running += step
            peak = max(peak, running)
        most[group] = peak
    return most


# -- scheduled runs: fired twice, or not at all while a beat lived (test_chaos, test_load) ------

BEAT_RUNS_SUFFIX = "beat-runs"
#: a beat killed between claiming a run and publishing it leaves a pending claim that the other
#: beats retry when it expires: the 10 s publish lease (beat/scheduler.py), plus slack
CLAIM_GRACE_S = 12.0


def beat_runs_key(prefix: str) -> str:
    """The list :func:`record_beat_run` appends to, for a given prefix."""
    return f"{prefix}{BEAT_RUNS_SUFFIX}"


def record_beat_run(  # noqa: PLR0917 - mirrors record_start
    client: redis.Redis,
    runs_key: str,
    label: str,
    task_id: str,
    worker: str,
    pid: int,
) -> None:
    """Append that the message of scheduled run ``label`` (``<entry>@<run id>``) started."""
    event = {
        "label": label,
        "task_id": task_id,
        "worker": worker,
        "pid": pid,
        "ts": server_time_us(client),
    }
    client.rpush(runs_key, json.dumps(event))


@dataclass(frozen=True)
class BeatRun:
    """One execution (or publication) of a scheduled run; ``task_id`` None when unknown."""

    label: str
    task_id: str | None = None

    @property
    def entry(self) -> str:
        """The schedule entry's name."""
        return self.label.rsplit("@", 1)[0]

    @property
    def run_ms(self) -> int | None:
        """The nominal run id (epoch ms), None for an unlabelled run."""
        run = self.label.rsplit("@", 1)[-1]
        return int(run) if run.isdigit() else None


def load_beat_runs(client: redis.Redis, runs_key: str) -> list[BeatRun]:
    """Every run :func:`record_beat_run` recorded under ``runs_key``."""
    runs = []
    for raw in client.lrange(runs_key, 0, -1):
        event = json.loads(raw)
        runs.append(BeatRun(str(event["label"]), str(event["task_id"])))
    return runs


def beat_runs_from_history(executions: Iterable[Execution]) -> list[BeatRun]:
    """The scheduled runs among recorded executions (keys ``<entry>@<run id>``), ids unknown."""
    return [BeatRun(e.key) for e in executions if "@" in e.key]


@dataclass(frozen=True)
class BeatWindow:
    """When a beat instance could publish: from its first tick to its kill or stop (epoch s)."""

    name: str
    ready: float
    end: float


@dataclass
class BeatRunReport:
    """What :func:`check_beat_runs` found."""

    #: label -> how many distinct messages carried it (executed or published)
    fired: dict[str, int]
    #: labels fired more than once, with their count
    fired_twice: dict[str, int] = field(default_factory=dict)
    #: entry -> nominal run ids (epoch ms) that were due while a beat lived but never ran
    lost: dict[str, list[int]] = field(default_factory=dict)
    #: entry -> how many runs were due while a beat lived
    required: dict[str, int] = field(default_factory=dict)
    #: labels without a run id (published without the run header)
    unlabelled: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when no run fired twice, none was lost and every run carried its label."""
        return not self.fired_twice and not self.lost_count and not self.unlabelled

    @property
    def lost_count(self) -> int:
        """How many required runs never ran."""
        return sum(len(ids) for ids in self.lost.values())

    def summary(self) -> str:
        """A readable multi-line account."""
        lines = [
            f"{len(self.fired)} scheduled runs, {len(self.fired_twice)} fired twice, "
            f"{self.lost_count} lost of {sum(self.required.values())} due while a beat lived, "
            f"{len(self.unlabelled)} unlabelled"
        ]
        for label, count in sorted(self.fired_twice.items()):
            lines.append(f"FIRED TWICE: {label} x{count}")
        for entry, ids in sorted(self.lost.items()):
            lines.append(f"LOST: {entry} {ids}")
        lines.extend(f"UNLABELLED: {label}" for label in self.unlabelled)
        return "\n".join(lines)


def required_runs(
    period_s: float,
    windows: Iterable[BeatWindow],
    beat_kills: Iterable[float] = (),
    margin_s: float = 1.0,
    claim_grace_s: float = CLAIM_GRACE_S,
) -> list[int]:
    """Nominal runs (epoch ms) of an epoch-aligned ``period_s`` entry that some beat had to fire.

    A run at ``s`` is required when one beat was ready before ``s`` and lived until
    ``s + margin_s``; if a beat was killed around ``s`` (it may have claimed the run and died
    before publishing it), a survivor publishes it when the claim's lease ran out, so it must
    have lived until ``s + claim_grace_s``.
    """
    windows = list(windows)
    kills = list(beat_kills)
    if not windows:
        return []
    step_ms = round(period_s * 1000)
    first = math.ceil(min(w.ready for w in windows) * 1000 / step_ms) * step_ms
    last = math.floor(max(w.end for w in windows) * 1000 / step_ms) * step_ms
    required = []
    for run_ms in range(first, last + 1, step_ms):
        s = run_ms / 1000
        near_kill = any(s - 0.5 <= k <= s + margin_s + 1.0 for k in kills)
        grace = claim_grace_s if near_kill else margin_s
        if any(w.ready < s and s + grace <= w.end for w in windows):
            required.append(run_ms)
    return required


def check_beat_runs(  # noqa: PLR0917
    executed: Iterable[BeatRun],
    periods: dict[str, float],
    windows: Iterable[BeatWindow],
    published: Iterable[BeatRun] = (),
    beat_kills: Iterable[float] = (),
    margin_s: float = 1.0,
) -> BeatRunReport:
    """Find scheduled runs fired twice, or never run although a beat lived to fire them.

    ``executed`` are the runs that started on a worker, ``published`` the runs the beats logged
    as published (``beat: published run``). A run fired once per distinct task id; runs
    executed without a known task id count once per execution. ``periods`` maps each
    epoch-aligned entry to check to its period (60 for a crontab firing every minute).
    """
    windows = list(windows)
    kills = list(beat_kills)
    ids: dict[str, set[str]] = defaultdict(set)
    anonymous: dict[str, int] = defaultdict(int)
    for run in [*executed, *published]:
        if run.task_id is None:
            anonymous[run.label] += 1
        else:
            ids[run.label].add(run.task_id)
    labels = set(ids) | set(anonymous)
    fired = {label: max(len(ids[label]), anonymous[label]) for label in labels}
    report = BeatRunReport(fired=fired)
    report.fired_twice = {label: n for label, n in fired.items() if n > 1}
    report.unlabelled = sorted(label for label in labels if BeatRun(label).run_ms is None)
    ran: dict[str, set[int]] = defaultdict(set)
    for label in labels:
        run = BeatRun(label)
        if run.run_ms is not None:
            ran[run.entry].add(run.run_ms)
    for entry, period in periods.items():
        due = required_runs(period, windows, kills, margin_s)
        report.required[entry] = len(due)
        missing = [run_ms for run_ms in due if run_ms not in ran[entry]]
        if missing:
            report.lost[entry] = missing
    return report
