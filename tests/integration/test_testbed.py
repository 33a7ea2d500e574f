"""Self-test of the test bed: real workers, private prefixes, history, processes, servers."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import redis
from celery import Celery

from tests.support.basic_app import BASIC_APP, RECORD_TASK, close_app, history_key, make_app
from tests.support.history import (
    assert_no_overlap,
    check_history,
    load_history,
    record_end,
    record_start,
)
from tests.support.servers import RedisServer, find_server_binary, ping
from tests.support.workers import WorkerFactory, is_alive


@dataclass
class Testbed:
    """The test-side app and the env that points a worker at the same private space."""

    __test__ = False

    app: Celery
    env: dict[str, str]
    queue: str
    history_key: str


@pytest.fixture
def testbed(redis_url: str, key_prefix: str) -> Iterator[Testbed]:
    """The self-test app on a private prefix and queue."""
    queue = f"q-{key_prefix.split(':')[1]}"
    app = make_app(redis_url, key_prefix, queue)
    env = {"SINGLETON_TEST_QUEUE": queue}
    yield Testbed(app=app, env=env, queue=queue, history_key=history_key(key_prefix))
    close_app(app)


def test_solo_and_prefork_workers_run_recorded_tasks(
    testbed: Testbed, worker_factory: WorkerFactory, redis_client: redis.Redis, key_prefix: str
) -> None:
    """A solo and a prefork worker run 6 record tasks; the history holds 6 finished runs."""
    solo = worker_factory.start(BASIC_APP, pool="solo", concurrency=1, env=testbed.env)
    prefork = worker_factory.start(BASIC_APP, pool="prefork", concurrency=2, env=testbed.env)
    solo.wait_ready(testbed.app)
    prefork.wait_ready(testbed.app)
    assert len(prefork.child_pids()) == 2

    results = [
        testbed.app.send_task(RECORD_TASK, args=(0.2,), kwargs={"key": f"k{i}"}) for i in range(6)
    ]
    try:
        exec_ids = [r.get(timeout=60) for r in results]
    except Exception:
        print(worker_factory.logs())
        raise
    for r in results:
        r.forget()

    executions = load_history(redis_client, testbed.history_key)
    assert sorted(e.exec_id for e in executions) == sorted(exec_ids)
    report = check_history(executions)
    assert len(report.finished()) == 6
    assert not report.unfinished
    assert_no_overlap(report)
    assert {e.worker for e in executions} <= {solo.nodename, prefork.nodename}
    # every key the test bed created lives under the private prefix
    assert redis_client.exists(testbed.history_key)
    assert not redis_client.exists(testbed.queue)  # the queue itself is prefixed too


def test_kill_leaves_no_process_of_the_worker_group(
    testbed: Testbed, worker_factory: WorkerFactory
) -> None:
    """kill() SIGKILLs a prefork worker with its pool: nothing of its process group survives."""
    worker = worker_factory.start(BASIC_APP, pool="prefork", concurrency=2, env=testbed.env)
    worker.wait_ready(testbed.app)
    children = worker.child_pids()
    assert len(children) == 2
    members = worker.group_pids()
    assert worker.pid in members
    assert set(children) <= set(members)

    worker.kill()

    assert not worker.is_running()
    assert worker.returncode == -9
    assert worker.group_pids() == []
    assert not [pid for pid in [worker.pid, *children, *members] if is_alive(pid)]


def test_terminate_is_a_warm_shutdown(testbed: Testbed, worker_factory: WorkerFactory) -> None:
    """terminate() (SIGTERM) lets a solo worker exit on its own with status 0."""
    worker = worker_factory.start(BASIC_APP, pool="solo", concurrency=1, env=testbed.env)
    worker.wait_ready(testbed.app)
    assert worker.terminate(timeout=30) == 0
    assert worker.group_pids() == []
    assert f"{worker.nodename} ready" in worker.log_text()


def test_redis_server_start_kill_restart_pause() -> None:
    """A private server starts, dies on kill(), restarts empty on its port, pauses and resumes."""
    assert os.access(find_server_binary(), os.X_OK)
    with RedisServer() as server:
        port, url = server.port, server.url
        assert url == f"redis://127.0.0.1:{port}/0"
        client = server.client(socket_timeout=0.5, socket_connect_timeout=0.5)
        try:
            client.set("k", "v")
            assert client.get("k") == b"v"

            server.kill()
            assert not server.is_running()
            assert not ping(url, timeout=0.3)

            server.restart()
            assert server.port == port
            assert ping(url)
            assert client.get("k") is None  # no persistence

            server.pause()
            assert not ping(url, timeout=0.3)
            server.resume()
            assert ping(url, timeout=2)
        finally:
            client.close()
        pid = server.pid
    assert pid is not None
    assert not is_alive(pid)
    assert not ping(url, timeout=0.3)


def test_history_round_trip_on_server_clock(redis_client: redis.Redis, key_prefix: str) -> None:
    """record_start/record_end write server-clock events that load_history folds back."""
    hkey = f"{key_prefix}history"
    first = record_start(redis_client, hkey, "k", 1, "w@h", os.getpid())
    record_end(redis_client, hkey, first)
    second = record_start(redis_client, hkey, "k", 2, "w@h", os.getpid())
    executions = load_history(redis_client, hkey)
    assert [e.exec_id for e in executions] == [first, second]
    assert executions[0].end_us is not None
    assert executions[0].start_us <= executions[0].end_us <= executions[1].start_us
    report = check_history(executions)
    assert report.unfinished == [executions[1]]
    assert_no_overlap(report)
