"""The Celery app the SingletonTask integration tests run in real worker processes.

Configured from the environment like ``basic_app`` (``SINGLETON_TEST_REDIS_URL``,
``SINGLETON_TEST_PREFIX``, ``SINGLETON_TEST_QUEUE``); ``SINGLETON_TEST_TTL`` sets the lock
ttl of every task (default 1 s, so any task longer than a second needs renewal).
Every task records its execution (start, end, fencing token) in the history list.
"""

from __future__ import annotations

import os
import time
from typing import Any

from celery.exceptions import Ignore, Reject

from celery_singleton_lock import SingletonTask
from tests.support.basic_app import _client, history_key, make_app
from tests.support.history import load_history, record_end, record_start
from tests.support.waiting import wait_for

__test__ = False

TTL = float(os.environ.get("SINGLETON_TEST_TTL", "1"))

app = make_app()
app.main = "tests.support.singleton_app"
app.conf.singleton_redis_url = app.conf.singleton_test_redis_url
app.conf.singleton_key_prefix = app.conf.singleton_test_prefix + "lock:"
app.conf.singleton_ttl = TTL


def _run(task: Any, key: str, seconds: float, until: str | None = None) -> dict[str, Any]:
    """Record this execution in the history while it sleeps ``seconds``; with ``until``, while
    it waits (at most 60 s) for the test to push to that list instead."""
    client = _client(app.conf.singleton_test_redis_url)
    hkey = history_key(app.conf.singleton_test_prefix)
    token = task.singleton.fencing_token
    exec_id = record_start(client, hkey, key, token, str(task.request.hostname), os.getpid())
    if until is None:
        time.sleep(seconds)
    else:  # short blocking reads: redis-py gives up on one blocked for more than 5 s
        deadline = time.monotonic() + 60
        while not client.blpop([until], timeout=1) and time.monotonic() < deadline:
            pass
    record_end(client, hkey, exec_id)
    return {"token": token, "lost": task.singleton.lost, "pid": os.getpid()}


@app.task(bind=True, base=SingletonTask, name="t.hold", singleton_key_args=("key",))
def hold(self: Any, key: str, seconds: float = 0.0, payload: Any = None) -> dict[str, Any]:
    """Hold the lock of ``key`` for ``seconds`` (default policy: skip)."""
    return _run(self, key, seconds)


@app.task(
    bind=True,
    base=SingletonTask,
    name="t.hold_retry",
    singleton_key_args=("key",),
    singleton_on_duplicate="retry",
    singleton_retry_countdown=0.2,
)
def hold_retry(self: Any, key: str, seconds: float = 0.0, payload: Any = None) -> dict[str, Any]:
    """Like hold, but duplicates are requeued until they can run; returns ``repr(payload)``."""
    return {**_run(self, key, seconds), "payload": repr(payload)}


@app.task(
    bind=True,
    base=SingletonTask,
    name="t.hold_raise",
    singleton_key_args=("key",),
    singleton_on_duplicate="raise",
)
def hold_raise(self: Any, key: str, seconds: float = 0.0) -> dict[str, Any]:
    """Like hold, but duplicates fail with DuplicateTaskError."""
    return _run(self, key, seconds)


#: the options of the coalescing tasks keyed on ``key``
COALESCING: dict[str, Any] = {
    "bind": True,
    "base": SingletonTask,
    "singleton_key_args": ("key",),
    "singleton_on_duplicate": "coalesce",
}


@app.task(name="t.hold_coalesce", **COALESCING)
def hold_coalesce(
    self: Any, key: str, seconds: float = 0.0, payload: Any = None, until: str | None = None
) -> dict[str, Any]:
    """Like hold, but duplicates coalesce into one follow-up; returns its ``payload`` too. With
    ``until``, it holds the lock until the test pushes to that list (``_run``)."""
    return {**_run(self, key, seconds, until), "payload": payload}


@app.task(bind=True, base=SingletonTask, name="t.retrying", max_retries=5)
def retrying(self: Any, key: str, times: int, countdown: float = 0.3) -> dict[str, Any]:
    """Retry ``times`` times (each run recorded), then succeed."""
    result = _run(self, key, 0.2)
    if self.request.retries < times:
        raise self.retry(countdown=countdown)
    return {**result, "retries": self.request.retries}


@app.task(bind=True, base=SingletonTask, name="t.outcome")
def outcome(self: Any, key: str, kind: str, seconds: float = 0.0) -> dict[str, Any]:
    """End with ``kind``: "ok", "fail", "ignore", "reject", after ``seconds``."""
    result = _run(self, key, seconds)
    if kind == "fail":
        raise ValueError("failed on purpose")
    if kind == "ignore":
        raise Ignore()
    if kind == "reject":
        raise Reject("rejected on purpose", requeue=False)
    return result


@app.task(
    bind=True,
    base=SingletonTask,
    name="t.limited",
    soft_time_limit=1,
    time_limit=2,
)
def limited(self: Any, key: str, seconds: float, swallow_soft: bool = False) -> dict[str, Any]:
    """Run into the soft (and, with ``swallow_soft``, the hard) time limit."""
    from celery.exceptions import SoftTimeLimitExceeded

    try:
        return _run(self, key, seconds)
    except SoftTimeLimitExceeded:
        if swallow_soft:
            time.sleep(seconds)
        raise


@app.task(bind=True, base=SingletonTask, name="t.hung", singleton_max_hold=1.5)
def hung(self: Any, key: str, seconds: float) -> dict[str, Any]:
    """A task that runs past its max_hold; reports whether it noticed the loss."""
    return _run(self, key, seconds)


@app.task(bind=True, base=SingletonTask, name="t.whole_args")
def whole_args(self: Any, account_id: int, full: bool = False) -> int | None:
    """Keyed on all its arguments; returns its fencing token after a short nap."""
    time.sleep(0.5)
    token: int | None = self.singleton.fencing_token
    return token


# -- added for test_policies: a log of the library's signals, and a bad setting on demand --------

from celery_singleton_lock import signals as _singleton_signals  # noqa: E402

SIGNALS_SUFFIX = "signals"


def signals_key(prefix: str) -> str:
    """The list every library signal is logged to (``"<signal name> <task_id>"``)."""
    return f"{prefix}{SIGNALS_SUFFIX}"


def _signal_logger(signal_name: str) -> Any:
    def receiver(sender: Any = None, task_id: str | None = None, **kwargs: Any) -> None:
        client = _client(app.conf.singleton_test_redis_url)
        client.rpush(signals_key(app.conf.singleton_test_prefix), f"{signal_name} {task_id}")

    return receiver


