"""Section 2: end-to-end throughput of no-op tasks through a real worker process.

One worker subprocess per pool (solo; prefork with two children) consumes from the private
Redis broker and stores results in it. For each base class, the benchmark process publishes
N tasks with distinct arguments, then polls the result keys (MGET) until every one is
ready; the figure is N over the time from the first publish to the last result. The base
classes take turns, in a rotating order, and the medians over the repeats are compared with
plain ``Task`` measured in the same rounds.

The publisher does not subscribe to result channels (Celery's Redis backend would, one
SUBSCRIBE per task, for ``.get()``), since the results are read by polling: that cost is the
same for every contender and only adds noise. ``INFO commandstats`` is reset before each
batch; the commands the benchmark itself sends (MGET, INFO, CONFIG) are left out of the
Redis commands per task.

The same worker also runs the real-worker contention case of section 4: ten lock keys are
held by the benchmark process and every delivery is a duplicate that ``SingletonTask``
skips (a result marked skipped, the body never runs).
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis

from celery_singleton_lock.core.connection import store_for
from celery_singleton_lock.core.joiners import joiners_key

from .report import Table, median, paired_ratio, spread
from .server import STATS_COMMANDS, PrivateRedis, command_stats, reset_stats
from .workers import BenchWorker

#: commands the benchmark itself sends while measuring
HARNESS_COMMANDS = STATS_COMMANDS | {"mget"}

POOLS: tuple[tuple[str, int], ...] = (("solo", 1), ("threads", 2), ("prefork", 2))

DUPLICATES = "SingletonTask, every delivery a duplicate (skipped)"
COALESCED = "SingletonTask, coalesce: every delivery a duplicate (coalesced)"
JOINED = "SingletonTask, join: every delivery a duplicate (joined)"
DEBOUNCED = "SingletonTask, debounce: every call debounced (superseded, the last skipped)"
#: the duplicate rows of 4b: their task, taking turns with section 2's rounds
DUPLICATE_ROWS = {
    DUPLICATES: "singleton",
    COALESCED: "coalesce",
    JOINED: "join",
    DEBOUNCED: "debounce",
}
DUP_KEYS = 10
#: 4b's floor row, in the same rounds: what a skip must at least do (store a result, ack)
SKIP_FLOOR = "floor of a skip: result stored in the main process, acked (no lock, no run)"
#: a skip's CPU at most this times the skip floor's, in solo and threads (at most a plain
#: run's in prefork, where the pool's children skip)
FLOOR_TARGET = 1.35
FLOOD = "SingletonTask, duplicates of one held key (all skipped)"
NO_RESULT_ROW = "plain Task storing no result (receive, run, ack)"
ACK_STORE_ROW = "result stored in the main process, no run (floor of a skip: receive, store, ack)"
ACK_ONLY_ROW = "acknowledged in the main process, nothing else (floor: receive, ack)"
#: flood rows that store no result: the queue and kombu's unacked hash drain instead
NO_RESULTS = (NO_RESULT_ROW, ACK_ONLY_ROW)
#: The queue of the flood rows: filled while no worker consumes it, then drained at once.
FLOOD_QUEUE = "bench-flood"


@dataclass
class Batch:
    seconds: float
    publish_s: float
    worker_cpu_s: float
    commands: int
    n: int

    @property
    def rate(self) -> float:
        return self.n / self.seconds


@dataclass
class Series:
    pool: str
    name: str
    batches: list[Batch] = field(default_factory=list)

    @property
    def rates(self) -> list[float]:
        return [b.rate for b in self.batches]

    @property
    def rate(self) -> float:
        return median(self.rates)

    def per_task(self, value: Callable[[Batch], float]) -> float:
        return median([value(b) / b.n for b in self.batches])

    def vs(self, base: Series) -> float:
        """Throughput relative to ``base``, round by round."""
        return paired_ratio(self.rates, base.rates)

    def cpu_vs(self, base: Series) -> float:
        """Worker CPU per task relative to ``base``, round by round."""
        return paired_ratio(
            [b.worker_cpu_s / b.n for b in self.batches],
            [b.worker_cpu_s / b.n for b in base.batches],
        )


class _Counter:
    def __init__(self) -> None:
        self.value = int(time.time() * 1000) % 10_000_000 * 1000

    def take(self, n: int) -> int:
        start = self.value
        self.value += n
        return start


def _args_from(base: int) -> Callable[[int], tuple[int]]:
    """The i-th task's arguments in a batch: ``(base + i,)``."""
    return lambda i: (base + i,)


