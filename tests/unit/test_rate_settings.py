"""singleton_rate_limit and singleton_permits="unlimited" as the settings read them: the rates
Celery spells, what is refused (and says so by name), and None given on a task (the deprecated
spelling of "unlimited", tests/unit/test_renamed_settings.py) told apart from an option not
given."""

from __future__ import annotations

import time
import uuid
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery
from celery.utils.saferepr import saferepr

from celery_singleton_lock import SingletonConfigError, SingletonTask
from celery_singleton_lock.core.hotkeys import HotKeys
from celery_singleton_lock.core.keys import lock_keys
from celery_singleton_lock.core.rates import parse_rate, rate_key
from celery_singleton_lock.duplicates.skips import skip_marker
from celery_singleton_lock.settings.options import read_options
from celery_singleton_lock.worker.hooks import banner_lines
from celery_singleton_lock.worker.mainskip import learning
from celery_singleton_lock.worker.scopes import check_scopes

REDLOCK = "redis+redlock://127.0.0.1:1,127.0.0.1:2,127.0.0.1:3/0"


@pytest.mark.parametrize(
    ("given", "read"),
    [
        ("5/s", (5, 1000)),
        ("10/m", (10, 60_000)),
        (" 3 / h ", (3, 3_600_000)),
        (7, (7, 1000)),  # an int: per second, as Celery reads rate_limit
        ("10000/s", (10_000, 1000)),
    ],
)
def test_rates_as_celery_spells_them(given: Any, read: tuple[int, int]) -> None:
    assert parse_rate(given) == read
    assert read_options({"singleton_rate_limit": given}).rate_limit == read


@pytest.mark.parametrize(
    "bad", ["5/d", "5", "/s", "0/s", "-1/s", "1.5/s", "5/sec", "10001/s", 0, 2.5, True, [5, "s"]]
)
def test_a_malformed_rate_is_refused_by_name(bad: Any) -> None:
    with pytest.raises(SingletonConfigError, match=r"singleton_rate_limit.*got"):
        read_options({"singleton_rate_limit": bad})
    task = SimpleNamespace(name="t.bad", singleton_rate_limit=bad)
    with pytest.raises(SingletonConfigError, match=r"singleton_rate_limit \(task t\.bad\)"):
        read_options({}, task)


def _task(**options: Any) -> Any:
    """A task object as Celery makes one from ``@app.task(base=SingletonTask, **options)``: the
    options are attributes of its own class."""
    cls = type("Made", (SingletonTask,), {"name": "t.made", "__module__": "app.tasks", **options})
    return cls()


def test_permits_none_on_the_task_is_told_apart_from_not_given() -> None:
    conf = {"singleton_permits": 3, "singleton_rate_limit": "5/s"}
    with pytest.warns(DeprecationWarning, match="unlimited"):
        assert read_options(conf, _task(singleton_permits=None)).permits == 0  # no limit at once
    assert read_options(conf, _task()).permits == 3  # not given: the app's setting
    assert read_options({"singleton_rate_limit": "5/s"}, _task()).permits == 1  # the default
    subclass = type("Mine", (SingletonTask,), {"__module__": "app.base", "singleton_permits": None})
    made = type("Made", (subclass,), {"name": "t.sub", "__module__": "app.tasks"})()
    with pytest.warns(DeprecationWarning, match="unlimited"):
        assert read_options(conf, made).permits == 0  # a class attribute of the user's base


def test_the_keys_carry_the_rate_and_no_slot_without_a_concurrency_limit() -> None:
    task = _task(
        singleton_permits="unlimited", singleton_rate_limit="2/m", run=staticmethod(lambda x: x)
    )
    keys = task.singleton_keys((1,), {})
    assert (keys.permits, keys.rate, keys.slots) == (0, (2, 60_000), [])
    assert rate_key(keys.lock) == keys.lock[: -len(":lock")] + ":rate"  # the lock's hash tag
    with pytest.raises(ValueError, match="permits"):
        lock_keys("p:", "t", b"a").with_permits(0)  # no slot, and no rate: nothing to limit


@pytest.mark.parametrize(
    ("conf", "options", "refusal"),
    [
        (
            {},
            {"singleton_permits": "unlimited"},
            "singleton_permits .*no limit on runs at once.* needs singleton_rate_limit",
        ),
        (
            {"singleton_redis_url": REDLOCK},
            {"singleton_rate_limit": "5/s"},
            "singleton_rate_limit is not supported with a redis\\+redlock:// URL",
        ),
        (
            {},
            {"singleton_rate_limit": "5/s", "singleton_lock_on": "publish"},
            'singleton_rate_limit needs singleton_lock_on "execute"',
        ),
        (
            {},
            {
                "singleton_rate_limit": "5/s",
                "singleton_permits": "unlimited",
                "singleton_on_duplicate": "join",
            },
            "singleton_rate_limit with singleton_on_duplicate 'join' needs a limit on runs",
        ),
    ],
    ids=["none-without-rate", "redlock", "publish", "join-without-concurrency-limit"],
)
def test_what_a_rate_does_not_go_with_is_refused(
    conf: dict[str, Any], options: dict[str, Any], refusal: str
) -> None:
    with pytest.raises(SingletonConfigError, match=f"task t.made: {refusal}"):
        read_options(conf, _task(**options))


