"""Faults on real processes, each judged by the recorded history.

- a worker paused (SIGSTOP) past its lock's ttl: another worker takes over with a larger
  fencing token, and the resumed run's fenced write is rejected;
- an ``acks_late`` message redelivered by the broker's visibility timeout while its first
  delivery still runs: the copy waits for the lock, then is dropped;
- a beat and a whole worker node SIGKILLed while runs hold locks and beats publish.

Each test appends its figures to ``$SINGLETON_RELIABILITY_OUT`` (tests/support/chaos.py).
"""

from __future__ import annotations

import math
import os
import random
import signal
import time

import pytest
import redis
from celery import Celery

from celery_singleton_lock import fenced_get
from celery_singleton_lock.beat.claims import CLAIM_HEADER, KEEP_HEADER, RUN_HEADER
from celery_singleton_lock.core.keys import run_claim_key
from tests.support.basic_app import BEAT_APP, SINGLETON_APP, history_key
from tests.support.beats import BeatFactory, BeatProcess
from tests.support.chaos import (
    LoadRig,
    deliveries_key,
    lock_holders,
    record_figures,
    wait_locks_gone,
    with_twice,
)
from tests.support.history import (
    CLAIM_GRACE_S,
    BeatRunReport,
    BeatWindow,
    Execution,
    assert_no_overlap,
    beat_runs_from_history,
    check_beat_runs,
    check_history,
    load_history,
    server_time_us,
)
from tests.support.waiting import wait_for
from tests.support.workers import WorkerFactory, WorkerProcess


def history(client: redis.Redis, prefix: str) -> list[Execution]:
    """Every execution recorded under ``prefix``."""
    return load_history(client, history_key(prefix))


def owner_of(client: redis.Redis, lock: str) -> str | None:
    """The task id holding ``lock``, None when it is free."""
    owner = client.hget(lock, "owner")
    return None if owner is None else owner.decode()


def start_ready(
    factory: WorkerFactory, app: Celery, env: dict[str, str], concurrency: int = 1
) -> WorkerProcess:
    """A prefork worker of singleton_app, answering ping."""
    worker = factory.start(SINGLETON_APP, pool="prefork", concurrency=concurrency, env=env)
    worker.wait_ready(app)
    return worker


# -- 1. a pause longer than the ttl -------------------------------------------------------------


def test_paused_worker_loses_its_lock_and_its_fenced_write_is_rejected(
    worker_factory: WorkerFactory,
    client_app: Celery,
    redis_client: redis.Redis,
    key_prefix: str,
) -> None:
    """SIGSTOP past the ttl: B takes over with a larger token; resumed A is lost, fenced out."""
    a = start_ready(worker_factory, client_app, {"SINGLETON_TEST_QUEUE": "chaos-a"})
    b = start_ready(worker_factory, client_app, {"SINGLETON_TEST_QUEUE": "chaos-b"})
    key, record = "paused", f"{key_prefix}record:paused"

    first = client_app.send_task("t.fenced_hold", args=(key, record, "A", 4.0), queue="chaos-a")
    lock = wait_for(
        lambda: next(
            (
                k
                for k, f in lock_holders(redis_client, key_prefix).items()
                if f["owner"] == first.id
            ),
            None,
        ),
        15,
        "A to take the lock",
    )
    wait_for(lambda: history(redis_client, key_prefix), 5, "A's body to start")
    token_a = int(redis_client.hget(lock, "token") or 0)

    os.killpg(a.pid, signal.SIGSTOP)  # the main process and its pool child: a GC-like pause
    stopped_us = server_time_us(redis_client)
    try:
        wait_for(lambda: not redis_client.exists(lock), 3, "A's lock to expire")
        second = client_app.send_task(
            "t.fenced_hold", args=(key, record, "B", 0.5), queue="chaos-b"
        )
        value_b = second.get(timeout=10)
        time.sleep(max(0.0, stopped_us / 1e6 + 3.0 - server_time_us(redis_client) / 1e6))
    finally:
        cont_us = server_time_us(redis_client)
        os.killpg(a.pid, signal.SIGCONT)

    # A's renewer wakes up overdue: it must not bring A's lock back
    owners = set()
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        owners.add(owner_of(redis_client, lock))
        time.sleep(0.005)
    value_a = first.get(timeout=15)
    owners.add(owner_of(redis_client, lock))

    executions = history(redis_client, key_prefix)
    report = check_history(executions)
    record_figures(
        "worker paused (SIGSTOP) past the ttl: overlap expected, its stale write rejected",
        runs=len(executions),
        overlaps=len(report.overlaps),
        stuck_locks=len(wait_locks_gone(redis_client, key_prefix, 2.0)),
        lost_runs=2 - len(report.finished()),
    )

    logs = worker_factory.logs()
    print(report.summary())
    print(f"A: {value_a}\nB: {value_b}\nowners after resuming: {owners}")
    assert first.id not in owners, f"A's lock came back after the pause: {owners}\n{logs}"
    assert value_a["token"] == token_a
    assert value_b["token"] > value_a["token"], (value_a, value_b)
    assert value_b["written"] is True, value_b
    assert value_a["lost"] is True, f"A did not learn it lost the lock: {value_a}\n{logs}"
    assert value_a["written"] is False, f"A's stale write was accepted: {value_a}"
    assert value_a["record_token"] == value_b["token"]
    assert fenced_get(redis_client, record) == (b"B", value_b["token"])
    assert "singleton: lock lost" in a.log_text(), a.log_tail()

    # B ran entirely while A was paused; in wall time the two runs overlap, and only the
    # fencing token (B's is larger, A's write refused) kept the data right
    run_a, run_b = sorted(executions, key=lambda e: e.token or 0)
    assert run_a.worker == a.nodename, executions
    assert run_b.worker == b.nodename, executions
    assert stopped_us <= run_b.start_us
    assert run_b.end_us is not None
    assert run_b.end_us <= cont_us, (stopped_us, cont_us, run_b.describe())
    assert report.overlaps == [(run_a, run_b)], report.summary()
    assert not report.token_regressions, report.summary()
    assert not wait_locks_gone(redis_client, key_prefix, 2.0)


