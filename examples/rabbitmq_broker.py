"""RabbitMQ as the broker, Redis as the lock store.

The lock lives in Redis whatever the broker is: with a non-Redis broker, name the lock's Redis
with ``singleton_redis_url`` (without it the locks would go to ``redis://localhost:6379/0``).
Nothing else changes: the lock is taken on the worker, so every message RabbitMQ delivers,
redelivered ones included, goes through it.

Environment (so the test can use private names): ``EXAMPLE_AMQP_URL`` (default
``amqp://guest:guest@127.0.0.1:5672//``), ``EXAMPLE_REDIS_URL`` (default
``redis://localhost:6379/0``), ``EXAMPLE_QUEUE`` (default ``singleton-example``) and
``EXAMPLE_PREFIX`` (the Redis key prefix, default ``amqp-example:``).

Run a worker with ``celery -A examples.rabbitmq_broker worker -c 2``.
"""

from __future__ import annotations

import os
import time
from typing import Any

from celery import Celery

from celery_singleton_lock import SingletonTask

AMQP_URL = os.environ.get("EXAMPLE_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//")
REDIS_URL = os.environ.get("EXAMPLE_REDIS_URL", "redis://localhost:6379/0")
QUEUE = os.environ.get("EXAMPLE_QUEUE", "singleton-example")
PREFIX = os.environ.get("EXAMPLE_PREFIX", "amqp-example:")

app = Celery("examples.rabbitmq_broker")
app.conf.update(
    broker_url=AMQP_URL,
    result_backend=REDIS_URL,  # results anywhere; Redis here so skip_info() can read them
    result_backend_transport_options={"global_keyprefix": PREFIX},
    task_default_queue=QUEUE,
    broker_connection_retry_on_startup=True,
    task_acks_late=True,  # RabbitMQ redelivers a killed worker's message; the lock guards it
    task_reject_on_worker_lost=True,
    # on a lost broker connection, stop late-acked runs: the broker redelivers them
    worker_cancel_long_running_tasks_on_connection_loss=True,
    worker_prefetch_multiplier=1,
    singleton_redis_url=REDIS_URL,  # required: the broker is not Redis
    singleton_key_prefix=f"{PREFIX}lock:",
    singleton_ttl=10,
)


@app.task(bind=True, base=SingletonTask)  # type: ignore[untyped-decorator]
def import_feed(self: Any, feed: str, seconds: float = 1.0) -> dict[str, Any]:
    """Import one feed; the same feed is never imported twice at once."""
    time.sleep(seconds)
    return {"feed": feed, "token": self.singleton.fencing_token}


@app.task(bind=True, base=SingletonTask, singleton_lock_on="publish")  # type: ignore[untyped-decorator]
def refresh_feed(self: Any, feed: str, seconds: float = 1.0) -> dict[str, Any]:
    """Deduplicated where it is published too: a second ``delay()`` of the same feed while one is
    queued or running returns that one's result instead of publishing again (the queued marker
    lives in the lock's Redis, beside the lock; RabbitMQ only carries the message)."""
    time.sleep(seconds)
    return {"feed": feed, "token": self.singleton.fencing_token}
