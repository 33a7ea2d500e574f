"""The lock is freed on every way a run can end, each path against a real worker process.

Every test starts its own ``celery worker`` (tests.support.singleton_app) on a private key
prefix, drives one release path and asserts the lock's state in Redis (gone, or held by whom)
and, where the path has one, the worker's ``singleton: `` log line. See the table in
``celery_singleton_lock/worker/hooks.py`` for which hook releases on which path.
"""

from __future__ import annotations

import dataclasses
import time

import pytest
from celery.result import AsyncResult

from celery_singleton_lock import skip_info
from tests.support.bed import Bed, assert_clean_log, new_key, wait_result
from tests.support.history import assert_no_overlap, check_history
from tests.support.singleton_app import RETRIED_QUEUE_SUFFIX, go_key
from tests.support.waiting import wait_for
from tests.support.workers import WorkerProcess, is_alive, kill_child


def exc_name(result: AsyncResult) -> str:
    """Class name of a failed result's exception."""
    return type(result.result).__name__


# -- 1. the run ends by itself ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "state", "error"),
    [
        ("ok", "SUCCESS", None),
        ("fail", "FAILURE", "ValueError"),
        ("reject", "FAILURE", "Reject"),
    ],
)
def test_run_end_releases(bed: Bed, kind: str, state: str, error: str | None) -> None:
    """Success, failure and Reject(requeue=False): the lock is gone right after the result."""
    worker = bed.start()
    key = new_key()
    result = bed.send("t.outcome", key, kind, seconds=0.5)
    lock = bed.wait_held(result.id)

    wait_result(result)
    assert bed.wait_gone(lock, 1.0) < 1.0
    assert result.state == state
    if error is not None:
        assert exc_name(result) == error
    if kind == "reject":
        wait_for(
            lambda: f"t.outcome[{result.id}] reject requeue=False" in worker.log_text(), 5, "log"
        )
    assert bed.locks() == {}
    assert len([e for e in bed.history() if e.finished]) == 1
    assert_clean_log(worker)


def test_ignore_releases(bed: Bed) -> None:
    """Ignore: no result is stored, the lock is gone and the worker logged "ignored"."""
    worker = bed.start()
    result = bed.send("t.outcome", new_key(), "ignore", seconds=0.5)
    lock = bed.wait_held(result.id)

    bed.wait_gone(lock, 10)
    wait_for(lambda: f"t.outcome[{result.id}] ignored" in worker.log_text(), 5, "ignored log")
    assert result.state == "PENDING"
    assert bed.locks() == {}
    assert_clean_log(worker)


# -- 2. retry: the lock is handed over, never released in between -------------------------------


def test_retry_hands_the_lock_over(bed: Bed) -> None:
    """retry(): the same task id holds the lock through every countdown; a duplicate is skipped."""
    worker = bed.start()  # ttl 1 s: the countdown (1 s) only fits if the hand-over extends it
    key = new_key()
    result = bed.send("t.retrying", key, 2, 1.0)
    lock = bed.wait_held(result.id)

    samples: list[tuple[int, int]] = []  # (gen, pttl) while the task is not done
    gaps = 0
    duplicate: AsyncResult | None = None
    deadline = time.monotonic() + 20
    while not result.ready():
        assert time.monotonic() < deadline, "t.retrying did not finish"
        fields, pttl = bed.lock(lock), bed.client.pttl(lock)
        if not fields:
            gaps += not result.ready()  # the final release comes after the result
            time.sleep(0.02)
            continue
        assert fields["owner"] == result.id
        samples.append((int(fields["gen"]), pttl))
        if duplicate is None and fields["gen"] == "0":
            finished = [e for e in bed.history() if e.finished]
            if finished:  # the first run is over: we are in its retry countdown
                duplicate = bed.send("t.retrying", key, 2, 1.0)
        time.sleep(0.02)

    assert result.get(timeout=5)["retries"] == 2
    assert gaps == 0, "the lock was free between two runs of a retried task"
    gens = [gen for i, (gen, _) in enumerate(samples) if i == 0 or samples[i - 1][0] != gen]
    assert gens == [0, 1, 2]
    for gen in (0, 1):
        # ttl alone is 1000 ms: more than that means the hand-over stretched it over the countdown
        assert max(p for g, p in samples if g == gen) > 1500, samples
    bed.wait_gone(lock, 1.0)

    assert duplicate is not None
    info = skip_info(duplicate.get(timeout=10))
    assert info is not None
    assert info.holder == result.id
    assert info.key == lock
    assert "singleton: duplicate skipped" in worker.log_text()

    report = check_history(bed.history())
    assert len(report.finished()) == 3
    assert_no_overlap(report, allow_unfinished=False)
    assert_clean_log(worker)


