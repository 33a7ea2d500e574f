"""Invalid settings stop a real worker or beat at start-up with one line naming the setting
(and never showing a password), instead of failing at the first task or tick."""

from __future__ import annotations

import pytest

from celery_singleton_lock import SingletonConfigError
from celery_singleton_lock.core.connection import client_for
from celery_singleton_lock.core.urls import redact_url
from celery_singleton_lock.settings.options import read_beat_options, read_options
from tests.support.basic_app import SINGLETON_APP
from tests.support.beats import BeatFactory
from tests.support.workers import WorkerFactory

PASSWORD = "s3cret-Pw-52e"
INVALID = "celery_singleton_lock: invalid setting: "


def _assert_refused(log: str, code: int, setting: str, value: str) -> None:
    """Exit code, the one ``invalid setting`` line naming the setting and value, no password."""
    assert code != 0, log
    (line,) = [line for line in log.splitlines() if INVALID in line]
    assert setting in line, line
    assert value in line, line
    assert PASSWORD not in log


@pytest.mark.parametrize(
    ("env", "setting", "shown"),
    [
        ({"SINGLETON_TEST_TTL": "0"}, "singleton_ttl", "got 0.0"),
        ({"SINGLETON_TEST_TTL": "-1"}, "singleton_ttl", "got -1.0"),
        ({"SINGLETON_TEST_TTL": "inf"}, "singleton_ttl", "got inf"),
        ({"SINGLETON_TEST_TTL": "nan"}, "singleton_ttl", "got nan"),
        ({"SINGLETON_TEST_COMPLETION_TTL": "inf"}, "singleton_completion_ttl", "got inf"),
        (  # a task option: the t.*window* tasks' singleton_lock_at_least
            {"SINGLETON_TEST_AT_LEAST": "inf"},
            "singleton_lock_at_least (task t.",
            "got inf",
        ),
        ({"SINGLETON_TEST_BAD_POLICY": "sometimes"}, "singleton_on_duplicate", "'sometimes'"),
        ({"SINGLETON_TEST_ON_REDIS_ERROR": "bogus"}, "singleton_on_redis_error", "'bogus'"),
        ({"SINGLETON_TEST_LOCK_URL": "http://x"}, "singleton_redis_url", "http://x"),
        (
            {"SINGLETON_TEST_LOCK_URL": f"redis://:{PASSWORD}@127.0.0.1:notaport/0"},
            "singleton_redis_url",
            "redis://:***@127.0.0.1:notaport/0",
        ),
        (  # a third task of the scope, keyed on (region, tenant) where the others key on tenant
            {"SINGLETON_TEST_BAD_SCOPE": "1"},
            "scope 'tenant-sync'",
            "t.tenant_bad on region, tenant",
        ),
        (  # tasks with singleton_permits=2 and 3 over Redlock (never connected to)
            {
                "SINGLETON_TEST_LOCK_URL": "redis+redlock://127.0.0.1:1,127.0.0.1:2,127.0.0.1:3/0",
                "SINGLETON_TEST_PERMITS": "1",
            },
            "singleton_permits",
            "redis+redlock://",
        ),
        (  # coalesce with an at-least window: a burst in the window is not one follow-up
            {"SINGLETON_TEST_WINDOW_COALESCE": "1"},
            "task t.window_coalesce: singleton_on_duplicate 'coalesce'",
            "singleton_lock_at_least",
        ),
        (  # a task of scope tenant-sync with 2 permits, the others with 1: they never meet
            {"SINGLETON_TEST_BAD_SCOPE_PERMITS": "1"},
            "scope 'tenant-sync' must take the same singleton_permits",
            "t.tenant_import 1; t.tenant_permits 2",
        ),
        (  # a malformed rate (a day is not a period Celery's rate_limit knows)
            {"SINGLETON_TEST_BAD_RATE": "5/d"},
            "singleton_rate_limit (task t.rate_bad)",
            "got '5/d'",
        ),
        (  # rate-limited tasks over Redlock (never connected to)
            {
                "SINGLETON_TEST_LOCK_URL": "redis+redlock://127.0.0.1:1,127.0.0.1:2,127.0.0.1:3/0",
                "SINGLETON_TEST_RATE": "1",
            },
            "singleton_rate_limit",
            "redis+redlock://",
        ),
    ],
    ids=[
        "ttl-zero",
        "ttl-negative",
        "ttl-inf",
        "ttl-nan",
        "completion-ttl-inf",
        "at-least-task-option-inf",
        "policy",
        "on-redis-error",
        "url-scheme",
        "url-port",
        "scope",
        "permits-redlock",
        "coalesce-window",
        "scope-permits",
        "rate-malformed",
        "rate-redlock",
    ],
)
def test_worker_refuses_to_start(
    worker_factory: WorkerFactory, env: dict[str, str], setting: str, shown: str
) -> None:
    """The worker exits before it is ready, with one line naming the setting and its value."""
    worker = worker_factory.start(SINGLETON_APP, concurrency=1, env=env)
    code = worker.wait(timeout=30)
    log = worker.log_text()
    _assert_refused(log, code, setting, shown)
    assert " ready." not in log
    assert "Traceback" not in log


def test_beat_refuses_to_start_with_bad_beat_mode(beat_factory: BeatFactory) -> None:
    """celery beat -S singleton with singleton_beat_mode="bogus" exits at start-up, no tick."""
    beat = beat_factory.start(env={"SINGLETON_TEST_BEAT_MODE": "bogus"})
    code = beat.wait(timeout=30)
    log = beat.log_text()
    _assert_refused(log, code, "singleton_beat_mode", "'bogus'")
    assert "Traceback" not in log
    assert "beat: Starting" not in log


