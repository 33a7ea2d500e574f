"""``singleton_on_duplicate="join"`` on real workers: a duplicate ends with the outcome of the
run it met (its value, or its failure), its canvas going on with it, and no joined call is
lost when the run it joined dies."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import redis
from celery import Celery, chain, chord

from celery_singleton_lock.core.joiners import joiners_key, record_done
from celery_singleton_lock.core.keys import derive_keys
from celery_singleton_lock.core.store import LockStore
from celery_singleton_lock.duplicates.join import JOINED_HEADER
from tests.support import singleton_app
from tests.support.basic_app import SINGLETON_APP, history_key
from tests.support.flower import EventCapture
from tests.support.history import check_history, load_history, wait_started
from tests.support.waiting import wait_for
from tests.support.workers import WorkerFactory, WorkerProcess

POOLS = ["prefork", "threads", "solo"]


def _workers(factory: WorkerFactory, client_app: Celery, pool: str) -> list[WorkerProcess]:
    """Workers with room for a holder and its duplicates at once. A solo worker runs one task
    at a time and reserves the next message meanwhile, so that pool gets two: one for the
    holders' queue (:func:`_holding`), one for the default queue the duplicates go to."""
    if pool == "solo":
        main = client_app.conf.task_default_queue
        started = [
            factory.start(SINGLETON_APP, pool="solo", concurrency=1, extra_args=("-Q", queue))
            for queue in (f"{main}-holders", main)
        ]
    else:
        started = [factory.start(SINGLETON_APP, pool=pool, concurrency=3)]
    for worker in started:
        worker.wait_ready(client_app)
    return started


def _holding(client_app: Celery, pool: str) -> dict[str, str]:
    """The publish options of a holder: its own worker's queue in the solo pool."""
    return {"queue": f"{client_app.conf.task_default_queue}-holders"} if pool == "solo" else {}


def _joined(redis_client: redis.Redis, lock: str, count: int, *workers: WorkerProcess) -> None:
    wait_for(
        lambda: redis_client.hlen(joiners_key(lock)) >= count,
        20,
        f"{count} duplicates to join",
        *workers,
    )


def _runs(redis_client: redis.Redis, key_prefix: str, key: str) -> int:
    history = load_history(redis_client, history_key(key_prefix))
    return len([e for e in history if e.key == key])


@pytest.mark.slow(seconds=8)
@pytest.mark.parametrize("pool", POOLS)
def test_joined_duplicates_end_with_the_holders_value_and_their_canvas_goes_on(
    worker_factory: WorkerFactory,
    client_app: Celery,
    redis_client: redis.Redis,
    key_prefix: str,
    pool: str,
) -> None:
    """Two duplicates join a running holder: a plain call with a link, and a chain's first
    step. Each ends SUCCESS with the holder's value; the link and the chain's next step get
    that value; the body ran once."""
    workers = _workers(worker_factory, client_app, pool)
    key = f"k-{uuid.uuid4().hex[:8]}"
    join = client_app.signature("t.join")
    after = client_app.signature("t.join_next")
    holder = join.clone((key, -1, {"v": 42})).apply_async(**_holding(client_app, pool))
    lock = wait_for(lambda: _held_lock(redis_client, key_prefix, key), 20, "the lock", *workers)
    linked = join.clone((key, 0, "not run")).apply_async(link=after.clone(kwargs={"tag": "link"}))
    chained = chain(join.clone((key, 0, "not run")), after.clone(kwargs={"tag": "chain"}))()
    _joined(redis_client, lock, 2, *workers)
    redis_client.rpush(f"{key}:go", 1)

    assert holder.get(timeout=20) == {"v": 42}
    assert linked.get(timeout=20) == {"v": 42}
    assert chained.get(timeout=20) == [{"v": 42}, "chain"]
    assert linked.state == "SUCCESS"
    assert chained.parent.get(timeout=5) == {"v": 42}
    nexts = wait_for(
        lambda: (
            sorted(v.decode() for v in redis_client.lrange(f"{key_prefix}join:next", 0, -1))
            if redis_client.llen(f"{key_prefix}join:next") >= 2
            else None
        ),
        10,
        "the link and the chain step",
    )
    assert nexts == ["chain:{'v': 42}", "link:{'v': 42}"]
    assert _runs(redis_client, key_prefix, key) == 1
    report = check_history(load_history(redis_client, history_key(key_prefix)))
    assert report.ok, report.summary()
    completed = "singleton: joined duplicate completed: t.join["

    def logs() -> str:
        return "".join(w.log_text() for w in workers)

    # each line is logged after its call's result is stored: the results may be read first
    wait_for(lambda: logs().count(completed) >= 2, 10, "both completions logged", *workers)
    assert logs().count("singleton: duplicate joined: t.join[") == 2, logs()
    assert logs().count(completed) == 2, logs()
    assert not redis_client.exists(joiners_key(lock))


