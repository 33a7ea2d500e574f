"""``singleton_key``: a ``callable(args, kwargs) -> str``, given to ``@app.task(...)`` as a plain
function or a lambda, or on a base class as a plain attribute or a staticmethod. Celery turns a
function given as a task option into a class attribute, so ``self.singleton_key`` is a bound
method: each of these must still be called with ``(args, kwargs)`` alone, on a real worker; and
a callable that cannot take them stops the worker at start-up."""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery

from celery_singleton_lock import SingletonTask, skip_info
from celery_singleton_lock.core.keys import derive_keys
from celery_singleton_lock.testing import held_locks
from tests.support.basic_app import SINGLETON_APP, close_app, history_key, make_app
from tests.support.documented import documented_python
from tests.support.history import load_history
from tests.support.waiting import wait_for
from tests.support.workers import WorkerFactory

NAMES = ("t.key_lambda", "t.key_inline", "t.key_attribute", "t.key_static")


def _account_key(args: Any, kwargs: Any) -> str:
    return f"account-{args[0]}"


class _StaticKeyed(SingletonTask):  # type: ignore[misc]
    singleton_key = staticmethod(_account_key)


class _AttributeKeyed(SingletonTask):  # type: ignore[misc]
    singleton_key = _account_key


def _task(app: Celery, how: str) -> Any:
    if how == "decorator":

        @app.task(
            bind=True,
            base=SingletonTask,
            name="k.decorator",
            shared=False,
            singleton_key=_account_key,
        )
        def decorator(self: Any, account: int) -> None: ...

        return decorator
    if how == "lambda":

        @app.task(
            bind=True,
            base=SingletonTask,
            name="k.lambda",
            shared=False,
            singleton_key=lambda args, kwargs: f"account-{args[0]}",
        )
        def inline(self: Any, account: int) -> None: ...

        return inline
    base = _StaticKeyed if how == "staticmethod" else _AttributeKeyed

    @app.task(bind=True, base=base, name=f"k.{how}", shared=False)
    def keyed(self: Any, account: int) -> None: ...

    return keyed


@pytest.mark.parametrize("how", ["decorator", "lambda", "attribute", "staticmethod"])
def test_every_spelling_is_called_with_args_and_kwargs(how: str) -> None:
    """The key comes from the callable, called as (args, kwargs), for every way to give it."""
    app = make_app("redis://127.0.0.1:6379/0", "cslt:unit:")
    task = _task(app, how)
    keys = task.singleton_keys((42,), {})
    expected = derive_keys("singleton:", task.name, task.run, (42,), {}, key_fn=_account_key)
    assert keys == expected
    assert task.singleton_options().key is not None
    app.close()


def test_a_callable_that_cannot_take_args_and_kwargs_is_refused_when_read() -> None:
    """A key callable with another signature is a setting error naming the option."""
    app = make_app("redis://127.0.0.1:6379/0", "cslt:unit:")

    @app.task(
        bind=True, base=SingletonTask, name="k.bad", shared=False, singleton_key=lambda args: "x"
    )
    def bad(self: Any, account: int) -> None: ...

    with pytest.raises(Exception, match=r"singleton_key \(task k\.bad\)") as caught:
        bad.singleton_options()
    assert "args, kwargs" in str(caught.value)
    app.close()


class _Unshared:
    """An app whose ``task`` decorator declares tasks for it alone (``shared=False``): a
    documented example run here leaves no shared task behind for the suite's later apps."""

    def __init__(self, app: Celery) -> None:
        self._app = app

    def task(self, *args: Any, **options: Any) -> Any:
        return self._app.task(*args, shared=False, **options)


def test_documented_task_options_in_code_run_as_written(redis_url: str, key_prefix: str) -> None:
    """docs/configuration.md, "Task options in code": its tasks run (eagerly, their locks on a
    real Redis), and nightly_report keys on the tenant however it is passed."""
    app = Celery("docs", broker="memory://", set_as_current=False)
    app.conf.task_always_eager = True
    app.conf.singleton_redis_url = redis_url
    app.conf.singleton_key_prefix = f"{key_prefix}lock:"
    names: dict[str, Any] = {"app": _Unshared(app), "__name__": "docs_configuration"}
    exec(documented_python("configuration.md", "## Task options in code"), names)
    nightly_report, sync_account = names["nightly_report"], names["sync_account"]
    try:
        assert skip_info(nightly_report.delay("acme")) is None
        assert skip_info(nightly_report.delay(tenant="acme", day="mon")) is None
        assert skip_info(sync_account.delay(42)) is None
        by_position = nightly_report.singleton_keys(("acme",), {})
        assert by_position == nightly_report.singleton_keys((), {"tenant": "acme"})
        assert by_position != nightly_report.singleton_keys(("globex",), {})
        assert nightly_report.singleton_options().ttl == 120
        assert held_locks(app, f"{key_prefix}lock:") == []
    finally:
        app.close()


@pytest.mark.slow(seconds=7)
def test_key_callables_run_on_a_real_worker(
    worker_factory: WorkerFactory, redis_url: str, key_prefix: str, redis_client: Any
) -> None:
    """On a real worker each spelling runs (no TypeError) and keys on the account alone: a second
    call for the same account while the first runs is skipped, another account runs."""
    app = make_app(redis_url, key_prefix)
    worker = worker_factory.start(SINGLETON_APP, pool="prefork", concurrency=2)
    worker.wait_ready(app)
    try:
        for name in NAMES:
            first = app.send_task(name, (7, 1.5), {"note": "first"})
            other = app.send_task(name, (8,), {"note": "other"})
            assert other.get(timeout=20)["token"] > 0, name
            wait_for(  # the first call holds its lock (a loaded machine may start it late)
                lambda: any(
                    e.key == "account-7:first" and e.end_us is None
                    for e in load_history(redis_client, history_key(key_prefix))
                ),
                10,
                f"{name}: the first call running",
                worker,
            )
            duplicate = app.send_task(name, (7,), {"note": "duplicate"})
            assert skip_info(duplicate.get(timeout=20)) is not None, name
            assert first.get(timeout=20)["token"] > 0, name
    finally:
        close_app(app)


def test_worker_refuses_a_key_callable_that_cannot_take_args_and_kwargs(
    worker_factory: WorkerFactory,
) -> None:
    """Checked at start-up like singleton_key_args: one line naming the option, no traceback."""
    worker = worker_factory.start(
        SINGLETON_APP, concurrency=1, env={"SINGLETON_TEST_BAD_KEY_FN": "1"}
    )
    code = worker.wait(timeout=30)
    log = worker.log_text()
    assert code != 0, log
    (line,) = [x for x in log.splitlines() if "celery_singleton_lock: invalid setting: " in x]
    assert "singleton_key (task t.key_bad)" in line
    assert " ready." not in log
    assert "Traceback" not in log
