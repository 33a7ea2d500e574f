"""The Celery app the throughput benchmarks run in real worker processes.

Broker and result backend are the private server named by ``BENCH_REDIS_URL``; the worker
gets it from its environment, the benchmark process calls :func:`configure`. Four no-op tasks
that differ only in their base class:

- ``bench.plain``: Celery's ``Task``;
- ``bench.singleton``: :class:`celery_singleton_lock.SingletonTask` (default options);
- ``bench.celery_singleton``: celery-singleton's ``Singleton`` (locks at publish time);
- ``bench.celery_once``: celery-once's ``QueueOnce`` (locks at publish time, graceful);
- ``bench.two_pings``: a plain task that sends one PING where SingletonTask acquires and one
  where it releases: the floor for any lock taken on the worker with two round trips;
- ``bench.one_ping``: only the first PING, the floor for one blocking round trip per run
  (SingletonTask's release leaves the run's path: it rides in the next acquire).
- ``bench.bare_ping``: one PING written and read on a bare connection, without redis-py's
  per-command layers: the least one blocking round trip before the body can cost, and so the
  floor of any lock taken on the worker.
- ``bench.same_wire``: a plain task that sends exactly SingletonTask's Redis traffic (the
  library's acquire.lua with the same arguments, then release.lua written after the run and
  its reply read with the next acquire) from a few lines of its own: what the lock costs on
  the wire and in the server, without the library's Python.

``bench.no_result`` is a plain task that stores no result: what a message costs a worker to
receive, run and acknowledge, and nothing more than a run.

Two floors below any run, for the flood rows (4c): tasks whose Celery ``Strategy`` handles each
message in the worker's main process, before any ``Request`` or pool:

- ``bench.ack_only`` acknowledges the message and does nothing else: the least a worker can
  spend on a message it consumes (kombu's receive and acknowledgement);
- ``bench.ack_store`` stores a ``SUCCESS`` result through the result backend, as any task's
  result is stored, then acknowledges: the least a skipped duplicate can cost, since its
  contract is a stored result (and it must also hear from Redis whether the lock is held).

``bench.coalesce`` is a ``SingletonTask`` whose duplicates coalesce into one follow-up,
``bench.join`` one whose duplicates join the run they meet, and ``bench.debounce`` one whose
calls are debounced (``singleton_debounce``, 50 ms) (section 4b).

``bench.scoped`` is a ``SingletonTask`` with ``singleton_scope`` (a lock shared across tasks),
and ``bench.permits`` one with ``singleton_permits=3``: counted in section 2c beside
``SingletonTask``, as is ``bench.coalesce`` run without a duplicate (its release is made in
place, and looks for a pending follow-up), and ``bench.acked_late``, a ``SingletonTask`` acked
late: its release also records the run's completion.

``bench.at_publish`` is a ``SingletonTask`` with ``singleton_lock_on="publish"``: a duplicate
is not published (section 7).

Section 8 (``memory``) runs ``bench.mem_singleton`` (SingletonTask, ``singleton_ttl`` of
:data:`MEM_TTL_S`), ``bench.mem_celery_singleton`` and ``bench.mem_celery_once``: no result
stored (only the locks' keys are left to count), each run counted in
:data:`MEM_DONE_KEY` ``<task name>``. ``BENCH_FENCE_MARGIN`` in the environment sets
``singleton_fence_margin``.

And ``bench.hold``, a SingletonTask keyed on ``key`` with a 30 s ttl that sleeps ``seconds``:
the run whose pool child section 6 (``child_loss``) kills.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import redis
from celery import Celery, Task
from celery_once import QueueOnce
from celery_singleton import Singleton

from celery_singleton_lock import SingletonTask
from celery_singleton_lock.core._wire import script
from celery_singleton_lock.core.backend import FENCE_MARGIN_MS, acquire_args, release_args
from celery_singleton_lock.core.keys import LockKeys

URL_ENV = "BENCH_REDIS_URL"
MARGIN_ENV = "BENCH_FENCE_MARGIN"

PLAIN = "bench.plain"
SINGLETON = "bench.singleton"
CELERY_SINGLETON = "bench.celery_singleton"
CELERY_ONCE = "bench.celery_once"
TWO_PINGS = "bench.two_pings"
ONE_PING = "bench.one_ping"
BARE_PING = "bench.bare_ping"
SAME_WIRE = "bench.same_wire"
HOLD = "bench.hold"
AT_PUBLISH = "bench.at_publish"
NO_RESULT = "bench.no_result"
ACK_ONLY = "bench.ack_only"
ACK_STORE = "bench.ack_store"
COALESCE = "bench.coalesce"
JOIN = "bench.join"
DEBOUNCE = "bench.debounce"
SCOPED = "bench.scoped"
ACKED_LATE = "bench.acked_late"
PERMITS = "bench.permits"
QUEUE_BURST = "bench.queue_burst"
RETRY_BURST = "bench.retry_burst"
#: the list each run of a burst appends ``<payload> <start µs> <end µs>`` to (server clock)
BURST_RUNS_KEY = "bench-burst-runs:"
MEM_SINGLETON = "bench.mem_singleton"
MEM_CELERY_SINGLETON = "bench.mem_celery_singleton"
MEM_CELERY_ONCE = "bench.mem_celery_once"
#: the lock ttl of section 8's SingletonTask, seconds
MEM_TTL_S = 5.0
#: section 8's run counters: ``MEM_DONE_KEY + task name``
MEM_DONE_KEY = "bench-mem-done:"

app = Celery("benchmarks.bench_app", set_as_current=False)


def configure(url: str) -> Celery:
    """Point broker, results and every library's locks at ``url``."""
    from celery_once.backends import redis as once_redis

    once_redis.redis = None  # celery-once keeps one client per process in a module global
    app.conf.update(
        broker_url=url,
        result_backend=url,
        broker_connection_retry_on_startup=True,
        task_default_queue="bench",
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        worker_hijack_root_logger=False,
        # celery-singleton-lock: the locks live in the broker's Redis by default
        singleton_key_prefix="bench-lock:",
        singleton_fence_margin=float(os.environ.get(MARGIN_ENV, FENCE_MARGIN_MS / 1000)),
        # celery-singleton
        singleton_backend_url=url,
        # celery-once
        ONCE={"backend": "celery_once.backends.Redis", "settings": {"url": url}},
    )
    return app