def _held_lock(
    redis_client: redis.Redis, key_prefix: str, key: str, task: str = "t.join"
) -> str | None:
    """The lock key of ``task(key)`` once a run holds it."""
    lock = _lock_of(key_prefix, key, task)
    return lock if redis_client.exists(lock) else None


@pytest.mark.parametrize("pool", POOLS)
@pytest.mark.slow(seconds=6)
def test_a_joined_duplicate_ends_with_the_holders_failure_and_its_error_link_fires(
    worker_factory: WorkerFactory,
    client_app: Celery,
    redis_client: redis.Redis,
    key_prefix: str,
    pool: str,
) -> None:
    workers = _workers(worker_factory, client_app, pool)
    key = f"k-{uuid.uuid4().hex[:8]}"
    join = client_app.signature("t.join")
    holder = join.clone((key, -1, "boom"), {"fail": True}).apply_async(**_holding(client_app, pool))
    lock = wait_for(lambda: _held_lock(redis_client, key_prefix, key), 20, "the lock", *workers)
    joined = join.clone((key, 0, "not run")).apply_async(
        link_error=client_app.signature("t.join_errback")
    )
    _joined(redis_client, lock, 1, *workers)
    redis_client.rpush(f"{key}:go", 1)

    with pytest.raises(ValueError, match="boom"):
        holder.get(timeout=20)
    with pytest.raises(ValueError, match="boom"):
        joined.get(timeout=20)
    assert joined.state == "FAILURE"
    errors = wait_for(
        lambda: redis_client.lrange(f"{key_prefix}join:errors", 0, -1), 10, "the error link"
    )
    assert [e.decode() for e in errors] == [f"{joined.id}:ValueError('boom')"]
    assert _runs(redis_client, key_prefix, key) == 1


@pytest.mark.parametrize("pool", POOLS)
@pytest.mark.slow(seconds=6)
def test_a_chord_counts_a_joined_member_with_the_holders_value(
    worker_factory: WorkerFactory,
    client_app: Celery,
    redis_client: redis.Redis,
    key_prefix: str,
    pool: str,
) -> None:
    """A chord's header with two members of one key: one runs, the other joins it; the body
    runs once, with both members' values (the same) and the third member's."""
    workers = _workers(worker_factory, client_app, pool)
    key, other = f"k-{uuid.uuid4().hex[:8]}", f"o-{uuid.uuid4().hex[:8]}"
    join = client_app.signature("t.join")
    first = join.clone((key, -1, "same")).set(**_holding(client_app, pool))
    header = [first, join.clone((key, -1, "same")), join.clone((other,))]
    result = chord(header, client_app.signature("t.join_gather"))()
    lock = wait_for(lambda: _held_lock(redis_client, key_prefix, key), 20, "the lock", *workers)
    _joined(redis_client, lock, 1, *workers)
    redis_client.rpush(f"{key}:go", 1)
    assert result.get(timeout=20) == ["same", "same", None]
    assert _runs(redis_client, key_prefix, key) == 1


