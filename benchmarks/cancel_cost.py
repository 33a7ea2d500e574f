"""What a stop request (``singleton_on_duplicate="cancel"``) costs the run it is sent to.

The holder learns of it from its own renewals: ``renew.lua`` reads the lock's ``cancel`` field
with the fields it reads anyway, and reports a lock asked to stop in its reply; the run's body
reads ``self.singleton.cancelled``, a Python attribute. So the run's path makes no round trip
for it. What it costs is in the renewal: one renewal of 1,000 locks of one process, none of them
asked to stop, against all of them asked, interleaved over the rounds: the wall time of
``LockStore.renew`` and the server's script time.

    python -m benchmarks.cancel_cost [--rounds N]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import cast

import redis

from celery_singleton_lock.core.backend import Acquired, RenewItem, RenewStatus
from celery_singleton_lock.core.connection import client_for
from celery_singleton_lock.core.keys import lock_keys
from celery_singleton_lock.core.store import LockStore

from .report import Table, median, paired_ratio, spread
from .server import PrivateRedis, command_stats

LOCKS = 1000
TTL_MS = 30_000


def _items(store: LockStore, prefix: str) -> list[RenewItem]:
    items = []
    for i in range(LOCKS):
        keys = lock_keys(prefix, "bench.cancel", b"%d" % i)
        taken = store.acquire(keys, f"owner-{i}", 0, TTL_MS)
        assert isinstance(taken, Acquired)
        items.append(RenewItem(keys.lock, f"owner-{i}", 0, TTL_MS, taken.token))
    return items


def _renew(store: LockStore, client: redis.Redis, items: list[RenewItem]) -> tuple[float, float]:
    """One renewal of every item: wall µs, and the server's script µs."""
    before = command_stats(client)
    started = time.perf_counter()
    statuses = store.renew(items)
    wall = (time.perf_counter() - started) * 1e6
    after = command_stats(client)
    assert all(s in (RenewStatus.RENEWED, RenewStatus.STOP_ASKED) for s in statuses)
    server = sum(after.usec(c) - before.usec(c) for c in ("evalsha", "eval"))
    return wall, server


def run(server: PrivateRedis, rounds: int) -> Table:
    client = cast(redis.Redis, client_for(server.url))
    store = LockStore(client)
    plain = _items(store, "bench-cancel-plain:")
    asked = _items(store, "bench-cancel-asked:")
    for item in asked:
        client.hset(item.key, "cancel", "a-newer-call")
    results: dict[str, tuple[list[float], list[float]]] = {"no": ([], []), "all": ([], [])}
    for _ in range(rounds):  # interleaved
        for name, items in (("no", plain), ("all", asked)):
            wall_us, script_us = _renew(store, client, items)
            results[name][0].append(wall_us)
            results[name][1].append(script_us)
    table = Table(
        f"9b. A stop request's cost: one renewal of {LOCKS:,} locks, none or all asked to stop",
        ["locks asked to stop", "wall µs", "spread", "server µs", "vs none (wall, paired)"],
    )
    for name, label in (("no", "none"), ("all", f"all {LOCKS:,}")):
        walls, scripts = results[name]
        table.add(
            label,
            median(walls),
            spread(walls),
            median(scripts),
            f"{paired_ratio(walls, results['no'][0]):.2f}x",
        )
    table.notes.append(
        f"{rounds} rounds, interleaved; medians. The run's own path makes no round trip for a "
        "stop request: renew.lua reads the field with the ones it reads anyway, and reports the "
        "locks asked in its reply; the run reads self.singleton.cancelled, an attribute."
    )
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cancel_cost", description=__doc__)
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--json", type=Path, help="also write the table as JSON here")
    args = parser.parse_args(argv)
    with PrivateRedis() as server:
        table = run(server, args.rounds)
    print(table.render())
    if args.json:
        args.json.write_text(json.dumps(dataclasses.asdict(table), default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
