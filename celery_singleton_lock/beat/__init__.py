"""Beat's wing: the scheduler, its schedules, run claims and the workers' witness.

``celery_singleton_lock.beat:SingletonScheduler`` is the public path (``celery beat -S``, the
``singleton`` entry point). The scheduler, which imports ``celery.beat``, is loaded only when
asked for: workers load this package for the witness and the claims alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .scheduler import SingletonScheduler, SingletonSchedulerMixin

__all__ = ["SingletonScheduler", "SingletonSchedulerMixin"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import scheduler

        return getattr(scheduler, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