# Only in processes started for a test (they get a private prefix): a test process that
# imports this module for signals_key() must not log its own in-process runs to the
# shared server under the default prefix, where nothing would ever delete them.
if os.environ.get("SINGLETON_TEST_PREFIX"):
    for _signal_name in _singleton_signals.__all__:
        getattr(_singleton_signals, _signal_name).connect(_signal_logger(_signal_name), weak=False)

# SINGLETON_TEST_BAD_POLICY=<value> sets singleton_on_duplicate app-wide to that (invalid) value,
# so the worker must refuse to start.
if os.environ.get("SINGLETON_TEST_BAD_POLICY"):
    app.conf.singleton_on_duplicate = os.environ["SINGLETON_TEST_BAD_POLICY"]

# SINGLETON_TEST_COMPLETION_TTL=<seconds> sets singleton_completion_ttl app-wide ("inf": the
# worker must refuse to start).
if os.environ.get("SINGLETON_TEST_COMPLETION_TTL"):
    app.conf.singleton_completion_ttl = float(os.environ["SINGLETON_TEST_COMPLETION_TTL"])


# -- added for test_release_paths: a late-acked task, and one with a slow finally block -------


@app.task(
    bind=True,
    base=SingletonTask,
    name="t.hold_late",
    singleton_key_args=("key",),
    acks_late=True,
    reject_on_worker_lost=True,
)
def hold_late(self: Any, key: str, seconds: float = 0.0) -> dict[str, Any]:
    """Like hold, but acked late: a killed child's message is redelivered, same task id."""
    return _run(self, key, seconds)


@app.task(bind=True, base=SingletonTask, name="t.hold_cleanup", singleton_key_args=("key",))
def hold_cleanup(self: Any, key: str, seconds: float = 0.0, cleanup: float = 0.0) -> None:
    """Hold ``key`` for ``seconds``, then a finally block (it runs on SIGTERM too) ``cleanup``."""
    client = _client(app.conf.singleton_test_redis_url)
    hkey = history_key(app.conf.singleton_test_prefix)
    token = self.singleton.fencing_token
    exec_id = record_start(client, hkey, key, token, str(self.request.hostname), os.getpid())
    try:
        time.sleep(seconds)
    finally:
        time.sleep(cleanup)
        record_end(client, hkey, exec_id)


# -- added for test_chaos: fenced writes after a pause, and a broker redelivery ----------------

from celery_singleton_lock import fenced_set as _fenced_set  # noqa: E402
from tests.support.chaos import configure_visibility, deliveries_key  # noqa: E402

# SINGLETON_TEST_VISIBILITY=<s>: the broker restores a message left unacked for <s> seconds
# (kombu's visibility_timeout), sweeping every second (see tests.support.chaos).
if os.environ.get("SINGLETON_TEST_VISIBILITY"):
    configure_visibility(app, float(os.environ["SINGLETON_TEST_VISIBILITY"]))

# SINGLETON_TEST_CHILD_GRACE_S=<s>: the worker's main process waits <s> seconds, not the
# default 0.5 s, before it releases the lock of a run whose child it killed or timed out.
if os.environ.get("SINGLETON_TEST_CHILD_GRACE_S"):
    from celery_singleton_lock.worker import hooks as _hooks

    _hooks.CHILD_EXIT_GRACE_S = float(os.environ["SINGLETON_TEST_CHILD_GRACE_S"])


@app.task(bind=True, base=SingletonTask, name="t.fenced_hold", singleton_key_args=("key",))
def fenced_hold(self: Any, key: str, record: str, value: str, seconds: float) -> dict[str, Any]:
    """Hold ``key`` for ``seconds``, then write ``value`` to ``record`` fenced by the token."""
    client = _client(app.conf.singleton_test_redis_url)
    hkey = history_key(app.conf.singleton_test_prefix)
    token = self.singleton.fencing_token
    exec_id = record_start(client, hkey, key, token, str(self.request.hostname), os.getpid())
    time.sleep(seconds)
    lost_before_write = self.singleton.lost
    write = _fenced_set(client, record, value, token)
    record_end(client, hkey, exec_id)
    return {
        "token": token,
        "lost": lost_before_write,
        "written": write.written,
        "record_token": write.token,
        "pid": os.getpid(),
    }


@app.task(
    bind=True,
    base=SingletonTask,
    name="t.hold_redelivered",
    singleton_key_args=("key",),
    acks_late=True,
)
def hold_redelivered(self: Any, key: str, seconds: float, again: float = 0.3) -> dict[str, Any]:
    """Acked late: the first run of a task id lasts ``seconds``, any later run ``again``."""
    client = _client(app.conf.singleton_test_redis_url)
    run = int(client.incr(deliveries_key(app.conf.singleton_test_prefix, self.request.id)))
    return {**_run(self, key, seconds if run == 1 else again), "run": run}


# -- added for test_redis_faults and test_bad_settings: the lock store elsewhere, settings ------
#
# SINGLETON_TEST_LOCK_URL         singleton_redis_url: the locks on another server (a private one
#                                 a test may stop, pause or restart) while the broker, the results
#                                 and the history stay on SINGLETON_TEST_REDIS_URL; any string
#                                 is taken as is, so an invalid URL must stop the worker
# SINGLETON_TEST_ON_REDIS_ERROR   singleton_on_redis_error app-wide ("fail", "run", or invalid)
# SINGLETON_TEST_RETRY_COUNTDOWN  singleton_retry_countdown app-wide, in seconds
# (an invalid ttl: SINGLETON_TEST_TTL=0 or -1; an invalid policy: SINGLETON_TEST_BAD_POLICY)

if os.environ.get("SINGLETON_TEST_LOCK_URL"):
    app.conf.singleton_redis_url = os.environ["SINGLETON_TEST_LOCK_URL"]
if os.environ.get("SINGLETON_TEST_ON_REDIS_ERROR"):
    app.conf.singleton_on_redis_error = os.environ["SINGLETON_TEST_ON_REDIS_ERROR"]
if os.environ.get("SINGLETON_TEST_RETRY_COUNTDOWN"):
    app.conf.singleton_retry_countdown = float(os.environ["SINGLETON_TEST_RETRY_COUNTDOWN"])


# -- added for test_publish: publish-time dedup (the test process defines the same task) -------


@app.task(
    bind=True,
    base=SingletonTask,
    name="t.publish_hold",
    singleton_key_args=("key",),
    singleton_lock_on="publish",
)
def publish_hold(self: Any, key: str, seconds: float = 0.0, retries: int = 0) -> dict[str, Any]:
    """Like hold, deduplicated at publish; retries itself ``retries`` times first."""
    result = _run(self, key, seconds)
    if self.request.retries < retries:
        raise self.retry(countdown=0.2)
    return {**result, "retries": self.request.retries}


