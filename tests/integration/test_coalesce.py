"""``singleton_on_duplicate="coalesce"`` on real worker processes: a burst of duplicates gives
exactly one follow-up run with the latest arguments, published by whoever releases the lock
(the run itself, the main process after its child was killed, a copy of the holder's message
after its lock expired); a follow-up left beside a dead holder's expired lock is superseded by
the next, newer run of the key."""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest
import redis
from celery import Celery
from celery.result import AsyncResult

from celery_singleton_lock import SkipInfo, skip_info
from celery_singleton_lock.core.backend import Acquired
from celery_singleton_lock.core.keys import derive_keys, keys_of, lock_keys
from celery_singleton_lock.core.pending import pending_key
from celery_singleton_lock.core.store import LockStore
from tests.support.basic_app import SINGLETON_APP, history_key
from tests.support.chaos import deliveries_key
from tests.support.history import (
    assert_no_overlap,
    check_history,
    load_history,
    server_time_us,
    wait_started,
)
from tests.support.store_checks import check_pending_scripts
from tests.support.waiting import wait_for
from tests.support.workers import WorkerFactory, WorkerProcess

TASK = "t.hold_coalesce"


def _signature(key: str, seconds: float = 0.0, payload: Any = None) -> None:
    """Same parameters as t.hold_coalesce."""


def _lock_key(prefix: str, key: str, task: str = TASK) -> str:
    return derive_keys(f"{prefix}lock:", task, _signature, (), {"key": key}, ("key",)).lock


def _runs(client: redis.Redis, prefix: str, key: str) -> int:
    return sum(1 for e in load_history(client, history_key(prefix)) if e.key == key)


def _coalesced(result: AsyncResult) -> str | None:
    info = skip_info(result) if result.ready() else None
    return None if info is None else info.follow_up


def _coalesce_one(  # noqa: PLR0917 - fixtures, then the call
    worker: WorkerProcess,
    client_app: Celery,
    redis_client: redis.Redis,
    key_prefix: str,
    task: str,
    key: str,
    seconds: float,
    payload: str,
) -> tuple[AsyncResult, AsyncResult, str]:
    """A holder of ``key`` (payload "held") running ``seconds``, and one duplicate coalesced
    onto it: the holder's and the duplicate's results, and the follow-up's task id."""
    holder = client_app.send_task(task, kwargs={"key": key, "seconds": seconds, "payload": "held"})
    wait_started(redis_client, history_key(key_prefix), key, worker, timeout=10)
    duplicate = client_app.send_task(task, kwargs={"key": key, "payload": payload})
    wait_for(duplicate.ready, 10, "the duplicate coalesced", worker)
    follow_up = _coalesced(duplicate)
    assert follow_up is not None
    return holder, duplicate, follow_up


def test_pending_scripts_on_one_server(redis_client: redis.Redis, key_prefix: str) -> None:
    check_pending_scripts(LockStore(redis_client), lock_keys(key_prefix, "t.c", b"one"))


@pytest.fixture
def worker(worker_factory: WorkerFactory, client_app: Celery) -> WorkerProcess:
    started = worker_factory.start(SINGLETON_APP, pool="prefork", concurrency=3)
    started.wait_ready(client_app)
    return started


#: duplicates in the burst test: "a burst of 1,000 webhooks for one account"
BURST = 1000


