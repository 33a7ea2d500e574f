"""A run's own log lines go through Celery's task logger: on a real worker whose
``worker_task_log_format`` has %(task_name)s and %(task_id)s, those name the run, also for the
lines logged where no run is current (the renewer's thread, the worker's main process)."""

from __future__ import annotations

import os
import re
import signal

import redis
from celery import Celery

from celery_singleton_lock.core.keys import derive_keys
from tests.support.basic_app import SINGLETON_APP, history_key
from tests.support.history import load_history
from tests.support.waiting import wait_for
from tests.support.workers import WorkerFactory, WorkerProcess, is_alive

#: the task format under test: every field the line needs, between fixed markers
TASK_FORMAT = "TASKLINE name=%(task_name)s id=%(task_id)s logger=%(name)s | %(message)s"
_TASK_LINE = re.compile(r"TASKLINE name=(\S+) id=(\S+) logger=(\S+) \| (singleton: .*)$", re.M)
#: the ``<task>[<id>]`` every run line names (the first one in the message)
_NAMED = re.compile(r"(\S+)\[([0-9a-f-]{36})\]")


def _hold_signature(key: str, seconds: float = 0.0) -> None:
    """The key parameter of t.hold."""


def _task_lines(worker: WorkerProcess) -> list[tuple[str, str, str, str]]:
    """(task_name, task_id, logger, message) of every line in the task format."""
    return _TASK_LINE.findall(worker.log_text())


def _line(worker: WorkerProcess, start: str) -> tuple[str, str, str, str] | None:
    return next((line for line in _task_lines(worker) if line[3].startswith(start)), None)


def test_run_lines_fill_the_task_format(
    worker_factory: WorkerFactory, client_app: Celery, redis_client: redis.Redis, key_prefix: str
) -> None:
    """acquired, duplicate skipped and duplicate retried, logged in the runs, carry their own
    task name and id; so do released and lock lost, which the renewer logs from its own thread;
    the main process's release after a lost child carries the lost run's."""
    worker = worker_factory.start(
        SINGLETON_APP,
        pool="prefork",
        concurrency=3,
        env={"SINGLETON_TEST_TASK_LOG_FORMAT": TASK_FORMAT},
        extra_args=["-l", "DEBUG"],
    )
    worker.wait_ready(client_app)
    hold = client_app.signature("t.hold", kwargs={"key": "logs", "seconds": 1.5})
    holder = hold.apply_async()
    history = history_key(key_prefix)
    wait_for(lambda: load_history(redis_client, history), 20, "the holder to start", worker)
    skipped = client_app.signature("t.hold", kwargs={"key": "logs"}).apply_async()
    retried = client_app.signature("t.hold_retry", kwargs={"key": "logs-r", "seconds": 1.0})
    retry_holder = retried.apply_async()
    wait_for(lambda: len(load_history(redis_client, history)) >= 2, 20, "t.hold_retry", worker)
    retry_dup = client_app.signature("t.hold_retry", kwargs={"key": "logs-r"}).apply_async()

    expected = {
        f"singleton: acquired t.hold[{holder.id}]": ("t.hold", holder.id),
        f"singleton: duplicate skipped: t.hold[{skipped.id}]": ("t.hold", skipped.id),
        f"singleton: duplicate retried in 0.2s: t.hold_retry[{retry_dup.id}]": (
            "t.hold_retry",
            retry_dup.id,
        ),
        f"singleton: acquired t.hold_retry[{retry_holder.id}]": ("t.hold_retry", retry_holder.id),
        f"singleton: released t.hold[{holder.id}]": ("t.hold", holder.id),
    }
    # a run whose lock is taken from it: the renewer's next renewal logs it lost
    lock = derive_keys(
        f"{key_prefix}lock:", "t.hold", _hold_signature, (), {"key": "logs-stolen"}, ("key",)
    ).lock
    robbed = client_app.signature("t.hold", kwargs={"key": "logs-stolen", "seconds": 2.0})
    robbed_run = robbed.apply_async()
    wait_for(
        lambda: redis_client.hget(lock, "owner") == robbed_run.id.encode(),
        20,
        "the robbed run's lock",
        worker,
    )
    redis_client.hset(lock, "owner", "thief")
    expected[f"singleton: lock lost: t.hold[{robbed_run.id}]"] = ("t.hold", robbed_run.id)
    for start in expected:
        wait_for(lambda s=start: _line(worker, s), 20, f"the line {start!r}", worker)
    for start, (name, task_id) in expected.items():
        line = _line(worker, start)
        assert line is not None
        assert line[:3] == (name, task_id, "celery_singleton_lock.task"), line

    # the main process, for a pool child SIGKILLed mid-run: no run is current there, the line
    # names the lost run through its own fields
    lost = client_app.signature("t.hold", kwargs={"key": "logs-lost", "seconds": 30}).apply_async()
    (pid,) = wait_for(
        lambda: [e.pid for e in load_history(redis_client, history) if e.key == "logs-lost"],
        20,
        "the lost run",
        worker,
    )
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not is_alive(pid), 5, f"child {pid} to die")
    start = f"singleton: released by main process after worker lost: t.hold[{lost.id}]"
    line = wait_for(lambda: _line(worker, start), 20, f"the line {start!r}", worker)
    assert line[:3] == ("t.hold", lost.id, "celery_singleton_lock.task"), line

    # every singleton line in the task format names the run its message is about, never ???
    lines = [line for line in _task_lines(worker) if _NAMED.search(line[3])]
    assert len(lines) >= len(expected) + 1
    for name, task_id, _logger, message in lines:
        named = _NAMED.search(message)
        assert named is not None
        assert (name, task_id) == named.groups(), message
    # and the lines stay greppable: each one is in the log as "singleton: ..."
    assert all(f"| {line[3]}" in worker.log_text() for line in lines)
