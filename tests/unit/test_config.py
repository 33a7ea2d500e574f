"""The settings table: defaults, task overrides, namespaced config, checks and URL redaction."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery

from celery_singleton_lock import SingletonConfigError, SingletonTask
from celery_singleton_lock.core.urls import redact_url
from celery_singleton_lock.settings.broker import visibility_timeout as broker_visibility
from celery_singleton_lock.settings.options import (
    Options,
    describe,
    read_beat_options,
    read_options,
    resolve_redis_url,
)
from celery_singleton_lock.settings.table import DEFAULT_REDIS_URL, SETTINGS, Setting
from celery_singleton_lock.worker.hooks import banner_lines


def _app(**conf: Any) -> Celery:
    app = Celery("tests.unit.test_config", set_as_current=False)
    app.conf.update(conf)
    return app


# -- defaults ---------------------------------------------------------------------------------


def test_defaults_from_an_empty_conf() -> None:
    """An empty conf gives every documented default."""
    opts = read_options({})
    assert opts == Options(
        redis_url=DEFAULT_REDIS_URL,
        key_prefix="singleton:",
        on_duplicate="skip",
        on_redis_error="fail",
        key_args=None,
        key=None,
        ttl=30.0,
        retry_countdown=5.0,
        max_hold=None,
    )
    assert opts.ttl_ms == 30_000
    assert DEFAULT_REDIS_URL == "redis://localhost:6379/0"


def test_defaults_from_a_fresh_celery_app() -> None:
    """A fresh Celery app (amqp broker by default) gives the same defaults."""
    opts = read_options(_app().conf)
    assert opts.redis_url == DEFAULT_REDIS_URL
    assert (opts.on_duplicate, opts.ttl, opts.retry_countdown) == ("skip", 30.0, 5.0)
    assert opts.key_prefix == "singleton:"
    assert opts.max_hold is None


def test_settings_table_conf_keys() -> None:
    """Every setting is read from ``singleton_<name>``; redis_url and key_prefix are app-wide."""
    assert all(s.conf_key == f"singleton_{name}" for name, s in SETTINGS.items())
    task_settings = {"on_duplicate", "key_args", "key", "ttl", "retry_countdown", "max_hold"}
    assert {"redis_url", "key_prefix", *task_settings} <= set(SETTINGS)
    assert not SETTINGS["redis_url"].task_option
    assert not SETTINGS["key_prefix"].task_option
    assert all(SETTINGS[name].task_option for name in task_settings)


def test_app_conf_values_are_read() -> None:
    """App-wide ``singleton_*`` values replace the defaults."""
    conf = {
        "singleton_ttl": 12,
        "singleton_on_duplicate": "raise",
        "singleton_retry_countdown": 0,
        "singleton_max_hold": 60,
        "singleton_key_prefix": "app:",
        "singleton_key_args": "account_id",
        "singleton_redis_url": "redis://locks:6379/3",
    }
    opts = read_options(conf)
    assert opts.ttl == 12.0
    assert opts.ttl_ms == 12_000
    assert opts.on_duplicate == "raise"
    assert opts.retry_countdown == 0.0
    assert opts.max_hold == 60.0
    assert opts.key_prefix == "app:"
    assert opts.key_args == ("account_id",)  # a single name is accepted
    assert opts.redis_url == "redis://locks:6379/3"


def test_ttl_ms_never_zero() -> None:
    """A tiny ttl still gives at least one millisecond."""
    assert read_options({"singleton_ttl": 0.0001}).ttl_ms == 1
    assert read_options({"singleton_ttl": 1.5}).ttl_ms == 1500


# -- task overrides ---------------------------------------------------------------------------


def test_task_attributes_override_app_conf() -> None:
    """A task's ``singleton_*`` attributes win over app conf; unset ones fall back to it."""
    conf = {"singleton_ttl": 12, "singleton_on_duplicate": "raise", "singleton_max_hold": 9}
    task = SimpleNamespace(
        name="t.x", singleton_ttl=3, singleton_on_duplicate="retry", singleton_key_args=["a"]
    )
    opts = read_options(conf, task)
    assert opts.ttl == 3.0
    assert opts.on_duplicate == "retry"
    assert opts.key_args == ("a",)
    assert opts.max_hold == 9.0  # not set on the task: app conf
    assert opts.retry_countdown == 5.0  # set nowhere: default