@pytest.mark.slow(seconds=20)
def test_burst_collapses_into_one_follow_up_with_the_latest_arguments(
    worker: WorkerProcess, client_app: Celery, redis_client: redis.Redis, key_prefix: str
) -> None:
    """1,000 duplicates met by one running holder, then one more: every one ends at once naming
    the same follow-up, and after the holder exactly one follow-up runs, with the last
    duplicate's arguments: two runs in all, not 1,002, not one."""
    key, lock = "burst", _lock_key(key_prefix, "burst")
    gate = f"{key_prefix}gate:burst"
    holder = client_app.send_task(TASK, kwargs={"key": key, "payload": "first", "until": gate})
    wait_started(redis_client, history_key(key_prefix), key, worker, timeout=10)
    with client_app.producer_or_acquire() as producer:
        burst = [
            client_app.send_task(TASK, kwargs={"key": key, "payload": f"b-{i}"}, producer=producer)
            for i in range(BURST)
        ]

    def coalesced() -> int:
        return int(redis_client.hget(pending_key(lock), "count") or 0)

    wait_for(lambda: coalesced() == BURST, 60, "the burst coalesced", worker)
    last = client_app.send_task(TASK, kwargs={"key": key, "payload": "last"})
    wait_for(lambda: coalesced() == BURST + 1, 10, "the last duplicate coalesced", worker)
    wait_for(lambda: all(r.ready() for r in [*burst, last]), 10, "every result", worker)
    assert not holder.ready()
    redis_client.rpush(gate, "go")
    # waited on for 30 s, failing with the worker's log: a get(timeout=10) timed out once, in
    # the suite's most loaded first minutes
    wait_for(holder.ready, 30, "the holder's end", worker)
    assert holder.get(timeout=1)["payload"] == "first"

    follow_ups = {_coalesced(r) for r in [*burst, last]}
    assert len(follow_ups) == 1, follow_ups
    follow_up = follow_ups.pop()
    assert follow_up is not None
    for result in [*burst[:10], last]:
        info = skip_info(result)
        assert info is not None
        assert (info.holder, info.key) == (holder.id, lock)
    ran = AsyncResult(follow_up, app=client_app)
    wait_for(ran.ready, 30, "the follow-up's run", worker)
    assert ran.get(timeout=1)["payload"] == "last"
    wait_for(lambda: not redis_client.exists(lock), 5, "the follow-up's release", worker)
    assert not redis_client.exists(pending_key(lock))
    executions = [e for e in load_history(redis_client, history_key(key_prefix)) if e.key == key]
    assert len(executions) == 2  # the holder and one follow-up
    assert all(e.finished for e in executions)
    assert_no_overlap(check_history(executions), allow_unfinished=False)
    log = worker.log_text()
    assert log.count("singleton: coalesced follow-up published after SUCCESS") == 1
    assert f"duplicates={BURST + 1}" in log
    redis_client.delete(gate)


def test_no_duplicate_no_follow_up(
    worker: WorkerProcess, client_app: Celery, redis_client: redis.Redis, key_prefix: str
) -> None:
    key, lock = "alone", _lock_key(key_prefix, "alone")
    value = client_app.send_task(TASK, kwargs={"key": key, "payload": 1}).get(timeout=10)
    assert value["payload"] == 1
    wait_for(lambda: not redis_client.exists(lock), 5, "the release", worker)
    assert not redis_client.exists(pending_key(lock))
    assert "coalesced follow-up published" not in worker.log_text()
    assert _runs(redis_client, key_prefix, key) == 1


@pytest.mark.slow(seconds=8)
def test_killed_holder_follow_up_published_by_main_process(
    worker: WorkerProcess, client_app: Celery, redis_client: redis.Redis, key_prefix: str
) -> None:
    key, lock = "killed", _lock_key(key_prefix, "killed")
    holder, _, follow_up = _coalesce_one(
        worker, client_app, redis_client, key_prefix, TASK, key, 30, "after"
    )

    pid = int(redis_client.hget(lock, "pid") or 0)
    os.kill(pid, signal.SIGKILL)
    killed_us = server_time_us(redis_client)  # the child is gone by now or within microseconds
    value = AsyncResult(follow_up, app=client_app).get(timeout=15)
    assert value["payload"] == "after"
    assert value["pid"] != pid
    wait_for(holder.ready, 10, "the killed holder's failure", worker)
    assert holder.state == "FAILURE"
    log = worker.log_text()
    assert "singleton: released by main process after worker lost" in log
    assert "singleton: coalesced follow-up published after worker lost" in log
    executions = [e for e in load_history(redis_client, history_key(key_prefix)) if e.key == key]
    assert len(executions) == 2
    assert not executions[0].finished  # the killed holder never ended
    assert executions[1].finished
    assert executions[1].start_us > killed_us  # the follow-up ran only after the holder died


