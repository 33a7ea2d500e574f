"""task_always_eager keeps the lock semantics, and the testing helpers users get
(celery_singleton_lock.testing, loaded as a pytest plugin)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery, chain
from celery.exceptions import Retry

from celery_singleton_lock import DuplicateTaskError, SingletonTask, SkipInfo, skip_info
from celery_singleton_lock.core.backend import Acquired
from celery_singleton_lock.core.connection import store_for
from celery_singleton_lock.core.pending import pending_key
from celery_singleton_lock.duplicates.coalesce import FOLLOW_UP_HEADER
from celery_singleton_lock.duplicates.gate import abandon
from celery_singleton_lock.testing import held_locks, isolated_locks


@pytest.fixture
def eager_app(redis_url: str) -> Iterator[Celery]:
    """An eager app with no result backend; its locks on the test Redis."""
    app = Celery("eager", broker="memory://", set_as_current=False)
    app.conf.task_always_eager = True
    app.conf.singleton_redis_url = redis_url

    @app.task(bind=True, base=SingletonTask, name="e.hold", shared=False)
    def hold(self: Any, key: str) -> dict[str, Any]:
        """Report the lock this eager run holds."""
        return {"token": self.singleton.fencing_token, "key": self.singleton.key}

    @app.task(
        bind=True, base=SingletonTask, name="e.retry", shared=False, singleton_on_duplicate="retry"
    )
    def retry(self: Any, key: str) -> None:
        """A duplicate of this one cannot be requeued in eager mode."""

    @app.task(
        bind=True, base=SingletonTask, name="e.join", shared=False, singleton_on_duplicate="join"
    )
    def join(self: Any, key: str) -> None:
        """A duplicate of this one cannot wait in eager mode."""

    app.eager_runs = _coalescing_task(app, "e.coalesce")  # type: ignore[attr-defined]

    @app.task(bind=True, base=SingletonTask, name="e.permits", shared=False, singleton_permits=2)
    def permits(self: Any, key: str) -> str | None:
        """Reports the permit slot this eager run holds."""
        return self.singleton.key

    yield app
    app.close()


def _coalescing_task(app: Celery, name: str, **options: Any) -> list[Any]:
    """Define ``name`` on ``app``: a coalescing task keyed on ``key`` that returns its
    ``payload``, with ``options`` as further task options; the list each of its eager runs
    appends that payload to."""
    runs: list[Any] = []

    @app.task(
        bind=True,
        base=SingletonTask,
        name=name,
        shared=False,
        singleton_on_duplicate="coalesce",
        singleton_key_args=("key",),
        **options,
    )
    def coalesce(self: Any, key: str, payload: Any = "") -> Any:
        runs.append(payload)
        return payload

    return runs


@pytest.fixture
def singleton_celery_app(eager_app: Celery) -> Celery:
    """The plugin's singleton_locks fixture isolates the eager app."""
    return eager_app


def _hold_elsewhere(task: Any, key: str) -> str:
    """Take the lock of ``task(key)`` as another run would; return its lock key."""
    keys = task.singleton_keys((key,), {})
    store_for(task.singleton_options().redis_url).acquire(keys, "other-run", 0, 10_000)
    return str(keys.lock)


def test_eager_run_takes_and_releases_its_lock(eager_app: Celery, singleton_locks: str) -> None:
    """An eager delay() runs under a fenced lock in the private prefix, freed afterwards."""
    hold = eager_app.tasks["e.hold"]
    result = hold.delay("k")
    assert result.state == "SUCCESS"
    assert isinstance(result.get()["token"], int)
    assert result.get()["key"].startswith(singleton_locks)
    assert skip_info(result) is None
    assert held_locks(eager_app, singleton_locks) == []


