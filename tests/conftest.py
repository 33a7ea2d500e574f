"""Shared fixtures: a Redis to test against, private key prefixes, private servers, workers,
beats and the client side of the test apps.

The shared Redis (127.0.0.1:6379, or ``SINGLETON_TEST_REDIS_URL``) is used by others at the same
time: tests only touch keys under their ``key_prefix`` and never run server-wide commands on it.
Anything destructive (kill, restart, pause) uses ``private_redis``.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from hypothesis import settings

from celery_singleton_lock.core import connection

# The helpers of tests/support assert as the tests do (the checks a test module runs through
# every topology, the bed's): pytest rewrites their asserts as a test module's, so a failure
# shows the values compared. Registered before the first of them is imported, just below.
pytest.register_assert_rewrite("tests.support")

from tests.support.basic_app import close_app, make_app  # noqa: E402
from tests.support.beats import BeatFactory  # noqa: E402
from tests.support.bed import Bed  # noqa: E402
from tests.support.django_db import release_database, use_database  # noqa: E402
from tests.support.prefixes import private_prefix  # noqa: E402
from tests.support.recording_schedulers import close_made  # noqa: E402
from tests.support.scheduling import ModuleAffineScheduling, longest_first  # noqa: E402
from tests.support.servers import RedisServer, shared_redis_url  # noqa: E402
from tests.support.topologies import sentinels_and_cluster  # noqa: E402
from tests.support.workers import WorkerFactory  # noqa: E402

# CI runs property tests with a fixed seed, so a run is repeatable; locally they explore.
settings.register_profile("ci", derandomize=True, database=None)
if os.environ.get("CI"):
    settings.load_profile("ci")

# tests/support holds helpers, not tests: none of its modules is collected
collect_ignore_glob = ["support/*"]


@pytest.hookimpl(trylast=True)  # after pytest's own grouping by fixture
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests marked ``slow(seconds=N)`` first, longest first (see tests/support/scheduling.py)."""
    items[:] = longest_first(items)


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, absent with -p no:xdist
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist load`` (the suite's own) keeps a module's tests on one worker where it can
    (tests/support/scheduling.py :class:`ModuleAffineScheduling`); other modes as xdist has them."""
    if config.getoption("dist") == "load":
        return ModuleAffineScheduling(config, log)
    return None


def pytest_collection_finish(session: pytest.Session) -> None:
    """Freeze what the collection made (every imported module, Celery, Django, hypothesis, the
    test items): the collector then leaves it alone, and each test's ``gc.collect()`` below
    only scans what was made since. Without it each one walked every object of the process:
    0.07 s on a quiet machine, 0.27 s (median) in the parallel suite, 1000+ times."""
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
def collect_garbage_after_the_test() -> Iterator[None]:
    """Collect the test's garbage in its own teardown, so a socket it left unclosed fails it
    (a ResourceWarning, an error under ``filterwarnings = error``), and not whichever later test
    the collector happens to run in."""
    yield
    gc.collect()


@pytest.fixture(autouse=True)
def close_the_schedulers_made() -> Iterator[None]:
    """The Redis clients of the schedulers a test made in this process, closed after it (before
    the garbage is collected above: set up after it, torn down before)."""
    yield
    close_made()


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """URL of the shared Redis if it answers, else of one private server for the session."""
    url = shared_redis_url()
    if url is not None:
        yield url
        return
    with RedisServer() as server:
        yield server.url


@pytest.fixture(scope="module")
def module_prefix(redis_url: str) -> Iterator[str]:
    """A ``key_prefix`` shared by a module's tests (one worker set for all of them)."""
    with private_prefix(redis_url) as prefix:
        yield prefix


@pytest.fixture
def key_prefix(redis_url: str) -> Iterator[str]:
    """A unique ``cslt:<uuid8>:`` prefix; every key under it is deleted at teardown."""
    with private_prefix(redis_url) as prefix:
        yield prefix


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    """A redis-py client for ``redis_url`` (only touch keys under ``key_prefix``)."""
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture
def private_redis() -> Iterator[RedisServer]:
    """A fresh private server on a free port, free to kill, pause or restart; stopped after."""
    server = RedisServer()
    yield server
    server.close()


@pytest.fixture
def worker_factory(tmp_path: Path, redis_url: str, key_prefix: str) -> Iterator[WorkerFactory]:
    """Starts real worker processes; every one is SIGKILLed, with its children, at teardown.

    Workers get ``SINGLETON_TEST_REDIS_URL`` and ``SINGLETON_TEST_PREFIX`` (``key_prefix``) by
    default; depending on ``key_prefix`` also makes the key cleanup run after the workers died.
    """
    factory = WorkerFactory(
        tmp_path,
        base_env={"SINGLETON_TEST_REDIS_URL": redis_url, "SINGLETON_TEST_PREFIX": key_prefix},
    )
    yield factory
    factory.close()


@pytest.fixture
def bed(tmp_path: Path, redis_url: str, key_prefix: str) -> Iterator[Bed]:
    """A test bed on ``key_prefix`` (tests/support/bed.py), no worker started yet: the test
    starts the workers it needs; every one is SIGKILLed at teardown, after their log tails were
    printed (pytest shows them for failed tests only). A module whose tests share workers
    defines a module-scoped ``bed`` of its own, on ``module_prefix``."""
    with Bed(redis_url, key_prefix, tmp_path / "bed") as made:
        yield made


@pytest.fixture
def beat_factory(tmp_path: Path, redis_url: str, key_prefix: str) -> Iterator[BeatFactory]:
    """Starts beats (of beat_app by default) on ``key_prefix``; all SIGKILLed at teardown.

    Beats get ``SINGLETON_TEST_ROLE=beat`` (beat_app then leaves ``b.remote`` unregistered).
    """
    factory = BeatFactory(
        tmp_path / "beats",
        base_env={
            "SINGLETON_TEST_REDIS_URL": redis_url,
            "SINGLETON_TEST_PREFIX": key_prefix,
            "SINGLETON_TEST_ROLE": "beat",
        },
    )
    yield factory
    factory.close()


@pytest.fixture
def client_app(redis_url: str, key_prefix: str) -> Iterator[Celery]:
    """The client side of the worker and beat apps: same broker, backend and private prefix."""
    app = make_app(redis_url, key_prefix)
    yield app
    close_app(app)


@pytest.fixture
def forget_stores() -> Iterator[None]:
    """Forget this process's lock stores and renewers before and after the test."""
    connection.reset()
    yield
    connection.reset()


@pytest.fixture
def django_database(tmp_path: Path) -> Iterator[Path]:
    """A fresh migrated SQLite database of the example Django project (examples/django_beat),
    this process's ORM on it (tests/support/django_db.py)."""
    path = use_database(tmp_path / "db.sqlite3")
    yield path
    release_database()


@pytest.fixture(scope="module")
def lock_urls() -> Iterator[dict[str, str]]:
    """A Sentinel set, a Cluster and three Redlock masters, private; their lock URLs."""
    with sentinels_and_cluster() as (sentinels, cluster):
        masters = [RedisServer() for _ in range(3)]
        try:
            hosts = ",".join(f"127.0.0.1:{m.port}" for m in masters)
            yield {
                "sentinel": sentinels.url(),
                "cluster": cluster.url,
                "redlock": f"redis+redlock://{hosts}/0",
            }
        finally:
            for master in masters:
                master.close()