def _plant_dead_holder(
    worker: WorkerProcess, client_app: Celery, redis_client: redis.Redis, lock: str, key: str
) -> str:
    """What a dead holder ``dead-run`` of ``key`` leaves: a lock hash that expires by itself,
    and a duplicate's call coalesced beside it (its follow-up's task id returned) once the lock
    expired."""
    redis_client.hset(lock, mapping={"owner": "dead-run", "gen": "0", "token": "1"})
    redis_client.pexpire(lock, 500)
    duplicate = client_app.send_task(TASK, kwargs={"key": key, "payload": "pending"})
    wait_for(duplicate.ready, 10, "the duplicate coalesced", worker)
    follow_up = _coalesced(duplicate)
    assert follow_up is not None
    assert skip_info(duplicate).holder == "dead-run"
    wait_for(lambda: not redis_client.exists(lock), 5, "the dead holder's lock to expire")
    assert redis_client.exists(pending_key(lock))
    return follow_up


@pytest.mark.slow(seconds=6)
def test_pending_of_an_expired_lock_is_superseded_by_the_next_run(
    worker: WorkerProcess, client_app: Celery, redis_client: redis.Redis, key_prefix: str
) -> None:
    """A pending record left beside a lock that expired (nobody released it) is taken when the
    next run of that key releases; that run took the lock after the record's call, so it is
    newer: the follow-up is not published but ends like a skip naming it."""
    key, lock = "expired", _lock_key(key_prefix, "expired")
    follow_up = _plant_dead_holder(worker, client_app, redis_client, lock, key)
    nxt = client_app.send_task(TASK, kwargs={"key": key, "payload": "next"})
    assert nxt.get(timeout=10)["payload"] == "next"
    info = skip_info(AsyncResult(follow_up, app=client_app).get(timeout=10))
    assert info == SkipInfo(key=lock, holder=nxt.id, task_id=follow_up)
    assert _runs(redis_client, key_prefix, key) == 1
    assert not redis_client.exists(pending_key(lock))
    # the pool child's log line reaches the worker's log through its main process, after the
    # results: wait for it (asserted at once, it was missing on a busy machine)
    line = (
        "singleton: coalesced follow-up superseded by a newer run, not published: "
        f"{TASK}[{follow_up}] key={lock} holder={nxt.id} duplicates=1"
    )
    wait_for(lambda: line in worker.log_text(), 10, "the superseded follow-up's log line", worker)


@pytest.mark.slow(seconds=6)
def test_pending_of_an_expired_lock_runs_after_a_copy_of_its_holder(
    worker: WorkerProcess, client_app: Celery, redis_client: redis.Redis, key_prefix: str
) -> None:
    """The run that takes the expired lock is a copy of the dead holder's own message (the same
    task id: a broker's redelivery after its node died), so it carries the holder's call, older
    than the coalesced one: its release publishes the follow-up, which runs after it."""
    key, lock = "expired-copy", _lock_key(key_prefix, "expired-copy")
    follow_up = _plant_dead_holder(worker, client_app, redis_client, lock, key)
    copy = client_app.send_task(TASK, kwargs={"key": key, "payload": "held"}, task_id="dead-run")
    assert copy.get(timeout=10)["payload"] == "held"
    assert AsyncResult(follow_up, app=client_app).get(timeout=10)["payload"] == "pending"
    executions = [e for e in load_history(redis_client, history_key(key_prefix)) if e.key == key]
    assert len(executions) == 2
    assert_no_overlap(check_history(executions), allow_unfinished=False)
    assert not redis_client.exists(pending_key(lock))