def test_task_cannot_override_app_wide_settings() -> None:
    """redis_url and key_prefix are app-wide: task attributes of those names are ignored."""
    conf = {"singleton_key_prefix": "app:", "singleton_redis_url": "redis://a:1/0"}
    task = SimpleNamespace(
        name="t.x", singleton_key_prefix="task:", singleton_redis_url="redis://b:2/0"
    )
    opts = read_options(conf, task)
    assert opts.key_prefix == "app:"
    assert opts.redis_url == "redis://a:1/0"


def test_real_singleton_task_options() -> None:
    """Options given to ``@app.task(base=SingletonTask, ...)`` override the app's conf."""
    app = _app(singleton_ttl=20, singleton_on_duplicate="raise", singleton_retry_countdown=2)

    @app.task(name="t.cfg", base=SingletonTask, singleton_ttl=4, singleton_key_args=("account_id",))
    def cfg(account_id: int, other: int = 0) -> None:
        return None

    @app.task(name="t.plain", base=SingletonTask)
    def plain(account_id: int) -> None:
        return None

    opts = cfg.singleton_options()
    assert opts.ttl == 4.0
    assert opts.key_args == ("account_id",)
    assert opts.on_duplicate == "raise"
    assert opts.retry_countdown == 2.0
    assert plain.singleton_options().ttl == 20.0
    assert plain.singleton_options().key_args is None


def test_task_key_args_and_key_together_rejected() -> None:
    """Setting both key_args and key on one task is a SingletonConfigError naming both."""
    task = SimpleNamespace(name="t.both", singleton_key_args=["a"], singleton_key=lambda a, k: "x")
    with pytest.raises(SingletonConfigError) as info:
        read_options({}, task)
    assert "singleton_key_args" in str(info.value)
    assert "singleton_key" in str(info.value)
    assert "t.both" in str(info.value)


def test_invalid_task_option_names_the_task() -> None:
    """A bad task option is reported with the setting and the task name."""
    task = SimpleNamespace(name="t.badttl", singleton_ttl=-1)
    with pytest.raises(SingletonConfigError) as info:
        read_options({"singleton_ttl": 5}, task)
    message = str(info.value)
    assert "singleton_ttl" in message
    assert "t.badttl" in message
    assert "-1" in message


# -- namespaced config ------------------------------------------------------------------------


def test_celery_namespace_setting_is_found() -> None:
    """With ``namespace="CELERY"``, ``CELERY_SINGLETON_TTL`` is read as the ttl."""
    app = Celery("tests.unit.test_config", namespace="CELERY", set_as_current=False)
    app.config_from_object(
        {
            "CELERY_SINGLETON_TTL": 7,
            "CELERY_SINGLETON_ON_DUPLICATE": "retry",
            "CELERY_BROKER_URL": "redis://broker:6379/4",
        },
        namespace="CELERY",
    )
    assert app.conf.get("singleton_ttl") == 7
    opts = read_options(app.conf)
    assert opts.ttl == 7.0
    assert opts.on_duplicate == "retry"
    assert opts.redis_url == "redis://broker:6379/4"


def test_celery_namespace_setting_seen_by_task() -> None:
    """A SingletonTask of a namespaced app gets the namespaced value."""
    app = Celery("tests.unit.test_config", namespace="CELERY", set_as_current=False)
    app.config_from_object({"CELERY_SINGLETON_TTL": 7}, namespace="CELERY")

    @app.task(name="t.ns", base=SingletonTask)
    def ns() -> None:
        return None

    assert ns.singleton_options().ttl == 7.0


