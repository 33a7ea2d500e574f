"""Section 1: one lock cycle (acquire + release) on one connection, loopback.

Every contender takes and releases one uncontended lock through its own public API and its
own Redis client, the way its library uses it. Batches of cycles are timed with
``perf_counter``; the contenders take turns batch by batch (in a rotating order), so a noisy
moment on the shared machine hits all of them alike. The floor is two PINGs: a lock that
needs one round trip to take and one to release cannot beat that.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import redis

from celery_singleton_lock.core.backend import Acquired, ReleaseStatus
from celery_singleton_lock.core.completion import Ending
from celery_singleton_lock.core.connection import client_for
from celery_singleton_lock.core.keys import lock_keys
from celery_singleton_lock.core.pending import take_pending
from celery_singleton_lock.core.store import LockStore

from .report import Table, median, paired_ratio, spread
from .server import PrivateRedis

Cycle = Callable[[], None]

PING_FLOOR = "two PINGs (floor)"
#: the same two PINGs written and read on a bare connection, without redis-py's per-command
#: layers (pool checkout, retries, response callbacks), as the library sends its scripts
RAW_PING_FLOOR = "two PINGs, bare connection"
OURS = "celery-singleton-lock"
#: the cycle as a SingletonTask worker runs it: the release rides in the next acquire
OURS_DEFERRED = "celery-singleton-lock, release in next acquire"
#: the same, for a task acked late: the release also records the run's completion
OURS_COMPLETION = "celery-singleton-lock, release in next acquire + completion record"

#: singleton_permits=N: the cycle takes the last free slot while the others are held
OURS_PERMITS_3 = "celery-singleton-lock, 3 permits (2 held)"
OURS_PERMITS_10 = "celery-singleton-lock, 10 permits (9 held)"

#: singleton_on_duplicate="coalesce": the release is made at once, then the pending
#: follow-up is looked for (take_pending.lua), as a coalescing run ends
OURS_COALESCE = "celery-singleton-lock, coalesce: release + look for a follow-up"

#: the lock ttl every contender uses (seconds): long, because the deferred-release contender
#: holds its lock from one of its batches to the next, across every other contender's batch
#: (a round took over 30 s once, on a loaded machine in the test suite)
TTL_S = 600


def _ours(url: str, coalesce: bool = False) -> Cycle:
    """Acquire, release; with ``coalesce``, then look for a pending follow-up (none is there),
    as a coalescing task's run ends: three round trips."""
    store = LockStore(cast(redis.Redis, client_for(url)))
    keys = lock_keys("bench:", "bench.cycle-coalesce" if coalesce else "bench.cycle", b"a")
    owner = uuid.uuid4().hex
    # the metadata SingletonTask writes with every acquire
    meta = {"task": "bench.cycle", "host": "bench@localhost", "pid": "12345"}
    ttl_ms = TTL_S * 1000

    def cycle() -> None:
        outcome = store.acquire(keys, owner, 0, ttl_ms, meta)
        if type(outcome) is not Acquired:
            raise AssertionError(f"ours: not acquired: {outcome}")
        if store.release(keys.lock, owner, 0) is not ReleaseStatus.RELEASED:
            raise AssertionError("ours: not released")
        if coalesce and take_pending(store.run_script, keys) is not None:
            raise AssertionError("ours (coalesce): a follow-up")

    return cycle


def _ours_deferred(url: str, ending: Ending | None = None) -> Cycle:
    """As SingletonTask runs it: each acquire carries the previous run's release (and, with
    ``ending``, the completion record that release writes; each acquire reads its own)."""
    store = LockStore(cast(redis.Redis, client_for(url)))
    keys = lock_keys("bench:", f"bench.cycle-deferred-{ending is not None}", b"a")
    meta = {"task": "bench.cycle", "host": "bench@localhost", "pid": "12345"}
    ttl_ms = TTL_S * 1000
    # the first cycle takes the first lock (taken when the contenders are built, it could
    # expire before a loaded machine came to this contender's first round)
    previous: list[str | None] = [None]

    def cycle() -> None:
        owner = uuid.uuid4().hex
        if previous[0] is None:
            if type(store.acquire(keys, owner, 0, ttl_ms, meta)) is not Acquired:
                raise AssertionError("ours (deferred): the first lock not acquired")
            previous[0] = owner
            return
        release = (keys.lock, previous[0], 0, None, ending or Ending())
        released, outcome = store.acquire_after([release], keys, owner, 0, ttl_ms, meta)
        if type(outcome) is not Acquired or released != [ReleaseStatus.RELEASED]:
            raise AssertionError(f"ours (deferred): {released} {outcome}")
        previous[0] = owner

    return cycle


