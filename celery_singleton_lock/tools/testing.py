"""Helpers for testing code that uses SingletonTask (a pytest plugin, loaded automatically).

- :func:`isolated_locks`: a context manager giving an app's SingletonTasks a private key
  prefix, and deleting every key under it afterwards (SCAN, never KEYS or FLUSHDB);
- :func:`held_locks`: the lock keys held under a prefix, to assert nothing was left locked;
- the pytest fixture ``singleton_locks``: :func:`isolated_locks` around one test, for the
  app the fixture ``singleton_celery_app`` returns (override it in your ``conftest.py``;
  by default the ``celery_app`` fixture when there is one, else ``celery.current_app``).

Installed as the ``pytest11`` entry point ``celery_singleton_lock``, so the fixtures are
there in every pytest run of a project that installs this library. See docs/testing.md.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from celery import Celery, current_app

from ..core.connection import store_for
from ..settings.options import resolve_redis_url
from ..task.singleton_task import SingletonTask

__all__ = ["held_locks", "isolated_locks", "singleton_celery_app", "singleton_locks"]

#: Default start of the private prefixes (a uuid fragment follows).
PREFIX = "singleton-test:"


def _forget_options(app: Celery) -> None:
    """Make every SingletonTask of ``app`` read its settings again at its next use."""
    for task in app.tasks.values():
        if isinstance(task, SingletonTask):
            task._singleton_opts = None


def _delete_prefix(client: Any, prefix: str) -> int:
    deleted = 0
    for key in client.scan_iter(match=f"{prefix}*", count=1000):
        deleted += int(client.delete(key))
    return deleted


def held_locks(app: Celery, prefix: str) -> list[str]:
    """The lock keys (``...:lock``, and the permit slots ``...:lock:<i>`` of a task with
    ``singleton_permits`` > 1) that exist under ``prefix`` in the app's lock store."""
    client = store_for(resolve_redis_url(app.conf)).client
    keys = (
        k.decode() if isinstance(k, bytes) else str(k)
        for k in client.scan_iter(match=f"{prefix}*:lock*", count=1000)
    )
    return sorted(k for k in keys if _LOCK_KEY.search(k[len(prefix) :]))


#: the end of a lock key or of one of its permit slots (core/keys.py)
_LOCK_KEY = re.compile(r":lock(?::[0-9]+)?\Z")


@contextmanager
def isolated_locks(app: Celery, prefix: str | None = None) -> Iterator[str]:
    """Run the block with ``singleton_key_prefix`` set to a private prefix; clean up after.

    Yields the prefix. Every key under it (locks, fencing counters, queued markers, beat
    claims) is deleted when the block ends, and the previous prefix is restored.
    """
    prefix = prefix or f"{PREFIX}{uuid.uuid4().hex[:8]}:"
    previous = app.conf.get("singleton_key_prefix")
    app.conf.singleton_key_prefix = prefix
    _forget_options(app)
    try:
        yield prefix
    finally:
        app.conf.singleton_key_prefix = previous
        _forget_options(app)
        _delete_prefix(store_for(resolve_redis_url(app.conf)).client, prefix)


@pytest.fixture
def singleton_celery_app(request: pytest.FixtureRequest) -> Celery:
    """The app ``singleton_locks`` isolates: override this fixture to name yours."""
    try:
        app: Celery = request.getfixturevalue("celery_app")
    except pytest.FixtureLookupError:
        app = current_app._get_current_object()
    return app


@pytest.fixture
def singleton_locks(singleton_celery_app: Celery) -> Iterator[str]:
    """A private lock key prefix for this test; every key under it is deleted afterwards."""
    with isolated_locks(singleton_celery_app) as prefix:
        yield prefix