def test_eager_duplicate_is_skipped_with_skip_info(eager_app: Celery, singleton_locks: str) -> None:
    """With the lock held elsewhere, the eager result is a SUCCESS that skip_info recognises."""
    hold = eager_app.tasks["e.hold"]
    lock = _hold_elsewhere(hold, "k")
    result = hold.delay("k")
    assert result.state == "SUCCESS"
    assert skip_info(result) == SkipInfo(key=lock, holder="other-run", task_id=result.id)
    assert skip_info(result.get()) == skip_info(result)
    assert held_locks(eager_app, singleton_locks) == [lock]


def test_eager_runs_record_their_completion(eager_app: Celery, singleton_locks: str) -> None:
    """An eager run of a task acked late records its completion as a worker's run does: the
    same task id applied again ends IGNORED, unrun (docs/internals.md); a new id runs."""
    runs: list[str] = []

    @eager_app.task(bind=True, base=SingletonTask, name="e.late", shared=False, acks_late=True)
    def late(self: Any, key: str) -> str:
        runs.append(str(self.request.id))
        return key

    assert late.apply(("k",), task_id="eager-1").get() == "k"
    again = late.apply(("k",), task_id="eager-1")
    assert again.state == "IGNORED"
    assert late.apply(("k",), task_id="eager-2").get() == "k"
    assert runs == ["eager-1", "eager-2"]
    assert held_locks(eager_app, singleton_locks) == []


def test_eager_retry_policy_raises(eager_app: Celery, singleton_locks: str) -> None:
    """Under "retry" an eager duplicate fails with DuplicateTaskError (no queue to wait in)."""
    retry = eager_app.tasks["e.retry"]
    _hold_elsewhere(retry, "k")
    result = retry.delay("k")
    assert result.state == "FAILURE"
    with pytest.raises(DuplicateTaskError, match="other-run"):
        result.get()


def test_eager_join_policy_raises(eager_app: Celery, singleton_locks: str) -> None:
    """Under "join" an eager duplicate fails with DuplicateTaskError: nothing can wait in an
    eager call (the holder may be the caller's own run); the holder's lock stays its own."""
    join = eager_app.tasks["e.join"]
    lock = _hold_elsewhere(join, "k")
    result = join.delay("k")
    assert result.state == "FAILURE"
    with pytest.raises(DuplicateTaskError, match="other-run"):
        result.get()
    assert held_locks(eager_app, singleton_locks) == [lock]


def test_isolated_locks_deletes_its_keys_and_restores_the_prefix(
    eager_app: Celery, redis_client: redis.Redis, request: pytest.FixtureRequest
) -> None:
    """Every key under the private prefix is gone after the block; the plugin is loaded."""
    eager_app.conf.singleton_key_prefix = "outer:"
    with isolated_locks(eager_app) as prefix:
        lock = _hold_elsewhere(eager_app.tasks["e.hold"], "k")
        assert lock.startswith(prefix)
        assert redis_client.exists(lock)
    assert not redis_client.exists(lock)
    assert eager_app.tasks["e.hold"].singleton_options().key_prefix == "outer:"
    assert request.config.pluginmanager.hasplugin("celery_singleton_lock")


def test_eager_chain_goes_on_past_a_skipped_step(eager_app: Celery, singleton_locks: str) -> None:
    """Eager canvas is run by Celery step by step (no worker, no message): a skipped step's
    result is its marker, and the chain goes on after it (docs/configuration.md, "Canvas")."""
    hold = eager_app.tasks["e.hold"]
    lock = _hold_elsewhere(hold, "busy")
    last = chain(hold.si("a"), hold.si("busy"), hold.si("c")).apply_async()
    skipped = last.parent
    assert skip_info(skipped) == SkipInfo(key=lock, holder="other-run", task_id=skipped.id)
    assert skip_info(last) is None
    assert isinstance(last.get()["token"], int)


# -- eager runs of coalesce and permits -----------------------------------------------------------