@pytest.mark.slow(seconds=15)
def test_an_orphaned_follow_up_does_not_run_after_a_newer_run(
    worker_factory: WorkerFactory,
    client_app: Celery,
    redis_client: redis.Redis,
    key_prefix: str,
) -> None:
    """Two holders (keys "orphan" and "joined") with duplicates coalesced beside them, then
    their whole node dies (the worker's process group SIGKILLed): nobody releases, their locks
    expire, their records stay. On another worker a newer run D of "orphan" runs; its release
    takes the orphaned record, whose older call would run after D: the follow-up ends like a
    skip naming D instead. On "joined" a duplicate meets the newer run D2 and joins the record
    (same follow-up id, its call the latest): D2's own follow-up, published at its release and
    run with that call. Nothing else is lost."""
    doomed = worker_factory.start(SINGLETON_APP, pool="prefork", concurrency=3)
    doomed.wait_ready(client_app)
    keys = ("orphan", "joined")
    locks = {key: _lock_key(key_prefix, key) for key in keys}
    for key in keys:
        until = f"{key_prefix}gate:dead:{key}"
        client_app.send_task(TASK, kwargs={"key": key, "payload": "held", "until": until})
    wait_for(
        lambda: all(_runs(redis_client, key_prefix, key) == 1 for key in keys), 10, "the holders"
    )
    follow_ups = {}
    for key in keys:
        burst = [
            client_app.send_task(TASK, kwargs={"key": key, "payload": f"old-{n}"}) for n in range(3)
        ]
        wait_for(lambda b=burst: all(r.ready() for r in b), 10, "the burst coalesced", doomed)
        (follow_ups[key],) = {_coalesced(r) for r in burst}
    doomed.kill()  # the whole node: no main process left to release
    wait_for(
        lambda: not redis_client.exists(*locks.values()), 5, "the dead holders' locks to expire"
    )
    assert redis_client.exists(*(pending_key(lock) for lock in locks.values())) == 2

    survivor = worker_factory.start(SINGLETON_APP, pool="prefork", concurrency=3)
    survivor.wait_ready(client_app)
    newer = client_app.send_task(TASK, kwargs={"key": "orphan", "payload": "D"})
    assert newer.get(timeout=10)["payload"] == "D"
    superseded = AsyncResult(follow_ups["orphan"], app=client_app).get(timeout=10)
    assert skip_info(superseded) == SkipInfo(
        key=locks["orphan"], holder=newer.id, task_id=follow_ups["orphan"]
    )

    gate = f"{key_prefix}gate:joined"
    joined = client_app.send_task(TASK, kwargs={"key": "joined", "payload": "D2", "until": gate})
    wait_started(redis_client, history_key(key_prefix), "joined", survivor, count=2, timeout=10)
    latest = client_app.send_task(TASK, kwargs={"key": "joined", "payload": "latest"})
    wait_for(latest.ready, 10, "the duplicate of D2 coalesced", survivor)
    assert skip_info(latest).holder == joined.id
    assert _coalesced(latest) == follow_ups["joined"]  # joined the record: one follow-up
    redis_client.rpush(gate, "go")
    assert joined.get(timeout=10)["payload"] == "D2"
    done = AsyncResult(follow_ups["joined"], app=client_app).get(timeout=10)
    assert done["payload"] == "latest"

    history = load_history(redis_client, history_key(key_prefix))
    ran = {key: [e for e in history if e.key == key] for key in keys}
    assert [e.finished for e in ran["orphan"]] == [False, True]  # the dead holder, D
    assert [e.finished for e in ran["joined"]] == [False, True, True]  # dead, D2, follow-up
    for key in keys:  # the dead holder's run never ended: the others, one at a time
        assert_no_overlap(check_history(ran[key][1:]), allow_unfinished=False)
        assert not redis_client.exists(pending_key(locks[key]))
    log = survivor.log_text()
    assert log.count("singleton: coalesced follow-up superseded by a newer run") == 1
    assert log.count("singleton: coalesced follow-up published after SUCCESS") == 1