def test_retry_without_throw_keeps_the_handed_over_lock(bed: Bed) -> None:
    """retry(throw=False): the body goes on and returns after the hand-over. Its end must not
    release the lock it handed over (a duplicate would take it during the countdown and the
    retried run would then be skipped); self.singleton.held is False after the hand-over."""
    worker = bed.start()
    key = new_key()
    result = bed.send("t.retry_no_throw", key, 2.0)
    lock = bed.wait_held(result.id)
    gens: list[str] = []  # the holder's generation, each time it changes; "" while free
    duplicate: AsyncResult | None = None
    deadline = time.monotonic() + 20
    while not gens or gens[-1] != "1":
        assert time.monotonic() < deadline, f"the retried run never took the lock: {gens}"
        gen = bed.lock(lock).get("gen", "")
        if not gens or gens[-1] != gen:
            gens.append(gen)
        if duplicate is None and [e for e in bed.history() if e.finished]:
            duplicate = bed.send("t.retry_no_throw", key, 2.0)  # in the countdown
        time.sleep(0.01)
    assert gens == ["0", "1"], f"the handed-over lock was free before its retry came: {gens}"
    assert duplicate is not None
    info = skip_info(duplicate.get(timeout=10))
    assert info is not None
    assert info.holder == result.id
    # (the first run's SUCCESS is stored too: Celery's retry(throw=False) semantics)
    wait_for(
        lambda: [e for e in bed.history() if e.key == f"{key}:retried" and e.finished],
        15,
        "the retried run",
    )
    labels = [e.key for e in bed.history()]
    assert f"{key}:held=False" in labels, labels
    bed.wait_gone(lock, 2.0)
    assert_clean_log(worker)


# -- 3./4. time limits ----------------------------------------------------------------------------


def test_soft_time_limit_releases(bed: Bed) -> None:
    """Soft time limit: the run fails with SoftTimeLimitExceeded and its lock is gone."""
    worker = bed.start()
    result = bed.send("t.limited", new_key(), 3)
    lock = bed.wait_held(result.id)

    wait_result(result)
    assert result.state == "FAILURE"
    assert exc_name(result) == "SoftTimeLimitExceeded"
    bed.wait_gone(lock, 1.0)
    assert_clean_log(worker)


def test_hard_time_limit_releases_long_before_the_ttl(bed: Bed) -> None:
    """Hard time limit: the killed run's lock (ttl 30 s) is gone within 10 s of the failure,
    long before its ttl."""
    worker = bed.start(ttl=30)
    result = bed.send("t.limited", new_key(), 3, swallow_soft=True)
    lock = bed.wait_held(result.id)

    wait_result(result)
    assert result.state == "FAILURE"
    assert exc_name(result) == "TimeLimitExceeded"
    assert bed.wait_gone(lock, 10.0) < 10.0
    # billiard turns the child's SIGTERM into SystemExit, so the child's own task_postrun may
    # release before its SIGKILL (0.1 s later); otherwise the main process releases for it
    time.sleep(1.0)  # the main process's release may come after a grace: let it land
    assert bed.signals().count(f"lock_released {result.id}") == 1
    by_main = "singleton: released by main process after hard time limit" in worker.log_text()
    print(f"released by {'the main process' if by_main else 'the dying child'}")
    assert_clean_log(worker)


