"""singleton_permits: up to N runs of one key at once, each in a permit slot of its own; under
"coalesce" the duplicates of a full set become the key's one follow-up."""

from __future__ import annotations

import os
import signal

import pytest
import redis
from celery import Celery
from celery.result import AsyncResult
from click.testing import CliRunner

from celery_singleton_lock import skip_info
from celery_singleton_lock.core.admin import LockInfo, iter_locks, read_lock
from celery_singleton_lock.core.backend import (
    Acquired,
    Completed,
    Contended,
    ReleaseStatus,
    RenewItem,
    RenewStatus,
    release_lost_slot,
)
from celery_singleton_lock.core.completion import Ending, done_key
from celery_singleton_lock.core.keys import LockKeys, lock_key_problem, lock_keys
from celery_singleton_lock.core.pending import pending_key
from celery_singleton_lock.core.store import LockStore
from celery_singleton_lock.tools.cli import singleton
from tests.support.basic_app import SINGLETON_APP, history_key
from tests.support.client_tasks import COALESCE, coalesce_keys
from tests.support.history import (
    assert_no_overlap,
    check_history,
    load_history,
    max_at_once,
    permit_group,
    server_time_us,
)
from tests.support.servers import RedisServer
from tests.support.store_checks import check_permit_slots
from tests.support.waiting import wait_for
from tests.support.workers import WorkerFactory, WorkerProcess


def test_permit_slots_on_one_server(redis_client: redis.Redis, key_prefix: str) -> None:
    check_permit_slots(LockStore(redis_client), _keys(key_prefix))


def _keys(prefix: str, permits: int = 3) -> LockKeys:
    return lock_keys(prefix, "tests.export", b"tenant-a").with_permits(permits)


def _take(
    store: LockStore, keys: LockKeys, owner: str, generation: int = 0, ttl_ms: int = 5000
) -> Acquired:
    outcome = store.acquire(keys, owner, generation, ttl_ms, {"task": "tests.export"})
    assert isinstance(outcome, Acquired), outcome
    return outcome