@pytest.mark.parametrize("pool", POOLS)
@pytest.mark.slow(seconds=6)
def test_joiners_wait_through_the_holders_retry_for_its_final_value(
    worker_factory: WorkerFactory,
    client_app: Celery,
    redis_client: redis.Redis,
    key_prefix: str,
    pool: str,
) -> None:
    workers = _workers(worker_factory, client_app, pool)
    key = f"k-{uuid.uuid4().hex[:8]}"
    holder = (
        client_app.signature("t.join_retry")
        .clone((key, "final"))
        .apply_async(**_holding(client_app, pool))
    )
    lock = wait_for(
        lambda: _held_lock(redis_client, key_prefix, key, "t.join_retry"), 20, "the lock", *workers
    )
    joined = client_app.signature("t.join_retry").clone((key, "not run")).apply_async()
    _joined(redis_client, lock, 1, *workers)
    redis_client.rpush(f"{key}:go", 1, 1)  # the first try, then the retried one
    assert holder.get(timeout=20) == "final"
    assert joined.get(timeout=20) == "final"
    assert _runs(redis_client, key_prefix, key) == 2  # the holder's two tries


@pytest.mark.slow(seconds=6)
def test_joiners_of_a_holder_whose_autoretry_max_retries_refuses_get_its_failure(
    worker_factory: WorkerFactory,
    client_app: Celery,
    redis_client: redis.Redis,
    key_prefix: str,
) -> None:
    """Celery's ``autoretry_for`` retries the holder once (its joiners wait), then
    ``max_retries`` refuses: the holder fails with its KeyError, and so does the joined call."""
    (worker,) = _workers(worker_factory, client_app, "prefork")
    key = f"k-{uuid.uuid4().hex[:8]}"
    task = client_app.signature("t.join_autoretry")
    holder = task.clone((key, "boom")).apply_async()
    lock = wait_for(
        lambda: _held_lock(redis_client, key_prefix, key, "t.join_autoretry"), 20, "lock", worker
    )
    joined = task.clone((key, "not run")).apply_async()
    _joined(redis_client, lock, 1, worker)
    redis_client.rpush(f"{key}:go", 1, 1)  # the first try, then the retried one
    for call in (holder, joined):
        with pytest.raises(KeyError) as raised:
            call.get(timeout=20)
        assert raised.value.args == ("boom",)
        assert call.state == "FAILURE"
    assert _runs(redis_client, key_prefix, key) == 2  # the holder's two tries
    assert not redis_client.exists(joiners_key(lock))


#: a secret argument and the mask its caller gives Celery (``kwargsrepr``)
_SECRET, _MASK = "s3cret-token", "{'value': '***'}"


