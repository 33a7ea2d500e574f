"""A broker given by the ``CELERY_BROKER_URL`` environment variable, as a real worker gets it:
the locks go to that broker's Redis (not to ``redis://localhost:6379/0``), and an acks_late
task's default completion_ttl follows that broker's visibility_timeout."""

from __future__ import annotations

import pytest
import redis

from celery_singleton_lock.core.completion import done_key
from tests.support.env_broker_app import HOLD_TASK, VISIBILITY_S, make_app
from tests.support.servers import RedisServer
from tests.support.waiting import wait_for
from tests.support.workers import WorkerFactory

ENV_BROKER_APP = "tests.support.env_broker_app"


@pytest.mark.parametrize("pool", ["prefork", "solo"])
def test_locks_go_to_the_broker_of_celery_broker_url(
    private_redis: RedisServer,
    worker_factory: WorkerFactory,
    key_prefix: str,
    redis_client: redis.Redis,
    pool: str,
) -> None:
    """A worker whose app names no broker, started with CELERY_BROKER_URL pointing at a private
    server (db 3): the lock of a run, then its completion record, are in that server's db 3,
    nothing under the test's prefix in the shared Redis; the banner says so, and the record
    lives visibility_timeout + 300 s, not the 3600 s a broker-less default gives."""
    broker = f"redis://127.0.0.1:{private_redis.port}/3"
    client = make_app(key_prefix, broker=broker)
    locks = redis.Redis.from_url(broker)
    try:
        worker = worker_factory.start(
            ENV_BROKER_APP, pool=pool, concurrency=1, env={"CELERY_BROKER_URL": broker}
        )
        worker.wait_ready(client)
        task = client.tasks[HOLD_TASK]
        until = f"{key_prefix}until"
        lock_key = task.singleton_keys(("k", until), {}).lock
        task_id = task.apply_async(("k", until)).id

        wait_for(lambda: locks.exists(lock_key), 30, "the lock in the broker's Redis", worker)
        assert not list(redis_client.scan_iter(count=1000, match=f"{key_prefix}*")), (
            "a lock on the shared Redis"
        )
        log = worker.log_text()
        assert f".> redis:           {broker}\n" in log
        expected_ttl = VISIBILITY_S + 300
        assert (
            f".> completion_ttl:  acks_late tasks: {expected_ttl}s (visibility_timeout + 300s)\n"
            in log
        )

        locks.rpush(until, "go")
        done = done_key(lock_key, task_id)
        wait_for(lambda: locks.exists(done), 30, "the run's completion record", worker)
        assert 3600 < locks.ttl(done) <= expected_ttl
        assert not locks.exists(lock_key)
    finally:
        locks.close()
        client.close()
