"""Every duplicate outcome is a finished task in the event stream, with its key and holder:
seen by a real Flower's HTTP API and by an event receiver (what ``celery events`` runs), against
a real worker started with ``-E`` (docs/operations.md, "Events and Flower").

- skip: task-received, task-started, task-succeeded whose ``result`` is the skip marker's repr
  (it names the key and the holder); Flower lists it as SUCCESS.
- raise: task-failed whose ``exception`` is the DuplicateTaskError naming key and holder;
  Flower: FAILURE.
- retry: task-retried whose ``exception`` names key and holder on every requeue (Flower: RETRY),
  then, once the lock is free, task-succeeded for the same task id (Flower: SUCCESS).
- coalesce: as skip, the marker also naming the follow-up (``coalesced_into``).
- skip turned away by the worker's main process (worker/mainskip.py): the same three events with the
  same fields as a skip in the pool; Flower shows the same task.
- join: task-received, task-started, then task-joined naming the holder and the key (Flower:
  JOINED) while it waits; task-succeeded with the holder's value (Flower: SUCCESS), sent by the
  holder's run when it completes the joined call. A holder's failure: task-failed. (The
  joined call's watch copy, the same task id, adds a task-received, and a task-started when it
  is due and dropped: Flower keeps the final state.)
- debounce: task-debounced (``key``, ``countdown``, ``calls``) as a call starts to wait
  (Flower: DEBOUNCED, not STARTED); then, as its copy comes due, task-succeeded with the skip
  marker naming the later call (superseded) or with its own value (the burst's run).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from celery_singleton_lock import skip_info
from celery_singleton_lock.core.backend import Acquired
from celery_singleton_lock.core.connection import store_for
from celery_singleton_lock.core.joiners import joiners_key
from celery_singleton_lock.core.keys import LockKeys, derive_keys
from tests.support.basic_app import SINGLETON_APP
from tests.support.flower import EventCapture, FlowerProcess
from tests.support.mainskip import turn_hot
from tests.support.waiting import wait_for
from tests.support.workers import WorkerFactory, WorkerProcess

TIMEOUT = 20
POLICIES = {
    "skip": "t.hold",
    "raise": "t.hold_raise",
    "retry": "t.hold_retry",
    "coalesce": "t.hold_coalesce",
}


def _hold_signature(key: str, seconds: float = 0.0) -> None:
    """The key parameter of t.hold, t.hold_raise, t.hold_retry and t.hold_coalesce."""


def _keys(prefix: str, task: str, key: str) -> LockKeys:
    return derive_keys(f"{prefix}lock:", task, _hold_signature, (), {"key": key}, ("key",))


def _held(prefix: str, redis_url: str) -> dict[str, LockKeys]:
    """The lock of each policy's task for key "busy", held by "holder-<policy>" (no task)."""
    held = {}
    for policy, task in POLICIES.items():
        keys = held[policy] = _keys(prefix, task, "busy")
        outcome = store_for(redis_url).acquire(keys, f"holder-{policy}", 0, 60_000)
        assert isinstance(outcome, Acquired)
    return held


def _joined_pair(
    app: Celery, redis_client: redis.Redis, prefix: str, worker: WorkerProcess, fail: bool = False
) -> tuple[Any, Any, str]:
    """A t.join holder that waits for a push to ``<key>:go``, and a duplicate that joined it;
    the key."""
    key = f"join-{uuid.uuid4().hex[:8]}"
    lock = _keys(prefix, "t.join", key).lock
    holder = app.send_task("t.join", kwargs={"key": key, "seconds": -1, "value": 7, "fail": fail})
    wait_for(lambda: redis_client.exists(lock), TIMEOUT, "the holder's lock", worker)
    joined = app.send_task("t.join", kwargs={"key": key, "value": "not run"})
    wait_for(lambda: redis_client.hlen(joiners_key(lock)), TIMEOUT, "the join", worker)
    return holder, joined, key


def _send_duplicates(app: Celery) -> dict[str, Any]:
    return {
        policy: app.send_task(task, kwargs={"key": "busy"}) for policy, task in POLICIES.items()
    }


def _flower_subscribed(flower: FlowerProcess, worker: WorkerProcess, app: Celery) -> None:
    """Flower's event receiver is subscribed once a plain run shows up in its API."""

    def flower_sees_a_run() -> bool:
        run = app.send_task("t.hold", kwargs={"key": "warm-up"})
        run.get(timeout=TIMEOUT)
        return wait_for(
            lambda: (flower.task(run.id) or {}).get("state") == "SUCCESS", 2, fail=False
        )

    wait_for(flower_sees_a_run, TIMEOUT, "flower to see a task", worker, flower)


