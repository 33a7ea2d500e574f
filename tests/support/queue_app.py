"""The Celery app of the queue policy's tests (``singleton_on_duplicate="queue"``), run in
real worker processes. Configured from the environment like ``singleton_app``.

Every task records its execution in the history (tests/support/history.py) and appends its
``payload`` to ``<prefix>order:<key>`` when it starts, so a test reads the order the calls of a
key ran in; it holds its key until the test pushes to ``<key>:go`` (``seconds`` < 0) or for
``seconds``.
"""

from __future__ import annotations

import os
import time
from typing import Any

from celery_singleton_lock import SingletonTask
from tests.support.basic_app import _client, history_key, make_app
from tests.support.history import record_end, record_start

__test__ = False

app = make_app()
app.main = "tests.support.queue_app"
app.conf.singleton_redis_url = app.conf.singleton_test_redis_url
app.conf.singleton_key_prefix = app.conf.singleton_test_prefix + "lock:"
app.conf.singleton_ttl = float(os.environ.get("SINGLETON_TEST_TTL", "2"))


def order_key(prefix: str, key: str) -> str:
    """The list the runs of ``key`` append their payloads to, in the order they started."""
    return f"{prefix}order:{key}"


def _run(task: Any, key: str, seconds: float, payload: Any) -> dict[str, Any]:
    client = _client(app.conf.singleton_test_redis_url)
    prefix = app.conf.singleton_test_prefix
    token = task.singleton.fencing_token
    exec_id = record_start(
        client, history_key(prefix), key, token, str(task.request.hostname), os.getpid()
    )
    client.rpush(order_key(prefix, key), str(payload))
    if seconds < 0:  # short blocking reads: redis-py gives up on one blocked for over 5 s
        deadline = time.monotonic() + 60
        while not client.blpop([f"{key}:go"], timeout=1) and time.monotonic() < deadline:
            pass
    else:
        time.sleep(seconds)
    record_end(client, history_key(prefix), exec_id)
    return {"payload": payload, "token": token, "pid": os.getpid()}


@app.task(
    bind=True,
    base=SingletonTask,
    name="q.line",
    singleton_key_args=("key",),
    singleton_on_duplicate="queue",
)
def line(self: Any, key: str, payload: Any = None, seconds: float = 0.0) -> dict[str, Any]:
    """A call of ``key`` that waits in line behind the runs holding it."""
    return _run(self, key, seconds, payload)


@app.task(
    bind=True,
    base=SingletonTask,
    name="q.line2",
    singleton_key_args=("key",),
    singleton_on_duplicate="queue",
    singleton_permits=2,
)
def line2(self: Any, key: str, payload: Any = None, seconds: float = 0.0) -> dict[str, Any]:
    """``q.line`` with two runs of a key at once."""
    return _run(self, key, seconds, payload)


@app.task(
    bind=True,
    base=SingletonTask,
    name="q.short",
    singleton_key_args=("key",),
    singleton_on_duplicate="queue",
    singleton_queue_max=2,
)
def short(self: Any, key: str, payload: Any = None, seconds: float = 0.0) -> dict[str, Any]:
    """``q.line`` with a queue of at most two calls."""
    return _run(self, key, seconds, payload)


@app.task(bind=True, name="q.after")
def after(self: Any, value: Any, tag: str = "") -> Any:
    """A link of a queued call: records what it was given."""
    client = _client(app.conf.singleton_test_redis_url)
    client.rpush(app.conf.singleton_test_prefix + "after", f"{tag}:{value['payload']}")
    return value


def _until_cancelled(  # noqa: PLR0917 - the run, and what it does when asked to stop
    task: Any, key: str, payload: Any, stop: bool, budget: float, pause: bool = False
) -> Any:
    """Record the run; wait (at most ``budget`` s) for a newer call's stop request, noting when
    it was seen; with ``pause``, wait then for a push to ``<key>:go``; then end cancelled
    (``stop``: ``end_cancelled()``, which goes on when the request was withdrawn) or finish."""
    client = _client(app.conf.singleton_test_redis_url)
    prefix = app.conf.singleton_test_prefix
    hkey = history_key(prefix)
    token = task.singleton.fencing_token
    exec_id = record_start(client, hkey, key, token, str(task.request.hostname), os.getpid())
    client.rpush(order_key(prefix, key), str(payload))
    deadline = time.monotonic() + budget
    while not task.singleton.cancelled and time.monotonic() < deadline:
        time.sleep(0.02)
    if task.singleton.cancelled:
        seconds, micros = client.time()
        client.rpush(f"{prefix}seen:{key}", f"{payload} {int(seconds) * 1_000_000 + int(micros)}")
        if pause:
            client.blpop([f"{key}:go"], timeout=30)
    record_end(client, hkey, exec_id)
    if stop and task.singleton.cancelled:
        task.singleton.end_cancelled()
    return {"payload": payload, "cancelled": task.singleton.cancelled}


@app.task(
    bind=True,
    base=SingletonTask,
    name="q.latest",
    singleton_key_args=("key",),
    singleton_on_duplicate="cancel",
)
def latest(  # noqa: PLR0917 - the call, and what it does when asked to stop
    self: Any,
    key: str,
    payload: Any = None,
    stop: bool = True,
    budget: float = 20.0,
    pause: bool = False,
) -> Any:
    """Runs until a newer call of ``key`` asks it to stop (then ends cancelled, with ``stop``;
    with ``pause`` once the test lets it go), or ``budget`` seconds."""
    return _until_cancelled(self, key, payload, stop, budget, pause)


if os.environ.get("SINGLETON_TEST_TERMINATES", "1") == "1":  # a solo or threads worker: "0"

    @app.task(
        bind=True,
        base=SingletonTask,
        name="q.latest_hard",
        singleton_key_args=("key",),
        singleton_on_duplicate="cancel",
        singleton_cancel_grace=1.0,
    )
    def latest_hard(self: Any, key: str, payload: Any = None, seconds: float = 30.0) -> Any:
        """Never checks for a stop request: a newer call's stop check terminates it after 1 s
        (a worker whose pool cannot terminate a run refuses it at start)."""
        return _run(self, key, seconds, payload)


@app.task(
    bind=True,
    base=SingletonTask,
    name="q.latest_publish",
    singleton_key_args=("key",),
    singleton_on_duplicate="cancel",
    singleton_lock_on="publish",
)
def latest_publish(self: Any, key: str, payload: Any = None, seconds: float = 0.0) -> Any:
    """``q.latest`` deduplicated at publish too: a newer call replaces a queued one."""
    return _run(self, key, seconds, payload)
