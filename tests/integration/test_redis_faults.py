"""The lock Redis misbehaving under real worker processes: down, restarted without its data,
unreachable for a while, slow, or refusing the password.

The locks live on a private server (``SINGLETON_TEST_LOCK_URL``) that each test stops, restarts,
pauses or slows down; the broker, the results and the history stay on the shared Redis under
``key_prefix``. Every test then checks the same four things: no crash loop (a bounded number of
requeues), the worker and its pool children alive and still serving, no lock key left on the
lock server, and no overlap in the history (except where a Redis that forgot its data makes one,
which the test then shows was reported).
"""

from __future__ import annotations

import threading
import time
import traceback
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery
from celery.result import AsyncResult

from celery_singleton_lock import LockUnavailableError, skip_info
from celery_singleton_lock.core import connection as singleton_connection
from celery_singleton_lock.core.connection import store_for
from celery_singleton_lock.core.keys import lock_keys
from tests.support.basic_app import RECORD_TASK
from tests.support.bed import Bed
from tests.support.history import check_history
from tests.support.servers import RedisServer, server_busy
from tests.support.waiting import wait_for
from tests.support.workers import WorkerProcess

#: singleton_retry_countdown of every worker here: how often a run is requeued while Redis fails
COUNTDOWN = 0.5
REQUEUED = "singleton: redis error on acquire, retrying in"
UNGUARDED = "singleton: redis error on acquire, running without the lock"
RENEW_FAILED = "singleton: renewal failed, retrying"
LOST = "singleton: lock lost"
#: lines that mean a process crashed or the library broke, whatever the scenario
CRASH_LINES = ("WorkerLostError", "renewer tick failed", "Unrecoverable error", "CRITICAL")

PASSWORD = "s3cret-Pw-71c"
WRONG_PASSWORD = "Wr0ng-Pw-93d"


# -- helpers ------------------------------------------------------------------------------------


def start_worker(
    bed: Bed,
    lock_url: str,
    ttl: float,
    concurrency: int = 2,
    **env: str,
) -> WorkerProcess:
    """A prefork worker of singleton_app whose locks live at ``lock_url``; waits for ping and
    for its pool's children."""
    worker = bed.start(
        concurrency=concurrency,
        ttl=ttl,
        env={
            "SINGLETON_TEST_LOCK_URL": lock_url,
            "SINGLETON_TEST_RETRY_COUNTDOWN": str(COUNTDOWN),
            **env,
        },
    )
    wait_for(lambda: len(worker.child_pids()) == concurrency, 10, "the pool", worker)
    return worker


def hold(app: Celery, key: str, seconds: float, queue: str | None = None) -> AsyncResult:
    """Send ``t.hold(key, seconds)``."""
    return app.send_task("t.hold", kwargs={"key": key, "seconds": seconds}, queue=queue)


def get(result: AsyncResult, worker: WorkerProcess, timeout: float = 20.0) -> Any:
    """The result's value; the worker's log on failure."""
    try:
        return result.get(timeout=timeout)
    except Exception as exc:
        raise AssertionError(f"{result.id} failed: {exc!r}\n{worker.log_tail(80)}") from exc


def lines(worker: WorkerProcess, needle: str, task_id: str | None = None) -> list[str]:
    """The worker's log lines containing ``needle`` (and ``task_id`` when given)."""
    return [
        line
        for line in worker.log_text().splitlines()
        if needle in line and (task_id is None or task_id in line)
    ]


def lock_keys_on(client: redis.Redis) -> list[str]:
    """Every lock key on the lock server (SCAN; fencing counters are meant to stay)."""
    return sorted(k.decode() for k in client.scan_iter(match="*:lock", count=1000))


def owner_of_lock(client: redis.Redis, task_id: str) -> str | None:
    """The key of the lock ``task_id`` holds on the lock server, if any."""
    for key in lock_keys_on(client):
        if client.hget(key, "owner") == task_id.encode():
            return key
    return None