def _wait_all(
    client: redis.Redis, keys: Sequence[str], timeout: float, worker: BenchWorker
) -> None:
    """Poll until every result key holds a result; fail on an unexpected state."""
    pending = list(keys)
    deadline = time.monotonic() + timeout
    while pending:
        left: list[str] = []
        for start in range(0, len(pending), 1000):
            chunk = pending[start : start + 1000]
            for key, value in zip(chunk, client.mget(chunk), strict=True):
                if value is None:
                    left.append(key)
                    continue
                status = json.loads(value)["status"]
                if status != "SUCCESS":
                    raise RuntimeError(f"{key}: state {status}:\n{value[:500]!r}")
        pending = left
        if pending:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{len(pending)} results missing after {timeout}s:\n{worker.log_tail()}"
                )
            time.sleep(0.005)


def _wait_drained(
    client: redis.Redis, timeout: float, worker: BenchWorker, unacked_before: int = 0
) -> None:
    """Poll until the flood queue is empty and no message of it is left unacknowledged (of
    kombu's unacked hash, ``unacked_before`` messages were someone else's: a closed worker's
    watch copies, restored only after the visibility timeout)."""
    deadline = time.monotonic() + timeout
    while client.llen(FLOOD_QUEUE) or client.hlen("unacked") > unacked_before:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{FLOOD_QUEUE} not drained after {timeout}s:\n{worker.log_tail()}")
        time.sleep(0.005)


def _batch(
    app: Any,
    task: Any,
    args_of: Callable[[int], tuple[Any, ...]],
    *,
    n: int,
    client: redis.Redis,
    worker: BenchWorker,
    joiners: Sequence[str] = (),
) -> Batch:
    """``n`` messages of ``task``, done when every result is stored; with ``joiners`` (the
    joiners' hashes of held keys: duplicates that join a run store no result until it ends),
    when every one of them has joined."""
    ids = [uuid.uuid4().hex for _ in range(n)]
    keys = [app.backend.get_key_for_task(tid).decode() for tid in ids]
    joined_before = sum(int(client.hlen(key)) for key in joiners)
    reset_stats(client)
    cpu0 = worker.cpu_seconds()
    start = time.perf_counter()
    for i, tid in enumerate(ids):
        task.apply_async(args=args_of(i), task_id=tid)
    published = time.perf_counter()
    if joiners:
        _wait_joined(client, joiners, joined_before + n, timeout=60 + n / 20, worker=worker)
    else:
        _wait_all(client, keys, timeout=60 + n / 20, worker=worker)
    end = time.perf_counter()
    cpu = worker.cpu_seconds() - cpu0
    commands = command_stats(client).total_calls(HARNESS_COMMANDS)
    client.delete(*keys)
    return Batch(end - start, published - start, cpu, commands, n)


