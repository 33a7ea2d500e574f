"""The duplicate policies, the library's signals, key equivalence, fencing, max_hold and loss,
each on real worker processes of ``tests.support.singleton_app``."""

from __future__ import annotations

import time
from typing import Any

import pytest
import redis
from celery import Celery
from celery.result import AsyncResult

from celery_singleton_lock import DuplicateTaskError, SkipInfo, signals, skip_info
from celery_singleton_lock.core.keys import derive_keys
from tests.support.basic_app import SINGLETON_APP, history_key
from tests.support.history import assert_no_overlap, check_history, load_history
from tests.support.waiting import wait_for as _wait_for
from tests.support.workers import WorkerFactory, WorkerProcess

# -- helpers ------------------------------------------------------------------------------------


@pytest.fixture
def worker(worker_factory: WorkerFactory, client_app: Celery) -> WorkerProcess:
    """One prefork worker, -c 3, ttl 1 s."""
    started = worker_factory.start(SINGLETON_APP, pool="prefork", concurrency=3)
    started.wait_ready(client_app)
    return started


def _hold_signature(key: str, seconds: float = 0.0, payload: Any = None) -> None:
    """Same parameters as the t.hold* and t.hung tasks."""


def _whole_args_signature(account_id: int, full: bool = False) -> None:
    """Same parameters as t.whole_args."""


def _lock_key(prefix: str, task_name: str, key: str) -> str:
    """The lock key the worker uses for ``task_name(key=key)`` (key_args=("key",))."""
    return derive_keys(
        f"{prefix}lock:", task_name, _hold_signature, (), {"key": key}, ("key",)
    ).lock


def _whole_args_key(prefix: str, args: list[Any], kwargs: dict[str, Any]) -> str:
    return derive_keys(f"{prefix}lock:", "t.whole_args", _whole_args_signature, args, kwargs).lock


def _started(client: redis.Redis, prefix: str, count: int = 1) -> bool:
    return len(load_history(client, history_key(prefix))) >= count


def _get(result: AsyncResult, worker: WorkerProcess, timeout: float = 20.0) -> Any:
    try:
        return result.get(timeout=timeout)
    except Exception:
        print(worker.log_tail(80))
        raise


def _signal_events(client: redis.Redis, prefix: str) -> list[tuple[str, str]]:
    """``(signal name, task id)`` for every library signal the worker received, except
    ``lock_renewed_late`` (a loaded machine may starve a renewal; the lock is still held). The
    list also logs Celery's ``task_failure`` for test_release_paths: left out too."""
    raw = client.lrange(f"{prefix}signals", 0, -1)
    events = [tuple(item.decode().split(" ", 1)) for item in raw]
    wanted = set(signals.__all__) - {"lock_renewed_late"}
    return [e for e in events if e[0] in wanted]  # type: ignore[misc]


def _events_of(events: list[tuple[str, str]], task_id: str) -> list[str]:
    return [name for name, tid in events if tid == task_id]


def _split_skipped(results: list[AsyncResult], worker: WorkerProcess) -> tuple[Any, list[Any]]:
    """Wait for every result; return (the one that ran, the skipped ones)."""
    ran, skipped = [], []
    for result in results:
        value = _get(result, worker)
        (skipped if skip_info(value) else ran).append(result)
    return ran, skipped


# -- skip -----------------------------------------------------------------------------------


def test_skip_policy_marks_duplicates_done_at_once(
    worker: WorkerProcess, client_app: Celery, key_prefix: str
) -> None:
    """Two duplicates sent with the holder finish at once with a skip marker naming it."""
    kwargs = {"key": "skip", "seconds": 2.5}
    sent = time.monotonic()
    results = [client_app.send_task("t.hold", kwargs=kwargs) for _ in range(3)]

    # the two duplicates are ready long before the holder's 2.5 s are over
    ready = _wait_for(
        lambda: [r for r in results if r.ready()] if sum(r.ready() for r in results) >= 2 else [],
        10,
        "two skipped duplicates",
        worker,
    )
    assert time.monotonic() - sent < 2.0
    assert len(ready) == 2
    holder = next(r for r in results if r not in ready)
    assert not holder.ready()

    lock_key = _lock_key(key_prefix, "t.hold", "skip")
    for duplicate in ready:
        value = _get(duplicate, worker, timeout=1)
        assert isinstance(value, dict)
        assert value["__singleton_skipped__"] is True
        assert duplicate.state == "SUCCESS"
        info = skip_info(duplicate)
        assert info == SkipInfo(key=lock_key, holder=holder.id, task_id=duplicate.id)
        assert skip_info(value) == info

    held = _get(holder, worker)
    assert skip_info(holder) is None
    assert held["lost"] is False
    assert isinstance(held["token"], int)

    log = worker.log_text()
    assert log.count("singleton: duplicate skipped") == 2
    for duplicate in ready:
        assert f"t.hold[{duplicate.id}] key={lock_key} holder={holder.id}" in log


