"""celery-singleton's and celery-once's option spellings, and the lock_on/publish_ttl settings."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
from celery import Celery

from celery_singleton_lock import SingletonConfigError, SingletonTask
from celery_singleton_lock.settings.options import describe, read_options
from celery_singleton_lock.worker.hooks import _check_and_announce
from tests.support.documented import documented_python


class _Task:
    """A stand-in task: only the attributes read_options looks at."""

    name = "t.legacy"

    def __init__(self, **attrs: Any) -> None:
        for key, value in attrs.items():
            setattr(self, key, value)


def test_celery_singleton_spellings_map_with_warnings() -> None:
    """unique_on, lock_expiry and raise_on_duplicate become key_args, ttl and publish_ttl (the
    expiry bounded celery-singleton's publish-time lock), and on_duplicate."""
    task = _Task(unique_on=["account_id"], lock_expiry=60, raise_on_duplicate=True)
    with pytest.warns(DeprecationWarning, match="is deprecated, use singleton_") as caught:
        opts = read_options({}, task)
    assert (opts.key_args, opts.ttl, opts.publish_ttl, opts.on_duplicate) == (
        ("account_id",),
        60.0,
        60.0,
        "raise",
    )
    messages = sorted(str(w.message) for w in caught)
    assert messages == [
        "task t.legacy: lock_expiry is deprecated, use singleton_ttl=60 and "
        "singleton_publish_ttl=60",
        "task t.legacy: raise_on_duplicate is deprecated, use singleton_on_duplicate='raise'",
        "task t.legacy: unique_on is deprecated, use singleton_key_args=['account_id']",
    ]


@pytest.mark.parametrize(("graceful", "policy"), [(True, "skip"), (False, "raise")])
def test_celery_once_spelling_maps_with_warnings(graceful: bool, policy: str) -> None:
    """once={"keys", "timeout", "graceful"} becomes key_args, ttl and publish_ttl, and
    on_duplicate."""
    task = _Task(once={"keys": ["a", "b"], "timeout": 90, "graceful": graceful})
    with pytest.warns(DeprecationWarning, match="is deprecated, use singleton_") as caught:
        opts = read_options({}, task)
    assert len(caught) == 3
    assert (opts.key_args, opts.ttl, opts.publish_ttl, opts.on_duplicate) == (
        ("a", "b"),
        90.0,
        90.0,
        policy,
    )


@pytest.mark.parametrize(
    ("attrs", "policy"),
    [
        ({}, "raise"),  # celery-once's default
        ({"singleton_on_duplicate": "skip"}, "skip"),  # the task's own policy wins
        ({"raise_on_duplicate": False}, "skip"),
    ],
)
def test_once_without_graceful_raises(attrs: dict[str, Any], policy: str) -> None:
    """once= without "graceful" reads as celery-once's default, graceful=False: "raise",
    over the app-wide policy, unless the task gives a policy of its own."""
    task = _Task(once={"keys": ["a"]}, **attrs)
    with pytest.warns(DeprecationWarning, match="is deprecated, use singleton_") as caught:
        opts = read_options({"singleton_on_duplicate": "skip"}, task)
    assert opts.on_duplicate == policy
    implied = [str(w.message) for w in caught if "not given" in str(w.message)]
    assert implied == (
        [
            "task t.legacy: once['graceful'] (not given: False) is deprecated, "
            "use singleton_on_duplicate='raise'"
        ]
        if policy == "raise"
        else []
    )


def test_legacy_option_on_a_real_task_warns_at_first_use() -> None:
    """@app.task(base=SingletonTask, unique_on=...) reads it when its options are first used."""
    app = Celery("compat", set_as_current=False)

    @app.task(bind=True, base=SingletonTask, shared=False, unique_on="x")
    def legacy(self: Any, x: int, y: int = 0) -> None:
        """A task declared the celery-singleton way."""

    with pytest.warns(DeprecationWarning, match=r"use singleton_key_args='x'"):
        assert legacy.singleton_options().key_args == ("x",)


@pytest.mark.parametrize(
    ("attrs", "match"),
    [
        ({"once": {"keys": ["a"], "unlock_before_run": True}}, "unlock_before_run"),
        ({"once": ["a"]}, "must be a dict"),
        ({"raise_on_duplicate": "yes"}, "True or False"),
        ({"once": {"timeout": 5}, "lock_expiry": 6}, "keep one"),
        ({"unique_on": ["a"], "singleton_key_args": ("a",)}, "keep the new one"),
        ({"lock_expiry": 60, "singleton_publish_ttl": 30}, "keep the new one"),
    ],
)
def test_bad_legacy_options_are_rejected(attrs: dict[str, Any], match: str) -> None:
    """Unknown once keys, bad values and old+new together raise SingletonConfigError."""
    task = _Task(**attrs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # some warn before the error
        with pytest.raises(SingletonConfigError, match=match):
            read_options({}, task)


def test_lock_on_setting_is_checked_and_shown() -> None:
    """lock_on takes execute or publish; publish_ttl must be > 0; the banner shows them."""
    opts = read_options({"singleton_lock_on": "publish", "singleton_publish_ttl": 30})
    assert (opts.lock_on, opts.publish_ttl) == ("publish", 30.0)
    assert read_options({}).lock_on == "execute"
    assert describe(opts)["lock_on"] == "publish"
    assert describe(opts)["publish_ttl"] == "30s"
    with pytest.raises(SingletonConfigError, match="singleton_lock_on"):
        read_options({"singleton_lock_on": "queue"})
    with pytest.raises(SingletonConfigError, match="singleton_publish_ttl"):
        read_options({}, _Task(singleton_publish_ttl=0))


def test_worker_start_logs_old_spellings(caplog: pytest.LogCaptureFixture) -> None:
    """A worker logs each old option spelling at start (Python hides DeprecationWarnings)."""
    app = Celery("compat", set_as_current=False)

    @app.task(bind=True, base=SingletonTask, shared=False, name="t.old", lock_expiry=60)
    def old(self: Any, x: int) -> None:
        """A task declared the celery-singleton way."""

    class Worker:
        def __init__(self) -> None:
            self.app = app

        def extra_info(self) -> str:
            return ""

    worker = Worker()
    _check_and_announce(instance=worker)
    assert (
        "singleton: deprecated option: task t.old: lock_expiry is deprecated, use "
        "singleton_ttl=60 and singleton_publish_ttl=60" in caplog.text
    )
    assert "lock_on:" in worker.extra_info()


def test_locks_of_a_rabbitmq_app_follow_the_documented_setting() -> None:
    """A RabbitMQ broker and a Redis result backend: the locks go to localhost (celery-singleton
    used the backend's Redis) until singleton_redis_url names it, as docs/migrating.md shows."""
    app = Celery("compat", broker="amqp://guest@rabbit//", set_as_current=False)
    app.conf.result_backend = "redis://backend:6379/2"
    assert read_options(app.conf).redis_url == "redis://localhost:6379/0"
    exec(documented_python("migrating.md", "## Where the locks live"), {"app": app})
    assert read_options(app.conf).redis_url == "redis://cache.internal:6379/2"


@pytest.mark.parametrize("lock_url", [None, "redis://backend:6379/2"])
def test_worker_start_warns_when_the_locks_default_to_localhost(
    caplog: pytest.LogCaptureFixture, lock_url: str | None
) -> None:
    """A non-Redis broker and no singleton_redis_url: the worker says at start where its locks
    are (celery-singleton would have used the Redis result backend); none when it is set."""
    app = Celery("compat", broker="amqp://guest@rabbit//", set_as_current=False)
    app.conf.result_backend = "redis://backend:6379/2"
    app.conf.singleton_redis_url = lock_url

    @app.task(base=SingletonTask, shared=False, name="t.amqp")
    def amqp_task(x: int) -> None:
        """A task of an app whose broker is RabbitMQ."""

    class Worker:
        def __init__(self) -> None:
            self.app = app

        def extra_info(self) -> str:
            return ""

    _check_and_announce(instance=Worker())
    warned = [r.getMessage() for r in caplog.records if "locks on the default" in r.getMessage()]
    expected = (
        "singleton: locks on the default redis://localhost:6379/0: the broker is not Redis "
        "and singleton_redis_url is not set"
    )
    assert warned == ([expected] if lock_url is None else [])