def test_hard_time_limit_main_process_waits_for_the_child(bed: Bed) -> None:
    """Hard time limit: the main process does not free the lock while the child is alive."""
    worker = bed.start(ttl=30)
    result = bed.send("t.limited", new_key(), 3, swallow_soft=True)
    lock = bed.wait_held(result.id)
    pid = int(bed.lock(lock)["pid"])

    deadline = time.monotonic() + 10
    while bed.client.exists(lock):  # poll tightly: billiard kills the child 0.1 s after TERM
        assert time.monotonic() < deadline, "the lock was never released"
        time.sleep(0.001)
    alive_at_release = is_alive(pid)
    wait_result(result)
    time.sleep(1.0)  # let a delayed release by the main process land in the log
    by_main = "singleton: released by main process after hard time limit" in worker.log_text()
    # the child releasing in its own task_postrun (its body and finally blocks are over) is
    # fine; the main process deleting the lock while the child may still run task code is not
    assert not (by_main and alive_at_release), (
        f"the main process freed the lock while child {pid}, still running the task, was alive"
    )


# -- 5. revoke ------------------------------------------------------------------------------------


def test_revoke_terminate_releases(bed: Bed) -> None:
    """revoke(terminate=True) of a running task: the lock (ttl 30 s) is released by the
    worker, long before its ttl (10 s leaves room for a busy machine)."""
    worker = bed.start(ttl=30)
    result = bed.send("t.hold", new_key(), seconds=10)
    lock = bed.wait_held(result.id)

    bed.app.control.revoke(result.id, terminate=True, destination=[worker.nodename])
    assert bed.wait_gone(lock, 10.0) < 10.0
    wait_for(lambda: result.state == "REVOKED", 5, "REVOKED state")
    time.sleep(1.0)  # the main process's release may come after a grace: let it land
    assert bed.signals().count(f"lock_released {result.id}") == 1
    assert_clean_log(worker)


def test_revoke_terminate_keeps_the_lock_through_the_child_cleanup(bed: Bed) -> None:
    """revoke(terminate=True): a finally block the SIGTERMed child still runs keeps its lock."""
    worker = bed.start(ttl=30)
    key = new_key()
    first = bed.send("t.hold_cleanup", key, seconds=10, cleanup=1.5)
    lock = bed.wait_held(first.id)
    pid = int(bed.lock(lock)["pid"])
    bed.wait_started(key, timeout=5)  # the body, and its try block

    bed.app.control.revoke(first.id, terminate=True, destination=[worker.nodename])
    bed.wait_gone(lock, 5)
    child_alive = is_alive(pid)
    duplicate = bed.send("t.hold_cleanup", key, seconds=0.2)
    wait_result(duplicate)
    wait_for(lambda: all(e.finished for e in bed.history()), 5, "the first run's cleanup")
    bed.assert_no_overlap()
    by_main = "singleton: released by main process after terminate" in worker.log_text()
    assert not (by_main and child_alive), (
        f"the main process freed the lock while child {pid} still ran its finally block"
    )


def test_revoke_without_terminate_keeps_running_lock(bed: Bed) -> None:
    """revoke() of a running task does not stop it: the lock stays until the run ends."""
    worker = bed.start(ttl=1)
    result = bed.send("t.hold", new_key(), seconds=2)
    lock = bed.wait_held(result.id)

    bed.app.control.revoke(result.id, destination=[worker.nodename])
    while True:
        fields = bed.lock(lock)
        # read after the lock: a run not ended now had not ended when the lock was read (its
        # end is recorded before its release)
        if [e for e in bed.history() if e.finished]:
            break
        assert fields.get("owner") == result.id, "the lock went away while its run went on"
        time.sleep(0.05)
    bed.wait_gone(lock, 1.0)
    wait_result(result)
    assert result.state == "SUCCESS"
    assert result.result["lost"] is False
    assert_clean_log(worker)