@pytest.mark.slow(seconds=8)
def test_joined_calls_at_celerys_seams(
    worker_factory: WorkerFactory,
    client_app: Celery,
    redis_client: redis.Redis,
    key_prefix: str,
) -> None:
    """Duplicates sent in pickle (carrying a set, which json cannot keep), msgpack and yaml;
    one with ``ignore_result`` and a link; one whose secret argument its caller masked with
    ``kwargsrepr``. Each joins and ends with the holder's value (the ignored one stores no
    result, its link still gets the value); the masked one's watch copy is shown with the mask,
    in the events Flower reads, never with the secret."""
    worker = worker_factory.start(
        SINGLETON_APP,
        concurrency=3,
        extra_args=["-E"],
        # C_FORCE_ROOT: Celery refuses pickle as root (a CI container)
        env={"SINGLETON_TEST_ACCEPT": "json,pickle,msgpack,yaml", "C_FORCE_ROOT": "1"},
    )
    worker.wait_ready(client_app)
    client_app.conf.accept_content = ["json", "pickle", "msgpack", "yaml"]
    capture = EventCapture(client_app).start()
    try:
        capture.wait_subscribed(worker)
        key = f"k-{uuid.uuid4().hex[:8]}"
        join = client_app.signature("t.join")
        holder = join.clone((key, -1, {"v": 1})).apply_async()
        lock = wait_for(lambda: _held_lock(redis_client, key_prefix, key), 20, "lock", worker)
        by_serializer = {
            "pickle": join.clone((key, 0, {1, 2})).apply_async(serializer="pickle"),
            "msgpack": join.clone((key, 0, "not run")).apply_async(serializer="msgpack"),
            "yaml": join.clone((key, 0, "not run")).apply_async(serializer="yaml"),
        }
        after = client_app.signature("t.join_next", kwargs={"tag": "ignored"})
        ignored = join.clone((key, 0, "not run")).apply_async(ignore_result=True, link=after)
        masked = client_app.send_task(
            "t.join", kwargs={"key": key, "value": _SECRET}, kwargsrepr=_MASK
        )
        _joined(redis_client, lock, 5, worker)
        # the first message's and the watch copy's task-received: both masked
        received = wait_for(
            lambda: (e := capture.of(masked.id, "task-received")) and len(e) == 2 and e,
            10,
            "the watch copy's task-received",
            worker,
        )
        assert [e["kwargs"] for e in received] == [_MASK, _MASK]
        redis_client.rpush(f"{key}:go", 1)

        assert holder.get(timeout=20) == {"v": 1}
        for serializer, call in by_serializer.items():
            assert call.get(timeout=20) == {"v": 1}, serializer
        assert masked.get(timeout=20) == {"v": 1}
        link = f"{key_prefix}join:next"
        wait_for(lambda: redis_client.llen(link), 10, "the ignored call's link", worker)
        assert [v.decode() for v in redis_client.lrange(link, 0, -1)] == ["ignored:{'v': 1}"]
        assert ignored.state == "PENDING"  # its result was not stored, as Celery does
        assert _SECRET not in "".join(str(e) for e in capture.events)
        assert _SECRET not in worker.log_text()
        assert _runs(redis_client, key_prefix, key) == 1
    finally:
        capture.stop()


@pytest.mark.parametrize("pool", POOLS)
@pytest.mark.slow(seconds=10)
def test_a_killed_holders_joiners_run_one_in_its_place_and_the_others_join_it(
    worker_factory: WorkerFactory,
    client_app: Celery,
    redis_client: redis.Redis,
    key_prefix: str,
    pool: str,
) -> None:
    """The holder's whole node is killed (no redelivery: acks early): when its lock expires,
    a joiner's watch copy runs in its place, and the other joiner ends with that run's value.
    (The joiners and their watch copies are on another worker's queue: a watch copy is a
    message with an eta, which a worker killed outright keeps unacknowledged until the broker
    restores it, as any retry's.)"""
    main = client_app.conf.task_default_queue
    side = f"{main}-side"
    survivor = worker_factory.start(
        SINGLETON_APP, pool=pool, concurrency=1 if pool == "solo" else 3, extra_args=("-Q", main)
    )
    doomed = worker_factory.start(
        SINGLETON_APP, pool="solo", concurrency=1, extra_args=("-Q", side)
    )
    for worker in (survivor, doomed):
        worker.wait_ready(client_app)
    key = f"k-{uuid.uuid4().hex[:8]}"
    join = client_app.signature("t.join")
    holder = join.clone((key, -1, "lost")).apply_async(queue=side)
    lock = wait_for(lambda: _held_lock(redis_client, key_prefix, key), 20, "the lock", doomed)
    first = join.clone((key, 0, "first")).apply_async()
    second = join.clone((key, 0, "second")).apply_async()
    _joined(redis_client, lock, 2, survivor)
    wait_started(redis_client, history_key(key_prefix), key, doomed)
    doomed.kill()

    values = {first.get(timeout=30), second.get(timeout=30)}
    assert len(values) == 1, values  # one ran, the other joined it
    assert values <= {"first", "second"}
    assert holder.state != "SUCCESS"
    assert _runs(redis_client, key_prefix, key) == 2  # the lost holder's, and its stand-in's
    history = load_history(redis_client, history_key(key_prefix))
    report = check_history([e for e in history if e.finished])  # the killed one never ends
    assert report.ok, report.summary()