# -- added for test_publish_seams: publish-time dedup at its seams (serializers, canvas) ----------


@app.task(
    bind=True,
    base=SingletonTask,
    name="t.publish_quiet",
    singleton_key_args=("key",),
    singleton_lock_on="publish",
    ignore_result=True,
)
def publish_quiet(self: Any, key: Any, seconds: float = 0.0) -> None:
    """Deduplicated at publish, stores no result: a marker left behind blocks the key."""
    _run(self, repr(key), seconds)


@app.task(
    bind=True,
    base=SingletonTask,
    name="t.tenant_step",
    singleton_key_args=("tenant",),
    singleton_lock_on=os.environ.get("SINGLETON_TEST_LOCK_ON", "publish"),
)
def tenant_step(self: Any, tenant: str, step: int, seconds: float = 0.0) -> int:
    """One step of a tenant's chain: recorded as ``<tenant>:<step>``; returns the step."""
    _run(self, f"{tenant}:{step}", seconds)
    return step


# -- added for test_key_callable: singleton_key given in each way the docs allow ----------------


def _account_key(args: Any, kwargs: Any) -> str:
    """Every call of one account is one key, whatever else it is given."""
    return f"account-{args[0] if args else kwargs['account']}"


class AccountKeyed(SingletonTask):  # type: ignore[misc]
    """A base class that names the key callable as a plain class attribute."""

    singleton_key = _account_key


class AccountKeyedStatic(SingletonTask):  # type: ignore[misc]
    """A base class that names the key callable as a staticmethod."""

    singleton_key = staticmethod(_account_key)


def _keyed_run(self: Any, account: int, seconds: float, note: str) -> dict[str, Any]:
    return _run(self, f"account-{account}:{note}", seconds)


@app.task(bind=True, base=SingletonTask, name="t.key_lambda", singleton_key=_account_key)
def key_lambda(self: Any, account: int, seconds: float = 0.0, note: str = "") -> dict[str, Any]:
    """singleton_key given to the decorator as a plain function."""
    return _keyed_run(self, account, seconds, note)


@app.task(
    bind=True,
    base=SingletonTask,
    name="t.key_inline",
    singleton_key=lambda args, kwargs: f"account-{args[0]}",
)
def key_inline(self: Any, account: int, seconds: float = 0.0, note: str = "") -> dict[str, Any]:
    """singleton_key given to the decorator as a lambda."""
    return _keyed_run(self, account, seconds, note)


@app.task(bind=True, base=AccountKeyed, name="t.key_attribute")
def key_attribute(self: Any, account: int, seconds: float = 0.0, note: str = "") -> dict[str, Any]:
    """singleton_key from the base class, a plain function attribute."""
    return _keyed_run(self, account, seconds, note)


@app.task(bind=True, base=AccountKeyedStatic, name="t.key_static")
def key_static(self: Any, account: int, seconds: float = 0.0, note: str = "") -> dict[str, Any]:
    """singleton_key from the base class, a staticmethod."""
    return _keyed_run(self, account, seconds, note)


# SINGLETON_TEST_BAD_KEY_FN=1: a task whose singleton_key cannot take (args, kwargs): the worker
# must refuse to start.
if os.environ.get("SINGLETON_TEST_BAD_KEY_FN"):

    def _three_arguments(task: Any, args: Any, kwargs: Any) -> str:
        return "never"

    class _BadKeyed(SingletonTask):  # type: ignore[misc]
        singleton_key = staticmethod(_three_arguments)

    @app.task(bind=True, base=_BadKeyed, name="t.key_bad")
    def key_bad(self: Any) -> None:
        """Never runs: the worker does not start."""


# -- added for test_release_paths: a run that hands its lock over to a retry and then dies -----

import signal as _signal  # noqa: E402

from celery import signals as _celery_signals  # noqa: E402

#: Suffix of the queue ``t.retry_then_die`` sends its retry to (a second worker consumes it).
RETRIED_QUEUE_SUFFIX = "-retried"
RETRIED_QUEUE = app.conf.task_default_queue + RETRIED_QUEUE_SUFFIX


def go_key(prefix: str, task_id: str) -> str:
    """The key a test sets to let ``t.retry_then_die``'s first run ``task_id`` die."""
    return f"{prefix}go:{task_id}"


@app.task(bind=True, base=SingletonTask, name="t.retry_then_die", singleton_key_args=("key",))
def retry_then_die(  # noqa: PLR0917 - one task for every variant
    self: Any,
    key: str,
    seconds: float = 0.0,
    countdown: float = 0.0,
    wait_taken: bool = False,
    die: str = "kill",
) -> dict[str, Any]:
    """First run: retry (to RETRIED_QUEUE) and die before reporting back; later runs hold.

    The first run records its execution as ended at the hand-over (it does nothing guarded
    after it), calls ``self.retry(countdown=countdown, throw=False)``, waits until the retried
    run holds the lock if ``wait_taken``, and until the test set its ``go_key``, then dies:
    ``die="kill"`` SIGKILLs its own process,
    ``die="limit"`` sleeps into the hard time limit the message was sent with (the retry gets
    a long one). ``die=""`` (a duplicate) and the retried run hold the lock ``seconds``.
    """
    if self.request.retries or not die:
        return _run(self, key, seconds)
    client = _client(app.conf.singleton_test_redis_url)
    hkey = history_key(app.conf.singleton_test_prefix)
    token = self.singleton.fencing_token
    exec_id = record_start(client, hkey, key, token, str(self.request.hostname), os.getpid())
    record_end(client, hkey, exec_id)
    self.retry(
        countdown=countdown, queue=RETRIED_QUEUE, throw=False, time_limit=60, soft_time_limit=None
    )
    go = go_key(app.conf.singleton_test_prefix, self.request.id)
    deadline = time.monotonic() + 20
    while (wait_taken and client.hget(self.singleton.key, "gen") != b"1") or not client.exists(go):
        if time.monotonic() > deadline:
            raise RuntimeError("the retried run never took the lock, or no go")
        time.sleep(0.005)
    if die == "kill":
        os.kill(os.getpid(), _signal.SIGKILL)
    time.sleep(60)  # into the hard time limit
    return {}


@app.task(
    bind=True,
    base=SingletonTask,
    name="t.hold_own_request",
    singleton_key_args=("key",),
    Request="celery.worker.request:Request",
)
def hold_own_request(self: Any, key: str, seconds: float = 0.0) -> dict[str, Any]:
    """Like hold, with a Request class that is Celery's own, not the library's."""
    return _run(self, key, seconds)