# -- raise ----------------------------------------------------------------------------------


def test_raise_policy_fails_duplicate_with_duplicate_task_error(
    worker: WorkerProcess, client_app: Celery, key_prefix: str
) -> None:
    """The duplicate fails; its client-side result is a DuplicateTaskError with holder and key."""
    kwargs = {"key": "raise", "seconds": 1.5}
    results = [client_app.send_task("t.hold_raise", kwargs=kwargs) for _ in range(2)]
    for result in results:
        result.get(timeout=20, propagate=False)

    failed = [r for r in results if r.state == "FAILURE"]
    succeeded = [r for r in results if r.state == "SUCCESS"]
    assert len(failed) == 1, worker.log_tail(40)
    assert len(succeeded) == 1
    duplicate, holder = failed[0], succeeded[0]

    error = duplicate.result
    assert isinstance(error, DuplicateTaskError)
    assert error.holder == holder.id
    assert error.key == _lock_key(key_prefix, "t.hold_raise", "raise")
    assert error.task_id == duplicate.id
    assert holder.id in str(error)
    with pytest.raises(DuplicateTaskError):
        duplicate.get(timeout=1)
    assert "singleton: duplicate raised" in worker.log_text()


# -- retry ----------------------------------------------------------------------------------


@pytest.mark.slow(seconds=6)
def test_retry_policy_runs_every_duplicate_in_turn(
    worker: WorkerProcess, client_app: Celery, redis_client: redis.Redis, key_prefix: str
) -> None:
    """A holder and 3 duplicates of a 1 s task all succeed, one after the other."""
    kwargs = {"key": "retry", "seconds": 1.0}
    results = [client_app.send_task("t.hold_retry", kwargs=kwargs) for _ in range(4)]
    values = [_get(r, worker, timeout=30) for r in results]

    assert all(r.state == "SUCCESS" for r in results)
    assert all(skip_info(v) is None and v["lost"] is False for v in values)
    report = check_history(load_history(redis_client, history_key(key_prefix)))
    assert len(report.finished()) == 4
    assert_no_overlap(report, allow_unfinished=False)
    assert sorted(e.token for e in report.executions) == sorted(v["token"] for v in values)
    assert "singleton: duplicate retried" in worker.log_text()


# -- signals --------------------------------------------------------------------------------


@pytest.mark.slow(seconds=7)
def test_signals_for_skip_raise_and_retry(
    worker: WorkerProcess, client_app: Celery, redis_client: redis.Redis, key_prefix: str
) -> None:
    """Every run sends lock_acquired/lock_released; duplicates send the signal of their policy."""
    # skip: one holder, one duplicate
    skip_results = [
        client_app.send_task("t.hold", kwargs={"key": "sig-skip", "seconds": 1.0}) for _ in range(2)
    ]
    [skip_holder], [skipped] = _split_skipped(skip_results, worker)
    # raise: one holder, one duplicate
    raise_results = [
        client_app.send_task("t.hold_raise", kwargs={"key": "sig-raise", "seconds": 1.0})
        for _ in range(2)
    ]
    for result in raise_results:
        result.get(timeout=20, propagate=False)
    [raised] = [r for r in raise_results if r.state == "FAILURE"]
    [raise_holder] = [r for r in raise_results if r.state == "SUCCESS"]
    # retry: two runs of one key, the second retried until the first is done
    retry_results = [
        client_app.send_task("t.hold_retry", kwargs={"key": "sig-retry", "seconds": 1.0})
        for _ in range(2)
    ]
    for result in retry_results:
        _get(result, worker)

    # lock_released is sent after the result is stored: wait for the last one
    def all_released() -> list[tuple[str, str]]:
        events = _signal_events(redis_client, key_prefix)
        released = {tid for name, tid in events if name == "lock_released"}
        wanted = {skip_holder.id, raise_holder.id, *(r.id for r in retry_results)}
        return events if wanted <= released else []

    events = _wait_for(all_released, 5, "lock_released signals", worker)

    assert _events_of(events, skip_holder.id) == ["lock_acquired", "lock_released"]
    assert _events_of(events, skipped.id) == ["duplicate_skipped"]
    assert _events_of(events, raise_holder.id) == ["lock_acquired", "lock_released"]
    assert _events_of(events, raised.id) == ["duplicate_raised"]

    retry_events = [_events_of(events, r.id) for r in retry_results]
    first, second = sorted(retry_events, key=lambda names: names.count("duplicate_retried"))
    assert first == ["lock_acquired", "lock_released"]
    assert second[-2:] == ["lock_acquired", "lock_released"]
    assert second[:-2], "the second retry run was never retried"
    assert set(second[:-2]) == {"duplicate_retried"}

    seen = {name for name, _ in events}
    assert seen == {
        "lock_acquired",
        "lock_released",
        "duplicate_skipped",
        "duplicate_raised",
        "duplicate_retried",
    }


