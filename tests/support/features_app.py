"""The singleton test app with tasks that switch on Celery's own features: retries that Celery
refuses (``max_retries``, ``autoretry_for``), ``retry_on_worker_lost``, a ``before_start``
override without ``super()``, eta messages acked early (tests/integration/test_celery_features.py).

Run a worker with ``celery -A tests.support.features_app worker``; configured from the
environment like :mod:`tests.support.singleton_app`, whose tasks, signal log and history it
shares.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from celery.exceptions import Ignore, Reject

from celery_singleton_lock import SingletonTask
from tests.support.basic_app import _client, history_key
from tests.support.chaos import deliveries_key
from tests.support.history import record_end, record_start
from tests.support.singleton_app import _run, app, go_key

__test__ = False

__all__ = ["app", "go_key"]

#: lock ttl (s) of the tasks that must not lose their lock to expiry while a test watches it
LONG_TTL = 60.0


def _wait_for_go(task: Any) -> None:
    """Block until the test pushes to this run's go key (at most 60 s)."""
    client = _client(app.conf.singleton_test_redis_url)
    for _ in range(60):  # short blocking reads: redis-py gives up on one blocked past 5 s
        if client.blpop([go_key(app.conf.singleton_test_prefix, task.request.id)], timeout=1):
            return


@app.task(
    bind=True,
    base=SingletonTask,
    name="x.give_up",
    singleton_key_args=("key",),
    singleton_ttl=LONG_TTL,
    max_retries=0,
)
def give_up(self: Any, key: str, countdown: float = 60.0) -> None:
    """Ask for a retry that ``max_retries=0`` refuses: the run ends in FAILURE."""
    _run(self, key, 0.0)
    raise self.retry(countdown=countdown)


@app.task(
    bind=True,
    base=SingletonTask,
    name="x.autoretry",
    singleton_key_args=("key",),
    singleton_ttl=LONG_TTL,
    autoretry_for=(ValueError,),
    max_retries=1,
    retry_backoff=0.2,
    retry_jitter=True,
)
def autoretry(self: Any, key: str) -> None:
    """Fail with ValueError every time: retried once (backoff, jitter), then FAILURE."""
    _run(self, key, 0.0)
    raise ValueError(f"attempt {self.request.retries}")


@app.task(
    bind=True,
    base=SingletonTask,
    name="x.autoretry_default_delay",
    singleton_key_args=("key",),
    singleton_ttl=LONG_TTL,
    autoretry_for=(ValueError,),
    max_retries=0,
)
def autoretry_default_delay(self: Any, key: str) -> None:
    """autoretry_for with Celery's default_retry_delay (180 s) and no retry left."""
    _run(self, key, 0.0)
    raise ValueError("no retry left")


@app.task(
    bind=True,
    base=SingletonTask,
    name="x.coalesce_give_up",
    singleton_key_args=("key",),
    singleton_ttl=LONG_TTL,
    singleton_on_duplicate="coalesce",
    max_retries=0,
)
def coalesce_give_up(self: Any, key: str, payload: str = "") -> str:
    """The holder (payload "holder") waits for its go, then asks for a refused retry; any
    other call (the coalesced follow-up) returns its payload."""
    _run(self, key, 0.0)
    if payload == "holder":
        _wait_for_go(self)
        raise self.retry(countdown=60)
    return payload


@app.task(
    bind=True,
    base=SingletonTask,
    name="x.lost_then_retried",
    singleton_key_args=("key",),
    singleton_ttl=LONG_TTL,
    retry_on_worker_lost=True,
    max_retries=3,
    default_retry_delay=LONG_TTL / 2,
)
def lost_then_retried(self: Any, key: str) -> dict[str, Any]:
    """The first run SIGKILLs its own pool child while it holds the lock, once the test lets it
    go (Celery 5.7 retries it: ``retry_on_worker_lost``); the retried run returns."""
    if not self.request.retries:
        _wait_for_go(self)
        client = _client(app.conf.singleton_test_redis_url)
        client.rpush(go_key(app.conf.singleton_test_prefix, "killed"), self.request.id)
        os.kill(os.getpid(), signal.SIGKILL)
    return _run(self, key, 0.0)


class NoSuperTask(SingletonTask):
    """A base class whose ``before_start`` does not call ``super()`` (Celery documents it as an
    empty hook to override)."""

    def before_start(self, task_id: str, args: Any, kwargs: Any) -> None:
        client = _client(app.conf.singleton_test_redis_url)
        client.rpush(go_key(app.conf.singleton_test_prefix, "before_start"), task_id)


@app.task(bind=True, base=NoSuperTask, name="x.no_super", singleton_key_args=("key",))
def no_super(self: Any, key: str, seconds: float = 0.0) -> dict[str, Any]:
    """Hold ``key`` for ``seconds`` (the app's ttl is 1 s: it needs renewing)."""
    return {**_run(self, key, seconds), "renewals": self.singleton.renewals}


@app.task(bind=True, base=SingletonTask, name="x.eta_once", singleton_key_args=("key",))
def eta_once(self: Any, key: str) -> dict[str, Any]:
    """Acked early; counts its deliveries per task id (sent with a countdown)."""
    client = _client(app.conf.singleton_test_redis_url)
    run = int(client.incr(deliveries_key(app.conf.singleton_test_prefix, self.request.id)))
    return {**_run(self, key, 0.0), "run": run}