def test_revoke_of_queued_message_never_locks(bed: Bed) -> None:
    """revoke() of a message still queued: it never runs and never takes a lock."""
    worker = bed.start(concurrency=1)
    first = bed.send("t.hold", new_key(), seconds=1.5)
    first_lock = bed.wait_held(first.id)
    queued_key = new_key()
    queued = bed.send("t.hold", queued_key, seconds=0.2)
    bed.app.control.revoke(queued.id, destination=[worker.nodename])

    deadline = time.monotonic() + 20
    while queued.state != "REVOKED":
        assert time.monotonic() < deadline, f"still {queued.state}"
        assert bed.lock_of(queued.id) is None, "a revoked message took a lock"
        time.sleep(0.05)
    assert first.get(timeout=10)["lost"] is False
    bed.wait_gone(first_lock, 1.0)
    time.sleep(0.3)  # in case it ran anyway: give its record time to land
    assert bed.locks() == {}
    assert queued_key not in {e.key for e in bed.history()}
    assert_clean_log(worker)


# -- 6. pool child killed -------------------------------------------------------------------------


def test_child_sigkill_released_by_main_process(bed: Bed) -> None:
    """SIGKILL of the pool child: the main process releases (ttl 30 s) and a duplicate then runs."""
    worker = bed.start(ttl=30)
    key = new_key()
    result = bed.send("t.hold", key, seconds=10)
    lock = bed.wait_held(result.id)
    pid = int(bed.lock(lock)["pid"])
    assert pid in worker.child_pids()

    kill_child(bed.client, pid)
    # the main process notices a dead child at once, or at its ChildReaper's next look (0.25 s;
    # else billiard's maintain_pool, every 5 s): 7 s is still far below the 30 s ttl, so only
    # the main process can have released it
    assert bed.wait_gone(lock, 7.0) < 7.0
    wait_for(
        lambda: "singleton: released by main process after worker lost" in worker.log_text(),
        3,
        "the worker lost release log",
    )
    wait_result(result)
    assert result.state == "FAILURE"
    assert exc_name(result) == "WorkerLostError"

    second = bed.send("t.hold", key, seconds=0.2)
    value = second.get(timeout=10)
    assert skip_info(value) is None
    assert value["pid"] != pid
    bed.wait_gone(lock, 1.0)
    assert_clean_log(worker)


def test_killed_children_released_without_the_pool_maintenance(bed: Bed) -> None:
    """SIGKILL of a pool child, again and again: each lock (ttl 30 s) is released by the main
    process and the next call of the job runs, with billiard's periodic pool maintenance (every
    5 s) pushed out to an hour. billiard's own exit tracking alone misses some deaths (it looks
    a moment before the dead child can be reaped); the library's ChildReaper catches them."""
    kills = 8
    worker = bed.start(ttl=30, env={"SINGLETON_TEST_POOL_MAINTENANCE": "3600"})
    for _ in range(kills):
        key = new_key()
        result = bed.send("t.hold", key, seconds=60)
        lock = bed.wait_held(result.id)
        kill_child(bed.client, int(bed.lock(lock)["pid"]))
        bed.wait_gone(lock, 20)  # far below the ttl; the pool's own look is an hour away

        value = bed.send("t.hold", key, seconds=0.1).get(timeout=20)
        assert skip_info(value) is None
        bed.wait_gone(lock, 5)
    log = worker.log_text()
    assert log.count("singleton: released by main process after worker lost") == kills
    assert_clean_log(worker)


# -- 6b. a child that handed its lock over to a retry, then died --------------------------------