# -- redis_url --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("broker", "expected"),
    [
        ("redis://broker:6379/2", "redis://broker:6379/2"),
        ("rediss://:pw@broker:6380/0", "rediss://:pw@broker:6380/0"),
        ("redis://a:6379/0;redis://b:6379/0", "redis://a:6379/0"),
        ("amqp://guest@localhost//", DEFAULT_REDIS_URL),
        ("sqs://", DEFAULT_REDIS_URL),
        (None, DEFAULT_REDIS_URL),
    ],
)
def test_redis_url_defaults_to_a_redis_broker(broker: str | None, expected: str) -> None:
    """A redis:// or rediss:// broker is used for the locks, anything else falls back."""
    assert resolve_redis_url({"broker_url": broker}) == expected
    assert read_options({"broker_url": broker}).redis_url == expected


def test_redis_url_setting_wins_over_broker() -> None:
    """``singleton_redis_url`` is used even when the broker is Redis."""
    conf = {"broker_url": "redis://broker:6379/0", "singleton_redis_url": "unix:///tmp/r.sock"}
    assert resolve_redis_url(conf) == "unix:///tmp/r.sock"


def test_redis_url_from_celery_app_broker() -> None:
    """A Celery app's redis broker_url is picked up."""
    assert read_options(_app(broker_url="redis://b:1/5").conf).redis_url == "redis://b:1/5"


# -- the broker as Celery resolves it --------------------------------------------------------

#: the failover list of the tests below: the first URL's Redis holds the locks
FIRST = "redis://:pw-8f3e@first.example:6379/2"
SECOND = "redis://second.example:6379/3"
BROKERS: dict[str, Any] = {
    "one": FIRST,
    "semicolons": f"{FIRST};{SECOND}",
    "list": [FIRST, SECOND],
}
SOURCES = ["keyword", "config_from_object", "environment", "django_namespace"]
#: the broker's visibility timeout in these tests: the default completion_ttl follows it
VISIBILITY = 7200


def _app_with_broker(source: str, broker: Any, monkeypatch: pytest.MonkeyPatch) -> Celery:
    """A Celery app given ``broker`` and its visibility timeout through ``source``."""
    monkeypatch.delenv("CELERY_BROKER_URL", raising=False)
    transport = {"visibility_timeout": VISIBILITY}
    name = "tests.unit.test_config"
    if source == "keyword":
        app = Celery(name, broker=broker, set_as_current=False)
        app.conf.broker_transport_options = transport
    elif source == "config_from_object":
        app = Celery(name, set_as_current=False)
        app.config_from_object(
            SimpleNamespace(broker_url=broker, broker_transport_options=transport)
        )
    elif source == "environment":  # a list cannot be: the variable is one string
        monkeypatch.setenv(
            "CELERY_BROKER_URL", broker if isinstance(broker, str) else ";".join(broker)
        )
        app = Celery(name, set_as_current=False)
        app.conf.broker_transport_options = transport
    else:  # Django's settings.py, read with namespace="CELERY"
        app = Celery(name, namespace="CELERY", set_as_current=False)
        settings = SimpleNamespace(
            CELERY_BROKER_URL=broker, CELERY_BROKER_TRANSPORT_OPTIONS=transport
        )
        app.config_from_object(settings, namespace="CELERY")
    return app


