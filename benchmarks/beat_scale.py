"""Section 5b: a large schedule, every entry due in the same minute.

N entries, each ``crontab()`` (every minute), so all N are due at the same minute. Measured:
the time from that minute to the last message published, the beat's CPU seconds until then,
and that each entry's run was published exactly once (the messages in the broker's queue,
counted per entry). Contenders: Celery's PersistentScheduler (plain beat), SingletonScheduler
in leader mode, in claims mode with one beat, and in claims mode with two active beats.

Each beat is a process of its own, forked from this one: a real scheduler class, the private
server as broker (a real kombu connection; no worker consumes) and as the claims' Redis, ticking
the way ``celery beat`` does (``tick()``, sleep what it returns, sync when due). Only its clock
is shifted: ``app.now`` and the singleton clock read the real clock plus an offset chosen so that
the schedule's minute comes about a second after every beat of the run has built its schedule
and ticked once. The clock runs at real speed, so the figures are real time. Logging is at
WARNING, Celery beat's default level. A run that has not published every entry after the cap is
cut off and reported as such.
"""

from __future__ import annotations

import json
import logging
import math
import multiprocessing
import shutil
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from multiprocessing.connection import Connection
from typing import Any

import redis
from celery import Celery
from celery.beat import PersistentScheduler
from celery.schedules import crontab
from celery.signals import after_task_publish

from celery_singleton_lock import SingletonScheduler

from .report import Table, median, spread
from .server import PrivateRedis

#: (label, scheduler, mode, beats)
CONTENDERS: tuple[tuple[str, str, str, int], ...] = (
    ("PersistentScheduler (plain beat)", "plain", "active", 1),
    ("SingletonScheduler, leader mode", "singleton", "leader", 1),
    ("SingletonScheduler, claims mode, 1 beat", "singleton", "active", 1),
    ("SingletonScheduler, claims mode, 2 beats", "singleton", "active", 2),
)
#: how far ahead of the minute the beats' clocks start (fake seconds), while they build
SETUP_AHEAD_S = 55.0
#: real seconds between the last beat being ready and the minute
LEAD_S = 1.0
#: how often a beat looks at the queue's length to know every run is out
POLL_S = 0.2


@dataclass
class Outcome:
    """One run of one contender."""

    last_publish_s: float  # from the minute to the last message published (nan: none)
    cpu_s: float  # every beat's CPU seconds from the minute to the end of its loop
    published: int  # messages in the queue
    once: bool  # every message of a distinct entry
    done: bool  # every entry published before the cap


def _app(url: str, queue: str, prefix: str, mode: str, entries: int) -> Celery:
    app = Celery("bench_beat_scale", set_as_current=False)
    app.conf.update(
        broker_url=url,
        broker_connection_retry_on_startup=True,
        task_default_queue=queue,
        singleton_redis_url=url,
        singleton_key_prefix=prefix,
        singleton_beat_mode=mode,
        beat_schedule={
            f"entry-{i}": {"task": "bench.scale_noop", "schedule": crontab(), "args": (i,)}
            for i in range(entries)
        },
    )

    @app.task(name="bench.scale_noop")  # type: ignore[untyped-decorator]
    def noop(i: int) -> None:
        return None

    return app


@dataclass(frozen=True)
class Job:
    """What one beat process of a run is given."""

    url: str
    queue: str
    prefix: str
    kind: str  # "plain" or "singleton"
    mode: str
    entries: int
    minute: float  # the schedule's minute, epoch seconds on the beats' shifted clock
    cap: float
    workdir: str


def _beat(conn: Connection, job: Job) -> None:
    """One beat process: build, tick once, say ready, wait for the minute's real time, tick
    like ``celery beat`` until every entry is in the queue (or the cap), report."""
    url, queue, n, minute, cap = job.url, job.queue, job.entries, job.minute, job.cap
    logging.basicConfig(level=logging.WARNING)
    offset = [minute - SETUP_AHEAD_S - time.time()]

    def clock() -> float:
        return time.time() + offset[0]

    app = _app(url, queue, job.prefix, job.mode, n)
    app.set_current()  # the shelve's entries come back without their app: they use the current
    app.now = lambda: datetime.fromtimestamp(clock(), timezone.utc).astimezone(app.timezone)
    published: list[float] = []
    after_task_publish.connect(lambda **_kw: published.append(time.time()), weak=False)
    cls = SingletonScheduler if job.kind == "singleton" else PersistentScheduler
    sched = cls(app=app, schedule_filename=f"{job.workdir}/{uuid.uuid4().hex}", max_interval=5)
    if job.kind == "singleton":
        sched.singleton_clock = clock
    sched.tick()  # the heap built (the lease taken), long before the minute
    conn.send("ready")
    start_real: float = conn.recv()  # real time of the minute
    offset[0] = minute - start_real
    broker = redis.Redis.from_url(url)
    cpu_at_minute: float | None = None
    looked = 0.0
    while True:
        if cpu_at_minute is None and time.time() >= start_real - 0.05:  # the tick of the minute
            cpu_at_minute = time.process_time()
        interval = sched.tick()
        now = time.time()
        if now - looked > POLL_S:
            looked = now
            if broker.llen(queue) >= n or now > start_real + cap:
                break
        if interval and interval > 0:
            time.sleep(min(interval, POLL_S))
            if sched.should_sync():
                sched._do_sync()
    cpu = time.process_time() - (cpu_at_minute or time.process_time())
    sched.close()
    conn.send({"last": published[-1] if published else math.nan, "cpu": cpu})