#: Log line of the main process when it leaves a lost child's lock alone (worker/hooks.py).
NOT_RELEASED = "singleton: not released by main process after"


def start_retry_pair(bed: Bed) -> tuple[WorkerProcess, WorkerProcess]:
    """A worker on the default queue, and one on t.retry_then_die's retry queue.

    The first has a second child, free for the duplicates sent while the first child dies.
    """
    first = bed.start(ttl=30)
    second = bed.start(ttl=30, queues=bed.app.conf.task_default_queue + RETRIED_QUEUE_SUFFIX)
    return first, second


def wait_task_failure(bed: Bed, task_id: str) -> None:
    """Wait until a main process sent task_failure for ``task_id`` (the library's handler ran)."""
    wait_for(lambda: f"task_failure {task_id}" in bed.signals(), 15, f"task_failure of {task_id}")


def wait_success(result: AsyncResult, timeout: float = 30.0) -> None:
    """Wait until ``result`` is SUCCESS (a retried run overwrites the lost run's FAILURE).

    A fresh AsyncResult per look: one caches the first ready state (FAILURE) it saw.
    """
    wait_for(
        lambda: result.app.AsyncResult(result.id).state == "SUCCESS",
        timeout,
        f"{result.id} to succeed",
    )


def assert_the_retry_runs_alone(bed: Bed, key: str, result: AsyncResult, lock: str) -> None:
    """A duplicate sent now is skipped (the lost run's retry holds the lock or is coming for it);
    the retried run then succeeds, beside no other run, with a larger token."""
    duplicate = bed.send("t.retry_then_die", key, seconds=0.2, die="")
    # (a job the pool gave the dead child before it noticed the death waits for that)
    info = skip_info(duplicate.get(timeout=20))
    assert info is not None, "a duplicate got the lock of the lost run's retry"
    assert info.holder == result.id

    wait_success(result)
    bed.wait_gone(lock, 1.0)
    killed, retried = bed.history()
    assert retried.token > killed.token  # type: ignore[operator]
    bed.assert_no_overlap()


@pytest.mark.parametrize(("die", "reason"), [("kill", "worker lost"), ("limit", "hard time limit")])
@pytest.mark.slow(seconds=13)
def test_lost_child_leaves_the_retried_runs_lock_alone(bed: Bed, die: str, reason: str) -> None:
    """retry(), the retried run takes the lock on another worker, then the first child dies
    (SIGKILL or hard time limit): its main process leaves the retried run's lock alone, and a
    duplicate is skipped instead of running beside the retried run."""
    first_worker, second_worker = start_retry_pair(bed)
    key = new_key()
    # the retried run holds 10 s: longer than billiard may take to notice the dead child (5 s),
    # and than a duplicate the pool gave the dead child may wait for that
    result = bed.app.send_task(
        "t.retry_then_die",
        args=(key,),
        kwargs={"seconds": 10, "wait_taken": True, "die": die},
        time_limit=2 if die == "limit" else None,
    )
    lock = bed.wait_held(result.id)
    wait_for(lambda: bed.lock(lock).get("gen") == "1", 15, "the retried run to take the lock")
    bed.client.set(go_key(bed.prefix, result.id), 1)
    wait_task_failure(bed, result.id)

    # worker lost: the main process decided before task_failure's next receiver ran; hard time
    # limit: it releases after a grace. Either way the retried run keeps its lock.
    deadline = time.monotonic() + 5
    while NOT_RELEASED + " " + reason not in first_worker.log_text():
        fields = bed.lock(lock)
        assert (fields.get("owner"), fields.get("gen")) == (result.id, "1"), (
            f"the main process of the lost child deleted the retried run's lock: {fields}"
        )
        assert time.monotonic() < deadline, f"no '{NOT_RELEASED} {reason}' line"
        time.sleep(0.02)
    assert (bed.lock(lock).get("owner"), bed.lock(lock).get("gen")) == (result.id, "1")

    assert_the_retry_runs_alone(bed, key, result, lock)
    assert "singleton: released by main process" not in first_worker.log_text()
    # a child SIGTERMed by the hard time limit unwinds and releases its (handed-over) generation
    assert_clean_log(first_worker, allow=("singleton: lock was no longer ours",))
    assert_clean_log(second_worker)


