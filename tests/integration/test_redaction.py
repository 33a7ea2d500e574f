"""The lock store's password stays out of `celery report`, `celery inspect conf` and reprs.

Celery masks settings by name only (``HIDDEN_SETTINGS``: API, TOKEN, KEY, SECRET, PASS, ...,
plus broker_url-like and "backend" names), so ``singleton_redis_url`` is the library's to mask.
Every password here is unique (``s3cr3t-<uuid>``), so a leak anywhere is found by grep.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from celery_singleton_lock.beat.leader import BeatState
from celery_singleton_lock.beat.redlock_claims import claims_and_store
from celery_singleton_lock.core.urls import redact_url
from celery_singleton_lock.settings.options import read_beat_options, read_options
from celery_singleton_lock.tools.cli import _Target
from tests.support.basic_app import SINGLETON_APP, close_app, make_app
from tests.support.servers import RedisServer
from tests.support.workers import REPO_ROOT, WorkerFactory

#: An app configured with namespace="CELERY": its setting is CELERY_SINGLETON_REDIS_URL.
NAMESPACED_APP = """
import os
from celery import Celery

app = Celery("namespaced_app")
app.config_from_object(
    {
        "CELERY_BROKER_URL": os.environ["SINGLETON_TEST_REDIS_URL"],
        "CELERY_SINGLETON_REDIS_URL": os.environ["SINGLETON_TEST_LOCK_URL"],
    },
    namespace="CELERY",
)
"""


def _password() -> str:
    return f"s3cr3t-{uuid.uuid4().hex}"


def _lock_urls(password: str, port: int = 6379) -> dict[str, str]:
    """The lock store URL with ``password`` in the user info, and in the query."""
    return {
        "userinfo": f"redis://:{password}@127.0.0.1:{port}/0",
        "query": f"redis://127.0.0.1:{port}/0?password={password}",
    }


def _celery(
    *args: str, env: dict[str, str], cwd: Path = REPO_ROOT
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "celery", *args],
        cwd=cwd,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.parametrize("where", ["userinfo", "query"])
def test_celery_report_never_shows_the_lock_store_password(
    where: str, redis_url: str, key_prefix: str
) -> None:
    """`celery -A app report` shows singleton_redis_url with its password masked."""
    password = _password()
    url = _lock_urls(password)[where]
    env = {
        "SINGLETON_TEST_REDIS_URL": redis_url,
        "SINGLETON_TEST_PREFIX": key_prefix,
        "SINGLETON_TEST_LOCK_URL": url,
    }
    report = _celery("-A", SINGLETON_APP, "report", env=env)
    assert report.returncode == 0, report.stderr
    assert password not in report.stdout + report.stderr
    assert f"singleton_redis_url: {redact_url(url)!r}" in report.stdout, report.stdout


def test_celery_report_of_a_namespaced_app_never_shows_the_password(
    tmp_path: Path, redis_url: str
) -> None:
    """With namespace="CELERY" the setting is CELERY_SINGLETON_REDIS_URL: masked too."""
    (tmp_path / "namespaced_app.py").write_text(NAMESPACED_APP)
    password = _password()
    url = _lock_urls(password)["userinfo"]
    path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {
        "SINGLETON_TEST_REDIS_URL": redis_url,
        "SINGLETON_TEST_LOCK_URL": url,
        "PYTHONPATH": path,
    }
    report = _celery("-A", "namespaced_app", "report", env=env, cwd=tmp_path)
    assert report.returncode == 0, report.stderr
    assert password not in report.stdout + report.stderr
    assert f"CELERY_SINGLETON_REDIS_URL: {redact_url(url)!r}" in report.stdout, report.stdout


@pytest.fixture
def locked_server() -> Iterator[tuple[RedisServer, str]]:
    """A private server that needs a password (``requirepass``), and that password."""
    password = _password()
    server = RedisServer()  # started without one: its start-up check PINGs without AUTH
    admin = redis.Redis.from_url(server.url)
    try:
        admin.config_set("requirepass", password)  # a private server: ours to configure
    finally:
        admin.close()
    yield server, password
    server.close()


@pytest.mark.parametrize("where", ["userinfo", "query"])
def test_inspect_conf_of_a_worker_never_shows_the_password(
    where: str,
    locked_server: tuple[RedisServer, str],
    worker_factory: WorkerFactory,
    redis_url: str,
    key_prefix: str,
) -> None:
    """A real worker whose locks live on a server with requirepass answers `celery inspect
    conf` with singleton_redis_url masked; its log never shows the password either."""
    server, password = locked_server
    url = _lock_urls(password, server.port)[where]
    env = {"SINGLETON_TEST_LOCK_URL": url}
    worker = worker_factory.start(SINGLETON_APP, concurrency=1, env=env)
    client_app = make_app(redis_url, key_prefix)
    try:
        worker.wait_ready(client_app)
        # the worker really uses that URL: a run takes its lock on the protected server
        result = client_app.send_task("t.hold", kwargs={"key": "k", "seconds": 0})
        assert result.get(timeout=30)["token"] > 0
    finally:
        close_app(client_app)
    conf = _celery(
        "-A",
        SINGLETON_APP,
        "inspect",
        "conf",
        "-d",
        worker.nodename,
        "-j",
        "-t",
        "10",
        env={
            "SINGLETON_TEST_REDIS_URL": redis_url,
            "SINGLETON_TEST_PREFIX": key_prefix,
            "SINGLETON_TEST_LOCK_URL": redact_url(url),  # this process must not hold it
        },
    )
    assert conf.returncode == 0, (conf.stdout, conf.stderr)
    assert password not in conf.stdout + conf.stderr
    replies: dict[str, Any] = json.loads(conf.stdout)
    assert replies[worker.nodename]["singleton_redis_url"] == redact_url(url)
    assert password not in worker.log_text()


def test_reprs_of_the_settings_objects_never_show_the_password() -> None:
    """Options, BeatOptions, beat's BeatState and the CLI's _Target keep the URL but show it
    masked (host, port and db stay visible)."""
    password = _password()
    for url in (
        *_lock_urls(password, port=1).values(),
        f"redis+sentinel://:{password}@127.0.0.1:1/mymaster?sentinel_password={password}",
    ):
        app = Celery(set_as_current=False)
        app.conf.singleton_redis_url = url
        options = read_options(app.conf)
        beat_options = read_beat_options(app.conf)
        claims, store = claims_and_store(url, "me")  # builds clients; nothing connects
        shown = {
            "Options": options,
            "BeatOptions": beat_options,
            "BeatState": BeatState(
                opts=beat_options, pid=1, claimer="me", claims=claims, store=store
            ),
            "_Target": _Target(redis_url=url, prefix="p:", app=None),
        }
        for name, obj in shown.items():
            text = repr(obj)
            assert password not in text, (name, text)
            assert redact_url(url) in text, (name, text)
        assert options.redis_url == url  # still usable
        app.close()


def test_the_settings_filter_keeps_celerys_behaviour_and_installs_once() -> None:
    """Celery's own censoring is kept (also in nested mappings, where the lock URL is masked
    too); installing again does not wrap twice."""
    from celery.app import utils as celery_app_utils

    from celery_singleton_lock.settings import masking as hidden_settings

    installed = celery_app_utils.filter_hidden_settings
    hidden_settings.install()
    assert celery_app_utils.filter_hidden_settings is installed
    password = _password()
    url = _lock_urls(password)["query"]
    conf = {
        "singleton_redis_url": url,
        "CELERY_SINGLETON_REDIS_URL": url,
        "singleton_redis_url_note": url,  # not the setting: its name does not end with it
        "singleton_ttl": 3,
        "singleton_redis_url_unset": None,
        "api_key": "k",
        "broker_url": f"redis://:{password}@h:6379/0",
        "result_backend": f"redis://:{password}@h:6379/1",
        "nested": {
            "singleton_redis_url": url,
            "token": "t",
            "deeper": {"x_singleton_redis_url": url},
        },
    }
    shown = celery_app_utils.filter_hidden_settings(conf)
    masked = redact_url(url)
    assert shown["singleton_redis_url"] == shown["CELERY_SINGLETON_REDIS_URL"] == masked
    assert shown["singleton_redis_url_note"] == url
    assert shown["singleton_ttl"] == 3
    assert shown["api_key"] == "********"
    assert shown["broker_url"] == "redis://:********@h:6379/0"
    assert shown["result_backend"] == "redis://:********@h:6379/1"
    assert shown["nested"] == {
        "singleton_redis_url": masked,
        "token": "********",
        "deeper": {"x_singleton_redis_url": masked},
    }
    app = Celery(set_as_current=False)
    app.conf.singleton_redis_url = url
    assert password not in app.conf.humanize()
    assert app.conf.table(censored=False)["singleton_redis_url"] == url  # only the censored view
    app.close()