@pytest.mark.parametrize("broker", BROKERS.values(), ids=BROKERS)
@pytest.mark.parametrize("source", SOURCES)
def test_every_broker_default_follows_the_broker_celery_resolves(
    source: str, broker: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Wherever the broker comes from (keyword, config_from_object, CELERY_BROKER_URL in the
    environment, a namespaced settings object) and however its failover list is given, its
    first URL's Redis holds the locks (tasks, banner, beat) and an acks_late task's default
    completion_ttl is its visibility timeout + 300 s."""
    app = _app_with_broker(source, broker, monkeypatch)

    @app.task(name="t.late", base=SingletonTask, shared=False, acks_late=True)
    def late() -> None: ...

    assert resolve_redis_url(app.conf) == FIRST
    assert late.singleton_options().redis_url == FIRST
    assert late.singleton_options().completion_ttl == VISIBILITY + 300
    assert read_beat_options(app.conf).redis_url == FIRST
    shown = describe(read_options(app.conf), app.conf)
    assert shown["redis"] == "redis://:***@first.example:6379/2"
    assert (
        shown["completion_ttl"]
        == f"acks_late tasks: {VISIBILITY + 300}s (visibility_timeout + 300s)"
    )
    assert "pw-8f3e" not in banner_lines(app.conf, [late])
    app.close()


def test_the_environment_wins_over_broker_url_as_in_celery(monkeypatch: pytest.MonkeyPatch) -> None:
    """Celery connects to CELERY_BROKER_URL even when broker_url is set: so do the locks."""
    monkeypatch.setenv("CELERY_BROKER_URL", "redis://env.example:6379/4")
    app = _app(broker_url="amqp://guest@localhost//")
    with app.connection_for_write() as connection:  # not connected: only the URL is read
        assert (connection.transport_cls, connection.hostname) == ("redis", "env.example")
    assert resolve_redis_url(app.conf) == "redis://env.example:6379/4"
    app.close()


def test_singleton_redis_url_wins_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CELERY_BROKER_URL", "redis://env.example:6379/4")
    app = _app(singleton_redis_url="redis://locks.example:6379/1")
    assert resolve_redis_url(app.conf) == "redis://locks.example:6379/1"
    app.close()


@pytest.mark.parametrize(
    ("broker", "visibility"),
    [
        ("amqp://guest@localhost//;redis://b:6379/0", None),  # the first URL is not Redis
        (["amqp://guest@localhost//", "redis://b:6379/0"], None),
        ([], None),
        ("", None),
        (["sqs://", "redis://b:6379/0"], 1800.0),
        (" redis://a:6379/0 ; redis://b:6379/0", 3600.0),
    ],
)
def test_a_failover_list_is_followed_by_its_first_url(
    broker: Any, visibility: float | None
) -> None:
    """Only the first URL counts: a Redis one later in the list is not where kombu connects."""
    conf = {"broker_url": broker}
    expected = "redis://a:6379/0" if visibility == 3600.0 else DEFAULT_REDIS_URL
    assert resolve_redis_url(conf) == expected
    assert broker_visibility(conf) == visibility


def test_an_infinite_visibility_timeout_gives_no_infinite_completion_ttl() -> None:
    conf = {
        "broker_url": "redis://a/0",
        "broker_transport_options": {"visibility_timeout": float("inf")},
    }
    task = SimpleNamespace(name="t.late", acks_late=True)
    assert read_options(conf, task).completion_ttl == 3600.0


# -- invalid values ---------------------------------------------------------------------------


@pytest.mark.parametrize("value", [0, -1, "5", True, [], float("nan")])
def test_invalid_ttl(value: Any) -> None:
    """A ttl that is not a positive number is rejected, naming singleton_ttl."""
    with pytest.raises(SingletonConfigError, match="singleton_ttl"):
        read_options({"singleton_ttl": value})


@pytest.mark.parametrize("value", [-0.5, "1", False])
def test_invalid_retry_countdown(value: Any) -> None:
    """A negative or non-numeric retry_countdown is rejected, naming the setting."""
    with pytest.raises(SingletonConfigError, match="singleton_retry_countdown"):
        read_options({"singleton_retry_countdown": value})


@pytest.mark.parametrize("value", [0, -3, "10"])
def test_invalid_max_hold(value: Any) -> None:
    """A max_hold that is set but not positive is rejected, naming the setting."""
    with pytest.raises(SingletonConfigError, match="singleton_max_hold"):
        read_options({"singleton_max_hold": value})


@pytest.mark.parametrize("value", ["bogus", "SKIP", "", 1])
def test_invalid_policy(value: Any) -> None:
    """An unknown on_duplicate policy is rejected, naming the setting and the choices."""
    with pytest.raises(SingletonConfigError) as info:
        read_options({"singleton_on_duplicate": value})
    message = str(info.value)
    assert "singleton_on_duplicate" in message
    for policy in ("skip", "retry", "raise"):
        assert repr(policy) in message


@pytest.mark.parametrize(
    "value", ["http://host:6379/0", "localhost:6379", "amqp://guest@localhost//", 6379]
)
def test_invalid_redis_url(value: Any) -> None:
    """A lock URL that is not redis://, rediss:// or unix:// is rejected, naming the setting."""
    with pytest.raises(SingletonConfigError, match="singleton_redis_url"):
        read_options({"singleton_redis_url": value})


def test_invalid_redis_url_message_hides_password() -> None:
    """The error for a bad URL never shows its password."""
    with pytest.raises(SingletonConfigError) as info:
        read_options({"singleton_redis_url": "http://user:s3cret@host:6379/0"})
    assert "s3cret" not in str(info.value)
    assert "***" in str(info.value)


@pytest.mark.parametrize("value", ["", "a b:", "x{y}:", "p*", "tab\t", "x" * 65, 5])
def test_invalid_prefix(value: Any) -> None:
    """A key prefix that is empty, too long, not a str or has a forbidden char is rejected."""
    with pytest.raises(SingletonConfigError, match="singleton_key_prefix"):
        read_options({"singleton_key_prefix": value})


@pytest.mark.parametrize("value", [[1, 2], 5, ("a", None)])
def test_invalid_key_args(value: Any) -> None:
    """key_args that are not argument names are rejected, naming the setting."""
    with pytest.raises(SingletonConfigError, match="singleton_key_args"):
        read_options({"singleton_key_args": value})


def test_invalid_key_fn() -> None:
    """A key that is not callable is rejected, naming the setting."""
    with pytest.raises(SingletonConfigError, match="singleton_key"):
        read_options({"singleton_key": "account_id"})


# -- numbers: every numeric row of the table, as an app setting and as a task option ----------

#: numbers a numeric setting may take: a row whose check accepts one of them is numeric
_SOME_NUMBERS = (1, 2, 1.5, 60, 1000)
#: refused by every numeric setting, whatever its range
_NEVER_NUMBERS: tuple[Any, ...] = (
    float("nan"),
    float("inf"),
    float("-inf"),
    -1,
    -0.5,
    True,
    False,
    "1",
    "inf",
    b"1",
    [1],
)
#: by the seconds ones: ints no float holds (the second has no repr either: ValueError past
#: 4300 digits)
_TOO_BIG_FOR_FLOAT = (10**400, 10**5000)
#: by the integer ones: a float, even a whole one
_NOT_INTEGERS = (1.0, 2.5)


def _accepts(setting: Setting, value: Any) -> bool:
    try:
        setting.check(setting.conf_key, value)
    except SingletonConfigError:
        return False
    return True


def _numeric_settings() -> list[Setting]:
    """The rows of :data:`SETTINGS` whose check accepts a number: a new one cannot skip the
    tests below."""
    return [s for s in SETTINGS.values() if any(_accepts(s, n) for n in _SOME_NUMBERS)]


def _integer(setting: Setting) -> bool:
    return not any(_accepts(setting, n) for n in (1.5, 2.5))


def _bad_numbers(setting: Setting) -> list[Any]:
    return [*_NEVER_NUMBERS, *(_NOT_INTEGERS if _integer(setting) else _TOO_BIG_FOR_FLOAT)]


def _read_everything(conf: dict[str, Any], task: object | None = None) -> None:
    """What a worker (every task's options, the banner's) and a beat read at start-up."""
    read_options(conf, task)
    if task is None:
        read_beat_options(conf)


def test_the_numeric_settings_are_found() -> None:
    """The probe finds every numeric setting known today, and only numbers pass it."""
    names = {s.name for s in _numeric_settings()}
    assert names >= {
        "wait_replicas",
        "wait_timeout",
        "permits",
        "ttl",
        "retry_countdown",
        "max_hold",
        "completion_ttl",
        "publish_ttl",
        "beat_skew",
        "lock_at_least",
        "beat_lock_at_least",
        "beat_lease",
    }
    assert {s.name for s in _numeric_settings() if _integer(s)} == {
        "wait_replicas",
        "permits",
        "rate_limit",
        "queue_max",
    }


@pytest.mark.parametrize("setting", _numeric_settings(), ids=lambda s: s.name)
def test_numeric_setting_refuses_non_numbers(setting: Setting) -> None:
    """NaN, infinities, negatives, bools, strings, an int no float holds (and, for an integer
    setting, floats) are a SingletonConfigError naming the setting: from its check, as an app
    setting, and as a task option where it is one. None only where it means "not set"."""
    for value in _bad_numbers(setting):
        with pytest.raises(SingletonConfigError, match=setting.conf_key):
            setting.check(setting.conf_key, value)
        with pytest.raises(SingletonConfigError, match=setting.conf_key):
            _read_everything({setting.conf_key: value})
        if setting.task_option:
            task = SimpleNamespace(name="t.numbers", **{setting.conf_key: value})
            named = rf"{setting.conf_key} \(task t\.numbers\)"
            with pytest.raises(SingletonConfigError, match=named):
                _read_everything({}, task)
    if setting.default is not None:
        with pytest.raises(SingletonConfigError, match=setting.conf_key):
            setting.check(setting.conf_key, None)


@pytest.mark.parametrize("setting", _numeric_settings(), ids=lambda s: s.name)
def test_numeric_setting_error_shows_the_value(setting: Setting) -> None:
    """The message shows what was given, and an int too long for a repr as its size."""
    with pytest.raises(SingletonConfigError, match=r"got inf$"):
        setting.check(setting.conf_key, float("inf"))
    if _integer(setting):
        return
    with pytest.raises(SingletonConfigError, match=r"got 1000000000\d{67}\.\.\.$"):
        setting.check(setting.conf_key, 10**400)
    with pytest.raises(SingletonConfigError, match=r"got an integer of 16610 bits$"):
        setting.check(setting.conf_key, 10**5000)


def test_infinite_ttls_never_reach_a_lock() -> None:
    """ttl=inf was a bare OverflowError (ttl_ms); completion_ttl and lock_at_least = inf
    passed and every release then died with OverflowError."""
    for name in ("ttl", "completion_ttl", "lock_at_least", "max_hold", "publish_ttl"):
        task = SimpleNamespace(name="t.inf", **{f"singleton_{name}": float("inf")})
        with pytest.raises(SingletonConfigError, match=f"singleton_{name}"):
            read_options({}, task).ttl_ms  # noqa: B018 - the property raised before


def test_config_error_is_a_value_error() -> None:
    """SingletonConfigError is also a ValueError (so generic handlers catch it)."""
    with pytest.raises(ValueError, match="singleton_ttl"):
        read_options({"singleton_ttl": 0})


# -- redaction --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("redis://user:pass@host:6379/0", "redis://user:***@host:6379/0"),
        ("redis://:pass@host/0", "redis://:***@host/0"),
        (
            "rediss://u:p4ss@h:6380/1?ssl_cert_reqs=none",
            "rediss://u:***@h:6380/1?ssl_cert_reqs=none",
        ),
        ("redis://u:p%40ss@h/0", "redis://u:***@h/0"),
        ("unix://:pw@/tmp/redis.sock?db=1", "unix://:***@/tmp/redis.sock?db=1"),
    ],
)
def test_redact_url_hides_password(url: str, expected: str) -> None:
    """The password is replaced by *** and everything else kept."""
    redacted = redact_url(url)
    assert redacted == expected
    password = url.split("@", maxsplit=1)[0].rsplit(":", 1)[1]
    assert password not in redacted


