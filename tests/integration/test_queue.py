"""``singleton_on_duplicate="queue"`` on real workers: every call of a key runs, one at a time,
in the order it reached the key; each release hands the key to the next call, so nothing polls;
waiting calls that are revoked or expire leave the line without running; a holder whose pool
child dies passes the key on; the queue is bounded.

Two workers (two prefork pool processes each) on one queue share the module's tests, each test
its own keys: the order is kept across workers.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator

import pytest
import redis

from celery_singleton_lock import DuplicateTaskError
from celery_singleton_lock.core.keys import derive_keys
from celery_singleton_lock.core.queue import queue_keys
from tests.support.basic_app import history_key
from tests.support.bed import Bed, new_key
from tests.support.cli import app_env, singleton_cli
from tests.support.history import check_history, load_history, wait_started
from tests.support.queue_app import order_key
from tests.support.waiting import wait_for
from tests.support.workers import WorkerProcess

QUEUE_APP = "tests.support.queue_app"


@pytest.fixture(scope="module")
def bed(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, module_prefix: str
) -> Iterator[Bed]:
    """Two prefork workers of two processes each on the default queue, then a threads and a
    gevent worker on queues of their own (:func:`_pool_queue`)."""
    with Bed(redis_url, module_prefix, tmp_path_factory.mktemp("queue")) as made:
        for _ in range(2):
            made.start(QUEUE_APP, pool="prefork", concurrency=2)
        yield made


@pytest.fixture(scope="module")
def pool_workers(bed: Bed) -> dict[str, WorkerProcess]:
    """A threads worker and a gevent worker, each on a queue of its own."""
    return {
        pool: bed.start(
            QUEUE_APP,
            pool=pool,
            concurrency=4,
            queues=_pool_queue(bed, pool),
            env={"SINGLETON_TEST_TERMINATES": "1" if pool == "gevent" else "0"},
        )
        for pool in ("threads", "gevent")
    }


def _pool_queue(bed: Bed, pool: str) -> str:
    return f"{bed.app.conf.task_default_queue}-{pool}"


def _lock(prefix: str, task: str, key: str) -> str:
    return derive_keys(f"{prefix}lock:", task, _signature, (key,), {}, ("key",)).lock


def _signature(key: str, payload: object = None, seconds: float = 0.0) -> None:
    """The signature of the test app's tasks (keys are derived from the bound arguments)."""


def _order(client: redis.Redis, prefix: str, key: str) -> list[str]:
    return [v.decode() for v in client.lrange(order_key(prefix, key), 0, -1)]


def _queued(client: redis.Redis, lock: str) -> int:
    return int(client.zcard(queue_keys(lock)[0]))


def _released(client: redis.Redis, lock: str, workers: list[WorkerProcess]) -> None:
    """Nothing of the key left: its last run's release comes just after its result is stored."""
    wait_for(lambda: not client.exists(lock, *queue_keys(lock)), 10, "the key released", *workers)


def _started(client: redis.Redis, prefix: str, key: str, workers: list[WorkerProcess]) -> None:
    """The holder's body started (its own record: its lock is no proof)."""
    wait_started(client, history_key(prefix), key, *workers)


