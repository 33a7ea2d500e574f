"""The demo's Celery app: three scheduled singleton jobs and one that users call by hand.

Configured from the environment, so the demo driver, its workers and its beats (and the
containers of ``compose.yaml``) share one private space on one Redis:

- ``DEMO_REDIS_URL`` (else ``REDIS_URL``, else ``redis://127.0.0.1:6379/0``): broker and lock
  store (no result backend: the jobs record what they did themselves);
- ``DEMO_PREFIX`` (default ``demo:``): prefix of every key the demo writes: kombu's queues
  (``global_keyprefix``), the locks, the beat claims and the event log;
- ``DEMO_BEAT_SCHEDULE``: the beat's local schedule file (default ``celerybeat-schedule``).

The schedule (``SingletonScheduler``: several beats, each run published once):

- ``short``: every 2 s, :func:`short` runs 0.3 s;
- ``long``: every 5 s, :func:`long` runs 3 s with a 1 s lock ttl, so only renewal keeps its
  lock held;
- ``cron``: every minute (``crontab()``), :func:`cron` runs 0.5 s.

Users call :func:`sync_account` (1.5 s, ttl 1 s) and :func:`long` by hand, several times at
once; the duplicates are skipped. Every finished run appends one JSON event to
``<prefix>events`` (``kind`` ``run``: start and end on the Redis server's clock, node, fencing
token, renewals (``self.singleton.renewals``, counted by the worker process), run label) and
every skipped duplicate one (``kind`` ``skip``); a started run is noted in the hash
``<prefix>started`` until it ends, so a run cut short by a killed node is known.

Messages are acknowledged after the run and restored 8 s after a node died without
acknowledging them (``visibility_timeout``), so a killed worker's runs run again elsewhere.

Run the processes by hand with::

    DEMO_REDIS_URL=redis://localhost:6379/0 celery -A examples.demo_app worker -n w1@%h
    DEMO_REDIS_URL=redis://localhost:6379/0 celery -A examples.demo_app beat \\
        -S celery_singleton_lock.SingletonScheduler
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery
from celery.schedules import crontab

from celery_singleton_lock import SingletonTask, signals

REDIS_URL = (
    os.environ.get("DEMO_REDIS_URL") or os.environ.get("REDIS_URL") or "redis://127.0.0.1:6379/0"
)
PREFIX = os.environ.get("DEMO_PREFIX") or "demo:"
QUEUE = "demo"
#: The Redis list of JSON events: one per finished run and one per skipped duplicate.
EVENTS_KEY = f"{PREFIX}events"
#: The Redis hash ``<task id>/<pid>`` -> JSON of a run that started and has not ended yet.
STARTED_KEY = f"{PREFIX}started"
#: Lock ttl in seconds: shorter than the runs of ``long`` and ``sync_account``.
TTL = 1.0
#: Seconds after which the broker gives a dead node's unacknowledged messages to another.
VISIBILITY_TIMEOUT = 8.0
#: How long one run of each job takes, in seconds.
RUN_SECONDS = {"short": 0.3, "long": 3.0, "cron": 0.5, "sync_account": 1.5}
#: The schedule as (entry name, task name, period in seconds or "cron").
SCHEDULE: tuple[tuple[str, str, float | str], ...] = (
    ("short", "demo.short", 2.0),
    ("long", "demo.long", 5.0),
    ("cron", "demo.cron", "cron"),
)

app = Celery("examples.demo_app")
app.conf.update(
    broker_url=REDIS_URL,
    broker_transport_options={
        "global_keyprefix": PREFIX,
        "visibility_timeout": VISIBILITY_TIMEOUT,
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
        "unacked_mutex_expire": 5,
    },
    broker_connection_retry_on_startup=True,
    task_default_queue=QUEUE,
    task_serializer="json",
    accept_content=["json"],
    task_ignore_result=True,
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    # on a lost broker connection, stop late-acked runs: the broker redelivers them
    worker_cancel_long_running_tasks_on_connection_loss=True,
    worker_prefetch_multiplier=1,
    beat_scheduler="celery_singleton_lock.SingletonScheduler",
    beat_schedule_filename=os.environ.get("DEMO_BEAT_SCHEDULE") or "celerybeat-schedule",
    beat_schedule={
        name: {"task": task, "schedule": crontab() if period == "cron" else period}
        for name, task, period in SCHEDULE
    },
    # the lock settings (all optional: these are the demo's choices)
    singleton_redis_url=REDIS_URL,
    singleton_key_prefix=f"{PREFIX}lock:",
    singleton_ttl=TTL,
)

_clients: dict[tuple[int, str], redis.Redis] = {}


def client() -> redis.Redis:
    """One redis-py client per process (pool children get their own)."""
    key = (os.getpid(), REDIS_URL)
    if key not in _clients:
        _clients[key] = redis.Redis.from_url(REDIS_URL)
    return _clients[key]


def server_time_us(conn: redis.Redis) -> int:
    """The Redis server's clock in microseconds: one clock for every process."""
    seconds, micros = conn.time()
    return int(seconds) * 1_000_000 + int(micros)


