"""OpenTelemetry in a test worker: the real Celery instrumentation, the SDK's in-memory
exporter, and each finished span copied to a Redis list the test reads.

A worker process keeps its spans in its own memory; the test is another process. So the
exporter is the SDK's :class:`InMemorySpanExporter` that also pushes each span it is given, as
JSON, to a list under the test's key prefix (:func:`spans_key`). The span processor is the
SDK's synchronous one: a span is in Redis when it ends, and nothing runs in a thread (the
prefork pool forks after :func:`start`, and its children inherit all of it).

``tests/support/singleton_app.py`` calls :func:`start` at import when
``SINGLETON_TEST_OTEL=1`` is in its environment.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import redis
from opentelemetry import trace
from opentelemetry.instrumentation.celery import CeleryInstrumentor
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

__test__ = False

SPANS_SUFFIX = "otel-spans"


def spans_key(prefix: str) -> str:
    """The list a worker of the test with key prefix ``prefix`` pushes its spans to."""
    return f"{prefix}{SPANS_SUFFIX}"


def as_dict(span: ReadableSpan) -> dict[str, Any]:
    """What the tests read of a span: name, kind, attributes, events, trace and parent ids."""
    context = span.get_span_context()
    return {
        "name": span.name,
        "kind": span.kind.name,
        "attributes": dict(span.attributes or {}),
        "events": [{"name": e.name, "attributes": dict(e.attributes or {})} for e in span.events],
        "trace_id": f"{context.trace_id:032x}" if context else None,
        "parent_id": f"{span.parent.span_id:016x}" if span.parent else None,
    }


class RedisCopyExporter(InMemorySpanExporter):
    """The in-memory exporter, each span also pushed to a Redis list."""

    def __init__(self, client: redis.Redis, key: str) -> None:
        super().__init__()
        self._client = client
        self._key = key

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        result = super().export(spans)
        if spans:
            self._client.rpush(self._key, *(json.dumps(as_dict(s)) for s in spans))
        return result


def start(redis_url: str, prefix: str) -> InMemorySpanExporter:
    """Trace this process: a global tracer provider exporting to Redis, Celery instrumented."""
    exporter = RedisCopyExporter(redis.Redis.from_url(redis_url), spans_key(prefix))
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    CeleryInstrumentor().instrument(tracer_provider=provider)
    return exporter


def load_spans(client: redis.Redis, prefix: str) -> list[dict[str, Any]]:
    """Every span the test's workers exported so far."""
    return [json.loads(raw) for raw in client.lrange(spans_key(prefix), 0, -1)]
