"""The demo's Celery app: one SingletonTask, ``sync_account``, that takes longer than its ttl.

Configured from the environment, so the demo driver and its worker processes share one
private space on one Redis:

- ``DEMO_REDIS_URL`` (else ``REDIS_URL``, else ``redis://127.0.0.1:6379/0``): broker, result
  backend and lock store;
- ``DEMO_PREFIX`` (default ``demo:``): prefix of every key the demo writes: kombu's queues,
  Celery's results (``global_keyprefix``), the locks and the execution log.

Run a worker by hand with::

    DEMO_REDIS_URL=redis://localhost:6379/0 celery -A examples.demo_app worker -c 2

and send duplicates from a Python shell with ``sync_account.delay(1)``.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery

from celery_singleton_lock import SingletonTask

REDIS_URL = (
    os.environ.get("DEMO_REDIS_URL") or os.environ.get("REDIS_URL") or "redis://127.0.0.1:6379/0"
)
PREFIX = os.environ.get("DEMO_PREFIX") or "demo:"
QUEUE = "demo"
#: The Redis list every execution appends one JSON record to (start, end, token, node).
EXECUTIONS_KEY = f"{PREFIX}executions"
#: Lock ttl in seconds: shorter than a run, so only renewal keeps the lock held.
TTL = 1.0
#: How long one run of ``sync_account`` takes, in seconds.
RUN_SECONDS = 1.5

app = Celery("examples.demo_app")
app.conf.update(
    broker_url=REDIS_URL,
    result_backend=REDIS_URL,
    broker_transport_options={"global_keyprefix": PREFIX},
    result_backend_transport_options={"global_keyprefix": PREFIX},
    broker_connection_retry_on_startup=True,
    task_default_queue=QUEUE,
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
    result_expires=600,
    worker_prefetch_multiplier=1,
    # the lock settings (all optional: these are the demo's choices)
    singleton_redis_url=REDIS_URL,
    singleton_key_prefix=f"{PREFIX}lock:",
    singleton_ttl=TTL,
)

_clients: dict[tuple[int, str], redis.Redis] = {}


def client() -> redis.Redis:
    """One redis-py client per process (pool children get their own)."""
    key = (os.getpid(), REDIS_URL)
    if key not in _clients:
        _clients[key] = redis.Redis.from_url(REDIS_URL)
    return _clients[key]


def server_time_us(conn: redis.Redis) -> int:
    """The Redis server's clock in microseconds: one clock for every worker process."""
    seconds, micros = conn.time()
    return int(seconds) * 1_000_000 + int(micros)


@app.task(bind=True, base=SingletonTask, name="demo.sync_account")  # type: ignore[untyped-decorator]
def sync_account(self: Any, account_id: int, seconds: float = RUN_SECONDS) -> dict[str, Any]:
    """Pretend to sync one account for ``seconds``; never runs twice at once per account.

    The lock key is built from every argument with defaults applied, so ``sync_account(1)``,
    ``sync_account(account_id=1)`` and ``sync_account(1, seconds=1.5)`` are one key.
    """
    conn = client()
    start_us = server_time_us(conn)
    token = self.singleton.fencing_token
    time.sleep(seconds)
    end_us = server_time_us(conn)
    renewals = conn.hget(self.singleton.key, "renewals") if self.singleton.key else None
    record = {
        "account_id": account_id,
        "task_id": self.request.id,
        "node": self.request.hostname,
        "pid": os.getpid(),
        "token": token,
        "start_us": start_us,
        "end_us": end_us,
        "renewals": int(renewals or 0),
        "lost": self.singleton.lost,
    }
    conn.rpush(EXECUTIONS_KEY, json.dumps(record))
    return record