def _log_task_failure(sender: Any = None, task_id: str | None = None, **_: Any) -> None:
    """Log ``task_failure <task id>``; connected after the library's handler, so it runs after."""
    client = _client(app.conf.singleton_test_redis_url)
    client.rpush(signals_key(app.conf.singleton_test_prefix), f"task_failure {task_id}")


if os.environ.get("SINGLETON_TEST_PREFIX"):
    _celery_signals.task_failure.connect(_log_task_failure, weak=False)


# -- added for test_release_paths: billiard's periodic pool maintenance out of the way --------

# SINGLETON_TEST_POOL_MAINTENANCE=<s>: the prefork pool's periodic maintenance (AsynPool.timers,
# every 5 s), which finds exited children its exit tracking missed, runs every <s> seconds, so
# a test sees whether something else notices a killed child (celery_singleton_lock.worker.reaper).
if os.environ.get("SINGLETON_TEST_POOL_MAINTENANCE"):
    from celery.concurrency import asynpool as _asynpool

    _MAINTENANCE_S = float(os.environ["SINGLETON_TEST_POOL_MAINTENANCE"])
    _asynpool.AsynPool.timers = property(lambda pool: {pool.maintain_pool: _MAINTENANCE_S})


# -- added for test_release_paths: retry(throw=False), the body going on after the hand-over ----


@app.task(bind=True, base=SingletonTask, name="t.retry_no_throw", singleton_key_args=("key",))
def retry_no_throw(self: Any, key: str, countdown: float = 2.0) -> dict[str, Any]:
    """First run: ``self.retry(countdown=..., throw=False)``, then return; the retried run holds.

    The first run records ``<key>:held=<self.singleton.held after the hand-over>``.
    """
    if self.request.retries:
        return {**_run(self, f"{key}:retried", 0.2), "retries": self.request.retries}
    client = _client(app.conf.singleton_test_redis_url)
    hkey = history_key(app.conf.singleton_test_prefix)
    self.retry(countdown=countdown, throw=False)
    held = self.singleton.held
    exec_id = record_start(
        client, hkey, f"{key}:held={held}", self.singleton.fencing_token, "", os.getpid()
    )
    record_end(client, hkey, exec_id)
    return {"retries": 0}


# -- added for test_skip_contract: what a skipped duplicate runs, and what it must not ------------


class _ContractTask(SingletonTask):  # type: ignore[misc]
    def on_success(self, retval: Any, task_id: str, args: Any, kwargs: Any) -> None:
        _log_event(f"on_success {task_id}")


@app.task(bind=True, base=_ContractTask, name="t.contract", singleton_key_args=("key",))
def contract(self: Any, key: str, seconds: float = 0.0) -> dict[str, Any]:
    """Like hold; its on_success and Celery's signals for it are logged to the signals list."""
    _log_event(f"body {self.request.id}")
    return _run(self, key, seconds)


def _log_event(event: str) -> None:
    client = _client(app.conf.singleton_test_redis_url)
    client.rpush(signals_key(app.conf.singleton_test_prefix), event)


def _celery_signal_logger(name: str) -> Any:
    def receiver(sender: Any = None, task_id: str | None = None, **kwargs: Any) -> None:
        task = sender if task_id is not None else kwargs.get("task", sender)
        if getattr(task, "name", None) not in ("t.contract", "t.hold_renewed"):
            return
        if task_id is None:  # task_success: the id is the request's
            task_id = task.request.id
        state = kwargs.get("state")
        _log_event(f"{name} {task_id}" + (f" {state}" if state else ""))

    return receiver


if os.environ.get("SINGLETON_TEST_PREFIX"):
    for _name in ("task_prerun", "task_postrun", "task_success"):
        getattr(_celery_signals, _name).connect(_celery_signal_logger(_name), weak=False)


# SINGLETON_TEST_METRICS_PORT=<port>: the library's Prometheus metrics, served by the worker's
# main process on 127.0.0.1:<port> as docs/operations.md shows for prefork (with
# PROMETHEUS_MULTIPROC_DIR set, every pool child's values added up).
if os.environ.get("SINGLETON_TEST_METRICS_PORT"):
    from celery_singleton_lock import metrics as _metrics

    _metrics.install()  # the children inherit the receivers when they fork

    @_celery_signals.worker_init.connect(weak=False)
    def _serve_metrics(**_: Any) -> None:
        _metrics.serve(int(os.environ["SINGLETON_TEST_METRICS_PORT"]), "127.0.0.1")


# -- added for test_canvas: chain steps, chord bodies and callbacks under each policy ----------


def _step(key: str, prev: Any) -> list[str]:
    """Log ``step <key>``; return the keys of the steps before (``prev``) and this one. A key
    starting with ``fail-`` raises ValueError after logging (a run that fails)."""
    _log_event(f"step {key}")
    if key.startswith("fail-"):
        raise ValueError(key)
    return [*(prev if isinstance(prev, list) else []), key]


@app.task(bind=True, base=SingletonTask, name="t.step", singleton_key_args=("key",))
def step(self: Any, prev: Any = None, key: str = "") -> list[str]:
    """A canvas step keyed on ``key`` (skip policy); ``prev`` is what the step before returned."""
    return _step(key, prev)


@app.task(
    bind=True,
    base=SingletonTask,
    name="t.step_retry",
    singleton_key_args=("key",),
    singleton_on_duplicate="retry",
    singleton_retry_countdown=0.2,
)
def step_retry(self: Any, prev: Any = None, key: str = "") -> list[str]:
    """Like t.step, under the retry policy."""
    return _step(key, prev)


@app.task(
    bind=True,
    base=SingletonTask,
    name="t.step_raise",
    singleton_key_args=("key",),
    singleton_on_duplicate="raise",
)
def step_raise(self: Any, prev: Any = None, key: str = "") -> list[str]:
    """Like t.step, under the raise policy."""
    return _step(key, prev)


@app.task(
    bind=True,
    base=SingletonTask,
    name="t.step_coalesce",
    singleton_key_args=("key",),
    singleton_on_duplicate="coalesce",
)
def step_coalesce(self: Any, prev: Any = None, key: str = "") -> list[str]:
    """Like t.step, under the coalesce policy."""
    return _step(key, prev)


@app.task(name="t.gather")
def gather(results: Any, label: str = "") -> Any:
    """A plain task (a chord body, a link callback): logs ``gather <label> <results as JSON>``."""
    import json

    _log_event(f"gather {label} {json.dumps(results, sort_keys=True)}")
    return results


@app.task(name="t.errback")
def errback(request: Any, exc: BaseException, traceback: Any, label: str = "") -> None:
    """A link_error callback: logs ``errback <label> <exception type> <task id>``."""
    _log_event(f"errback {label} {type(exc).__name__} {getattr(request, 'id', request)}")