@pytest.mark.slow(seconds=11)
def test_lost_child_leaves_a_handed_over_lock_to_its_retry(bed: Bed) -> None:
    """retry(countdown=8), then SIGKILL before the retried message arrived: the main process
    leaves the stretched lock alone, a duplicate is skipped, and the retried run takes over."""
    first_worker, second_worker = start_retry_pair(bed)
    key = new_key()
    # the countdown outlasts billiard noticing the dead child (at most its 5 s maintenance)
    result = bed.send("t.retry_then_die", key, seconds=0.5, countdown=8)
    lock = bed.wait_held(result.id)
    bed.client.set(go_key(bed.prefix, result.id), 1)
    wait_task_failure(bed, result.id)

    fields = bed.lock(lock)
    assert (fields.get("owner"), fields.get("gen")) == (result.id, "0"), (
        f"the handed-over lock was deleted before its retry came: {fields}"
    )
    assert bed.client.pttl(lock) > 30_000  # still stretched over the countdown (ttl 30 s)
    wait_for(lambda: NOT_RELEASED + " worker lost" in first_worker.log_text(), 5, "the log line")

    assert_the_retry_runs_alone(bed, key, result, lock)
    assert_clean_log(first_worker)
    assert_clean_log(second_worker)


def test_lost_child_of_a_foreign_request_class_leaves_the_lock_to_its_ttl(bed: Bed) -> None:
    """A task whose Request class is not the library's: the main process cannot tell which
    generation the dead child held, so it does not release; it logs why."""
    worker = bed.start(ttl=30)
    result = bed.send("t.hold_own_request", new_key(), seconds=10)
    lock = bed.wait_held(result.id)
    fields = bed.lock(lock)

    kill_child(bed.client, int(fields["pid"]))
    wait_task_failure(bed, result.id)
    assert bed.lock(lock).get("token") == fields["token"], "released without knowing the generation"
    assert NOT_RELEASED + " worker lost, generation unknown" in worker.log_text()


# -- 7. warm shutdown -----------------------------------------------------------------------------


@pytest.mark.slow(seconds=7)
def test_warm_shutdown_lets_the_run_finish(bed: Bed) -> None:
    """SIGTERM (warm shutdown) while a run holds the lock: it completes, releases, exit code 0."""
    worker = bed.start(ttl=30)  # a long ttl: only a release can make the lock go away
    result = bed.send("t.hold", new_key(), seconds=3)
    lock = bed.wait_held(result.id)

    assert worker.terminate(timeout=30) == 0
    value = result.get(timeout=5)
    assert value["lost"] is False
    assert not bed.client.exists(lock)
    assert [e.finished for e in bed.history()] == [True]
    assert "released by main process after shutdown" not in worker.log_text()
    assert_clean_log(worker)


# -- 8. whole node killed -------------------------------------------------------------------------


def test_node_sigkill_lock_expires_by_ttl(bed: Bed) -> None:
    """SIGKILL of the whole worker: the lock stays, expires in its ttl, then a new worker runs."""
    worker = bed.start(ttl=2)
    key = new_key()
    result = bed.send("t.hold", key, seconds=10)
    lock = bed.wait_held(result.id)

    worker.kill()
    fields, pttl = bed.lock(lock), bed.client.pttl(lock)
    assert fields.get("owner") == result.id, "nobody may release for a killed node"
    assert 0 < pttl <= 2000
    assert bed.wait_gone(lock, 3.0) < 3.0

    second_worker = bed.start(ttl=2)
    second = bed.send("t.hold", key, seconds=0.2)
    value = second.get(timeout=10)
    assert skip_info(value) is None
    assert value["token"] > int(fields["token"])
    bed.wait_gone(lock, 1.0)
    assert_clean_log(second_worker)