def _once(
    server: PrivateRedis, contender: tuple[str, str, str, int], n: int, cap: float
) -> Outcome:
    label, kind, mode, beats = contender
    queue = f"bench-scale-{uuid.uuid4().hex[:8]}"
    prefix = f"bench-scale:{uuid.uuid4().hex[:8]}:"
    minute = (math.floor(time.time() / 60) + 5) * 60.0  # any whole minute: the clocks are moved
    workdir = tempfile.mkdtemp(prefix="cslt-bench-scale-")
    ctx = multiprocessing.get_context("fork")
    pipes, procs = [], []
    try:
        for _ in range(beats):
            parent, child = ctx.Pipe()
            job = Job(server.url, queue, prefix, kind, mode, n, minute, cap, workdir)
            proc = ctx.Process(target=_beat, args=(child, job), daemon=True)
            proc.start()
            pipes.append(parent)
            procs.append(proc)
        for pipe in pipes:
            if not pipe.poll(600) or pipe.recv() != "ready":
                raise RuntimeError(f"{label}: a beat did not start")
        start_real = time.time() + LEAD_S
        for pipe in pipes:
            pipe.send(start_real)
        reports = [pipe.recv() for pipe in pipes]
        for proc in procs:
            proc.join(30)
        client = server.client()
        counts = _count(client, queue)
        client.delete(queue)
        client.close()
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        shutil.rmtree(workdir, ignore_errors=True)
    last = max((r["last"] for r in reports if not math.isnan(r["last"])), default=math.nan)
    total = sum(counts.values())
    return Outcome(
        last_publish_s=last - start_real,
        cpu_s=sum(r["cpu"] for r in reports),
        published=total,
        once=all(c == 1 for c in counts.values()) and set(counts) <= set(range(n)),
        done=len(counts) == n,
    )


def _count(client: redis.Redis, queue: str) -> Counter[int]:
    """Messages in ``queue`` per entry (its argument, read from the ``argsrepr`` header)."""
    counts: Counter[int] = Counter()
    size = client.llen(queue)
    for start in range(0, size, 5000):
        for raw in client.lrange(queue, start, start + 4999):
            headers = json.loads(raw)["headers"]
            counts[int(headers["argsrepr"].strip("()[],"))] += 1
    return counts


def run(
    server: PrivateRedis, sizes: Sequence[int], repeats: int, cap: float
) -> tuple[Table, dict[str, Any]]:
    """Every contender at every size, ``repeats`` times each (the contenders take turns)."""
    results: dict[tuple[str, int], list[Outcome]] = {}
    for n in sizes:
        for r in range(repeats):
            order = CONTENDERS if r % 2 == 0 else CONTENDERS[::-1]
            for contender in order:
                key = (contender[0], n)
                if results.get(key) and not results[key][0].done:
                    continue  # cut off once: its repeats would only wait the cap again
                results.setdefault(key, []).append(_once(server, contender, n, cap))
    table = Table(
        "5b. Beat: N crontab entries due in the same minute",
        [
            "scheduler",
            "entries",
            "minute to last publish s (median)",
            "min-max",
            "beat CPU s",
            "published",
            "each run once",
        ],
    )
    for (label, n), outcomes in results.items():
        done = all(o.done for o in outcomes)
        lasts = [o.last_publish_s for o in outcomes]
        table.add(
            label,
            n,
            median(lasts) if done else f"not done after {cap:g} s",
            spread(lasts) if done else "-",
            median([o.cpu_s for o in outcomes]),
            min(o.published for o in outcomes),
            "yes" if all(o.once for o in outcomes) else "NO",
        )
    table.notes.append(
        f"{repeats} run(s) per row (a cut-off row: one), the contenders taking turns; each beat a "
        "forked process ticking like celery beat against the private server (broker and claims), "
        "its clock shifted so the minute comes 1 s after every beat is ready; beat CPU: all the "
        "row's beats, from the minute to the end."
    )
    return table, {f"{label} @ {n}": [o.__dict__ for o in v] for (label, n), v in results.items()}


if __name__ == "__main__":
    import sys

    with PrivateRedis() as srv:
        sizes = tuple(int(a) for a in sys.argv[1:]) or (1000,)
        print(run(srv, sizes, 1, 60.0)[0].render())
