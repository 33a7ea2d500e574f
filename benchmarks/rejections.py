"""Section 7: duplicates turned away at publish time, in the publishing process.

One process calls ``delay()`` of a call whose duplicate is already queued (nothing consumes
the queue), N times in a row; every call is turned away. Contenders:

- ``SingletonTask`` with ``singleton_lock_on="publish"``: ``publish.lua`` finds the queued
  marker (or, in the second row, the lock held by a running holder) and returns that holder's
  AsyncResult;
- celery-singleton: ``SET NX`` of its lock fails, a ``GET`` reads the holder's task id;
- celery-once (graceful): ``SET NX`` fails, a ``PTTL`` gives the remaining time; ``delay()``
  returns None;
- the floors: one ``PING`` per call through a redis-py client, and a plain ``delay()`` that
  publishes every call (what a duplicate would cost if nothing turned it away).

Contenders take turns round by round in a rotating order; each round uses fresh arguments.
Rejections per second are N over the wall time of the N calls; publisher CPU is the process's
CPU time over them; Redis commands per call are counted by the (private) server.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from celery_singleton_lock.core.connection import store_for

from .report import Table, median, paired_ratio, spread
from .server import STATS_COMMANDS, PrivateRedis, command_stats, reset_stats

QUEUE = "bench-rejected"  # nothing consumes it

OURS_QUEUED = "SingletonTask, lock_on=publish (an identical call queued)"
OURS_RUNNING = "SingletonTask, lock_on=publish (the lock held by a run)"
CELERY_SINGLETON = "celery-singleton"
CELERY_ONCE = "celery-once (graceful)"
PING = "one PING per call (floor: a round trip)"
PLAIN = "plain delay(), published every time"


@dataclass
class Series:
    name: str
    rates: list[float] = field(default_factory=list)
    cpu_us: list[float] = field(default_factory=list)
    commands: list[float] = field(default_factory=list)


def run(server: PrivateRedis, n: int, repeats: int) -> tuple[Table, dict[str, Series]]:
    from . import bench_app

    bench_app.configure(server.url)
    client = server.client()
    store = store_for(server.url)
    ping_client = server.client()

    def ours_queued(i: int) -> Callable[[], Any]:
        task = bench_app.at_publish
        task.apply_async((i,), queue=QUEUE)  # the call that waits in the queue
        return lambda: task.apply_async((i,), queue=QUEUE)

    def ours_running(i: int) -> Callable[[], Any]:
        task = bench_app.at_publish
        store.acquire(task.singleton_keys((i,), {}), f"holder-{uuid.uuid4().hex}", 0, 600_000)
        return lambda: task.apply_async((i,), queue=QUEUE)

    def celery_singleton(i: int) -> Callable[[], Any]:
        task = bench_app.celery_singleton
        task.apply_async((i,), queue=QUEUE)
        return lambda: task.apply_async((i,), queue=QUEUE)

    def celery_once(i: int) -> Callable[[], Any]:
        task = bench_app.celery_once
        task.apply_async((i,), queue=QUEUE)
        return lambda: task.apply_async((i,), queue=QUEUE)

    def ping(i: int) -> Callable[[], Any]:
        return ping_client.ping

    def plain(i: int) -> Callable[[], Any]:
        task = bench_app.plain
        return lambda: task.apply_async((i,), queue=QUEUE)

    contenders: dict[str, Callable[[int], Callable[[], Any]]] = {
        OURS_QUEUED: ours_queued,
        OURS_RUNNING: ours_running,
        CELERY_SINGLETON: celery_singleton,
        CELERY_ONCE: celery_once,
        PING: ping,
        PLAIN: plain,
    }
    series = {name: Series(name) for name in contenders}
    names = list(contenders)
    base = int(time.time() * 1000) % 10_000_000 * 1000
    for r in range(repeats + 1):  # round 0 warms up (imports, connections, scripts)
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            base += 1
            call = contenders[name](base)
            count = n if r else 50
            reset_stats(client)
            cpu0, t0 = time.process_time(), time.perf_counter()
            for _ in range(count):
                call()
            seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
            commands = command_stats(client).total_calls(STATS_COMMANDS)
            if r:
                series[name].rates.append(count / seconds)
                series[name].cpu_us.append(cpu / count * 1e6)
                series[name].commands.append(commands / count)
            client.delete(QUEUE)
    return _table(series, n, repeats), series


def _table(series: dict[str, Series], n: int, repeats: int) -> Table:
    table = Table(
        "7. Duplicates turned away at publish: delay() of a call already queued",
        [
            "contender",
            "calls/s (median)",
            "min-max",
            "vs ours (queued)",
            "publisher CPU µs/call",
            "CPU vs ours",
            "Redis cmds/call",
        ],
    )
    ours = series[OURS_QUEUED]
    for s in series.values():
        table.add(
            s.name,
            median(s.rates),
            spread(s.rates),
            f"{paired_ratio(s.rates, ours.rates):.2f}x",
            median(s.cpu_us),
            f"{paired_ratio(s.cpu_us, ours.cpu_us):.2f}x",
            median(s.commands),
        )
    table.notes.append(
        f"{repeats} rounds of {n} calls per contender, interleaved; ratios are medians of "
        "per-round ratios. Every call but the plain row's is turned away; Redis commands are "
        "counted by the server, including those inside Lua scripts."
    )
    return table


def main(argv: list[str] | None = None) -> int:
    """Section 7 alone; ``benchmarks.run`` runs it in a process of its own, as it does 2c."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.rejections")
    parser.add_argument("--calls", type=int, default=2000, help="calls per round")
    parser.add_argument("--repeat", type=int, default=10, help="rounds")
    parser.add_argument("--json", type=Path, help="write the table here as JSON")
    args = parser.parse_args(argv)
    with PrivateRedis() as server:
        table, _ = run(server, args.calls, args.repeat)
    print(table.render())
    if args.json:
        args.json.write_text(json.dumps(table.__dict__, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