# -- 2. broker redelivery of a late-acked message -----------------------------------------------


@pytest.mark.slow(seconds=10)
def test_visibility_timeout_redelivery_waits_for_the_lock_and_is_dropped(
    worker_factory: WorkerFactory,
    client_app: Celery,
    redis_client: redis.Redis,
    key_prefix: str,
) -> None:
    """acks_late, visibility 2 s, a 6 s run: the broker's copy waits for the lock, no overlap,
    and once the first delivery finished the copy is dropped: the message ran once."""
    env = {"SINGLETON_TEST_VISIBILITY": "2"}
    workers = [
        worker_factory.start(SINGLETON_APP, pool="prefork", concurrency=1, env=env) for _ in "ab"
    ]
    for worker in workers:
        worker.wait_ready(client_app)

    result = client_app.send_task("t.hold_redelivered", args=("redelivered", 6.0))
    runs_key = deliveries_key(key_prefix, result.id)
    wait_for(
        lambda: "singleton: already completed, redelivery dropped" in worker_factory.logs(),
        30,
        "the copy to be dropped",
        *workers,
    )
    executions = wait_for(
        lambda: (h := history(redis_client, key_prefix)) and all(e.finished for e in h) and h,
        10,
        "every run to finish",
    )
    stuck = wait_locks_gone(redis_client, key_prefix, 2.0)
    report = check_history(executions)
    record_figures(
        "acks_late redelivered by the visibility timeout",
        runs=len(executions),
        overlaps=len(report.overlaps),
        stuck_locks=len(stuck),
        lost_runs=0 if result.state == "SUCCESS" else 1,
        run_twice=int(redis_client.get(runs_key) or 0) - 1,
    )

    logs = worker_factory.logs()
    print(report.summary())
    print("\n".join(line for line in logs.splitlines() if "singleton:" in line))
    assert "singleton: redelivered while held" in logs, logs
    assert len(executions) == int(redis_client.get(runs_key) or 0) == 1, report.summary()
    first = executions[0]
    assert first.end_us is not None
    assert first.end_us - first.start_us >= 5_900_000, first.describe()
    assert_no_overlap(report, allow_unfinished=False)
    assert not stuck, stuck
    wait_for(lambda: result.state == "SUCCESS", 10, "the result")
    assert result.result["run"] == 1  # the first run's result, untouched by the copy
    assert "singleton: lock lost" not in logs