configure(os.environ.get(URL_ENV, "redis://127.0.0.1:1/0"))  # never the shared server


class TwoPings(Task):  # type: ignore[misc]
    """One round trip before the body and one after it, on a client of its own."""

    _client: redis.Redis | None = None

    def _ping(self) -> None:
        if self._client is None:
            self._client = redis.Redis.from_url(app.conf.broker_url)
        self._client.ping()

    def before_start(self, task_id: str, args: Any, kwargs: Any) -> None:
        self._ping()

    def after_return(self, *args: Any, **kwargs: Any) -> None:
        self._ping()


class OnePing(TwoPings):
    """One round trip before the body: the floor for a lock with one blocking round trip."""

    def after_return(self, *args: Any, **kwargs: Any) -> None:
        return None


class _Bare(threading.local):
    """A bare connection per thread (the threads pool runs tasks in several)."""

    connection: Any = None
    pending = 0


class BarePing(Task):  # type: ignore[misc]
    """One PING before the body on a bare connection: a round trip and nothing else."""

    _bare = _Bare()

    def before_start(self, task_id: str, args: Any, kwargs: Any) -> None:
        connection = self._bare.connection
        if connection is None:
            client = redis.Redis.from_url(app.conf.broker_url)
            connection = self._bare.connection = client.connection_pool.get_connection()
        connection.send_packed_command([b"*1\r\n$4\r\nPING\r\n"], check_health=False)
        connection.read_response()