def renewed_after_ms(client: redis.Redis, key: str) -> int:
    """Ms from the lock's acquire to its last renewal (about 0 if never): age - (ttl - pttl)."""
    pipe = client.pipeline(transaction=False)
    pipe.hmget(key, "since", "ttl")
    pipe.pttl(key)
    pipe.time()
    (since, ttl), pttl, (seconds, micros) = pipe.execute()
    if since is None or ttl is None or pttl < 0:
        return -1
    now_ms = int(seconds) * 1000 + int(micros) // 1000
    return (now_ms - int(since)) - (int(ttl) - int(pttl))


def assert_healthy(
    worker: WorkerProcess,
    app: Celery,
    lock_client: redis.Redis,
    children: set[int],
    queue: str | None = None,
) -> None:
    """Alive, same pool children, still serving guarded runs, no lock left behind, no crash."""
    assert worker.is_running(), worker.log_tail(80)
    assert set(worker.child_pids()) == children, worker.log_tail(80)
    value = get(hold(app, f"after-{uuid.uuid4().hex[:6]}", 0.0, queue), worker)
    assert isinstance(value["token"], int)
    assert value["lost"] is False
    wait_for(lambda: not lock_keys_on(lock_client), 5, "every lock released", worker)
    crashes = [line for needle in CRASH_LINES for line in lines(worker, needle)]
    assert not crashes, "\n".join(crashes)


@pytest.fixture
def lock_client(private_redis: RedisServer) -> Iterator[redis.Redis]:
    """A client of the private lock server (it reconnects after a restart)."""
    client = private_redis.client(socket_timeout=10)
    yield client
    client.close()


# -- 1, 2. the lock Redis is down when a run arrives -------------------------------------------


def test_fail_policy_requeues_until_lock_redis_is_back(
    bed: Bed, private_redis: RedisServer, lock_client: redis.Redis
) -> None:
    """on_redis_error="fail": no run while the lock Redis is down, requeued, runs once after."""
    worker = start_worker(bed, private_redis.url, ttl=5)
    children = set(worker.child_pids())
    private_redis.stop()
    stopped = time.monotonic()
    result = hold(bed.app, "down", 0.2)
    wait_for(lambda: len(lines(worker, REQUEUED, result.id)) >= 3, 15, "3 requeues", worker)
    assert result.state == "RETRY"
    assert bed.runs("down") == []  # nothing ran unguarded

    private_redis.restart()  # same port, empty
    outage = time.monotonic() - stopped
    value = get(result, worker)
    assert isinstance(value["token"], int)
    assert value["lost"] is False
    assert len(bed.runs("down")) == 1

    requeues = lines(worker, REQUEUED, result.id)
    assert 3 <= len(requeues) <= outage / COUNTDOWN + 3, "\n".join(requeues)
    assert "Connection refused" in requeues[0]
    assert not lines(worker, UNGUARDED)
    assert_healthy(worker, bed.app, lock_client, children)
    assert len(lines(worker, REQUEUED, result.id)) == len(requeues)  # no requeue after the run
    bed.assert_no_overlap()


def test_run_policy_runs_unguarded_while_lock_redis_is_down(
    bed: Bed, private_redis: RedisServer, lock_client: redis.Redis
) -> None:
    """on_redis_error="run": the run starts at once without a lock, token None, and says so."""
    worker = start_worker(
        bed,
        private_redis.url,
        ttl=5,
        SINGLETON_TEST_ON_REDIS_ERROR="run",
    )
    children = set(worker.child_pids())
    private_redis.stop()
    result = hold(bed.app, "down", 0.2)
    value = get(result, worker, timeout=10)
    assert value["token"] is None
    assert value["lost"] is False
    unguarded = lines(worker, UNGUARDED, result.id)
    assert len(unguarded) == 1, worker.log_tail(40)
    assert "key=" in unguarded[0]
    assert not lines(worker, REQUEUED)
    (run,) = bed.runs("down")
    assert run.token is None

    private_redis.restart()
    assert_healthy(worker, bed.app, lock_client, children)
    assert len(lines(worker, UNGUARDED)) == 1  # once Redis is back, runs are guarded again
    bed.assert_no_overlap()


