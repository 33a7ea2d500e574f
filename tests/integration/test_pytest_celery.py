"""The pytest plugin beside pytest-celery, in one pytest run of a user's project.

pytest-celery's plugin (entry point ``celery``) re-exports ``celery.contrib.pytest``'s fixtures
(``celery_app``, ``celery_config``, ``celery_session_app``, ``celery_session_worker``...) and
shadows ``celery_worker`` with its Docker one. This suite switches it off (``-p no:celery`` in
pyproject.toml), so the check is a pytest run of its own: a small project written into a
temporary directory, both plugins loaded through their entry points, its tests asking for
both plugins' fixtures. It needs no Docker (none runs here): its worker is
``celery_session_worker``, Celery's in-thread worker.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.support.documented import documented_python
from tests.support.workers import REPO_ROOT

pytest.importorskip("pytest_celery", reason="pytest-celery is in the test extra")

CONFTEST = '''
import os
import time

import celery.contrib.testing.tasks  # noqa: F401  (celery.ping, for start_worker's check)
import pytest
from celery import shared_task

from celery_singleton_lock import SingletonTask

URL = os.environ["PROJECT_REDIS_URL"]
PREFIX = os.environ["PROJECT_PREFIX"]


@pytest.fixture(scope="session")
def celery_config():
    return {
        "broker_url": URL,
        "result_backend": URL,
        "broker_transport_options": {"global_keyprefix": PREFIX},
        "result_backend_transport_options": {"global_keyprefix": PREFIX},
        "task_default_queue": f"{PREFIX}queue",
        "result_expires": 60,
        "singleton_redis_url": URL,
    }


@pytest.fixture(scope="session")
def celery_worker_pool():
    return "threads"


@pytest.fixture(scope="session")
def celery_worker_parameters():
    # no ping check: start_worker sends celery.ping through the current app, which the worker's
    # thread may not have made current yet (a race: "No result backend is configured"); the
    # test's own first call, through this app, waits for the worker instead
    return {"concurrency": 2, "perform_ping_check": False}


@shared_task(base=SingletonTask, bind=True, name="project.hold", singleton_on_duplicate="skip")
def hold(self, key, gate):
    """Holds the lock until the Redis key ``gate`` exists."""
    client = self.app.backend.client
    while not client.exists(gate):
        time.sleep(0.02)
    return self.singleton.fencing_token
'''

TEST_EAGER = """
import importlib
import threading
import time
import uuid

import pytest

from celery_singleton_lock import skip_info
from celery_singleton_lock.testing import held_locks

OURS = "celery_singleton_lock.tools.testing"


def test_both_plugins_are_loaded_and_no_fixture_is_defined_twice(request):
    plugins = request.config.pluginmanager
    assert plugins.has_plugin("celery"), "pytest-celery's plugin"
    assert plugins.has_plugin("celery_singleton_lock")
    manager = request._fixturemanager
    for name in ("singleton_locks", "singleton_celery_app"):
        found = manager.getfixturedefs(name, request.node)
        assert [d.func.__module__ for d in found] == [OURS], name
    theirs = manager.getfixturedefs("celery_worker", request.node)
    assert theirs[-1].func.__module__.startswith("pytest_celery"), "the Docker one wins"

    def fixtures_of(module):
        return {
            name
            for name in dir(module)
            if not name.startswith("_") and manager.getfixturedefs(name, request.node)
        }

    mine = fixtures_of(importlib.import_module(OURS))
    assert mine == {"singleton_locks", "singleton_celery_app"}
    theirs = fixtures_of(importlib.import_module("pytest_celery.plugin"))
    assert {"celery_app", "celery_config", "celery_session_worker", "celery_setup"} <= theirs
    assert not mine & theirs