# -- added for test_scope: two tasks sharing one lock per tenant (singleton_scope) --------------


@app.task(
    bind=True,
    base=SingletonTask,
    name="t.tenant_import",
    singleton_scope="tenant-sync",
    singleton_key_args=("tenant",),
)
def tenant_import(self: Any, tenant: str, seconds: float = 0.0) -> dict[str, Any]:
    """Imports a tenant; excludes t.tenant_export of the same tenant."""
    return _run(self, f"tenant-{tenant}", seconds)


@app.task(
    bind=True,
    base=SingletonTask,
    name="t.tenant_export",
    singleton_scope="tenant-sync",
    singleton_key_args=("tenant",),
)
def tenant_export(self: Any, fmt: str, tenant: str, seconds: float = 0.0) -> dict[str, Any]:
    """Exports a tenant (other parameters, another order); same scope as t.tenant_import."""
    return _run(self, f"tenant-{tenant}", seconds)


# SINGLETON_TEST_BAD_SCOPE=1: a third task of the scope keyed on other arguments: the worker
# must refuse to start.
if os.environ.get("SINGLETON_TEST_BAD_SCOPE"):

    @app.task(bind=True, base=SingletonTask, name="t.tenant_bad", singleton_scope="tenant-sync")
    def tenant_bad(self: Any, tenant: str, region: str) -> None:
        """Never runs: keys on (region, tenant), not (tenant,)."""


# -- added for test_completion: a finished message is not run again; at-least windows -----------


@app.task(
    bind=True,
    base=SingletonTask,
    name="t.once_late",
    singleton_key_args=("key",),
    acks_late=True,
    reject_on_worker_lost=True,
)
def once_late(self: Any, key: str, seconds: float = 0.0) -> dict[str, Any]:
    """Acked late; counts the runs of its task id (``deliveries_key``) and records each."""
    client = _client(app.conf.singleton_test_redis_url)
    run = int(client.incr(deliveries_key(app.conf.singleton_test_prefix, self.request.id)))
    return {**_run(self, key, seconds), "run": run}


def _kill_after_body(sender: Any = None, task_id: str | None = None, **kwargs: Any) -> None:
    """SIGKILL the whole worker right after ``t.once_late``'s first run ended: after the
    library's task_postrun (connected before this one) released the lock and recorded the
    completion, before the worker acknowledged the message."""
    retval = kwargs.get("retval")
    if getattr(sender, "name", None) != "t.once_late" or not isinstance(retval, dict):
        return
    if retval.get("run") != 1:
        return
    client = _client(app.conf.singleton_test_redis_url)
    client.rpush(signals_key(app.conf.singleton_test_prefix), f"killed_after_body {task_id}")
    os.killpg(os.getpgid(0), _signal.SIGKILL)  # the worker runs in its own process group


# SINGLETON_TEST_KILL_AFTER_BODY=1: the worker dies as a whole right after t.once_late's body.
if os.environ.get("SINGLETON_TEST_KILL_AFTER_BODY"):
    _celery_signals.task_postrun.connect(_kill_after_body, weak=False)

#: at-least window of the t.window_* tasks, seconds (SINGLETON_TEST_AT_LEAST)
AT_LEAST = float(os.environ.get("SINGLETON_TEST_AT_LEAST", "3"))


def _window_task(name: str, **options: Any) -> Any:
    @app.task(
        bind=True,
        base=SingletonTask,
        name=name,
        singleton_key_args=("key",),
        singleton_lock_at_least=AT_LEAST,
        **options,
    )
    def window_task(self: Any, key: str, seconds: float = 0.0) -> dict[str, Any]:
        """Holds ``key`` for at least AT_LEAST seconds after it started."""
        return _run(self, key, seconds)

    return window_task


window_skip = _window_task("t.window_skip")
window_retry = _window_task(
    "t.window_retry", singleton_on_duplicate="retry", singleton_retry_countdown=0.2
)
window_raise = _window_task("t.window_raise", singleton_on_duplicate="raise")
window_publish = _window_task("t.window_publish", singleton_lock_on="publish")


# -- added for test_completion: which failures are final (recorded), and which run again ---------


def _count_run(task: Any, key: str) -> int:
    """Record this execution; the how-manyth run of its task id it is (``deliveries_key``)."""
    client = _client(app.conf.singleton_test_redis_url)
    run = int(client.incr(deliveries_key(app.conf.singleton_test_prefix, task.request.id)))
    _run(task, key, 0.1)
    return run


@app.task(
    bind=True,
    base=SingletonTask,
    name="t.fail_late",
    singleton_key_args=("key",),
    acks_late=True,
    track_started=True,
)
def fail_late(self: Any, key: str) -> None:
    """Acked late, reports STARTED, always fails: a final failure (Celery acks it)."""
    run = _count_run(self, key)
    raise ValueError(f"failed on purpose, run {run}")


@app.task(
    bind=True,
    base=SingletonTask,
    name="t.fail_unacked",
    singleton_key_args=("key",),
    acks_late=True,
    acks_on_failure_or_timeout=False,
)
def fail_unacked(self: Any, key: str) -> int:
    """Acked late, a failure left unacknowledged (rejected: SQS delivers it again after its
    visibility timeout, RabbitMQ may dead-letter it back): the first run fails, a later
    delivery of the message succeeds."""
    run = _count_run(self, key)
    if run == 1:
        raise ValueError("failed on purpose, left to the broker")
    return run


@app.task(
    bind=True,
    base=SingletonTask,
    name="t.autoretry_late",
    singleton_key_args=("key",),
    acks_late=True,
    autoretry_for=(ValueError,),
    max_retries=3,
    default_retry_delay=0.2,
)
def autoretry_late(self: Any, key: str, failures: int) -> int:
    """Acked late, retried by Celery (autoretry_for) ``failures`` times, then succeeds."""
    run = _count_run(self, key)
    if self.request.retries < failures:
        raise ValueError(f"failed on purpose, run {run}")
    return run


# -- added for test_permits: up to N runs of one key at once (singleton_permits) ----------------