# -- with completion records: copies of a coalesced message (acks_late, visibility timeout) -------

LATE = "t.coalesce_late"


@pytest.mark.slow(seconds=10)
def test_copies_of_the_holder_the_duplicate_and_the_follow_up_never_run_again(
    worker: WorkerProcess, client_app: Celery, redis_client: redis.Redis, key_prefix: str
) -> None:
    """t.coalesce_late is acked late, so its runs record their completion. After a holder with
    a pending follow-up, the coalesced duplicate and the follow-up have all ended, a broker's
    copy of each (same task id, same retries count, as a redelivery after the visibility
    timeout) is dropped: nothing runs twice, no second follow-up is published, and the
    duplicate's call, already carried by the follow-up, is not run again with its stale
    arguments."""
    key = "late"
    holder, duplicate, follow_up = _coalesce_one(
        worker, client_app, redis_client, key_prefix, LATE, key, 2, "v2"
    )
    assert holder.get(timeout=10)["payload"] == "held"
    assert AsyncResult(follow_up, app=client_app).get(timeout=10)["payload"] == "v2"
    wait_for(
        lambda: not redis_client.exists(_lock_key(key_prefix, key, LATE)), 5, "the release", worker
    )

    copies = [
        client_app.send_task(
            LATE, kwargs={"key": key, "seconds": 2, "payload": "held"}, task_id=holder.id
        ),
        client_app.send_task(LATE, kwargs={"key": key, "payload": "v2"}, task_id=duplicate.id),
        client_app.send_task(LATE, kwargs={"key": key, "payload": "v2"}, task_id=follow_up),
    ]
    dropped = "singleton: already completed, redelivery dropped: t.coalesce_late[{}]"
    wait_for(
        lambda: all(dropped.format(c.id) in worker.log_text() for c in copies),
        10,
        "every copy dropped",
        worker,
    )
    for task_id in (holder.id, follow_up):
        assert int(redis_client.get(deliveries_key(key_prefix, task_id)) or 0) == 1
    assert _runs(redis_client, key_prefix, key) == 2  # the holder and the follow-up, once each
    log = worker.log_text()
    assert log.count("singleton: coalesced follow-up published") == 1
    assert not redis_client.exists(pending_key(_lock_key(key_prefix, key, LATE)))
    assert skip_info(duplicate).follow_up == follow_up  # the first run's result stays


@pytest.mark.slow(seconds=10)
def test_a_copy_of_the_holder_met_while_it_runs_waits_and_is_dropped(
    worker: WorkerProcess, client_app: Celery, redis_client: redis.Redis, key_prefix: str
) -> None:
    """A broker's copy of the holder (acks_late, a visibility timeout shorter than the run)
    arrives while the holder runs with a pending follow-up: the copy is not coalesced (it is
    the holder's own message) but waits, and once the holder ended it is dropped; the
    follow-up is published once, by the holder's release: two runs in all."""
    key = "late-running"
    holder, _, follow_up = _coalesce_one(
        worker, client_app, redis_client, key_prefix, LATE, key, 3, "v2"
    )
    copy = client_app.send_task(
        LATE, kwargs={"key": key, "seconds": 3, "payload": "held"}, task_id=holder.id
    )
    wait_for(
        lambda: "singleton: redelivered while held, retrying in" in worker.log_text(),
        10,
        "the copy to meet its own holder",
        worker,
    )
    assert not holder.ready()
    assert AsyncResult(follow_up, app=client_app).get(timeout=15)["payload"] == "v2"
    wait_for(
        lambda: f"redelivery dropped: {LATE}[{copy.id}]" in worker.log_text(),
        15,
        "the copy dropped",
        worker,
    )
    assert int(redis_client.get(deliveries_key(key_prefix, holder.id)) or 0) == 1
    executions = [e for e in load_history(redis_client, history_key(key_prefix)) if e.key == key]
    assert len(executions) == 2
    assert_no_overlap(check_history(executions), allow_unfinished=False)
    assert worker.log_text().count("singleton: coalesced follow-up published") == 1