def test_eager_coalesced_duplicate_leaves_its_call_and_a_newer_run_supersedes_it(
    eager_app: Celery, singleton_locks: str, redis_client: redis.Redis, caplog: Any
) -> None:
    """An eager duplicate under "coalesce" ends like a skip naming the follow-up and leaves its
    call. Its holder's lock goes without a release that looks for the record (as when it
    expires: its node died), so the next eager run of the key takes the lock after the
    coalesced call: newer, its release ends the follow-up as its skip instead of running the
    older call after it. Nothing left behind."""
    coalesce = eager_app.tasks["e.coalesce"]
    lock = _hold_elsewhere(coalesce, "k")
    duplicate = coalesce.delay("k", "coalesced")
    info = skip_info(duplicate)
    assert info is not None
    assert info.holder == "other-run"
    assert info.follow_up is not None
    assert redis_client.hget(pending_key(lock), "id") == info.follow_up.encode()
    assert eager_app.eager_runs == []  # type: ignore[attr-defined]

    store_for(coalesce.singleton_options().redis_url).release(lock, "other-run", 0)
    with caplog.at_level("INFO", logger="celery_singleton_lock.duplicates.coalesce"):
        nxt = coalesce.delay("k", "next")
    assert nxt.get() == "next"
    assert eager_app.eager_runs == ["next"]  # type: ignore[attr-defined]
    assert (
        "singleton: coalesced follow-up superseded by a newer run, not published: "
        f"e.coalesce[{info.follow_up}] key={lock} holder={nxt.id} duplicates=1"
    ) in caplog.text
    assert not redis_client.exists(pending_key(lock))
    assert held_locks(eager_app, singleton_locks) == []


def test_a_follow_up_that_meets_a_run_ends_as_a_skip_and_leaves_nothing(
    eager_app: Celery, singleton_locks: str, redis_client: redis.Redis
) -> None:
    """A message with the follow-up header that meets a run holding its lock is not coalesced
    again (that run is newer): its result is a skip marker naming that run, no follow-up."""
    coalesce = eager_app.tasks["e.coalesce"]
    lock = _hold_elsewhere(coalesce, "k")
    late = coalesce.apply_async(("k", "old"), headers={FOLLOW_UP_HEADER: True})
    info = skip_info(late)
    assert info is not None
    assert (info.holder, info.follow_up) == ("other-run", None)
    assert not redis_client.exists(pending_key(lock))
    assert eager_app.eager_runs == []  # type: ignore[attr-defined]


def test_a_run_ended_before_its_body_publishes_the_follow_up_left_meanwhile(
    eager_app: Celery, singleton_locks: str, redis_client: redis.Redis
) -> None:
    """A worker's run whose lock was taken, but which Celery's tracer ended before the body
    (task/tracer.py: the lock is abandoned), publishes the follow-up a duplicate left beside it in
    that moment, as any release of a coalescing run does (here eager: it runs in place)."""
    coalesce = eager_app.tasks["e.coalesce"]
    keys = coalesce.singleton_keys(("k",), {})
    lock = _hold_elsewhere(coalesce, "k")
    info = skip_info(coalesce.delay("k", "left"))
    assert info is not None
    assert info.holder == "other-run"
    _abandon(coalesce, keys, "other-run", 1)
    assert eager_app.eager_runs == ["left"]  # type: ignore[attr-defined]
    assert not redis_client.exists(pending_key(lock))
    assert held_locks(eager_app, singleton_locks) == []


def test_eager_runs_take_permit_slots_and_the_next_is_skipped(
    eager_app: Celery, singleton_locks: str
) -> None:
    """Two permits: with one slot held elsewhere an eager run takes the other; with both held
    it is skipped naming a holder. ``held_locks`` lists the slots."""
    permits = eager_app.tasks["e.permits"]
    keys = permits.singleton_keys(("k",), {})
    store = store_for(permits.singleton_options().redis_url)
    store.acquire(keys, "other-run", 0, 10_000)
    assert held_locks(eager_app, singleton_locks) == [keys.slot(1)]
    assert permits.delay("k").get() == keys.slot(2)
    assert held_locks(eager_app, singleton_locks) == [keys.slot(1)]
    store.acquire(keys, "third-run", 0, 10_000)
    skipped = permits.delay("k")
    assert skipped.state == "SUCCESS"
    assert skip_info(skipped) == SkipInfo(key=keys.lock, holder="other-run", task_id=skipped.id)
    assert held_locks(eager_app, singleton_locks) == keys.slots


