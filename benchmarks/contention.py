"""Section 4: contention, 50 publisher processes hammering 10 keys.

Each publisher process loops until a shared deadline: pick one of the 10 keys at random,
try to take its lock with a fresh owner id (as a new task delivery would); if it got the
lock, hold it for ``hold`` seconds and release it, else count a duplicate and go on at once.
Ours goes through ``LockStore.acquire``; the peers through the calls their Celery glue makes
for a duplicate (celery-singleton: SET NX, then GET of the holder's task id; celery-once: SET
NX via redis-py's Lock, then PTTL; redis-py: a non-blocking ``Lock.acquire``).

Redis commands per attempt come from ``INFO commandstats`` on the private server (reset
right before the start signal) and count the commands run inside Lua scripts too, so they
show the server's work; round trips per attempt are counted by the publishers.
The real-worker variant (every delivery a duplicate, skipped by SingletonTask in a worker)
is measured in section 2's worker session.
"""

from __future__ import annotations

import multiprocessing as mp
import random
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis

from celery_singleton_lock.core.backend import Acquired
from celery_singleton_lock.core.keys import lock_keys
from celery_singleton_lock.core.store import LockStore

from .report import Table, median, spread
from .server import STATS_COMMANDS, PrivateRedis, command_stats, reset_stats

KEYS = 10
TTL_S = 30
#: commands the benchmark itself sends while measuring
HARNESS_COMMANDS = STATS_COMMANDS | {"ping"}

#: attempt(key index) -> (acquired, round trips)
Attempt = Callable[[int], tuple[bool, int]]


def _ours(url: str, hold: float) -> Attempt:
    store = LockStore(redis.Redis.from_url(url))
    keys = [lock_keys("bench-contend:", "bench.contend", b"%d" % k) for k in range(KEYS)]
    meta = {"task": "bench.contend", "host": "bench@localhost", "pid": "12345"}

    def attempt(k: int) -> tuple[bool, int]:
        owner = uuid.uuid4().hex
        outcome = store.acquire(keys[k], owner, 0, TTL_S * 1000, meta)
        if type(outcome) is not Acquired:
            return False, 1
        time.sleep(hold)
        store.release(keys[k].lock, owner, 0)
        return True, 2

    return attempt


def _redis_py(url: str, hold: float) -> Attempt:
    client = redis.Redis.from_url(url)
    names = [f"bench-contend:redis-py:{k}" for k in range(KEYS)]

    def attempt(k: int) -> tuple[bool, int]:
        lock = client.lock(names[k], timeout=TTL_S)
        if not lock.acquire(blocking=False):
            return False, 1
        time.sleep(hold)
        lock.release()
        return True, 2

    return attempt


def _celery_singleton(url: str, hold: float) -> Attempt:
    from celery_singleton.backends.redis import RedisBackend

    backend = RedisBackend(url)
    names = [f"SINGLETONLOCK_bench.contend{k}" for k in range(KEYS)]

    def attempt(k: int) -> tuple[bool, int]:
        if not backend.lock(names[k], uuid.uuid4().hex, expiry=TTL_S):
            backend.get(names[k])  # the holder's task id, returned as an AsyncResult
            return False, 2
        time.sleep(hold)
        backend.unlock(names[k])
        return True, 2

    return attempt


def _celery_once(url: str, hold: float) -> Attempt:
    from celery_once.backends import Redis as OnceRedis
    from celery_once.backends import redis as once_redis
    from celery_once.tasks import AlreadyQueued

    once_redis.redis = None
    backend = OnceRedis({"url": url, "default_timeout": TTL_S})
    names = [f"qo_bench.contend_k-{k}" for k in range(KEYS)]

    def attempt(k: int) -> tuple[bool, int]:
        try:
            backend.raise_or_lock(names[k], timeout=TTL_S)
        except AlreadyQueued:
            return False, 2
        time.sleep(hold)
        backend.clear_lock(names[k])
        return True, 2

    return attempt


CONTENDERS: dict[str, Callable[[str, float], Attempt]] = {
    "celery-singleton-lock (LockStore)": _ours,
    "redis-py Lock": _redis_py,
    "celery-singleton backend": _celery_singleton,
    "celery-once backend": _celery_once,
}


