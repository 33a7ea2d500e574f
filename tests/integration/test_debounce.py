"""``singleton_debounce`` on real workers, two worker processes (a prefork and a threads one)
sharing the queue: a burst of calls runs once, after it, with the last call's arguments,
whichever way it was sent (``delay``, ``send_task``, a chain's first step); the earlier calls
end as skipped duplicates naming a later call, their chains stopped; a burst that keeps going
runs at its cap; a self.retry() of a burst's run is not debounced again."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery, chain

from celery_singleton_lock import SingletonTask, skip_info
from celery_singleton_lock.beat.claims import CLAIM_HEADER, KEEP_HEADER, RUN_HEADER
from celery_singleton_lock.testing import isolated_locks
from tests.support.bed import Bed, new_key
from tests.support.history import check_history
from tests.support.servers import RedisServer
from tests.support.singleton_app import DEBOUNCE_MAX_S, DEBOUNCE_S
from tests.support.waiting import wait_for


def debounced(bed: Bed, key: str) -> list[tuple[str, float]]:
    """The values ``key``'s runs ran with, and when, in order."""
    raw = bed.client.lrange(f"{bed.prefix}debounce:{key}", 0, -1)
    return [(v, float(t)) for v, _, t in (r.decode().partition("|") for r in raw)]


@pytest.fixture(scope="module")
def bed(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, module_prefix: str
) -> Iterator[Bed]:
    """Two workers sharing the module's queue, a prefork and a threads one, for the module's
    tests."""
    queue = f"debounce-{uuid.uuid4().hex[:6]}"
    with Bed(redis_url, module_prefix, tmp_path_factory.mktemp("debounce"), queue=queue) as made:
        for worker in [made.start(pool=pool, ready=False) for pool in ("prefork", "threads")]:
            worker.wait_ready(made.app)
        yield made


def _beat_headers(app: Celery, value: Any) -> dict[str, Any]:
    """The headers of a message SingletonScheduler published (a run of its own each)."""
    run = f"{app.conf.singleton_test_prefix}claim:{uuid.uuid4().hex}"
    return {RUN_HEADER: f"entry@{value}", CLAIM_HEADER: run, KEEP_HEADER: 60_000}


#: how a test sends a call of ``t.debounce``: by the task's own apply_async, by name, as beat
#: publishes it, or as a chain's first step (its next step records what it got)
SENDERS: dict[str, Callable[[Celery, str, str, Any], Any]] = {
    "delay": lambda app, task, key, value: app.signature(task, (key, value)).delay(),
    "send_task": lambda app, task, key, value: app.send_task(task, args=(key, value)),
    "beat": lambda app, task, key, value: app.send_task(
        task, args=(key, value), headers=_beat_headers(app, value)
    ),
    "chain": lambda app, task, key, value: chain(
        app.signature(task, (key, value)), app.signature("t.join_next", kwargs={"tag": key})
    )(),
}


@pytest.mark.slow(seconds=4)
@pytest.mark.parametrize("how", sorted(SENDERS))
def test_a_burst_runs_once_after_it_with_the_last_arguments(bed: Bed, how: str) -> None:
    """Five calls 0.1 s apart: one run, with the fifth call's value, at least the window after
    it; the four others end as skipped duplicates naming a later call of the burst; in a chain
    only the last call's next step runs, the others' chains end with the skip marker."""
    key, send = new_key(), SENDERS[how]
    results = []
    for value in range(5):
        last_sent = time.time()  # the fifth call is made after this (a sleep may oversleep)
        results.append(send(bed.app, "t.debounce", key, f"v{value}"))
        time.sleep(0.1)
    last = results[-1]
    if how == "chain":
        assert last.get(timeout=20) == ["v4", key]
        assert last.parent.get(timeout=5) == "v4"
    else:
        assert last.get(timeout=20) == "v4"
    assert skip_info(last if how != "chain" else last.parent) is None
    ids = [(r.parent if how == "chain" else r).id for r in results]
    for index, result in enumerate(results[:-1]):
        info = skip_info(result.get(timeout=20))
        assert info is not None, result.result
        assert info.task_id == ids[index]
        assert info.superseded_by == info.holder
        assert info.superseded_by in ids[index + 1 :]
    ran = debounced(bed, key)
    assert [value for value, _ in ran] == ["v4"]
    assert ran[0][1] >= last_sent + DEBOUNCE_S - 0.05  # not before its window ended
    superseded = [f"singleton: debounced call superseded: t.debounce[{i}]" for i in ids[:-1]]
    wait_for(
        lambda: all(line in bed.log_text() for line in superseded), 10, "the lines", *bed.workers
    )
    report = check_history(bed.history())
    assert report.ok, report.summary()


