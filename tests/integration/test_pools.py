"""The gevent and eventlet pools, and prefork with ``worker_pool_start_method="spawn"``, on real
workers (celery_singleton_lock/worker/pools.py; docs/deployments.md, "Worker pools").

One worker per pool serves every test of the module (``-P gevent -c 20``, ``-P eventlet -c 20``,
``-P prefork -c 2`` with spawned children), each on its own queue, all on one key prefix; the
lock ttl is 1 s. Under each: a duplicate met while a run holds the key is skipped, also after
the run's lock outlived its ttl (renewed by the green renewer, or the spawned child's); the
key is free after a run that succeeded or failed (the deferred release sent, its reply read);
under the green pools 20 runs of 20 keys hold their locks at once, and every duplicate is
skipped by the pool, not by the worker's main process (worker/mainskip.py). A spawned child killed
mid-run has its lock released by the main process. A green pool the library cannot run under
(not monkey-patched, or patched after the library was imported) stops the worker at start-up.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery.result import AsyncResult

from celery_singleton_lock import skip_info
from celery_singleton_lock.worker.pools import check_pool, pool_module
from tests.support.bed import Bed, assert_clean_log, new_key, wait_result
from tests.support.history import server_time_us
from tests.support.mainskip import reached_celery
from tests.support.waiting import wait_for
from tests.support.workers import REPO_ROOT, WorkerProcess, kill_child

GREEN = ("gevent", "eventlet")
#: the pools of the module's workers: "spawn" is prefork with spawned children
POOLS = (*GREEN, "spawn")
TTL = 1.0
#: concurrent runs of distinct keys under a green pool (its -c)
GREEN_CONCURRENCY = 20
INVALID = "celery_singleton_lock: invalid setting: "


def _needs(pool: str) -> None:
    """Skip, with the reason, when the pool's library is not installed. Looked up, never
    imported: eventlet warns at every later fork of the process that imported it (an error
    under ``filterwarnings = error``, in whichever test of this xdist worker forks next)."""
    if pool in GREEN and importlib.util.find_spec(pool) is None:
        pytest.skip(f"{pool} is not installed (the test extra installs it)")


def _queue(pool: str) -> str:
    return f"pools-{pool}"


def worker_of(bed: Bed, pool: str) -> WorkerProcess:
    """The worker of ``pool``, ready, started at the first test of its pool (and only then: an
    xdist process starts the workers of its tests only). Skips the test when the pool's
    library is not installed."""
    _needs(pool)
    name = f"pools-{pool}-"
    started = [w for w in bed.workers if w.name.startswith(name)]
    if started:
        return started[0]
    spawn = pool == "spawn"
    env = {"SINGLETON_TEST_TTL": str(TTL)}
    if spawn:
        env["SINGLETON_TEST_START_METHOD"] = "spawn"
    return bed.start(
        pool="prefork" if spawn else pool,
        concurrency=2 if spawn else GREEN_CONCURRENCY,
        name=f"{name}{uuid.uuid4().hex[:6]}",
        env=env,
        queues=_queue(pool),
        ready_timeout=60,
    )


def send_to(bed: Bed, pool: str, name: str, *args: Any, **kwargs: Any) -> AsyncResult:
    """Send task ``name`` to the worker of ``pool`` (started if it was not)."""
    worker_of(bed, pool)
    return bed.app.send_task(name, args=args, kwargs=kwargs, queue=_queue(pool))


def server_us(bed: Bed) -> int:
    """The Redis server's clock (the history's), in microseconds."""
    return server_time_us(bed.client)


def wait_released(bed: Bed, task_id: str, worker: WorkerProcess) -> None:
    """Wait until ``lock_released`` came for ``task_id``: the reply of its release was read."""
    wait_for(lambda: "lock_released" in bed.events(task_id), 10, "lock_released", worker)


@pytest.fixture(scope="module")
def pools(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, module_prefix: str
) -> Iterator[Bed]:
    """The module's bed: a worker per pool (:func:`worker_of`), each on its own queue, all on
    the module's key prefix."""
    with Bed(redis_url, module_prefix, tmp_path_factory.mktemp("pools")) as bed:
        yield bed


# -- one run at a time, renewed past its ttl, released ---------------------------------------------