@pytest.fixture
def worker(worker_factory: WorkerFactory, client_app: Celery) -> WorkerProcess:
    """A worker sending task events (-E)."""
    worker = worker_factory.start(SINGLETON_APP, pool="threads", concurrency=4, extra_args=["-E"])
    worker.wait_ready(client_app)
    return worker


@pytest.fixture
def flower(tmp_path: Path, redis_url: str, key_prefix: str) -> Iterator[FlowerProcess]:
    """A headless Flower on a free port, over the test app's broker; killed at teardown."""
    process = FlowerProcess(
        SINGLETON_APP,
        tmp_path / "flower",
        env={"SINGLETON_TEST_REDIS_URL": redis_url, "SINGLETON_TEST_PREFIX": key_prefix},
    )
    try:
        process.wait_ready()
        yield process
    finally:
        process.kill()


@pytest.mark.slow(seconds=6)
def test_flower_lists_every_duplicate_outcome_as_finished_with_key_and_holder(  # noqa: PLR0917
    flower: FlowerProcess,
    worker: WorkerProcess,
    client_app: Celery,
    key_prefix: str,
    redis_url: str,
    redis_client: redis.Redis,
) -> None:
    _flower_subscribed(flower, worker, client_app)
    held = _held(key_prefix, redis_url)
    duplicates = _send_duplicates(client_app)

    def flower_state(policy: str, state: str) -> dict[str, Any]:
        return wait_for(
            lambda: (
                (info := flower.task(duplicates[policy].id)) and info["state"] == state and info
            ),
            TIMEOUT,
            f"flower to show the {policy} duplicate as {state}",
            worker,
            flower,
        )

    skipped = flower_state("skip", "SUCCESS")
    assert skip_info(duplicates["skip"]) is not None
    assert held["skip"].lock in skipped["result"]
    assert "'holder': 'holder-skip'" in skipped["result"]
    assert skipped["name"] == "t.hold"
    assert skipped["worker"] == worker.nodename

    coalesced = flower_state("coalesce", "SUCCESS")
    info = skip_info(duplicates["coalesce"])
    assert info is not None
    assert info.follow_up is not None
    assert held["coalesce"].lock in coalesced["result"]
    assert "'holder': 'holder-coalesce'" in coalesced["result"]
    assert f"'coalesced_into': '{info.follow_up}'" in coalesced["result"]

    raised = flower_state("raise", "FAILURE")
    assert raised["exception"].startswith("DuplicateTaskError(")
    assert held["raise"].lock in raised["exception"]
    assert "is held by holder-raise" in raised["exception"]

    retried = flower_state("retry", "RETRY")
    assert held["retry"].lock in retried["exception"]
    assert "is held by holder-retry" in retried["exception"]
    store_for(redis_url).release(held["retry"].lock, "holder-retry", 0)
    ran = flower_state("retry", "SUCCESS")
    assert "token" in ran["result"]

    holder, duplicates["join"], key = _joined_pair(client_app, redis_client, key_prefix, worker)
    assert flower_state("join", "JOINED")["name"] == "t.join"
    redis_client.rpush(f"{key}:go", 1)
    assert holder.get(timeout=TIMEOUT) == 7
    completed = flower_state("join", "SUCCESS")
    assert completed["result"] == "7"

    # the task list, as Flower's UI pages it, shows them in their terminal states
    succeeded = flower.get("/api/tasks?state=SUCCESS")
    assert succeeded[duplicates["skip"].id]["result"] == skipped["result"]
    assert duplicates["retry"].id in succeeded
    assert duplicates["raise"].id in flower.get("/api/tasks?state=FAILURE")
    assert duplicates["join"].id in succeeded
    # and a search for the marker finds the skip and the coalesced duplicate, and no run
    found = flower.get("/api/tasks?search=__singleton_skipped__")
    assert sorted(found) == sorted([duplicates["skip"].id, duplicates["coalesce"].id])


