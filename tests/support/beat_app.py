"""The Celery app the beat tests run as real ``celery beat`` and ``celery worker`` processes.

Configured from the environment like ``basic_app``. The schedule has a 1 s interval entry
and an every-minute crontab entry, both recording every execution with the run label
(``<entry>@<run id>``) that SingletonScheduler puts in the message headers, plus an entry
for a task the beat process does not know (``SINGLETON_TEST_ROLE=beat`` leaves it
unregistered, so beat publishes it through ``send_task``).

``SINGLETON_TEST_BEAT_MODE`` selects "active" (default) or "leader";
``SINGLETON_TEST_BEAT_LEASE`` the leader lease; ``SINGLETON_TEST_BEAT_CATCH_UP`` a catch-up
window in seconds (the default is "latest").
"""

from __future__ import annotations

import os
from typing import Any

from celery.schedules import crontab

import celery_singleton_lock  # noqa: F401 - connects the worker hooks (scheduled-run witness)
from tests.support.basic_app import _client, history_key, make_app
from tests.support.history import record_end, record_start

__test__ = False

app = make_app()
app.main = "tests.support.beat_app"
app.conf.singleton_redis_url = app.conf.singleton_test_redis_url
app.conf.singleton_key_prefix = app.conf.singleton_test_prefix + "lock:"
app.conf.singleton_beat_mode = os.environ.get("SINGLETON_TEST_BEAT_MODE", "active")
app.conf.singleton_beat_lease = float(os.environ.get("SINGLETON_TEST_BEAT_LEASE", "3"))
if os.environ.get("SINGLETON_TEST_BEAT_CATCH_UP"):  # a window, in seconds
    app.conf.singleton_beat_catch_up = float(os.environ["SINGLETON_TEST_BEAT_CATCH_UP"])
app.conf.beat_scheduler = "celery_singleton_lock.SingletonScheduler"
app.conf.beat_schedule = {
    "every-second": {"task": "b.record", "schedule": 1.0, "args": ("every-second",)},
    "every-minute": {"task": "b.record", "schedule": crontab(), "args": ("every-minute",)},
    "remote-every-2s": {"task": "b.remote", "schedule": 2.0, "args": ("remote-every-2s",)},
}


def _record(task: Any, entry: str) -> str:
    client = _client(app.conf.singleton_test_redis_url)
    run = str(task.request.get("singleton_beat_run") or f"{entry}@?")
    exec_id = record_start(
        client,
        history_key(app.conf.singleton_test_prefix),
        run,
        None,
        str(task.request.hostname),
        os.getpid(),
    )
    record_end(client, history_key(app.conf.singleton_test_prefix), exec_id)
    return run


@app.task(bind=True, name="b.record")
def record(self: Any, entry: str) -> str:
    """Record one execution of a scheduled run, keyed by its run label."""
    return _record(self, entry)


if os.environ.get("SINGLETON_TEST_ROLE") != "beat":

    @app.task(bind=True, name="b.remote")
    def remote(self: Any, entry: str) -> str:
        """Known to workers only: beat publishes it with send_task."""
        return _record(self, entry)


# ``SINGLETON_TEST_LOCK_URL``: a different Redis URL for the run claims than the broker's (the
# banner test gives one with a password, which the banner must hide).
if os.environ.get("SINGLETON_TEST_LOCK_URL"):
    app.conf.singleton_redis_url = os.environ["SINGLETON_TEST_LOCK_URL"]


# -- added for test_chaos and test_load: late acks, scheduled runs' task ids, a singleton load ---
#
# SINGLETON_TEST_VISIBILITY=<s>: every task is acked late and requeued if its pool child dies,
#   and the broker restores a message left unacked for <s> seconds (a killed node's messages).
# SINGLETON_TEST_LOAD_KEYS=<n>: registers ``b.load`` (a retry-policy SingletonTask, ttl 1 s,
#   recorded in the history under ``load:<key>``) and ``b.fanout``, adds the entry
#   ``load-fanout`` (every second: one b.load for key ``k<slot % n>``), and records the label
#   and task id of every scheduled run that starts (history.record_beat_run).

if os.environ.get("SINGLETON_TEST_VISIBILITY"):
    from tests.support.chaos import configure_visibility

    configure_visibility(app, float(os.environ["SINGLETON_TEST_VISIBILITY"]))
    app.conf.task_acks_late = True
    app.conf.task_reject_on_worker_lost = True