@app.task(
    bind=True,
    base=SingletonTask,
    name="x.ignored",
    singleton_key_args=("key",),
    ignore_result=True,
)
def ignored(self: Any, key: str, hold: bool = False) -> dict[str, Any]:
    """``ignore_result=True`` on the task; with ``hold``, waits for its go."""
    if hold:
        _wait_for_go(self)
    return _run(self, key, 0.0)


@app.task(bind=True, base=SingletonTask, name="x.replaced", singleton_key_args=("key",))
def replaced(self: Any, key: str, done: bool = False) -> Any:
    """Replace itself (``Task.replace``: the same task id, the same key) once, then return."""
    if not done:
        _run(self, key, 0.0)
        raise self.replace(self.s(key, done=True))
    return {**_run(self, key, 0.0), "replaced": True}


# -- the matrix: each way a run can end, under each duplicate policy -----------------------------

#: how a holder of the matrix ends, once the test lets it go (``x.end_<policy>``'s ``ending``)
ENDINGS = (
    "return",
    "raise",
    "retry_refused",
    "retry_refused_exc",
    "reject",
    "ignore",
    "soft_limit",
)


def _end(task: Any, key: str, ending: str) -> str:
    """Record the run; a holder (any ``ending`` but "now") waits for its go first, then ends
    as ``ending`` says. The end is recorded however the run ends."""
    client = _client(app.conf.singleton_test_redis_url)
    hkey = history_key(app.conf.singleton_test_prefix)
    token = task.singleton.fencing_token
    exec_id = record_start(client, hkey, key, token, str(task.request.hostname), os.getpid())
    try:
        if ending != "now":
            _wait_for_go(task)
        if ending == "raise":
            raise ValueError("the body failed")
        if ending == "retry_refused":
            raise task.retry(countdown=60)
        if ending == "retry_refused_exc":
            raise task.retry(exc=ValueError("no retry left"), countdown=60)
        if ending == "reject":
            raise Reject("rejected", requeue=False)
        if ending == "ignore":
            raise Ignore()
        if ending == "soft_limit":
            time.sleep(30)  # the message's soft_time_limit raises SoftTimeLimitExceeded here
        return ending
    finally:
        record_end(client, hkey, exec_id)


def _policy_task(policy: str) -> Any:
    @app.task(
        bind=True,
        base=SingletonTask,
        name=f"x.end_{policy}",
        singleton_key_args=("key",),
        singleton_ttl=LONG_TTL,
        singleton_on_duplicate=policy,
        singleton_retry_countdown=0.2,
        max_retries=0,
    )
    def end(self: Any, key: str, ending: str = "now") -> str:
        return _end(self, key, ending)

    return end


POLICY_TASKS = {policy: _policy_task(policy) for policy in ("skip", "retry", "raise", "coalesce")}


@app.task(
    bind=True,
    base=SingletonTask,
    name="x.reject_in_window",
    singleton_key_args=("key",),
    singleton_lock_at_least=2.0,
    singleton_retry_countdown=0.2,
    acks_late=True,
)
def reject_in_window(self: Any, key: str) -> dict[str, Any]:
    """Acked late, the first delivery asks the broker to requeue it (``Reject(requeue=True)``)
    inside its own at-least window; the next one runs."""
    client = _client(app.conf.singleton_test_redis_url)
    run = int(client.incr(deliveries_key(app.conf.singleton_test_prefix, self.request.id)))
    if run == 1:
        raise Reject("again, please", requeue=True)
    return {**_run(self, key, 0.0), "run": run}


@app.task(
    bind=True,
    base=SingletonTask,
    name="x.coalesce_lost_late",
    singleton_key_args=("key",),
    singleton_on_duplicate="coalesce",
    singleton_ttl=2.0,
    acks_late=True,
    reject_on_worker_lost=True,
)
def coalesce_lost_late(self: Any, key: str, payload: str = "") -> str:
    """Coalescing, acked late, requeued if its child dies: the first delivery of payload "die"
    waits for its go and SIGKILLs its own pool child; every other run records itself."""
    client = _client(app.conf.singleton_test_redis_url)
    run = int(client.incr(deliveries_key(app.conf.singleton_test_prefix, self.request.id)))
    if payload == "die" and run == 1:
        _wait_for_go(self)
        os.kill(os.getpid(), signal.SIGKILL)
    _run(self, f"{key}:{payload}", 0.0)
    return payload


@app.task(
    bind=True,
    base=SingletonTask,
    name="x.headers",
    singleton_key_args=("key",),
    singleton_on_duplicate="retry",
    singleton_retry_countdown=0.2,
)
def headers(self: Any, key: str, hold: bool = False) -> Any:
    """Under "retry": returns its message's custom ``tenant`` header, its priority and the
    queue it came from; with ``hold``, waits for its go first."""
    if hold:
        _wait_for_go(self)
    _run(self, key, 0.0)
    delivery = self.request.delivery_info or {}
    return {
        "tenant": self.request.get("tenant"),
        "priority": delivery.get("priority"),
        "queue": delivery.get("routing_key"),
    }


# SINGLETON_TEST_RESULTS: how the worker keeps results ("ignore": task_ignore_result; "extended":
# result_extended; "none": no result backend at all)
_RESULTS = os.environ.get("SINGLETON_TEST_RESULTS")
if _RESULTS == "ignore":
    app.conf.task_ignore_result = True
elif _RESULTS == "extended":
    app.conf.result_extended = True
elif _RESULTS == "none":
    app.conf.result_backend = None
