"""Canvas around a duplicate, on a real worker: chain, group, chord, link and link_error under
each policy (docs/configuration.md, "Canvas").

- skip (and coalesce, whose duplicate ends as a skip naming its follow-up): nothing after the
  skipped step runs (the rest of its chain, its chord's body, its link
  callbacks, not link_error either); every result the caller waits on is the skip marker, so
  ``skip_info`` on a chain's or a chord's AsyncResult names the key and the holder; a group's
  skipped member is its own marker.
- raise: Celery's failure semantics: the rest of the chain fails with DuplicateTaskError, the
  chord body with a ChordError naming it, link_error is called.
- retry: the duplicate waits for the lock, then runs, and the canvas goes on as if nothing
  happened.
- skip decided by the worker's main process (worker/mainskip.py), its key hot: the same.

The worker is a solo pool consuming one message at a time, in order: once a callback published
after everything else has run, whatever the steps before it published has run too, so "never
ran" is seen without a sleep.
"""

from __future__ import annotations

from typing import Any

import pytest
import redis
from celery import Celery, chain, chord, group
from celery.exceptions import ChordError

from celery_singleton_lock import DuplicateTaskError, SkipInfo, skip_info
from celery_singleton_lock.core.backend import Acquired, LockBackend
from celery_singleton_lock.core.connection import store_for
from celery_singleton_lock.core.keys import LockKeys, derive_keys
from celery_singleton_lock.core.pending import pending_key
from tests.support.basic_app import SINGLETON_APP
from tests.support.mainskip import reached_celery, turn_hot
from tests.support.singleton_app import signals_key
from tests.support.waiting import wait_for
from tests.support.workers import WorkerFactory, WorkerProcess

TIMEOUT = 20


def _step_signature(prev: Any = None, key: str = "") -> None:
    """Same parameters as t.step, t.step_retry, t.step_raise and t.step_coalesce."""


class Canvas:
    """The worker, the client and the lock store of one test, with helpers for its steps."""

    def __init__(  # noqa: PLR0917 - fixtures
        self,
        task: str,
        app: Celery,
        worker: WorkerProcess,
        client: redis.Redis,
        prefix: str,
        redis_url: str,
    ) -> None:
        self.task, self.app, self.worker, self.client = task, app, worker, client
        self.prefix = prefix
        self.store: LockBackend = store_for(redis_url)
        self.fences = 0

    def lock(self, key: str) -> str:
        """The lock key of this test's step task for ``key``."""
        return self.keys(key).lock

    def keys(self, key: str) -> LockKeys:
        return derive_keys(
            f"{self.prefix}lock:", self.task, _step_signature, (), {"key": key}, ("key",)
        )

    def hold(self, key: str, holder: str) -> None:
        """Make ``holder`` (no task) hold the lock of ``key``."""
        assert isinstance(self.store.acquire(self.keys(key), holder, 0, 60_000), Acquired)

    def free(self, key: str, holder: str) -> None:
        self.store.release(self.lock(key), holder, 0)

    def step(self, key: str) -> Any:
        return self.app.signature(self.task, kwargs={"key": key})

    def gather(self, label: str) -> Any:
        return self.app.signature("t.gather", kwargs={"label": label})

    def errback(self, label: str) -> Any:
        return self.app.signature("t.errback", kwargs={"label": label})

    def events(self) -> list[str]:
        return [e.decode() for e in self.client.lrange(signals_key(self.prefix), 0, -1)]

    def logged(self, prefix: str) -> list[str]:
        return [e for e in self.events() if e.startswith(prefix)]

    def fence(self) -> None:
        """Wait until everything published so far has run: a step with a link callback, both
        published now, must have run (and the link callback shows link callbacks do run)."""
        self.fences += 1
        label = f"fence-{self.fences}"
        self.app.send_task(self.task, kwargs={"key": label}, link=self.gather(label)).get(
            timeout=TIMEOUT
        )
        wait_for(lambda: self.logged(f"gather {label} "), TIMEOUT, label, self.worker)


@pytest.fixture
def canvas(  # noqa: PLR0917 - fixtures
    request: pytest.FixtureRequest,
    worker_factory: WorkerFactory,
    client_app: Celery,
    redis_client: redis.Redis,
    key_prefix: str,
    redis_url: str,
) -> Canvas:
    worker = worker_factory.start(SINGLETON_APP, pool="solo", concurrency=1)
    worker.wait_ready(client_app)
    return Canvas(request.param, client_app, worker, redis_client, key_prefix, redis_url)


