"""OpenTelemetry: what the lock did, on the run's span (``pip install
'celery-singleton-lock[otel]'``).

opentelemetry-instrumentation-celery opens a span for each run in ``task_prerun``, makes it
current, and ends it in ``task_postrun``; it has no hooks. The lock is taken before
``task_prerun`` (task/tracer.py), so the outcome is put on the span by the library's own
signals, each sent where the run's span is current (``before_start``, or between the
``task_prerun`` and ``task_postrun`` a skip sends: task/tracer.py :func:`end_skip`):

- ``celery_singleton.key``: the lock key;
- ``celery_singleton.outcome``: :data:`OUTCOMES`' value for the signal;
- ``celery_singleton.fencing_token`` when acquired, ``celery_singleton.holder`` (the holder's
  task id) when not;
- an event ``celery_singleton.lock_lost`` when a renewal finds the lock gone or taken (sent
  from the renewer's thread: the span is the one current when the lock was acquired);
- in a process that publishes, an event ``celery_singleton.duplicate_not_published`` on the
  caller's current span when a call is turned away at publish (``singleton_lock_on``
  ``"publish"``).

A signal about another run than the current one (a coalesced follow-up superseded while the
holder releases) changes nothing. A delivery dropped in front of Celery's tracer (its message
already completed) fires no ``task_prerun``: the instrumentation opens no span, so one is
opened here, named as the instrumentation names a run's (``run/<task name>``), and ended at
once.

Nothing is connected, and nothing imported, unless the ``opentelemetry`` API is installed
(:func:`install`, at the package's import), and a run's receivers only with the Celery
instrumentation installed as well; OpenTelemetry itself is imported at the first signal.
Without a span being recorded, a receiver reads the current span and returns.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any
from weakref import WeakValueDictionary

from .. import signals

__all__ = [
    "FENCING_TOKEN",
    "HOLDER",
    "KEY",
    "LOCK_LOST",
    "NOT_PUBLISHED",
    "OUTCOME",
    "OUTCOMES",
    "install",
]

KEY = "celery_singleton.key"
OUTCOME = "celery_singleton.outcome"
FENCING_TOKEN = "celery_singleton.fencing_token"
HOLDER = "celery_singleton.holder"
#: the event a lost lock adds to the run's span (with KEY, FENCING_TOKEN and REASON)
LOCK_LOST = "celery_singleton.lock_lost"
#: the event a call turned away at publish adds to the caller's span (with KEY, HOLDER,
#: STATE, TASK and TASK_ID)
NOT_PUBLISHED = "celery_singleton.duplicate_not_published"
REASON = "celery_singleton.reason"
STATE = "celery_singleton.state"
TASK = "celery_singleton.task"
TASK_ID = "celery_singleton.task_id"

#: ``celery_singleton.outcome`` of the run each library signal is about: one line per outcome.
OUTCOMES: dict[str, str] = {
    "lock_acquired": "acquired",
    "duplicate_skipped": "skipped",  # "coalesced" when the skip names its follow-up
    "duplicate_retried": "retried",
    "duplicate_raised": "raised",
    "duplicate_joined": "joined",
    "duplicate_queued": "queued",
    "queue_full": "queue_full",
    "stop_asked": "stop_asked",
    "rate_limited": "rate_limited",
    "redelivery_dropped": "redelivery_dropped",
}
_COALESCED = "coalesced"
#: the package that opens a span for each run (found, not imported, by :func:`install`)
INSTRUMENTATION = "opentelemetry.instrumentation.celery"
_OWN_SPAN = frozenset({"redelivery_dropped"})

#: the span of each run holding a lock in this process, by task id: where ``lock_lost`` (from
#: the renewer's thread, where no span is current) adds its event. Gone with the span.
_spans: WeakValueDictionary[str, Any] = WeakValueDictionary()
_installed: list[bool] = []


def install() -> bool:
    """Connect the receivers, once, if the OpenTelemetry API is installed; True if they are.

    A run's receivers only where opentelemetry-instrumentation-celery is installed too: it
    opens the run spans they write on. The API alone comes with many packages, and a receiver
    costs each run Celery's signal dispatch even when no span is recorded. The publish-time
    receiver (off the run's path) writes on whatever span the caller has."""
    if _installed:
        return True
    if importlib.util.find_spec("opentelemetry") is None:
        return False
    if importlib.util.find_spec("opentelemetry.trace") is None:
        return False
    if importlib.util.find_spec(INSTRUMENTATION) is not None:
        for name, outcome in OUTCOMES.items():
            getattr(signals, name).connect(_outcome_receiver(outcome), weak=False)
        signals.lock_lost.connect(_lock_lost, weak=False)
    signals.duplicate_not_published.connect(_not_published, weak=False)
    _installed.append(True)
    return True


def _outcome_receiver(outcome: str) -> Callable[..., None]:
    own_span = outcome in _OWN_SPAN

    def receive(sender: Any = None, key: str = "", task_id: str = "", **kwargs: Any) -> None:
        span = _run_span(sender, task_id)
        if span is None and not own_span:
            return
        attributes: dict[str, Any] = {KEY: key, OUTCOME: outcome}
        token = kwargs.get("token")
        if token is not None:  # acquired
            attributes[FENCING_TOKEN] = token
        holder = kwargs.get("holder")
        if holder is not None:
            attributes[HOLDER] = holder
            if kwargs.get("follow_up") is not None:
                attributes[OUTCOME] = _COALESCED
        if span is None:
            _own_span(sender, task_id, attributes)
            return
        span.set_attributes(attributes)
        if token is not None:
            _spans[task_id] = span

    return receive


def _run_span(sender: Any, task_id: str) -> Any:
    """The recording span current in this thread, if the signal is about the run current in
    it (the sender's request); else None."""
    from opentelemetry import trace

    span = trace.get_current_span()
    if not span.is_recording():
        return None
    if getattr(getattr(sender, "request", None), "id", None) != task_id:
        return None
    return span


def _own_span(sender: Any, task_id: str, attributes: dict[str, Any]) -> None:
    """A span of its own for a run the instrumentation opened none for, parented by the
    message's trace context, ended at once; named, and its task named, as the
    instrumentation's."""
    from opentelemetry import propagate, trace

    request = getattr(sender, "request", None)
    headers = getattr(request, "headers", None) or {}
    carrier = {k: v for k, v in headers.items() if isinstance(v, str)}
    for name in ("traceparent", "tracestate"):  # protocol 2 puts custom headers on the request
        value = getattr(request, name, None)
        if isinstance(value, str):
            carrier.setdefault(name, value)
    name = getattr(sender, "name", "?")
    tracer = trace.get_tracer(__name__)
    span = tracer.start_span(
        f"run/{name}",
        context=propagate.extract(carrier),
        kind=trace.SpanKind.CONSUMER,
        attributes={"celery.task_name": name, "messaging.message.id": task_id, **attributes},
    )
    span.end()


def _lock_lost(
    sender: Any = None, key: str = "", task_id: str = "", token: Any = None, **kwargs: Any
) -> None:
    span = _spans.get(task_id)
    if span is None or not span.is_recording():
        return
    attributes = {KEY: key, REASON: str(kwargs.get("reason"))}
    if token is not None:
        attributes[FENCING_TOKEN] = token
    span.add_event(LOCK_LOST, attributes)


def _not_published(sender: Any = None, key: str = "", task_id: str = "", **kwargs: Any) -> None:
    from opentelemetry import trace

    span = trace.get_current_span()
    if not span.is_recording():
        return
    span.add_event(
        NOT_PUBLISHED,
        {
            KEY: key,
            HOLDER: str(kwargs.get("holder")),
            STATE: str(kwargs.get("state")),
            TASK: str(getattr(sender, "name", sender)),
            TASK_ID: task_id,
        },
    )
