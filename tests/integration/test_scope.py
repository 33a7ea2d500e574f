"""singleton_scope: one lock shared by several tasks, keyed on the same argument names."""

from __future__ import annotations

from typing import Any

import pytest
import redis
from celery import Celery

from celery_singleton_lock import SingletonConfigError, SingletonTask, skip_info
from celery_singleton_lock.core.keys import derive_keys
from celery_singleton_lock.core.pending import pending_key
from celery_singleton_lock.worker.scopes import check_scopes
from tests.support.basic_app import SINGLETON_APP, history_key, make_app
from tests.support.chaos import lock_prefix
from tests.support.history import assert_no_overlap, check_history, load_history
from tests.support.waiting import wait_for
from tests.support.workers import WorkerFactory


def _app_with(**scopes: Any) -> tuple[Celery, dict[str, Any]]:
    app = make_app("redis://127.0.0.1:6379/0", "cslt:unit:")
    made: dict[str, Any] = {}

    @app.task(base=SingletonTask, name="s.import", shared=False, **scopes.get("import", {}))
    def imp(tenant: str, since: int = 0) -> None: ...

    @app.task(base=SingletonTask, name="s.export", shared=False, **scopes.get("export", {}))
    def exp(fmt: str, tenant: str) -> None: ...

    made.update({"import": imp, "export": exp})
    return app, made


SHARED = {"singleton_scope": "tenant-sync", "singleton_key_args": ("tenant",)}


def test_tasks_of_a_scope_share_a_key_per_key_argument_value() -> None:
    app, t = _app_with(**{"import": SHARED, "export": SHARED})
    a = t["import"].singleton_keys(("acme",), {"since": 5})
    b = t["export"].singleton_keys(("csv",), {"tenant": "acme"})
    c = t["export"].singleton_keys(("csv", "other"), {})
    assert a == b
    assert a != c
    assert "{tenant-sync:" in a.lock
    check_scopes([t["import"], t["export"]])
    app.close()


def test_without_a_scope_each_task_keeps_its_own_key() -> None:
    app, t = _app_with(**{"export": SHARED})
    a = t["import"].singleton_keys(("acme",), {})
    b = t["export"].singleton_keys(("csv", "acme"), {})
    assert a != b
    assert "{s.import:" in a.lock
    app.close()


def test_all_parameters_in_any_order_key_the_same() -> None:
    """Without key_args a scope keys on every parameter, by name: the order does not matter."""
    app = make_app("redis://127.0.0.1:6379/0", "cslt:unit:")

    @app.task(base=SingletonTask, name="s.a", shared=False, singleton_scope="pair")
    def a(x: int, y: int) -> None: ...

    @app.task(base=SingletonTask, name="s.b", shared=False, singleton_scope="pair")
    def b(y: int, x: int) -> None: ...

    assert a.singleton_keys((1, 2), {}) == b.singleton_keys((2, 1), {})
    check_scopes([a, b])
    app.close()


def test_tasks_of_a_scope_keyed_on_other_arguments_are_refused() -> None:
    app, t = _app_with(
        **{"import": SHARED, "export": {"singleton_scope": "tenant-sync"}}  # export: all args
    )
    with pytest.raises(
        SingletonConfigError, match=r"scope 'tenant-sync'.*s\.export on fmt, tenant"
    ):
        check_scopes([t["import"], t["export"]])
    app.close()


def test_tasks_of_a_scope_with_other_permits_are_refused() -> None:
    """1 permit locks the key itself, 3 lock its slots ``...:lock:1..3``: the two tasks would
    never meet. Refused, and shown so."""
    app, t = _app_with(**{"import": SHARED, "export": {**SHARED, "singleton_permits": 3}})
    assert (
        t["import"].singleton_keys(("a",), {}).slots
        != t["export"].singleton_keys(("csv", "a"), {}).slots
    )
    with pytest.raises(
        SingletonConfigError,
        match=r"scope 'tenant-sync' must take the same singleton_permits.*"
        r"s\.export 3; s\.import 1",
    ):
        check_scopes([t["import"], t["export"]])
    app.close()


@pytest.mark.parametrize("other", ["skip", "retry", "coalesce"])
def test_a_scope_that_joins_in_part_is_refused(other: str) -> None:
    """A joined call left beside a run of a task of another policy would never be completed
    by that run's end: a scope joins as a whole or not at all."""
    app, t = _app_with(
        **{
            "import": {**SHARED, "singleton_on_duplicate": "join"},
            "export": {**SHARED, "singleton_on_duplicate": other},
        }
    )
    with pytest.raises(
        SingletonConfigError,
        match=r"scope 'tenant-sync' must all use singleton_on_duplicate .*'join'",
    ):
        check_scopes([t["import"], t["export"]])
    app.close()


@pytest.mark.parametrize("other", ["skip", "retry", "raise"])
def test_a_scope_that_coalesces_in_part_is_refused(other: str) -> None:
    """A follow-up left beside a run of a task that does not coalesce would wait for the
    key's next coalescing release: a scope coalesces as a whole or not at all."""
    app, t = _app_with(
        **{
            "import": {**SHARED, "singleton_on_duplicate": "coalesce"},
            "export": {**SHARED, "singleton_on_duplicate": other},
        }
    )
    with pytest.raises(
        SingletonConfigError,
        match=rf"scope 'tenant-sync' must all use singleton_on_duplicate 'coalesce' or none.*"
        rf"s\.export {other}; s\.import coalesce",
    ):
        check_scopes([t["import"], t["export"]])
    app.close()
    both, t = _app_with(
        **{
            "import": {**SHARED, "singleton_on_duplicate": "coalesce", "singleton_permits": 1},
            "export": {**SHARED, "singleton_on_duplicate": "coalesce"},
        }
    )
    check_scopes([t["import"], t["export"]])  # all of them coalesce: accepted
    both.close()