def _label(task: Any) -> str | None:
    """The scheduled run's label ``<entry>@<run id>``, or None for a call made by hand."""
    label = task.request.get("singleton_beat_run")
    return str(label) if label else None


def _run(task: Any, job: str, seconds: float, **args: Any) -> dict[str, Any]:
    """Note the start, work for ``seconds``, append the run's event."""
    conn = client()
    record: dict[str, Any] = {
        "kind": "run",
        "job": job,
        "args": args,
        "key": task.singleton.key,
        "label": _label(task),
        "task_id": task.request.id,
        "node": task.request.hostname,
        "pid": os.getpid(),
        "token": task.singleton.fencing_token,
        "start_us": server_time_us(conn),
    }
    started = f"{task.request.id}/{os.getpid()}"  # a redelivered run gets its own field
    conn.hset(STARTED_KEY, started, json.dumps(record))
    time.sleep(seconds)
    record.update(
        end_us=server_time_us(conn), renewals=task.singleton.renewals, lost=task.singleton.lost
    )
    with conn.pipeline() as pipe:
        pipe.rpush(EVENTS_KEY, json.dumps(record))
        pipe.hdel(STARTED_KEY, started)
        pipe.execute()
    return record


@app.task(bind=True, base=SingletonTask, name="demo.short")  # type: ignore[untyped-decorator]
def short(self: Any) -> dict[str, Any]:
    """A short scheduled job."""
    return _run(self, "short", RUN_SECONDS["short"])


@app.task(bind=True, base=SingletonTask, name="demo.long")  # type: ignore[untyped-decorator]
def long(self: Any) -> dict[str, Any]:
    """A scheduled job that runs three times its lock ttl: renewal keeps the lock held."""
    return _run(self, "long", RUN_SECONDS["long"])


@app.task(bind=True, base=SingletonTask, name="demo.cron")  # type: ignore[untyped-decorator]
def cron(self: Any) -> dict[str, Any]:
    """A crontab job: once a minute."""
    return _run(self, "cron", RUN_SECONDS["cron"])


@app.task(bind=True, base=SingletonTask, name="demo.sync_account")  # type: ignore[untyped-decorator]
def sync_account(
    self: Any, account_id: int, seconds: float = RUN_SECONDS["sync_account"]
) -> dict[str, Any]:
    """Sync one account for ``seconds``; never runs twice at once per account.

    The lock key is built from every argument with defaults applied, so ``sync_account(1)``,
    ``sync_account(account_id=1)`` and ``sync_account(1, seconds=1.5)`` are one key.
    """
    return _run(self, "sync_account", seconds, account_id=account_id)


JOBS = {"short": short, "long": long, "cron": cron, "sync_account": sync_account}


@signals.duplicate_skipped.connect(weak=False)
def _note_skip(
    sender: Any = None, key: str = "", task_id: str = "", holder: str = "", **_: Any
) -> None:
    """Append a ``skip`` event for a duplicate the lock turned away."""
    name = str(getattr(sender, "name", ""))
    job = name.removeprefix("demo.")
    request = sender.request if sender is not None else None
    conn = client()
    event = {
        "kind": "skip",
        "job": job,
        "key": key,
        "label": _label(sender) if request is not None else None,
        "task_id": task_id,
        "holder": holder,
        "node": getattr(request, "hostname", None),
        "at_us": server_time_us(conn),
    }
    conn.rpush(EVENTS_KEY, json.dumps(event))