def test_beat_refuses_to_start_with_bad_url(beat_factory: BeatFactory) -> None:
    """A beat whose lock URL is not a Redis URL exits at start-up; the password stays hidden."""
    url = f"redis://:{PASSWORD}@127.0.0.1:99999/0"
    beat = beat_factory.start(env={"SINGLETON_TEST_LOCK_URL": url})
    code = beat.wait(timeout=30)
    _assert_refused(beat.log_text(), code, "singleton_redis_url", "redis://:***@127.0.0.1:99999/0")


def test_beat_refuses_a_lock_socket_timeout_longer_than_a_quarter_of_the_lease(
    beat_factory: BeatFactory,
) -> None:
    """Leader mode, a 3 s lease, a lock URL whose socket_timeout is 1 s: a renewal that hangs
    would fail too late for the leader to trust its lease meanwhile. Refused at start-up."""
    env = {
        "SINGLETON_TEST_BEAT_MODE": "leader",
        "SINGLETON_TEST_BEAT_LEASE": "3",
        "SINGLETON_TEST_LOCK_URL": f"redis://:{PASSWORD}@127.0.0.1:1/0?socket_timeout=1",
    }
    beat = beat_factory.start(env=env)
    code = beat.wait(timeout=30)
    log = beat.log_text()
    _assert_refused(log, code, "singleton_beat_lease=3", "socket_timeout at most 0.75s")
    assert "Traceback" not in log


# -- the checks behind it, without processes --------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "url", "lease", "read"),
    [  # leader mode: socket timeouts of a quarter of the lease, at most 5 s, unless given
        ("leader", "redis://h/0", 3, "redis://h/0?socket_timeout=0.75&socket_connect_timeout=0.75"),
        ("leader", "redis://h/0", 40, "redis://h/0?socket_timeout=5&socket_connect_timeout=5"),
        (
            "leader",
            "redis://h/0?socket_timeout=0.2",
            10,
            "redis://h/0?socket_timeout=0.2&socket_connect_timeout=2.5",
        ),
        ("leader", "redis+redlock://a,b,c/0", 3, "redis+redlock://a,b,c/0"),  # master_timeout
        ("active", "redis://h/0", 3, "redis://h/0"),
    ],
)
def test_beat_lock_url_socket_timeouts(mode: str, url: str, lease: int, read: str) -> None:
    conf = {"singleton_redis_url": url, "singleton_beat_mode": mode, "singleton_beat_lease": lease}
    assert read_beat_options(conf).redis_url == read


@pytest.mark.parametrize("name", ["socket_timeout", "socket_connect_timeout"])
def test_beat_lease_refuses_longer_socket_timeouts(name: str) -> None:
    conf = {
        "singleton_redis_url": f"redis://:{PASSWORD}@h/0?{name}=2.6",
        "singleton_beat_mode": "leader",
        "singleton_beat_lease": 10,
    }
    with pytest.raises(SingletonConfigError, match=f"{name} at most 2.5s") as info:
        read_beat_options(conf)
    assert PASSWORD not in str(info.value)


@pytest.mark.parametrize(
    "url",
    [
        f"redis://:{PASSWORD}@127.0.0.1:notaport/0",
        f"redis://:{PASSWORD}@127.0.0.1:99999/0",
        f"rediss://user:{PASSWORD}@host/0?db=x",
        f"redis://:{PASSWORD}@host/0?socket_timeout=soon",
        f"redis://:{PASSWORD}@[::1/0",
        f"http://user:{PASSWORD}@host:6379/0",
        f"redis:/user:{PASSWORD}@host/0",
        # a password with an unescaped "/": the URL parser sees a port ":s3cret-..." before it
        f"redis://:ab/{PASSWORD}@host:6379/0",
    ],
)
def test_bad_url_named_without_password(url: str) -> None:
    """A URL redis-py would refuse is a SingletonConfigError naming the setting, password hidden."""
    with pytest.raises(SingletonConfigError, match="singleton_redis_url") as info:
        read_options({"singleton_redis_url": url})
    assert PASSWORD not in str(info.value)
    assert "ab/" not in str(info.value)
    with pytest.raises(SingletonConfigError, match="singleton_redis_url"):
        read_beat_options({"singleton_redis_url": url})


@pytest.mark.parametrize(
    "url",
    [
        f"redis://:{PASSWORD}@127.0.0.1:notaport/0",
        f"redis://:ab/{PASSWORD}@host:6379/0",
        f"redis://u:{PASSWORD}@host:6379/0?x=a@b",
    ],
)
def test_redact_url_never_fails_and_never_shows_the_password(url: str) -> None:
    """redact_url copes with URLs urllib cannot fully parse, and hides what may be a password."""
    shown = redact_url(url)
    assert PASSWORD not in shown
    assert "***" in shown


def test_client_for_bad_url_hides_password() -> None:
    """client_for's ValueError for a URL it cannot use shows the URL without its password."""
    with pytest.raises(ValueError, match="bad Redis URL") as info:
        client_for(f"redis://:{PASSWORD}@127.0.0.1:notaport/0")
    assert PASSWORD not in str(info.value)


@pytest.mark.parametrize(
    "url",
    [
        "redis://127.0.0.1:6379/0",
        f"redis://:{PASSWORD}@localhost/3",
        f"rediss://user:{PASSWORD}@host:6380/0?ssl_cert_reqs=none",
        "unix:///tmp/redis.sock?db=2",
        "redis://[::1]:6379/0",
    ],
)
def test_good_urls_still_accepted(url: str) -> None:
    """Valid redis://, rediss:// and unix:// URLs pass the check unchanged."""
    assert read_options({"singleton_redis_url": url}).redis_url == url
