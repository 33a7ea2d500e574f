"""Where the time goes: ablations of the library's hot paths (``python -m benchmarks.hotspots``).

Not part of ``benchmarks.run``: this is the evidence behind the reading in
docs/performance.md. Each row runs one path, or one piece of it, alone or with one cost taken
away by monkeypatching inside this process only (the library's files are never changed),
interleaved with the unchanged path, medians over rounds:

A. the lock cycle of section 1, against what it is made of: two PINGs, two EVALSHAs of a
   trivial script without and with the same arguments, the real scripts without the
   LockStore wrappers, a leaner acquire script (a prototype defined here), and LockStore
   without the three metadata fields;
B. one SingletonTask run, eagerly (``task.apply``: Celery's tracer, no broker), against a
   plain Task and a plain Task that makes two PINGs where the lock makes its two round trips;
   then the Python glue around those round trips, piece by piece (best of many loops, the
   robust figure for CPU-bound work on a noisy machine);
C. one skipped duplicate, eagerly, with and without Celery's ``ExceptionInfo`` (what
   raising ``Ignore`` from ``before_start`` costs);
D. one renewal of 10,000 locks, split into client argument packing and the server's script
   time, with a variant script defined here (one argument per lock instead of two).

The prototypes show what a change could save; they are not the library's behaviour (the lean
acquire, for one, drops the ``since``/``ttl`` fields and folds the metadata).
"""

from __future__ import annotations

import argparse
import contextlib
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, cast

import redis
from celery import Celery, Task

from celery_singleton_lock import SingletonTask, signals
from celery_singleton_lock.core.backend import (
    acquire_args,
    release_args,
    renew_args,
    renew_groups,
)
from celery_singleton_lock.core.connection import client_for, store_for
from celery_singleton_lock.core.keys import lock_keys
from celery_singleton_lock.core.renewer import Renewer
from celery_singleton_lock.core.store import ACQUIRE, RELEASE, RENEW, LockStore, _RenewCall

from .report import Table, median, spread
from .server import PrivateRedis, command_stats

Variant = tuple[Callable[[int], None], Callable[[], contextlib.AbstractContextManager[Any]]]