#: the options every task keyed on ``tenant`` shares
PER_TENANT: dict[str, Any] = {
    "bind": True,
    "base": SingletonTask,
    "singleton_key_args": ("tenant",),
}
# Refused over Redlock (a worker of this app on a redlock:// lock URL would not start): left
# out there, unless SINGLETON_TEST_PERMITS=1 asks for the refusal (test_bad_settings).
_REDLOCK = "redlock" in str(app.conf.singleton_redis_url).split("://", 1)[0]
if not _REDLOCK or os.environ.get("SINGLETON_TEST_PERMITS"):

    @app.task(name="t.export_permits", singleton_permits=3, **PER_TENANT)
    def export_permits(self: Any, tenant: str, seconds: float = 0.0) -> dict[str, Any]:
        """At most 3 exports of a tenant at once (skip); records the permit slot it holds."""
        return {**_run(self, self.singleton.key, seconds), "key": self.singleton.key}

    @app.task(
        name="t.export_permits_retry",
        singleton_permits=2,
        singleton_on_duplicate="retry",
        singleton_retry_countdown=0.2,
        **PER_TENANT,
    )
    def export_permits_retry(self: Any, tenant: str, seconds: float = 0.0) -> dict[str, Any]:
        """At most 2 at once; the others are requeued until a slot is free."""
        return {**_run(self, self.singleton.key, seconds), "key": self.singleton.key}

    @app.task(name="t.export_permits_self_retry", singleton_permits=2, max_retries=3, **PER_TENANT)
    def export_permits_self_retry(self: Any, tenant: str, times: int) -> dict[str, Any]:
        """Retries itself ``times`` times; each run records the slot it holds, re-entered or not."""
        client = _client(app.conf.singleton_test_redis_url)
        client.rpush(
            history_key(app.conf.singleton_test_prefix) + ":slots",
            f"{self.request.id} {self.request.retries} {self.singleton.key} "
            f"{int(self.singleton.reentered)}",
        )
        result = _run(self, self.singleton.key, 0.2)
        if self.request.retries < times:
            raise self.retry(countdown=0.3)
        return result

    @app.task(
        name="t.export_permits_coalesce",
        singleton_permits=2,
        singleton_on_duplicate="coalesce",
        **PER_TENANT,
    )
    def export_permits_coalesce(
        self: Any, tenant: str, payload: Any = None, until: str | None = None
    ) -> dict[str, Any]:
        """At most 2 at once; the duplicates of a full set coalesce into one follow-up. With
        ``until``, it holds its slot until the test pushes to that list (``_run``)."""
        key = self.singleton.key
        return {**_run(self, key, 0.0, until), "key": key, "payload": payload}

    @app.task(name="t.permits_outcome", singleton_permits=2, **PER_TENANT)
    def permits_outcome(self: Any, tenant: str, kind: str, seconds: float = 0.0) -> dict[str, Any]:
        """Two at once; ends with ``kind`` after ``seconds``: "ok", "fail" (ValueError) or
        "limit" (sent with time limits: the soft one is swallowed, the hard one ends it)."""
        from celery.exceptions import SoftTimeLimitExceeded

        try:
            result = _run(self, self.singleton.key, seconds)
        except SoftTimeLimitExceeded:
            if kind == "limit":
                time.sleep(seconds)
            raise
        if kind == "fail":
            raise ValueError("failed on purpose")
        return {**result, "key": self.singleton.key}


# -- added for the seams where two features meet (test_coalesce, test_permits, test_scope) -------

# SINGLETON_TEST_WINDOW_COALESCE=1: a coalescing task with an at-least window: refused.
if os.environ.get("SINGLETON_TEST_WINDOW_COALESCE"):
    _window_task("t.window_coalesce", singleton_on_duplicate="coalesce")

# SINGLETON_TEST_BAD_SCOPE_PERMITS=1: a task of scope tenant-sync with 2 permits where the
# others take 1 (they would lock the key's slots, the others the key itself): refused.
if os.environ.get("SINGLETON_TEST_BAD_SCOPE_PERMITS"):

    @app.task(
        bind=True,
        base=SingletonTask,
        name="t.tenant_permits",
        singleton_scope="tenant-sync",
        singleton_key_args=("tenant",),
        singleton_permits=2,
    )
    def tenant_permits(self: Any, tenant: str) -> None:
        """Never runs: its worker does not start."""


def _merge_task(name: str) -> Any:
    @app.task(
        bind=True,
        base=SingletonTask,
        name=name,
        singleton_scope="tenant-merge",
        singleton_key_args=("tenant",),
        singleton_on_duplicate="coalesce",
    )
    def merge_task(self: Any, tenant: str, seconds: float = 0.0, payload: Any = None) -> Any:
        """Two tasks of scope tenant-merge that both coalesce: a duplicate of either, met while
        the other runs, becomes the follow-up."""
        return {**_run(self, f"merge-{tenant}", seconds), "payload": payload, "task": self.name}

    return merge_task


merge_pull = _merge_task("t.merge_pull")
merge_push = _merge_task("t.merge_push")


@app.task(name="t.coalesce_retrying", max_retries=5, **COALESCING)
def coalesce_retrying(self: Any, key: str, times: int = 0, payload: Any = None) -> dict[str, Any]:
    """Coalesces; retries itself ``times`` times (0.5 s countdown), each run 0.5 s long."""
    result = _run(self, key, 0.5)
    if self.request.retries < times:
        raise self.retry(countdown=0.5)
    return {**result, "payload": payload, "retries": self.request.retries}


@app.task(name="t.coalesce_late", acks_late=True, **COALESCING)
def coalesce_late(self: Any, key: str, seconds: float = 0.0, payload: Any = None) -> dict[str, Any]:
    """Coalesces, acked late (completion records on); counts the runs of its task id."""
    client = _client(app.conf.singleton_test_redis_url)
    run = int(client.incr(deliveries_key(app.conf.singleton_test_prefix, self.request.id)))
    return {**_run(self, key, seconds), "payload": payload, "run": run}


# SINGLETON_TEST_ACCEPT=json,pickle: the worker also accepts pickled messages (test_coalesce: a
# duplicate sent in pickle to a json task, carrying what json cannot write)
if os.environ.get("SINGLETON_TEST_ACCEPT"):
    app.conf.accept_content = os.environ["SINGLETON_TEST_ACCEPT"].split(",")


@app.task(name="t.coalesce_repr", **COALESCING)
def coalesce_repr(self: Any, key: str, seconds: float = 0.0, payload: Any = None) -> dict[str, Any]:
    """Like hold_coalesce, but returns the ``repr`` of its payload (any type, a json result)."""
    return {**_run(self, key, seconds), "payload": repr(payload)}


if not _REDLOCK:

    @app.task(
        name="t.export_permits_window",
        singleton_permits=2,
        singleton_lock_at_least=AT_LEAST,
        **PER_TENANT,
    )
    def export_permits_window(self: Any, tenant: str, seconds: float = 0.0) -> dict[str, Any]:
        """At most 2 exports of a tenant per AT_LEAST seconds: each run's slot is held for a
        window after it started."""
        return {**_run(self, self.singleton.key, seconds), "key": self.singleton.key}


# -- added for test_argsrepr: a secret argument the caller masks with argsrepr/kwargsrepr -----


