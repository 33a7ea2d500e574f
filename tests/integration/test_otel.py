"""The lock's outcome on OpenTelemetry spans (tools/otel.py), with the real
opentelemetry-instrumentation-celery and the SDK's in-memory exporter.

On a real worker (prefork: the outcomes; threads: a skip the worker's main process ends), each
span copied to Redis by the worker's exporter (tests/support/otel_spans.py); in this process,
the event a call turned away at publish adds to the caller's span.
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery, chain
from opentelemetry.instrumentation.celery import CeleryInstrumentor
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
    InMemorySpanExporter,
)

from celery_singleton_lock import SingletonTask, skip_info
from celery_singleton_lock.core.connection import store_for
from celery_singleton_lock.tools import otel
from tests.support.basic_app import SINGLETON_APP, close_app
from tests.support.client_tasks import publish_client_app
from tests.support.mainskip import turn_hot
from tests.support.otel_spans import load_spans
from tests.support.waiting import wait_for
from tests.support.workers import REPO_ROOT, WorkerFactory, WorkerProcess

TRACED = {"SINGLETON_TEST_OTEL": "1", "SINGLETON_TEST_COMPLETION_TTL": "60"}


def _runs(client: redis.Redis, prefix: str, task_id: str) -> list[dict[str, Any]]:
    """The run spans the workers exported for ``task_id`` (one per delivery)."""
    return [
        span
        for span in load_spans(client, prefix)
        if span["name"].startswith("run/")
        and span["attributes"].get("messaging.message.id") == task_id
    ]


def _outcome_span(
    client: redis.Redis, prefix: str, task_id: str, outcome: str, *workers: WorkerProcess
) -> dict[str, Any]:
    def found() -> dict[str, Any] | None:
        for span in _runs(client, prefix, task_id):
            if span["attributes"].get(otel.OUTCOME) == outcome:
                return span
        return None

    return wait_for(found, 20, f"a span of {task_id} with outcome {outcome}", *workers)


def _held(client: redis.Redis, prefix: str, key: str) -> str | None:
    """The lock key held for a run with the argument ``key``, if one is."""
    for lock in client.scan_iter(match=f"{prefix}lock:*", count=1000):
        if client.type(lock) == b"hash" and key.encode() in (client.hget(lock, "args") or b""):
            return lock.decode()
    return None


@pytest.fixture
def caller_spans() -> Iterator[tuple[Any, InMemorySpanExporter]]:
    """A tracer of a provider of this test's own, exporting to memory; Celery instrumented with
    it for the test (a publish's span too), and uninstrumented after."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    instrumentor = CeleryInstrumentor()
    instrumentor.instrument(tracer_provider=provider)
    try:
        yield provider.get_tracer(__name__), exporter
    finally:
        instrumentor.uninstrument()
        provider.shutdown()


@pytest.mark.slow(seconds=10)
def test_each_outcome_on_the_run_span_of_a_prefork_worker(
    worker_factory: WorkerFactory,
    client_app: Celery,
    redis_client: redis.Redis,
    key_prefix: str,
    caller_spans: Any,
) -> None:
    """Holders and their duplicates under each policy, on one prefork worker: each run's span
    carries the key, the outcome and the fencing token (acquired) or the holder (not); a
    renewal that finds the lock gone adds ``lock_lost``; a dropped redelivery, which Celery
    opens no span for, gets one of its own in the message's trace."""
    worker = worker_factory.start(SINGLETON_APP, pool="prefork", concurrency=6, env=TRACED)
    worker.wait_ready(client_app)
    tag = uuid.uuid4().hex[:8]
    holders = {
        "skipped": ("t.hold", {"key": f"s-{tag}", "seconds": 4}),
        "retried": ("t.hold_retry", {"key": f"r-{tag}", "seconds": 2}),
        "raised": ("t.hold_raise", {"key": f"x-{tag}", "seconds": 4}),
        "coalesced": ("t.hold_coalesce", {"key": f"c-{tag}", "until": f"{key_prefix}go-{tag}"}),
        "joined": ("t.join", {"key": f"j-{tag}", "seconds": -1}),
    }
    started = {
        outcome: client_app.send_task(name, kwargs=kwargs)
        for outcome, (name, kwargs) in holders.items()
    }
    locks = {
        outcome: wait_for(
            lambda kwargs=kwargs: _held(redis_client, key_prefix, kwargs["key"]),
            20,
            f"the {outcome} holder's lock",
            worker,
        )
        for outcome, (_, kwargs) in holders.items()
    }
    duplicates = {
        outcome: client_app.send_task(name, kwargs={"key": kwargs["key"]})
        for outcome, (name, kwargs) in holders.items()
    }
    for outcome, duplicate in duplicates.items():
        span = _outcome_span(redis_client, key_prefix, duplicate.id, outcome, worker)
        assert span["attributes"][otel.KEY] == locks[outcome], outcome
        assert span["attributes"][otel.HOLDER] == started[outcome].id, outcome
        assert otel.FENCING_TOKEN not in span["attributes"], outcome
    assert skip_info(duplicates["skipped"].get(timeout=20)) is not None

    redis_client.rpush(f"{key_prefix}go-{tag}", 1)  # the coalescing and joined holders end
    redis_client.rpush(f"j-{tag}:go", 1)
    for outcome, holder in started.items():
        holder.get(timeout=30, propagate=False)
        span = _outcome_span(redis_client, key_prefix, holder.id, "acquired", worker)
        assert span["attributes"][otel.KEY] == locks[outcome]
        assert isinstance(span["attributes"][otel.FENCING_TOKEN], int)
        assert otel.HOLDER not in span["attributes"]
    retried = _outcome_span(redis_client, key_prefix, duplicates["retried"].id, "acquired", worker)
    assert retried["attributes"][otel.KEY] == locks["retried"]  # its later delivery took it

    # t.rate_alone: 3 starts a minute; the fourth call is over the rate (skipped)
    rated = [client_app.send_task("t.rate_alone", args=(f"o-{tag}",)) for _ in range(3)]
    for call in rated:
        call.get(timeout=20)
    over = client_app.send_task("t.rate_alone", args=(f"o-{tag}",))
    span = _outcome_span(redis_client, key_prefix, over.id, "rate_limited", worker)
    assert span["attributes"][otel.HOLDER] in {call.id for call in rated}
    assert span["attributes"][otel.KEY].endswith(":lock")

    lost = client_app.send_task("t.hold", kwargs={"key": f"l-{tag}", "seconds": 3})
    lock = wait_for(lambda: _held(redis_client, key_prefix, f"l-{tag}"), 20, "the lock", worker)
    redis_client.delete(lock)  # an operator's release: the next renewal finds it gone
    span = _outcome_span(redis_client, key_prefix, lost.id, "acquired", worker)
    events = [e for e in span["events"] if e["name"] == otel.LOCK_LOST]
    assert len(events) == 1, span
    assert events[0]["attributes"][otel.KEY] == lock
    assert events[0]["attributes"][otel.REASON] == "gone"
    assert events[0]["attributes"][otel.FENCING_TOKEN] == span["attributes"][otel.FENCING_TOKEN]

    done = client_app.send_task("t.hold", kwargs={"key": f"d-{tag}"})
    done.get(timeout=20)
    tracer, _ = caller_spans
    with tracer.start_as_current_span("redeliver") as caller:  # its publish carries the trace
        again = client_app.send_task("t.hold", kwargs={"key": f"d-{tag}"}, task_id=done.id)
    span = _outcome_span(redis_client, key_prefix, again.id, "redelivery_dropped", worker)
    first = _outcome_span(redis_client, key_prefix, done.id, "acquired", worker)
    assert span["attributes"][otel.KEY] == first["attributes"][otel.KEY]
    assert span["attributes"]["celery.task_name"] == "t.hold"
    assert (span["name"], span["kind"]) == ("run/t.hold", "CONSUMER")
    assert span["trace_id"] == f"{caller.get_span_context().trace_id:032x}"


def test_a_call_turned_away_at_publish_adds_an_event_to_the_callers_span(
    redis_url: str, key_prefix: str, caller_spans: Any
) -> None:
    """Two calls of a ``singleton_lock_on="publish"`` task under one caller span: the first is
    published (its publish span is the caller's child), the second is turned away with one
    event on the caller's span naming the first."""
    tracer, exporter = caller_spans
    app, task = publish_client_app(redis_url, key_prefix, singleton_publish_ttl=60)
    try:
        key = f"p-{uuid.uuid4().hex[:8]}"
        with tracer.start_as_current_span("caller"):
            first = task.apply_async(kwargs={"key": key})
            second = task.apply_async(kwargs={"key": key})
        assert second.id == first.id
    finally:
        app.control.purge()
        close_app(app)
    spans = {span.name: span for span in exporter.get_finished_spans()}
    caller = spans["caller"]
    events = [e for e in caller.events if e.name == otel.NOT_PUBLISHED]
    assert len(events) == 1, caller.events
    attributes = dict(events[0].attributes or {})
    assert attributes[otel.HOLDER] == first.id
    assert attributes[otel.STATE] == "queued"
    assert attributes[otel.TASK] == "t.publish_hold"
    assert attributes[otel.KEY].startswith(f"{key_prefix}lock:")
    assert spans["apply_async/t.publish_hold"].parent.span_id == caller.context.span_id


def test_a_skip_the_main_process_ends_has_its_own_span_there(
    worker_factory: WorkerFactory,
    client_app: Celery,
    redis_client: redis.Redis,
    key_prefix: str,
    caller_spans: Any,
) -> None:
    """Threads pool, the instrumentation on in the worker's one process: a duplicate the main
    process turns away (no pool) still fires ``task_prerun``/``task_postrun`` there, so it has
    a run span of its own, in the caller's trace, with the skip's attributes."""
    worker = worker_factory.start(SINGLETON_APP, pool="threads", concurrency=2, env=TRACED)
    worker.wait_ready(client_app)
    key = f"m-{uuid.uuid4().hex[:8]}"
    holder = client_app.send_task("t.hold", kwargs={"key": key, "seconds": 5})
    lock = wait_for(lambda: _held(redis_client, key_prefix, key), 20, "the lock", worker)
    tracer, _ = caller_spans
    with tracer.start_as_current_span("flood") as caller:
        sent = turn_hot(client_app, worker, "t.hold", {"key": key})
    span = _outcome_span(redis_client, key_prefix, sent[-1].id, "skipped", worker)
    assert span["attributes"][otel.KEY] == lock
    assert span["attributes"][otel.HOLDER] == holder.id
    assert span["trace_id"] == f"{caller.get_span_context().trace_id:032x}"


def _python(code: str) -> None:
    """Run ``code`` in a fresh interpreter (what the package connects at its import); its
    asserts must hold."""
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=False
    )
    assert run.returncode == 0, run.stderr