class SameWire(Task):  # type: ignore[misc]
    """SingletonTask's scripts and round trips, on a bare connection of its own."""

    _bare = _Bare()
    _shas: tuple[str, str] = ("", "")

    def before_start(self, task_id: str, args: Any, kwargs: Any) -> None:
        bare = self._bare
        if bare.connection is None:
            client = redis.Redis.from_url(app.conf.broker_url)
            type(self)._shas = (
                client.script_load(script("acquire.lua").text),
                client.script_load(script("release.lua").text),
            )
            bare.connection = client.connection_pool.get_connection()
        key = f"bench-wire:{{{args[0]}}}"
        # the library's own argument lists, so this stays SingletonTask's traffic
        acquire = acquire_args(
            LockKeys(f"{key}:lock", f"{key}:fence"),
            task_id,
            0,
            300_000,
            FENCE_MARGIN_MS,
            {"task": SAME_WIRE, "host": "bench@localhost", "pid": "12345", "args": repr(args)},
        )
        connection = bare.connection
        connection.send_packed_command(
            connection.pack_command("EVALSHA", self._shas[0], *acquire), check_health=False
        )
        for _ in range(bare.pending + 1):
            connection.read_response()
        bare.pending = 0
        self.request.wire_key = key

    def after_return(self, status: str, retval: Any, task_id: str, *args: Any) -> None:
        connection = self._bare.connection
        key = self.request.wire_key
        release = release_args(f"{key}:lock", task_id, 0)
        connection.send_packed_command(
            connection.pack_command("EVALSHA", self._shas[1], *release), check_health=False
        )
        self._bare.pending += 1


@app.task(name=PLAIN, base=Task)  # type: ignore[untyped-decorator]
def plain(i: int) -> None:
    return None


@app.task(name=SINGLETON, base=SingletonTask)  # type: ignore[untyped-decorator]
def singleton(i: int) -> None:
    return None


@app.task(name=CELERY_SINGLETON, base=Singleton)  # type: ignore[untyped-decorator]
def celery_singleton(i: int) -> None:
    return None


@app.task(name=CELERY_ONCE, base=QueueOnce, once={"graceful": True})  # type: ignore[untyped-decorator]
def celery_once(i: int) -> None:
    return None


@app.task(name=TWO_PINGS, base=TwoPings)  # type: ignore[untyped-decorator]
def two_pings(i: int) -> None:
    return None


@app.task(name=ONE_PING, base=OnePing)  # type: ignore[untyped-decorator]
def one_ping(i: int) -> None:
    return None


@app.task(name=BARE_PING, base=BarePing)  # type: ignore[untyped-decorator]
def bare_ping(i: int) -> None:
    return None


@app.task(name=SAME_WIRE, base=SameWire)  # type: ignore[untyped-decorator]
def same_wire(i: int) -> None:
    return None


@app.task(name=NO_RESULT, base=Task, ignore_result=True)  # type: ignore[untyped-decorator]
def no_result(i: int) -> None:
    return None


def ack_only_strategy(task: Task, app: Celery, consumer: Any, **options: Any) -> Any:
    """A Celery task strategy that acknowledges every message and does nothing else."""

    def on_message(message: Any, *args: Any, **kwargs: Any) -> None:
        message.ack()

    return on_message


def ack_store_strategy(task: Task, app: Celery, consumer: Any, **options: Any) -> Any:
    """A Celery task strategy that stores a SUCCESS result for every message, then acks it."""
    store_result = task.backend.store_result

    def on_message(message: Any, *args: Any, **kwargs: Any) -> None:
        store_result(message.headers["id"], None, "SUCCESS")
        message.ack()

    return on_message


class AckOnly(Task):  # type: ignore[misc]
    Strategy = "benchmarks.bench_app:ack_only_strategy"


class AckStore(Task):  # type: ignore[misc]
    Strategy = "benchmarks.bench_app:ack_store_strategy"


@app.task(name=ACK_ONLY, base=AckOnly)  # type: ignore[untyped-decorator]
def ack_only(i: int) -> None:
    return None


@app.task(name=ACK_STORE, base=AckStore)  # type: ignore[untyped-decorator]
def ack_store(i: int) -> None:
    return None


@app.task(name=COALESCE, base=SingletonTask, singleton_on_duplicate="coalesce")  # type: ignore[untyped-decorator]
def coalesce(i: int) -> None:
    return None


@app.task(name=JOIN, base=SingletonTask, singleton_on_duplicate="join")  # type: ignore[untyped-decorator]
def join(i: int) -> None:
    return None


@app.task(name=DEBOUNCE, base=SingletonTask, singleton_debounce=0.05)  # type: ignore[untyped-decorator]
def debounce(i: int) -> None:
    return None


@app.task(  # type: ignore[untyped-decorator]
    name=SCOPED, base=SingletonTask, singleton_scope="bench-scope", singleton_key_args=("i",)
)
def scoped(i: int) -> None:
    return None


