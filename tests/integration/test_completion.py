"""A finished message is not run again; a finished run holds its key for an at-least window
on real worker processes of every pool and over every lock store.

- a worker SIGKILLed as a whole right after the body (and the library's release) and before
  the ack: the broker restores the message after its visibility timeout, another worker drops
  it (``singleton: already completed, redelivery dropped``), the result stays the first run's;
- an ``acks_late`` run longer than the visibility timeout: the copy waits, then is dropped;
- ``singleton_lock_at_least``: a call inside the window meets the duplicate policy (skip,
  retry, raise), publish-time dedup returns the finished run, the window survives a worker
  restart and ``celery singleton show`` tells it from a running holder.
"""

from __future__ import annotations

from typing import Any

import pytest
import redis
from celery import Celery
from celery.result import AsyncResult
from click.testing import CliRunner

from celery_singleton_lock import SingletonTask, skip_info
from celery_singleton_lock.core.admin import read_lock
from celery_singleton_lock.core.connection import store_for
from celery_singleton_lock.tools.cli import singleton
from tests.support.basic_app import SINGLETON_APP, history_key
from tests.support.chaos import deliveries_key, lock_prefix
from tests.support.history import load_history
from tests.support.waiting import wait_for
from tests.support.workers import WorkerFactory, WorkerProcess

POOLS = ["prefork", "solo", "threads"]
#: the t.window_* tasks' at-least window in these tests (SINGLETON_TEST_AT_LEAST): long enough
#: for four runs, a worker restart and the duplicate calls to happen inside it
AT_LEAST_S = 15.0  # long enough to outlast a worker's restart on a loaded machine
WINDOW_ENV = {"SINGLETON_TEST_AT_LEAST": f"{AT_LEAST_S:g}"}


def signals_logged(client: redis.Redis, prefix: str) -> list[str]:
    """The library signals (and test markers) the workers logged: ``"<name> <task id>"``."""
    return [raw.decode() for raw in client.lrange(f"{prefix}signals", 0, -1)]


def runs_of(client: redis.Redis, prefix: str, task_id: str) -> int:
    return int(client.get(deliveries_key(prefix, task_id)) or 0)


def client_task(app: Celery, key_prefix: str, redis_url: str, name: str, **options: Any) -> Any:
    """singleton_app's ``name`` (a t.window_* task) defined on the client app too: its keys, and
    its publish-time dedup."""
    app.conf.singleton_redis_url = redis_url
    app.conf.singleton_key_prefix = lock_prefix(key_prefix)

    @app.task(
        bind=True,
        base=SingletonTask,
        name=name,
        shared=False,
        singleton_key_args=("key",),
        singleton_lock_at_least=AT_LEAST_S,
        **options,
    )
    def window(self: Any, key: str, seconds: float = 0.0) -> None:
        """Runs on the worker only."""

    return window


def start(
    factory: WorkerFactory, app: Celery, pool: str, env: dict[str, str] | None = None
) -> WorkerProcess:
    worker = factory.start(SINGLETON_APP, pool=pool, concurrency=2, env=env or {})
    worker.wait_ready(app)
    return worker


# -- 1. a finished message is not run again -------------------------------------------------------


def kill_after_body(
    factory: WorkerFactory,
    app: Celery,
    client: redis.Redis,
    prefix: str,
    *,
    pool: str,
    env: dict[str, str],
) -> tuple[Any, WorkerProcess]:
    """Run t.once_late (acked late, visibility 2 s) on a worker that dies as a whole right after
    the body and task_postrun, before the ack; start another, and wait for it to drop the
    restored message. The result, and the second worker."""
    env = {"SINGLETON_TEST_VISIBILITY": "2", "SINGLETON_TEST_KILL_AFTER_BODY": "1", **env}
    first = start(factory, app, pool, env)
    result = app.send_task("t.once_late", args=(f"killed-after-body-{pool}", 0.2))
    wait_for(
        lambda: f"killed_after_body {result.id}" in signals_logged(client, prefix),
        20,
        "the kill after the body",
        first,
    )
    wait_for(lambda: not first.is_running(), 10, "the worker to die", first)
    second = start(factory, app, pool, env)
    wait_for(
        lambda: f"redelivery_dropped {result.id}" in signals_logged(client, prefix),
        30,
        "the restored message to be dropped",
        second,
    )
    assert runs_of(client, prefix, result.id) == 1
    return result, second