@pytest.mark.slow(seconds=8)
@pytest.mark.parametrize("pool", POOLS)
def test_a_run_renewed_past_its_ttl_skips_duplicates_and_releases(pools: Bed, pool: str) -> None:
    """A run holding its key for 3 ttls (it waits, cooperatively, for the test to let it go):
    a duplicate sent once the lock outlived its ttl is skipped in front of Celery's tracer
    (task_postrun SUCCESS, no lock_acquired: the ``__trace__`` wrapper applies, also in a
    spawned child); the run's lock was renewed and never lost; the key is free after it, and
    the release's reply was read."""
    worker = worker_of(pools, pool)
    key, gate = new_key(), pools.gate()
    run = send_to(pools, pool, "t.hold_renewed", key, until=gate)
    lock = pools.wait_held(run.id)
    start_us = pools.wait_started(key, timeout=10)[0].start_us
    wait_for(lambda: server_us(pools) > start_us + 1.5 * TTL * 1e6, 10, "1.5 ttls")
    assert pools.lock(lock)["owner"] == run.id  # it outlived its ttl: renewed

    duplicate = send_to(pools, pool, "t.hold_renewed", key)
    info = skip_info(duplicate.get(timeout=20))
    assert info is not None
    assert (info.key, info.holder) == (lock, run.id)
    wait_for(lambda: "task_postrun SUCCESS" in pools.events(duplicate.id), 10, "postrun", worker)
    assert pools.events(duplicate.id) == [
        "task_prerun",
        "duplicate_skipped",
        "task_postrun SUCCESS",
    ]

    wait_for(lambda: server_us(pools) > start_us + 3 * TTL * 1e6, 10, "3 ttls")
    pools.open(gate)
    result = run.get(timeout=20)
    assert result["lost"] is False
    assert result["renewals"] > 0
    pools.wait_gone(lock, 5)
    wait_released(pools, run.id, worker)
    assert pools.events(run.id)[:2] == ["task_prerun", "lock_acquired"]
    assert len([e for e in pools.history() if e.key == key]) == 1  # the duplicate never ran
    assert_clean_log(worker)


@pytest.mark.slow(seconds=4)
@pytest.mark.parametrize("pool", POOLS)
def test_a_failed_run_releases(pools: Bed, pool: str) -> None:
    """A run that raises: FAILURE, its key free, its release reported; the key runs again."""
    worker = worker_of(pools, pool)
    key = new_key()
    run = send_to(pools, pool, "t.hold_renewed", key, 0.2, fail=True)
    lock = pools.wait_held(run.id)
    wait_result(run)
    assert run.state == "FAILURE"
    pools.wait_gone(lock, 5)
    wait_released(pools, run.id, worker)

    again = send_to(pools, pool, "t.hold_renewed", key)
    assert skip_info(again.get(timeout=20)) is None
    wait_released(pools, again.id, worker)
    assert_clean_log(worker)


# -- green pools: distinct keys at once, and who skips --------------------------------------------


@pytest.mark.slow(seconds=6)
@pytest.mark.parametrize("pool", GREEN)
def test_runs_of_distinct_keys_hold_their_locks_at_once(pools: Bed, pool: str) -> None:
    """20 runs of 20 keys under -c 20: all of them start (each holding its lock) before any is
    let go, so their intervals share a moment; none lost its lock meanwhile."""
    worker = worker_of(pools, pool)
    tag, gate = new_key(), pools.gate()
    keys = [f"{tag}-{i}" for i in range(GREEN_CONCURRENCY)]
    runs = [send_to(pools, pool, "t.hold_renewed", k, until=gate) for k in keys]

    def started() -> bool:
        return len({e.key for e in pools.history() if e.key.startswith(tag)}) == len(keys)

    wait_for(started, 30, f"{len(keys)} runs started at once", worker)
    owners = {fields.get("owner") for fields in pools.locks().values()}
    assert {run.id for run in runs} <= owners  # every lock held, at one moment
    pools.open(gate, len(keys))
    results = [run.get(timeout=30) for run in runs]
    assert [r["lost"] for r in results] == [False] * len(keys)
    runs_of_tag = [e for e in pools.history() if e.key.startswith(tag)]
    assert len(runs_of_tag) == len(keys)
    ends = [e.end_us for e in runs_of_tag if e.end_us is not None]
    assert len(ends) == len(keys)
    assert max(e.start_us for e in runs_of_tag) < min(ends)  # one moment inside every run
    assert_clean_log(worker)


@pytest.mark.slow(seconds=4)
@pytest.mark.parametrize("pool", GREEN)
def test_every_duplicate_is_skipped_by_the_pool(pools: Bed, pool: str) -> None:
    """The main-process skip is for solo and threads only (strategy.MAIN_PROCESS_POOLS): under
    a green pool each duplicate of a held key reaches Celery's handler, even after a skip, and
    is skipped by its green thread."""
    worker = worker_of(pools, pool)
    key, gate = new_key(), pools.gate()
    run = send_to(pools, pool, "t.hold_renewed", key, until=gate)
    lock = pools.wait_held(run.id)
    duplicates = []
    for _ in range(4):  # one at a time: each skip could have made the key hot
        duplicate = send_to(pools, pool, "t.hold_renewed", key)
        info = skip_info(duplicate.get(timeout=20))
        assert info is not None
        assert info.holder == run.id
        duplicates.append(duplicate)
    assert [reached_celery(worker, "t.hold_renewed", d.id) for d in duplicates] == [True] * 4
    pools.open(gate)
    assert run.get(timeout=20)["lost"] is False
    pools.wait_gone(lock, 5)


# -- spawn: a killed child ---------------------------------------------------------------------


