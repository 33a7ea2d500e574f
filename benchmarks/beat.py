"""Section 5: what publishing one scheduled run costs, SingletonScheduler against plain beat.

Both schedulers run in this process against the private server as broker (a real kombu
connection; the messages pile up in the queue, no worker consumes them) and publish one
interval entry through ``apply_async(entry, producer=scheduler.producer, advance=False)``,
which is how beat's ``apply_entry`` calls it. For ``SingletonScheduler`` that is claim +
publish + confirm; its wall clock is replaced by a counter that moves one interval per call,
so every call is a new run that this instance wins (the path every published run takes).
Batches of calls alternate between the two schedulers; medians of µs per run.
"""

from __future__ import annotations

import itertools
import logging
import shutil
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from celery import Celery
from celery.beat import PersistentScheduler, ScheduleEntry
from celery.schedules import schedule

from celery_singleton_lock import SingletonScheduler

from .report import Table, median, spread
from .server import STATS_COMMANDS, PrivateRedis, command_stats, reset_stats

INTERVAL_S = 10.0
HARNESS_COMMANDS = STATS_COMMANDS


def _app(url: str) -> Celery:
    app = Celery("bench_beat", set_as_current=False)
    app.conf.update(
        broker_url=url,
        broker_connection_retry_on_startup=True,
        task_default_queue="bench-beat",
        singleton_key_prefix="bench-beat:",
    )

    @app.task(name="bench.beat_noop")  # type: ignore[untyped-decorator]
    def noop() -> None:
        return None

    return app


def _entry(app: Celery) -> ScheduleEntry:
    return ScheduleEntry(
        name="bench-entry",
        task="bench.beat_noop",
        schedule=schedule(timedelta(seconds=INTERVAL_S)),
        app=app,
    )


def _scheduler(cls: type, app: Celery, workdir: Path) -> Any:
    sched = cls(app=app, schedule_filename=str(workdir / cls.__name__), lazy=False)
    if cls is SingletonScheduler:
        slots = itertools.count(int(time.time() // INTERVAL_S) + 1)
        sched.singleton_clock = lambda: next(slots) * INTERVAL_S  # a new run every call
    return sched


def _batch(sched: Any, entry: ScheduleEntry, n: int) -> float:
    producer = sched.producer
    start = time.perf_counter()
    for _ in range(n):
        if sched.apply_async(entry, producer=producer, advance=False) is None:
            raise RuntimeError(f"{type(sched).__name__} did not publish")
    return (time.perf_counter() - start) / n * 1e6


def run(server: PrivateRedis, batch: int, rounds: int) -> tuple[Table, dict[str, list[float]]]:
    logging.getLogger("celery_singleton_lock.beat.scheduler").setLevel(logging.WARNING)
    workdir = Path(tempfile.mkdtemp(prefix="cslt-bench-beat-"))
    app = _app(server.url)
    client = server.client()
    scheds = {
        "PersistentScheduler (plain beat)": _scheduler(PersistentScheduler, app, workdir),
        "SingletonScheduler (claim + publish + confirm)": _scheduler(
            SingletonScheduler, app, workdir
        ),
    }
    entry = _entry(app)
    samples: dict[str, list[float]] = {name: [] for name in scheds}
    commands: dict[str, float] = {}
    try:
        for sched in scheds.values():  # warm up: connection, scripts, exchange declaration
            _batch(sched, entry, 50)
        for name, sched in scheds.items():
            reset_stats(client)
            _batch(sched, entry, batch)
            commands[name] = command_stats(client).total_calls(HARNESS_COMMANDS) / batch
        names = list(scheds)
        for r in range(rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                samples[name].append(_batch(scheds[name], entry, batch))
                client.delete("bench-beat")  # the queue: keep it small
    finally:
        for sched in scheds.values():
            sched.close()
        shutil.rmtree(workdir, ignore_errors=True)
    table = Table(
        "5. Beat: publishing one scheduled run",
        ["scheduler", "µs/run (median)", "min-max", "vs plain", "extra µs/run", "Redis cmds/run"],
    )
    plain_name = next(iter(samples))
    plain = median(samples[plain_name])
    for name, values in samples.items():
        table.add(
            name,
            median(values),
            spread(values),
            f"{median(values) / plain:.2f}x",
            "-" if name == plain_name else f"+{median(values) - plain:.0f}",
            commands[name],
        )
    table.notes.append(
        f"{rounds} rounds x {batch} runs per scheduler, alternating; in-process, real broker "
        "connection; Redis commands include those inside the claim/confirm scripts."
    )
    return table, samples
