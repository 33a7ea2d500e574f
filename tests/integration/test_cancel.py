"""``singleton_on_duplicate="cancel"`` (latest wins) on real workers: a newer call asks the
running holder to stop and runs after its release; the holder sees the request within one
renewal interval, with no round trip of its own, and may end cancelled (REVOKED, no link); the
calls that waited before the newest end as skips naming it; with ``singleton_cancel_grace`` a
holder that never checks is terminated; under publish-time dedup a newer call takes the place
of an older one still queued, which never runs; a threads worker refuses the grace at start.

One prefork worker (two pool processes) and a gevent and a threads worker share the module.
The lock ttl is 2 s: a renewal every 0.67 s.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery.exceptions import TaskRevokedError

from celery_singleton_lock import SingletonTask, skip_info
from celery_singleton_lock.core.keys import derive_keys, queued_key
from celery_singleton_lock.core.queue import queue_keys
from tests.support.basic_app import close_app, history_key, make_app
from tests.support.bed import Bed, new_key
from tests.support.history import check_history, load_history
from tests.support.queue_app import order_key
from tests.support.waiting import wait_for
from tests.support.workers import WorkerProcess

QUEUE_APP = "tests.support.queue_app"
TTL_S = 2.0
#: how long after the newer call reached a worker the holder may learn of it: one renewal
#: interval (ttl / 3), and the holder's own poll of its flag and a loaded machine's slack
SEEN_WITHIN_S = TTL_S / 3 + 0.5


@pytest.fixture(scope="module")
def bed(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, module_prefix: str
) -> Iterator[Bed]:
    """A prefork worker on the default queue, a gevent and a threads worker on their own."""
    with Bed(redis_url, module_prefix, tmp_path_factory.mktemp("cancel")) as made:
        made.start(QUEUE_APP, pool="prefork", concurrency=2, ttl=TTL_S)
        made.start(
            QUEUE_APP, pool="gevent", concurrency=4, ttl=TTL_S, queues=_pool_queue(made, "gevent")
        )
        made.start(
            QUEUE_APP,
            pool="threads",
            concurrency=4,
            ttl=TTL_S,
            queues=_pool_queue(made, "threads"),
            env={"SINGLETON_TEST_TERMINATES": "0"},
        )
        yield made


def _pool_queue(bed: Bed, pool: str) -> str:
    return f"{bed.app.conf.task_default_queue}-{pool}"


def _worker(bed: Bed, pool: str) -> WorkerProcess:
    return next(w for w in bed.workers if w.pool == pool)


def _signature(key: str, payload: object = None, stop: bool = True, budget: float = 0) -> None:
    """The signature the test app's tasks key on (``key`` only)."""


def _lock(prefix: str, task: str, key: str) -> str:
    return derive_keys(f"{prefix}lock:", task, _signature, (key,), {}, ("key",)).lock


def _order(client: redis.Redis, prefix: str, key: str) -> list[str]:
    return [v.decode() for v in client.lrange(order_key(prefix, key), 0, -1)]


def _queue_for(bed: Bed, pool: str) -> dict[str, str]:
    return {} if pool == "prefork" else {"queue": _pool_queue(bed, pool)}


@pytest.mark.slow(seconds=6)
@pytest.mark.parametrize("pool", ["prefork", "gevent", "threads"])
def test_a_newer_call_stops_the_holder_and_runs_after_it(bed: Bed, pool: str) -> None:
    """The holder sees the stop request within one renewal interval of the newer call
    reaching its key, ends cancelled (REVOKED, its link not called); the newer call then runs
    with its own outcome. Never two runs at once."""
    app, client, module_prefix = bed.app, bed.client, bed.prefix
    worker = _worker(bed, pool)
    key = new_key()
    lock = _lock(module_prefix, "q.latest", key)
    route = _queue_for(bed, pool)
    link = app.signature("q.after", kwargs={"tag": key})
    holder = app.signature("q.latest", (key, "old")).apply_async(link=link, **route)
    wait_for(lambda: _order(client, module_prefix, key), 20, "the holder's start", worker)
    newer = app.signature("q.latest", (key, "new", True, 0.3)).apply_async(link=link, **route)
    reached = wait_for(
        lambda: client.hget(lock, "cancel") and client.time(), 10, "the stop request", worker
    )
    asked_us = int(reached[0]) * 1_000_000 + int(reached[1])
    with pytest.raises(TaskRevokedError):
        holder.get(timeout=20)
    assert holder.state == "REVOKED"
    assert newer.get(timeout=20) == {"payload": "new", "cancelled": False}
    seen = client.lrange(f"{module_prefix}seen:{key}", 0, -1)
    assert len(seen) == 1, seen
    seen_us = int(seen[0].split()[1])
    assert seen_us - asked_us <= SEEN_WITHIN_S * 1_000_000, (seen_us - asked_us) / 1e6
    assert _order(client, module_prefix, key) == ["old", "new"]
    history = [e for e in load_history(client, history_key(module_prefix)) if e.key == key]
    report = check_history(history)
    assert report.ok, report.summary()
    links = wait_for(
        lambda: [
            v for v in client.lrange(module_prefix + "after", 0, -1) if v.startswith(key.encode())
        ],
        10,
        "the newer call's link",
    )
    assert [v.decode() for v in links] == [f"{key}:new"]  # never the cancelled holder's
    wait_for(lambda: not client.exists(lock, *queue_keys(lock)), 10, "the key released", worker)