@pytest.mark.celery(task_always_eager=True)
def test_the_re_exported_celery_app_is_isolated_and_a_duplicate_skipped(
    celery_app, singleton_celery_app, singleton_locks
):
    assert singleton_celery_app is celery_app
    assert celery_app.conf.singleton_key_prefix == singleton_locks
    hold = celery_app.tasks["project.hold"]
    gate = f"{singleton_locks}gate"
    first_id = str(uuid.uuid4())
    runs = []
    first = threading.Thread(target=lambda: runs.append(hold.apply(("k", gate), task_id=first_id)))
    first.start()
    deadline = time.monotonic() + 30
    while not held_locks(celery_app, singleton_locks):
        assert time.monotonic() < deadline, "the first run never took its lock"
        time.sleep(0.02)
    second = hold.delay("k", gate)
    assert skip_info(second).holder == first_id
    celery_app.backend.client.set(gate, 1)
    first.join(30)
    assert isinstance(runs[0].get(), int)
    assert skip_info(runs[0]) is None
    assert held_locks(celery_app, singleton_locks) == []
"""

TEST_WORKER = """
import time
import uuid

import pytest

from celery_singleton_lock import skip_info
from celery_singleton_lock.testing import held_locks


@pytest.fixture
def singleton_celery_app(celery_session_app):
    return celery_session_app


def test_a_duplicate_on_the_session_worker_is_skipped(
    celery_session_worker, singleton_celery_app, singleton_locks
):
    app = singleton_celery_app
    hold = app.tasks["project.hold"]
    gate = f"{singleton_locks}gate:{uuid.uuid4().hex}"
    first = hold.delay("k", gate)
    deadline = time.monotonic() + 30
    while not held_locks(app, singleton_locks):
        assert time.monotonic() < deadline, "the first run never took its lock"
        time.sleep(0.02)
    second = hold.delay("k", gate)
    info = skip_info(second.get(timeout=30))
    assert info is not None and info.holder == first.id
    app.backend.client.set(gate, 1)
    assert isinstance(first.get(timeout=30), int)
    while held_locks(app, singleton_locks):
        assert time.monotonic() < deadline, "the first run left its lock"
        time.sleep(0.02)
"""

#: the Redis URL line of docs/testing.md's example, which the run points at the test's Redis
DOCUMENTED_URL = 'REDIS_URL = "redis://localhost:6379/0"'


def documented_test(redis_url: str) -> str:
    """docs/testing.md's pytest-celery example as written, its Redis the test's."""
    text = documented_python("testing.md", "## With pytest-celery")
    assert DOCUMENTED_URL in text
    return text.replace(DOCUMENTED_URL, f"REDIS_URL = {redis_url!r}")


#: A project's own ini file (this repository's pyproject.toml must not apply). Not
#: ``filterwarnings = error``: Celery's in-thread worker then never answers its start-up ping
#: (measured with Celery 5.7, without this library too).
PYTEST_INI = """
[pytest]
"""


@pytest.mark.slow(seconds=8)
def test_our_plugin_and_pytest_celery_in_one_run(
    tmp_path: Path, redis_url: str, key_prefix: str
) -> None:
    """A project's pytest run with both plugins: our fixtures are defined once, on
    ``celery.contrib.pytest``'s ``celery_app`` (eager) and ``celery_session_app`` (its
    in-thread worker) a duplicate is skipped, and no lock is left behind; docs/testing.md's
    example runs as written."""
    project = tmp_path / "project"
    project.mkdir()
    for name, text in (
        ("conftest.py", CONFTEST),
        ("test_eager.py", TEST_EAGER),
        ("test_worker.py", TEST_WORKER),
        ("test_documented.py", documented_test(redis_url)),
        ("pytest.ini", PYTEST_INI),
    ):
        (project / name).write_text(textwrap.dedent(text), encoding="utf-8")
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("PYTEST_ADDOPTS", "PYTEST_PLUGINS", "PYTEST_DISABLE_PLUGIN_AUTOLOAD")
    }
    env |= {
        "PROJECT_REDIS_URL": redis_url,
        "PROJECT_PREFIX": key_prefix,
        "PYTHONPATH": str(REPO_ROOT),
    }
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist", "-q"],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "4 passed" in run.stdout, run.stdout