@pytest.mark.slow(seconds=8)
@pytest.mark.parametrize("how", ["revoke", "time limit"])
def test_a_terminated_or_timed_out_holders_joiners_end_as_its_caller_sees_it(
    worker_factory: WorkerFactory,
    client_app: Celery,
    redis_client: redis.Redis,
    key_prefix: str,
    how: str,
) -> None:
    """``revoke(terminate=True)`` of the holder: its joiner ends REVOKED (TaskRevokedError), as
    the holder's own result; its hard time limit: the joiner fails with TimeLimitExceeded.

    The worker starts without ``-E``; task events are turned on at run time, as Flower does
    (``celery control enable_events``): the joined call's task-joined (from the pool child that
    joined it) and its end (from the main process, which ends the holder) are sent too."""
    worker = worker_factory.start(SINGLETON_APP, concurrency=3, worker_events=True)
    worker.wait_ready(client_app)
    capture = EventCapture(client_app).start()
    try:
        capture.wait_subscribed(worker)
        assert client_app.control.enable_events(
            destination=[worker.nodename], reply=True, timeout=10
        )
        key = f"k-{uuid.uuid4().hex[:8]}"
        join = client_app.signature("t.join")
        options = {"time_limit": 2.0} if how == "time limit" else {}
        holder = join.clone((key, -1, "never")).apply_async(**options)
        lock = wait_for(lambda: _held_lock(redis_client, key_prefix, key), 20, "the lock", worker)
        joined = join.clone((key, 0, "not run")).apply_async()
        _joined(redis_client, lock, 1, worker)
        if how == "revoke":
            wait_started(redis_client, history_key(key_prefix), key, worker)
            client_app.control.revoke(holder.id, terminate=True, destination=[worker.nodename])
        expected = "REVOKED" if how == "revoke" else "FAILURE"
        wait_for(lambda: holder.state == expected, 20, f"the holder {expected}", worker)
        wait_for(lambda: joined.state == expected, 20, f"the joiner {expected}", worker)
        assert type(joined.result) is type(holder.result), (joined.result, holder.result)
        assert _runs(redis_client, key_prefix, key) == 1
        # a watch copy that comes while the holder still runs joins again: one more event
        joins = wait_for(lambda: capture.of(joined.id, "task-joined"), 10, "task-joined")
        assert {e["holder"] for e in joins} == {holder.id}
        end = "task-revoked" if how == "revoke" else "task-failed"
        (event,) = wait_for(lambda: capture.of(joined.id, end), 10, end, worker)
        if how == "time limit":
            assert event["exception"].startswith("TimeLimitExceeded(")
    finally:
        capture.stop()


@pytest.mark.slow(seconds=7)
def test_a_duplicate_that_joins_a_killed_holder_during_the_grace_ends_with_it(
    worker_factory: WorkerFactory,
    client_app: Celery,
    redis_client: redis.Redis,
    key_prefix: str,
) -> None:
    """``revoke(terminate=True, signal="SIGKILL")``: the main process ends the holder's joiners
    at once (REVOKED), and releases its lock after a grace (3 s here) for the child to die. A
    duplicate that joins the dead run during the grace ends REVOKED too: the release takes the
    joiners once more. It does not run itself when its watch copy finds the lock free, up to
    one ttl (10 s) later."""
    worker = worker_factory.start(
        SINGLETON_APP,
        concurrency=2,
        env={"SINGLETON_TEST_CHILD_GRACE_S": "3", "SINGLETON_TEST_TTL": "10"},
    )
    worker.wait_ready(client_app)
    key = f"k-{uuid.uuid4().hex[:8]}"
    join = client_app.signature("t.join")
    holder = join.clone((key, -1, "never")).apply_async()
    lock = wait_for(lambda: _held_lock(redis_client, key_prefix, key), 20, "the lock", worker)
    wait_started(redis_client, history_key(key_prefix), key, worker)
    client_app.control.revoke(
        holder.id, terminate=True, signal="SIGKILL", destination=[worker.nodename]
    )
    wait_for(lambda: holder.state == "REVOKED", 20, "the holder REVOKED", worker)
    assert redis_client.exists(lock), "released before the grace"
    late = join.clone((key, 0, "not run")).apply_async()
    worker.wait_for_log(rf"duplicate joined: t\.join\[{late.id}\]")
    wait_for(lambda: late.state in ("REVOKED", "SUCCESS"), 20, "the late joiner's end", worker)
    assert late.state == "REVOKED", (late.state, late.result, worker.log_tail())
    assert type(late.result) is type(holder.result), (late.result, holder.result)
    assert _runs(redis_client, key_prefix, key) == 1
    assert not redis_client.exists(joiners_key(lock))


