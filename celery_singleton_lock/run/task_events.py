"""Task events (what Flower and ``celery events`` read) that the library sends on a call's
behalf, for a call whose own worker sends none: a joined duplicate. Celery's worker sends a
task's events from its main process, which sees a joined duplicate end as an ``Ignore``
(``task-joined`` is sent instead, from the process that joined it), and never sees it complete
(``task-succeeded``, ``task-failed`` or ``task-revoked`` are sent by the run that completes it).

Whether the worker sends task events (``-E``, ``worker_send_task_events``, or turned on later
by ``celery control enable_events``, as Flower does) is known to its main process only: it
writes it into each request it hands to the pool (:data:`TASK_EVENTS_FIELD`, by
worker/hooks.py ``SingletonRequest``), so that a pool child, even a spawned one, reads it from
the request it runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .log import logger

__all__ = [
    "TASK_EVENTS_FIELD",
    "EventSink",
    "Events",
    "run_sink",
    "sends_task_events",
]

#: Request field: whether the worker that runs the request sends task events.
TASK_EVENTS_FIELD = "singleton_task_events"

#: Events to send: (type, task id, fields).
Events = Sequence[tuple[str, str, dict[str, Any]]]

#: Sends events, or None when the worker sends none.
EventSink = Callable[[Events], None]


def sends_task_events(eventer: Any, task: Any) -> bool:
    """Whether ``eventer`` (a worker's event dispatcher) sends ``task``'s events now."""
    return bool(
        eventer is not None
        and eventer.enabled
        and getattr(task, "send_events", True)
        and (not eventer.groups or "task" in eventer.groups)
    )


def run_sink(task: Any, request: Any = None) -> EventSink | None:
    """A sink for events about a run of ``task``: its ``request`` (the current one by default;
    a worker's main process gives the request it reports on, or its ``request_dict``). None if
    the worker that ran it sends no task events, or the run is eager."""
    request = task.request if request is None else request
    if not request.get(TASK_EVENTS_FIELD) or not getattr(task, "send_events", True):
        return None
    hostname = request.get("hostname")

    def send(events: Events) -> None:
        try:
            with task.app.events.default_dispatcher(hostname=hostname) as dispatcher:
                for type_, task_id, fields in events:
                    dispatcher.send(type_, uuid=task_id, **fields)
        except Exception as exc:  # a monitor's event never stops a completion
            _not_sent(events, exc)

    return send


def _not_sent(events: Events, exc: BaseException) -> None:
    logger.warning(
        "singleton: could not send task events: %s: %s",
        ", ".join(f"{type_}[{task_id}]" for type_, task_id, _ in events),
        exc,
    )