@pytest.mark.slow(seconds=6)
def test_a_duplicate_sent_in_another_serializer_than_its_tasks_is_coalesced_or_requeued(
    worker_factory: WorkerFactory,
    client_app: Celery,
    redis_client: redis.Redis,
    key_prefix: str,
) -> None:
    """A json task on a worker that also accepts pickle: a duplicate sent in pickle, carrying a
    set (json cannot write one), is coalesced (its call recorded in pickle, the first accepted
    serializer that writes it) and its follow-up is published in pickle and runs with the set.
    Under ``"retry"`` such a duplicate is requeued in pickle, and runs with its set."""
    worker = worker_factory.start(
        SINGLETON_APP,
        pool="prefork",
        concurrency=2,
        # C_FORCE_ROOT: Celery refuses pickle as root (a CI container)
        env={"SINGLETON_TEST_ACCEPT": "json,pickle", "C_FORCE_ROOT": "1"},
    )
    worker.wait_ready(client_app)
    task, key = "t.coalesce_repr", "pickled"
    holder = client_app.send_task(task, kwargs={"key": key, "seconds": 2, "payload": "held"})
    wait_started(redis_client, history_key(key_prefix), key, worker, timeout=10)
    duplicate = client_app.send_task(
        task, kwargs={"key": key, "payload": {1, 2}}, serializer="pickle"
    )
    wait_for(duplicate.ready, 10, "the duplicate coalesced", worker)
    assert duplicate.state == "SUCCESS", duplicate.traceback
    follow_up = _coalesced(duplicate)
    assert follow_up is not None
    assert holder.get(timeout=10)["payload"] == "'held'"
    assert AsyncResult(follow_up, app=client_app).get(timeout=10)["payload"] == "{1, 2}"
    assert worker.log_text().count("singleton: coalesced follow-up published after SUCCESS") == 1
    executions = [e for e in load_history(redis_client, history_key(key_prefix)) if e.key == key]
    assert len(executions) == 2
    assert_no_overlap(check_history(executions), allow_unfinished=False)

    lock = _lock_key(key_prefix, key, "t.hold_retry")
    assert isinstance(LockStore(redis_client).acquire(keys_of(lock), "holder", 0, 30_000), Acquired)
    retried = client_app.send_task(
        "t.hold_retry", kwargs={"key": key, "payload": {3, 4}}, serializer="pickle"
    )
    worker.wait_for_log(rf"singleton: duplicate retried in 0.2s: t.hold_retry\[{retried.id}\]")
    worker.wait_for_log(rf"Task t.hold_retry\[{retried.id}\] retry")
    LockStore(redis_client).release(lock, "holder", 0)
    assert retried.get(timeout=10)["payload"] == "{3, 4}"


