"""A tiny Celery app for the test bed's self-test (placeholder until the library's test apps).

Configured from the environment so a worker subprocess and the test share one private space:

- ``SINGLETON_TEST_REDIS_URL``: broker and result backend (default ``redis://127.0.0.1:6379/0``);
- ``SINGLETON_TEST_PREFIX``: prefix of every broker and result key (kombu's and celery's
  ``global_keyprefix`` transport option), and of the history list;
- ``SINGLETON_TEST_QUEUE``: the default queue name;
- ``SINGLETON_TEST_TASK_LOG_FORMAT``: the worker's ``worker_task_log_format``, when set.

Run a worker with ``celery -A tests.support.basic_app worker``; build the same app in the test
process with :func:`make_app` and the same three values.
"""

from __future__ import annotations

import gc
import os
import time
from typing import Any

import redis
from celery import Celery

from tests.support.history import record_end, record_start

#: the test apps, by the module name ``celery -A`` takes (worker and beat processes)
BASIC_APP = "tests.support.basic_app"
SINGLETON_APP = "tests.support.singleton_app"
BEAT_APP = "tests.support.beat_app"

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_PREFIX = "cslt:default:"
DEFAULT_QUEUE = "cslt-testbed"
RECORD_TASK = "tests.support.basic_app.record"
HISTORY_SUFFIX = "history"

__test__ = False  # a helper module: never collected

_clients: dict[str, redis.Redis] = {}


def history_key(prefix: str) -> str:
    """The history list the ``record`` task appends to, for a given prefix."""
    return f"{prefix}{HISTORY_SUFFIX}"


def _client(url: str) -> redis.Redis:
    # redis-py pools reset themselves after fork, so one client per process is enough
    if url not in _clients:
        _clients[url] = redis.Redis.from_url(url)
    return _clients[url]


def make_app(
    redis_url: str | None = None,
    prefix: str | None = None,
    queue: str | None = None,
    *,
    set_as_current: bool = False,
) -> Celery:
    """A Celery app whose broker keys, result keys and queue are private to ``prefix``."""
    redis_url = redis_url or os.environ.get("SINGLETON_TEST_REDIS_URL") or DEFAULT_REDIS_URL
    prefix = prefix or os.environ.get("SINGLETON_TEST_PREFIX") or DEFAULT_PREFIX
    queue = queue or os.environ.get("SINGLETON_TEST_QUEUE") or DEFAULT_QUEUE

    app = Celery("tests.support.basic_app", set_as_current=set_as_current)
    app.conf.update(
        broker_url=redis_url,
        result_backend=redis_url,
        broker_transport_options={"global_keyprefix": prefix},
        result_backend_transport_options={"global_keyprefix": prefix},
        broker_connection_retry_on_startup=True,
        task_default_queue=queue,
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        result_expires=3600,
        worker_hijack_root_logger=False,
        worker_prefetch_multiplier=1,
    )
    task_log_format = os.environ.get("SINGLETON_TEST_TASK_LOG_FORMAT")
    if task_log_format:
        app.conf.worker_task_log_format = task_log_format
    app.conf.singleton_test_prefix = prefix
    app.conf.singleton_test_redis_url = redis_url

    @app.task(name=RECORD_TASK, bind=True, shared=False)
    def record(self: Any, sleep_s: float = 0.0, key: str = "testbed", token: Any = None) -> str:
        """Record start, sleep ``sleep_s`` seconds, record end; return the execution id."""
        client = _client(redis_url)
        hkey = history_key(prefix)
        exec_id = record_start(client, hkey, key, token, str(self.request.hostname), os.getpid())
        time.sleep(sleep_s)
        record_end(client, hkey, exec_id)
        return exec_id

    return app


def close_app(app: Celery) -> None:
    """Close a client app and its result backend's connections, the pub/sub one included.

    ``app.close()`` alone leaves the result consumer's pub/sub connection (opened by
    ``AsyncResult.get``) to the garbage collector, which closes its socket in whichever later
    test it runs: a ResourceWarning, an error under ``filterwarnings = error``. The collection
    first lets AsyncResults left in reference cycles unsubscribe now.
    """
    gc.collect()
    backend = app._backend  # None when this thread never used a backend: nothing to close
    if backend is not None:
        # Results still waited on (a group's or a chord's members, read without the pub/sub
        # channel) are held by the backend; freed after the channel is closed, each would
        # unsubscribe through a new connection that nobody closes.
        for waiters in [*getattr(backend, "_pending_results", ((),))[0].values()]:
            for result in list(waiters.values()):
                backend.remove_pending_result(result)
        consumer = getattr(backend, "result_consumer", None)
        if consumer is not None:
            consumer.stop()
        client = getattr(backend, "client", None)
        if client is not None:
            client.connection_pool.disconnect()
    app.close()


app = make_app()