@pytest.mark.slow(seconds=6)
def test_a_burst_that_keeps_going_runs_at_its_cap(bed: Bed) -> None:
    """Calls every 0.3 s (within the window of each other) go on until the burst runs: it
    runs although the calls never stopped, at its cap, with the latest call made before it.
    Once they stop, the calls made after that run form a burst of their own, run with the
    last one."""
    key = new_key()
    first = time.time()
    sent: list[tuple[str, float]] = []
    deadline = first + 3 * DEBOUNCE_MAX_S
    while not debounced(bed, key) and time.time() < deadline:
        sent.append((f"v{len(sent)}", time.time()))
        bed.app.send_task("t.debounce_cap", args=(key, sent[-1][0]))
        time.sleep(0.3)
    runs = debounced(bed, key)
    assert runs, bed.log_text()
    value, ran_at = runs[0]
    assert ran_at >= first + DEBOUNCE_MAX_S - 0.05  # the cap, not before
    assert value in [v for v, at in sent if at <= ran_at]
    final = bed.app.send_task("t.debounce_cap", args=(key, "last"))
    assert final.get(timeout=20) == "last"
    assert [v for v, _ in debounced(bed, key)][-1] == "last"
    # the calls made after the cap's run and "last" form one burst (a third run only if the
    # machine stalled the test for a whole window between two sends)
    assert len(debounced(bed, key)) in (2, 3)


def test_calls_of_other_keys_do_not_supersede_each_other(bed: Bed) -> None:
    """Two keys called at once, three times each: each runs once, with a value of its own,
    and its other calls are superseded by calls of the same key. (Calls sent at the same
    instant reach the two workers in either order: which is last is the worker's order.)"""
    keys = (new_key(), new_key())
    sent = {
        k: [bed.app.send_task("t.debounce", args=(k, f"{k}-{i}")) for i in range(3)] for k in keys
    }
    for key, results in sent.items():
        values = [r.get(timeout=20) for r in results]
        ran = [v for v in values if skip_info(v) is None]
        assert len(ran) == 1, values
        assert [v for v, _ in debounced(bed, key)] == ran
        ids = {r.id for r in results}
        for value in values:
            info = skip_info(value)
            assert info is None or (info.superseded_by in ids and info.task_id in ids), value


def test_a_retry_of_the_bursts_run_is_not_debounced_again(bed: Bed) -> None:
    """The run calls self.retry() (retries 1): the retried message runs at once."""
    key = new_key()
    result = bed.app.send_task("t.debounce_retry", args=(key, "v"))
    assert result.get(timeout=20) == "v"
    wait_for(lambda: f"Task t.debounce_retry[{result.id}] succeeded" in bed.log_text(), 10)
    logs = bed.log_text()
    assert (
        logs.count(
            f"singleton: debounced, runs in 0.8s unless called again: t.debounce_retry[{result.id}]"
        )
        == 1
    ), logs
    assert logs.count(f"singleton: debounced call runs: t.debounce_retry[{result.id}]") == 1


def test_a_call_whose_message_expires_while_it_waits_ends_revoked(bed: Bed) -> None:
    """Its copy carries its ``expires``: Celery ends it as an expired message; the burst, whose
    latest call it was, does not run."""
    key = new_key()
    result = bed.app.send_task("t.debounce", args=(key, "v"), expires=DEBOUNCE_S / 2)
    wait_for(lambda: result.state == "REVOKED", 20, "the expiry", *bed.workers)
    assert debounced(bed, key) == []


