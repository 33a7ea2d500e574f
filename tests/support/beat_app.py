"""The Celery app the beat tests run as real ``celery beat`` and ``celery worker`` processes.

Configured from the environment like ``test_app``. The schedule has a 1 s interval entry
and an every-minute crontab entry, both recording every execution with the run label
(``<entry>@<run id>``) that SingletonScheduler puts in the message headers, plus an entry
for a task the beat process does not know (``SINGLETON_TEST_ROLE=beat`` leaves it
unregistered, so beat publishes it through ``send_task``).

``SINGLETON_TEST_BEAT_MODE`` selects "active" (default) or "leader";
``SINGLETON_TEST_BEAT_LEASE`` the leader lease.
"""

from __future__ import annotations

import os
from typing import Any

from celery.schedules import crontab

from tests.support.history import record_end, record_start
from tests.support.test_app import _client, history_key, make_app

__test__ = False

app = make_app()
app.main = "tests.support.beat_app"
app.conf.singleton_redis_url = app.conf.singleton_test_redis_url
app.conf.singleton_key_prefix = app.conf.singleton_test_prefix + "lock:"
app.conf.singleton_beat_mode = os.environ.get("SINGLETON_TEST_BEAT_MODE", "active")
app.conf.singleton_beat_lease = float(os.environ.get("SINGLETON_TEST_BEAT_LEASE", "3"))
app.conf.beat_scheduler = "celery_singleton_lock.SingletonScheduler"
app.conf.beat_schedule = {
    "every-second": {"task": "b.record", "schedule": 1.0, "args": ("every-second",)},
    "every-minute": {"task": "b.record", "schedule": crontab(), "args": ("every-minute",)},
    "remote-every-2s": {"task": "b.remote", "schedule": 2.0, "args": ("remote-every-2s",)},
}


def _record(task: Any, entry: str) -> str:
    client = _client(app.conf.singleton_test_redis_url)
    run = str(task.request.get("singleton_beat_run") or f"{entry}@?")
    exec_id = record_start(
        client,
        history_key(app.conf.singleton_test_prefix),
        run,
        None,
        str(task.request.hostname),
        os.getpid(),
    )
    record_end(client, history_key(app.conf.singleton_test_prefix), exec_id)
    return run


@app.task(bind=True, name="b.record")
def record(self: Any, entry: str) -> str:
    """Record one execution of a scheduled run, keyed by its run label."""
    return _record(self, entry)


if os.environ.get("SINGLETON_TEST_ROLE") != "beat":

    @app.task(bind=True, name="b.remote")
    def remote(self: Any, entry: str) -> str:
        """Known to workers only: beat publishes it with send_task."""
        return _record(self, entry)


# ``SINGLETON_TEST_LOCK_URL``: a different Redis URL for the run claims than the broker's (the
# banner test gives one with a password, which the banner must hide).
if os.environ.get("SINGLETON_TEST_LOCK_URL"):
    app.conf.singleton_redis_url = os.environ["SINGLETON_TEST_LOCK_URL"]
