"""The lock's contract with Celery's own features switched on, on real worker processes.

Each test asks "and with Celery's feature X on?": a retry that ``max_retries`` refuses,
``autoretry_for`` giving up, coalesce after such a retry, ``retry_on_worker_lost`` (Celery
5.7), a ``before_start`` override that does not call ``super()``, an eta message acked early
that the Redis broker hands out again. The contract: one run at a time per key, the lock
released on every ending (at once, not by its ttl), nothing run twice.

A worker per pool (tests.support.features_app; prefork and threads) serves the module's tests,
each on keys of its own: the tests are not marked slow, so they keep their collection order and
each xdist process starts a pool's worker once. The eta test starts a worker of its own (a
short visibility timeout).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from celery_singleton_lock import DuplicateTaskError, skip_info
from celery_singleton_lock.core.keys import KeyDeriver
from tests.support import features_app
from tests.support.bed import Bed, new_key
from tests.support.chaos import deliveries_key
from tests.support.features_app import ENDINGS, LONG_TTL, go_key
from tests.support.history import (
    assert_no_overlap,
    check_history,
    server_time_us,
)
from tests.support.waiting import wait_for

FEATURES_APP = "tests.support.features_app"

#: seconds within which a lock must be gone once its run ended: far below every LONG_TTL lock's
#: ttl, so a lock gone in time was released, not expired
RELEASED_WITHIN = 10.0
assert RELEASED_WITHIN < LONG_TTL / 2


def lock_key(bed: Bed, name: str, key: str) -> str:
    """The lock key of ``name(key, ...)`` (features_app's tasks key on ``key``)."""
    run = features_app.app.tasks[name].run
    return KeyDeriver(f"{bed.prefix}lock:", name, run, ("key",)).derive((key,), {}).lock


def wait_locked(bed: Bed, name: str, key: str) -> str:
    """Wait until the lock of ``name(key, ...)`` is held; its key."""
    lock = lock_key(bed, name, key)
    bed.wait_taken(lock)
    return lock


def wait_free(bed: Bed, name: str, key: str) -> None:
    """Wait until the lock of ``name(key, ...)`` is gone, released (:data:`RELEASED_WITHIN`)."""
    bed.wait_gone(lock_key(bed, name, key), RELEASED_WITHIN)


def go(bed: Bed, task_id: str) -> None:
    """Let the run of ``task_id`` go on (features_app's ``_wait_for_go``)."""
    bed.client.rpush(go_key(bed.prefix, task_id), 1)


def other_queue(bed: Bed) -> str:
    """A second queue the worker consumes (routing)."""
    return f"{bed.app.conf.task_default_queue}-other"


#: the pools every test of the shared worker runs in (each its own worker, shared by the tests;
#: eventlet and prefork's spawn start method: test_pools.py)
POOLS = ["prefork", "threads", "gevent"]


@pytest.fixture(scope="module", params=POOLS)
def bed(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    redis_url: str,
    module_prefix: str,
) -> Iterator[Bed]:
    """A worker of each pool in :data:`POOLS`, on its own queue (and a second one), for every
    test of the module."""
    pool = request.param
    queue = f"features-{pool}"
    work_dir = tmp_path_factory.mktemp(f"features-{pool}")
    with Bed(redis_url, module_prefix, work_dir, queue=queue) as made:
        made.start(FEATURES_APP, pool=pool, concurrency=3, queues=(queue, f"{queue}-other"))
        yield made


# -- retries Celery refuses ---------------------------------------------------------------------


def test_a_retry_that_max_retries_refuses_releases_the_lock_at_once(bed: Bed) -> None:
    """``self.retry(countdown=60)`` with no retry left ends in FAILURE: nothing is published,
    so nothing is handed over; the lock is released as after any failure, and the next call of
    the key runs."""
    key = new_key()
    result = bed.app.send_task("x.give_up", args=(key, 60.0))
    with pytest.raises(Exception, match=r"Can't retry x\.give_up"):
        result.get(timeout=20, propagate=True)
    assert result.state == "FAILURE"
    wait_free(bed, "x.give_up", key)
    again = bed.app.send_task("x.give_up", args=(key, 60.0))
    with pytest.raises(Exception, match="Can't retry"):
        again.get(timeout=20)
    assert skip_info(again) is None
    assert len(bed.runs(key)) == 2


@pytest.mark.parametrize("task", ["x.autoretry", "x.autoretry_default_delay"])
def test_autoretry_for_that_gives_up_releases_the_lock_at_once(bed: Bed, task: str) -> None:
    """``autoretry_for`` (with ``retry_backoff``/``retry_jitter``, and with Celery's default
    180 s ``default_retry_delay``): the final failure releases the lock at once; every retry
    before it took the lock over (one run at a time)."""
    key = new_key()
    result = bed.app.send_task(task, args=(key,))
    with pytest.raises(ValueError, match=r"attempt 1|no retry left"):
        result.get(timeout=20)
    wait_free(bed, task, key)
    runs = bed.runs(key)
    assert len(runs) == (2 if task == "x.autoretry" else 1)
    assert_no_overlap(check_history(runs))


def test_coalesce_publishes_the_follow_up_at_once_after_a_refused_retry(bed: Bed) -> None:
    """The holder's retry is refused (FAILURE): the follow-up its duplicate left is published
    at its release, not after the lock's ttl."""
    key = new_key()
    holder = bed.app.send_task("x.coalesce_give_up", args=(key, "holder"))
    wait_locked(bed, "x.coalesce_give_up", key)
    duplicate = bed.app.send_task("x.coalesce_give_up", args=(key, "follow"))
    info = wait_for(lambda: duplicate.ready() and skip_info(duplicate), 20, "the coalesce")
    assert info.follow_up, info
    go(bed, holder.id)
    with pytest.raises(Exception, match="Can't retry"):
        holder.get(timeout=20)
    follow_up = bed.app.AsyncResult(info.follow_up)
    assert follow_up.get(timeout=RELEASED_WITHIN) == "follow"
    wait_free(bed, "x.coalesce_give_up", key)
    assert_no_overlap(check_history(bed.runs(key)))


# -- Celery 5.7's retry_on_worker_lost ------------------------------------------------------------


def test_retry_on_worker_lost_releases_the_dead_childs_lock(bed: Bed) -> None:
    """The pool child dies holding the lock; Celery publishes the retry (30 s countdown) and
    sends no task_failure. The main process releases the lock at once: the key is free long
    before the retry comes (or the lock's 60 s ttl ends)."""
    if not hasattr(bed.app.Task, "retry_on_worker_lost"):
        pytest.skip("retry_on_worker_lost is new in Celery 5.7")
    if bed.worker.pool != "prefork":
        pytest.skip("a lost worker is a prefork child")
    key = new_key()
    result = bed.app.send_task("x.lost_then_retried", args=(key,))
    lock = wait_locked(bed, "x.lost_then_retried", key)
    assert bed.client.hget(lock, "owner") == result.id.encode()
    go(bed, result.id)
    wait_for(
        lambda: bed.client.lrange(go_key(bed.prefix, "killed"), 0, -1),
        20,
        "the child to kill itself",
        bed.worker,
    )
    wait_free(bed, "x.lost_then_retried", key)
    wait_for(
        lambda: (
            f"released by main process after worker lost: x.lost_then_retried[{result.id}]"
            in bed.worker.log_text()
        ),
        10,
        "the release's line",
        bed.worker,
    )
    wait_for(lambda: result.state == "RETRY", 10, "the RETRY state", bed.worker)


# -- before_start overridden without super() ----------------------------------------------------


def test_a_before_start_override_without_super_keeps_the_lock_renewed(bed: Bed) -> None:
    """The app's ttl is 1 s and the run lasts 3.5 s: the lock is renewed although the
    subclass's ``before_start`` never calls ``super()``; a duplicate sent midway is skipped."""
    key = new_key()
    first = bed.app.send_task("x.no_super", args=(key, 3.5))
    lock = wait_locked(bed, "x.no_super", key)
    wait_for(lambda: bed.client.pttl(lock) > 0 and bed.runs(key), 10, "the run to start")
    before = int(bed.client.hget(lock, "token") or 0)
    duplicate = bed.app.send_task("x.no_super", args=(key, 0.0))
    duplicate.get(timeout=20)
    assert skip_info(duplicate) is not None
    done = first.get(timeout=20)
    assert done["renewals"] >= 2, done
    assert done["token"] == before
    assert len(bed.runs(key)) == 1
    starts = bed.client.lrange(go_key(bed.prefix, "before_start"), 0, -1)
    assert first.id.encode() in starts  # the user's hook still runs
    wait_free(bed, "x.no_super", key)


# -- an eta message that Redis hands out again ---------------------------------------------


@pytest.mark.slow(seconds=14)
def test_an_eta_message_redelivered_while_it_waits_runs_once(
    tmp_path: Path, redis_url: str, key_prefix: str
) -> None:
    """Acked early, sent with ``countdown=4`` to a Redis broker whose visibility timeout is
    1 s: the broker hands the waiting message out again every second, and at the eta every copy
    reaches the pool. The first copy runs; the others are dropped (its completion record)."""
    with Bed(redis_url, key_prefix, tmp_path) as own:
        worker = own.start(FEATURES_APP, concurrency=3, env={"SINGLETON_TEST_VISIBILITY": "1"})
        key = new_key()
        result = own.app.send_task("x.eta_once", args=(key,), countdown=4)
        assert result.get(timeout=30)["run"] == 1
        own.wait_signal("redelivery_dropped", result.id)
        wait_for(lambda: _broker_idle(own), 20, "every copy to be consumed", worker)
        assert int(own.client.get(deliveries_key(key_prefix, result.id)) or 0) == 1


def _broker_idle(bed: Bed) -> bool:
    """No message of the bed's queue waits, unacked or queued."""
    queue = bed.app.conf.task_default_queue
    return not bed.client.hlen(f"{bed.prefix}unacked") and not bed.client.llen(
        f"{bed.prefix}{queue}"
    )


# -- results ---------------------------------------------------------------------------------


def test_a_task_that_ignores_results_stores_no_skip_marker(bed: Bed) -> None:
    """``@app.task(ignore_result=True)``, called by name (``send_task``, beat: the message
    says nothing of results, and the task decides, as Celery's tracer does): a skipped
    duplicate stores nothing, like the run it met."""
    key = new_key()
    holder = bed.app.send_task("x.ignored", args=(key, True))
    wait_locked(bed, "x.ignored", key)
    duplicate = bed.app.send_task("x.ignored", args=(key,))
    bed.wait_signal("duplicate_skipped", duplicate.id)
    go(bed, holder.id)
    wait_free(bed, "x.ignored", key)
    assert not bed.client.exists(f"{bed.prefix}celery-task-meta-{duplicate.id}")
    assert not bed.client.exists(f"{bed.prefix}celery-task-meta-{holder.id}")


# -- canvas and message options ------------------------------------------------------------


def test_a_task_replaced_by_itself_runs_the_replacement_after_it_let_go(bed: Bed) -> None:
    """``self.replace(self.s(...))`` publishes the replacement under the same task id and ends
    the run (``Ignore``): the replacement waits for that run's release, then runs; no overlap."""
    key = new_key()
    result = bed.app.send_task("x.replaced", args=(key,))
    assert result.get(timeout=20)["replaced"] is True
    wait_free(bed, "x.replaced", key)
    runs = bed.runs(key)
    assert len(runs) == 2
    assert_no_overlap(check_history(runs))


def test_a_requeued_duplicate_keeps_its_expires(bed: Bed) -> None:
    """Under "retry" a duplicate is requeued while the key is held; its ``expires`` goes with
    it, so it ends REVOKED (expired) when that time passes, not requeued for ever."""
    key = new_key()
    holder = bed.app.send_task("t.hold_retry", args=(key, 4.0))
    bed.wait_started(key)
    duplicate = bed.app.send_task("t.hold_retry", args=(key,), expires=1.5)
    wait_for(lambda: duplicate.state == "REVOKED", 20, "the duplicate to expire", bed.worker)
    assert holder.get(timeout=20)["token"] is not None
    assert len(bed.runs(key)) == 1


def test_a_shadow_name_does_not_change_the_key(bed: Bed) -> None:
    """``apply_async(shadow=...)`` renames the task in logs and events only: the key is the
    task's, and a shadowed duplicate is skipped."""
    key = new_key()
    holder = bed.app.send_task("t.hold", args=(key, 3.0))
    bed.wait_started(key)
    duplicate = bed.app.send_task("t.hold", args=(key,), shadow="renamed.hold")
    duplicate.get(timeout=20)
    assert skip_info(duplicate) is not None
    assert holder.get(timeout=20)["token"] is not None


# -- the matrix: each way a holder ends, under each duplicate policy ---------------------------


@pytest.mark.parametrize("policy", ["skip", "retry", "raise", "coalesce"])
@pytest.mark.parametrize("ending", ENDINGS)
def test_each_ending_under_each_policy(bed: Bed, ending: str, policy: str) -> None:
    """A holder of the key ends as ``ending`` (success, failure, a retry Celery refuses, with
    and without ``exc``, ``Reject``, ``Ignore``, a soft time limit) while a duplicate meets
    ``policy``: the duplicate is skipped (naming the holder), raised, requeued or coalesced;
    the holder's end releases the lock at once (its ttl is 60 s); a requeued duplicate or the
    follow-up runs after it, once; no two runs of the key overlap."""
    if ending == "soft_limit" and bed.worker.pool != "prefork":
        pytest.skip("a message's soft_time_limit is enforced by prefork only (not threads, gevent)")
    name = f"x.end_{policy}"
    key = new_key()
    options = {"soft_time_limit": 1} if ending == "soft_limit" else {}
    holder = bed.app.send_task(name, args=(key, ending), **options)
    wait_locked(bed, name, key)
    bed.wait_started(key)
    duplicate, follow_up = _duplicate_meets(bed, name, key, holder.id, policy)
    go(bed, holder.id)
    wait_for(lambda: all(e.finished for e in bed.runs(key)), 20, "the holder's end", bed.worker)
    _the_waiting_call_runs(duplicate, follow_up, policy, bed.app)
    wait_free(bed, name, key)
    runs = bed.runs(key)
    assert len(runs) == (2 if policy in ("retry", "coalesce") else 1), runs
    assert_no_overlap(check_history(runs), allow_unfinished=False)


@pytest.mark.parametrize("policy", ["skip", "retry", "raise", "coalesce"])
@pytest.mark.parametrize("ending", ["hard_limit", "revoke"])
def test_each_killed_ending_under_each_policy(bed: Bed, ending: str, policy: str) -> None:
    """The holder's child is ended from outside while a duplicate meets ``policy``: its hard
    time limit (the child is SIGKILLed: the main process releases), or ``revoke(terminate=True)``
    (SIGTERM: the child's own end releases). The lock is released long before its 60 s ttl, and
    a requeued duplicate or the follow-up runs once, after the holder was ended."""
    if bed.worker.pool != "prefork":
        pytest.skip("time limits and terminate end a prefork child")
    name = f"x.end_{policy}"
    key = new_key()
    options = {"time_limit": 4} if ending == "hard_limit" else {}
    holder = bed.app.send_task(name, args=(key, "hold"), **options)
    wait_locked(bed, name, key)
    started = bed.wait_started(key)[0]
    duplicate, follow_up = _duplicate_meets(bed, name, key, holder.id, policy)
    if ending == "hard_limit":  # no run may start before the child was killed, at 4 s
        ended_by_us = started.start_us + 4_000_000
    else:
        ended_by_us = server_time_us(bed.client)
        bed.app.control.revoke(holder.id, terminate=True)
    wait_for(holder.ready, 20, "the holder's end", bed.worker)
    assert holder.state == ("FAILURE" if ending == "hard_limit" else "REVOKED")
    _the_waiting_call_runs(duplicate, follow_up, policy, bed.app)
    wait_free(bed, name, key)
    later = [e for e in bed.runs(key) if e.exec_id != started.exec_id]
    assert len(later) == (1 if policy in ("retry", "coalesce") else 0), later
    assert all(e.start_us >= ended_by_us for e in later), (started, later)


def _duplicate_meets(
    bed: Bed, name: str, key: str, holder: str, policy: str
) -> tuple[Any, str | None]:
    """Send a duplicate of ``name(key)`` while ``holder`` holds the key, and check what it met
    under ``policy``; the duplicate's result, and the follow-up it was coalesced into."""
    duplicate = bed.app.send_task(name, args=(key,))
    follow_up = None
    if policy == "raise":
        with pytest.raises(DuplicateTaskError):
            duplicate.get(timeout=20)
    elif policy == "retry":
        bed.wait_signal("duplicate_retried", duplicate.id)
    else:
        duplicate.get(timeout=20)
        info = skip_info(duplicate)
        assert info is not None
        assert info.holder == holder
        follow_up = info.follow_up
        assert (follow_up is not None) == (policy == "coalesce")
    return duplicate, follow_up


def _the_waiting_call_runs(duplicate: Any, follow_up: str | None, policy: str, app: Celery) -> None:
    """Under "retry" the requeued duplicate, under "coalesce" the follow-up, runs after all."""
    if policy == "retry":
        assert duplicate.get(timeout=20) == "now"
    if follow_up is not None:
        assert app.AsyncResult(follow_up).get(timeout=20) == "now"


def test_a_message_requeued_by_reject_inside_its_window_waits_for_the_window_once(
    bed: Bed,
) -> None:
    """``Reject(requeue=True)`` from a run acked late with a 2 s at-least window: the broker
    hands the message back at once, and it meets its own window. It is requeued once, to the
    window's end (not every ``singleton_retry_countdown``, 0.2 s), then runs."""
    key = new_key()
    result = bed.app.send_task("x.reject_in_window", args=(key,))
    assert result.get(timeout=20)["run"] == 2
    assert bed.signals().count(f"duplicate_retried {result.id}") == 1


def test_coalesce_with_reject_on_worker_lost_runs_the_redelivered_holder_first(bed: Bed) -> None:
    """Acked late with ``task_reject_on_worker_lost``: the holder's child dies after a duplicate
    was coalesced. Celery sends no failure and the broker hands the holder's message back; it
    waits for its dead run's lock (2 s ttl), runs, and only its release publishes the
    follow-up, which runs after it: the newest call runs last."""
    if bed.worker.pool != "prefork":
        pytest.skip("a lost worker is a prefork child")
    key = new_key()
    holder = bed.app.send_task("x.coalesce_lost_late", args=(key, "die"))
    wait_locked(bed, "x.coalesce_lost_late", key)
    duplicate = bed.app.send_task("x.coalesce_lost_late", args=(key, "newest"))
    info = wait_for(lambda: duplicate.ready() and skip_info(duplicate), 20, "the coalesce")
    assert info.follow_up
    go(bed, holder.id)
    assert holder.get(timeout=30) == "die"
    assert bed.app.AsyncResult(info.follow_up).get(timeout=30) == "newest"
    runs = bed.history()
    first = next(e for e in runs if e.key == f"{key}:die")
    last = next(e for e in runs if e.key == f"{key}:newest")
    assert first.end_us is not None
    assert first.end_us <= last.start_us


def test_a_requeued_duplicate_keeps_its_headers_priority_and_queue(bed: Bed) -> None:
    """Under "retry" a duplicate is published again while the key is held: the custom headers,
    the priority and the queue it was sent with (routed to another queue than the task's
    default) reach its run."""
    key = new_key()
    holder = bed.app.send_task("x.headers", args=(key, True))
    wait_locked(bed, "x.headers", key)
    duplicate = bed.app.send_task(
        "x.headers", args=(key,), headers={"tenant": "acme"}, priority=3, queue=other_queue(bed)
    )
    bed.wait_signal("duplicate_retried", duplicate.id)
    go(bed, holder.id)
    assert duplicate.get(timeout=20) == {
        "tenant": "acme",
        "priority": 3,
        "queue": other_queue(bed),
    }


# -- how results are kept -------------------------------------------------------------------


@pytest.mark.slow(seconds=8)
@pytest.mark.parametrize("results", ["ignore", "extended", "none"])
def test_skip_and_coalesce_with_each_way_of_keeping_results(
    tmp_path: Path, redis_url: str, key_prefix: str, results: str
) -> None:
    """``task_ignore_result``, ``result_extended``, and no result backend at all: a duplicate
    is skipped (its marker stored only where results are kept, with the extended fields where
    they are on) and a coalesced one runs after the holder; every lock is released."""
    with Bed(redis_url, key_prefix, tmp_path) as bed:
        worker = bed.start(FEATURES_APP, concurrency=3, env={"SINGLETON_TEST_RESULTS": results})
        for policy in ("skip", "coalesce"):
            name, key = f"x.end_{policy}", new_key()
            holder = bed.app.send_task(name, args=(key, "return"))
            wait_locked(bed, name, key)
            duplicate = bed.app.send_task(name, args=(key,))
            bed.wait_signal("duplicate_skipped", duplicate.id)
            meta = bed.client.get(f"{key_prefix}celery-task-meta-{duplicate.id}")
            if results in ("ignore", "none"):
                assert meta is None
            else:
                stored = json.loads(meta or b"{}")
                assert stored["status"] == "SUCCESS"
                assert stored["result"]["holder"] == holder.id
                assert stored["name"] == name  # result_extended's fields
            go(bed, holder.id)
            expected = 2 if policy == "coalesce" else 1
            wait_for(
                lambda key=key, expected=expected: (
                    len(bed.runs(key)) == expected and all(e.finished for e in bed.runs(key))
                ),
                20,
                f"{expected} run(s) of {key}",
                worker,
            )
            wait_free(bed, name, key)
            assert_no_overlap(check_history(bed.runs(key)), allow_unfinished=False)