@pytest.mark.parametrize(
    "url", ["redis://host:6379/0", "redis://user@host/0", "rediss://h", "unix:///tmp/r.sock"]
)
def test_redact_url_without_password_is_unchanged(url: str) -> None:
    """A URL without a password comes back as it was."""
    assert redact_url(url) == url


def test_redact_url_keeps_ipv6_brackets() -> None:
    """An IPv6 host keeps its brackets after redaction."""
    assert redact_url("redis://u:p@[::1]:6379/0") == "redis://u:***@[::1]:6379/0"


def test_describe_hides_password() -> None:
    """The start-up banner's settings show the lock URL without its password."""
    opts = read_options({"singleton_redis_url": "redis://:topsecret@h:6379/0", "singleton_ttl": 2})
    shown = describe(opts)
    assert shown["redis"] == "redis://:***@h:6379/0"
    assert "topsecret" not in " ".join(shown.values())
    assert shown["ttl"] == "2s"
    assert shown["max_hold"] == "none"


# -- permits ----------------------------------------------------------------------------------


def test_permits_default_to_one_and_key_slots_of_the_task() -> None:
    app = _app(singleton_redis_url="redis://127.0.0.1:6379/0")

    @app.task(base=SingletonTask, name="t.export", shared=False, singleton_permits=3)
    def export(tenant: str) -> None: ...

    @app.task(base=SingletonTask, name="t.one", shared=False)
    def one(tenant: str) -> None: ...

    keys = export.singleton_keys(("acme",), {})
    assert export.singleton_options().permits == 3
    assert keys.slots == [f"{keys.lock}:1", f"{keys.lock}:2", f"{keys.lock}:3"]
    assert one.singleton_options().permits == 1
    assert one.singleton_keys(("acme",), {}).slots == [one.singleton_keys(("acme",), {}).lock]
    assert ".> permits:         t.export=3\n" in banner_lines(app.conf, [export, one])
    assert "permits" not in banner_lines(app.conf, [one])
    app.close()


