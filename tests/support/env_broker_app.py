"""A Celery app that names no broker: a worker of it gets one from ``CELERY_BROKER_URL``.

Nor does it name ``singleton_redis_url``: its locks go where the library's broker-derived
default sends them. ``SINGLETON_TEST_PREFIX`` gives the private key prefix of its locks
(``<prefix>lock:``); its broker's ``visibility_timeout`` is :data:`VISIBILITY_S`.

Its one task, ``t.env_hold`` (acked late, keyed on ``key``), holds its lock until the test
pushes to the list ``until`` on the broker's Redis.
"""

from __future__ import annotations

import os
from typing import Any

import redis
from celery import Celery

from celery_singleton_lock import SingletonTask

__test__ = False

#: the broker's visibility timeout: an acks_late task's default completion_ttl is it + 300 s
VISIBILITY_S = 7200
HOLD_TASK = "t.env_hold"
#: t.env_hold's options: acked late, keyed on ``key``
HOLD_OPTIONS: dict[str, Any] = {
    "bind": True,
    "base": SingletonTask,
    "name": HOLD_TASK,
    "shared": False,
    "singleton_key_args": ("key",),
    "acks_late": True,
}


def make_app(prefix: str, broker: str | None = None) -> Celery:
    """The app: no broker (a worker's comes from ``CELERY_BROKER_URL``) unless the test's client
    names one; its locks under ``<prefix>lock:``."""
    app = Celery("tests.support.env_broker_app", broker=broker, set_as_current=False)
    app.conf.update(
        broker_transport_options={"visibility_timeout": VISIBILITY_S},
        broker_connection_retry_on_startup=True,
        task_serializer="json",
        accept_content=["json"],
        worker_hijack_root_logger=False,
        worker_prefetch_multiplier=1,
        singleton_key_prefix=f"{prefix}lock:",
    )

    @app.task(**HOLD_OPTIONS)
    def env_hold(self: Any, key: str, until: str) -> None:
        """Hold the lock of ``key`` until the test pushes to ``until`` (at most 60 s)."""
        client = redis.Redis.from_url(os.environ["CELERY_BROKER_URL"])
        try:  # short blocking reads: redis-py gives up on one blocked for more than 5 s
            for _ in range(60):
                if client.blpop([until], timeout=1):
                    return
        finally:
            client.close()

    return app


app = make_app(os.environ.get("SINGLETON_TEST_PREFIX", "cslt:env-broker:"))
