"""SingletonTask, assembled from the wings below it (``singleton_task.py``), and how a worker
runs its message: the lock taken in front of Celery's tracer (``tracer.py``).

``from celery_singleton_lock.task import SingletonTask`` keeps working."""

from __future__ import annotations

from .singleton_task import SingletonTask

__all__ = ["SingletonTask"]