@pytest.mark.slow(seconds=6)
@pytest.mark.parametrize("completed", [False, True])
def test_a_watch_copy_whose_joiner_is_being_completed_checks_again_before_running(
    worker_factory: WorkerFactory,
    client_app: Celery,
    redis_client: redis.Redis,
    key_prefix: str,
    completed: bool,
) -> None:
    """A watch copy that finds the lock free but its own record taken (a run's end is
    completing it right now) does not run: it checks again one ttl later, and then runs,
    unless that end recorded it as completed meanwhile (then it is dropped)."""
    (worker,) = _workers(worker_factory, client_app, "prefork")
    key = f"k-{uuid.uuid4().hex[:8]}"
    copy = (
        client_app.signature("t.join")
        .clone((key, 0, "its own"))
        .apply_async(headers={JOINED_HEADER: "a-holder-that-died"})
    )
    worker.wait_for_log(rf"joined duplicate is being completed, checks again in .*\[{copy.id}\]")
    wait_for(lambda: _held_lock(redis_client, key_prefix, key) is None, 10, "the lock's release")
    if completed:  # what the completing end writes once the joiner's result is stored
        store = LockStore(redis_client)
        record_done(store.run_script, _lock_of(key_prefix, key), [(copy.id, 0)], 60_000)
        worker.wait_for_log(rf"already completed, redelivery dropped: t.join\[{copy.id}\]")
        assert copy.state == "PENDING"
    else:
        assert copy.get(timeout=20) == "its own"
        worker.wait_for_log(rf"runs in its holder's place: t.join\[{copy.id}\]")


def _signature(key: str, seconds: float = 0.0, value: Any = None, fail: bool = False) -> None:
    """Same parameters as t.join."""


def _lock_of(key_prefix: str, key: str, task: str = "t.join") -> str:
    return derive_keys(f"{key_prefix}lock:", task, _signature, (key,), {}, ("key",)).lock


@pytest.mark.slow(seconds=14)
@pytest.mark.usefixtures("forget_stores")
@pytest.mark.parametrize("store", ["sentinel", "cluster", "redlock"])
def test_a_duplicate_joins_over_every_store(  # noqa: PLR0917 - fixtures
    worker_factory: WorkerFactory,
    client_app: Celery,
    redis_client: redis.Redis,
    key_prefix: str,
    lock_urls: dict[str, str],
    store: str,
) -> None:
    """The locks on a Sentinel's master, a Cluster or Redlock masters: the joiners beside
    them, and a duplicate ends with the holder's value."""
    env = {"SINGLETON_TEST_LOCK_URL": lock_urls[store]}
    worker = worker_factory.start(SINGLETON_APP, pool="prefork", concurrency=3, env=env)
    worker.wait_ready(client_app)
    key = f"k-{uuid.uuid4().hex[:8]}"
    join = client_app.signature("t.join")
    holder = join.clone((key, -1, store)).apply_async()
    wait_started(redis_client, history_key(key_prefix), key, worker)
    joined = join.clone((key, 0, "not run")).apply_async()
    worker.wait_for_log(rf"singleton: duplicate joined: t.join\[{joined.id}\]")
    redis_client.rpush(f"{key}:go", 1)
    assert holder.get(timeout=20) == store
    assert joined.get(timeout=20) == store
    assert _runs(redis_client, key_prefix, key) == 1