def test_eager_coalesce_with_permits_collapses_into_one_follow_up_for_the_key(
    eager_app: Celery, singleton_locks: str, redis_client: redis.Redis
) -> None:
    """Two permits, both slots held elsewhere: every eager duplicate collapses into the key's
    one pending record (the latest call, a count), and an eager run while one slot is free
    takes it instead of coalescing. The holder of either slot that releases publishes the
    follow-up (here eager: it runs in place), once; nothing is left behind."""
    runs = _coalescing_task(eager_app, "e.coalesce_permits", singleton_permits=2)
    coalesce = eager_app.tasks["e.coalesce_permits"]
    keys = coalesce.singleton_keys(("k",), {})
    store = store_for(coalesce.singleton_options().redis_url)
    assert isinstance(store.acquire(keys, "other-run", 0, 10_000), Acquired)
    assert coalesce.delay("k", "in-the-free-slot").get() == "in-the-free-slot"
    assert runs == ["in-the-free-slot"]
    assert isinstance(store.acquire(keys, "third-run", 0, 10_000), Acquired)
    infos = [skip_info(coalesce.delay("k", f"call-{i}")) for i in range(3)]
    assert all(info is not None for info in infos)
    follow_ups = {info.follow_up for info in infos if info is not None}
    assert len(follow_ups) == 1, follow_ups  # one pending record for the key, not per slot
    assert redis_client.hget(pending_key(keys.lock), "count") == b"3"
    assert runs == ["in-the-free-slot"]

    _abandon(coalesce, keys, "third-run", 2)
    assert runs == ["in-the-free-slot", "call-2"]  # the latest call, once
    assert not redis_client.exists(pending_key(keys.lock))
    _abandon(coalesce, keys, "other-run", 1)  # nothing pending: runs nothing
    assert runs == ["in-the-free-slot", "call-2"]
    assert held_locks(eager_app, singleton_locks) == []