def test_a_bursts_run_that_meets_the_lock_waits_for_it_under_retry_not_debounced_again(
    bed: Bed,
) -> None:
    """The second burst's run comes due while the first one's still holds the lock: under
    "retry" it is requeued until the lock is free (the requeue is the same call: it keeps the
    debounce header, and is not debounced again), then runs."""
    key = new_key()
    first = bed.app.send_task("t.debounce_wait", args=(key, "a", 1.5))
    wait_for(lambda: debounced(bed, key), 20, "the first burst's run", *bed.workers)
    second = bed.app.send_task("t.debounce_wait", args=(key, "b"))
    assert first.get(timeout=20) == "a"
    assert second.get(timeout=20) == "b"
    assert [v for v, _ in debounced(bed, key)] == ["a", "b"]
    logs = bed.log_text()
    assert f"singleton: duplicate retried in 0.2s: t.debounce_wait[{second.id}]" in logs, logs
    assert logs.count(f"unless called again: t.debounce_wait[{second.id}]") == 1, logs
    report = check_history(bed.history())
    assert report.ok, report.summary()


@pytest.mark.slow(seconds=12)
def test_a_waiting_burst_survives_its_worker_killed(
    tmp_path: Path, redis_url: str, key_prefix: str
) -> None:
    """The only worker holds every waiting copy of a burst (3 s window) when it is SIGKILLed.
    The broker gives them back after its visibility timeout (2 s) to a new worker: the burst
    runs once, with its last call, and the others end superseded."""
    env = {"SINGLETON_TEST_VISIBILITY": "2"}
    with Bed(redis_url, key_prefix, tmp_path, env=env) as own:
        doomed = own.start(pool="threads")
        key = new_key()
        results = [own.send("t.debounce_long", key, f"v{i}") for i in range(3)]
        waiting = [f"unless called again: t.debounce_long[{r.id}]" for r in results]
        wait_for(lambda: all(w in doomed.log_text() for w in waiting), 10, "the waits", doomed)
        doomed.kill()
        own.start(pool="threads")
        assert results[-1].get(timeout=30) == "v2"
        for result in results[:-1]:
            info = skip_info(result.get(timeout=10))
            assert info is not None
            assert info.superseded_by == results[-1].id
        assert [v for v, _ in debounced(own, key)] == ["v2"]


def test_eager_calls_run_at_once(redis_url: str, redis_client: redis.Redis) -> None:
    """Under task_always_eager the call is the run: no queue to wait in, each runs at once
    under its lock, and nothing of debounce is written."""
    app = Celery("eager-debounce", broker="memory://", set_as_current=False)
    app.conf.task_always_eager = True
    app.conf.singleton_redis_url = redis_url

    @app.task(bind=True, base=SingletonTask, name="e.debounce", shared=False, singleton_debounce=5)
    def debounced(self: Any, key: str, value: str) -> tuple[str, int]:
        return value, self.singleton.fencing_token

    try:
        with isolated_locks(app) as prefix:
            ran = [debounced.delay("k", f"v{i}").get() for i in range(3)]
            assert [value for value, _ in ran] == ["v0", "v1", "v2"]
            assert all(token > 0 for _, token in ran)
            assert list(redis_client.scan_iter(count=1000, match=f"{prefix}*:debounce")) == []
    finally:
        app.close()


@pytest.mark.slow(seconds=8)
def test_a_call_waits_for_the_lock_redis_to_come_back(
    tmp_path: Path, redis_url: str, key_prefix: str, private_redis: RedisServer
) -> None:
    """The locks' Redis is down when the call arrives: under on_redis_error="fail" its message
    comes back every retry_countdown, nothing runs; once Redis is back it is debounced and
    runs, once."""
    env = {"SINGLETON_TEST_LOCK_URL": private_redis.url, "SINGLETON_TEST_RETRY_COUNTDOWN": "0.3"}
    with Bed(redis_url, key_prefix, tmp_path, env=env) as own:
        worker = own.start(pool="threads")
        private_redis.stop()
        key = new_key()
        result = own.send("t.debounce", key, "v")
        retried = f"singleton: redis error on debounce, retrying in 0.3s: t.debounce[{result.id}]"
        wait_for(lambda: worker.log_text().count(retried) >= 2, 15, "2 requeues", worker)
        assert debounced(own, key) == []
        private_redis.restart()
        assert result.get(timeout=20) == "v"
        assert [v for v, _ in debounced(own, key)] == ["v"]
        runs = f"singleton: debounced, runs in 0.8s unless called again: t.debounce[{result.id}]"
        assert runs in worker.log_text()