def _publisher(  # noqa: PLR0917 - a multiprocessing target takes positional args
    name: str,
    url: str,
    hold: float,
    seed: int,
    ready: Any,
    start: Any,
    deadline: Any,
    results: Any,
) -> None:
    attempt = CONTENDERS[name](url, hold)
    redis.Redis.from_url(url).ping()
    rnd = random.Random(seed)
    ready.put(1)
    start.wait()
    end = deadline.value
    acquired = duplicates = trips = 0
    while time.monotonic() < end:
        got, rt = attempt(rnd.randrange(KEYS))
        trips += rt
        if got:
            acquired += 1
        else:
            duplicates += 1
    results.put((acquired, duplicates, trips))


@dataclass
class Run:
    seconds: float
    acquired: int
    duplicates: int
    trips: int
    commands: int

    @property
    def attempts(self) -> int:
        return self.acquired + self.duplicates


@dataclass
class Series:
    name: str
    runs: list[Run] = field(default_factory=list)

    def med(self, value: Callable[[Run], float]) -> float:
        return median([value(r) for r in self.runs])


def _run_once(
    name: str, url: str, *, publishers: int, seconds: float, hold: float, client: redis.Redis
) -> Run:
    ctx = mp.get_context("fork")
    ready, results = ctx.Queue(), ctx.Queue()
    start, deadline = ctx.Event(), ctx.Value("d", 0.0)
    procs = [
        ctx.Process(
            target=_publisher,
            args=(name, url, hold, seed, ready, start, deadline, results),
            daemon=True,
        )
        for seed in range(publishers)
    ]
    for p in procs:
        p.start()
    try:
        for _ in procs:
            ready.get(timeout=60)
        client.flushdb()  # private server: no locks left from the previous contender
        reset_stats(client)
        begin = time.monotonic()
        deadline.value = begin + seconds
        start.set()
        totals = [results.get(timeout=seconds + 60) for _ in procs]
        elapsed = time.monotonic() - begin
        commands = command_stats(client).total_calls(HARNESS_COMMANDS)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return Run(
        elapsed,
        sum(t[0] for t in totals),
        sum(t[1] for t in totals),
        sum(t[2] for t in totals),
        commands,
    )


def run(
    server: PrivateRedis, publishers: int, seconds: float, hold: float, repeats: int
) -> tuple[Table, list[Series]]:
    client = server.client()
    series = {name: Series(name) for name in CONTENDERS}
    names = list(CONTENDERS)
    for r in range(repeats):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            series[name].runs.append(
                _run_once(
                    name,
                    server.url,
                    publishers=publishers,
                    seconds=seconds,
                    hold=hold,
                    client=client,
                )
            )
    table = Table(
        f"4. Contention: {publishers} publisher processes, {KEYS} keys, "
        f"holders keep a lock {hold * 1000:g} ms",
        [
            "contender / path",
            "duplicates/s (median)",
            "min-max",
            "acquired/s",
            "round trips/attempt",
            "Redis cmds/attempt",
            "Redis cmds/duplicate",
        ],
    )
    for s in series.values():
        dup_rates = [r.duplicates / r.seconds for r in s.runs]
        table.add(
            s.name,
            median(dup_rates),
            spread(dup_rates),
            s.med(lambda r: r.acquired / r.seconds),
            s.med(lambda r: r.trips / r.attempts),
            s.med(lambda r: r.commands / r.attempts),
            DUP_COMMANDS[s.name],
        )
    table.notes.append(
        f"{repeats} run(s) of {seconds:g} s per contender, contenders interleaved; commands "
        "counted by the server, Lua scripts' inner commands included."
    )
    return table, list(series.values())


#: commands one duplicate costs the server, from each library's code (inner calls included)
DUP_COMMANDS = {
    "celery-singleton-lock (LockStore)": "3 (EVALSHA: HMGET, PTTL)",
    "redis-py Lock": "1 (SET NX)",
    "celery-singleton backend": "2 (SET NX, GET)",
    "celery-once backend": "2 (SET NX, PTTL)",
}
