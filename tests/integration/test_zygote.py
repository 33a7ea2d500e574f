"""The suite's zygote (tests/support/zygote.py): a worker forked from it is the process a new
``python -m celery worker`` would be (its own session, environment, log and exit code), and a
start it could not mirror is a new process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest
from celery import Celery

from celery_singleton_lock._dev.process import children_of
from tests.support.basic_app import SINGLETON_APP
from tests.support.workers import REPO_ROOT, WorkerFactory
from tests.support.zygote import ForkedProcess, ZygoteClient


def test_a_forked_worker_is_a_new_session_with_its_own_environment_log_and_exit_code(
    worker_factory: WorkerFactory, client_app: Celery, key_prefix: str
) -> None:
    worker = worker_factory.start(
        SINGLETON_APP, pool="prefork", concurrency=2, env={"SINGLETON_TEST_TTL": "7"}
    )
    worker.wait_ready(client_app)
    assert isinstance(worker.proc, ForkedProcess)
    assert os.getsid(worker.pid) == worker.pid
    assert os.getpgid(worker.pid) == worker.pid
    assert len(children_of(worker.pid)) >= 2  # the pool's children, forked by the worker
    log = worker.log_text()  # the app read the environment of its start at import
    assert f".> prefix:          {key_prefix}lock:" in log
    assert ".> ttl:             7s" in log
    assert f"{worker.nodename} ready." in log
    assert worker.returncode is None

    worker.signal(signal.SIGTERM)  # a warm shutdown, as a new process's
    assert worker.wait(30) == 0
    assert "worker: Warm shutdown" in worker.log_text()


def test_a_worker_that_refuses_to_start_exits_non_zero(worker_factory: WorkerFactory) -> None:
    bad = worker_factory.start(SINGLETON_APP, env={"SINGLETON_TEST_BAD_POLICY": "bogus"})
    assert isinstance(bad.proc, ForkedProcess)
    assert bad.wait(30) == 1
    assert "celery_singleton_lock: invalid setting" in bad.log_text()


def test_a_killed_worker_reports_the_signal(
    worker_factory: WorkerFactory, client_app: Celery
) -> None:
    worker = worker_factory.start(SINGLETON_APP, pool="solo", concurrency=1)
    worker.wait_ready(client_app)
    worker.kill()
    assert worker.returncode == -signal.SIGKILL


@pytest.fixture(scope="module")
def client() -> Iterator[ZygoteClient]:
    made = ZygoteClient()
    yield made
    made.close()


def test_only_starts_a_new_interpreter_would_run_the_same_are_forked(client: ZygoteClient) -> None:
    celery = [sys.executable, "-m", "celery", "-A", SINGLETON_APP, "worker", "-P", "prefork"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    assert client.can_fork(celery, env, REPO_ROOT)
    assert client.can_fork(celery, {**env, "SINGLETON_TEST_TTL": "3"}, REPO_ROOT)
    # another interpreter, another command, another directory
    assert not client.can_fork(["/usr/bin/python3", *celery[1:]], env, REPO_ROOT)
    assert not client.can_fork([sys.executable, "-m", "pytest"], env, REPO_ROOT)
    assert not client.can_fork(celery, env, REPO_ROOT / "examples")
    # a pool that monkeypatches before anything is imported
    for pool in ("gevent", "eventlet"):
        assert not client.can_fork([*celery[:-1], pool], env, REPO_ROOT)
    # a variable something may read at import time (celery.platforms reads C_FORCE_ROOT)
    for key, value in (("C_FORCE_ROOT", "1"), ("PYTHONPATH", "/tmp"), ("CELERY_BROKER_URL", "x")):
        assert not client.can_fork(celery, {**env, key: value}, REPO_ROOT)
    assert not client.can_fork(celery, {k: v for k, v in env.items() if k != "PATH"}, REPO_ROOT)


def test_a_fork_after_the_zygote_died_is_refused() -> None:
    zygote = ZygoteClient()
    zygote.close()
    celery = [sys.executable, "-m", "celery", "-A", SINGLETON_APP, "worker"]
    assert not zygote.can_fork(celery, {**os.environ, "PYTHONUNBUFFERED": "1"}, REPO_ROOT)
    with pytest.raises(subprocess.TimeoutExpired):
        ForkedProcess(zygote, os.getpid(), celery).wait(0.1)  # alive, and nobody to reap it