def test_a_scope_named_like_a_task_is_refused() -> None:
    """A scope's keys carry its name where a task's carry the task's: a scope named like a task
    outside any scope would share that task's locks. Refused, naming both."""
    app, t = _app_with(**{"export": {**SHARED, "singleton_scope": "s.import"}})
    with pytest.raises(SingletonConfigError, match=r"scope 's\.import' is the name of task"):
        check_scopes([t["import"], t["export"]])
    app.close()


@pytest.mark.parametrize("bad", ["", "has space", "{brace}", "x" * 65, 3])
def test_a_scope_name_is_checked(bad: Any) -> None:
    app, t = _app_with(**{"import": {"singleton_scope": bad}})
    with pytest.raises(SingletonConfigError, match="singleton_scope"):
        t["import"].singleton_options()
    app.close()


@pytest.mark.slow(seconds=8)
def test_an_import_and_an_export_of_one_tenant_exclude_each_other(
    worker_factory: WorkerFactory,
    client_app: Celery,
    key_prefix: str,
    redis_client: redis.Redis,
) -> None:
    """On a real worker: the export of a tenant being imported is skipped, naming the import;
    another tenant's export runs at the same time; no two runs of one tenant overlap."""
    worker = worker_factory.start(SINGLETON_APP, pool="prefork", concurrency=3)
    worker.wait_ready(client_app)
    imported = client_app.send_task("t.tenant_import", kwargs={"tenant": "a", "seconds": 2})
    wait_for(
        lambda: load_history(redis_client, history_key(key_prefix)),
        10,
        "the import running",
        worker,
    )
    export_a = client_app.send_task("t.tenant_export", ("csv", "a"))
    export_b = client_app.send_task("t.tenant_export", ("csv", "b"), {"seconds": 0.5})
    info = skip_info(export_a.get(timeout=20))
    assert info is not None
    assert info.holder == imported.id
    assert skip_info(export_b.get(timeout=20)) is None
    assert skip_info(imported.get(timeout=20)) is None
    report = check_history(load_history(redis_client, history_key(key_prefix)))
    assert_no_overlap(report, allow_unfinished=False)
    assert len(report.finished()) == 2


@pytest.mark.slow(seconds=10)
def test_a_duplicate_of_one_task_coalesced_on_a_run_of_the_other(
    worker_factory: WorkerFactory,
    client_app: Celery,
    key_prefix: str,
    redis_client: redis.Redis,
) -> None:
    """Two coalescing tasks of one scope: duplicates of both, met while one of them runs,
    collapse into one follow-up of the latest duplicate's task with its arguments, published
    by the running task's release; nothing overlaps, nothing is left behind."""
    worker = worker_factory.start(SINGLETON_APP, pool="prefork", concurrency=3)
    worker.wait_ready(client_app)
    pull = client_app.send_task("t.merge_pull", kwargs={"tenant": "a", "seconds": 2})
    wait_for(lambda: load_history(redis_client, history_key(key_prefix)), 10, "the pull", worker)
    burst = [client_app.send_task("t.merge_pull", kwargs={"tenant": "a", "payload": "pull-1"})]
    wait_for(burst[0].ready, 10, "the pull duplicate coalesced", worker)
    burst.append(client_app.send_task("t.merge_push", kwargs={"tenant": "a", "payload": "push-2"}))
    wait_for(burst[1].ready, 10, "the push duplicate coalesced", worker)
    infos = [skip_info(r) for r in burst]
    assert all(i is not None and i.holder == pull.id for i in infos), infos
    follow_ups = {i.follow_up for i in infos if i is not None}
    assert len(follow_ups) == 1, follow_ups
    (follow_up,) = follow_ups
    assert follow_up is not None
    lock = merge_lock(key_prefix)
    assert {i.key for i in infos if i is not None} == {lock}  # the scope's lock, both tasks
    assert skip_info(pull.get(timeout=10)) is None

    value = client_app.AsyncResult(follow_up).get(timeout=10)
    assert value == {**value, "task": "t.merge_push", "payload": "push-2"}
    wait_for(lambda: not redis_client.exists(lock), 5, "the follow-up's release", worker)
    assert not redis_client.exists(pending_key(lock))
    report = check_history(load_history(redis_client, history_key(key_prefix)))
    assert_no_overlap(report, allow_unfinished=False)
    assert len(report.finished()) == 2  # the pull and one follow-up
    assert worker.log_text().count("singleton: coalesced follow-up published after SUCCESS") == 1


def merge_lock(key_prefix: str) -> str:
    """The lock key of scope tenant-merge for tenant "a" (as the worker's tasks derive it)."""
    keys = derive_keys(lock_prefix(key_prefix), "tenant-merge", _merge, ("a",), {}, ("tenant",))
    return str(keys.lock)


def _merge(tenant: str, seconds: float = 0.0, payload: Any = None) -> None:
    """The parameters of t.merge_pull and t.merge_push."""
