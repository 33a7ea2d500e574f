"""The test bed: real Celery workers (and beats) of a test app on one private key prefix, the
client side of that app, and what a test reads back from Redis.

A :class:`Bed` serves one test (the ``bed`` fixture of tests/conftest.py, on ``key_prefix``) or
every test of a module (a module-scoped fixture of the module's own, on ``module_prefix``: the
tests share its workers). It

- starts workers of an app module (singleton_app by default) with a pool, a concurrency, a lock
  ttl, queues and environment of their own, and waits until each answers a ping
  (:meth:`Bed.start`); beats of beat_app (:attr:`Bed.beats`);
- sends calls by name (:meth:`Bed.send`, or :attr:`Bed.app` for publish options);
- reads what the workers write: the history of guarded runs (:meth:`Bed.runs`), the library
  signals they logged (:meth:`Bed.signals`), the locks under the prefix (:meth:`Bed.locks`);
- waits on those events, never on time: a body's start (:meth:`Bed.wait_started`), a lock taken
  (:meth:`Bed.wait_held`) or gone (:meth:`Bed.wait_gone`), a signal (:meth:`Bed.wait_signal`);
- holds runs at gates until the test opens them (:meth:`Bed.gate`), and opens every gate left
  when it closes, so no run is left waiting;
- names every worker's log tail when a wait fails, and prints them when it closes (pytest
  shows them for failed tests only); :meth:`Bed.close` SIGKILLs every process it started.

A held lock is no proof that a body started: the lock is taken before the body runs, and a run
killed in between records nothing. :meth:`Bed.wait_started` waits for the body's own record.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import redis
from celery.result import AsyncResult

from tests.support.basic_app import SINGLETON_APP, close_app, history_key, make_app
from tests.support.beats import BeatFactory
from tests.support.history import (
    Execution,
    assert_no_overlap,
    check_history,
    load_history,
    wait_started,
)
from tests.support.singleton_app import signals_key
from tests.support.waiting import wait_for
from tests.support.workers import WorkerFactory, WorkerProcess

__test__ = False

#: log lines that must never appear on a path that releases correctly
BAD_LINES = (
    "singleton: lock lost",
    "singleton: lock was no longer ours",
    "singleton: release failed",
    "singleton: could not release",
)


def new_key() -> str:
    """A lock key argument no other test uses."""
    return f"k-{uuid.uuid4().hex[:8]}"


class Bed:
    """Workers and beats of the test apps on ``prefix``, the client app and a Redis client.

    ``queue``: the client app's default queue, given to every worker (``SINGLETON_TEST_QUEUE``);
    None: the apps' default. ``env``: given to every worker and beat, over the prefix's own
    variables; ``work_dir``: where their logs and schedule files go.
    """

    def __init__(
        self,
        redis_url: str,
        prefix: str,
        work_dir: Path,
        *,
        queue: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.redis_url = redis_url
        self.prefix = prefix
        self.work_dir = Path(work_dir)
        self.env = {"SINGLETON_TEST_REDIS_URL": redis_url, "SINGLETON_TEST_PREFIX": prefix}
        if queue is not None:
            self.env["SINGLETON_TEST_QUEUE"] = queue
        self.env.update(env or {})
        #: the client side of the test apps: same broker, backend, prefix and default queue
        self.app = make_app(redis_url, prefix, queue)
        #: a client of the shared Redis (touch only keys under ``prefix``)
        self.client = redis.Redis.from_url(redis_url)
        self.factory = WorkerFactory(self.work_dir, base_env=self.env)
        self._beat_factories: list[BeatFactory] = []
        #: starts beats (beat_app by default) with the bed's environment and role "beat"
        self.beats = self.new_beats()
        self.gates: list[str] = []

    # -- processes ------------------------------------------------------------------------------

    def start(
        self,
        app_module: str = SINGLETON_APP,
        *,
        pool: str = "prefork",
        concurrency: int = 2,
        ttl: float | None = None,
        queues: str | Sequence[str] | None = None,
        env: Mapping[str, str] | None = None,
        name: str | None = None,
        extra_args: Iterable[str] = (),
        ready: bool = True,
        ready_timeout: float = 30.0,
    ) -> WorkerProcess:
        """Start a worker of ``app_module``; unless ``ready`` is False, wait until it answers a
        ping (raising with its log if it exits first).

        ``ttl``: the lock ttl of singleton_app's tasks (``SINGLETON_TEST_TTL``); ``queues``:
        the queues it consumes (``-Q``), else the default one; ``env``: over the bed's."""
        env = dict(env or {})
        if ttl is not None:
            env["SINGLETON_TEST_TTL"] = str(ttl)
        if queues is not None:
            names = queues if isinstance(queues, str) else ",".join(queues)
            extra_args = ("-Q", names, *extra_args)
        worker = self.factory.start(
            app_module,
            pool=pool,
            concurrency=concurrency,
            name=name,
            env=env,
            extra_args=extra_args,
        )
        if ready:
            worker.wait_ready(self.app, timeout=ready_timeout)
        return worker

    @property
    def workers(self) -> list[WorkerProcess]:
        """Every worker started, in order."""
        return self.factory.workers

    @property
    def worker(self) -> WorkerProcess:
        """The first worker started (the only one, where a module shares one worker)."""
        assert self.workers, "no worker was started on this bed"
        return self.workers[0]

    def new_beats(self, work_dir: Path | None = None) -> BeatFactory:
        """A fresh :attr:`beats` factory (logs and schedule files under ``work_dir``); the
        beats of the previous one are SIGKILLed. A module sharing its workers gives each test
        beats of its own this way."""
        if self._beat_factories:
            self._beat_factories[-1].close()
        work_dir = work_dir or self.work_dir / f"beats-{len(self._beat_factories)}"
        factory = BeatFactory(work_dir, base_env={**self.env, "SINGLETON_TEST_ROLE": "beat"})
        self._beat_factories.append(factory)
        self.beats = factory
        return factory

    # -- calls ----------------------------------------------------------------------------------

    def send(self, name: str, *args: Any, **kwargs: Any) -> AsyncResult:
        """Send task ``name`` by name (to the app's default queue); ``kwargs`` are the task's."""
        return self.app.send_task(name, args=args, kwargs=kwargs)

    def gate(self, label: str = "gate") -> str:
        """A list no other test uses, for a run to wait on (``until=``) until :meth:`open`."""
        gate = f"{self.prefix}gate:{label}:{uuid.uuid4().hex[:8]}"
        self.gates.append(gate)
        return gate

    def open(self, gate: str, runs: int = 1) -> None:
        """Let ``runs`` runs waiting on ``gate`` go."""
        self.client.rpush(gate, *["go"] * runs)

    def open_gates(self) -> None:
        """Open every gate made so far, once, and forget them: no run is left waiting (a
        module sharing its workers does this after each test)."""
        for gate in self.gates:
            self.open(gate)
        self.gates.clear()

    # -- what the workers wrote -----------------------------------------------------------------

    def history(self) -> list[Execution]:
        """Every execution the workers' guarded bodies recorded, by start time."""
        return load_history(self.client, history_key(self.prefix))

    def runs(self, key: str) -> list[Execution]:
        """The executions recorded under ``key`` (the key argument, or a run label)."""
        return [e for e in self.history() if e.key == key]

    def wait_started(self, key: str, count: int = 1, timeout: float = 20.0) -> list[Execution]:
        """Wait until ``count`` runs of ``key`` recorded their start; their executions."""
        return wait_started(
            self.client, history_key(self.prefix), key, *self.workers, count=count, timeout=timeout
        )

    def assert_no_overlap(self, key: str | None = None, *, allow_unfinished: bool = False) -> None:
        """No two runs of one key (of ``key`` only, if given) at once, tokens increasing, and
        every run finished unless ``allow_unfinished``."""
        runs = self.history() if key is None else self.runs(key)
        assert_no_overlap(check_history(runs), allow_unfinished=allow_unfinished)

    def signals(self) -> list[str]:
        """The library's (and some of Celery's) signals the workers logged, oldest first:
        ``"<name> <task id>"``."""
        return [raw.decode() for raw in self.client.lrange(signals_key(self.prefix), 0, -1)]

    def events(self, task_id: str) -> list[str]:
        """The signals the run of ``task_id`` sent, in order, without the id."""
        return [e.replace(f" {task_id}", "") for e in self.signals() if f" {task_id}" in e]

    def wait_signal(self, name: str, task_id: str, timeout: float = 20.0) -> None:
        """Wait until the workers logged signal ``name`` for ``task_id``."""
        entry = f"{name} {task_id}"
        wait_for(lambda: entry in self.signals(), timeout, entry, *self.workers)

    def locks(self) -> dict[str, dict[str, str]]:
        """Every lock under the prefix: key -> its hash."""
        found = {}
        for raw in self.client.scan_iter(count=1000, match=f"{self.prefix}lock:*:lock"):
            fields = self.client.hgetall(raw)
            if fields:
                found[raw.decode()] = {k.decode(): v.decode() for k, v in fields.items()}
        return found

    def lock(self, key: str) -> dict[str, str]:
        """The hash of lock ``key``; empty when it is free."""
        return {k.decode(): v.decode() for k, v in self.client.hgetall(key).items()}

    def lock_of(self, task_id: str) -> str | None:
        """The key of the lock ``task_id`` holds, if any."""
        for key, fields in self.locks().items():
            if fields.get("owner") == task_id:
                return key
        return None

    def wait_held(self, task_id: str, timeout: float = 15.0) -> str:
        """Wait until ``task_id`` holds a lock; return its key."""
        key = wait_for(
            lambda: self.lock_of(task_id), timeout, f"a lock held by {task_id}", *self.workers
        )
        assert key is not None
        return key

    def wait_taken(self, key: str, timeout: float = 20.0) -> None:
        """Wait until lock ``key`` is held (by anyone)."""
        wait_for(lambda: self.client.exists(key), timeout, f"{key} to be taken", *self.workers)

    def wait_gone(self, key: str, timeout: float) -> float:
        """Wait until lock ``key`` is gone; return how long that took."""
        started = time.monotonic()
        wait_for(
            lambda: not self.client.exists(key),
            timeout,
            f"{key} to be released",
            *self.workers,
            details=lambda: repr(self.client.hgetall(key)),
        )
        return time.monotonic() - started

    # -- logs -----------------------------------------------------------------------------------

    def log_text(self) -> str:
        """Every worker's whole log, one after the other."""
        return "".join(w.log_text() for w in self.workers)

    def logs(self) -> str:
        """The tail of every worker's and beat's log, for failure messages."""
        beats = [f.logs() for f in self._beat_factories if f.beats]
        return "\n".join([self.factory.logs(), *beats])

    # -- the end --------------------------------------------------------------------------------

    def close(self) -> None:
        """Open every gate (no run is left waiting), print the logs, SIGKILL every worker and
        beat, close the clients."""
        try:
            self.open_gates()
            print(self.logs())
        finally:
            for factory in self._beat_factories:
                factory.close()
            self.factory.close()
            close_app(self.app)
            self.client.close()

    def __enter__(self) -> Bed:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


def wait_result(result: AsyncResult, timeout: float = 20.0) -> AsyncResult:
    """Wait until ``result`` is ready (success or failure)."""
    wait_for(result.ready, timeout, f"the result of {result.id}")
    return result


def assert_clean_log(worker: WorkerProcess, allow: tuple[str, ...] = ()) -> None:
    """No lost lock, no foreign lock at release, no failed release in the worker's log
    (:data:`BAD_LINES`), but for lines containing one of ``allow``."""
    log = worker.log_text()
    lines = [line for line in log.splitlines() if not any(a in line for a in allow)]
    bad = [line for line in lines if any(b in line for b in BAD_LINES)]
    assert not bad, "\n".join(bad)