def test_paused_delivery_learns_its_redelivered_copy_took_the_lock(
    worker_factory: WorkerFactory,
    client_app: Celery,
    redis_client: redis.Redis,
    key_prefix: str,
) -> None:
    """acks_late, visibility 2 s: the first delivery's process is paused (SIGSTOP) past the
    ttl, its lock expires and the broker's copy (same task id, same retries count) takes it on
    the other worker. Resumed, the first delivery must learn its lock is gone (its renewal, or
    its release, finds the copy's token) and, when it ends, leave the copy's lock alone."""
    env = {"SINGLETON_TEST_VISIBILITY": "2"}
    workers = [
        worker_factory.start(SINGLETON_APP, pool="prefork", concurrency=1, env=env) for _ in "ab"
    ]
    for worker in workers:
        worker.wait_ready(client_app)
    # the first delivery's body lasts 4 s: under load, the pause below must still find it running
    # (a body that ended first acks its message, and no copy ever comes)
    result = client_app.send_task("t.hold_redelivered", args=("paused-copy", 4.0, 10.0))
    runs_key = deliveries_key(key_prefix, result.id)
    # its body started, not only its lock taken: a child paused in between would leave the
    # copy to run as the first delivery, with the long body (seen under load)
    lock, fields = wait_for(
        lambda: (
            int(redis_client.get(runs_key) or 0) >= 1
            and next(iter(lock_holders(redis_client, key_prefix).items()), None)
        ),
        15,
        "the first delivery to take the lock and start its body",
    )
    first = next(w for w in workers if w.nodename == fields["host"])
    # only the pool child (and its renewer): a stopped main process could be the one whose
    # pending BRPOP the broker hands the restored copy to
    child = int(fields["pid"])
    os.kill(child, signal.SIGSTOP)
    try:
        wait_for(
            lambda: int(redis_client.get(runs_key) or 0) >= 2, 20, "the broker's copy", *workers
        )
        copy_token = wait_for(
            lambda: (
                (t := redis_client.hget(lock, "token")) and int(t) != int(fields["token"]) and t
            ),
            10,
            "the copy to take the lock",
        )
    finally:
        os.kill(child, signal.SIGCONT)
    wait_for(
        lambda: len([e for e in history(redis_client, key_prefix) if e.finished]) >= 1,
        15,
        "the first delivery to end",
    )
    # the copy runs 10 s: the first delivery ended (and released) while it still runs
    assert redis_client.hget(lock, "token") == copy_token, (
        "the first delivery freed the copy's lock"
    )
    # it learns at its next renewal ("lock lost ... reason=taken") or, when its body ended
    # before the renewer's next tick, at its release ("no longer ours")
    learned = ("reason=taken", "singleton: lock was no longer ours at release")
    wait_for(lambda: any(line in first.log_text() for line in learned), 10, "the first to learn")


# -- 3. a beat and a worker node killed ----------------------------------------------------------

CHAOS_PERIODS = {"every-second": 1.0, "remote-every-2s": 2.0, "load-fanout": 1.0}


def latest_publisher(beats: list[BeatProcess]) -> BeatProcess:
    """The beat that published a run most recently (the first one if none has)."""
    last = {b.name: (b.published()[-1:] or [None])[0] for b in beats}
    return max(beats, key=lambda b: p.ts if (p := last[b.name]) is not None else 0.0)


