"""Section 8: what distinct keys leave in Redis once their runs ended, and bytes per record.

A real worker (prefork, 2 children) runs ``runs`` calls with distinct arguments (one key each,
acked early, no result stored) of each contender in turn: ``SingletonTask`` with a 5 s ttl
(``bench_app.MEM_TTL_S``) and the fence margin given (``singleton_fence_margin``), then
celery-singleton and celery-once. For each, Redis's ``used_memory`` and key count above a
baseline taken just before its calls were published (the worker idle, the queue empty) are read
right after its last run ended (every run counted, then 0.5 s for the last releases), one ttl
later and one bound (ttl + fence margin) later. The goal: nothing left once the bound passed.

Then the bytes one record takes (``MEMORY USAGE``): a lock held with the metadata a
``SingletonTask`` writes, the same with a 100-character argument preview, with every field at
its bound, a fencing counter and a completion record.

    python -m benchmarks.memory --runs 2000 --margin 1     # alone, quick
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from celery_singleton_lock.core.backend import Acquired
from celery_singleton_lock.core.completion import Ending, done_key
from celery_singleton_lock.core.keys import lock_keys
from celery_singleton_lock.core.store import LockStore

from .report import Table
from .server import PrivateRedis
from .workers import BenchWorker

POOL = ("prefork", 2)
SETTLE_S = 0.5


@dataclass
class Left:
    """What one contender left: bytes and keys above its baseline at each instant."""

    name: str
    run_s: float
    bytes_at: list[int]
    keys_at: list[int]


def _state(client: redis.Redis) -> tuple[int, int]:
    return int(client.info("memory")["used_memory"]), int(client.dbsize())


def _contender(  # noqa: PLR0917 - the contender, its size and where to measure
    client: redis.Redis, task: Any, name: str, runs: int, offsets: list[float], worker: BenchWorker
) -> Left:
    from . import bench_app

    done = bench_app.MEM_DONE_KEY + task.name
    client.delete(done)
    base_bytes, base_keys = _state(client)
    first = uuid.uuid4().int % 10**9  # distinct arguments: one key per call
    start = time.monotonic()
    for i in range(runs):
        task.apply_async(args=(first + i,))
    deadline = start + 120 + runs / 50
    while int(client.get(done) or 0) < runs:
        if time.monotonic() > deadline:
            counted = int(client.get(done) or 0)
            raise TimeoutError(f"{name}: {counted} of {runs} runs:\n{worker.log_tail()}")
        time.sleep(0.05)
    ended = time.monotonic()
    time.sleep(SETTLE_S)
    client.delete(done)
    bytes_at, keys_at = [], []
    for offset in offsets:
        time.sleep(max(0.0, ended + SETTLE_S + offset - time.monotonic()))
        used, keys = _state(client)
        bytes_at.append(used - base_bytes)
        keys_at.append(keys - base_keys)
    return Left(name, ended - start, bytes_at, keys_at)


def _records(client: redis.Redis) -> list[tuple[str, int]]:
    """``MEMORY USAGE`` of one lock of each shape, a counter and a completion record."""
    store = LockStore(client)
    owner = str(uuid.uuid4())  # a Celery task id
    meta = {"task": "billing.sync_account", "host": "celery@worker-1", "pid": "12345"}
    huge = "x" * 100_000
    shapes = [
        ("held lock, short arguments ((42,) {})", {**meta, "args": "(42,) {}"}),
        ("held lock, 100-character argument preview", {**meta, "args": "x" * 100}),
        (
            "held lock, every field at its bound (100 kB values)",
            {"task": huge, "host": huge, "pid": huge, "args": huge},
        ),
    ]
    out = []
    fence = record = 0
    for label, fields in shapes:
        keys = lock_keys("bench-mem-record:", "billing.sync_account", uuid.uuid4().bytes)
        outcome = store.acquire(keys, owner, 0, 30_000, fields)
        assert isinstance(outcome, Acquired), outcome
        out.append((label, int(client.memory_usage(keys.lock, samples=0) or 0)))
        fence = int(client.memory_usage(keys.fence, samples=0) or 0)
        store.release(keys.lock, owner, 0, outcome.token, Ending(completion_ttl_ms=60_000))
        record = int(client.memory_usage(done_key(keys.lock, owner), samples=0) or 0)
    out.append(("fencing counter", fence))
    out.append(("completion record (task acked late, or singleton_completion_ttl)", record))
    for key in client.scan_iter(match="bench-mem-record:*"):
        client.delete(key)
    return out


def run(server: PrivateRedis, runs: int, margin_s: float) -> tuple[Table, Table, list[Left]]:
    from . import bench_app

    app = bench_app.configure(server.url)
    client = server.client()
    ttl = bench_app.MEM_TTL_S
    offsets = [0.0, ttl, ttl + margin_s]
    worker = BenchWorker(server.url, *POOL, env={bench_app.MARGIN_ENV: f"{margin_s:g}"})
    contenders = [
        ("celery-singleton-lock (SingletonTask)", bench_app.mem_singleton),
        ("celery-singleton", bench_app.mem_celery_singleton),
        ("celery-once", bench_app.mem_celery_once),
    ]
    results = []
    try:
        worker.wait_ready(app)
        for name, task in contenders:
            results.append(_contender(client, task, name, runs, offsets, worker))
        records = _records(client)
    finally:
        worker.close()
        client.close()
    when = ["right after", f"+{ttl:g} s (ttl)", f"+{ttl + margin_s:g} s (bound)"]
    table = Table(
        f"8. Memory: what {runs:,} distinct keys leave in Redis after their runs ended",
        [
            "contender",
            "runs/s",
            *[f"bytes {w}" for w in when],
            *[f"keys {w}" for w in when],
        ],
    )
    for r in results:
        table.add(r.name, runs / r.run_s, *r.bytes_at, *r.keys_at)
    table.add("goal", "-", "-", "-", 0, "-", "-", 0)
    table.notes.append(
        f"{POOL[0]} -c {POOL[1]}, tasks acked early, no result stored; SingletonTask with "
        f"singleton_ttl={ttl:g} and singleton_fence_margin={margin_s:g}, so its bound is "
        f"{ttl + margin_s:g} s. Bytes: INFO used_memory above the baseline taken before the "
        "contender's calls were published (allocator noise: a few kB either way); keys: DBSIZE "
        f"above it. 'right after': {SETTLE_S:g} s after the last run's body returned. "
        "used_memory also counts the keyspace's own hash table, which Redis shrinks lazily: "
        "hence bytes left with no key left."
    )
    sizes = Table("8b. Bytes per record (MEMORY USAGE)", ["record", "bytes"])
    for label, size in records:
        sizes.add(label, size)
    return table, sizes, results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.memory", description=__doc__)
    parser.add_argument("--runs", type=int, default=2000)
    parser.add_argument("--margin", type=float, default=1.0, help="singleton_fence_margin, s")
    parser.add_argument("--json", type=Path, help="write both tables as JSON here")
    args = parser.parse_args(argv)
    with PrivateRedis() as server:
        table, sizes, _ = run(server, args.runs, args.margin)
    for t in (table, sizes):
        print(t.render() + "\n")
    if args.json:
        args.json.write_text(json.dumps([table.__dict__, sizes.__dict__], default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