def test_n_owners_take_n_slots_and_the_next_is_contended(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    """Three owners get slots 1, 2, 3 with increasing tokens from one shared counter; the
    fourth meets the holder whose slot expires first; the single lock key stays unwritten."""
    store = LockStore(redis_client)
    keys = _keys(key_prefix)
    taken = [_take(store, keys, f"run-{i}") for i in range(3)]
    assert [t.slot for t in taken] == [1, 2, 3]
    assert [t.token for t in taken] == sorted({t.token for t in taken})
    redis_client.pexpire(keys.slot(2), 1000)  # the one that frees up first
    fourth = store.acquire(keys, "run-3", 0, 5000)
    assert isinstance(fourth, Contended)
    assert (fourth.holder, fourth.holder_token) == ("run-1", taken[1].token)
    assert 0 < fourth.pttl_ms <= 1000
    assert not redis_client.exists(keys.lock)
    assert store.holder(keys.slot(3))["permit"] == "3"
    assert store.holder(keys.slot(3))["permits"] == "3"


def test_a_released_slot_is_taken_again(redis_client: redis.Redis, key_prefix: str) -> None:
    store = LockStore(redis_client)
    keys = _keys(key_prefix)
    taken = [_take(store, keys, f"run-{i}") for i in range(3)]
    assert store.release(keys.slot(2), "run-1", 0, taken[1].token) is ReleaseStatus.RELEASED
    again = _take(store, keys, "run-9")
    assert again.slot == 2
    assert again.token > taken[2].token


def test_a_redelivered_copy_meets_its_own_slot_and_a_retry_takes_it_over(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    """The same owner and generation, while slot 2 is its own and slot 3 free, is Contended
    by itself (never a second slot); its next generation re-enters slot 2."""
    store = LockStore(redis_client)
    keys = _keys(key_prefix)
    _take(store, keys, "run-0")
    first = _take(store, keys, "run-1")
    copy = store.acquire(keys, "run-1", 0, 5000)
    assert isinstance(copy, Contended)
    assert (copy.holder, copy.holder_generation, copy.holder_token) == ("run-1", 0, first.token)
    assert not redis_client.exists(keys.slot(3))
    retried = _take(store, keys, "run-1", 1)
    assert (retried.slot, retried.reentered) == (2, True)
    assert retried.token > first.token
    assert store.holder(keys.slot(2))["gen"] == "1"


def test_renew_and_release_work_on_a_slot_as_on_a_lock(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    store = LockStore(redis_client)
    keys = _keys(key_prefix, 2)
    a, b = _take(store, keys, "a"), _take(store, keys, "b")
    items = [
        RenewItem(keys.slot(1), "a", 0, 9000, a.token),
        RenewItem(keys.slot(2), "a", 0, 9000, a.token),  # b's slot: not a's
    ]
    assert store.renew(items) == [RenewStatus.RENEWED, RenewStatus.TAKEN]
    assert redis_client.pttl(keys.slot(1)) > 5000
    assert store.release(keys.slot(1), "b", 0, b.token) is ReleaseStatus.TAKEN
    assert store.release(keys.slot(2), "b", 0, b.token) is ReleaseStatus.RELEASED


def test_one_completion_record_per_owner_whichever_slot(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    """A finished run's record (written by the release of its slot) stops a later copy of its
    message whatever slot would be free."""
    store = LockStore(redis_client)
    keys = _keys(key_prefix)
    _take(store, keys, "run-0")
    run = _take(store, keys, "run-1")
    assert done_key(keys.slot(2), "run-1") == done_key(keys.lock, "run-1")
    ending = Ending(completion_ttl_ms=60_000)
    assert store.release(keys.slot(2), "run-1", 0, run.token, ending) is ReleaseStatus.RELEASED
    copy = store.acquire(keys, "run-1", 0, 5000)
    assert isinstance(copy, Completed)
    assert not redis_client.exists(keys.slot(2))
    assert isinstance(store.acquire(keys, "run-1", 1, 5000), Acquired)  # a retry runs


def test_the_main_process_finds_the_slot_of_a_lost_run(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    store = LockStore(redis_client)
    keys = _keys(key_prefix)
    for owner in ("a", "b", "c"):
        _take(store, keys, owner)
    assert release_lost_slot(store, keys, "c", 0, 0) == (keys.slot(3), ReleaseStatus.RELEASED)
    assert not redis_client.exists(keys.slot(3))
    assert redis_client.exists(keys.slot(1), keys.slot(2)) == 2
    assert release_lost_slot(store, keys, "c", 0, 0) == (keys.lock, ReleaseStatus.TAKEN)
    assert release_lost_slot(store, keys, "a", 5, 0) == (keys.lock, ReleaseStatus.TAKEN)
    single = lock_keys(key_prefix, "tests.export", b"other")
    assert release_lost_slot(store, single, "x", 0, 0) == (single.lock, ReleaseStatus.NOT_HELD)


def test_a_lost_run_leaves_its_slot_as_a_window_and_a_handed_over_slot_alone(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    """The main process releases a lost run's slot as the run would have: with an at-least
    window it becomes a window (its slot stays blocked, the other is taken); a slot its run handed
    over to a retry (stretched past its ttl) is left to the retried message."""
    store = LockStore(redis_client)
    keys = _keys(key_prefix, permits=2)
    _take(store, keys, "lost")
    _take(store, keys, "retrying")
    assert release_lost_slot(store, keys, "lost", 0, 60_000) == (
        keys.slot(1),
        ReleaseStatus.RELEASED,
    )
    window = read_lock(redis_client, keys.slot(1), key_prefix)
    assert window is not None
    assert window.state == "window"
    redis_client.pexpire(keys.slot(2), 20_000)  # retry(countdown=15) handed it over
    assert release_lost_slot(store, keys, "retrying", 0, 60_000) == (
        keys.slot(2),
        ReleaseStatus.HANDED_OVER,
    )
    met = store.acquire(keys, "third", 0, 5000)
    assert isinstance(met, Contended)
    assert (met.holder, met.finished) == ("retrying", False)  # its slot frees first
    redis_client.pexpire(keys.slot(2), 1)
    wait_for(lambda: not redis_client.exists(keys.slot(2)), 2, "the handed-over slot to expire")
    assert _take(store, keys, "third").slot == 2  # the window still blocks slot 1


def test_the_admin_lists_and_reads_slots(redis_client: redis.Redis, key_prefix: str) -> None:
    store = LockStore(redis_client)
    keys = _keys(key_prefix, 2)
    _take(store, keys, "a")
    _take(store, keys, "b")
    single = lock_keys(key_prefix, "tests.single", b"x")
    _take(store, single, "c")
    assert lock_key_problem(key_prefix, keys.slot(2)) is None
    assert lock_key_problem(key_prefix, keys.lock + ":0") is not None
    found = {
        info.key: (info.owner, info.permit, info.permits)
        for info in iter_locks(redis_client, key_prefix)
    }
    assert found == {
        keys.slot(1): ("a", 1, 2),
        keys.slot(2): ("b", 2, 2),
        single.lock: ("c", None, None),
    }
    info = read_lock(redis_client, keys.slot(2), key_prefix)
    assert info is not None
    assert info.as_dict()["permit"] == 2


@pytest.mark.parametrize("permits", [2, 10, 1000])
def test_an_acquire_is_one_script_call_however_many_permits(permits: int) -> None:
    """Taking the last free slot of ``permits`` (the others held) and meeting them all full are
    one EVALSHA each, one round trip, whatever N (a private server's command counts)."""
    with RedisServer() as server:
        client = server.client()
        store = LockStore(client)
        keys = _keys("cslt:permits:", permits)
        # a loaded machine can take longer than a 5 s ttl to fill 999 slots: none may expire
        for i in range(permits - 1):
            _take(store, keys, f"run-{i}", ttl_ms=300_000)
        client.config_resetstat()
        assert _take(store, keys, "last").slot == permits
        assert isinstance(store.acquire(keys, "one-too-many", 0, 5000), Contended)
        calls = {
            name: stats["calls"]
            for name, stats in client.info("commandstats").items()
            if name in ("cmdstat_evalsha", "cmdstat_eval", "cmdstat_script")
        }
        assert calls.get("cmdstat_evalsha") == 2, calls
        assert "cmdstat_eval" not in calls, calls  # the script was loaded by the first ones
        client.close()


@pytest.mark.parametrize("permits", [0, 1001])
def test_permits_are_bounded(permits: int) -> None:
    with pytest.raises(ValueError, match="permits"):
        LockKeys("k:lock", "k:fence", permits)


# -- on real workers ------------------------------------------------------------------------------


def _slots_held(client: redis.Redis, prefix: str) -> dict[str, dict[str, str]]:
    """Every permit slot the test workers hold (their locks are under ``<prefix>lock:``)."""
    return {
        info.key: {"owner": info.owner or "", "pid": str(info.pid)}
        for info in iter_locks(client, f"{prefix}lock:")
        if info.permit is not None
    }


@pytest.mark.slow(seconds=8)
def test_at_most_n_exports_of_a_tenant_run_at_once(
    worker_factory: WorkerFactory,
    client_app: Celery,
    key_prefix: str,
    redis_client: redis.Redis,
) -> None:
    """Five exports of one tenant on a worker of five processes: three run for 2 s (the ttl is
    1 s: each slot is renewed), each in a slot of its own with its own token, two are skipped
    naming a holder; another tenant runs beside them; never more than three of a tenant at
    once, no slot held twice."""
    worker = worker_factory.start(SINGLETON_APP, pool="prefork", concurrency=6)
    worker.wait_ready(client_app)
    sent = [client_app.send_task("t.export_permits", ("a",), {"seconds": 2}) for _ in range(5)]
    other = client_app.send_task("t.export_permits", ("b",), {"seconds": 0.2})
    values = [result.get(timeout=30) for result in sent]
    ran = [value for value in values if skip_info(value) is None]
    skipped = [skip_info(value) for value in values if skip_info(value) is not None]
    assert len(ran) == 3
    assert not any(value["lost"] for value in ran)  # each slot renewed past its ttl of 1 s
    held = sorted(value["key"] for value in ran)  # each run's own slot, slot 1 included
    assert [key.rsplit(":", 1)[1] for key in held] == ["1", "2", "3"], held
    assert len({value["token"] for value in ran}) == 3
    ids = {result.id for result in sent}
    assert all(info is not None and info.holder in ids for info in skipped)
    assert skip_info(other.get(timeout=30)) is None
    executions = load_history(redis_client, history_key(key_prefix))
    report = check_history(executions)
    assert_no_overlap(report, allow_unfinished=False)
    assert set(max_at_once(executions).values()) <= {1, 2, 3}
    assert max(max_at_once(executions).values()) == 3
    wait_for(lambda: not _slots_held(redis_client, key_prefix), 5, "every slot released", worker)


@pytest.mark.slow(seconds=12)
def test_retried_duplicates_all_run_two_at_a_time(
    worker_factory: WorkerFactory,
    client_app: Celery,
    key_prefix: str,
    redis_client: redis.Redis,
) -> None:
    """Six exports under "retry" with two permits: every one runs exactly once (nothing lost),
    never more than two at once."""
    worker = worker_factory.start(SINGLETON_APP, pool="prefork", concurrency=4)
    worker.wait_ready(client_app)
    sent = [
        client_app.send_task("t.export_permits_retry", ("a",), {"seconds": 0.5}) for _ in range(6)
    ]
    values = [result.get(timeout=60) for result in sent]
    assert all(skip_info(value) is None for value in values)
    executions = load_history(redis_client, history_key(key_prefix))
    report = check_history(executions)
    assert_no_overlap(report, allow_unfinished=False)
    assert len(report.finished()) == 6
    assert max_at_once(executions) == {permit_group(executions[0].key): 2}
    wait_for(lambda: not _slots_held(redis_client, key_prefix), 5, "every slot released", worker)


@pytest.mark.slow(seconds=8)
def test_the_main_process_releases_the_slot_of_a_killed_child(
    worker_factory: WorkerFactory,
    client_app: Celery,
    key_prefix: str,
    redis_client: redis.Redis,
) -> None:
    """SIGKILL of the child holding a slot (ttl 30 s): the worker's main process finds that
    slot among the three and releases it, and leaves the others' slots alone."""
    worker = worker_factory.start(
        SINGLETON_APP, pool="prefork", concurrency=3, env={"SINGLETON_TEST_TTL": "30"}
    )
    worker.wait_ready(client_app)
    sent = [client_app.send_task("t.export_permits", ("a",), {"seconds": 8}) for _ in range(3)]
    held = wait_for(
        lambda: (s := _slots_held(redis_client, key_prefix)) and len(s) == 3 and s,
        15,
        "three slots held",
        worker,
    )
    victim_key = max(held)  # slot 3
    pid = int(held[victim_key]["pid"])
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not redis_client.exists(victim_key), 10, "the slot released", worker)
    assert "singleton: released by main process after worker lost" in worker.log_text()
    assert set(_slots_held(redis_client, key_prefix)) == set(held) - {victim_key}
    victim = next(r for r in sent if r.id == held[victim_key]["owner"])
    wait_for(victim.ready, 10, "the killed run's result", worker)
    assert victim.state == "FAILURE"


@pytest.mark.parametrize("ending", ["fail", "hard time limit", "revoke", "revoke SIGKILL"])
@pytest.mark.slow(seconds=12)
def test_a_run_frees_its_own_slot_on_every_path(
    worker_factory: WorkerFactory,
    client_app: Celery,
    key_prefix: str,
    redis_client: redis.Redis,
    ending: str,
) -> None:
    """Two permits, ttl 30 s: a run that fails, meets its hard time limit, or is revoked
    (terminated with SIGTERM or SIGKILL) frees its own slot within 6 s, long before its ttl;
    the slot of the run beside it stays held until that run ends."""
    worker = worker_factory.start(
        SINGLETON_APP, pool="prefork", concurrency=3, env={"SINGLETON_TEST_TTL": "30"}
    )
    worker.wait_ready(client_app)
    task = "t.permits_outcome"
    beside = client_app.send_task(task, ("a", "ok"), {"seconds": 10})
    kind, seconds, limits = "ok", 10.0, {}
    if ending == "fail":
        kind, seconds = "fail", 0.5
    elif ending == "hard time limit":
        kind, seconds, limits = "limit", 3.0, {"soft_time_limit": 1, "time_limit": 2}
    victim = client_app.send_task(task, ("a", kind), {"seconds": seconds}, **limits)

    def slot_of(task_id: str) -> str | None:
        held = _slots_held(redis_client, key_prefix)
        return next((key for key, info in held.items() if info["owner"] == task_id), None)

    own = wait_for(lambda: slot_of(victim.id), 15, "the run's slot", worker)
    other = wait_for(lambda: slot_of(beside.id), 15, "the slot beside it", worker)
    assert own != other
    if ending.startswith("revoke"):
        signum = "SIGKILL" if ending.endswith("SIGKILL") else "SIGTERM"
        client_app.control.revoke(
            victim.id, terminate=True, signal=signum, destination=[worker.nodename]
        )
    wait_for(victim.ready, 15, "the run's end", worker)
    assert victim.state == ("REVOKED" if ending.startswith("revoke") else "FAILURE")
    # within 6 s (the ttl is 30 s): a loaded machine once took over 3 s from SIGTERM to release
    wait_for(lambda: not redis_client.exists(own), 6, "its slot released", worker)
    assert slot_of(beside.id) == other  # the other run's slot is left alone
    assert skip_info(beside.get(timeout=15)) is None
    wait_for(lambda: not _slots_held(redis_client, key_prefix), 5, "every slot released", worker)
    assert "singleton: lock lost" not in worker.log_text()
    assert_no_overlap(check_history(load_history(redis_client, history_key(key_prefix))))


def test_the_cli_lists_and_shows_the_slots(
    redis_client: redis.Redis, redis_url: str, key_prefix: str
) -> None:
    store = LockStore(redis_client)
    keys = _keys(key_prefix)
    _take(store, keys, "a")
    _take(store, keys, "b")
    runner = CliRunner()
    base = ["--url", redis_url, "--prefix", key_prefix]
    listed = runner.invoke(singleton, [*base, "list"])
    assert listed.exit_code == 0, listed.output
    header, *rows = [line.split("\t") for line in listed.output.splitlines()]
    column = header.index("PERMIT")
    assert sorted(row[column] for row in rows) == ["1/3", "2/3"]
    shown = runner.invoke(singleton, [*base, "show", keys.slot(2)])
    assert shown.exit_code == 0, shown.output
    assert "permit:    2 of 3" in shown.output
    released = runner.invoke(singleton, [*base, "release", "--yes", keys.slot(1)])
    assert released.exit_code == 0, released.output
    assert not redis_client.exists(keys.slot(1))
    assert redis_client.exists(keys.slot(2))


@pytest.mark.slow(seconds=6)
def test_a_retry_takes_its_own_slot_over(
    worker_factory: WorkerFactory,
    client_app: Celery,
    key_prefix: str,
    redis_client: redis.Redis,
) -> None:
    """self.retry() hands the run's slot over: every retried run re-enters that same slot, and
    a call made meanwhile runs in the other slot."""
    worker = worker_factory.start(SINGLETON_APP, pool="prefork", concurrency=3)
    worker.wait_ready(client_app)
    retried = client_app.send_task("t.export_permits_self_retry", ("a", 2))
    slots_key = history_key(key_prefix) + ":slots"
    wait_for(lambda: redis_client.llen(slots_key), 15, "the first run", worker)
    beside = client_app.send_task("t.export_permits_self_retry", ("a", 0))
    assert skip_info(beside.get(timeout=20)) is None
    assert skip_info(retried.get(timeout=20)) is None
    runs = [raw.decode().split() for raw in redis_client.lrange(slots_key, 0, -1)]
    own = [run[1:] for run in runs if run[0] == retried.id]
    slot = own[0][1]
    assert own == [["0", slot, "0"], ["1", slot, "1"], ["2", slot, "1"]]
    assert [run[2] for run in runs if run[0] == beside.id] != [slot]
    assert_no_overlap(check_history(load_history(redis_client, history_key(key_prefix))))


# -- with an at-least window (singleton_lock_at_least) ------------------------------------------

#: the at-least window of t.export_permits_window here (SINGLETON_TEST_AT_LEAST)
WINDOW_S = 4.0


@pytest.mark.slow(seconds=12)
def test_a_window_per_slot_lets_n_runs_start_per_window(
    worker_factory: WorkerFactory,
    client_app: Celery,
    key_prefix: str,
    redis_client: redis.Redis,
    redis_url: str,
) -> None:
    """Two permits, a 4 s window: each run's slot stays blocked until 4 s after it started
    (server clock). A second run takes the other slot beside the first one's window; a third
    meets the policy (skip, naming a finished run); ``celery singleton list`` shows both slots
    as windows; once they ended, a run starts again: at most 2 runs start per window."""
    worker = worker_factory.start(
        SINGLETON_APP, pool="prefork", concurrency=3, env={"SINGLETON_TEST_AT_LEAST": "4"}
    )
    worker.wait_ready(client_app)
    task = "t.export_permits_window"
    first = client_app.send_task(task, ("w",), {"seconds": 0.1})
    first_value = first.get(timeout=10)
    second = client_app.send_task(task, ("w",), {"seconds": 0.1})
    second_value = second.get(timeout=10)
    assert skip_info(second_value) is None  # the first one's window blocks its slot only
    assert first_value["key"] != second_value["key"]

    def slots() -> dict[str, LockInfo]:
        return {
            info.key: info
            for info in iter_locks(redis_client, f"{key_prefix}lock:")
            if info.permit is not None
        }

    # the result is stored before the run's release: the second slot turns into a window then
    windows = wait_for(
        lambda: (found := slots()) and {i.state for i in found.values()} == {"window"} and found,
        5,
        "both slots to be windows",
        worker,
        details=lambda: repr(slots()),
    )
    assert set(windows) == {first_value["key"], second_value["key"]}
    listed = CliRunner().invoke(
        singleton, ["--url", redis_url, "--prefix", f"{key_prefix}lock:", "list"]
    )
    assert listed.exit_code == 0, listed.output
    header, *rows = [line.split("\t") for line in listed.output.splitlines()]
    assert sorted((row[header.index("STATE")], row[header.index("PERMIT")]) for row in rows) == [
        ("window", "1/2"),
        ("window", "2/2"),
    ]

    third = client_app.send_task(task, ("w",), {"seconds": 0.1})
    info = skip_info(third.get(timeout=10))
    assert info is not None
    assert info.holder in {first.id, second.id}  # a finished run: its window

    wait_for(lambda: not _slots_held(redis_client, key_prefix), WINDOW_S + 2, "the windows")
    fourth = client_app.send_task(task, ("w",), {"seconds": 0.1})
    assert skip_info(fourth.get(timeout=10)) is None
    runs = load_history(redis_client, history_key(key_prefix))
    assert len(runs) == 3  # the first, the second and the fourth
    # a window runs from when its run took the slot (`since`, server clock), a little before
    # the body started; the fourth was sent once both had ended
    since_ms = max(info.since_ms or 0 for info in windows.values())
    assert runs[2].start_us >= (since_ms / 1000 + WINDOW_S) * 1e6, (since_ms, runs)
    assert_no_overlap(check_history(runs), allow_unfinished=False)


# -- with coalesce (singleton_on_duplicate="coalesce") -------------------------------------------

#: duplicates in the burst met by a full set of slots
BURST = 200


def _fill_the_slots(
    client_app: Celery, redis_client: redis.Redis, key_prefix: str, worker: WorkerProcess
) -> tuple[list[AsyncResult], list[str], dict[str, dict[str, str]]]:
    """Two runs of tenant "a" holding both slots until their gates are pushed: the runs, the
    gates, and the slots they hold."""
    gates = [f"{key_prefix}gate:slot:{n}" for n in range(2)]
    holders = [
        client_app.send_task(COALESCE, ("a",), {"payload": f"H{n}", "until": gate})
        for n, gate in enumerate(gates)
    ]
    held = wait_for(
        lambda: (s := _slots_held(redis_client, key_prefix)) and len(s) == 2 and s,
        10,
        "both slots held",
        worker,
    )
    return holders, gates, held


def _follow_up_of(results: list[AsyncResult]) -> str:
    """The one follow-up every coalesced duplicate of ``results`` names."""
    follow_ups = {info.follow_up if (info := skip_info(r)) else None for r in results}
    assert len(follow_ups) == 1, follow_ups
    (follow_up,) = follow_ups
    assert follow_up is not None
    return follow_up


@pytest.mark.slow(seconds=12)
def test_a_burst_met_by_every_slot_gives_one_follow_up_with_the_latest_arguments(
    worker_factory: WorkerFactory,
    client_app: Celery,
    key_prefix: str,
    redis_client: redis.Redis,
) -> None:
    """Two permits, both held: 200 duplicates and one more collapse into one follow-up (one
    record for the key, not one per slot), with the last one's arguments. The first holder's
    release publishes it; it takes the freed slot and runs beside the second holder. Three runs
    in all, never more than two at once, no slot held twice."""
    worker = worker_factory.start(SINGLETON_APP, pool="prefork", concurrency=4)
    worker.wait_ready(client_app)
    keys = coalesce_keys(key_prefix)
    holders, gates, held = _fill_the_slots(client_app, redis_client, key_prefix, worker)
    with client_app.producer_or_acquire() as producer:
        burst = [
            client_app.send_task(COALESCE, ("a",), {"payload": f"b-{i}"}, producer=producer)
            for i in range(BURST)
        ]

    def coalesced() -> int:
        return int(redis_client.hget(pending_key(keys.lock), "count") or 0)

    wait_for(lambda: coalesced() == BURST, 60, "the burst coalesced", worker)
    last = client_app.send_task(COALESCE, ("a",), {"payload": "last"})
    wait_for(lambda: coalesced() == BURST + 1, 10, "the last duplicate coalesced", worker)
    wait_for(lambda: all(r.ready() for r in [*burst, last]), 10, "every result", worker)
    follow_up = _follow_up_of([*burst, last])
    assert {skip_info(r).holder for r in [*burst[:20], last]} <= {h.id for h in holders}
    assert pending_key(keys.slot(2)) == pending_key(keys.lock)  # one record per key

    redis_client.rpush(gates[0], "go")
    first = holders[0].get(timeout=10)
    value = AsyncResult(follow_up, app=client_app).get(timeout=10)
    assert value["payload"] == "last"
    assert value["key"] == first["key"]  # the slot its release freed
    assert not holders[1].ready()  # the follow-up ran beside the second holder
    redis_client.rpush(gates[1], "go")
    holders[1].get(timeout=10)
    wait_for(lambda: not _slots_held(redis_client, key_prefix), 5, "every slot released", worker)
    assert not redis_client.exists(pending_key(keys.lock))
    executions = load_history(redis_client, history_key(key_prefix))
    assert len(executions) == 3
    assert_no_overlap(check_history(executions), allow_unfinished=False)
    assert max_at_once(executions) == {permit_group(keys.lock): 2}
    log = worker.log_text()
    assert log.count("singleton: coalesced follow-up published after SUCCESS") == 1
    assert f"duplicates={BURST + 1}" in log
    assert set(held) == set(keys.slots)


@pytest.mark.slow(seconds=10)
@pytest.mark.parametrize("expired_first", [False, True])
def test_the_main_process_publishes_the_follow_up_of_a_killed_slot_holder(
    worker_factory: WorkerFactory,
    client_app: Celery,
    key_prefix: str,
    redis_client: redis.Redis,
    expired_first: bool,
) -> None:
    """Two permits, both held (ttl 30 s), one duplicate coalesced: SIGKILL of the child of one
    holder. The worker's main process releases that slot and publishes the follow-up, which
    runs in it while the other holder still runs. ``expired_first``: the child was stopped
    (SIGSTOP) until its slot expired (ttl 1 s), then killed: the main process finds the slot
    gone, and still publishes the follow-up into it."""
    worker = worker_factory.start(
        SINGLETON_APP,
        pool="prefork",
        concurrency=4,
        env={"SINGLETON_TEST_TTL": "1" if expired_first else "30"},
    )
    worker.wait_ready(client_app)
    holders, gates, held = _fill_the_slots(client_app, redis_client, key_prefix, worker)
    duplicate = client_app.send_task(COALESCE, ("a",), {"payload": "after"})
    wait_for(duplicate.ready, 10, "the duplicate coalesced", worker)
    follow_up = _follow_up_of([duplicate])
    victim_key = next(key for key, info in held.items() if info["owner"] == holders[1].id)
    pid = int(held[victim_key]["pid"])
    if expired_first:
        os.kill(pid, signal.SIGSTOP)
        wait_for(lambda: not redis_client.exists(victim_key), 10, "the slot to expire", worker)
    os.kill(pid, signal.SIGKILL)
    killed_us = server_time_us(redis_client)
    value = AsyncResult(follow_up, app=client_app).get(timeout=15)
    assert (value["payload"], value["key"]) == ("after", victim_key)
    assert value["pid"] != pid
    assert not holders[0].ready()
    log = worker.log_text()
    released = "singleton: released by main process after worker lost" in log
    assert released is not expired_first  # an expired slot: nothing left to release
    assert "singleton: coalesced follow-up published after worker lost" in log
    redis_client.rpush(gates[0], "go")
    holders[0].get(timeout=10)
    wait_for(holders[1].ready, 10, "the killed holder's failure", worker)
    assert holders[1].state == "FAILURE"
    executions = load_history(redis_client, history_key(key_prefix))
    assert len(executions) == 3
    ended = [e for e in executions if e.finished]  # the killed holder's run never ended
    assert len(ended) == 2
    assert_no_overlap(check_history(ended), allow_unfinished=False)
    assert next(e for e in ended if e.key == victim_key).start_us > killed_us
    assert not redis_client.exists(pending_key(victim_key))