@pytest.mark.parametrize("signum", ["SIGTERM", "SIGKILL"])
@pytest.mark.slow(seconds=6)
def test_a_terminated_holder_still_gets_its_follow_up_published(
    worker: WorkerProcess,
    client_app: Celery,
    redis_client: redis.Redis,
    key_prefix: str,
    signum: str,
) -> None:
    """revoke(terminate=True) of a holder with a pending follow-up: with SIGTERM the child's own
    release publishes it, with SIGKILL the worker's main process does; once either way."""
    key = f"revoked-{signum}"
    holder, _, follow_up = _coalesce_one(
        worker, client_app, redis_client, key_prefix, TASK, key, 30, "after"
    )
    client_app.control.revoke(holder.id, terminate=True, signal=signum)
    published = AsyncResult(follow_up, app=client_app)
    wait_for(published.ready, 30, "the follow-up's run", worker)  # fails with the worker's log
    assert published.get(timeout=1)["payload"] == "after"
    wait_for(lambda: holder.state == "REVOKED", 10, "the holder revoked", worker)
    log = worker.log_text()
    assert log.count("singleton: coalesced follow-up published after") == 1
    if signum == "SIGKILL":
        assert "singleton: coalesced follow-up published after terminate" in log
    executions = [e for e in load_history(redis_client, history_key(key_prefix)) if e.key == key]
    assert len(executions) == 2
    assert executions[1].finished
    assert not redis_client.exists(pending_key(_lock_key(key_prefix, key)))


@pytest.mark.slow(seconds=8)
def test_a_holder_that_retries_itself_keeps_the_burst_for_its_last_run(
    worker: WorkerProcess, client_app: Celery, redis_client: redis.Redis, key_prefix: str
) -> None:
    """A holder that calls self.retry() twice hands its lock over each time: duplicates met
    during its runs and during the countdowns coalesce onto it, and one follow-up, with the
    latest arguments, is published by its last run's release, never by a retry's."""
    task, key = "t.coalesce_retrying", "retrying"
    holder = client_app.send_task(task, kwargs={"key": key, "times": 2, "payload": "held"})
    wait_started(redis_client, history_key(key_prefix), key, worker, timeout=10)
    burst = []
    for n in range(3):  # one during the first run, two once the second started (1.5 s left)
        burst.append(client_app.send_task(task, kwargs={"key": key, "payload": f"dup-{n}"}))
        wait_for(burst[-1].ready, 10, "the duplicate coalesced", worker)
        if n == 0:
            wait_started(redis_client, history_key(key_prefix), key, worker, count=2, timeout=10)
    assert {skip_info(r).holder for r in burst} == {holder.id}
    follow_ups = {_coalesced(r) for r in burst}
    assert len(follow_ups) == 1, follow_ups
    (follow_up,) = follow_ups
    assert holder.get(timeout=15)["retries"] == 2
    assert AsyncResult(follow_up, app=client_app).get(timeout=10)["payload"] == "dup-2"
    executions = [e for e in load_history(redis_client, history_key(key_prefix)) if e.key == key]
    assert len(executions) == 4  # three runs of the holder, one follow-up
    assert_no_overlap(check_history(executions), allow_unfinished=False)
    log = worker.log_text()
    assert log.count("singleton: coalesced follow-up published after SUCCESS") == 1
    assert log.count("singleton: coalesced follow-up published") == 1


@pytest.mark.slow(seconds=6)
def test_a_coalesced_duplicates_canvas_stops_and_its_follow_up_carries_none(
    worker: WorkerProcess, client_app: Celery, redis_client: redis.Redis, key_prefix: str
) -> None:
    """A coalesced duplicate that is a chain's first step, with a link callback: the chain stops
    there as after a skip (the caller's result is the marker naming the follow-up), and the
    follow-up runs the duplicate's call alone: neither the next step nor the callback runs."""
    key, gate = "canvas", f"{key_prefix}gate:canvas"
    holder = client_app.send_task(TASK, kwargs={"key": key, "payload": "held", "until": gate})
    wait_started(redis_client, history_key(key_prefix), key, worker, timeout=10)
    after = client_app.signature("t.hold", kwargs={"key": "after-step"})
    callback = client_app.signature("t.hold", kwargs={"key": "callback"})
    duplicate = client_app.signature(TASK, kwargs={"key": key, "payload": "dup"})
    chained = (duplicate.set(link=callback) | after).apply_async()
    info = skip_info(chained.get(timeout=10))  # the next step's result: the marker
    assert info is not None
    assert (info.holder, info.task_id) == (holder.id, chained.parent.id)
    assert info.follow_up is not None
    redis_client.rpush(gate, "go")
    assert AsyncResult(info.follow_up, app=client_app).get(timeout=10)["payload"] == "dup"
    wait_for(lambda: not redis_client.exists(_lock_key(key_prefix, key)), 5, "released", worker)
    # whatever the follow-up published would be received before a call sent after it ended
    sentinel = client_app.send_task("t.hold", kwargs={"key": "sentinel"})
    sentinel.get(timeout=10)
    ran = {e.key for e in load_history(redis_client, history_key(key_prefix))}
    assert ran == {key, "sentinel"}
    assert f"[{chained.id}] received" not in worker.log_text()


