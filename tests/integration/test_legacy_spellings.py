"""celery-singleton's and celery-once's option spellings behave as those libraries did, on a
real Redis (docs/migrating.md): ``once=`` without ``graceful`` raises on a duplicate, and
``lock_expiry`` / ``once["timeout"]`` bound the marker taken at publish as well as the lock."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from celery import Celery

from celery_singleton_lock import DuplicateTaskError, SingletonTask
from celery_singleton_lock.core.keys import derive_keys, queued_key
from tests.support.basic_app import close_app, make_app

NAME = "t.legacy_sync"


def _signature(tenant: str, full: bool = False) -> None:
    """The parameters of t.legacy_sync."""


@pytest.fixture
def make_task(redis_url: str, key_prefix: str) -> Iterator[Callable[..., Any]]:
    """Declares t.legacy_sync on a client app of its own with the options given (the lock
    taken at publish); purges and closes the apps after the test."""
    apps: list[Celery] = []

    def make(**options: Any) -> Any:
        app = make_app(redis_url, key_prefix)
        app.conf.singleton_redis_url = redis_url
        app.conf.singleton_key_prefix = f"{key_prefix}lock:"
        apps.append(app)

        @app.task(base=SingletonTask, name=NAME, shared=False, **options)
        def legacy_sync(tenant: str, full: bool = False) -> None:
            """Never runs: no worker consumes the queue."""

        return legacy_sync

    yield make
    for app in apps:
        app.control.purge()
        close_app(app)


def _marker(prefix: str, tenant: str) -> str:
    lock = derive_keys(f"{prefix}lock:", NAME, _signature, (tenant,), {}, ("tenant",))
    return queued_key(lock.lock)


def test_once_without_graceful_raises_as_celery_once_did(make_task: Callable[..., Any]) -> None:
    """once={"keys": [...]} with no "graceful": a duplicate delay() raises DuplicateTaskError,
    whose task_id is the refused call's and holder the queued message's."""
    task = make_task(once={"keys": ["tenant"]}, singleton_lock_on="publish")
    with pytest.warns(DeprecationWarning, match="is deprecated, use singleton_") as caught:
        first = task.delay("acme")
    assert sorted(str(w.message) for w in caught) == [
        f"task {NAME}: once['graceful'] (not given: False) is deprecated, "
        "use singleton_on_duplicate='raise'",
        f"task {NAME}: once['keys'] is deprecated, use singleton_key_args=['tenant']",
    ]
    with pytest.raises(DuplicateTaskError) as refused:
        task.delay("acme")
    assert refused.value.holder == first.id
    assert refused.value.task_id not in (None, first.id)
    assert task.delay("other").id != first.id  # another key is no duplicate


@pytest.mark.parametrize(
    "options",
    [
        {"once": {"keys": ["tenant"], "graceful": True}},
        {"once": {"keys": ["tenant"]}, "singleton_on_duplicate": "skip"},
    ],
    ids=["graceful", "new-option-wins"],
)
def test_once_graceful_or_a_policy_of_the_task_skips(
    make_task: Callable[..., Any], options: dict[str, Any]
) -> None:
    """graceful=True, or singleton_on_duplicate given on the task next to once=: a duplicate
    delay() returns the holder's AsyncResult."""
    task = make_task(singleton_lock_on="publish", **options)
    with pytest.warns(DeprecationWarning, match="is deprecated, use singleton_") as caught:
        first = task.delay("acme")
    assert not any("(not given: False)" in str(w.message) for w in caught)
    assert task.delay("acme").id == first.id


@pytest.mark.parametrize(
    "options",
    [
        {"unique_on": ["tenant"], "lock_expiry": 60},
        {"once": {"keys": ["tenant"], "timeout": 60, "graceful": True}},
    ],
    ids=["lock_expiry", "once-timeout"],
)
def test_old_expiry_bounds_the_publish_marker(
    make_task: Callable[..., Any],
    redis_client: redis.Redis,
    key_prefix: str,
    options: dict[str, Any],
) -> None:
    """lock_expiry=60 (once timeout=60) is read as singleton_ttl=60 and
    singleton_publish_ttl=60: the queued marker lives 60 s, not the default 300 s."""
    task = make_task(singleton_lock_on="publish", **options)
    with pytest.warns(DeprecationWarning, match="is deprecated, use singleton_") as caught:
        task.delay("acme")
    assert any(
        str(w.message).endswith("use singleton_ttl=60 and singleton_publish_ttl=60") for w in caught
    )
    assert task.singleton_options().ttl == 60.0
    assert 0 < redis_client.pttl(_marker(key_prefix, "acme")) <= 60_000