@pytest.mark.parametrize("serializer", ["json", "pickle", "msgpack", "yaml"])
def test_a_coalesced_call_goes_through_the_tasks_serializer(
    redis_url: str, serializer: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The pending call is written with the task's serializer and read with the app's
    accept_content: a follow-up of a pickle (msgpack, yaml) task is published and runs, though
    kombu disables those serializers unless a consumer accepts them. A record of a content type
    the app does not accept (written by someone else) is dropped, never deserialized."""
    app = Celery("eager-serializers", broker="memory://", set_as_current=False)
    app.conf.update(
        task_always_eager=True,
        singleton_redis_url=redis_url,
        task_serializer=serializer,
        accept_content=[serializer],
    )
    runs = _coalescing_task(app, "e.coalesce_serialized")
    coalesce = app.tasks["e.coalesce_serialized"]

    with isolated_locks(app):
        lock = _hold_elsewhere(coalesce, "k")
        payload = {"n": 1, "items": ["a", "b"]}
        info = skip_info(coalesce.delay("k", payload))
        assert info is not None
        assert info.follow_up is not None
        _abandon(coalesce, coalesce.singleton_keys(("k",), {}), "other-run", 1)
        assert runs == [payload]  # published by the holder's release: runs in place

        _hold_elsewhere(coalesce, "k")
        assert skip_info(coalesce.delay("k", "refused")) is not None
        store = store_for(coalesce.singleton_options().redis_url)
        store.release(lock, "other-run", 0)
        # the record's type is not (or no longer) one the app accepts
        app.conf.accept_content = ["json" if serializer != "json" else "pickle"]
        with caplog.at_level("ERROR", logger="celery_singleton_lock.duplicates.coalesce"):
            coalesce.delay("k", "last")
        assert runs == [payload, "last"]  # the refused record was not run
        assert not store.client.exists(pending_key(lock))  # nor put back
        assert "coalesced follow-up dropped, not a call this app wrote or accepts" in (caplog.text)
    app.close()


@pytest.mark.parametrize(
    "record",
    [
        {"id": "f-1", "count": "1"},  # no call at all
        {"id": "f-2", "body": "{not json", "ctype": "application/json", "cenc": "utf-8"},
        {"id": "f-3", "body": '{"a": 1}', "ctype": "application/json", "cenc": "utf-8"},
        {  # a call of another key: not left by a duplicate of this lock
            **{"id": "f-4", "task": "e.coalesce", "ctype": "application/json", "cenc": "utf-8"},
            "body": '[["other", "x"], {}]',
        },
        {  # a task that takes no lock at all
            **{"id": "f-5", "task": "celery.backend_cleanup", "ctype": "application/json"},
            **{"cenc": "utf-8", "body": "[[], {}]"},
        },
    ],
    ids=["no-call", "not-json", "not-a-call", "another-lock", "not-a-singleton-task"],
)
def test_a_pending_record_we_did_not_write_is_dropped_not_put_back(
    eager_app: Celery,
    singleton_locks: str,
    redis_client: redis.Redis,
    record: dict[str, Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A pending record beside a free lock that no duplicate of this app wrote: the next
    release drops it with one ERROR line, publishes nothing, and does not put it back (it
    would fail, its expiry renewed, at every release). The run itself is unaffected."""
    coalesce = eager_app.tasks["e.coalesce"]
    lock = coalesce.singleton_keys(("k",), {}).lock
    redis_client.hset(pending_key(lock), mapping=record)
    with caplog.at_level("ERROR", logger="celery_singleton_lock.duplicates.coalesce"):
        assert coalesce.delay("k", "run").get() == "run"
    assert eager_app.eager_runs == ["run"]  # type: ignore[attr-defined]
    assert not redis_client.exists(pending_key(lock))
    assert caplog.text.count("coalesced follow-up dropped, not a call this app wrote") == 1
    assert held_locks(eager_app, singleton_locks) == []


def _retrying_task(app: Celery, name: str) -> list[int]:
    """Define ``name`` on ``app``: it retries (60 s countdown) until its third try, then
    returns; the list each of its runs appends its retries count to."""
    tries: list[int] = []

    @app.task(bind=True, base=SingletonTask, name=name, shared=False, max_retries=3)
    def retrying(self: Any, key: str, fail: bool = False) -> int:
        tries.append(self.request.retries)
        if fail:
            raise ValueError("the body failed")
        if self.request.retries < 2:
            raise self.retry(countdown=60)
        return int(self.request.retries)

    return tries


@pytest.mark.parametrize("propagates", [False, True])
def test_an_eager_retry_leaves_the_key_free(
    eager_app: Celery, singleton_locks: str, propagates: bool
) -> None:
    """An eager ``self.retry()`` publishes nothing. Without ``task_eager_propagates`` Celery
    runs the retry at once (each try takes the key, none is skipped); with it, ``Retry`` is
    raised out of ``delay()`` and nothing runs it: nothing is handed over, the lock is
    released, and the next call of the key runs."""
    eager_app.conf.task_eager_propagates = propagates
    tries = _retrying_task(eager_app, "e.retrying")
    task = eager_app.tasks["e.retrying"]
    if propagates:
        with pytest.raises(Retry):
            task.delay("k")
        assert held_locks(eager_app, singleton_locks) == []
        with pytest.raises(Retry):
            task.delay("k")  # not skipped: it ran, and asked for its retry again
        assert tries == [0, 0]
    else:
        assert task.delay("k").get() == 2
        assert tries == [0, 1, 2]
    assert held_locks(eager_app, singleton_locks) == []


def test_an_eager_failure_propagated_releases_the_lock(
    eager_app: Celery, singleton_locks: str
) -> None:
    """``task_eager_propagates``: a failing body's exception leaves ``delay()``; Celery sends
    ``task_postrun`` (with no state) first, and the lock is released."""
    eager_app.conf.task_eager_propagates = True
    tries = _retrying_task(eager_app, "e.failing")
    task = eager_app.tasks["e.failing"]
    for _ in range(2):
        with pytest.raises(ValueError, match="the body failed"):
            task.delay("k", fail=True)
    assert tries == [0, 0]
    assert held_locks(eager_app, singleton_locks) == []


def test_an_eager_run_shows_its_arguments_as_the_caller_masked_them(
    eager_app: Celery, singleton_locks: str, redis_client: redis.Redis
) -> None:
    """Celery's eager ``apply()`` drops ``argsrepr``/``kwargsrepr``: SingletonTask hands them
    on, and the lock's ``args`` shows each half given as given, the other previewed (as
    Celery's log lines do), through ``apply_async`` and ``apply`` alike."""
    card = "4111111111111111"

    @eager_app.task(bind=True, base=SingletonTask, name="e.charge", shared=False)
    def charge(self: Any, card: str, note: str = "") -> str:
        """The ``args`` field of the lock this eager run holds."""
        return (redis_client.hget(self.singleton.key, "args") or b"").decode()

    assert charge.apply_async((card,), argsrepr="('****',)").get() == "('****',) {}"
    masked_args = charge.apply((card,), {"note": "n"}, argsrepr="('****',)").get()
    assert masked_args == "('****',) {'note': 'n'}"
    masked_kwargs = charge.apply(kwargs={"card": card}, kwargsrepr="{'card': '*'}").get()
    assert masked_kwargs == "() {'card': '*'}"
    assert charge.apply(("plain",), headers={"h": 1}).get() == "('plain',) {}"


@pytest.mark.parametrize("accepts_pickle", [True, False])
def test_a_coalesced_call_is_kept_so_that_it_keys_the_same(
    redis_url: str, accepts_pickle: bool
) -> None:
    """A JSON task's duplicate whose key argument is a tuple (a message sent with pickle, or an
    eager call): JSON would read it back as a list, which keys differently, and the release
    would drop the follow-up as not ours. The call is kept with a serializer the app accepts
    that keeps its key (pickle); with none, the duplicate is not coalesced but requeued (in
    eager mode: it raises), never dropped."""
    app = Celery("eager-tuple-key", broker="memory://", set_as_current=False)
    app.conf.update(
        task_always_eager=True,
        singleton_redis_url=redis_url,
        task_serializer="json",
        accept_content=["json", "pickle"] if accepts_pickle else ["json"],
    )
    runs = _coalescing_task(app, "e.coalesce_tuple")
    coalesce = app.tasks["e.coalesce_tuple"]
    key = ("region", 7)
    with isolated_locks(app):
        _hold_elsewhere(coalesce, key)  # type: ignore[arg-type]
        if not accepts_pickle:
            with pytest.raises(DuplicateTaskError):  # apply(): the tuple as a worker gets it
                coalesce.apply((key, "follow")).get()
            app.close()
            return
        info = skip_info(coalesce.apply((key, "follow")))
        assert info is not None
        assert info.follow_up is not None
        _abandon(coalesce, coalesce.singleton_keys((key,), {}), "other-run", 1)
        assert runs == ["follow"]  # published by the holder's release, in the same key
    app.close()


def _abandon(task: Any, keys: Any, owner: str, slot: int = 1) -> None:
    """Give back ``owner``'s slot as a run that never started does (duplicates/gate.py)."""
    abandon(task, keys, owner, 0, slot, task.singleton_options())
