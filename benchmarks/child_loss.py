"""Section 6: how soon a SIGKILLed pool child's lock is released by the worker's main process.

    python -m benchmarks.child_loss                  # 100 kills of each kind, private server
    python -m benchmarks.child_loss --kills 300
    python -m benchmarks.run --only child_loss       # the same, as a section of the full run

One prefork worker (2 children) of ``benchmarks.bench_app`` on a private server. Each kill
publishes ``bench.hold`` (a SingletonTask, ttl 30 s, sleeping 60 s) under a new key, waits
until the lock hash names the pool child running it (its ``pid`` field), SIGKILLs that child
and then measures one of two things:

- **lock gone**: the time from the kill until the lock key is gone, polling ``EXISTS`` about
  every millisecond (only the main process can release it this early: the ttl is 30 s);
- **next call runs**: the time from the kill until a call of the same job runs instead of
  being skipped as a duplicate: ``bench.hold(key, 0)`` is called again (and its result read)
  as soon as the previous call came back skipped.

Both are printed as a distribution: count, p50, p90, p99, max, and how many within 1 s. A
release that waits for billiard's periodic pool maintenance (every 5 s) shows up near 5 s:
the next kill follows such a late release closely, so it waits nearly a whole period if it
is missed too. Figures: docs/performance.md, section 6.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

import redis
from celery.result import AsyncResult

from celery_singleton_lock import skip_info

from . import bench_app
from .report import Table, fmt
from .server import PrivateRedis
from .workers import BenchWorker

#: Children of the worker: one runs the job to be killed, the other takes the next call.
CONCURRENCY = 2
#: How long the killed run would hold the lock (it never gets there): far past every wait.
HOLD_S = 60.0
#: Longest wait for a release before the kill counts as not released (the ttl is 30 s).
GIVE_UP_S = 15.0
#: Within this, a release counts as prompt.
PROMPT_S = 1.0
POLL_S = 0.001


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q``-th percentile (0 < q <= 100) of ``values``."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def _wait(condition: Callable[[], object], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(POLL_S)
    return True


class Killer:
    """Starts runs of ``bench.hold`` on the worker and SIGKILLs the child running each."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client

    def start_and_kill(self) -> tuple[str, str, float]:
        """A new run under a fresh key, killed once it holds its lock: (key, lock, kill time)."""
        key = f"loss-{uuid.uuid4().hex[:12]}"
        lock = bench_app.hold.singleton_keys((key,), {}).lock
        bench_app.hold.apply_async((key, HOLD_S))
        pid = None

        def holder_pid() -> object:
            nonlocal pid
            pid = self.client.hget(lock, "pid")
            return pid

        if not _wait(holder_pid, 30):
            raise RuntimeError(f"the run of {key} never took its lock")
        assert pid is not None
        os.kill(int(pid), signal.SIGKILL)
        return key, lock, time.monotonic()

    def lock_gone(self) -> float:
        """Seconds from a kill until its lock is gone (inf: not within GIVE_UP_S)."""
        _key, lock, killed_at = self.start_and_kill()
        if not _wait(lambda: not self.client.exists(lock), GIVE_UP_S):
            return math.inf
        return time.monotonic() - killed_at

    def next_call_runs(self) -> float:
        """Seconds from a kill until a call of the same job runs (inf: not within GIVE_UP_S)."""
        key, lock, killed_at = self.start_and_kill()
        while time.monotonic() - killed_at < GIVE_UP_S:
            result: AsyncResult = bench_app.hold.apply_async((key, 0.0))
            if skip_info(result.get(timeout=GIVE_UP_S)) is None:
                elapsed = time.monotonic() - killed_at
                _wait(lambda: not self.client.exists(lock), GIVE_UP_S)  # its own release
                return elapsed
        return math.inf


def distribution_row(label: str, seconds: Sequence[float]) -> list[object]:
    """count, p50, p90, p99, max (ms) and the share within PROMPT_S."""
    prompt = sum(1 for s in seconds if s <= PROMPT_S)
    return [
        label,
        len(seconds),
        *(percentile(seconds, q) * 1000 for q in (50, 90, 99, 100)),
        f"{prompt} ({prompt * 100 / len(seconds):.0f}%)",
    ]


def run(server: PrivateRedis, kills: int, next_calls: int) -> tuple[Table, dict[str, list[float]]]:
    """``kills`` kills measured to the lock's release, ``next_calls`` to the next run."""
    app = bench_app.configure(server.url)
    client = server.client()
    worker = BenchWorker(server.url, "prefork", CONCURRENCY)
    series: dict[str, list[float]] = {"lock gone": [], "next call runs": []}
    try:
        worker.wait_ready(app)
        killer = Killer(client)
        series["lock gone"] = [killer.lock_gone() for _ in range(kills)]
        series["next call runs"] = [killer.next_call_runs() for _ in range(next_calls)]
    finally:
        worker.close()
        client.close()
    table = Table(
        "6. A pool child SIGKILLed mid-run: time from the kill (prefork, 2 children, ttl 30 s)",
        ["measured until", "kills", "p50 ms", "p90 ms", "p99 ms", "max ms", "within 1 s"],
    )
    for label, seconds in series.items():
        if seconds:
            table.add(*distribution_row(label, seconds))
    table.notes += [
        "lock gone: EXISTS polled every ~1 ms; next call runs: the same job called again each",
        "time it came back skipped, until one ran. inf: not within "
        f"{fmt(GIVE_UP_S)} s (the ttl is 30 s).",
    ]
    return table, series


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.child_loss", description=__doc__)
    parser.add_argument("--kills", type=int, default=100, help="kills of each kind")
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table too")
    parser.add_argument("--json", type=Path, help="also write the table as JSON here")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with PrivateRedis() as server:
        print(f"{server.version()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}")
        table, _ = run(server, args.kills, args.kills)
    print(table.render())
    if args.markdown:
        print("\n" + table.markdown())
    if args.json:
        args.json.write_text(json.dumps(table.__dict__, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