# -- 3. restarted without its data while a lock is held -----------------------------------------


@pytest.mark.slow(seconds=9)
def test_restart_without_persistence_loses_the_lock_and_says_so(
    bed: Bed, private_redis: RedisServer, lock_client: redis.Redis
) -> None:
    """A Redis that forgets: the holder's renewal finds the lock gone, lost=True, newer token."""
    worker = start_worker(bed, private_redis.url, ttl=2)
    children = set(worker.child_pids())
    first = hold(bed.app, "forget", 6.0)
    wait_for(lambda: owner_of_lock(lock_client, first.id), 10, "the lock", worker)

    private_redis.restart()  # SIGKILL, start again on the same port with nothing
    lost = wait_for(lambda: lines(worker, LOST, first.id), 10, "the loss", worker)
    assert len(lost) == 1
    assert "reason=gone" in lost[0]
    # the lock is free now: a duplicate runs (the documented weakness of a Redis that forgets)
    second = hold(bed.app, "forget", 0.3)
    second_value = get(second, worker)
    first_value = get(first, worker)
    assert first_value["lost"] is True  # the loss is reported to the body
    assert second_value["lost"] is False
    assert second_value["token"] > first_value["token"]  # a fenced write by the first loses

    runs = bed.runs("forget")
    assert [r.token for r in runs] == [first_value["token"], second_value["token"]]
    report = check_history(bed.history())
    assert report.token_regressions == []
    assert [(a.token, b.token) for a, b in report.overlaps] == [
        (first_value["token"], second_value["token"])
    ], report.summary()
    assert len(lines(worker, RENEW_FAILED)) <= 3  # the dead connection, then the new server
    assert not lines(worker, "singleton: lock was no longer ours")  # the loss was known
    assert not lines(worker, REQUEUED)
    assert_healthy(worker, bed.app, lock_client, children)


# -- 4. unreachable for a while, data kept --------------------------------------------------------


@pytest.mark.slow(seconds=9)
def test_lock_survives_a_lock_redis_stopped_for_4s(bed: Bed) -> None:
    """Renewals fail while the (persistent) lock Redis is down, then succeed: the lock stays."""
    server = RedisServer(extra_args=("--appendonly", "yes"))  # keeps its data over a restart
    lock_client = server.client(socket_timeout=10)
    try:
        worker = start_worker(bed, server.url, ttl=10)
        children = set(worker.child_pids())
        result = hold(bed.app, "unreachable", 8.0)
        key = wait_for(lambda: owner_of_lock(lock_client, result.id), 10, "the lock", worker)
        token = int(lock_client.hget(key, "token") or 0)

        server.stop()  # the first renewal is due 3.3 s after the acquire
        time.sleep(4.0)
        assert lines(worker, RENEW_FAILED), worker.log_tail(40)
        server.restart()  # same port, same data directory

        # the next renewal lands before the ttl ran out: same lock, same token
        wait_for(lambda: renewed_after_ms(lock_client, key) > 1000, 5, "a renewal")
        failed = lines(worker, RENEW_FAILED)
        assert 1 <= len(failed) <= 3, "\n".join(failed)  # one a second while down, no storm
        assert lock_client.hget(key, "owner") == result.id.encode()
        assert int(lock_client.hget(key, "token") or 0) == token
        duplicate = get(hold(bed.app, "unreachable", 0.0), worker)
        assert skip_info(duplicate) is not None
        assert skip_info(duplicate).holder == result.id  # type: ignore[union-attr]

        value = get(result, worker)
        assert value["lost"] is False
        assert value["token"] == token
        assert not lines(worker, LOST)
        assert len(lines(worker, RENEW_FAILED)) == len(failed)  # none once Redis was back
        assert not lines(worker, REQUEUED)
        assert_healthy(worker, bed.app, lock_client, children)
        bed.assert_no_overlap()
    finally:
        lock_client.close()
        server.close()