def test_without_opentelemetry_nothing_is_imported_or_connected() -> None:
    """The package imported where OpenTelemetry cannot be: the module of this integration not
    loaded, no receiver on any signal (a run's hot path sends ``lock_acquired`` only to
    receivers), nothing of OpenTelemetry loaded."""
    code = (
        "import sys; sys.modules['opentelemetry'] = None\n"
        "import celery_singleton_lock\n"
        "from celery_singleton_lock import signals\n"
        "assert 'celery_singleton_lock.tools.otel' not in sys.modules\n"
        "from celery_singleton_lock.tools import otel\n"
        "assert not otel._installed\n"
        "connected = [n for n in signals.__all__ if getattr(signals, n).receivers]\n"
        "assert not connected, connected\n"
        "loaded = [m for m in sys.modules if m.startswith('opentelemetry.')]\n"
        "assert not loaded, loaded\n"
        "assert otel.install() is False\n"
    )
    _python(code)


def test_with_the_api_alone_a_run_pays_nothing() -> None:
    """The OpenTelemetry API installed (many packages bring it) without the Celery
    instrumentation, which opens the run spans: no receiver on a run's signals, so a run sends
    none; the publish-time receiver only. (redis-py 8 imports OpenTelemetry's SDK itself
    where it is installed: what is imported is not checked here.)"""
    code = (
        "import sys; sys.modules['opentelemetry.instrumentation.celery'] = None\n"
        "import celery_singleton_lock\n"
        "from celery_singleton_lock import signals\n"
        "from celery_singleton_lock.tools import otel\n"
        "assert otel._installed\n"
        "connected = [n for n in signals.__all__ if getattr(signals, n).receivers]\n"
        "assert connected == ['duplicate_not_published'], connected\n"
    )
    _python(code)


