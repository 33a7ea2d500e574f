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
from tests.support import zygote as zygote_module
from tests.support.basic_app import SINGLETON_APP
from tests.support.workers import REPO_ROOT, WorkerFactory
from tests.support.zygote import ForkedProcess, forkable, import_environment, zygote_for


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


def test_only_starts_a_new_interpreter_would_run_the_same_are_forked() -> None:
    celery = [sys.executable, "-m", "celery", "-A", SINGLETON_APP, "worker", "-P", "prefork"]
    assert forkable(celery, REPO_ROOT)
    # another interpreter, another command, another directory
    assert not forkable(["/usr/bin/python3", *celery[1:]], REPO_ROOT)
    assert not forkable([sys.executable, "-m", "pytest"], REPO_ROOT)
    assert not forkable(celery, REPO_ROOT / "examples")
    assert not forkable(celery, None)
    # a pool that monkeypatches before anything is imported
    for pool in ("gevent", "eventlet"):
        assert not forkable([*celery[:-1], pool], REPO_ROOT)


@pytest.fixture
def own_zygotes(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """This test's zygotes apart from the ones its xdist worker started before (those count
    against the cap), closed after it."""
    mine: dict[frozenset[tuple[str, str]], zygote_module.Zygote] = {}
    monkeypatch.setattr(zygote_module, "_ZYGOTES", mine)
    yield
    for zygote in list(mine.values()):
        zygote.close()


@pytest.mark.usefixtures("own_zygotes")
def test_each_import_environment_has_its_own_zygote() -> None:
    """The test apps' settings differ between the forks of one zygote; any other variable
    (celery.platforms reads C_FORCE_ROOT at import) gets a zygote started with it."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "SINGLETON_TEST_TTL": "3"}
    zygote = zygote_for(env)
    assert zygote is not None
    assert zygote_for({**env, "SINGLETON_TEST_TTL": "4", "PYTEST_CURRENT_TEST": "x"}) is zygote
    assert "SINGLETON_TEST_TTL" not in zygote.env
    other = zygote_for({**env, "C_FORCE_ROOT": "1"})
    assert other is not None
    assert other is not zygote
    assert other.env["C_FORCE_ROOT"] == "1"
    assert import_environment(other.env) == import_environment({**env, "C_FORCE_ROOT": "1"})


@pytest.mark.usefixtures("own_zygotes")
def test_a_dead_zygotes_children_end_and_it_is_started_again() -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "SINGLETON_TEST_ZYGOTE_CASE": "dead"}
    zygote = zygote_for(env)
    assert zygote is not None
    zygote.close()
    assert not zygote.alive()
    with pytest.raises(subprocess.TimeoutExpired):  # alive, and nobody to reap it
        ForkedProcess(zygote, os.getpid(), ["x"]).wait(0.1)
    again = zygote_for(env)
    assert again is not None
    assert again is not zygote
    assert again.alive()


@pytest.mark.usefixtures("own_zygotes")
def test_past_the_cap_a_start_is_a_new_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(zygote_module, "MAX_ZYGOTES", 1)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "SINGLETON_TEST_ZYGOTE_CASE": "cap"}
    assert zygote_for(env) is not None
    assert zygote_for({**env, "C_FORCE_ROOT": "1"}) is None