# -- 9. acks_late redelivery ----------------------------------------------------------------------


@pytest.mark.slow(seconds=11)
def test_acks_late_redelivery_waits_for_the_old_lock(bed: Bed) -> None:
    """acks_late + reject_on_worker_lost: the redelivered message waits out the lock, runs once."""
    # billiard may take up to its 5 s maintain_pool interval to notice the dead child and
    # requeue the message: a 9 s ttl (renewed every 3 s) is still held when it comes back
    worker = bed.start(ttl=9)
    key = new_key()
    result = bed.send("t.hold_late", key, seconds=1.0)
    lock = bed.wait_held(result.id)
    first = bed.lock(lock)
    pid = int(first["pid"])
    bed.wait_started(key, timeout=5)

    killed_at = kill_child(bed.client, pid)
    pttl = bed.client.pttl(lock)

    # the same task id takes the lock again, with a new token, once the old one expired
    wait_for(
        lambda: bed.lock(lock).get("token", first["token"]) != first["token"],
        15,
        "the redelivered run to take the lock",
    )
    assert bed.lock(lock)["owner"] == result.id
    value = result.get(timeout=15)
    assert skip_info(value) is None
    assert value["pid"] != pid
    assert result.state == "SUCCESS"
    bed.wait_gone(lock, 1.0)
    assert "singleton: redelivered while held" in worker.log_text()

    killed, rerun = bed.history()
    assert not killed.finished
    assert rerun.finished
    # the killed run did nothing after its death; the rerun began once the lock had expired
    assert rerun.start_us >= killed_at + (pttl - 100) * 1000
    report = check_history([dataclasses.replace(killed, end_us=killed_at), rerun])
    assert_no_overlap(report, allow_unfinished=False)
    assert_clean_log(worker)


# -- 10. other pools ------------------------------------------------------------------------------


@pytest.mark.parametrize(("pool", "concurrency"), [("threads", 4), ("solo", 1)])
def test_other_pools_release_and_skip(bed: Bed, pool: str, concurrency: int) -> None:
    """-P threads / -P solo: a renewed run succeeds and releases; a duplicate is skipped."""
    worker = bed.start(pool=pool, concurrency=concurrency)  # ttl 1 s: renewal needed
    key = new_key()
    first = bed.send("t.hold", key, seconds=1.5)
    lock = bed.wait_held(first.id)
    if pool == "threads":  # only a pool running two tasks at once can meet a running holder
        duplicate = bed.send("t.hold", key)
        info = skip_info(duplicate.get(timeout=10))
        assert info is not None
        assert info.holder == first.id
        assert bed.lock(lock).get("owner") == first.id
    assert first.get(timeout=10)["lost"] is False
    bed.wait_gone(lock, 1.0)

    # a lock held across a retry countdown meets a duplicate on every pool, solo included
    retried = bed.send("t.retrying", key, 1, 1.0)
    retry_lock = bed.wait_held(retried.id)
    wait_for(lambda: len([e for e in bed.history() if e.finished]) == 2, 10, "first try")
    assert bed.lock(retry_lock)["gen"] == "0"
    duplicate = bed.send("t.retrying", key, 1, 1.0)
    info = skip_info(duplicate.get(timeout=10))
    assert info is not None
    assert info.holder == retried.id
    assert retried.get(timeout=10)["retries"] == 1
    bed.wait_gone(retry_lock, 1.0)

    report = check_history(bed.history())
    assert len(report.finished()) == 3
    assert_no_overlap(report, allow_unfinished=False)
    assert "singleton: duplicate skipped" in worker.log_text()
    assert_clean_log(worker)