def _ours_completion(url: str) -> Cycle:
    """:func:`_ours_deferred` with a completion record kept 60 s (a new key every cycle)."""
    return _ours_deferred(url, Ending(completion_ttl_ms=60_000))


def _ours_permits(url: str, permits: int) -> Cycle:
    """:func:`_ours` on a key with ``permits`` slots, all but the last held by other runs:
    each acquire reads every slot (acquire_permit.lua) before it takes the free one."""
    store = LockStore(cast(redis.Redis, client_for(url)))
    keys = lock_keys("bench:", f"bench.cycle-permits-{permits}", b"a").with_permits(permits)
    meta = {"task": "bench.cycle", "host": "bench@localhost", "pid": "12345"}
    ttl_ms = TTL_S * 1000
    for _ in range(permits - 1):  # held for the whole benchmark (its ttl is longer)
        store.acquire(keys, uuid.uuid4().hex, 0, 3600_000, meta)
    owner = uuid.uuid4().hex
    last = keys.slot(permits)

    def cycle() -> None:
        outcome = store.acquire(keys, owner, 0, ttl_ms, meta)
        if type(outcome) is not Acquired or outcome.slot != permits:
            raise AssertionError(f"ours ({permits} permits): not acquired: {outcome}")
        if store.release(last, owner, 0) is not ReleaseStatus.RELEASED:
            raise AssertionError(f"ours ({permits} permits): not released")

    return cycle


def _redis_py(url: str) -> Cycle:
    client = redis.Redis.from_url(url)
    lock = client.lock("bench:redis-py", timeout=TTL_S)

    def cycle() -> None:
        if not lock.acquire(blocking=False):
            raise AssertionError("redis-py: not acquired")
        lock.release()

    return cycle


def _python_redis_lock(url: str) -> Cycle:
    import redis_lock

    client = redis.Redis.from_url(url)
    lock = redis_lock.Lock(client, "bench:python-redis-lock", expire=TTL_S)

    def cycle() -> None:
        if not lock.acquire(blocking=False):
            raise AssertionError("python-redis-lock: not acquired")
        lock.release()

    return cycle


def _celery_singleton(url: str) -> Cycle:
    from celery_singleton.backends.redis import RedisBackend

    backend = RedisBackend(url)
    key = "SINGLETONLOCK_bench"
    task_id = uuid.uuid4().hex

    def cycle() -> None:
        if not backend.lock(key, task_id, expiry=TTL_S):
            raise AssertionError("celery-singleton: not acquired")
        backend.unlock(key)

    return cycle


def _celery_once(url: str) -> Cycle:
    from celery_once.backends import Redis as OnceRedis
    from celery_once.backends import redis as once_redis

    once_redis.redis = None  # its client is a module global: bind it to this server
    backend = OnceRedis({"url": url, "default_timeout": TTL_S})
    key = "qo_bench.cycle_i-1"

    def cycle() -> None:
        backend.raise_or_lock(key, timeout=TTL_S)  # raises AlreadyQueued if held
        backend.clear_lock(key)

    return cycle


def _pottery(url: str) -> Cycle:
    import logging

    from pottery import Redlock

    logging.getLogger("pottery").setLevel(logging.ERROR)
    client = redis.Redis.from_url(url)
    lock = Redlock(key="bench:pottery", masters={client}, auto_release_time=TTL_S)

    def cycle() -> None:
        if not lock.acquire(blocking=False):
            raise AssertionError("pottery: not acquired")
        lock.release()

    return cycle


def _pings(url: str) -> Cycle:
    client = redis.Redis.from_url(url)
    ping = client.ping

    def cycle() -> None:
        ping()
        ping()

    return cycle


def _raw_pings(url: str) -> Cycle:
    connection = redis.Redis.from_url(url).connection_pool.get_connection()
    packed = connection.pack_command("PING")  # type: ignore[no-untyped-call]

    def cycle() -> None:
        connection.send_packed_command(packed, check_health=False)  # type: ignore[no-untyped-call]
        connection.read_response()
        connection.send_packed_command(packed, check_health=False)  # type: ignore[no-untyped-call]
        connection.read_response()

    return cycle


CONTENDERS: dict[str, Callable[[str], Cycle]] = {
    OURS: _ours,
    OURS_DEFERRED: _ours_deferred,
    OURS_COMPLETION: _ours_completion,
    OURS_PERMITS_3: lambda url: _ours_permits(url, 3),
    OURS_PERMITS_10: lambda url: _ours_permits(url, 10),
    OURS_COALESCE: lambda url: _ours(url, coalesce=True),
    "redis-py Lock": _redis_py,
    "python-redis-lock": _python_redis_lock,
    "celery-singleton backend": _celery_singleton,
    "celery-once backend": _celery_once,
    "pottery Redlock (1 master)": _pottery,
    PING_FLOOR: _pings,
    RAW_PING_FLOOR: _raw_pings,
}

