"""Helpers for the chaos and load tests: kills, a load rig of real workers and beats, figures.

- :func:`configure_visibility`: late acks survive a killed node (kombu restores a message left
  unacked for the visibility timeout); imported by the worker apps behind an env switch.
- :class:`Kill` and :func:`close_killed`: a killed run never records its end; its execution
  is closed at the moment its process was known dead, so the history checker can compare it.
- :class:`LoadRig`: worker nodes and beats of ``tests.support.beat_app`` in load mode, a feed
  of duplicate ``b.load`` calls, kills of pool children, nodes and beats, and the final checks
  (overlaps, tokens, scheduled runs, lost calls, stuck locks).
- :func:`record_figures`: one JSON line per scenario to ``$SINGLETON_RELIABILITY_OUT``, which
  ``scripts/reliability_table.py`` renders for docs/reliability.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import random
import re
import signal
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import redis

from tests.support.basic_app import BEAT_APP, history_key
from tests.support.beats import BeatFactory, BeatProcess, parse_log
from tests.support.history import (
    BeatRun,
    BeatRunReport,
    BeatWindow,
    Execution,
    HistoryReport,
    beat_runs_key,
    check_beat_runs,
    check_history,
    load_beat_runs,
    load_history,
    server_time_us,
)
from tests.support.waiting import wait_for
from tests.support.workers import WorkerFactory, WorkerProcess, is_alive

__test__ = False

RELIABILITY_ENV = "SINGLETON_RELIABILITY_OUT"
#: a task id in a worker log line: ``b.load[feed-...]``, ``b.record[<uuid>]``
_TASK_ID = re.compile(r"\[((?:feed-|fanout-)?[0-9a-f][0-9a-f-]{15,})\]")
LOAD_TASK = "b.load"


# -- keys shared with the worker apps ---------------------------------------------------------


def deliveries_key(prefix: str, task_id: str) -> str:
    """Counter of the runs of one task id (singleton_app's ``t.hold_redelivered``)."""
    return f"{prefix}deliveries:{task_id}"


def sent_key(prefix: str) -> str:
    """Set of the ``b.load`` task ids sent (by the test or by the fan-out entry)."""
    return f"{prefix}load-sent"


def done_key(prefix: str) -> str:
    """Set of the ``b.load`` task ids that finished a run."""
    return f"{prefix}load-done"


def load_key_name(index: int) -> str:
    """The ``key`` argument of load key number ``index``."""
    return f"k{index:02d}"


def load_key(key: str) -> str:
    """The history key ``b.load`` records its runs under."""
    return f"load:{key}"


def finished_runs_key(prefix: str) -> str:
    """Hash of the finished runs of each ``b.load`` task id (a message must finish once)."""
    return f"{prefix}finished-runs"


def ended_runs_key(prefix: str) -> str:
    """Hash of the ``b.load`` task ids whose run ended: its task_postrun (and the library's
    release, which records the completion) went through."""
    return f"{prefix}ended-runs"


def reruns_key(prefix: str) -> str:
    """Set of the ``b.load`` task ids that started again after a run of theirs had ended."""
    return f"{prefix}reruns"


def kill_after_body_key(prefix: str) -> str:
    """The node name whose next finished ``b.load`` run SIGKILLs the whole node (beat_app)."""
    return f"{prefix}kill-after-body"


def lock_prefix(prefix: str) -> str:
    """The lock key prefix the test apps use (``singleton_key_prefix``)."""
    return f"{prefix}lock:"


def configure_visibility(app: Any, seconds: float) -> None:
    """Make the Redis broker restore messages left unacked for ``seconds``, sweeping every 1 s.

    kombu keeps every delivered message in an ``unacked`` hash until it is acked; a consumer's
    ``restore_visible`` (a timer every ``unacked_restore_interval`` s, scanning on every
    ``unacked_restore_throttle``-th call) puts back those older than ``visibility_timeout``.
    The sweep's mutex expires after 5 s, not 300, in case its holder is SIGKILLed.
    """
    options = dict(app.conf.broker_transport_options or {})
    options.update(
        visibility_timeout=seconds,
        unacked_restore_interval=1,
        unacked_restore_throttle=1,
        unacked_mutex_expire=5,
    )
    app.conf.broker_transport_options = options


# -- figures --------------------------------------------------------------------------------


def record_figures(
    scenario: str,
    *,
    runs: int,
    overlaps: int,
    stuck_locks: int,
    lost_runs: int,
    run_twice: int | None = None,
) -> dict[str, Any]:
    """Append one JSON line of figures to ``$SINGLETON_RELIABILITY_OUT`` (if set); return it.
    ``run_twice``: messages run again after they had finished (None: not counted here)."""
    line = {
        "scenario": scenario,
        "runs": runs,
        "overlaps": overlaps,
        "stuck_locks": stuck_locks,
        "lost_runs": lost_runs,
        "run_twice": run_twice,
    }
    out = os.environ.get(RELIABILITY_ENV)
    if out:
        with open(out, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(line) + "\n")
    return line


def with_twice(scenario: str, fired_twice: int) -> str:
    """The scenario's name, saying so if scheduled runs fired twice (the table has no column)."""
    return scenario + (f" (scheduled runs fired twice: {fired_twice})" if fired_twice else "")


# -- locks ----------------------------------------------------------------------------------


def lock_holders(client: redis.Redis, prefix: str) -> dict[str, dict[str, str]]:
    """Every lock under the test's lock prefix: key -> its hash (owner, host, pid, ...)."""
    found = {}
    for raw in client.scan_iter(match=f"{lock_prefix(prefix)}*:lock", count=1000):
        fields = client.hgetall(raw)
        if fields:
            found[raw.decode()] = {k.decode(): v.decode() for k, v in fields.items()}
    return found


def wait_locks_gone(client: redis.Redis, prefix: str, timeout: float) -> dict[str, dict[str, str]]:
    """Wait up to ``timeout`` for every lock under the prefix to go; return those left."""
    wait_for(lambda: not lock_holders(client, prefix), timeout, interval=0.05, fail=False)
    return lock_holders(client, prefix)


# -- kills ----------------------------------------------------------------------------------

#: Kill kinds that take a whole node down (messages in flight to it may be lost by the broker).
NODE_KILLS = frozenset({"node", "after-body"})


@dataclass(frozen=True)
class Kill:
    """A SIGKILL: of what, which pids died, and the server time (us) once they were dead."""

    kind: str
    name: str
    pids: frozenset[int]
    at_us: int
    at: float  # epoch seconds (local clock), for beat windows

    def describe(self) -> str:
        """One readable line."""
        return f"{self.kind} {self.name} pids={sorted(self.pids)} at={self.at_us}"


def close_killed(executions: Iterable[Execution], kills: Iterable[Kill]) -> list[Execution]:
    """Close unfinished executions whose process was killed, at the moment it was dead."""
    kills = sorted(kills, key=lambda k: k.at_us)
    closed = []
    for execution in executions:
        end = None
        if not execution.finished:
            ends = (k.at_us for k in kills if execution.pid in k.pids)
            end = next((at for at in ends if at >= execution.start_us), None)
        closed.append(execution if end is None else dataclasses.replace(execution, end_us=end))
    return closed


def sigkill_pid(client: redis.Redis, pid: int, timeout: float = 5.0) -> int:
    """SIGKILL ``pid``, wait until it is gone; return the server time (us) just after."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not is_alive(pid), timeout, interval=0.01, fail=False)
    return server_time_us(client)


def beat_ready_at(beat: BeatProcess) -> float | None:
    """Log time (epoch s) of the beat's first tick, None if it never ticked."""
    for line in beat.lines():
        if "singleton scheduler started" in line.text:
            return line.ts
    return None


# -- the load rig ---------------------------------------------------------------------------


@dataclass
class LoadReport:
    """Everything the final checks of a :class:`LoadRig` run found."""

    history: HistoryReport
    beat: BeatRunReport
    #: calls sent that never finished a run, and those of them a node kill explains
    lost_calls: list[str]
    dropped_calls: list[str]
    #: published scheduled runs (task ids) that never started, and those a node kill explains
    unstarted_runs: list[str]
    dropped_runs: list[str]
    stuck_locks: dict[str, dict[str, str]]
    kills: list[Kill]
    sent: int
    #: task ids whose b.load ran again after a run of theirs had ended (released, completion
    #: recorded): what the completion record must prevent
    run_twice: list[str] = field(default_factory=list)
    #: task ids whose body finished more than once: run_twice, plus runs whose process was
    #: killed between the body's end and the release (no completion recorded: docs/internals.md)
    finished_twice: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def unexplained_calls(self) -> list[str]:
        """Calls that never finished although no node was killed with them in flight."""
        return sorted(set(self.lost_calls) - set(self.dropped_calls))

    @property
    def unexplained_runs(self) -> list[str]:
        """Published runs that never started although no node was killed with them in flight."""
        return sorted(set(self.unstarted_runs) - set(self.dropped_runs))

    @property
    def load_runs(self) -> list[Execution]:
        """Executions of ``b.load`` (history keys ``load:<key>``)."""
        return [e for e in self.history.executions if e.key.startswith("load:")]

    @property
    def overlaps(self) -> int:
        """Overlapping executions of one lock key."""
        return len(self.history.overlaps)

    @property
    def lost_runs(self) -> int:
        """Scheduled runs no beat fired while one lived, plus calls and published runs that
        never ran without a node kill to explain it (see :attr:`broker_drops`)."""
        return self.beat.lost_count + len(self.unexplained_calls) + len(self.unexplained_runs)

    @property
    def broker_drops(self) -> int:
        """Messages lost in flight to a SIGKILLed node: popped from the queue (BRPOP) and not
        yet in kombu's ``unacked`` hash, so no visibility timeout brings them back."""
        return len(self.dropped_calls) + len(self.dropped_runs)

    def summary(self) -> str:
        """A readable multi-line account of the run and every problem found."""
        lines = [
            f"{len(self.load_runs)} lock runs over "
            f"{len({e.key for e in self.load_runs})} keys, {self.sent} calls sent, "
            f"{len(self.lost_calls)} never finished ({len(self.dropped_calls)} in flight to a "
            f"killed node); {len(self.unstarted_runs)} published runs never started "
            f"({len(self.dropped_runs)} in flight to a killed node); "
            f"{len(self.stuck_locks)} stuck locks; {len(self.run_twice)} messages ran again "
            f"after a run of theirs ended {self.run_twice}, {len(self.finished_twice)} finished "
            f"their body twice {self.finished_twice}",
            "history: " + self.history.summary(),
            "beat: " + self.beat.summary(),
            "kills: " + "; ".join(k.describe() for k in self.kills),
        ]
        if self.unexplained_calls:
            lines.append(f"LOST CALLS: {self.unexplained_calls[:20]}")
        if self.unexplained_runs:
            lines.append(f"PUBLISHED, NEVER STARTED: {self.unexplained_runs[:20]}")
        if self.broker_drops:
            lines.append(f"dropped in flight: {self.dropped_calls[:10]} {self.dropped_runs[:10]}")
        for key, fields in self.stuck_locks.items():
            lines.append(f"STUCK LOCK: {key} {fields}")
        return "\n".join(lines)


class LoadRig:
    """Worker nodes and beats of beat_app in load mode on one key prefix, and their chaos.

    Everything the nodes run is acked late and restored by the broker after ``visibility``
    seconds, so neither a killed pool child nor a killed node loses a message; ``b.load`` uses
    the retry policy, so duplicates wait instead of being dropped.
    """

    def __init__(
        self,
        *,
        workers: WorkerFactory,
        beats: BeatFactory,
        app: Any,
        client: redis.Redis,
        prefix: str,
        keys: int,
        visibility: float,
        rng: random.Random,
    ) -> None:
        self.worker_factory = workers
        self.beat_factory = beats
        self.app = app
        self.client = client
        self.prefix = prefix
        self.keys = [load_key_name(i) for i in range(keys)]
        self.env = {
            "SINGLETON_TEST_LOAD_KEYS": str(keys),
            "SINGLETON_TEST_VISIBILITY": f"{visibility:g}",
        }
        self.rng = rng
        self.visibility = visibility
        self.nodes: list[WorkerProcess] = []
        self.beats: list[BeatProcess] = []
        self.kills: list[Kill] = []
        self.sent_at: dict[str, float] = {}
        self.beats_stopped_at: float | None = None
        self._seen: dict[str, float] = {}

    # -- processes ---------------------------------------------------------------------------

    def start_node(self, concurrency: int) -> WorkerProcess:
        """Start one prefork node (not waiting for it)."""
        node = self.worker_factory.start(
            BEAT_APP, pool="prefork", concurrency=concurrency, env=self.env
        )
        self.nodes.append(node)
        return node

    def start_beat(self) -> BeatProcess:
        """Start one active-mode beat (not waiting for it)."""
        beat = self.beat_factory.start(env=self.env)
        self.beats.append(beat)
        return beat

    def start(self, nodes: int, concurrency: int, beats: int) -> None:
        """Start the nodes and beats and wait until all are ready."""
        started = [self.start_node(concurrency) for _ in range(nodes)]
        new_beats = [self.start_beat() for _ in range(beats)]
        for node in started:
            node.wait_ready(self.app, timeout=60)
        for beat in new_beats:
            beat.wait_ready(timeout=60)

    def live_nodes(self) -> list[WorkerProcess]:
        """Nodes not killed and still running."""
        return [n for n in self.nodes if n.is_running()]

    def live_beats(self) -> list[BeatProcess]:
        """Beats not killed and still running."""
        return [b for b in self.beats if b.is_running() and b.killed_at is None]

    # -- the feed ----------------------------------------------------------------------------

    def send(self, key: str, seconds: float) -> str:
        """Send one ``b.load`` call (counted as sent before it is)."""
        task_id = f"feed-{self.rng.getrandbits(64):016x}"
        self.client.sadd(sent_key(self.prefix), task_id)
        self.sent_at[task_id] = time.time()
        self.app.send_task(LOAD_TASK, kwargs={"key": key, "seconds": seconds}, task_id=task_id)
        return task_id

    def send_random(self, copies: int = 1) -> None:
        """``copies`` calls of one random key, each lasting 1.2 to 2.5 s (longer than the ttl)."""
        key = self.rng.choice(self.keys)
        for _ in range(copies):
            self.send(key, round(self.rng.uniform(1.2, 2.5), 3))

    # -- kills -------------------------------------------------------------------------------

    def _record(self, kind: str, name: str, pids: Iterable[int], at_us: int) -> Kill:
        kill = Kill(kind, name, frozenset(pids), at_us, time.time())
        self.kills.append(kill)
        print(f"chaos: killed {kill.describe()}")
        return kill

    def kill_child(self) -> Kill | None:
        """SIGKILL a pool child, one holding a lock if any does."""
        nodes = {n.nodename: n for n in self.live_nodes()}
        holders = []
        for fields in lock_holders(self.client, self.prefix).values():
            node = nodes.get(fields.get("host", ""))
            pid = int(fields.get("pid", 0))
            if node is not None and pid in node.child_pids():
                holders.append((node, pid))
        if not holders:
            holders = [(n, pid) for n in nodes.values() for pid in n.child_pids()]
        if not holders:
            return None
        node, pid = self.rng.choice(sorted(holders, key=lambda h: h[1]))
        return self._record("child", f"{node.name}/{pid}", [pid], sigkill_pid(self.client, pid))

    def kill_node(self, node: WorkerProcess | None = None, replace: bool = True) -> Kill | None:
        """SIGKILL a whole node (process group and descendants) mid-second, away from the beats'
        publishes; start a replacement."""
        time.sleep(max(0.0, math.floor(time.time()) + 1.5 - time.time()))
        if node is None:
            live = self.live_nodes()
            if not live:
                return None
            node = self.rng.choice(live)
        pids = {node.pid, *node.group_pids(), *node.child_pids()}
        concurrency = node.concurrency
        node.kill()
        kill = self._record("node", node.name, pids, server_time_us(self.client))
        if replace:
            self.start_node(concurrency)
        return kill

    def kill_beat(self, beat: BeatProcess | None = None, replace: bool = True) -> Kill | None:
        """SIGKILL a beat mid-second, between two publishes; start a replacement.

        (A kill inside a publish is test_chaos's deterministic pair of tests: one of its two
        windows duplicates the run.)"""
        time.sleep(max(0.0, math.floor(time.time()) + 1.5 - time.time()))
        if beat is None:
            live = self.live_beats()
            if not live:
                return None
            beat = self.rng.choice(live)
        beat.kill()
        kill = self._record("beat", beat.name, [beat.pid], server_time_us(self.client))
        if beat.killed_at is not None:
            kill = dataclasses.replace(kill, at=beat.killed_at)
            self.kills[-1] = kill
        if replace:
            self.start_beat()
        return kill

    def kill_after_body(self, timeout: float = 20.0) -> Kill | None:
        """SIGKILL a whole node right after one of its b.load runs finished its body (and the
        library's release), before the message is acked (beat_app's task_postrun hook); start
        a replacement. None when no run finished there within ``timeout``."""
        live = self.live_nodes()
        if not live:
            return None
        node = self.rng.choice(live)
        pids = {node.pid, *node.group_pids(), *node.child_pids()}
        flag = kill_after_body_key(self.prefix)
        self.client.set(flag, node.nodename)
        died = wait_for(lambda: not node.is_running(), timeout, "a kill after the body", fail=False)
        self.client.delete(flag)
        if not died:
            return None
        node.killed_at = node.killed_at or time.time()
        kill = self._record("after-body", node.name, pids, server_time_us(self.client))
        self.start_node(node.concurrency)
        return kill

    def random_kill(self) -> Kill | None:
        """One kill of a random kind: a pool child, a whole node, or a beat."""
        kind = self.rng.choice(["child", "node", "beat"])
        if kind == "child":
            return self.kill_child()
        if kind == "node":
            return self.kill_node()
        return self.kill_beat()

    # -- the end -----------------------------------------------------------------------------

    def stop_beats(self) -> float:
        """Stop every live beat (SIGTERM); return when the stop began (epoch s)."""
        self.beats_stopped_at = time.time()
        for beat in self.live_beats():
            beat.signal(signal.SIGTERM)
        for beat in self.live_beats():
            beat.terminate(timeout=15)
        return self.beats_stopped_at

    def pending(self) -> tuple[list[str], list[str]]:
        """Calls sent but not finished, and published scheduled runs (task ids) not started."""
        sent = {m.decode() for m in self.client.smembers(sent_key(self.prefix))}
        done = {m.decode() for m in self.client.smembers(done_key(self.prefix))}
        started = {r.task_id for r in load_beat_runs(self.client, beat_runs_key(self.prefix))}
        published = [p for b in self.beats for p in b.published()]
        unstarted = sorted(p.task_id for p in published if p.task_id not in started)
        return sorted(sent - done), unstarted

    def last_seen(self) -> dict[str, float]:
        """Task id -> time (epoch s) of the last worker log line that names it."""
        seen: dict[str, float] = {}
        for node in self.nodes:
            for line in parse_log(node.log_text()):
                for task_id in _TASK_ID.findall(line.text):
                    seen[task_id] = max(seen.get(task_id, 0.0), line.ts)
        return seen

    def in_flight_at_node_kill(self, task_id: str, since: float | None) -> bool:
        """True if a node was SIGKILLed while ``task_id`` was plausibly in flight to it.

        A message a node popped (BRPOP) but had not yet recorded as unacked dies with it:
        the kill came just after the last log line naming the task (a requeue publishes the
        next copy, popped at once), or, if no worker ever logged it, soon after ``since``
        (when it was sent or published)."""
        seen = self._seen.get(task_id)
        if seen is not None:
            low, high = seen - 0.2, seen + 2.0
        elif since is not None:
            low, high = since - 0.2, since + 5.0
        else:
            return False
        return any(k.kind in NODE_KILLS and low <= k.at <= high for k in self.kills)

    def drain(self, timeout: float) -> tuple[list[str], list[str]]:
        """Wait until every call finished and every published run started (or ``timeout``).

        Stops early when all that is left was in flight to a killed node and the broker has
        had its chance to restore it (visibility timeout + 3 s after the last node kill)."""
        deadline = time.monotonic() + timeout
        node_kills = [k.at for k in self.kills if k.kind in NODE_KILLS]
        settled = max(node_kills, default=0.0) + self.visibility + 3
        while True:
            calls, runs = self.pending()
            if (not calls and not runs) or time.monotonic() >= deadline:
                return calls, runs
            if time.time() >= settled:
                self._seen = self.last_seen()
                published = {p.task_id: p.ts for b in self.beats for p in b.published()}
                if all(self.in_flight_at_node_kill(c, self._call_since(c)) for c in calls) and all(
                    self.in_flight_at_node_kill(r, published.get(r)) for r in runs
                ):
                    return calls, runs
            time.sleep(0.25)

    def _call_since(self, task_id: str) -> float | None:
        """When call ``task_id`` was sent: by the test, or by the fan-out run it is named after."""
        if task_id.startswith("fanout-"):
            return self._seen.get(task_id.removeprefix("fanout-"))
        return self.sent_at.get(task_id)

    def stop_workers(self) -> None:
        """Warm shutdown of every live node (SIGTERM), all at once."""
        live = self.live_nodes()
        for node in live:
            node.signal(signal.SIGTERM)
        for node in live:
            node.terminate(timeout=30)

    def windows(self) -> list[BeatWindow]:
        """Each beat's life: first tick to kill (or to the final stop)."""
        windows = []
        for beat in self.beats:
            ready = beat_ready_at(beat)
            end = beat.killed_at or self.beats_stopped_at
            if ready is not None and end is not None:
                windows.append(BeatWindow(beat.name, ready, end))
        return windows

    def report(
        self, periods: Mapping[str, float], *, drain_timeout: float, lock_grace: float
    ) -> LoadReport:
        """Stop the beats, drain, stop the nodes, wait ``lock_grace``; check everything."""
        self.stop_beats()
        lost_calls, unstarted = self.drain(drain_timeout)
        self.stop_workers()
        stuck = wait_locks_gone(self.client, self.prefix, lock_grace)

        self._seen = self.last_seen()
        published_at = {p.task_id: p.ts for b in self.beats for p in b.published()}
        dropped_calls = []
        for task_id in lost_calls:
            if self.in_flight_at_node_kill(task_id, self._call_since(task_id)):
                dropped_calls.append(task_id)
        dropped_runs = [t for t in unstarted if self.in_flight_at_node_kill(t, published_at.get(t))]

        executions = close_killed(load_history(self.client, history_key(self.prefix)), self.kills)
        history = check_history(e for e in executions if e.key.startswith("load:"))
        beat = check_beat_runs(
            load_beat_runs(self.client, beat_runs_key(self.prefix)),
            dict(periods),
            self.windows(),
            published=[BeatRun(p.label, p.task_id) for b in self.beats for p in b.published()],
            beat_kills=[k.at for k in self.kills if k.kind == "beat"],
        )
        return LoadReport(
            history=history,
            beat=beat,
            lost_calls=lost_calls,
            dropped_calls=dropped_calls,
            unstarted_runs=unstarted,
            dropped_runs=dropped_runs,
            stuck_locks=stuck,
            kills=list(self.kills),
            sent=len(self.client.smembers(sent_key(self.prefix))),
            run_twice=sorted(m.decode() for m in self.client.smembers(reruns_key(self.prefix))),
            finished_twice=sorted(
                task_id.decode()
                for task_id, count in self.client.hgetall(finished_runs_key(self.prefix)).items()
                if int(count) > 1
            ),
        )

    def logs(self) -> str:
        """Worker and beat log tails, for failure messages."""
        return f"{self.worker_factory.logs()}\n{self.beat_factory.logs(200)}"