def run(
    server: PrivateRedis, n: int, repeats: int, dup_n: int, flood_n: int
) -> tuple[Table, list[Series], list[Series], list[Flood]]:
    from . import bench_app

    app = bench_app.configure(server.url)
    app.backend.on_task_call = lambda producer, task_id: None  # results are polled
    client = server.client()
    counter = _Counter()
    series: list[Series] = []
    dup_series: list[Series] = []
    floods: list[Flood] = []
    contenders = [*bench_app.TASKS, *DUPLICATE_ROWS, SKIP_FLOOR]
    for pool, concurrency in POOLS:
        worker = BenchWorker(server.url, pool, concurrency)
        try:
            worker.wait_ready(app)
            label = pool if pool == "solo" else f"{pool} -c {concurrency}"
            by_name = {name: Series(label, name) for name in contenders}
            with (
                _held_keys(app, counter, DUP_KEYS, bench_app.singleton) as dup_base,
                _held_keys(app, counter, DUP_KEYS, bench_app.coalesce) as coalesce_base,
                _held_keys(app, counter, DUP_KEYS, bench_app.join) as join_base,
                _held_keys(app, counter, DUP_KEYS, bench_app.debounce) as debounce_base,
            ):
                bases = {
                    DUPLICATES: dup_base,
                    COALESCED: coalesce_base,
                    JOINED: join_base,
                    DEBOUNCED: debounce_base,
                }
                join_hashes = [
                    joiners_key(bench_app.join.singleton_keys((join_base + k,), {}).lock)
                    for k in range(DUP_KEYS)
                ]

                def batch(
                    name: str,
                    size: int,
                    worker: BenchWorker = worker,
                    bases: Any = bases,
                    join_hashes: Sequence[str] = join_hashes,
                ) -> Batch:
                    hashes: Sequence[str] = ()
                    if name in DUPLICATE_ROWS:  # every delivery meets a held lock
                        task = getattr(bench_app, DUPLICATE_ROWS[name])
                        args_of = _cycling(bases[name], DUP_KEYS)
                        hashes = join_hashes if name == JOINED else ()
                    elif name == SKIP_FLOOR:
                        task, args_of = bench_app.ack_store, _args_from(counter.take(size))
                    else:
                        task, args_of = bench_app.TASKS[name], _args_from(counter.take(size))
                    return _batch(
                        app, task, args_of, n=size, client=client, worker=worker, joiners=hashes
                    )

                for name in contenders:  # warm up: imports, connections, scripts, threads
                    batch(name, 50)
                for r in range(repeats):
                    shift = r % len(contenders)
                    for name in contenders[shift:] + contenders[:shift]:
                        size = dup_n if name in (*DUPLICATE_ROWS, SKIP_FLOOR) else n
                        by_name[name].batches.append(batch(name, size))
                # the floods on a fresh worker: this one's timers hold the joined duplicates'
                # watch copies (due as the held locks expire), whose memory and unacknowledged
                # messages are no part of a flood
                worker.close()
                worker = BenchWorker(server.url, pool, concurrency)
                worker.wait_ready(app)
                plain_args = _args_from(counter.take(flood_n))
                for task, args_of, what in (
                    (bench_app.plain, plain_args, "plain Task"),
                    (bench_app.singleton, _cycling(dup_base, 1), FLOOD),
                    (bench_app.no_result, _args_from(counter.take(flood_n)), NO_RESULT_ROW),
                    (bench_app.ack_store, _args_from(counter.take(flood_n)), ACK_STORE_ROW),
                    (bench_app.ack_only, _args_from(counter.take(flood_n)), ACK_ONLY_ROW),
                ):
                    floods.append(_flood(app, label, task, args_of, flood_n, client, worker, what))
            dup_series += [by_name.pop(name) for name in (*DUPLICATE_ROWS, SKIP_FLOOR)]
            series += by_name.values()
        finally:
            worker.close()
    return _table(series, n, repeats), series, dup_series, floods


def _wait_joined(
    client: redis.Redis, hashes: Sequence[str], total: int, *, timeout: float, worker: BenchWorker
) -> None:
    """Until the joiners' hashes hold ``total`` fields (HLEN, a round trip per poll)."""
    deadline = time.monotonic() + timeout
    while sum(int(client.hlen(key)) for key in hashes) < total:
        if time.monotonic() > deadline:
            raise TimeoutError(f"not every duplicate joined in {timeout} s:\n{worker.log_tail()}")
        time.sleep(0.002)


def _cycling(base: int, keys: int) -> Callable[[int], tuple[int]]:
    """The i-th call's arguments cycle through ``keys`` held keys: ``(base + i % keys,)``."""
    return lambda i: (base + i % keys,)


@contextlib.contextmanager
def _held_keys(app: Any, counter: _Counter, count: int, task: Any) -> Iterator[int]:
    """Hold the locks of ``task(base + k)`` for k < count, as another run would; yield
    ``base``."""
    store = store_for(server_url(app))
    base = counter.take(count)
    holders = []
    for k in range(count):
        keys = task.singleton_keys((base + k,), {})
        owner = f"holder-{uuid.uuid4().hex}"
        store.acquire(keys, owner, 0, 600_000)
        holders.append((keys, owner))
    try:
        yield base
    finally:
        for keys, owner in holders:
            store.release(keys.lock, owner, 0)


