"""The documented import path of the Prometheus metrics (docs/operations.md)::

    from celery_singleton_lock import metrics

    metrics.install()
    metrics.serve(9808)

They live in ``tools/metrics.py``."""

from __future__ import annotations

from .tools.metrics import EVENTS, HOLD_BUCKETS, WAIT_BUCKETS, LockMetrics, install, serve

__all__ = ["EVENTS", "HOLD_BUCKETS", "WAIT_BUCKETS", "LockMetrics", "install", "serve"]
