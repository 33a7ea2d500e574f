"""The composition matrix's tasks: one per configuration of tests/support/matrix.py (a policy,
with or without a modifier), made from the cell declarations.

Configured from the environment like ``basic_app`` (``SINGLETON_TEST_REDIS_URL``,
``SINGLETON_TEST_PREFIX``, ``SINGLETON_TEST_QUEUE``), and:

- ``SINGLETON_TEST_VISIBILITY=<s>``: the Redis broker hands a message left unacknowledged for
  ``<s>`` seconds out again (tests/support/chaos.py ``configure_visibility``);
- ``SINGLETON_TEST_MATRIX_ONLY=<cell id>``: the app holds that cell's task alone, also a
  refused one (its worker must refuse to start).

Every task keys on ``key``. Its body records its start (with its task id) and end in the
history (tests/support/history.py); with ``hold=<name>`` it holds until the test pushes to
:func:`go_key` of that name, and logs its task id to :func:`cancels_key` once it sees a newer
call's request to stop (``self.singleton.cancelled``, ``"cancel"``) while it holds; with
``end="refuse"`` it then asks for a retry that ``max_retries=0`` refuses; else, asked to stop,
it ends cancelled (``self.singleton.end_cancelled()``: REVOKED). It returns
``{"ran": <its task id>, "key": key}``. ``m.link``
records the tag it is given each time it is called (acked late, so a call of it still running
keeps its message in the broker's unacked hash). Each library signal a worker sends is logged
to :func:`signals_key` as ``"<signal> <task id>"``.
"""

from __future__ import annotations

import os
import time
from typing import Any

from celery import Celery

from celery_singleton_lock import SingletonTask
from celery_singleton_lock import signals as singleton_signals
from tests.support.basic_app import _client, history_key, make_app
from tests.support.chaos import configure_visibility
from tests.support.history import record_end, record_start
from tests.support.matrix import BY_ID, RETRY_COUNTDOWN, TTL, configurations

__test__ = False

MATRIX_APP = "tests.support.matrix_app"
LINK_TASK = "m.link"
#: how often a holding body looks for its go, and for a request to stop (s)
HOLD_POLL_S = 0.2


def go_key(prefix: str, key: str, name: str) -> str:
    """The list a holder ``hold=name`` of ``key`` waits on."""
    return f"{prefix}go:{key}:{name}"


def cancels_key(prefix: str) -> str:
    """The list a holding body appends its task id to once it sees a request to stop."""
    return f"{prefix}cancels"


def links_key(prefix: str) -> str:
    """The list ``m.link`` appends its tags to."""
    return f"{prefix}links"


def signals_key(prefix: str) -> str:
    """The list every library signal is logged to (``"<signal> <task id>"``)."""
    return f"{prefix}signals"


def build(
    redis_url: str | None = None,
    prefix: str | None = None,
    queue: str | None = None,
    *,
    only: str | None = None,
) -> Celery:
    """The matrix app: every allowed configuration's task, or ``only`` that cell's."""
    app = make_app(redis_url, prefix, queue)
    app.main = MATRIX_APP
    url, prefix = app.conf.singleton_test_redis_url, app.conf.singleton_test_prefix
    app.conf.singleton_redis_url = url
    app.conf.singleton_key_prefix = f"{prefix}lock:"
    app.conf.singleton_ttl = TTL
    app.conf.singleton_retry_countdown = RETRY_COUNTDOWN

    @app.task(name=LINK_TASK, shared=False, acks_late=True)
    def link(value: Any, tag: str) -> None:
        _client(url).rpush(links_key(prefix), tag)

    if only is None:
        chosen = configurations()
    else:
        cell = BY_ID[only]
        chosen = {cell.task: cell.options()}
    for name, options in chosen.items():
        _define(app, name, options)
    return app


def _define(app: Celery, name: str, options: dict[str, Any]) -> None:
    url, prefix = app.conf.singleton_test_redis_url, app.conf.singleton_test_prefix

    @app.task(
        name=name,
        bind=True,
        base=SingletonTask,
        shared=False,
        singleton_key_args=("key",),
        **options,
    )
    def body(self: Any, key: str, hold: str | None = None, end: str = "ok") -> dict[str, Any]:
        client = _client(url)
        hkey = history_key(prefix)
        who = f"{self.request.hostname} {self.request.id}"
        exec_id = record_start(client, hkey, key, self.singleton.fencing_token, who, os.getpid())
        if hold is not None:  # short blocking reads: redis-py gives up on one past 5 s
            deadline = time.monotonic() + 60
            seen = False
            while not client.blpop([go_key(prefix, key, hold)], timeout=HOLD_POLL_S):
                if not seen and self.singleton.cancelled:
                    client.rpush(cancels_key(prefix), self.request.id)
                    seen = True
                if time.monotonic() > deadline:
                    break
        record_end(client, hkey, exec_id)
        if end == "refuse":
            raise self.retry(countdown=60, max_retries=0)
        if self.singleton.cancelled:
            self.singleton.end_cancelled()
        return {"ran": self.request.id, "key": key}


def _log_signal(prefix: str, url: str, name: str) -> Any:
    def receiver(sender: Any = None, task_id: str | None = None, **_: Any) -> None:
        _client(url).rpush(signals_key(prefix), f"{name} {task_id}")

    return receiver


app = build(only=os.environ.get("SINGLETON_TEST_MATRIX_ONLY") or None)

if os.environ.get("SINGLETON_TEST_VISIBILITY"):
    configure_visibility(app, float(os.environ["SINGLETON_TEST_VISIBILITY"]))

# Only in the processes started for a test (they get a private prefix): a test process imports
# this module for build() and must log nothing under the default prefix.
if os.environ.get("SINGLETON_TEST_PREFIX"):
    for _name in singleton_signals.__all__:
        getattr(singleton_signals, _name).connect(
            _log_signal(app.conf.singleton_test_prefix, app.conf.singleton_test_redis_url, _name),
            weak=False,
        )