@pytest.mark.slow(seconds=32)
def test_beat_and_node_killed_while_runs_hold_locks(
    worker_factory: WorkerFactory,
    beat_factory: BeatFactory,
    client_app: Celery,
    redis_client: redis.Redis,
    key_prefix: str,
) -> None:
    """SIGKILL of a beat at a slot start and of a node holding locks: no overlap, nothing lost."""
    seed = 4004
    rig = LoadRig(
        workers=worker_factory,
        beats=beat_factory,
        app=client_app,
        client=redis_client,
        prefix=key_prefix,
        keys=4,
        visibility=6,
        rng=random.Random(seed),
    )
    rig.start(nodes=2, concurrency=3, beats=2)
    begin = time.monotonic()
    sends = 0
    beat_killed = node_killed = False
    while time.monotonic() - begin < 22:
        elapsed = time.monotonic() - begin
        if elapsed >= sends * 1.5:  # one call every 1.5 s, every third one twice
            rig.send_random(copies=2 if sends % 3 == 0 else 1)
            sends += 1
        if not beat_killed and elapsed >= 6:
            # mid-second, between two publishes (the publish itself: the two tests below)
            time.sleep(max(0.0, math.floor(time.time()) + 1.5 - time.time()))
            rig.kill_beat(latest_publisher(rig.live_beats()), replace=False)
            beat_killed = True
        if not node_killed and elapsed >= 10 and elapsed - (sends - 1) * 1.5 > 0.5:
            hosts = {f["host"] for f in lock_holders(redis_client, key_prefix).values()}
            holder = next((n for n in rig.live_nodes() if n.nodename in hosts), None)
            if holder is not None:
                rig.kill_node(holder, replace=True)
                node_killed = True
        time.sleep(0.05)
    assert beat_killed, rig.logs()
    assert node_killed, rig.logs()

    report = rig.report({**CHAOS_PERIODS, "every-minute": 60.0}, drain_timeout=30, lock_grace=2.0)
    record_figures(
        with_twice(
            "beat and worker node SIGKILLed while runs hold locks", len(report.beat.fired_twice)
        ),
        runs=len(report.load_runs) + len(report.beat.fired),
        overlaps=report.overlaps,
        stuck_locks=len(report.stuck_locks),
        lost_runs=report.lost_runs,
    )
    summary = f"seed={seed}\n{report.summary()}"
    print(summary)
    detail = f"{summary}\n{rig.logs()}"
    assert report.history.ok, detail
    assert not report.history.unfinished, detail
    assert report.beat.ok, detail
    assert not report.unexplained_calls, detail
    assert not report.unexplained_runs, detail
    assert not report.stuck_locks, detail
    assert len(report.load_runs) >= 10, detail
    assert "singleton: duplicate retried" in worker_factory.logs(), "no contention"
    # the killed node held locks, and their runs were redelivered and ran to the end
    assert any(k.kind == "node" for k in report.kills)
    assert any(n > 0 for n in report.beat.required.values()), detail


# -- 4. a beat killed inside its publish --------------------------------------------------------

DIE_ENTRY = "every-second"


def beat_dying_on_publish(  # noqa: PLR0917 - fixtures passed through
    when: str,
    beat_factory: BeatFactory,
    worker_factory: WorkerFactory,
    client_app: Celery,
    redis_client: redis.Redis,
    key_prefix: str,
) -> tuple[str, BeatRunReport, list[Execution], str]:
    """Two beats; one SIGKILLs itself ``when`` ("before"/"after") it publishes a run.

    Returns the run's label, the beat checker's report for the entry, the run's executions
    and the beat logs."""
    worker = worker_factory.start(BEAT_APP, pool="prefork", concurrency=2)
    worker.wait_ready(client_app)
    survivor = beat_factory.start(name="survivor")
    ready = {"survivor": survivor.wait_ready()}
    # the survivor must already fire every slot, so it sees the victim's claim of the fatal one
    survivor.wait_for_log(rf"beat: published run: entry={DIE_ENTRY} ", 20)
    victim = beat_factory.start(
        name="victim", env={"SINGLETON_TEST_DIE_ON_PUBLISH": f"{when}:{DIE_ENTRY}"}
    )
    ready["victim"] = victim.wait_ready()
    died_key = f"{key_prefix}died-on"
    wait_for(lambda: not victim.is_running(), 20, "the victim to win a claim and die")
    died_at = time.time()
    label = (redis_client.lindex(died_key, 0) or b"").decode()
    run_s = int(label.rsplit("@", 1)[1]) / 1000
    # the victim's pending claim expires after the 10 s publish lease; the survivor retries it
    time.sleep(max(0.0, run_s + CLAIM_GRACE_S + 1 - time.time()))
    end = time.time()
    survivor.terminate()
    time.sleep(2.0)  # let the last runs execute

    executions = history(redis_client, key_prefix)
    report = check_beat_runs(
        beat_runs_from_history(executions),
        {DIE_ENTRY: 1.0},
        [
            BeatWindow("victim", ready["victim"], died_at),
            BeatWindow("survivor", ready["survivor"], end),
        ],
        beat_kills=[run_s],
    )
    runs = [e for e in executions if e.key == label]
    record_figures(
        with_twice(f"beat SIGKILLed {when} publishing a run", len(report.fired_twice)),
        runs=len(report.fired),
        overlaps=len(check_history(executions).overlaps),
        stuck_locks=len(wait_locks_gone(redis_client, key_prefix, 2.0)),
        lost_runs=report.lost_count,
    )
    return label, report, runs, beat_factory.logs(100)


