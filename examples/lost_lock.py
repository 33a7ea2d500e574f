"""A long task that notices it lost its lock, and stops before doing harm.

A lock can be lost while its task still runs: a long pause (GC, a stopped VM) or an unreachable
Redis outlasts the ttl, and another run may then take the lock. The library does not kill the
task; the renewer sets ``self.singleton.lost`` (and logs ``singleton: lock lost: ...``, sends
``signals.lock_lost``). A long task checks the flag between steps and stops, and passes the
fencing token with every write so the store refuses a write that slipped through (see
:mod:`examples.fenced_sql`).

Environment: ``EXAMPLE_REDIS_URL`` (default ``redis://localhost:6379/0``), ``EXAMPLE_PREFIX``
(key prefix, default ``lost-example:``).
"""

from __future__ import annotations

import os
import time
from typing import Any

from celery import Celery

from celery_singleton_lock import SingletonTask

REDIS_URL = os.environ.get("EXAMPLE_REDIS_URL", "redis://localhost:6379/0")
PREFIX = os.environ.get("EXAMPLE_PREFIX", "lost-example:")

app = Celery("examples.lost_lock")
app.conf.update(
    broker_url=REDIS_URL,
    result_backend=REDIS_URL,
    broker_transport_options={"global_keyprefix": PREFIX},
    result_backend_transport_options={"global_keyprefix": PREFIX},
    task_default_queue=f"{PREFIX}celery",
    broker_connection_retry_on_startup=True,
    singleton_key_prefix=f"{PREFIX}lock:",
    singleton_ttl=3,  # renewed every second
)


def write_batch(batch: int, token: int | None) -> None:
    """Stand-in for a fenced write of one batch (see examples/fenced_sql.py)."""


@app.task(bind=True, base=SingletonTask)  # type: ignore[untyped-decorator]
def export(
    self: Any, name: str, batches: int = 100, seconds_per_batch: float = 0.1
) -> dict[str, Any]:
    """Export ``batches`` batches; stop at the first batch after the lock was lost."""
    done = 0
    for batch in range(batches):
        if self.singleton.lost:  # someone else may hold the lock now: do not write any more
            break
        time.sleep(seconds_per_batch)  # the work
        write_batch(batch, self.singleton.fencing_token)
        done += 1
    return {"name": name, "done": done, "lost": self.singleton.lost, "key": self.singleton.key}