@pytest.mark.slow(seconds=8)
def test_a_burst_runs_every_call_in_the_order_it_reached_the_key(bed: Bed) -> None:
    """A holder, then ten calls sent one after another while it runs: each waits in line (in
    no worker slot), and each runs in turn, in the order it was sent, across two workers; each
    call's own result, and its link called with it; nothing left in Redis."""
    app, workers, client, module_prefix = bed.app, bed.workers, bed.client, bed.prefix
    key = new_key()
    lock = _lock(module_prefix, "q.line", key)
    holder = app.send_task("q.line", (key, "holder", -1))
    _started(client, module_prefix, key, workers)
    calls = []
    for i in range(10):
        calls.append(
            app.signature("q.line", (key, f"c{i}", 0.05)).apply_async(
                link=app.signature("q.after", kwargs={"tag": key})
            )
        )
        wait_for(lambda n=i + 1: _queued(client, lock) >= n, 10, f"call {i} queued", *workers)
    client.rpush(f"{key}:go", 1)
    assert holder.get(timeout=20)["payload"] == "holder"
    assert [c.get(timeout=30)["payload"] for c in calls] == [f"c{i}" for i in range(10)]
    assert _order(client, module_prefix, key) == ["holder", *(f"c{i}" for i in range(10))]
    history = [e for e in load_history(client, history_key(module_prefix)) if e.key == key]
    assert len(history) == 11
    report = check_history(history)
    assert report.ok, report.summary()
    tokens = [e.token for e in sorted(history, key=lambda e: e.start_us)]
    assert tokens == sorted(tokens)
    links = wait_for(
        lambda: (
            items if len(items := client.lrange(module_prefix + "after", 0, -1)) >= 10 else None
        ),
        10,
        "the links",
    )
    assert sorted(v.decode() for v in links if v.decode().startswith(key)) == sorted(
        f"{key}:c{i}" for i in range(10)
    )
    _released(client, lock, workers)
    logs = "".join(w.log_text() for w in workers)
    assert logs.count("singleton: duplicate queued: q.line[") >= 10


@pytest.mark.slow(seconds=6)
def test_two_permits_run_two_at_a_time_in_order(bed: Bed) -> None:
    """Two permits: two holders, four calls waiting; they are handed the key two by two, in
    the order they came (the two handed it at once start in either order), never three runs at
    once."""
    app, workers, client, module_prefix = bed.app, bed.workers, bed.client, bed.prefix
    key = new_key()
    holders = [app.send_task("q.line2", (key, f"h{i}", -1)) for i in range(2)]
    wait_for(lambda: len(_order(client, module_prefix, key)) >= 2, 20, "two holders", *workers)
    lock = _lock(module_prefix, "q.line2", key)
    calls = []
    for i in range(4):
        calls.append(app.send_task("q.line2", (key, f"c{i}", 0.2)))
        wait_for(lambda n=i + 1: _queued(client, lock) >= n, 10, f"call {i} queued", *workers)
    client.rpush(f"{key}:go", 1, 1)
    for h in holders:
        h.get(timeout=20)
    assert [c.get(timeout=30)["payload"] for c in calls] == ["c0", "c1", "c2", "c3"]
    order = _order(client, module_prefix, key)[2:]  # two handed the key at once start in any order
    assert (set(order[:2]), set(order[2:])) == ({"c0", "c1"}, {"c2", "c3"}), order
    history = [e for e in load_history(client, history_key(module_prefix)) if e.key == key]
    starts = sorted(e.start_us for e in history)
    for at in starts:  # at most two runs at any start
        assert sum(1 for e in history if e.start_us <= at < (e.end_us or at + 1)) <= 2


@pytest.mark.slow(seconds=8)
def test_revoked_and_expired_waiting_calls_leave_the_line_without_running(bed: Bed) -> None:
    """Four calls wait; the second is revoked and the third expires while they wait: at their
    turn they are passed over (REVOKED, no run, no link); the others run in order."""
    app, workers, client, module_prefix = bed.app, bed.workers, bed.client, bed.prefix
    key = new_key()
    lock = _lock(module_prefix, "q.line", key)
    holder = app.send_task("q.line", (key, "holder", -1))
    _started(client, module_prefix, key, workers)
    link = app.signature("q.after", kwargs={"tag": key})
    first = app.signature("q.line", (key, "first")).apply_async(link=link)
    wait_for(lambda: _queued(client, lock) >= 1, 10, "first queued", *workers)
    revoked = app.signature("q.line", (key, "revoked")).apply_async(link=link)
    wait_for(lambda: _queued(client, lock) >= 2, 10, "revoked queued", *workers)
    expiring = app.signature("q.line", (key, "expired")).apply_async(link=link, expires=1.5)
    wait_for(lambda: _queued(client, lock) >= 3, 10, "expiring queued", *workers)
    last = app.signature("q.line", (key, "last")).apply_async(link=link)
    wait_for(lambda: _queued(client, lock) >= 4, 10, "last queued", *workers)
    app.control.revoke(revoked.id)
    wait_for(lambda: revoked.state == "REVOKED", 10, "the revoke stored", *workers)
    time.sleep(1.6)  # past the third call's expires (the clock it is checked against)
    client.rpush(f"{key}:go", 1)
    holder.get(timeout=20)
    assert first.get(timeout=20)["payload"] == "first"
    assert last.get(timeout=20)["payload"] == "last"
    assert revoked.state == "REVOKED"
    wait_for(lambda: expiring.state == "REVOKED", 10, "the expired call REVOKED", *workers)
    assert _order(client, module_prefix, key) == ["holder", "first", "last"]
    _released(client, lock, workers)
    logs = "".join(w.log_text() for w in workers)
    assert f"queued call already ended, passed over: q.line[{revoked.id}]" in logs
    assert f"queued call already ended, passed over: q.line[{expiring.id}]" in logs