@pytest.mark.slow(seconds=20)
def test_beat_killed_after_claiming_before_publishing_publishes_the_run_late_once(
    beat_factory: BeatFactory,
    worker_factory: WorkerFactory,
    client_app: Celery,
    redis_client: redis.Redis,
    key_prefix: str,
) -> None:
    """A beat dead between claim and publish: the survivor publishes the run after the lease."""
    label, report, runs, logs = beat_dying_on_publish(
        "before", beat_factory, worker_factory, client_app, redis_client, key_prefix
    )
    detail = f"{label}\n{report.summary()}\n{logs}"
    assert len(runs) == 1, detail
    run_s = int(label.rsplit("@", 1)[1]) / 1000
    assert runs[0].start_us / 1e6 >= run_s + 9.5, detail  # after the victim's claim expired
    assert report.ok, detail


@pytest.mark.slow(seconds=22)
def test_beat_killed_after_publishing_before_confirming_does_not_publish_twice(
    beat_factory: BeatFactory,
    worker_factory: WorkerFactory,
    client_app: Celery,
    redis_client: redis.Redis,
    key_prefix: str,
) -> None:
    """A beat dead between publish and confirm: its run must not be published a second time."""
    label, report, runs, logs = beat_dying_on_publish(
        "after", beat_factory, worker_factory, client_app, redis_client, key_prefix
    )
    detail = f"{label}\n{report.summary()}\n{logs}"
    assert len(runs) == 1, detail
    assert report.ok, detail


@pytest.mark.slow(seconds=16)
def test_beat_started_after_a_claimer_died_publishes_its_run_late_once(
    beat_factory: BeatFactory,
    worker_factory: WorkerFactory,
    client_app: Celery,
    redis_client: redis.Redis,
    key_prefix: str,
) -> None:
    """A beat that starts after the run's claimer died unpublished still publishes it, once."""
    worker = worker_factory.start(BEAT_APP, pool="prefork", concurrency=2)
    worker.wait_ready(client_app)
    victim = beat_factory.start(
        name="victim", env={"SINGLETON_TEST_DIE_ON_PUBLISH": f"before:{DIE_ENTRY}"}
    )
    victim.wait_ready()
    wait_for(lambda: not victim.is_running(), 20, "the victim to claim a run and die")
    label = (redis_client.lindex(f"{key_prefix}died-on", 0) or b"").decode()
    run_s = int(label.rsplit("@", 1)[1]) / 1000
    late = beat_factory.start(name="late")  # starts after the victim's run, in a later slot
    late.wait_ready()
    wait_for(
        lambda: [e for e in history(redis_client, key_prefix) if e.key == label],
        run_s + CLAIM_GRACE_S + 15 - time.time(),
        "the late beat to publish the dead claimer's run",
    )
    late.terminate()
    time.sleep(1.0)  # a second publication, if any, would have run by now
    runs = [e for e in history(redis_client, key_prefix) if e.key == label]
    detail = f"{label}\n{beat_factory.logs(100)}"
    assert len(runs) == 1, detail
    assert runs[0].start_us / 1e6 >= run_s + 9.5, detail  # after the victim's claim expired
    assert "beat: watching a run claimed by another instance" in late.log_text(), detail


def test_worker_drops_a_second_message_of_one_scheduled_run(
    worker_factory: WorkerFactory,
    client_app: Celery,
    redis_client: redis.Redis,
    key_prefix: str,
) -> None:
    """Two messages of one run (two task ids): the second is revoked; a redelivery still runs."""
    worker = worker_factory.start(BEAT_APP, pool="prefork", concurrency=2)
    worker.wait_ready(client_app)
    label = "manual@1"
    claim = run_claim_key(f"{key_prefix}lock:", "manual", "1")
    headers = {RUN_HEADER: label, CLAIM_HEADER: claim, KEEP_HEADER: 60_000}
    first = client_app.send_task("b.record", args=("manual",), headers=headers)
    assert first.get(timeout=30) == label
    second = client_app.send_task("b.record", args=("manual",), headers=headers)
    wait_for(lambda: second.state == "REVOKED", 30, "the second message to be revoked")
    redelivered = client_app.send_task(
        "b.record", args=("manual",), headers=headers, task_id=first.id
    )
    assert redelivered.id == first.id  # its result is already there: wait for the execution

    def label_runs() -> list[Execution]:
        return [e for e in history(redis_client, key_prefix) if e.key == label]

    wait_for(lambda: len(label_runs()) >= 2, 30, "the redelivered first message to run")
    time.sleep(0.5)  # the second message, had it not been dropped, would have run long ago
    runs = label_runs()
    assert len(runs) == 2, runs  # the first message and its redelivery, never the second
    log = worker.log_text()
    assert f"singleton: duplicate scheduled run dropped: run={label} task_id={second.id}" in log
