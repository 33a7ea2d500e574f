"""Prometheus metrics of the lock events (``pip install 'celery-singleton-lock[prometheus]'``).

::

    from celery_singleton_lock import metrics

    metrics.install()            # count events into prometheus_client's default registry
    metrics.serve(9808)          # and serve them over HTTP from this process

Four metrics, all labelled by task name:

- ``singleton_lock_events_total{event, task}``: one count per library signal; ``event`` is
  the signal's name without ``lock_`` (acquired, released, lost, max_hold, renewed_late,
  force_released, unavailable, duplicate_skipped, duplicate_retried, duplicate_raised,
  duplicate_not_published, redelivery_dropped, rate_limited);
- ``singleton_locks_held{task}``: locks held by runs of this process right now (a lock
  counts from ``lock_acquired`` until it is released or lost, or its run ends);
- ``singleton_lock_hold_seconds{task}`` (histogram): how long each of those holds lasted;
- ``singleton_duplicate_wait_seconds{task}`` (histogram): for a run that took its lock after
  waiting in the queue as a duplicate (policy ``"retry"``, a redelivery, a chain step waiting
  for its parent), the time from its first requeue to that acquire (``lock_acquired``'s
  ``waited``; wall clocks of the two workers).

examples/grafana-dashboard.json charts them.

Under the prefork pool every child counts its own events: set ``PROMETHEUS_MULTIPROC_DIR``
and serve from the main process (:func:`serve` does so when the variable is set); see
docs/operations.md.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from celery import signals as celery_signals
from celery.utils.dispatch import Signal
from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    start_http_server,
)
from prometheus_client import multiprocess as _multiprocess

from .. import signals

__all__ = ["EVENTS", "LockMetrics", "install", "serve"]

#: ``event`` label of each library signal.
EVENTS: dict[str, str] = {name: name.removeprefix("lock_") for name in sorted(signals.__all__)}

_ENDS_HOLD = frozenset({"released", "lost", "max_hold", "force_released"})

#: Buckets (seconds) of the hold histogram: from a short job's run to an hour-long one.
HOLD_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)
#: Buckets (seconds) of the wait histogram: one retry countdown (5 s by default) and up.
WAIT_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600, 1800, 3600)


class LockMetrics:
    """The counter, the gauge and the histograms in one registry, fed by the library's signals."""

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.registry = registry
        self.events = Counter(
            "singleton_lock_events",
            "Lock events of celery_singleton_lock, by event and task.",
            ["event", "task"],
            registry=registry,
        )
        self.held = Gauge(
            "singleton_locks_held",
            "Locks held by running tasks of this process (summed over live processes).",
            ["task"],
            registry=registry,
            multiprocess_mode="livesum",
        )
        self.hold_seconds = Histogram(
            "singleton_lock_hold_seconds",
            "How long runs held their lock: from the acquire to the release, the loss, or the "
            "run's end.",
            ["task"],
            registry=registry,
            buckets=HOLD_BUCKETS,
        )
        self.wait_seconds = Histogram(
            "singleton_duplicate_wait_seconds",
            "How long a requeued duplicate waited: from its first requeue to the run that took "
            "the lock.",
            ["task"],
            registry=registry,
            buckets=WAIT_BUCKETS,
        )
        self._mutex = threading.Lock()
        # task id -> (key, task label, time.monotonic() of the acquire)
        self._holding: dict[str, tuple[str, str, float]] = {}
        self._receivers: list[tuple[Signal, Any]] = []
        for name, event in EVENTS.items():
            self._connect(getattr(signals, name), self._receiver(event))
        self._connect(celery_signals.task_postrun, self._run_ended)

    def _connect(self, signal: Signal, receiver: Any) -> None:
        signal.connect(receiver, weak=False)
        self._receivers.append((signal, receiver))

    def _receiver(self, event: str) -> Any:
        def receive(sender: Any = None, **kwargs: Any) -> None:
            self.count(event, sender, kwargs)

        return receive

    def count(self, event: str, sender: Any, data: dict[str, Any]) -> None:
        """Count one event (the signal receivers call this)."""
        task = _task_label(sender, data)
        self.events.labels(event=event, task=task).inc()
        task_id, key = data.get("task_id"), data.get("key")
        waited = data.get("waited")
        if event == "acquired" and isinstance(waited, (int, float)):
            self.wait_seconds.labels(task=task).observe(waited)
        if not isinstance(task_id, str) or not isinstance(key, str):
            return
        with self._mutex:
            if event == "acquired" and task_id not in self._holding:
                self._holding[task_id] = (key, task, time.monotonic())
                self.held.labels(task=task).inc()
            elif event in _ENDS_HOLD and self._holding.get(task_id, ("",))[0] == key:
                self._drop(task_id)

    def _drop(self, task_id: str) -> None:
        _key, task, since = self._holding.pop(task_id)
        self.held.labels(task=task).dec()
        self.hold_seconds.labels(task=task).observe(time.monotonic() - since)

    def _run_ended(self, task_id: str | None = None, **_: Any) -> None:
        with self._mutex:
            if task_id in self._holding:
                self._drop(task_id)

    def close(self) -> None:
        """Stop counting: disconnect from the signals (the metrics stay registered)."""
        for signal, receiver in self._receivers:
            signal.disconnect(receiver)
        self._receivers.clear()


def _task_label(sender: Any, data: dict[str, Any]) -> str:
    name = getattr(sender, "name", None) or data.get("task")
    return name if isinstance(name, str) else ""


_installed: dict[int, LockMetrics] = {}
_install_mutex = threading.Lock()


def install(registry: CollectorRegistry = REGISTRY) -> LockMetrics:
    """Count the lock events into ``registry`` (once per registry; later calls return it)."""
    with _install_mutex:
        found = _installed.get(id(registry))
        if found is None or found.registry is not registry:
            found = _installed[id(registry)] = LockMetrics(registry)
        return found


def serve(port: int, addr: str = "0.0.0.0") -> None:
    """Install the metrics and serve them over HTTP from this process (a daemon thread).

    With ``PROMETHEUS_MULTIPROC_DIR`` set, the endpoint aggregates the values every process
    wrote there (prometheus_client's multiprocess mode): call it once, in the worker's main
    process, and every prefork child's events are in it.
    """
    install()
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        _multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
        start_http_server(port, addr, registry)
    else:
        start_http_server(port, addr)