@pytest.mark.slow(seconds=8)
def test_a_holder_killed_passes_the_key_to_the_next_call(bed: Bed) -> None:
    """The holder's pool child is SIGKILLed while two calls wait: the worker's main process
    releases its lock and hands the key to the next call; both run, in order."""
    app, workers, client, module_prefix = bed.app, bed.workers, bed.client, bed.prefix
    key = new_key()
    lock = _lock(module_prefix, "q.line", key)
    holder = app.send_task("q.line", (key, "holder", -1))
    _started(client, module_prefix, key, workers)
    calls = []
    for i in range(2):
        calls.append(app.send_task("q.line", (key, f"c{i}", 0.1)))
        wait_for(lambda n=i + 1: _queued(client, lock) >= n, 10, f"call {i} queued", *workers)
    pid = next(e.pid for e in load_history(client, history_key(module_prefix)) if e.key == key)
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(Exception, match=r"(?i)worker"):
        holder.get(timeout=20)
    assert [c.get(timeout=30)["payload"] for c in calls] == ["c0", "c1"]
    assert _order(client, module_prefix, key) == ["holder", "c0", "c1"]
    _released(client, lock, workers)


@pytest.mark.slow(seconds=5)
def test_a_full_queue_refuses_the_call(bed: Bed) -> None:
    app, workers, client, module_prefix = bed.app, bed.workers, bed.client, bed.prefix
    key = new_key()
    lock = _lock(module_prefix, "q.short", key)
    holder = app.send_task("q.short", (key, "holder", -1))
    _started(client, module_prefix, key, workers)
    waiting = [app.send_task("q.short", (key, f"c{i}")) for i in range(2)]
    wait_for(lambda: _queued(client, lock) >= 2, 10, "two queued", *workers)
    refused = app.send_task("q.short", (key, "over"))
    with pytest.raises(DuplicateTaskError, match=r"queue of .* is full"):
        refused.get(timeout=20)
    client.rpush(f"{key}:go", 1)
    holder.get(timeout=20)
    assert [w.get(timeout=20)["payload"] for w in waiting] == ["c0", "c1"]
    logs = "".join(w.log_text() for w in workers)
    assert f"singleton: queue full, raised: q.short[{refused.id}]" in logs