@pytest.mark.slow(seconds=8)
def test_a_joined_call_that_expires_while_it_waits_ends_revoked(
    worker_factory: WorkerFactory,
    client_app: Celery,
    redis_client: redis.Redis,
    key_prefix: str,
) -> None:
    """``expires`` 2 s on a duplicate that joins a holder running longer: the duplicate ends
    REVOKED as Celery ends an expired message, and the holder's later end leaves it so."""
    (worker,) = _workers(worker_factory, client_app, "prefork")
    key = f"k-{uuid.uuid4().hex[:8]}"
    join = client_app.signature("t.join")
    holder = join.clone((key, -1, "late")).apply_async()
    wait_started(redis_client, history_key(key_prefix), key, worker)
    joined = join.clone((key, 0, "not run")).apply_async(expires=2.0)
    worker.wait_for_log(rf"singleton: duplicate joined: t.join\[{joined.id}\]")
    wait_for(lambda: joined.state == "REVOKED", 20, "the joined call to expire", worker)
    redis_client.rpush(f"{key}:go", 1)
    assert holder.get(timeout=20) == "late"
    worker.wait_for_log(rf"Task t.join\[{holder.id}\] succeeded")
    assert joined.state == "REVOKED"
    assert "joined duplicate completed" not in worker.log_text()
    assert _runs(redis_client, key_prefix, key) == 1


@pytest.mark.slow(seconds=6)
def test_a_call_refused_at_publish_and_one_joined_on_the_worker_agree(
    worker_factory: WorkerFactory,
    client_app: Celery,
    redis_client: redis.Redis,
    key_prefix: str,
    redis_url: str,
) -> None:
    """``singleton_lock_on="publish"`` with ``"join"``: a plain duplicate ``delay()`` is refused
    at publish and returns the holder's AsyncResult; one that starts a canvas of its own (a
    link, a chain) is published and joins on the worker. Each caller gets the holder's value,
    and each canvas goes on with it, as under ``"execute"``."""
    assert singleton_app.join_both.name == "t.join_both"
    (worker,) = _workers(worker_factory, client_app, "prefork")
    client_app.conf.singleton_redis_url = redis_url
    client_app.conf.singleton_key_prefix = f"{key_prefix}lock:"

    join_both = client_app.tasks["t.join_both"]  # singleton_app's task, shared with every app
    key = f"k-{uuid.uuid4().hex[:8]}"
    after = client_app.signature("t.join_next")
    holder = join_both.delay(key, -1, "v")
    wait_started(redis_client, history_key(key_prefix), key, worker)
    refused = join_both.delay(key, 0, "not run")
    linked = join_both.apply_async((key, 0, "not run"), link=after.clone(kwargs={"tag": "link"}))
    chained = chain(join_both.s(key, 0, "not run"), after.clone(kwargs={"tag": "chain"}))()
    for call in (linked, chained.parent):
        worker.wait_for_log(rf"singleton: duplicate joined: t.join_both\[{call.id}\]")
    redis_client.rpush(f"{key}:go", 1)

    assert refused.id == holder.id
    assert refused.get(timeout=20) == linked.get(timeout=20) == "v"
    assert chained.get(timeout=20) == ["v", "chain"]
    nexts = wait_for(
        lambda: (
            redis_client.llen(f"{key_prefix}join:next") >= 2
            and sorted(v.decode() for v in redis_client.lrange(f"{key_prefix}join:next", 0, -1))
        ),
        10,
        "the link and the chain step",
    )
    assert nexts == ["chain:'v'", "link:'v'"]
    assert _runs(redis_client, key_prefix, key) == 1