def test_eager_chain_each_step_on_its_span(
    redis_url: str, key_prefix: str, caller_spans: Any
) -> None:
    """An eager chain under a caller span, its middle step's lock held by another run: each
    step's span (Celery's tracer, in this process) says acquired with a token, or skipped
    with the holder, all in the caller's trace."""
    tracer, exporter = caller_spans
    app = Celery("otel-eager", broker="memory://", set_as_current=False)
    app.conf.update(
        task_always_eager=True,
        singleton_redis_url=redis_url,
        singleton_key_prefix=f"{key_prefix}lock:",
    )

    @app.task(bind=True, base=SingletonTask, name="o.hold", shared=False)
    def hold(self: Any, key: str) -> int:
        return int(self.singleton.fencing_token)

    keys = hold.singleton_keys(("busy",), {})
    store_for(redis_url).acquire(keys, "other-run", 0, 10_000)
    try:
        with tracer.start_as_current_span("caller") as caller:
            last = chain(hold.si("a"), hold.si("busy"), hold.si("c")).apply_async()
    finally:
        app.close()
    steps = [last.parent.parent.id, last.parent.id, last.id]
    runs = {
        span.attributes.get("messaging.message.id"): span
        for span in exporter.get_finished_spans()
        if span.name == "run/o.hold"
    }
    outcomes = [runs[step].attributes[otel.OUTCOME] for step in steps]
    assert outcomes == ["acquired", "skipped", "acquired"]
    assert runs[steps[1]].attributes[otel.HOLDER] == "other-run"
    assert runs[steps[1]].attributes[otel.KEY] == keys.lock
    assert isinstance(runs[steps[2]].attributes[otel.FENCING_TOKEN], int)
    trace_id = caller.get_span_context().trace_id
    assert {runs[step].context.trace_id for step in steps} == {trace_id}
