"""A race of processes over Redlock masters (test_redlock.py): each takes the lock, records its
run in a history, holds it, releases it, again and again, until the test says stop.

The test starts :func:`race_launcher` in a subprocess (``python -c "from
tests.support.redlock_race import race_launcher; ..."``), which forks the racers. Also the
store's clients (:func:`client_for`) and the race's keys (:func:`job_keys`), as test_redlock's
other tests make them.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import random
import sys
import time
import traceback
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from celery_singleton_lock.core.backend import Contended
from celery_singleton_lock.core.keys import LockKeys, lock_keys
from celery_singleton_lock.core.redlock import RedlockStore
from celery_singleton_lock.errors import LockUnavailableError
from tests.support.history import record_end, record_start

__test__ = False

PREFIX = "rl:"


def client_for(url: str, timeout: float = 1.0) -> redis.Redis:
    """A client as the store wants it: bounded timeouts, no retries."""
    return redis.Redis.from_url(
        url,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        retry=Retry(NoBackoff(), 0),
    )


def job_keys(name: str = "job") -> LockKeys:
    """The keys of job ``name`` under :data:`PREFIX`."""
    return lock_keys(PREFIX, f"tests.{name}", name.encode())


#: how many processes race
PROCESSES = 20


def race_worker(config: dict[str, Any], tag: str) -> None:
    """One racing process: take the lock, record the run, hold it, release, again and again,
    until the test says stop (or, if the test died, a minute has passed)."""
    clients = [client_for(url) for url in config["masters"]]
    store = RedlockStore(clients, master_timeout_s=1.0)
    history = redis.Redis.from_url(config["history"])
    keys = job_keys("race")
    rng = random.Random(tag)
    history.rpush("ready", tag)
    give_up = time.monotonic() + 60  # the test died: do not wait for ever
    while not history.exists("go"):
        if time.monotonic() > give_up:
            raise TimeoutError("no go")
        time.sleep(0.005)
    counts = {"runs": 0, "contended": 0, "unavailable": 0}
    for attempt in itertools.count():
        if history.exists("stop") or time.monotonic() > give_up:
            break
        owner = f"{tag}-{attempt}"
        try:
            outcome = store.acquire(keys, owner, 0, 5000)
        except LockUnavailableError:
            counts["unavailable"] += 1
            time.sleep(0.01)
            continue
        if isinstance(outcome, Contended):
            counts["contended"] += 1
            time.sleep(rng.uniform(0.02, 0.2))
            continue
        exec_id = record_start(history, "history", keys.lock, outcome.token, tag, os.getpid())
        time.sleep(0.02)
        record_end(history, "history", exec_id)
        history.incr("runs")
        counts["runs"] += 1
        with contextlib.suppress(LockUnavailableError):  # else it expires in its ttl
            store.release(keys.lock, owner, 0)
    history.rpush("counts", json.dumps(counts))


def race_launcher(config_json: str) -> None:
    """Fork the racing processes (imports done once, no thread running yet); exit 1 if any
    of them failed."""
    config = json.loads(config_json)
    pids = []
    for n in range(config["processes"]):
        pid = os.fork()
        if pid == 0:  # pragma: no cover - runs in the child
            code = 1
            try:
                race_worker(config, f"p{n:02d}")
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)
        pids.append(pid)
    failures = sum(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) != 0 for pid in pids)
    sys.exit(1 if failures else 0)