def _cli(redis_url: str, prefix: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``celery -A tests.support.queue_app singleton <args>`` as a real process."""
    return singleton_cli(QUEUE_APP, app_env(redis_url, prefix), *args)


@pytest.mark.slow(seconds=10)
def test_the_cli_shows_the_queue_and_a_release_hands_the_key_to_the_next_call(
    bed: Bed, redis_url: str
) -> None:
    """``list`` and ``show`` give the queue's length and its next call; a forced ``release``
    of the holder's lock hands the key to that call (it runs, the holder still running, as the
    operator asked), and says so; the calls behind it go on in order."""
    app, workers, client, module_prefix = bed.app, bed.workers, bed.client, bed.prefix
    key = new_key()
    lock = _lock(module_prefix, "q.line", key)
    holder = app.send_task("q.line", (key, "holder", -1))
    _started(client, module_prefix, key, workers)
    calls = []
    for i in range(2):
        calls.append(app.send_task("q.line", (key, f"c{i}", 0.1)))
        wait_for(lambda n=i + 1: _queued(client, lock) >= n, 10, f"call {i} queued", *workers)
    listed = _cli(redis_url, module_prefix, "list")
    row = next(line for line in listed.stdout.splitlines() if lock in line)
    assert f"2 next={calls[0].id}" in row, listed.stdout
    shown = _cli(redis_url, module_prefix, "show", lock)
    assert f"queue:     2 calls wait, next {calls[0].id}" in shown.stdout, shown.stdout
    released = _cli(redis_url, module_prefix, "release", lock, "--yes")
    assert released.returncode == 0, released.stderr
    assert f"{lock}: handed to the next queued call; 1 wait behind it" in released.stdout
    assert [c.get(timeout=30)["payload"] for c in calls] == ["c0", "c1"]
    client.rpush(f"{key}:go", 1)
    holder.get(timeout=20)  # its own release finds the lock another's: left alone
    _released(client, lock, workers)


@pytest.mark.slow(seconds=10)
def test_purge_hands_on_a_queue_whose_lock_expired(bed: Bed, redis_url: str) -> None:
    """A queue whose holder was lost with its node (the lock gone, no later call): ``purge``
    finds it and hands the key to its next call; the calls run in order."""
    app, workers, client, module_prefix = bed.app, bed.workers, bed.client, bed.prefix
    key = new_key()
    lock = _lock(module_prefix, "q.line", key)
    holder = app.send_task("q.line", (key, "holder", -1))
    _started(client, module_prefix, key, workers)
    calls = []
    for i in range(2):
        calls.append(app.send_task("q.line", (key, f"c{i}", 0.1)))
        wait_for(lambda n=i + 1: _queued(client, lock) >= n, 10, f"call {i} queued", *workers)
    client.delete(lock)  # as if it expired: its node died
    dry = _cli(redis_url, module_prefix, "purge", "--dry-run")
    assert f"orphaned queue\t2 calls\tq.line\t{lock}" in dry.stdout, dry.stdout
    purged = _cli(redis_url, module_prefix, "purge", "--yes")
    assert f"{lock}: handed to the next queued call; 1 wait behind it" in purged.stdout
    assert [c.get(timeout=30)["payload"] for c in calls] == ["c0", "c1"]
    client.rpush(f"{key}:go", 1)
    holder.get(timeout=20)
    _released(client, lock, workers)


@pytest.mark.slow(seconds=6)
@pytest.mark.parametrize("pool", ["threads", "gevent"])
def test_a_burst_keeps_its_order_in_the_threads_and_gevent_pools(
    bed: Bed, pool_workers: dict[str, WorkerProcess], pool: str
) -> None:
    app, client, module_prefix = bed.app, bed.client, bed.prefix
    worker = pool_workers[pool]
    queue = _pool_queue(bed, pool)
    key = new_key()
    lock = _lock(module_prefix, "q.line", key)
    holder = app.send_task("q.line", (key, "holder", -1), queue=queue)
    _started(client, module_prefix, key, [worker])
    calls = []
    for i in range(5):
        calls.append(app.send_task("q.line", (key, f"c{i}", 0.05), queue=queue))
        wait_for(lambda n=i + 1: _queued(client, lock) >= n, 10, f"call {i} queued", worker)
    client.rpush(f"{key}:go", 1)
    holder.get(timeout=20)
    assert [c.get(timeout=30)["payload"] for c in calls] == [f"c{i}" for i in range(5)]
    assert _order(client, module_prefix, key) == ["holder", *(f"c{i}" for i in range(5))]
    _released(client, lock, [worker])
