"""The documented import path of the pytest plugin (docs/testing.md), and its ``pytest11``
entry point: ``isolated_locks``, ``held_locks`` and the fixtures ``singleton_locks`` and
``singleton_celery_app``. They live in ``tools/testing.py``."""

from __future__ import annotations

from .tools.testing import held_locks, isolated_locks, singleton_celery_app, singleton_locks

__all__ = ["held_locks", "isolated_locks", "singleton_celery_app", "singleton_locks"]