# -- keys -----------------------------------------------------------------------------------


def test_equivalent_calls_share_one_key(
    worker: WorkerProcess, client_app: Celery, key_prefix: str
) -> None:
    """[1], {"account_id": 1} and [1, False] bind to one key: one runs, two are skipped."""
    calls: list[tuple[list[Any], dict[str, Any]]] = [
        ([1], {}),
        ([], {"account_id": 1}),
        ([1, False], {}),
    ]
    assert len({_whole_args_key(key_prefix, a, k) for a, k in calls}) == 1
    results = [client_app.send_task("t.whole_args", args=a, kwargs=k) for a, k in calls]
    ran, skipped = _split_skipped(results, worker)
    assert len(ran) == 1, worker.log_tail(40)
    assert len(skipped) == 2
    assert isinstance(ran[0].result, int)
    for result in skipped:
        info = skip_info(result)
        assert info is not None
        assert info.holder == ran[0].id
        assert info.key == _whole_args_key(key_prefix, [1], {})


def test_int_and_str_arguments_are_different_keys(
    worker: WorkerProcess, client_app: Celery, redis_client: redis.Redis, key_prefix: str
) -> None:
    """t.whole_args(1) and t.whole_args("1") hold their locks at the same time."""
    int_key = _whole_args_key(key_prefix, [1], {})
    str_key = _whole_args_key(key_prefix, ["1"], {})
    assert int_key != str_key
    results = [
        client_app.send_task("t.whole_args", args=[1]),
        client_app.send_task("t.whole_args", args=["1"]),
    ]
    # both locks are held at one moment: neither run waited for the other
    _wait_for(
        lambda: redis_client.exists(int_key, str_key) == 2,
        5,
        "both locks held at once",
        worker,
    )
    values = [_get(r, worker) for r in results]
    assert all(isinstance(v, int) for v in values)
    assert all(skip_info(r) is None for r in results)


# -- fencing --------------------------------------------------------------------------------


def test_fencing_tokens_of_successive_runs_increase(
    worker: WorkerProcess, client_app: Celery, redis_client: redis.Redis, key_prefix: str
) -> None:
    """Five successive runs of one key get strictly increasing fencing tokens."""
    tokens = []
    for _ in range(5):
        value = _get(client_app.send_task("t.hold", kwargs={"key": "fence"}), worker)
        tokens.append(value["token"])
    assert all(isinstance(t, int) and t > 0 for t in tokens)
    assert tokens == sorted(tokens)
    assert len(set(tokens)) == 5
    report = check_history(load_history(redis_client, history_key(key_prefix)))
    assert [e.token for e in report.executions] == tokens
    assert_no_overlap(report, allow_unfinished=False)


# -- max_hold and loss ----------------------------------------------------------------------