@pytest.mark.slow(seconds=6)
def test_the_calls_that_waited_end_as_skips_naming_the_newest(bed: Bed) -> None:
    """A holder that finishes anyway (it does not end cancelled); three calls come while it
    runs: each of the first two ends skipped, naming the newer call that took its place, and
    the last runs after the holder."""
    app, client, module_prefix = bed.app, bed.client, bed.prefix
    worker = _worker(bed, "prefork")
    key = new_key()
    lock = _lock(module_prefix, "q.latest", key)
    holder = app.send_task("q.latest", (key, "holder", False, 3.0))
    wait_for(lambda: _order(client, module_prefix, key), 20, "the holder's start", worker)
    calls = []
    for i in range(3):
        calls.append(app.send_task("q.latest", (key, f"c{i}", True, 0.1)))
        wait_for(
            lambda c=calls[-1]: client.zscore(queue_keys(lock)[0], c.id) is not None,
            10,
            f"call {i} waiting",
            worker,
        )
    first, second, last = calls
    for superseded, by in ((first, second), (second, last)):  # each by the next one that came
        info = skip_info(superseded.get(timeout=10))
        assert info is not None
        assert info.holder == by.id
    assert holder.get(timeout=20) == {"payload": "holder", "cancelled": True}
    assert last.get(timeout=20) == {"payload": "c2", "cancelled": False}
    assert _order(client, module_prefix, key) == ["holder", "c2"]


@pytest.mark.slow(seconds=8)
def test_a_holder_that_never_checks_is_terminated_after_the_grace(bed: Bed) -> None:
    """``singleton_cancel_grace=1``: the holder never reads the request; one second after it
    was asked, the newer call's stop check revokes it with ``terminate=True``: it ends
    REVOKED, its lock goes, and the newer call runs."""
    app, client, module_prefix = bed.app, bed.client, bed.prefix
    worker = _worker(bed, "prefork")
    key = new_key()
    holder = app.send_task("q.latest_hard", (key, "stuck", 30.0))
    wait_for(lambda: _order(client, module_prefix, key), 20, "the holder's start", worker)
    newer = app.send_task("q.latest_hard", (key, "new", 0.1))
    assert newer.get(timeout=30)["payload"] == "new"
    assert holder.state == "REVOKED"
    assert "singleton: holder did not stop within the grace, terminated: q.latest_hard" in (
        worker.log_text()
    )
    assert _order(client, module_prefix, key) == ["stuck", "new"]


@pytest.mark.slow(seconds=6)
def test_under_publish_dedup_a_newer_call_replaces_a_queued_one(bed: Bed, redis_url: str) -> None:
    """Two calls published to a queue no worker reads yet: the second takes the place of the
    first, which is revoked. Once a worker reads the queue, the first is discarded (REVOKED)
    and only the second runs."""
    app, client, module_prefix = bed.app, bed.client, bed.prefix
    worker = _worker(bed, "prefork")
    key = new_key()
    parked = f"{app.conf.task_default_queue}-parked-{key}"
    publisher = make_app(redis_url, module_prefix)  # dedup at publish: the task is the caller's
    publisher.conf.update(
        singleton_redis_url=redis_url, singleton_key_prefix=f"{module_prefix}lock:"
    )

    @publisher.task(
        bind=True,
        base=SingletonTask,
        name="q.latest_publish",
        singleton_key_args=("key",),
        singleton_on_duplicate="cancel",
        singleton_lock_on="publish",
        shared=False,
    )
    def latest_publish(self: Any, key: str, payload: Any = None, seconds: float = 0.0) -> Any:
        raise AssertionError("published only: it runs on the worker")

    try:  # the results are read through the module's app: this one is closed after
        first = app.AsyncResult(latest_publish.apply_async((key, "first"), queue=parked).id)
        second = app.AsyncResult(latest_publish.apply_async((key, "second"), queue=parked).id)
    finally:
        close_app(publisher)
    assert first.id != second.id
    marker = queued_key(_lock(module_prefix, "q.latest_publish", key))
    assert client.get(marker) == second.id.encode()
    wait_for(lambda: first.state == "REVOKED", 10, "the first call revoked", worker)
    app.control.add_consumer(parked, destination=[worker.nodename], reply=True)
    assert second.get(timeout=20)["payload"] == "second"
    assert first.state == "REVOKED"
    assert _order(client, module_prefix, key) == ["second"]
    app.control.cancel_consumer(parked, destination=[worker.nodename], reply=True)