# -- 5. slow or frozen for less than the socket timeout ------------------------------------------


@pytest.mark.parametrize("stall", ["debug-sleep", "sigstop"])
@pytest.mark.slow(seconds=8)
def test_slow_lock_redis_delays_but_keeps_the_lock(stall: str, bed: Bed) -> None:
    """A 2 s stall (DEBUG SLEEP, SIGSTOP): the renewal is late, acquires wait, nothing is lost."""
    server = RedisServer(extra_args=("--enable-debug-command", "yes"))
    lock_client = server.client(socket_timeout=10)
    try:
        worker = start_worker(bed, server.url, ttl=6, concurrency=3)
        children = set(worker.child_pids())
        holder = hold(bed.app, "slow", 7.0)
        key = wait_for(lambda: owner_of_lock(lock_client, holder.id), 10, "the lock", worker)
        # the first renewal comes 2 s after the acquire; stall from 1.5 s before the next one
        wait_for(lambda: renewed_after_ms(lock_client, key) > 1000, 5, "renewal 1", worker)
        time.sleep(1.5)
        woken_after, duplicate, other = _stall(stall, server, lock_client, bed.app, seconds=2.0)

        assert skip_info(get(duplicate, worker)).holder == holder.id  # type: ignore[union-attr]
        other_value = get(other, worker)
        assert isinstance(other_value["token"], int)
        (other_run,) = bed.runs("slow-other")
        assert other_run.start_us / 1e6 >= woken_after - 0.05  # it waited for the stall

        # renewal 1 landed 2 s after the acquire; the late one 4 s or more after it
        wait_for(lambda: renewed_after_ms(lock_client, key) > 3000, 5, "the late one", worker)
        value = get(holder, worker)
        assert value["lost"] is False
        assert not lines(worker, LOST)
        assert not lines(worker, RENEW_FAILED)  # 2 s is well inside the 5 s socket timeout
        assert not lines(worker, REQUEUED)
        assert_healthy(worker, bed.app, lock_client, children)
        bed.assert_no_overlap()
    finally:
        lock_client.close()
        server.close()


def _stall(
    how: str, server: RedisServer, client: redis.Redis, app: Celery, seconds: float
) -> tuple[float, AsyncResult, AsyncResult]:
    """Stall ``server`` for ``seconds``, sending a duplicate and a run of another key meanwhile.

    Returns a time the stall cannot have ended before (epoch seconds: when the stall was asked
    for, plus ``seconds``; a test process held off the CPU reads it late, never early), the
    duplicate and the other run.
    """
    if how == "debug-sleep":
        began = 0.0

        def sleep() -> None:
            nonlocal began
            began = time.time()  # read after the join below
            client.execute_command("DEBUG", "SLEEP", seconds)

        thread = threading.Thread(target=sleep, daemon=True)
        thread.start()
        # a PING unanswered for 0.2 s: asleep, not merely slow on a loaded machine
        wait_for(lambda: server_busy(server.url, 0.2), seconds / 2, "the server asleep")
        sent = hold(app, "slow", 0.0), hold(app, "slow-other", 0.2)
        thread.join()
        return began + seconds, *sent
    server.pause()
    time.sleep(0.2)
    sent = hold(app, "slow", 0.0), hold(app, "slow-other", 0.2)
    time.sleep(seconds - 0.2)
    resumed = time.time()  # before SIGCONT: the server wakes after it
    server.resume()
    return resumed, *sent


# -- 6. authentication and TLS errors hide the password --------------------------------------


def _require_password(server: RedisServer) -> None:
    """Make the private server ask for PASSWORD (RedisServer cannot start with one: it pings)."""
    client = server.client()
    try:
        client.config_set("requirepass", PASSWORD)
    finally:
        client.close()