@pytest.mark.slow(seconds=14)
@pytest.mark.parametrize("pool", POOLS)
def test_a_worker_killed_after_the_body_before_the_ack_runs_the_message_once(
    worker_factory: WorkerFactory,
    client_app: Celery,
    redis_client: redis.Redis,
    key_prefix: str,
    pool: str,
) -> None:
    """acks_late, visibility 2 s: the worker dies as a whole right after the body; the restored
    message reaches another worker, which drops it. One execution; the result is the first's."""
    result, second = kill_after_body(
        worker_factory, client_app, redis_client, key_prefix, pool=pool, env={}
    )
    assert "singleton: already completed, redelivery dropped: t.once_late" in second.log_text()
    assert result.get(timeout=10)["run"] == 1  # the first run's result, untouched
    executions = load_history(redis_client, history_key(key_prefix))
    assert len(executions) == 1, executions


@pytest.mark.slow(seconds=12)
@pytest.mark.parametrize("pool", POOLS)
def test_an_acks_late_run_longer_than_the_visibility_timeout_runs_once(
    worker_factory: WorkerFactory,
    client_app: Celery,
    redis_client: redis.Redis,
    key_prefix: str,
    pool: str,
) -> None:
    """Visibility 2 s, a 5 s run: the broker's copy is requeued while the first delivery runs,
    then dropped when it comes back after the run ended; the message ran once."""
    env = {"SINGLETON_TEST_VISIBILITY": "2"}
    workers = [start(worker_factory, client_app, pool, env) for _ in "ab"]
    result = client_app.send_task("t.once_late", args=("longer-than-visibility", 5.0))
    assert result.get(timeout=30)["run"] == 1
    wait_for(
        lambda: f"redelivery_dropped {result.id}" in signals_logged(redis_client, key_prefix),
        20,
        "the copy to be dropped",
        *workers,
    )
    logs = worker_factory.logs()
    assert "singleton: redelivered while held" in logs
    assert runs_of(redis_client, key_prefix, result.id) == 1
    assert result.get(timeout=10)["run"] == 1


def _dropped(client: redis.Redis, prefix: str, task_id: str) -> bool:
    return f"redelivery_dropped {task_id}" in signals_logged(client, prefix)


@pytest.mark.slow(seconds=8)
@pytest.mark.parametrize("pool", POOLS)
def test_a_final_failure_is_recorded_and_a_failure_celery_or_the_broker_retries_is_not(
    worker_factory: WorkerFactory,
    client_app: Celery,
    redis_client: redis.Redis,
    key_prefix: str,
    pool: str,
) -> None:
    """Each message sent again by hand, as a broker redelivers it (same task id, same retries):

    - a failure Celery acks (the default) is final: the copy is dropped before Celery's tracer
      and the result stays FAILURE, although the task reports STARTED (``track_started``);
    - a failure left unacknowledged (``acks_on_failure_or_timeout=False``: SQS delivers it
      again, a RabbitMQ dead-letter queue may route it back) is not final: the copy runs;
    - a failure Celery retries (``autoretry_for``) records nothing: every retry runs, and only
      the last generation's success is final: a copy of the first delivery is dropped.
    """
    worker = start(worker_factory, client_app, pool)

    def state(task_id: str) -> str:
        return str(AsyncResult(task_id, app=client_app).state)  # read again: not the cache

    failed = client_app.send_task("t.fail_late", args=("final-failure",)).id
    wait_for(lambda: state(failed) == "FAILURE", 20, "the failure", worker)
    client_app.send_task("t.fail_late", args=("final-failure",), task_id=failed)
    wait_for(lambda: _dropped(redis_client, key_prefix, failed), 20, "the copy dropped", worker)
    assert runs_of(redis_client, key_prefix, failed) == 1
    assert state(failed) == "FAILURE"
    assert "run 1" in str(AsyncResult(failed, app=client_app).result)
    unacked_key = f"{key_prefix}unacked"  # kombu's hash of delivered, unacknowledged messages
    wait_for(lambda: not redis_client.hlen(unacked_key), 10, "the copy acknowledged", worker)

    unacked = client_app.send_task("t.fail_unacked", args=("unacked-failure",)).id
    wait_for(lambda: state(unacked) == "FAILURE", 20, "the failure", worker)
    client_app.send_task("t.fail_unacked", args=("unacked-failure",), task_id=unacked)
    wait_for(lambda: state(unacked) == "SUCCESS", 20, "the copy to run and succeed", worker)
    assert runs_of(redis_client, key_prefix, unacked) == 2
    assert not _dropped(redis_client, key_prefix, unacked)

    retried = client_app.send_task("t.autoretry_late", args=("auto-retried", 2)).id
    wait_for(lambda: state(retried) == "SUCCESS", 20, "the retries to succeed", worker)
    assert runs_of(redis_client, key_prefix, retried) == 3  # generations 0 and 1 failed
    client_app.send_task("t.autoretry_late", args=("auto-retried", 2), task_id=retried)
    wait_for(lambda: _dropped(redis_client, key_prefix, retried), 20, "the copy dropped", worker)
    assert runs_of(redis_client, key_prefix, retried) == 3
    assert AsyncResult(retried, app=client_app).result == 3
    assert "singleton: already completed, redelivery dropped: t.fail_late" in worker.log_text()