@pytest.mark.slow(seconds=8)
def test_max_hold_stops_renewal_and_lets_a_duplicate_run(
    worker: WorkerProcess, client_app: Celery, redis_client: redis.Redis, key_prefix: str
) -> None:
    """After max_hold (1.5 s) a hung run's lock expires and a duplicate runs beside it."""
    hkey = history_key(key_prefix)
    kwargs = {"key": "hung", "seconds": 4.0}  # t.hung is keyed on all its arguments
    hung = client_app.send_task("t.hung", kwargs=kwargs)
    _wait_for(lambda: _started(redis_client, key_prefix), 10, "the hung run to start", worker)
    began = time.monotonic()

    # still inside max_hold: a duplicate is skipped
    time.sleep(0.8)
    early = client_app.send_task("t.hung", kwargs=kwargs)
    early_info = skip_info(_get(early, worker))
    assert early_info is not None
    assert early_info.holder == hung.id

    # max_hold (1.5 s) + one ttl (1 s) later the lock is gone: a duplicate runs
    time.sleep(max(0.0, began + 3.0 - time.monotonic()))
    late = client_app.send_task("t.hung", kwargs=kwargs)
    _wait_for(lambda: _started(redis_client, key_prefix, 2), 5, "the duplicate to run", worker)
    assert not hung.ready(), "the hung run should still be running"

    hung_value = _get(hung, worker)
    late_value = _get(late, worker)
    assert skip_info(late_value) is None
    # past max_hold the run no longer holds a lock it can count on: it is marked lost
    assert hung_value["lost"] is True
    assert late_value["token"] > hung_value["token"]

    executions = load_history(redis_client, hkey)
    assert len(executions) == 2
    first, second = executions
    assert first.token == hung_value["token"]
    assert second.token == late_value["token"]
    # the late run started while the hung one was still running: exactly what max_hold allows
    assert first.end_us is not None
    assert first.start_us < second.start_us < first.end_us
    assert check_history(executions).overlaps == [(first, second)]

    log = worker.log_text()
    max_hold_lines = [line for line in log.splitlines() if "singleton: max hold reached" in line]
    assert any(f"t.hung[{hung.id}]" in line for line in max_hold_lines), log
    # the hung run is known lost, so finding the duplicate's lock at release is no surprise:
    # its owner-checked release leaves that lock alone without a warning
    released = [line for line in log.splitlines() if "lock was no longer ours at release" in line]
    assert not any(f"t.hung[{hung.id}]" in line for line in released), log

    def max_hold_signal() -> bool:
        return ("lock_max_hold", hung.id) in _signal_events(redis_client, key_prefix)

    _wait_for(max_hold_signal, 2, "the lock_max_hold signal", worker)


def test_lock_taken_by_another_owner_is_reported_lost(
    worker: WorkerProcess, client_app: Celery, redis_client: redis.Redis, key_prefix: str
) -> None:
    """When the lock's owner changes under a run, the next renewal marks it lost (taken)."""
    lock_key = _lock_key(key_prefix, "t.hold", "stolen")
    result = client_app.send_task("t.hold", kwargs={"key": "stolen", "seconds": 3.0})
    _wait_for(lambda: redis_client.exists(lock_key), 10, "the lock to be taken", worker)
    assert redis_client.hget(lock_key, "owner") == result.id.encode()
    redis_client.hset(lock_key, "owner", "thief")

    value = _get(result, worker)
    assert value["lost"] is True

    log = worker.log_text()
    lost_lines = [line for line in log.splitlines() if "singleton: lock lost" in line]
    assert len(lost_lines) == 1, log
    assert f"t.hold[{result.id}]" in lost_lines[0]
    assert "reason=taken" in lost_lines[0]
    # the thief's lock was left alone at release
    assert redis_client.hget(lock_key, "owner") in (b"thief", None)
    assert "singleton: lock was no longer ours at release" not in log
    assert ("lock_lost", result.id) in _signal_events(redis_client, key_prefix)


# -- settings -------------------------------------------------------------------------------


def test_worker_with_invalid_policy_exits_at_start_up(worker_factory: WorkerFactory) -> None:
    """An app-wide singleton_on_duplicate="bogus" stops the worker before it consumes."""
    bad = worker_factory.start(
        SINGLETON_APP, pool="prefork", concurrency=1, env={"SINGLETON_TEST_BAD_POLICY": "bogus"}
    )
    code = bad.wait(timeout=30)
    log = bad.log_text()
    assert code != 0
    assert "celery_singleton_lock: invalid setting" in log
    assert "singleton_on_duplicate" in log
    assert "'bogus'" in log
    assert " ready." not in log