@dataclass
class Flood:
    """``n`` messages queued while nothing consumed them, then drained by one worker."""

    pool: str
    what: str
    n: int
    seconds: float
    worker_cpu_s: float
    rss_before: int
    rss_peak: int
    rss_after: int

    @property
    def rate(self) -> float:
        return self.n / self.seconds


def _flood(  # noqa: PLR0917 - where, what, and how many
    app: Any,
    pool: str,
    task: Any,
    args_of: Callable[[int], tuple[Any, ...]],
    n: int,
    client: redis.Redis,
    worker: BenchWorker,
    what: str,
) -> Flood:
    """Queue ``n`` calls on a queue the worker does not consume, then let it consume it; the
    drain time runs from that moment to the last result; the worker's memory is sampled."""
    ids = [uuid.uuid4().hex for _ in range(n)]
    keys = [app.backend.get_key_for_task(tid).decode() for tid in ids]
    for i, tid in enumerate(ids):
        task.apply_async(args=args_of(i), task_id=tid, queue=FLOOD_QUEUE)
    rss_before = worker.rss_bytes()
    peak = [rss_before]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.05):
            peak[0] = max(peak[0], worker.rss_bytes())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    cpu0 = worker.cpu_seconds()
    unacked_before = int(client.hlen("unacked"))
    start = time.perf_counter()
    app.control.add_consumer(FLOOD_QUEUE, destination=[worker.nodename], reply=True, timeout=5)
    try:
        if what in NO_RESULTS:  # no results to poll: the queue and kombu's unacked hash drain
            _wait_drained(client, timeout=60 + n / 20, worker=worker, unacked_before=unacked_before)
        else:
            _wait_all(client, keys, timeout=60 + n / 20, worker=worker)
        seconds = time.perf_counter() - start
        cpu = worker.cpu_seconds() - cpu0
    finally:
        done.set()
        sampler.join()
        app.control.cancel_consumer(
            FLOOD_QUEUE, destination=[worker.nodename], reply=True, timeout=5
        )
    for first in range(0, n, 1000):
        client.delete(*keys[first : first + 1000])
    return Flood(pool, what, n, seconds, cpu, rss_before, peak[0], worker.rss_bytes())


def server_url(app: Any) -> str:
    return str(app.conf.broker_url)


def _table(series: list[Series], n: int, repeats: int) -> Table:
    table = Table(
        "2. End-to-end throughput: no-op tasks with distinct arguments, real worker",
        [
            "pool",
            "base class",
            "tasks/s (median)",
            "min-max",
            "vs plain",
            "publish µs/task",
            "worker CPU µs/task",
            "CPU vs plain",
            "Redis cmds/task",
        ],
    )
    plain = {s.pool: s for s in series if s.name == "plain Task"}
    for s in series:
        base = plain[s.pool]
        table.add(
            s.pool,
            s.name,
            s.rate,
            spread(s.rates),
            f"{s.vs(base):.0%}",
            s.per_task(lambda b: b.publish_s * 1e6),
            s.per_task(lambda b: b.worker_cpu_s * 1e6),
            f"{s.cpu_vs(base):.2f}x",
            s.per_task(lambda b: float(b.commands)),
        )
    ours = ", ".join(
        f"{s.pool}: {s.vs(plain[s.pool]):.0%}" for s in series if s.name == "SingletonTask"
    )
    table.notes.append(
        f"{repeats} batches of {n} tasks per row, base classes interleaved; from the first "
        "publish to the last result; ratios are medians of per-round ratios. "
        f"SingletonTask: {ours} of plain; the run's target is read in instructions (2c)."
    )
    return table