def test_a_rate_goes_with_permits_coalesce_and_join_on_one_permit() -> None:
    for options in (
        {"singleton_permits": 3},
        {"singleton_on_duplicate": "coalesce"},
        {"singleton_on_duplicate": "join"},
        {"singleton_lock_at_least": 2},
    ):
        assert read_options({}, _task(singleton_rate_limit="5/s", **options)).rate_limit


def test_celery_task_options_and_the_banner() -> None:
    """Through Celery's own decorator: ``singleton_permits="unlimited"``, the banner shows the
    rates and the tasks without a limit on runs at once."""
    app = Celery("rate-banner", set_as_current=False)
    app.conf.singleton_redis_url = "redis://127.0.0.1:6379/0"

    @app.task(
        base=SingletonTask,
        name="t.api",
        shared=False,
        singleton_permits="unlimited",
        singleton_rate_limit="5/s",
    )
    def api(customer: str) -> None: ...

    @app.task(base=SingletonTask, name="t.sync", shared=False, singleton_rate_limit="2/m")
    def sync(customer: str) -> None: ...

    @app.task(base=SingletonTask, name="t.plain", shared=False)
    def plain(customer: str) -> None: ...

    try:
        assert (api.singleton_options().permits, api.singleton_options().rate_limit) == (
            0,
            (5, 1000),
        )
        assert sync.singleton_options().permits == 1
        assert plain.singleton_options().rate_limit is None
        banner = banner_lines(app.conf, [api, sync, plain])
        assert ".> permits:         t.api=unlimited\n" in banner
        assert ".> rate_limit:      t.api=5/s, t.sync=2/m\n" in banner
        assert "rate_limit" not in banner_lines(app.conf, [plain])
    finally:
        app.close()


def test_the_tasks_of_a_scope_take_one_rate_and_none_goes_without_windows() -> None:
    """Tasks sharing a scope count their starts in one record: one rate for all, else refused
    at worker start; a task without a limit on runs at once has no lock to keep a window."""
    app = Celery("rate-scope", set_as_current=False)
    app.conf.singleton_redis_url = "redis://127.0.0.1:6379/0"
    scoped = {"base": SingletonTask, "shared": False, "singleton_scope": "tenant-api"}

    @app.task(name="t.read", singleton_rate_limit="5/s", **scoped)
    def read(tenant: str) -> None: ...

    @app.task(name="t.write", singleton_rate_limit="2/s", **scoped)
    def write(tenant: str) -> None: ...

    try:
        with pytest.raises(SingletonConfigError, match=r"same singleton_rate_limit.*t\.read 5/s"):
            check_scopes([read, write])
        with pytest.raises(SingletonConfigError, match="does not go with singleton_lock_at_least"):
            read_options(
                {},
                _task(
                    singleton_permits="unlimited",
                    singleton_rate_limit="5/s",
                    singleton_lock_at_least=1,
                ),
            )
    finally:
        app.close()


def test_a_skip_for_the_rate_makes_no_key_hot() -> None:
    """The worker's main process (solo, threads) probes the lock of a key a skip made hot: a
    skip for the rate found the key free, so it marks nothing (no probe's round trip for the
    calls after it); a duplicate's skip still does."""
    app = Celery("rate-hot", set_as_current=False)
    app.conf.singleton_redis_url = "redis://127.0.0.1:6379/0"

    @app.task(base=SingletonTask, name="t.hot", shared=False, singleton_rate_limit="1/s")
    def hot(tenant: str) -> None: ...

    hot.__dict__["_singleton_hot"] = HotKeys()
    learns = learning(lambda self, failed__retval__runtime, **kwargs: None)
    request = SimpleNamespace(task=hot, args=("acme",), kwargs={})
    key = hot.singleton_keys(("acme",), {}).lock
    try:
        ids = [str(uuid.uuid4()) for _ in range(3)]  # as long as Celery task ids
        rate = skip_marker(key, ids[0], ids[1], ids[2], time.time() + 1)
        learns(request, (False, saferepr(rate), 0.0))
        assert not hot.__dict__["_singleton_hot"].entries
        learns(request, (False, saferepr(skip_marker(key, "h", "t")), 0.0))
        assert key in hot.__dict__["_singleton_hot"].entries
    finally:
        app.close()