def _published(canvas: Canvas) -> dict[str, Any]:
    """Every shape, each with its one duplicate (a step whose key ``holder-<shape>`` holds)."""
    for shape in ("chain", "group", "chord", "link", "nested", "before-chord"):
        canvas.hold(f"busy-{shape}", f"holder-{shape}")
    step, gather = canvas.step, canvas.gather
    return {
        "chain": chain(step("a"), step("busy-chain"), step("c")).apply_async(),
        "group": group(step("g"), step("busy-group")).apply_async(),
        "chord": chord([step("h"), step("busy-chord")], gather("chord")).apply_async(),
        "link": canvas.app.send_task(
            canvas.task,
            kwargs={"key": "busy-link"},
            link=gather("link"),
            link_error=canvas.errback("link"),
        ),
        # a chain inside a chord's header, and a chord after a chain's step
        "nested": chord(
            [chain(step("n1"), step("busy-nested")), step("n2")], gather("nested")
        ).apply_async(),
        "before-chord": chain(
            step("busy-before-chord"), chord([step("x1"), step("x2")], gather("after"))
        ).apply_async(),
    }


@pytest.mark.parametrize("canvas", ["t.step", "t.step_coalesce"], indirect=True)
def test_skip_stops_what_follows_and_the_callers_result_says_why(
    canvas: Canvas, redis_client: redis.Redis
) -> None:
    """skip, and coalesce (whose duplicate ends as a skip naming its follow-up, a plain message
    of the task published when the holder lets go: it carries no canvas)."""
    coalesce = canvas.task == "t.step_coalesce"
    results = _published(canvas)

    def why(value: Any, shape: str, task_id: str | None = None) -> SkipInfo:
        """``value``'s skip info, checked against ``shape``'s lock and holder (and the skipped
        step's task id); under coalesce its follow-up is the one pending beside that lock."""
        info = skip_info(value)
        assert info is not None, value
        lock = canvas.lock(f"busy-{shape}")
        assert (info.key, info.holder) == (lock, f"holder-{shape}")
        assert task_id is None or info.task_id == task_id
        pending = redis_client.hget(pending_key(lock), "id")
        if coalesce:
            assert pending is not None, shape
            assert info.follow_up == pending.decode(), shape
        else:
            assert (info.follow_up, pending) == (None, None), shape
        return info

    chained = results["chain"]
    skipped = chained.parent
    assert chained.get(timeout=TIMEOUT) == skipped.get(timeout=TIMEOUT)
    why(chained, "chain", skipped.id)
    assert chained.parent.parent.get(timeout=TIMEOUT) == ["a"]

    members = results["group"].get(timeout=TIMEOUT)
    assert members[0] == ["g"]
    why(members[1], "group", results["group"].results[1].id)

    body = results["chord"]
    header = body.parent.results
    why(body.get(timeout=TIMEOUT), "chord", header[1].id)
    assert header[0].get(timeout=TIMEOUT) == ["h"]

    linked = results["link"]
    why(linked.get(timeout=TIMEOUT), "link", linked.id)
    why(results["nested"].get(timeout=TIMEOUT), "nested")
    why(results["before-chord"].get(timeout=TIMEOUT), "before-chord")

    # a group after a chain's step (a shape Celery leaves PENDING on a failure, so skip only)
    canvas.hold("busy-before-group", "holder-before-group")
    grouped = chain(canvas.step("busy-before-group"), group(canvas.step("z1"), canvas.step("z2")))
    for member in grouped.apply_async().get(timeout=TIMEOUT):
        why(member, "before-group")

    canvas.fence()
    ran = canvas.logged("step ")
    assert sorted(ran) == ["step a", "step fence-1", "step g", "step h", "step n1", "step n2"]
    assert canvas.logged("gather ") == [f"gather fence-1 {['fence-1']}".replace("'", '"')]
    assert canvas.logged("errback") == []
    log = canvas.worker.log_text()
    assert log.count(f"singleton: duplicate {'coalesced' if coalesce else 'skipped'}: ") == 7
    assert "singleton: skipped duplicate stops its canvas, 1 later tasks marked skipped" in log
    assert "Traceback" not in log
    for shape in ("chain", "group", "chord", "link", "nested", "before-chord"):
        assert canvas.store.holder(canvas.lock(f"busy-{shape}"))["owner"] == f"holder-{shape}"


@pytest.mark.parametrize("canvas", ["t.step"], indirect=True)
def test_a_skip_in_the_main_process_stops_what_follows_too(canvas: Canvas) -> None:
    """The chain's and the chord's duplicate steps are turned away by the worker's main process
    (the key is hot): nothing after them runs, and the caller's result names key and holder."""
    canvas.hold("busy-hot", "holder-hot")
    warm_up = turn_hot(canvas.app, canvas.worker, canvas.task, {"key": "busy-hot"})
    step = canvas.step
    chained = chain(step("a"), step("busy-hot"), step("c")).apply_async()
    body = chord([step("h"), step("busy-hot")], canvas.gather("chord")).apply_async()
    expected = (canvas.lock("busy-hot"), "holder-hot")
    skipped = [chained.parent, body.parent.results[1]]
    for result, value in (
        (chained, chained.get(timeout=TIMEOUT)),
        (body, body.get(timeout=TIMEOUT)),
    ):
        info = skip_info(value)
        assert info is not None, result
        assert (info.key, info.holder) == expected
    assert not [r.id for r in skipped if reached_celery(canvas.worker, canvas.task, r.id)]
    canvas.fence()
    assert sorted(canvas.logged("step ")) == ["step a", "step fence-1", "step h"]
    log = canvas.worker.log_text()
    assert log.count("singleton: duplicate skipped: ") == len(warm_up) + 2
    assert log.count("singleton: skipped duplicate stops its canvas, 1 later tasks marked") == 2


