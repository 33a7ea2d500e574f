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

import json
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis

from celery_singleton_lock.core.connection import store_for

from .report import Table, median, paired_ratio, spread
from .server import STATS_COMMANDS, PrivateRedis, command_stats, reset_stats
from .workers import BenchWorker

#: commands the benchmark itself sends while measuring
HARNESS_COMMANDS = STATS_COMMANDS | {"mget"}

POOLS: tuple[tuple[str, int], ...] = (("solo", 1), ("prefork", 2))

DUPLICATES = "SingletonTask, every delivery a duplicate (skipped)"
DUP_KEYS = 10


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


def _batch(
    app: Any,
    task: Any,
    args_of: Callable[[int], tuple[Any, ...]],
    *,
    n: int,
    client: redis.Redis,
    worker: BenchWorker,
) -> Batch:
    ids = [uuid.uuid4().hex for _ in range(n)]
    keys = [app.backend.get_key_for_task(tid).decode() for tid in ids]
    reset_stats(client)
    cpu0 = worker.cpu_seconds()
    start = time.perf_counter()
    for i, tid in enumerate(ids):
        task.apply_async(args=args_of(i), task_id=tid)
    published = time.perf_counter()
    _wait_all(client, keys, timeout=60 + n / 20, worker=worker)
    end = time.perf_counter()
    cpu = worker.cpu_seconds() - cpu0
    commands = command_stats(client).total_calls(HARNESS_COMMANDS)
    client.delete(*keys)
    return Batch(end - start, published - start, cpu, commands, n)


def run(
    server: PrivateRedis, n: int, repeats: int, dup_n: int
) -> tuple[Table, list[Series], list[Series]]:
    from . import bench_app

    app = bench_app.configure(server.url)
    app.backend.on_task_call = lambda producer, task_id: None  # results are polled
    client = server.client()
    counter = _Counter()
    series: list[Series] = []
    dup_series: list[Series] = []
    names = list(bench_app.TASKS)
    for pool, concurrency in POOLS:
        worker = BenchWorker(server.url, pool, concurrency)
        try:
            worker.wait_ready(app)
            label = pool if pool == "solo" else f"{pool} -c {concurrency}"
            by_name = {name: Series(label, name) for name in names}
            for name in names:  # warm up: imports, connections, scripts, renewer threads
                base = counter.take(50)
                _batch(
                    app,
                    bench_app.TASKS[name],
                    _args_from(base),
                    n=50,
                    client=client,
                    worker=worker,
                )
            for r in range(repeats):
                shift = r % len(names)
                for name in names[shift:] + names[:shift]:
                    base = counter.take(n)
                    by_name[name].batches.append(
                        _batch(
                            app,
                            bench_app.TASKS[name],
                            _args_from(base),
                            n=n,
                            client=client,
                            worker=worker,
                        )
                    )
            series += by_name.values()
            dup_series.append(
                _duplicates(
                    app,
                    label,
                    n=dup_n,
                    repeats=repeats,
                    client=client,
                    worker=worker,
                    counter=counter,
                )
            )
        finally:
            worker.close()
    return _table(series, n, repeats), series, dup_series


def _duplicates(
    app: Any,
    label: str,
    *,
    n: int,
    repeats: int,
    client: redis.Redis,
    worker: BenchWorker,
    counter: _Counter,
) -> Series:
    """Every delivery meets a held lock: the worker skips them all."""
    from . import bench_app

    task = bench_app.singleton
    store = store_for(server_url(app))
    base = counter.take(DUP_KEYS)
    holders = []
    for k in range(DUP_KEYS):
        keys = task.singleton_keys((base + k,), {})
        owner = f"holder-{uuid.uuid4().hex}"
        store.acquire(keys, owner, 0, 600_000)
        holders.append((keys, owner))
    out = Series(label, DUPLICATES)
    try:
        for _ in range(repeats):
            out.batches.append(
                _batch(
                    app,
                    task,
                    lambda i: (base + i % DUP_KEYS,),
                    n=n,
                    client=client,
                    worker=worker,
                )
            )
    finally:
        for keys, owner in holders:
            store.release(keys.lock, owner, 0)
    return out


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
    targets = ", ".join(
        f"{s.pool}: {s.vs(plain[s.pool]):.0%}" for s in series if s.name == "SingletonTask"
    )
    table.notes.append(
        f"{repeats} batches of {n} tasks per row, base classes interleaved; from the first "
        "publish to the last result; ratios are medians of per-round ratios. "
        f"Target: SingletonTask >= 95% of plain ({targets})."
    )
    return table


def duplicates_table(dups: list[Series], series: list[Series], n: int, repeats: int) -> Table:
    """Section 4, real-worker variant: deliveries that all meet a held lock and are skipped."""
    table = Table(
        f"4b. Contention through a real worker: every delivery a duplicate ({DUP_KEYS} keys held)",
        [
            "pool",
            "duplicates skipped/s (median)",
            "min-max",
            "vs plain tasks/s",
            "worker CPU µs/duplicate",
            "Redis cmds/duplicate",
        ],
    )
    for d in dups:
        plain = next(s for s in series if s.pool == d.pool and s.name == "plain Task")
        table.add(
            d.pool,
            d.rate,
            spread(d.rates),
            f"{d.rate / plain.rate:.0%}",
            d.per_task(lambda b: b.worker_cpu_s * 1e6),
            d.per_task(lambda b: float(b.commands)),
        )
    table.notes.append(
        f"{repeats} batches of {n} SingletonTask deliveries whose keys are held by the "
        "benchmark; each is skipped (result marked skipped, body not run). Includes publish, "
        "broker, the acquire that finds the holder, the skip result and its write."
    )
    return table