# -- 2. at-least windows ------------------------------------------------------------------------


def _executions(client: redis.Redis, prefix: str, key: str) -> list[Any]:
    return [e for e in load_history(client, history_key(prefix)) if e.key == key]


@pytest.mark.slow(seconds=27)
@pytest.mark.parametrize("pool", POOLS)
def test_a_window_meets_every_policy_and_survives_a_restart(  # noqa: PLR0917 - fixtures
    worker_factory: WorkerFactory,
    client_app: Celery,
    redis_client: redis.Redis,
    key_prefix: str,
    redis_url: str,
    pool: str,
) -> None:
    """singleton_lock_at_least=15: after a short run the key stays blocked until 15 s after the
    run started (server clock): skip names the finished run, raise raises, retry runs once the
    window ended, publish-time dedup returns the finished run; a new worker still finds it."""
    worker = start(worker_factory, client_app, pool, WINDOW_ENV)
    firsts = {
        name: client_app.send_task(f"t.window_{name}", args=(f"w-{name}", 0.1))
        for name in ("skip", "retry", "raise", "publish")
    }
    for first in firsts.values():
        first.get(timeout=20)
    # sent at once, it meets the window in this worker (14+ s left): requeued to the window's end,
    # its waiting message must survive the restart
    retried = client_app.send_task("t.window_retry", args=("w-retry", 0.1))
    worker.wait_for_log(rf"singleton: duplicate retried.*{retried.id}")
    old_log = worker.log_text()
    worker.terminate()  # the windows live in Redis: a restarted worker still finds them
    worker = start(worker_factory, client_app, pool, WINDOW_ENV)
    skip = client_task(client_app, key_prefix, redis_url, "t.window_skip")
    lock = skip.singleton_keys(("w-skip",), {}).lock
    shown = read_lock(redis_client, lock, lock_prefix(key_prefix))
    assert shown is not None
    assert shown.state == "window"
    retry_lock = client_task(client_app, key_prefix, redis_url, "t.window_retry").singleton_keys(
        ("w-retry",), {}
    )
    retry_window = read_lock(redis_client, retry_lock.lock, lock_prefix(key_prefix))
    assert retry_window is not None
    assert retry_window.state == "window"
    assert retry_window.since_ms is not None

    skipped = client_app.send_task("t.window_skip", args=("w-skip", 0.1))
    info = skip_info(wait_for(lambda: skipped.ready() and skipped, 20, "the skip", worker))
    assert info is not None
    assert info.holder == firsts["skip"].id  # the finished run

    raised = client_app.send_task("t.window_raise", args=("w-raise", 0.1))
    wait_for(raised.ready, 20, "the raise", worker)
    assert raised.state == "FAILURE"
    assert "DuplicateTaskError" in repr(raised.result)

    publish = client_task(
        client_app, key_prefix, redis_url, "t.window_publish", singleton_lock_on="publish"
    )
    published = publish.delay("w-publish", 0.1)
    assert published.id == firsts["publish"].id

    retried.get(timeout=AT_LEAST_S + 15)
    runs = _executions(redis_client, key_prefix, "w-retry")
    assert len(runs) == 2, runs
    # the window runs from when the first run took the lock (its `since`, server clock), a
    # little before its body started
    assert runs[1].start_us >= (retry_window.since_ms / 1000 + AT_LEAST_S) * 1e6, runs
    # requeued to the window's end, not every retry_countdown (0.2 s) until then
    requeues = [
        line
        for line in (old_log + worker.log_text()).splitlines()
        if "singleton: duplicate retried" in line and retried.id in line
    ]
    assert 1 <= len(requeues) <= 2, requeues

    wait_for(lambda: not redis_client.exists(lock), AT_LEAST_S + 5, "the window to end", worker)
    again = client_app.send_task("t.window_skip", args=("w-skip", 0.1))
    assert skip_info(again.get(timeout=20)) is None
    assert len(_executions(redis_client, key_prefix, "w-skip")) == 2