@app.task(name=ACKED_LATE, base=SingletonTask, acks_late=True)  # type: ignore[untyped-decorator]
def acked_late(i: int) -> None:
    return None


@app.task(name=PERMITS, base=SingletonTask, singleton_permits=3)  # type: ignore[untyped-decorator]
def permits(i: int) -> None:
    return None


@app.task(name=AT_PUBLISH, base=SingletonTask, singleton_lock_on="publish")  # type: ignore[untyped-decorator]
def at_publish(i: int) -> None:
    return None


@app.task(  # type: ignore[untyped-decorator]
    name=HOLD, base=SingletonTask, singleton_key_args=("key",), singleton_ttl=30
)
def hold(key: str, seconds: float = 0.0) -> None:
    time.sleep(seconds)


class _Counted(threading.local):
    client: redis.Redis | None = None


_counted = _Counted()


def _count_run(name: str) -> None:
    """One run of section 8's task ``name`` ended (its lock is released after this)."""
    if _counted.client is None:
        _counted.client = redis.Redis.from_url(app.conf.broker_url)
    _counted.client.incr(MEM_DONE_KEY + name)


@app.task(  # type: ignore[untyped-decorator]
    name=MEM_SINGLETON, base=SingletonTask, singleton_ttl=MEM_TTL_S, ignore_result=True
)
def mem_singleton(i: int) -> None:
    _count_run(MEM_SINGLETON)


@app.task(name=MEM_CELERY_SINGLETON, base=Singleton, ignore_result=True)  # type: ignore[untyped-decorator]
def mem_celery_singleton(i: int) -> None:
    _count_run(MEM_CELERY_SINGLETON)


@app.task(  # type: ignore[untyped-decorator]
    name=MEM_CELERY_ONCE, base=QueueOnce, once={"graceful": True}, ignore_result=True
)
def mem_celery_once(i: int) -> None:
    _count_run(MEM_CELERY_ONCE)


TASKS: dict[str, Any] = {
    "plain Task": plain,
    "plain + 1 bare PING (floor: a round trip, nothing else)": bare_ping,
    "plain + 1 PING (floor, 1 round trip)": one_ping,
    "plain + 2 PINGs (floor)": two_pings,
    "plain + SingletonTask's Redis traffic (floor, no library Python)": same_wire,
    "SingletonTask": singleton,
    "celery-singleton": celery_singleton,
    "celery-once": celery_once,
}

#: section 2c only: variants whose cost is counted, not timed, beside section 2's contenders
COUNTED_ONLY: dict[str, Any] = {
    "SingletonTask with singleton_scope": scoped,
    "SingletonTask acked late (+ completion record)": acked_late,
    "SingletonTask with singleton_permits=3": permits,
    "SingletonTask with coalesce (no duplicate)": coalesce,
}


def _burst_run(key: str, payload: int, seconds: float) -> None:
    """One run of a burst's key: its start and end on the server's clock, appended in order.
    The first call (payload 0) holds the key until the bench pushes to ``<key>:go``."""
    if _counted.client is None:
        _counted.client = redis.Redis.from_url(app.conf.broker_url)
    client = _counted.client
    start = client.time()
    if payload == 0:  # the burst's holder: until every other call reached the key
        client.blpop([BURST_RUNS_KEY + key + ":go"], timeout=60)
    else:
        time.sleep(seconds)
    end = client.time()
    started, ended = start[0] * 1_000_000 + start[1], end[0] * 1_000_000 + end[1]
    client.rpush(BURST_RUNS_KEY + key, f"{payload} {started} {ended}")


@app.task(  # type: ignore[untyped-decorator]
    name=QUEUE_BURST,
    base=SingletonTask,
    singleton_key_args=("key",),
    singleton_on_duplicate="queue",
    ignore_result=True,
)
def queue_burst(key: str, payload: int, seconds: float = 0.05) -> None:
    _burst_run(key, payload, seconds)


@app.task(  # type: ignore[untyped-decorator]
    name=RETRY_BURST,
    base=SingletonTask,
    singleton_key_args=("key",),
    singleton_on_duplicate="retry",
    singleton_retry_countdown=0.5,
)
def retry_burst(key: str, payload: int, seconds: float = 0.05) -> None:
    _burst_run(key, payload, seconds)