@pytest.mark.parametrize("value", [0, -1, 1001, 2.0, "3", True])
def test_invalid_permits(value: Any) -> None:
    with pytest.raises(SingletonConfigError, match="singleton_permits"):
        read_options({"singleton_permits": value})


@pytest.mark.parametrize(
    "url", ["redis+redlock://a:6379,b:6379,c:6379/0", "REDISS+REDLOCK://a:1,b:1,c:1/0"]
)
def test_permits_are_refused_with_redlock(url: str) -> None:
    task = SimpleNamespace(name="t.export", singleton_permits=2)
    with pytest.raises(SingletonConfigError, match=r"task t\.export: singleton_permits.*redlock"):
        read_options({"singleton_redis_url": url}, task)
    assert read_options({"singleton_redis_url": url}, SimpleNamespace(name="t.x")).permits == 1


def test_permits_are_refused_with_publish_time_dedup() -> None:
    with pytest.raises(SingletonConfigError, match=r'singleton_permits > 1 needs.*"execute"'):
        read_options({"singleton_permits": 2, "singleton_lock_on": "publish"})


def test_permits_go_with_coalesce_but_not_with_a_window() -> None:
    """Coalesce with permits: the N+1th call meets the policy, and its call waits as the key's
    one follow-up (docs/internals.md). With an at-least window per slot it is still refused, as
    for one permit: a slot in a window has no run whose release would take the record."""
    conf = {"singleton_permits": 3, "singleton_on_duplicate": "coalesce"}
    opts = read_options(conf)
    assert (opts.permits, opts.on_duplicate) == (3, "coalesce")
    task = SimpleNamespace(
        name="t.export",
        singleton_permits=3,
        singleton_on_duplicate="coalesce",
        singleton_lock_at_least=60,
    )
    with pytest.raises(SingletonConfigError, match="does not go with singleton_lock_at_least"):
        read_options({}, task)


def test_coalesce_is_refused_with_an_at_least_window() -> None:
    """A burst met in an at-least window would give two runs after it, not one follow-up:
    the task option singleton_lock_at_least and coalesce are refused together. An app-wide
    singleton_lock_at_least is beat's (old spelling) and never refuses an app-wide coalesce."""
    task = SimpleNamespace(
        name="t.resync", singleton_on_duplicate="coalesce", singleton_lock_at_least=600
    )
    with pytest.raises(
        SingletonConfigError,
        match=r"task t\.resync: singleton_on_duplicate 'coalesce' does not go with "
        r"singleton_lock_at_least",
    ):
        read_options({}, task)
    conf = {"singleton_on_duplicate": "coalesce", "singleton_lock_at_least": 600}
    assert read_options(conf).on_duplicate == "coalesce"
    assert read_options(conf, SimpleNamespace(name="t.x")).lock_at_least == 0
    skip = SimpleNamespace(name="t.resync", singleton_lock_at_least=600)
    assert read_options({}, skip).lock_at_least == 600