def _measure(
    variants: dict[str, Variant], batch: int, rounds: int
) -> dict[str, tuple[list[float], list[float]]]:
    """Per variant: wall µs per call and process CPU µs per call, one sample per round."""
    for fn, patch in variants.values():
        with patch():
            fn(max(batch // 5, 20))
    samples: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in variants}
    names = list(variants)
    for r in range(rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            fn, patch = variants[name]
            with patch():
                cpu = time.process_time()
                start = time.perf_counter()
                fn(batch)
                wall = time.perf_counter() - start
                cpu = time.process_time() - cpu
            samples[name][0].append(wall / batch * 1e6)
            samples[name][1].append(cpu / batch * 1e6)
    return samples


def _table(title: str, samples: dict[str, tuple[list[float], list[float]]], base: str) -> Table:
    table = Table(
        title,
        ["path", "wall µs (median)", "min-max", f"vs {base}", "CPU µs (median)", "CPU vs base"],
    )
    wall_ref, cpu_ref = samples[base]
    for name, (wall, cpu) in samples.items():
        table.add(
            name,
            median(wall),
            spread(wall),
            f"{paired_delta(wall, wall_ref):+.0f} µs",
            median(cpu),
            f"{paired_delta(cpu, cpu_ref):+.0f} µs",
        )
    table.notes.append(
        "differences are medians of per-round differences; CPU is the whole process "
        "(the renewer thread included), which the machine's load disturbs less than wall time"
    )
    return table


def paired_delta(values: list[float], baseline: list[float]) -> float:
    return median([v - b for v, b in zip(values, baseline, strict=True)])


# -- patches (this process only) ---------------------------------------------------------


@contextlib.contextmanager
def _nothing() -> Iterator[None]:
    yield


@contextlib.contextmanager
def _cheap_exception_info() -> Iterator[None]:
    from celery.app import trace

    class Cheap:
        def __init__(self, exc_info: Any = None, internal: bool = False) -> None:
            self.exception = None
            self.traceback = ""
            self.internal = internal
            self.exc_info = (None, None, None)
            self.type = None

    original = trace.ExceptionInfo
    trace.ExceptionInfo = Cheap
    try:
        yield
    finally:
        trace.ExceptionInfo = original


# -- A. the lock cycle ---------------------------------------------------------------------

#: a prototype, not the library's script: 4 arguments (the metadata in one field), one write
#: of the fencing counter (SET PX instead of INCR + SET + PEXPIRE), 4 hash fields
LEAN_ACQUIRE = """
local held = redis.call('HMGET', KEYS[1], 'owner', 'gen', 'token')
if held[1] and (held[1] ~= ARGV[1] or tonumber(ARGV[2]) <= tonumber(held[2])) then
  return {0, held[1], tonumber(held[2]), tonumber(held[3]), redis.call('PTTL', KEYS[1])}
end
local now = redis.call('TIME')
local now_us = tonumber(now[1]) * 1000000 + tonumber(now[2])
local token = tonumber(redis.call('GET', KEYS[2]) or '0') + 1
if token < now_us then token = now_us end
local text = string.format('%d', token)
redis.call('SET', KEYS[2], text, 'PX', 90000)
redis.call('HSET', KEYS[1], 'owner', ARGV[1], 'gen', ARGV[2], 'token', text, 'meta', ARGV[4])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
if held[1] then return {1, token, 1} end
return {1, token, 0}
"""


def lock_cycle(url: str, batch: int, rounds: int) -> Table:
    client = cast(redis.Redis, client_for(url))  # a single private server
    store = LockStore(client)
    keys = lock_keys("hot:", "hot.cycle", b"a")
    owner = uuid.uuid4().hex
    meta = {"task": "hot.cycle", "host": "bench@localhost", "pid": "12345"}
    store.acquire(keys, owner, 0, 30_000, meta)
    store.release(keys.lock, owner, 0)  # loads both scripts
    acq, rel = ACQUIRE.sha, RELEASE.sha
    # the library's own argument lists (numkeys, KEYS, ARGV), as LockStore sends them
    acquire = acquire_args(keys, owner, 0, 30_000, store.fence_margin_ms, meta)
    release = release_args(keys.lock, owner, 0)
    lean = client.register_script(LEAN_ACQUIRE)
    lean_meta = "hot.cycle|bench@localhost|12345"
    trivial = client.script_load("return 1")
    trivial3 = client.script_load("return {1, 1700000000000000, 0}")

    def loop(body: Callable[[], object]) -> Callable[[int], None]:
        def run(n: int) -> None:
            for _ in range(n):
                body()

        return run

    def carried(n: int) -> None:
        """n cycles as SingletonTask runs them: each acquire carries the previous release."""
        store.acquire(keys, owner, 0, 30_000, meta)
        for _ in range(n):
            store.acquire_after([(keys.lock, owner, 0, None)], keys, owner, 0, 30_000, meta)
        store.release(keys.lock, owner, 0)

    variants: dict[str, Variant] = {
        "two PINGs": (loop(lambda: (client.ping(), client.ping())), _nothing),
        "2 EVALSHA of a trivial script, no arguments": (
            loop(lambda: (client.evalsha(trivial, 0), client.evalsha(trivial, 0))),
            _nothing,
        ),
        "2 EVALSHA of a trivial script, the cycle's arguments": (
            loop(
                lambda: (
                    client.evalsha(trivial3, *acquire),
                    client.evalsha(trivial, *release),
                )
            ),
            _nothing,
        ),
        "acquire.lua + release.lua, raw evalsha": (
            loop(
                lambda: (
                    client.evalsha(acq, *acquire),
                    client.evalsha(rel, *release),
                )
            ),
            _nothing,
        ),
        "prototype: lean acquire (4 args, 1 fence write) + release.lua, raw": (
            loop(
                lambda: (
                    lean(keys=[keys.lock, keys.fence], args=[owner, 0, 30_000, lean_meta]),
                    client.evalsha(rel, *release),
                )
            ),
            _nothing,
        ),
        "LockStore.acquire + release, no metadata": (
            loop(
                lambda: (
                    store.acquire(keys, owner, 0, 30_000),
                    store.release(keys.lock, owner, 0),
                )
            ),
            _nothing,
        ),
        "LockStore.acquire_after: previous release + acquire, one pipeline": (
            carried,
            _nothing,
        ),
        "LockStore.acquire + release, 3 metadata fields (section 1)": (
            loop(
                lambda: (
                    store.acquire(keys, owner, 0, 30_000, meta),
                    store.release(keys.lock, owner, 0),
                )
            ),
            _nothing,
        ),
    }
    samples = _measure(variants, batch, rounds)
    table = _table("A. Lock cycle, piece by piece", samples, "two PINGs")
    before = command_stats(client)
    for _ in range(1000):
        store.acquire(keys, owner, 0, 30_000, meta)
        store.release(keys.lock, owner, 0)
    delta = command_stats(client) - before
    table.notes.append(
        f"server time per cycle (cmdstat_evalsha): {delta.usec('evalsha') / 1000:.1f} µs "
        f"for {delta.calls('evalsha') / 1000:g} EVALSHA"
    )
    return table


# -- B and C. one task run, eagerly -----------------------------------------------------------


def _eager_app(url: str) -> Celery:
    app = Celery("hotspots", set_as_current=False)
    app.conf.update(
        broker_url=url,
        result_backend=url,
        task_store_eager_result=False,
        singleton_key_prefix="hot-lock:",
    )
    return app


def task_runs(url: str, batch: int, rounds: int) -> tuple[Table, Table]:
    app = _eager_app(url)
    ping_client = client_for(url)

    class TwoPings(Task):  # type: ignore[misc]
        """A plain task with one round trip where the lock acquires, one where it releases."""

        def before_start(self, task_id: str, args: Any, kwargs: Any) -> None:
            ping_client.ping()

        def after_return(self, *args: Any, **kwargs: Any) -> None:
            ping_client.ping()

    @app.task(name="hot.plain", base=Task)  # type: ignore[untyped-decorator]
    def plain(i: int) -> None:
        return None

    @app.task(name="hot.pings", base=TwoPings)  # type: ignore[untyped-decorator]
    def pings(i: int) -> None:
        return None

    @app.task(name="hot.singleton", base=SingletonTask)  # type: ignore[untyped-decorator]
    def single(i: int) -> None:
        return None

    counter = iter(range(10**12))

    def runs(task: Any) -> Callable[[int], None]:
        def run(n: int) -> None:
            for _ in range(n):
                task.apply(args=(next(counter),))

        return run

    variants: dict[str, Variant] = {
        "plain Task": (runs(plain), _nothing),
        "plain Task + 2 PINGs (before_start, after_return)": (runs(pings), _nothing),
        "SingletonTask": (runs(single), _nothing),
    }
    b = _table(
        "B. One task run (eager apply: Celery's tracer, no broker)",
        _measure(variants, batch, rounds),
        "plain Task",
    )

    store = store_for(url)
    held = 10**11
    for k in range(10):
        store.acquire(single.singleton_keys((held + k,), {}), f"holder-{k}", 0, 600_000)
    ring = iter(range(10**12))

    def duplicates(n: int) -> None:
        for _ in range(n):
            single.apply(args=(held + next(ring) % 10,))

    dup_variants: dict[str, Variant] = {
        "plain Task": (runs(plain), _nothing),
        "duplicate skipped": (duplicates, _nothing),
        "duplicate skipped, Celery's ExceptionInfo stubbed": (duplicates, _cheap_exception_info),
    }
    c = _table(
        "C. One skipped duplicate (eager apply)",
        _measure(dup_variants, batch, rounds),
        "plain Task",
    )
    c.notes.append(
        "Celery's tracer builds two billiard ExceptionInfo (frame snapshots + formatted "
        "traceback) for every Ignore raised from before_start."
    )
    return b, c


# -- B2. the Python glue around the two round trips, best of N -----------------------------


def _best(fn: Callable[[], object], n: int, repeats: int) -> tuple[float, float]:
    """(best, median) µs of process CPU per call over ``repeats`` loops of ``n`` calls.

    The best of many loops is what the code costs when the machine lets it run; it is the
    robust figure for work that does not wait on the network.
    """
    loops = []
    for _ in range(repeats):
        start = time.process_time()
        for _ in range(n):
            fn()
        loops.append((time.process_time() - start) / n * 1e6)
    return min(loops), median(loops)


def glue(url: str, n: int, repeats: int) -> Table:
    import inspect

    from celery_singleton_lock import LockHandle
    from celery_singleton_lock.core.renewer import HeldLock

    app = _eager_app(url)

    @app.task(name="hot.glue", base=SingletonTask)  # type: ignore[untyped-decorator]
    def single(i: int) -> None:
        return None

    store = LockStore(cast(redis.Redis, client_for(url)))  # a single private server
    idle, running = Renewer(store), Renewer(store)
    running.ensure_started()

    def held() -> HeldLock:
        return HeldLock("k", "owner", 0, 30_000, 1, acquired_at=time.monotonic())

    def add_remove(renewer: Renewer) -> Callable[[], None]:
        def cycle() -> None:
            h = held()
            renewer.add(h)
            time.sleep(0)  # let a woken renewer thread run, as the task body would
            renewer.remove(h)

        return cycle

    rows: dict[str, Callable[[], object]] = {
        "task.singleton_keys((i,), {}): bind, encode, digest": lambda: single.singleton_keys(
            (12345,), {}
        ),
        "  inspect.signature(run), uncached, for comparison": lambda: inspect.signature(single.run),
        "HeldLock + LockHandle": lambda: LockHandle("k", "t", held(), False),
        "Renewer.add + remove, renewer thread running": add_remove(running),
        "Renewer.add + remove, no thread to wake": add_remove(idle),
        "signals.lock_acquired.send, no receivers": lambda: signals.lock_acquired.send(
            sender=single, key="k", task_id="t", token=1, reentered=False
        ),
    }
    table = Table(
        "B2. The Python glue of one run, piece by piece (process CPU, best of loops)",
        ["piece", "best µs/call", "median µs/call"],
    )
    try:
        for name, fn in rows.items():
            best, med = _best(fn, n, repeats)
            table.add(name, best, med)
    finally:
        running.stop()
    table.notes.append(
        "The renewer thread's CPU is part of the process CPU: the difference between the two "
        "add + remove rows is what waking the thread would cost (add wakes it only when the new "
        "lock is due before the thread's next wake-up)."
    )
    return table


# -- D. renewal of 10,000 locks ----------------------------------------------------------------

#: a prototype, not the library's script: "owner:gen" in one argument per lock (the library
#: sends owner and generation as two)
RENEW_LEAN = """
local bad = {}
local ttl = ARGV[1]
for i = 1, #KEYS do
  local held = redis.call('HMGET', KEYS[i], 'owner', 'gen')
  if not held[1] then
    bad[#bad + 1] = i
    bad[#bad + 1] = 0
  elseif held[1] .. ':' .. held[2] == ARGV[i + 1] then
    redis.call('PEXPIRE', KEYS[i], ttl)
  else
    bad[#bad + 1] = i
    bad[#bad + 1] = -1
  end
end
return bad
"""


def renewal(url: str, locks: int, rounds: int) -> Table:
    from .renewal import _take

    client = cast(redis.Redis, client_for(url))  # a single private server
    store = LockStore(client)
    held = _take(store, locks)
    renewer = Renewer(store)
    for h in held:
        renewer.add(h)
    items = [h.as_item() for h in held]
    keys = [it.key for it in items]
    args: list[Any] = renew_args(items, range(len(items)))[1 + len(keys) :]  # renew.lua's ARGV
    lean = client.register_script(RENEW_LEAN)
    renew_lua = client.register_script(RENEW.text)  # as redis-py would call it
    compact_args: list[int | str] = [
        items[0].ttl_ms,
        *[f"{it.owner}:{it.generation}" for it in items],
    ]
    if lean(keys=keys, args=compact_args):
        raise RuntimeError("lean renew prototype found a lock not held")
    conn = client.connection_pool.get_connection()
    now = [0.0]

    def due(n: int) -> None:
        for _ in range(n):
            now[0] += 10.0
            renewer.run_due(now[0])

    def pack(n: int) -> None:
        for _ in range(n):
            conn.pack_command("EVALSHA", RENEW.sha, len(keys), *keys, *args)  # type: ignore[no-untyped-call]

    groups = renew_groups(items, range(len(items)))

    def prepacked(n: int) -> None:
        for _ in range(n):
            for group in groups:
                _RenewCall(RENEW.sha, items, group)()

    def pack_compact(n: int) -> None:
        for _ in range(n):
            conn.pack_command("EVALSHA", lean.sha, len(keys), *keys, *compact_args)  # type: ignore[no-untyped-call]

    def raw_lean(n: int) -> None:
        for _ in range(n):
            lean(keys=keys, args=compact_args)

    def raw(n: int) -> None:
        for _ in range(n):
            renew_lua(keys=keys, args=args)

    def chunked(n: int) -> None:
        for _ in range(n):
            store.renew(items)

    variants: dict[str, Variant] = {
        "Renewer.run_due (section 3)": (due, _nothing),
        "LockStore.renew: 10 calls of 1,000 locks, streamed": (chunked, _nothing),
        "renew.lua via Script, all locks in one call, no LockStore/Renewer": (raw, _nothing),
        "prototype: 1 arg/lock": (raw_lean, _nothing),
        "client packing only (3 args/lock)": (pack, _nothing),
        "client packing only (2 args/lock)": (pack_compact, _nothing),
        "client packing only, 10 calls from packed items (the library's)": (prepacked, _nothing),
    }
    samples = _measure(variants, 1, rounds)
    client.connection_pool.release(conn)
    table = Table(
        f"D. One renewal of {locks:,} locks, piece by piece",
        ["path", "ms (median)", "min-max", "CPU ms (median)"],
    )
    for name, (values, cpu) in samples.items():
        ms = [v / 1000 for v in values]
        table.add(name, median(ms), spread(ms), median(cpu) / 1000)
    for label, script, argv in (
        ("renew.lua", renew_lua, args),
        ("prototype", lean, compact_args),
    ):
        before = command_stats(client)
        script(keys=keys, args=argv)
        delta = command_stats(client) - before
        table.notes.append(f"server time, {label}: {delta.usec('evalsha') / 1000:.1f} ms")
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.hotspots", description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--only",
        action="append",
        choices=("A", "B", "D"),
        help="run only this section (repeatable); default: all",
    )
    args = parser.parse_args(argv)
    batch, rounds = (200, 5) if args.quick else (1000, 11)
    for section in args.only or ("A", "B", "D"):
        with PrivateRedis() as server:
            if section == "A":
                tables = [lock_cycle(server.url, batch * 2, rounds)]
            elif section == "B":
                tables = list(task_runs(server.url, batch // 2, rounds))
                tables.insert(1, glue(server.url, batch * 2, rounds))
            else:
                tables = [renewal(server.url, 10_000, max(rounds // 2, 3))]
        for table in tables:
            print(table.render() + "\n", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