def _charge_task(name: str, **options: Any) -> Any:
    """A task keyed on a card number that holds its lock until the test pushes to ``until``;
    it returns nothing of the card (its result is not what the masking is about)."""

    @app.task(bind=True, base=SingletonTask, name=name, singleton_key_args=("card",), **options)
    def charge(self: Any, card: str, until: str | None = None) -> dict[str, Any]:
        return _run(self, "charge", 0.0, until)

    return charge


charge = _charge_task("t.charge")
charge_coalesce = _charge_task("t.charge_coalesce", singleton_on_duplicate="coalesce")
charge_retry = _charge_task(
    "t.charge_retry", singleton_on_duplicate="retry", singleton_retry_countdown=0.2
)


@app.task(bind=True, base=SingletonTask, name="t.charge_self_retry", singleton_key_args=("card",))
def charge_self_retry(self: Any, card: str, until: str | None = None) -> dict[str, Any]:
    """Retries itself once (the same call), then holds its lock like t.charge."""
    if not self.request.retries:
        raise self.retry(countdown=0.1)
    return _run(self, "charge", 0.0, until)


SIGNAL_PAYLOADS_SUFFIX = "signal-payloads"


def signal_payloads_key(prefix: str) -> str:
    """The list every library signal's full payload is logged to, with
    ``SINGLETON_TEST_SIGNAL_PAYLOADS`` set (``"<signal name> <repr of its arguments>"``)."""
    return f"{prefix}{SIGNAL_PAYLOADS_SUFFIX}"


def _payload_logger(signal_name: str) -> Any:
    def receiver(sender: Any = None, **kwargs: Any) -> None:
        kwargs.pop("signal", None)
        client = _client(app.conf.singleton_test_redis_url)
        shown = f"{signal_name} {sender!r} {sorted(kwargs.items())!r}"
        client.rpush(signal_payloads_key(app.conf.singleton_test_prefix), shown)

    return receiver


if os.environ.get("SINGLETON_TEST_PREFIX") and os.environ.get("SINGLETON_TEST_SIGNAL_PAYLOADS"):
    for _signal_name in _singleton_signals.__all__:
        getattr(_singleton_signals, _signal_name).connect(_payload_logger(_signal_name), weak=False)


# -- added for test_pools: prefork's start method, and what a run saw of its renewals ----------

# SINGLETON_TEST_START_METHOD=spawn: prefork children are fresh interpreters (Celery 5.7's
# worker_pool_start_method), which inherit nothing from the worker's main process
if os.environ.get("SINGLETON_TEST_START_METHOD"):
    app.conf.worker_pool_start_method = os.environ["SINGLETON_TEST_START_METHOD"]
# SINGLETON_TEST_WORKER_POOL=gevent: the pool named by the worker_pool setting only (Celery then
# monkey-patches nothing: it reads -P from the command line)
if os.environ.get("SINGLETON_TEST_WORKER_POOL"):
    app.conf.worker_pool = os.environ["SINGLETON_TEST_WORKER_POOL"]


def _renewed_task(name: str, **options: Any) -> Any:
    @app.task(bind=True, base=SingletonTask, name=name, singleton_key_args=("key",), **options)
    def hold_renewed(
        self: Any, key: str, seconds: float = 0.0, fail: bool = False, until: str | None = None
    ) -> dict[str, Any]:
        """Like hold (``until``: as hold_coalesce), and how often this process renewed the
        lock; with ``fail``, it then raises."""
        result = {**_run(self, key, seconds, until), "renewals": self.singleton.renewals}
        if fail:
            raise ValueError(f"failed on purpose after {result}")
        return result

    return hold_renewed


#: Celery's signals for it are logged as t.contract's
hold_renewed = _renewed_task("t.hold_renewed")
#: with a 30 s ttl whatever SINGLETON_TEST_TTL says: a lock of it that is gone within seconds
#: was released, not expired
hold_long_ttl = _renewed_task("t.hold_long_ttl", singleton_ttl=30)


# -- the join policy (test_join.py) ------------------------------------------------------------


@app.task(
    bind=True,
    base=SingletonTask,
    name="t.join",
    singleton_key_args=("key",),
    singleton_on_duplicate="join",
)
def join_hold(
    self: Any, key: str, seconds: float = 0.0, value: Any = None, fail: bool = False
) -> Any:
    """Hold ``key`` for ``seconds`` (until a push to ``key``'s release list: ``seconds`` < 0),
    then return ``value`` (or fail with ValueError(value)); a duplicate joins the run it
    meets."""
    _run(self, key, max(seconds, 0.0), until=f"{key}:go" if seconds < 0 else None)
    if fail:
        raise ValueError(value)
    return value


@app.task(
    bind=True,
    base=SingletonTask,
    name="t.join_both",
    singleton_key_args=("key",),
    singleton_on_duplicate="join",
    singleton_lock_on="publish",
)
def join_both(self: Any, key: str, seconds: float = 0.0, value: Any = None) -> Any:
    """t.join, deduplicated at publish too."""
    _run(self, key, max(seconds, 0.0), until=f"{key}:go" if seconds < 0 else None)
    return value


@app.task(bind=True, name="t.join_next")
def join_next(self: Any, value: Any, tag: str = "") -> list[Any]:
    """A chain step or link after a joined call: what it was given, and its tag."""
    client = _client(app.conf.singleton_test_redis_url)
    client.rpush(app.conf.singleton_test_prefix + "join:next", f"{tag}:{value!r}")
    return [value, tag]


@app.task(name="t.join_errback")
def join_errback(request: Any, exc: Any, traceback: Any) -> None:
    """An error link of a joined call: records the failed task's id and error."""
    client = _client(app.conf.singleton_test_redis_url)
    client.rpush(app.conf.singleton_test_prefix + "join:errors", f"{request.id}:{exc!r}")


@app.task(name="t.join_gather")
def join_gather(values: list[Any]) -> list[Any]:
    """A chord's body: the header members' values."""
    return values


@app.task(
    bind=True,
    base=SingletonTask,
    name="t.join_retry",
    singleton_key_args=("key",),
    singleton_on_duplicate="join",
)
def join_retry(self: Any, key: str, value: Any = None) -> Any:
    """Wait for a push to ``key``'s release list, retry once, then return ``value``."""
    _run(self, key, 0.0, until=f"{key}:go")
    if not self.request.retries:
        raise self.retry(countdown=0.2)
    return value