@pytest.mark.parametrize("canvas", ["t.step_raise"], indirect=True)
def test_raise_fails_what_follows_as_celery_does(canvas: Canvas) -> None:
    results = _published(canvas)

    chained = results["chain"]
    with pytest.raises(DuplicateTaskError) as raised:
        chained.get(timeout=TIMEOUT)
    assert (raised.value.key, raised.value.holder) == (canvas.lock("busy-chain"), "holder-chain")
    assert chained.parent.state == "FAILURE"
    assert chained.parent.parent.get(timeout=TIMEOUT) == ["a"]

    members = results["group"].get(timeout=TIMEOUT, propagate=False)
    assert members[0] == ["g"]
    assert isinstance(members[1], DuplicateTaskError)
    assert members[1].holder == "holder-group"

    # get() raises the header's error if it sees it failed before it waits on the body, else
    # the body's ChordError naming it (Celery's own race); the body's is stored either way
    for shape in ("chord", "nested"):
        with pytest.raises((DuplicateTaskError, ChordError), match=f"holder-{shape}"):
            results[shape].get(timeout=TIMEOUT)
        body = results[shape]
        wait_for(lambda body=body: body.state == "FAILURE", TIMEOUT, f"{shape} body failed")
        assert isinstance(body.result, ChordError)
        assert f"holder-{shape}" in str(body.result)
    with pytest.raises(DuplicateTaskError):
        results["link"].get(timeout=TIMEOUT)
    with pytest.raises(DuplicateTaskError, match="holder-before-chord"):
        results["before-chord"].get(timeout=TIMEOUT)

    canvas.fence()
    assert sorted(canvas.logged("step ")) == [
        "step a",
        "step fence-1",
        "step g",
        "step h",
        "step n1",
        "step n2",
    ]
    assert [e.split(" ")[1] for e in canvas.logged("gather ")] == ["fence-1"]
    assert canvas.logged("errback") == [f"errback link DuplicateTaskError {results['link'].id}"]


@pytest.mark.parametrize("canvas", ["t.step_retry"], indirect=True)
def test_retry_waits_then_the_canvas_goes_on(canvas: Canvas) -> None:
    results = _published(canvas)
    duplicates = {
        "chain": results["chain"].parent.id,
        "group": results["group"].results[1].id,
        "chord": results["chord"].parent.results[1].id,
        "link": results["link"].id,
    }
    for shape, task_id in duplicates.items():
        wait_for(
            lambda task_id=task_id: canvas.logged(f"duplicate_retried {task_id}"),
            TIMEOUT,
            f"the {shape} duplicate requeued",
            canvas.worker,
        )
    for shape in ("chain", "group", "chord", "link", "nested", "before-chord"):
        canvas.free(f"busy-{shape}", f"holder-{shape}")

    assert results["chain"].get(timeout=TIMEOUT) == ["a", "busy-chain", "c"]
    assert results["group"].get(timeout=TIMEOUT) == [["g"], ["busy-group"]]
    assert results["chord"].get(timeout=TIMEOUT) == [["h"], ["busy-chord"]]
    assert results["link"].get(timeout=TIMEOUT) == ["busy-link"]
    assert results["nested"].get(timeout=TIMEOUT) == [["n1", "busy-nested"], ["n2"]]
    assert results["before-chord"].get(timeout=TIMEOUT) == [
        ["busy-before-chord", "x1"],
        ["busy-before-chord", "x2"],
    ]
    canvas.fence()
    assert 'gather link ["busy-link"]' in canvas.logged("gather link")
    assert canvas.logged("errback") == []

    # link_error: not called while the duplicate waits, called once its own run fails
    canvas.hold("fail-link", "holder-fail")
    failing = canvas.app.send_task(
        canvas.task, kwargs={"key": "fail-link"}, link_error=canvas.errback("fail")
    )
    wait_for(
        lambda: canvas.logged(f"duplicate_retried {failing.id}"),
        TIMEOUT,
        "the failing duplicate requeued",
        canvas.worker,
    )
    assert canvas.logged("errback") == []
    canvas.free("fail-link", "holder-fail")
    with pytest.raises(ValueError, match="fail-link"):
        failing.get(timeout=TIMEOUT)
    errback = f"errback fail ValueError {failing.id}"
    wait_for(lambda: canvas.logged(errback), TIMEOUT, "the errback", canvas.worker)
    assert canvas.logged("errback") == [errback]