@pytest.mark.slow(seconds=6)
def test_a_killed_spawned_child_lock_is_released_by_the_main_process(pools: Bed) -> None:
    """SIGKILL of the spawned child running a run: the worker's main process releases its lock
    (task_failure with WorkerLostError), long before its 30 s ttl would let it go."""
    worker = worker_of(pools, "spawn")
    key, gate = new_key(), pools.gate()
    run = send_to(pools, "spawn", "t.hold_long_ttl", key, until=gate)
    lock = pools.wait_held(run.id)
    pid = int(pools.lock(lock)["pid"])
    assert pid in worker.child_pids()
    kill_child(pools.client, pid)
    pools.wait_gone(lock, 10)
    wait_result(run)
    assert run.state == "FAILURE"
    assert type(run.result).__name__ == "WorkerLostError"
    line = f"singleton: released by main process after worker lost: t.hold_long_ttl[{run.id}]"
    wait_for(lambda: line in worker.log_text(), 5, "the main process's release", worker)


# -- refused at start-up -------------------------------------------------------------------------


@pytest.mark.slow(seconds=4)
@pytest.mark.parametrize("pool", GREEN)
def test_a_duplicate_joins_a_run_of_a_green_pool(pools: Bed, pool: str) -> None:
    """``singleton_on_duplicate="join"`` in a gevent or eventlet worker: the duplicate waits
    in no green thread and ends with the holder's value."""
    worker = worker_of(pools, pool)
    key = f"join-{uuid.uuid4().hex[:8]}"
    holder = send_to(pools, pool, "t.join", key, -1, {"v": pool})
    worker.wait_for_log(rf"Task t.join\[{holder.id}\] received")
    pattern = f"{pools.prefix}lock:{{t.join:*}}:lock"
    wait_for(lambda: list(pools.client.scan_iter(pattern, count=1000)), 10, "the lock")
    joined = send_to(pools, pool, "t.join", key, 0, "not run")
    worker.wait_for_log(rf"singleton: duplicate joined: t.join\[{joined.id}\]")
    pools.client.rpush(f"{key}:go", 1)
    assert holder.get(timeout=20) == joined.get(timeout=20) == {"v": pool}


@pytest.mark.parametrize("pool", GREEN)
def test_a_green_pool_set_by_worker_pool_alone_is_refused(bed: Bed, pool: str) -> None:
    """worker_pool="gevent" (or eventlet) in the configuration, no -P: Celery patches nothing;
    the worker exits before it is ready with one line naming worker_pool and the fix."""
    _needs(pool)
    worker = bed.start(concurrency=1, env={"SINGLETON_TEST_WORKER_POOL": pool}, ready=False)
    code = worker.wait(timeout=30)
    log = worker.log_text()
    assert code != 0, log
    (line,) = [line for line in log.splitlines() if INVALID in line]
    assert f"worker_pool {pool!r}" in line
    assert f"celery worker -P {pool}" in line
    assert " ready." not in log
    assert "Traceback" not in log


#: imports the library, then monkey-patches (first argument) or the other way round, then
#: prints what check_pool says of that pool
_ORDER = """
import sys, importlib
pool, first = sys.argv[1], sys.argv[2]

def patch():
    if pool == "gevent":
        importlib.import_module("gevent.monkey").patch_all()
    else:
        importlib.import_module("eventlet").monkey_patch()

if first == "patch":
    patch()
import celery_singleton_lock.worker.hooks
if first == "import":
    patch()
from celery_singleton_lock.worker.pools import check_pool
try:
    check_pool(pool)
except ValueError as exc:
    print("refused:", exc)
else:
    print("accepted")
"""


@pytest.mark.parametrize("pool", GREEN)
def test_patching_after_the_library_was_imported_is_refused(pool: str) -> None:
    """Patched first (what -P does), the pool is accepted; the library imported first (its
    per-run state then one per OS thread), it is refused. One process for each order, both
    at once."""
    _needs(pool)
    orders = {
        first: subprocess.Popen(
            [sys.executable, "-W", "ignore", "-c", _ORDER, pool, first],
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for first in ("patch", "import")
    }
    said = {first: process.communicate(timeout=60)[0] for first, process in orders.items()}
    assert said["patch"].startswith("accepted"), said["patch"]
    assert said["import"].startswith(
        f"refused: worker_pool {pool!r} needs threading and socket monkey-patched"
    ), said["import"]


@pytest.mark.parametrize(
    ("pool", "module"),
    [
        (None, "celery.concurrency.prefork"),
        ("gevent", "celery.concurrency.gevent"),
        ("eventlet", "celery.concurrency.eventlet"),
        ("threads", "celery.concurrency.thread"),
        ("celery.concurrency.gevent:TaskPool", "celery.concurrency.gevent"),
        ("celery.concurrency.gevent.TaskPool", "celery.concurrency.gevent"),
        (Path, "pathlib"),
    ],
)
def test_pool_module(pool: Any, module: str) -> None:
    """A pool given as a class, an alias or a dotted path names its module."""
    assert pool_module(pool) == module


@pytest.mark.parametrize("pool", [None, "prefork", "solo", "threads"])
def test_other_pools_are_never_refused(pool: str | None) -> None:
    check_pool(pool)