def duplicates_table(dups: list[Series], series: list[Series], n: int, repeats: int) -> Table:
    """Section 4b: deliveries that all meet a held lock and are skipped, against plain runs and
    the floor of a skip (a result stored and an ack, in the main process) of the same rounds."""
    table = Table(
        f"4b. Contention through a real worker: every delivery a duplicate ({DUP_KEYS} keys held)",
        [
            "pool",
            "policy",
            "duplicates handled/s (median)",
            "min-max",
            "vs plain tasks/s",
            "worker CPU µs/duplicate",
            "vs a plain run's CPU",
            "vs the skip floor's CPU",
            "min-max",
            "Redis cmds/duplicate",
        ],
    )
    readings = []
    for d in dups:
        plain = next(s for s in series if s.pool == d.pool and s.name == "plain Task")
        floor = next(s for s in dups if s.pool == d.pool and s.name == SKIP_FLOOR)
        to_floor = [
            a.worker_cpu_s / a.n / (b.worker_cpu_s / b.n)
            for a, b in zip(d.batches, floor.batches, strict=True)
        ]
        policy = {
            DUPLICATES: "skip",
            COALESCED: "coalesce",
            JOINED: "join",
            DEBOUNCED: "debounce",
        }.get(d.name, d.name)
        table.add(
            d.pool,
            policy,
            d.rate,
            spread(d.rates),
            f"{d.vs(plain):.2f}x",
            d.per_task(lambda b: b.worker_cpu_s * 1e6),
            f"{d.cpu_vs(plain):.2f}x",
            f"{median(to_floor):.2f}x",
            spread(to_floor),
            d.per_task(lambda b: float(b.commands)),
        )
        if d.name == DUPLICATES:
            if d.pool.startswith("prefork"):
                ratio, limit, against = d.cpu_vs(plain), 1.0, "a plain run's"
            else:
                ratio, limit, against = median(to_floor), FLOOR_TARGET, "the skip floor's"
            verdict = "met" if ratio <= limit else "not met"
            readings.append(f"{d.pool}: {ratio:.2f}x {against} (<= {limit:.2f}x: {verdict})")
    table.notes.append(
        f"{repeats} batches of {n} SingletonTask deliveries whose keys are held by the "
        "benchmark, interleaved with section 2's rounds; each is skipped (result stored, body "
        "not run), or under coalesce left as the held lock's follow-up (coalesce.lua, one more "
        "round trip) and then ended as a skip, or under join kept beside the held lock "
        "(join.lua), a watch copy of its message published and the delivery acknowledged "
        "without a result (a batch of joined duplicates ends once all have joined), or "
        "under debounce (50 ms; the calls of a key come faster than that) told to wait "
        "(debounce.lua), a copy of its message published due 50 ms later and the delivery "
        "acknowledged, then the copy, come due, superseded by a later call (debounce.lua "
        "again) and ended as a skip, the last call of each key skipped by the held lock. "
        "The floor row stores a SUCCESS result and acks "
        "each message in the worker's main process (no lock, no run): the least a skip can "
        "cost. Ratios are medians of per-round ratios against plain Task and the floor of the "
        "same pool and rounds; min-max is the spread of the per-round ratios to the floor. "
        f"Target: a skip's CPU at most {FLOOR_TARGET}x the skip floor's in solo and threads, at "
        f"most a plain run's in prefork ({'; '.join(readings)})."
    )
    return table


def flood_table(floods: list[Flood]) -> Table:
    """Section 4c: a queue full of duplicates of one key, drained by one worker."""
    table = Table(
        "4c. A flood: queued messages drained by one worker",
        [
            "pool",
            "messages",
            "drained/s",
            "vs plain",
            "worker CPU µs/message",
            "CPU vs plain",
            "CPU vs skip floor",
            "RSS MB before",
            "peak",
            "after",
        ],
    )
    mb = 1 / (1 << 20)
    plain = {f.pool: f for f in floods if f.what == "plain Task"}
    floor = {f.pool: f for f in floods if f.what == ACK_STORE_ROW}
    for f in floods:
        table.add(
            f.pool,
            f"{f.n:,} {f.what}",
            f.rate,
            f"{f.rate / plain[f.pool].rate:.2f}x",
            f.worker_cpu_s / f.n * 1e6,
            f"{f.worker_cpu_s / plain[f.pool].worker_cpu_s:.2f}x",
            f"{f.worker_cpu_s / floor[f.pool].worker_cpu_s:.2f}x",
            f.rss_before * mb,
            f.rss_peak * mb,
            f.rss_after * mb,
        )
    table.notes.append(
        "The messages are queued while the worker does not consume their queue, then it is told "
        "to (add_consumer); from then to the last result. RSS: the worker and its children, "
        "sampled every 50 ms. One flood per row. The two rows handled in the main process "
        "are floors under any per-message handling inside Celery's worker: a Celery Strategy "
        "that only acknowledges, and one that stores a SUCCESS result and acknowledges (what a "
        "skipped duplicate must at least do, before it even asks Redis about the lock)."
    )
    return table