if os.environ.get("SINGLETON_TEST_LOAD_KEYS"):
    import signal
    import time

    from celery.signals import task_postrun, task_prerun

    from celery_singleton_lock import SingletonTask
    from tests.support.chaos import (
        done_key,
        ended_runs_key,
        finished_runs_key,
        kill_after_body_key,
        load_key,
        load_key_name,
        reruns_key,
        sent_key,
    )
    from tests.support.history import beat_runs_key, record_beat_run

    LOAD_KEYS = int(os.environ["SINGLETON_TEST_LOAD_KEYS"])
    app.conf.beat_schedule["load-fanout"] = {
        "task": "b.fanout",
        "schedule": 1.0,
        "args": ("load-fanout",),
    }

    @task_prerun.connect(weak=False)
    def _record_scheduled_run(task_id: str | None = None, task: Any = None, **_: Any) -> None:
        label = task.request.get("singleton_beat_run") if task is not None else None
        if label:
            record_beat_run(
                _client(app.conf.singleton_test_redis_url),
                beat_runs_key(app.conf.singleton_test_prefix),
                str(label),
                str(task_id),
                str(task.request.hostname),
                os.getpid(),
            )

    @app.task(
        bind=True,
        base=SingletonTask,
        name="b.load",
        singleton_key_args=("key",),
        singleton_on_duplicate="retry",
        singleton_retry_countdown=0.5,
        singleton_ttl=1,
        acks_late=True,
        reject_on_worker_lost=True,
    )
    def load(self: Any, key: str, seconds: float) -> int:
        """Hold the lock of ``key`` for ``seconds``; recorded as ``load:<key>``."""
        client = _client(app.conf.singleton_test_redis_url)
        prefix = app.conf.singleton_test_prefix
        if client.hexists(ended_runs_key(prefix), str(self.request.id)):
            client.sadd(reruns_key(prefix), str(self.request.id))  # ran again after it ended
        token = self.singleton.fencing_token
        exec_id = record_start(
            client,
            history_key(prefix),
            load_key(key),
            token,
            str(self.request.hostname),
            os.getpid(),
        )
        time.sleep(seconds)
        record_end(client, history_key(prefix), exec_id)
        client.sadd(done_key(prefix), str(self.request.id))
        client.hincrby(finished_runs_key(prefix), str(self.request.id), 1)
        return int(token)

    @task_postrun.connect(weak=False)  # after the library's own (connected at its import)
    def _after_load(sender: Any = None, task_id: str | None = None, **kwargs: Any) -> None:
        """A b.load run ended and the library released (and recorded its completion): noted in
        ``ended_runs_key``. The node named in ``kill_after_body_key`` then dies as a whole,
        before the message is acked."""
        if getattr(sender, "name", None) != "b.load" or kwargs.get("state") != "SUCCESS":
            return
        client = _client(app.conf.singleton_test_redis_url)
        client.hset(ended_runs_key(app.conf.singleton_test_prefix), str(task_id), 1)
        flag = kill_after_body_key(app.conf.singleton_test_prefix)
        hostname = str(sender.request.hostname)
        if client.get(flag) == hostname.encode() and client.delete(flag):
            os.killpg(os.getpgid(0), signal.SIGKILL)

    @app.task(bind=True, name="b.fanout")
    def fanout(self: Any, entry: str) -> str:
        """A scheduled run (recorded like b.record) that sends one b.load for its slot's key."""
        run = _record(self, entry)
        slot = run.rsplit("@", 1)[1]
        index = int(slot) // 1000 % LOAD_KEYS if slot.isdigit() else 0
        # one task id per scheduled run, counted as sent before it is: a redelivered fan-out
        # (its node was killed) sends the same id again, so no send is lost or counted twice
        load_id = f"fanout-{self.request.id}"
        _client(app.conf.singleton_test_redis_url).sadd(
            sent_key(app.conf.singleton_test_prefix), load_id
        )
        load.apply_async(kwargs={"key": load_key_name(index), "seconds": 1.5}, task_id=load_id)
        return run