def test_event_receiver_sees_every_duplicate_end(
    worker: WorkerProcess,
    client_app: Celery,
    key_prefix: str,
    redis_url: str,
    redis_client: redis.Redis,
) -> None:
    capture = EventCapture(client_app).start()
    try:
        capture.wait_subscribed(worker)
        held = _held(key_prefix, redis_url)
        duplicates = _send_duplicates(client_app)

        def ended(policy: str, kind: str) -> dict[str, Any]:
            found: list[dict[str, Any]] = wait_for(
                lambda: capture.of(duplicates[policy].id, kind), TIMEOUT, kind, worker
            )
            return found[0]

        succeeded = ended("skip", "task-succeeded")
        assert held["skip"].lock in succeeded["result"]
        assert "'holder': 'holder-skip'" in succeeded["result"]
        assert [e["type"] for e in capture.of(duplicates["skip"].id)] == [
            "task-received",
            "task-started",
            "task-succeeded",
        ]
        coalesced = ended("coalesce", "task-succeeded")
        assert held["coalesce"].lock in coalesced["result"]
        assert "'holder': 'holder-coalesce'" in coalesced["result"]
        assert "'coalesced_into': '" in coalesced["result"]
        failed = ended("raise", "task-failed")
        assert held["raise"].lock in failed["exception"]
        assert "is held by holder-raise" in failed["exception"]
        retried = ended("retry", "task-retried")
        assert held["retry"].lock in retried["exception"]
        assert "is held by holder-retry" in retried["exception"]

        for fail, last in ((False, "task-succeeded"), (True, "task-failed")):
            holder, joined, key = _joined_pair(client_app, redis_client, key_prefix, worker, fail)
            (event,) = wait_for(lambda j=joined: capture.of(j.id, "task-joined"), TIMEOUT, "joined")
            assert event["holder"] == holder.id
            assert event["key"] == _keys(key_prefix, "t.join", key).lock
            assert event["hostname"] == worker.nodename
            redis_client.rpush(f"{key}:go", 1)
            (end,) = wait_for(lambda j=joined, k=last: capture.of(j.id, k), TIMEOUT, last, worker)
            if fail:
                assert end["exception"] == "ValueError(7)"
            else:
                assert end["result"] == "7"
            # the watch copy (same task id) adds its own task-received, and task-started once due
            kinds = [e["type"] for e in capture.of(joined.id)]
            assert set(kinds) == {"task-received", "task-started", "task-joined", last}
            assert kinds.count("task-joined") == kinds.count(last) == 1

        # debounce: each call waits (task-debounced), then the earlier ends skipped, the later runs
        key = f"deb-{uuid.uuid4().hex[:8]}"
        early, late = (  # a 3 s window: the two reach a loaded worker within it
            client_app.send_task("t.debounce_long", kwargs={"key": key, "value": v}) for v in (1, 2)
        )
        for call, end in ((early, "'superseded_by': "), (late, "2")):
            (succeeded,) = wait_for(
                lambda c=call: capture.of(c.id, "task-succeeded"), TIMEOUT, "its end", worker
            )
            assert end in succeeded["result"]
            (waited,) = capture.of(call.id, "task-debounced")
            assert waited["key"] == _keys(key_prefix, "t.debounce_long", key).lock
            assert waited["countdown"] > 0
    finally:
        capture.stop()


#: what differs from one task's events to another's whoever sends them
_PER_EVENT = {"uuid", "timestamp", "local_received", "clock", "pid", "runtime", "result", "root_id"}


@pytest.mark.slow(seconds=6)
def test_a_skip_in_the_main_process_is_the_same_finished_task(
    flower: FlowerProcess,
    worker: WorkerProcess,
    client_app: Celery,
    key_prefix: str,
    redis_url: str,
) -> None:
    """The first duplicate is skipped in the pool, the last of the warm-up by the worker's main
    process: the event stream and Flower show both alike."""
    capture = EventCapture(client_app).start()
    try:
        capture.wait_subscribed(worker)
        _flower_subscribed(flower, worker, client_app)
        keys = _keys(key_prefix, "t.hold", "flood")
        assert isinstance(store_for(redis_url).acquire(keys, "holder-main", 0, 60_000), Acquired)
        sent = turn_hot(client_app, worker, "t.hold", {"key": "flood"})
        in_pool, in_main = sent[0], sent[-1]
        kinds = ["task-received", "task-started", "task-succeeded"]
        for duplicate in (in_pool, in_main):
            wait_for(
                lambda d=duplicate: [e["type"] for e in capture.of(d.id)] == kinds,
                TIMEOUT,
                "the three events",
                worker,
            )
        for kind in kinds:
            (pooled,) = capture.of(in_pool.id, kind)
            (mained,) = capture.of(in_main.id, kind)
            assert set(mained) == set(pooled), kind
            same = {k: v for k, v in pooled.items() if k not in _PER_EVENT}
            assert {k: mained[k] for k in same} == same, kind
        (succeeded,) = capture.of(in_main.id, "task-succeeded")
        assert keys.lock in succeeded["result"]
        assert "'holder': 'holder-main'" in succeeded["result"]
        assert succeeded["hostname"] == worker.nodename

        def flower_shows(task_id: str) -> dict[str, Any]:
            return wait_for(
                lambda: (info := flower.task(task_id)) and info.get("succeeded") and info,
                TIMEOUT,
                "flower to show the skip",
                worker,
                flower,
            )

        pooled_task, mained_task = flower_shows(in_pool.id), flower_shows(in_main.id)
        assert mained_task["state"] == "SUCCESS"
        assert mained_task["result"] == succeeded["result"]
        assert mained_task["worker"] == worker.nodename
        shown = {k for k, v in pooled_task.items() if v is not None}
        assert shown == {k for k, v in mained_task.items() if v is not None}
    finally:
        capture.stop()
