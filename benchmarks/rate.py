"""Section 1b: a rate check (``singleton_rate_limit``) on one connection, loopback, beside the
acquire it rides in, and celery-heimdall's global rate limit.

Ours decides the rate in the acquire's own script call (acquire_permit.lua): a lock cycle under a
rate is the same two round trips as one without, and a rate alone
(``singleton_permits="unlimited"``) one. celery-heimdall's check (``rate_limited_countdown``, what
its task's ``__call__`` runs before the body) is GET then SET or INCR under the limit (a fixed
window: a counter expiring after the period), GET, GET, TTL and SET over it. Round trips are
counted, not read from the code: every write a contender's connections make is counted, in a pass
of its own.

Under the limit each of ours runs over 100 keys in turn, 1000/s each (a window of a few hundred
starts per key), so the key is never full; over it, one key whose window is full (5/h).
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import redis
from redis.connection import AbstractConnection

from celery_singleton_lock.core.backend import Acquired, RateLimited, ReleaseStatus
from celery_singleton_lock.core.keys import LockKeys, lock_keys
from celery_singleton_lock.core.store import LockStore

from .lock_cycle import Cycle, CycleResult, interleaved
from .report import Table, paired_ratio, spread
from .server import PrivateRedis

OURS_LOCK = "ours: lock cycle, no rate"
OURS_LOCK_RATE = "ours: lock cycle under a rate (1000/s)"
OURS_RATE = 'ours: rate alone (permits="unlimited"), a start'
OURS_OVER = "ours: over the rate (5/h), refused"
HEIMDALL = "celery-heimdall: rate check, under the limit"
HEIMDALL_OVER = "celery-heimdall: rate check, over the limit"
PING = "one PING (floor)"

TTL_MS = 30_000
META = {"task": "bench.rate", "host": "bench@localhost", "pid": "12345"}
_KEYS = 100


def _round_robin(name: str, rate: tuple[int, int] | None, permits: int = 1) -> Iterator[LockKeys]:
    keys = [
        lock_keys("bench:", name, b"%d" % i).with_rate(rate).with_permits(permits)
        for i in range(_KEYS)
    ]
    return itertools.cycle(keys)


def _ours_lock(store: LockStore, rate: tuple[int, int] | None) -> Cycle:
    """Acquire (with the rate, when given), release: a run of a one-permit key."""
    keys = _round_robin(f"bench.rate-lock-{rate is not None}", rate)
    owners = (uuid.uuid4().hex + str(n) for n in itertools.count())

    def cycle() -> None:
        key, owner = next(keys), next(owners)
        if type(store.acquire(key, owner, 0, TTL_MS, META)) is not Acquired:
            raise AssertionError("ours: not acquired")
        if store.release(key.lock, owner, 0) is not ReleaseStatus.RELEASED:
            raise AssertionError("ours: not released")

    return cycle


def _ours_rate(store: LockStore) -> Cycle:
    """A start of a key with no limit on runs at once: the acquire alone, nothing to release."""
    keys = _round_robin("bench.rate-alone", (1000, 1000), permits=0)
    owners = (uuid.uuid4().hex + str(n) for n in itertools.count())

    def cycle() -> None:
        if type(store.acquire(next(keys), next(owners), 0, TTL_MS, META)) is not Acquired:
            raise AssertionError("ours: not started")

    return cycle


def _ours_over(store: LockStore) -> Cycle:
    keys = lock_keys("bench:", "bench.rate-over", b"a").with_rate((5, 3_600_000)).with_permits(0)
    for n in range(5):
        store.acquire(keys, f"filler{n}", 0, TTL_MS, META)
    owners = (uuid.uuid4().hex + str(n) for n in itertools.count())

    def cycle() -> None:
        if type(store.acquire(keys, next(owners), 0, TTL_MS, META)) is not RateLimited:
            raise AssertionError("ours: not refused")

    return cycle


def _heimdall(client: redis.Redis, times: int) -> Cycle:
    """celery-heimdall's check, as its task's ``__call__`` makes it for one key."""
    from celery_heimdall.task import RateLimit, rate_limited_countdown

    task = SimpleNamespace(heimdall={"rate_limit": RateLimit((times, 3600))}, heimdall_redis=client)
    key = f"bench:heimdall:{times}"
    for _ in range(min(times, 5)):  # over the limit: the window is full before the timing
        rate_limited_countdown(task, key, (), {})
    over = times <= 5

    def cycle() -> None:
        if (rate_limited_countdown(task, key, (), {}) > 0) is not over:
            raise AssertionError("heimdall: not what it should be")

    return cycle


def _ping(client: redis.Redis) -> Cycle:
    def cycle() -> None:
        client.ping()

    return cycle


CONTENDERS: dict[str, Callable[[redis.Redis], Cycle]] = {
    OURS_LOCK: lambda c: _ours_lock(LockStore(c), None),
    OURS_LOCK_RATE: lambda c: _ours_lock(LockStore(c), (1000, 1000)),
    OURS_RATE: lambda c: _ours_rate(LockStore(c)),
    OURS_OVER: lambda c: _ours_over(LockStore(c)),
    HEIMDALL: lambda c: _heimdall(c, 10**9),
    HEIMDALL_OVER: lambda c: _heimdall(c, 5),
    PING: _ping,
}


def round_trips(url: str, name: str, calls: int = 50) -> float:
    """Round trips per cycle of contender ``name``: the writes its connections make (a
    pipeline, or calls written ahead, is one write), counted in a pass of its own."""
    client = redis.Redis.from_url(url)
    cycle = CONTENDERS[name](client)
    cycle()  # connected, scripts loaded
    count = [0]
    send = AbstractConnection.send_packed_command

    def counting(self: AbstractConnection, *args: Any, **kwargs: Any) -> None:
        count[0] += 1
        send(self, *args, **kwargs)  # type: ignore[no-untyped-call]

    AbstractConnection.send_packed_command = counting  # type: ignore[method-assign]
    try:
        for _ in range(calls):
            cycle()
    finally:
        AbstractConnection.send_packed_command = send  # type: ignore[method-assign]
        client.close()
    return count[0] / calls


def run(server: PrivateRedis, batch: int, rounds: int) -> tuple[Table, list[CycleResult]]:
    clients = {name: redis.Redis.from_url(server.url) for name in CONTENDERS}
    cycles = {name: make(clients[name]) for name, make in CONTENDERS.items()}
    samples = interleaved(cycles, batch, rounds)
    names = list(cycles)
    trips = {name: round_trips(server.url, name) for name in names}
    for client in clients.values():
        client.close()
    results = [CycleResult(name, samples[name]) for name in names]
    table = Table(
        "1b. Rate limit: the check in the acquire's round trip, and celery-heimdall's",
        ["contender", "µs/call (median)", "min-max", "vs one PING", "round trips"],
    )
    for res in results:
        table.add(
            res.name,
            res.median_us,
            spread(res.samples_us),
            f"{paired_ratio(res.samples_us, samples[PING]):.2f}x",
            f"{trips[res.name]:g}",
        )
    table.notes.append(
        f"{rounds} rounds x {batch} calls per contender, interleaved; round trips counted on "
        "each contender's client. A lock cycle under a rate costs "
        f"{paired_ratio(samples[OURS_LOCK_RATE], samples[OURS_LOCK]):.2f}x one without, in "
        f"the same {trips[OURS_LOCK_RATE]:g} round trips (target: no extra round trip); a "
        f"start under a rate alone {paired_ratio(samples[OURS_RATE], samples[HEIMDALL]):.2f}x "
        "celery-heimdall's check under its limit, a refusal "
        f"{paired_ratio(samples[OURS_OVER], samples[HEIMDALL_OVER]):.2f}x its check over it. "
        "celery-heimdall's window is fixed (a counter expiring a period after the first call: "
        "up to 2N calls across a boundary); ours slides."
    )
    return table, results


def main() -> int:
    with PrivateRedis() as server:
        table, _ = run(server, 300, 5)
    print(table.render())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