def test_wrong_password_is_reported_without_the_password(
    bed: Bed, private_redis: RedisServer
) -> None:
    """A wrong password: requeued with a clear auth error, the password in no log or result."""
    _require_password(private_redis)
    authed = redis.Redis.from_url(f"redis://:{PASSWORD}@127.0.0.1:{private_redis.port}/0")
    wrong_url = f"redis://:{WRONG_PASSWORD}@127.0.0.1:{private_redis.port}/0"
    right_url = f"redis://:{PASSWORD}@127.0.0.1:{private_redis.port}/0"
    try:
        wrong = bed.start(
            concurrency=1,
            env={
                "SINGLETON_TEST_LOCK_URL": wrong_url,
                "SINGLETON_TEST_RETRY_COUNTDOWN": str(COUNTDOWN),
                "SINGLETON_TEST_QUEUE": f"{bed.prefix}wrong",
            },
            ready=False,
        )
        right = bed.start(
            concurrency=1,
            env={"SINGLETON_TEST_LOCK_URL": right_url, "SINGLETON_TEST_QUEUE": f"{bed.prefix}ok"},
            ready=False,
        )
        wrong.wait_ready(bed.app)
        right.wait_ready(bed.app)
        children = set(wrong.child_pids())

        started = time.monotonic()
        refused = hold(bed.app, "auth", 0.1, queue=f"{bed.prefix}wrong")
        wait_for(lambda: len(lines(wrong, REQUEUED, refused.id)) >= 3, 15, "requeues", wrong)
        assert refused.state == "RETRY"
        error = refused.info
        assert isinstance(error, LockUnavailableError), repr(error)
        assert "invalid username-password pair" in str(error)
        requeues = lines(wrong, REQUEUED, refused.id)
        assert "invalid username-password pair" in requeues[0]
        assert len(requeues) <= (time.monotonic() - started) / COUNTDOWN + 2
        assert bed.runs("auth") == []

        # the worker itself is fine: it answers and runs tasks that need no lock
        assert wrong.is_running()
        assert set(wrong.child_pids()) == children
        record = bed.app.send_task(RECORD_TASK, queue=f"{bed.prefix}wrong")
        assert get(record, wrong)

        # with the right password everything works
        value = get(hold(bed.app, "auth-ok", 0.1, queue=f"{bed.prefix}ok"), right)
        assert isinstance(value["token"], int)
        wait_for(lambda: not lock_keys_on(authed), 5, "the lock released", right)

        for worker in (wrong, right):
            log = worker.log_text()
            assert f"redis://:***@127.0.0.1:{private_redis.port}/0" in log  # the banner
            assert PASSWORD not in log
            assert WRONG_PASSWORD not in log
        for text in (str(error), repr(error.args), str(refused.traceback)):
            assert PASSWORD not in text
            assert WRONG_PASSWORD not in text
        bed.assert_no_overlap()
    finally:
        authed.close()


@pytest.mark.parametrize("scheme", ["redis", "rediss"])
def test_auth_and_tls_errors_hide_the_password(
    private_redis: RedisServer, monkeypatch: pytest.MonkeyPatch, scheme: str
) -> None:
    """Wrong password (redis://) and TLS to a plain port (rediss://): clear error, no password."""
    _require_password(private_redis)
    monkeypatch.setattr(singleton_connection, "SOCKET_TIMEOUT_S", 1.0)  # the TLS handshake stalls
    url = f"{scheme}://user:{WRONG_PASSWORD}@127.0.0.1:{private_redis.port}/0"
    with pytest.raises(LockUnavailableError) as info:
        store_for(url).acquire(lock_keys("unit:", "t.unit", b"1"), "owner", 0, 1000)
    error = info.value
    expected = "invalid username-password pair" if scheme == "redis" else "Timeout connecting"
    assert expected in str(error)
    text = "".join(traceback.format_exception(error)) + repr(error.args)
    assert WRONG_PASSWORD not in text
    assert "could not acquire unit:" in str(error)