@pytest.mark.slow(seconds=10)
def test_a_late_follow_up_never_replaces_a_newer_call(
    worker_factory: WorkerFactory,
    client_app: Celery,
    redis_client: redis.Redis,
    key_prefix: str,
) -> None:
    """A follow-up that reaches a worker only after another run took the lock (its queue was
    slow) carries a call older than that run, and older than a call coalesced onto that run
    meanwhile: it must not overwrite it. It ends like a skip naming that run (which started
    after its call), and the last run has the latest call's arguments."""
    main = client_app.conf.task_default_queue
    side = f"{main}-side"
    worker = worker_factory.start(
        SINGLETON_APP, pool="prefork", concurrency=3, extra_args=("-Q", main)
    )
    worker.wait_ready(client_app)
    # the side queue's only consumer, for A's delivery: it is gone before A's follow-up comes
    # (a cancel_consumer left a blocking read naming the side queue in flight)
    side_worker = worker_factory.start(
        SINGLETON_APP, pool="solo", concurrency=1, extra_args=("-Q", side)
    )
    side_worker.wait_ready(client_app)
    key, lock = "late", _lock_key(key_prefix, "late")
    gates = [f"{key_prefix}gate:late:{n}" for n in range(2)]

    def hold(payload: str, gate: str) -> AsyncResult:
        holder = client_app.send_task(TASK, kwargs={"key": key, "payload": payload, "until": gate})
        wait_for(lambda: redis_client.hget(lock, "owner") == holder.id.encode(), 10, "held")
        return holder

    def coalesce(payload: str, **options: Any) -> str:
        duplicate = client_app.send_task(TASK, kwargs={"key": key, "payload": payload}, **options)
        follow_up = wait_for(lambda: _coalesced(duplicate), 10, "coalesced", worker)
        return str(follow_up)

    first = hold("H0", gates[0])
    stale = coalesce("A", queue=side)  # its follow-up goes back to the side queue
    side_worker.terminate()
    redis_client.rpush(gates[0], "go")  # H0 ends: the follow-up of A waits in the side queue
    first.get(timeout=10)
    # the result is stored before the release: B sent in between would be coalesced onto H0
    wait_for(lambda: not redis_client.exists(lock), 10, "H0's release", worker)
    second = hold("B", gates[1])
    latest = coalesce("X")
    client_app.control.add_consumer(side, destination=[worker.nodename], reply=True)
    wait_for(lambda: AsyncResult(stale, app=client_app).ready(), 10, "the late follow-up", worker)
    redis_client.rpush(gates[1], "go")
    second.get(timeout=10)
    assert AsyncResult(latest, app=client_app).get(timeout=10)["payload"] == "X"
    wait_for(lambda: not redis_client.exists(lock), 5, "the last release", worker)
    info = skip_info(AsyncResult(stale, app=client_app))
    assert info is not None
    assert (info.holder, info.follow_up) == (second.id, None)
    runs = [e for e in load_history(redis_client, history_key(key_prefix)) if e.key == key]
    assert len(runs) == 3  # H0, B and the follow-up with X: the late one of A did not run
    assert_no_overlap(check_history(runs), allow_unfinished=False)