def test_the_cli_tells_a_window_from_a_running_holder(
    worker_factory: WorkerFactory,
    client_app: Celery,
    redis_client: redis.Redis,
    key_prefix: str,
    redis_url: str,
) -> None:
    """``celery singleton show/list``: a running holder is "running", a window "window"."""
    worker = start(worker_factory, client_app, "prefork", WINDOW_ENV)
    task = client_task(client_app, key_prefix, redis_url, "t.window_skip")
    lock = task.singleton_keys(("w-cli",), {}).lock
    prefix = lock_prefix(key_prefix)
    running = client_app.send_task("t.window_skip", args=("w-cli", 1.5))
    wait_for(lambda: redis_client.exists(lock), 20, "the run to take its lock", worker)
    assert (info := read_lock(redis_client, lock, prefix)) is not None
    assert info.state == "running"
    running.get(timeout=20)  # stored before task_postrun releases: the window comes right after
    windowed = wait_for(
        lambda: (i := read_lock(redis_client, lock, prefix)) and i.state == "window" and i,
        10,
        "the window",
        worker,
    )
    assert windowed.owner == running.id
    cli = CliRunner()
    shown = cli.invoke(singleton, ["--url", redis_url, "--prefix", prefix, "show", lock])
    assert shown.exit_code == 0, shown.output
    assert "state:     window" in shown.output
    listed = cli.invoke(singleton, ["--url", redis_url, "--prefix", prefix, "list"])
    assert "\twindow\t" in listed.output, listed.output


# -- both, over Sentinel, Cluster and Redlock -----------------------------------------------------


@pytest.mark.slow(seconds=12)
@pytest.mark.usefixtures("forget_stores")
@pytest.mark.parametrize(
    ("store", "pool"), [("sentinel", "prefork"), ("cluster", "threads"), ("redlock", "solo")]
)
def test_completion_and_window_over_every_store(  # noqa: PLR0917 - fixtures
    worker_factory: WorkerFactory,
    client_app: Celery,
    redis_client: redis.Redis,
    key_prefix: str,
    redis_url: str,
    lock_urls: dict[str, str],
    store: str,
    pool: str,
) -> None:
    """The locks on a Sentinel's master, a Cluster or Redlock masters: a late-acked run longer
    than the visibility timeout runs once, and a window skips a call made inside it.

    Each store on another pool, so that every store meets a pool and every pool a store: the
    store decides how the record and the window are written, the pool where the run's release
    is made, and the two do not meet (the tests above run every pool on the single server)."""
    env = {"SINGLETON_TEST_VISIBILITY": "2", "SINGLETON_TEST_LOCK_URL": lock_urls[store]}
    workers = [start(worker_factory, client_app, pool, env) for _ in "ab"]
    late = client_app.send_task("t.once_late", args=(f"{store}-{pool}-late", 4.0))
    first = client_app.send_task("t.window_skip", args=(f"{store}-{pool}-window", 0.1))
    first.get(timeout=20)
    task = client_task(client_app, key_prefix, redis_url, "t.window_skip")
    lock_key = task.singleton_keys((f"{store}-{pool}-window",), {}).lock
    locks = store_for(lock_urls[store])
    wait_for(lambda: "ended" in locks.holder(lock_key), 10, "the window", *workers)
    skipped = client_app.send_task("t.window_skip", args=(f"{store}-{pool}-window", 0.1))
    info = skip_info(wait_for(lambda: skipped.ready() and skipped, 20, "the skip", *workers))
    assert info is not None
    assert info.holder == first.id
    assert late.get(timeout=30)["run"] == 1
    wait_for(
        lambda: f"redelivery_dropped {late.id}" in signals_logged(redis_client, key_prefix),
        20,
        "the copy to be dropped",
        *workers,
    )
    assert runs_of(redis_client, key_prefix, late.id) == 1


@pytest.mark.slow(seconds=14)
@pytest.mark.usefixtures("forget_stores")
@pytest.mark.parametrize("store", ["sentinel", "cluster", "redlock"])
def test_a_worker_killed_after_the_body_over_every_store(  # noqa: PLR0917 - fixtures
    worker_factory: WorkerFactory,
    client_app: Celery,
    redis_client: redis.Redis,
    key_prefix: str,
    lock_urls: dict[str, str],
    store: str,
) -> None:
    """The kill right after the body and task_postrun, before the ack, with the locks on a
    Sentinel's master, a Cluster or Redlock masters: the restored message is dropped."""
    result, _ = kill_after_body(
        worker_factory,
        client_app,
        redis_client,
        key_prefix,
        pool="prefork",
        env={"SINGLETON_TEST_LOCK_URL": lock_urls[store]},
    )
    assert result.get(timeout=10)["run"] == 1