# SINGLETON_TEST_DIE_ON_PUBLISH=<before|after>:<entry>: this beat notes the label of the first
# run of <entry> it publishes in the list "<prefix>died-on", then SIGKILLs itself right before
# (claimed, not published) or right after (published, claim not confirmed) the publish.
if os.environ.get("SINGLETON_TEST_DIE_ON_PUBLISH"):
    import signal as _signal

    from celery.signals import after_task_publish, before_task_publish

    _when, _die_entry = os.environ["SINGLETON_TEST_DIE_ON_PUBLISH"].split(":", 1)

    def _die_on_publish(headers: Any = None, **_: Any) -> None:
        label = str((headers or {}).get("singleton_beat_run") or "")
        if label.rsplit("@", 1)[0] == _die_entry:
            client = _client(app.conf.singleton_test_redis_url)
            client.rpush(f"{app.conf.singleton_test_prefix}died-on", label)
            os.kill(os.getpid(), _signal.SIGKILL)

    (before_task_publish if _when == "before" else after_task_publish).connect(
        _die_on_publish, weak=False
    )


# SINGLETON_TEST_SENTRY=1: Sentry's Celery integration monitors the beat's runs (Sentry Crons),
# its check-ins recorded in Redis (tests/support/sentry_crons.py), and the schedule is six
# 2 s entries Sentry reads as one minute: ``crons-record`` (b.record), ``crons-held``
# (``b.crons_held``, a SingletonTask holding its lock 2.5 s: the run after each is skipped),
# ``crons-waits`` (``b.crons_waits``, the same lock, policy "retry": requeued while it is held),
# ``crons-coalesce`` (``b.crons_coalesce``, holding a lock of its own 2.5 s, policy "coalesce"),
# ``crons-joins`` (the same with policy "join") and ``crons-fails`` (``b.crons_fails``,
# raises). The SingletonTasks are unknown to beats, which publish them with send_task.
if os.environ.get("SINGLETON_TEST_SENTRY"):
    import time as _time

    from celery_singleton_lock import SingletonTask
    from tests.support.sentry_crons import CronsInterval, init_sentry

    init_sentry(app.conf.singleton_test_redis_url, app.conf.singleton_test_prefix)
    app.conf.beat_schedule = {
        name: {"task": task, "schedule": CronsInterval(2.0), "args": (name,)}
        for name, task in (
            ("crons-record", "b.record"),
            ("crons-held", "b.crons_held"),
            ("crons-waits", "b.crons_waits"),
            ("crons-coalesce", "b.crons_coalesce"),
            ("crons-fails", "b.crons_fails"),
            ("crons-joins", "b.crons_joins"),
        )
    }

    @app.task(bind=True, name="b.crons_fails")
    def crons_fails(self: Any, entry: str) -> None:
        """A scheduled run that fails (recorded first)."""
        _record(self, entry)
        raise ValueError("scheduled run failed")

    if os.environ.get("SINGLETON_TEST_ROLE") != "beat":

        def _crons_key(args: Any, kwargs: Any) -> str:
            return "crons"

        def _record_and_hold(task: Any, entry: str) -> str:
            """Record the run, then hold its lock 2.5 s: the entry's next run (2 s later) meets
            it."""
            run = _record(task, entry)
            _time.sleep(2.5)
            return run

        #: a lock of each task's own
        _own_lock: dict[str, Any] = {"bind": True, "base": SingletonTask, "singleton_ttl": 5}

        #: one lock for both tasks (a scope, one key)
        _crons_lock: dict[str, Any] = {
            **_own_lock,
            "singleton_scope": "crons",
            "singleton_key": _crons_key,
        }

        @app.task(name="b.crons_held", **_crons_lock)
        def crons_held(self: Any, entry: str) -> str:
            """A scheduled run holding its lock 2.5 s: the next run meets it and is skipped."""
            return _record_and_hold(self, entry)

        @app.task(
            name="b.crons_waits",
            singleton_on_duplicate="retry",
            singleton_retry_countdown=0.5,
            **_crons_lock,
        )
        def crons_waits(self: Any, entry: str) -> str:
            """A scheduled run that meets crons_held's lock and waits in the queue for it."""
            return _record(self, entry)

        @app.task(name="b.crons_coalesce", singleton_on_duplicate="coalesce", **_own_lock)
        def crons_coalesce(self: Any, entry: str) -> str:
            """A scheduled run holding its lock 2.5 s: the next run is coalesced (kept as the
            follow-up published at the release, which carries no check-in)."""
            return _record_and_hold(self, entry)

        @app.task(name="b.crons_joins", singleton_on_duplicate="join", **_own_lock)
        def crons_joins(self: Any, entry: str) -> str:
            """A scheduled run holding its lock 2.5 s: the next run joins it (its check-in
            closed as it joins; its watch copy carries none)."""
            return _record_and_hold(self, entry)