@app.task(
    bind=True,
    base=SingletonTask,
    name="t.join_autoretry",
    singleton_key_args=("key",),
    singleton_on_duplicate="join",
    autoretry_for=(KeyError,),
    max_retries=1,
    default_retry_delay=0.2,
)
def join_autoretry(self: Any, key: str, value: Any = None) -> Any:
    """Wait for a push to ``key``'s release list, then raise KeyError(value): Celery's
    ``autoretry_for`` retries once, and its ``max_retries`` refuses the second retry (the run
    fails with the KeyError)."""
    _run(self, key, 0.0, until=f"{key}:go")
    raise KeyError(value)


# -- added for test_join_seams: join beside a long ttl, and beside debounce ----------------------


def _join_task(name: str, **options: Any) -> Any:
    @app.task(
        name=name,
        singleton_key_args=("key",),
        **{"bind": True, "base": SingletonTask, "singleton_on_duplicate": "join", **options},
    )
    def join_task(self: Any, key: str, seconds: float = 0.0, value: Any = None) -> Any:
        """t.join with other options: holds ``key`` for ``seconds`` (until a push to ``key``'s
        release list: ``seconds`` < 0), then returns ``value``."""
        _run(self, key, max(seconds, 0.0), until=f"{key}:go" if seconds < 0 else None)
        return value

    return join_task


#: a joiner's watch copy is due 30 s after it joined: a holder's end comes first
join_long_ttl = _join_task("t.join_long_ttl", singleton_ttl=30)
#: a burst of calls runs once, 1 s after its last call; a call that meets a run joins it
join_debounce = _join_task("t.join_debounce", singleton_debounce=1.0)


# -- added for test_rate: a cluster-wide rate limit per key (singleton_rate_limit) -------------
#
# Refused over Redlock (a worker of this app on a redlock:// lock URL would not start): left out
# there, unless SINGLETON_TEST_RATE=1 asks for the refusal. SINGLETON_TEST_BAD_RATE: a task with
# that malformed rate, refused at worker start.


def _rate_task(name: str, **options: Any) -> Any:
    @app.task(
        name=name,
        singleton_key_args=("tenant",),
        **{"bind": True, "base": SingletonTask, **options},
    )
    def rate_task(
        self: Any, tenant: str, seconds: float = 0.0, until: str | None = None
    ) -> dict[str, Any]:
        """Records its start (key ``rate:<task>:<tenant>``) and sleeps ``seconds`` (with
        ``until``: waits for the test to push to that list)."""
        key = f"rate:{self.name}:{tenant}"
        return {**_run(self, key, seconds, until), "host": self.request.hostname}

    return rate_task


if not _REDLOCK or os.environ.get("SINGLETON_TEST_RATE"):
    # a rate alone (no limit on runs at once): a flood meets the rate, not a held lock
    rate_skip = _rate_task("t.rate_skip", singleton_rate_limit="4/s", singleton_permits="unlimited")
    rate_retry = _rate_task(
        "t.rate_retry",
        singleton_rate_limit="4/s",
        singleton_on_duplicate="retry",
        singleton_permits="unlimited",
    )
    rate_alone = _rate_task(
        "t.rate_alone", singleton_rate_limit="3/m", singleton_permits="unlimited"
    )
    rate_raise = _rate_task(
        "t.rate_raise", singleton_rate_limit="2/m", singleton_on_duplicate="raise"
    )
    rate_coalesce = _rate_task(
        "t.rate_coalesce",
        singleton_rate_limit="2/s",
        singleton_on_duplicate="coalesce",
        singleton_permits="unlimited",
    )
    rate_minute = _rate_task("t.rate_minute", singleton_rate_limit="1/m")
    rate_join = _rate_task("t.rate_join", singleton_rate_limit="1/s", singleton_on_duplicate="join")

    @app.task(
        name="t.rate_autoretry",
        singleton_rate_limit="2/s",
        singleton_permits="unlimited",
        autoretry_for=(ValueError,),
        max_retries=1,
        default_retry_delay=0.01,
        **PER_TENANT,
    )
    def rate_autoretry(self: Any, tenant: str) -> dict[str, Any]:
        """Records each start; fails its first try (autoretry_for retries it at once), once the
        tenant's two first tries have started (a retry that started before the other first try
        would fill the rate, and that call, not a retry, is then over it)."""
        key = f"rate:{self.name}:{tenant}"
        result = _run(self, key, 0.0)
        if not self.request.retries:
            client = _client(app.conf.singleton_test_redis_url)
            hkey = history_key(app.conf.singleton_test_prefix)
            both = lambda: sum(e.key == key for e in load_history(client, hkey)) >= 2  # noqa: E731
            wait_for(both, 10, "both first tries", fail=False)
            raise ValueError("the first try fails")
        return result


if os.environ.get("SINGLETON_TEST_BAD_RATE"):
    _rate_task("t.rate_bad", singleton_rate_limit=os.environ["SINGLETON_TEST_BAD_RATE"])


# -- OpenTelemetry (test_otel.py) -----------------------------------------------------------------

if os.environ.get("SINGLETON_TEST_OTEL"):  # the real instrumentation; spans copied to Redis
    from tests.support.otel_spans import start as _start_tracing

    _start_tracing(app.conf.singleton_test_redis_url, app.conf.singleton_test_prefix)


# -- debounce (test_debounce.py) ------------------------------------------------------------------

#: the debounce window of the debounced tasks, and the cap of ``t.debounce_cap``
DEBOUNCE_S = 0.8
DEBOUNCE_MAX_S = 2.0


def _debounce_task(name: str, *, retry_first: bool = False, **options: Any) -> Any:
    @app.task(
        bind=True,
        base=SingletonTask,
        name=name,
        singleton_key_args=("key",),
        **{"singleton_debounce": DEBOUNCE_S, **options},
    )
    def debounced(self: Any, key: str, value: Any = None, seconds: float = 0.0) -> Any:
        """A burst of calls of ``key`` runs once, with the latest ``value``: the run is
        recorded (history) with that value and when it started (``<prefix>debounce:<key>``),
        and holds the lock ``seconds``. With ``retry_first``, it calls self.retry() once
        first."""
        if retry_first and not self.request.retries:
            raise self.retry(countdown=0.1)
        client = _client(app.conf.singleton_test_redis_url)
        client.rpush(f"{app.conf.singleton_test_prefix}debounce:{key}", f"{value}|{time.time()}")
        _run(self, key, seconds)
        return value

    return debounced


debounce_run = _debounce_task("t.debounce")
debounce_cap = _debounce_task("t.debounce_cap", singleton_debounce_max=DEBOUNCE_MAX_S)
debounce_retry = _debounce_task("t.debounce_retry", retry_first=True)
debounce_long = _debounce_task("t.debounce_long", singleton_debounce=3.0)
debounce_wait = _debounce_task(
    "t.debounce_wait", singleton_on_duplicate="retry", singleton_retry_countdown=0.2
)