#: round trips per cycle, from reading each library's code (checked against commandstats)
ROUND_TRIPS = {
    OURS: "1 + 1 (EVALSHA, EVALSHA)",
    OURS_DEFERRED: "1 (pipeline: release EVALSHA + acquire EVALSHA)",
    OURS_COMPLETION: "1 (the same two calls; the record is a SET inside the release)",
    OURS_PERMITS_3: "1 + 1 (EVALSHA reading 3 slots, EVALSHA)",
    OURS_PERMITS_10: "1 + 1 (EVALSHA reading 10 slots, EVALSHA)",
    OURS_COALESCE: "1 + 1 + 1 (EVALSHA, EVALSHA, EVALSHA take_pending)",
    "redis-py Lock": "1 + 1 (SET NX, EVALSHA)",
    "python-redis-lock": "2 + 1 (GET, SET NX, EVALSHA)",
    "celery-singleton backend": "1 + 1 (SET NX, DEL)",
    "celery-once backend": "1 + 1 (SET NX, DEL)",
    "pottery Redlock (1 master)": "1 + 1 (SET NX, EVALSHA) + threads",
    PING_FLOOR: "2 (PING, PING)",
    RAW_PING_FLOOR: "2 (PING, PING)",
}


@dataclass
class CycleResult:
    name: str
    samples_us: list[float]

    @property
    def median_us(self) -> float:
        return median(self.samples_us)


def interleaved(cycles: dict[str, Cycle], batch: int, rounds: int) -> dict[str, list[float]]:
    """µs per cycle of each contender, one sample per round: each warmed up first (connected,
    scripts loaded, checked), then batch by batch in a rotating order."""
    for cycle in cycles.values():
        for _ in range(50):
            cycle()
    names = list(cycles)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            samples[name].append(_batch(cycles[name], batch))
    return samples


def _batch(cycle: Cycle, n: int) -> float:
    """µs per cycle over one batch of ``n`` cycles."""
    start = time.perf_counter()
    for _ in range(n):
        cycle()
    return (time.perf_counter() - start) / n * 1e6


def run(server: PrivateRedis, batch: int, rounds: int) -> tuple[Table, list[CycleResult]]:
    cycles = {name: make(server.url) for name, make in CONTENDERS.items()}
    samples = interleaved(cycles, batch, rounds)
    results = [CycleResult(name, samples[name]) for name in cycles]
    floor = next(r for r in results if r.name == PING_FLOOR).samples_us
    ours = next(r for r in results if r.name == OURS).samples_us
    table = Table(
        "1. Lock cycle: acquire + release, one connection, loopback",
        ["contender", "µs/cycle (median)", "min-max", "vs two PINGs", "vs ours", "round trips"],
    )
    for res in sorted(results, key=lambda r: r.median_us):
        table.add(
            res.name,
            res.median_us,
            spread(res.samples_us),
            f"{paired_ratio(res.samples_us, floor):.2f}x",
            f"{paired_ratio(res.samples_us, ours):.2f}x",
            ROUND_TRIPS[res.name],
        )
    table.notes.append(
        f"{rounds} rounds x {batch} cycles per contender, contenders interleaved; ratios are "
        "medians of per-round ratios; target: ours <= 1.15x two PINGs "
        f"(now {paired_ratio(ours, floor):.2f}x; "
        f"{paired_ratio(ours, samples[RAW_PING_FLOOR]):.2f}x two PINGs on a bare connection, "
        "the way the library sends its scripts; "
        f"{paired_ratio(samples[OURS_DEFERRED], floor):.2f}x with the release carried by "
        "the next acquire, as SingletonTask does) and below every peer. The completion record "
        "of a task acked late costs "
        f"{paired_ratio(samples[OURS_COMPLETION], samples[OURS_DEFERRED]):.2f}x that cycle "
        "(a SET in the release, a GET in the acquire; no round trip added). With "
        "singleton_permits an acquire reads every slot: 3 permits cost "
        f"{paired_ratio(samples[OURS_PERMITS_3], ours):.2f}x the single lock's cycle, 10 "
        f"permits {paired_ratio(samples[OURS_PERMITS_10], ours):.2f}x (still one round trip). "
        "A coalescing task's run releases at once and looks for a pending follow-up: "
        f"{paired_ratio(samples[OURS_COALESCE], ours):.2f}x the single lock's cycle, "
        f"{paired_ratio(samples[OURS_COALESCE], samples[OURS_DEFERRED]):.2f}x the cycle "
        "SingletonTask runs otherwise."
    )
    return table, results