def test_a_threads_worker_refuses_the_cancel_grace_at_start(
    bed: Bed, tmp_path: Path, redis_url: str
) -> None:
    """A holder that does not stop cannot be terminated in the threads pool: a worker of an app
    with ``singleton_cancel_grace`` refuses to start there, in one line naming the setting."""
    with Bed(redis_url, bed.prefix, tmp_path) as own:
        worker = own.start(QUEUE_APP, pool="threads", concurrency=2, ready=False)
        assert worker.wait(timeout=60) != 0
        log = worker.log_text()
        assert (
            "celery_singleton_lock: invalid setting: singleton_cancel_grace (task "
            "q.latest_hard) needs a pool that can terminate a run (prefork, gevent or "
            "eventlet), got thread"
        ) in log, log


@pytest.mark.slow(seconds=6)
def test_a_copy_of_a_cancelled_holders_message_is_dropped(bed: Bed) -> None:
    """A holder sent with a countdown (its message is one Redis may hand out again) ends
    cancelled: its end is recorded as its message's completion, so a copy of that message that
    comes later is dropped, not run, and its REVOKED result stays."""
    app, client, module_prefix = bed.app, bed.client, bed.prefix
    worker = _worker(bed, "prefork")
    key = new_key()
    holder = app.send_task("q.latest", (key, "old"), countdown=0.1)
    wait_for(lambda: _order(client, module_prefix, key), 20, "the holder's start", worker)
    newer = app.send_task("q.latest", (key, "new", True, 0.1))
    assert newer.get(timeout=20)["payload"] == "new"
    assert holder.state == "REVOKED"
    copy = app.send_task("q.latest", (key, "old"), task_id=holder.id, countdown=0.1)
    worker.wait_for_log(rf"already completed, redelivery dropped: q\.latest\[{copy.id}\]")
    assert holder.state == "REVOKED"
    assert _order(client, module_prefix, key) == ["old", "new"]


@pytest.mark.slow(seconds=6)
def test_a_newer_call_revoked_while_it_waits_withdraws_its_stop_request(bed: Bed) -> None:
    """The newer call asks the holder to stop, then is revoked before the holder ends: the
    holder's ``end_cancelled()`` finds the request void and returns, so the holder ends as it
    would have (SUCCESS); the revoked call is passed over at its turn (REVOKED, never runs)."""
    app, client, module_prefix = bed.app, bed.client, bed.prefix
    worker = _worker(bed, "prefork")
    key = new_key()
    lock = _lock(module_prefix, "q.latest", key)
    holder = app.send_task("q.latest", (key, "old", True, 20.0, True))
    wait_for(lambda: _order(client, module_prefix, key), 20, "the holder's start", worker)
    newer = app.send_task("q.latest", (key, "new", True, 0.1))
    wait_for(
        lambda: client.lrange(f"{module_prefix}seen:{key}", 0, -1), 10, "the request seen", worker
    )
    app.control.revoke(newer.id)
    wait_for(lambda: newer.state == "REVOKED", 10, "the newer call revoked", worker)
    client.rpush(f"{key}:go", 1)
    assert holder.get(timeout=20) == {"payload": "old", "cancelled": False}
    worker.wait_for_log(rf"stop request withdrawn, the newer call ended: q\.latest\[{holder.id}\]")
    assert newer.state == "REVOKED"
    assert _order(client, module_prefix, key) == ["old"]
    wait_for(lambda: not client.exists(lock, *queue_keys(lock)), 10, "the key released", worker)
