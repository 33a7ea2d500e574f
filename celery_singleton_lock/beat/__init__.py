"""Beat's wing: the scheduler, its schedules, run claims and the workers' witness.

``celery_singleton_lock.beat:SingletonScheduler`` is the public path (``celery beat -S``, the
``singleton`` entry point); ``SingletonDatabaseScheduler`` is django-celery-beat's database
scheduler behind the same claims (the ``singleton-django`` entry point). The schedulers, which
import ``celery.beat`` (and Django), are loaded only when asked for: workers load this package
for the witness and the claims alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .django_beat import SingletonDatabaseScheduler
    from .scheduler import SingletonScheduler, SingletonSchedulerMixin

__all__ = ["SingletonDatabaseScheduler", "SingletonScheduler", "SingletonSchedulerMixin"]


def __getattr__(name: str) -> Any:
    if name == "SingletonDatabaseScheduler":
        from . import django_beat

        return django_beat.SingletonDatabaseScheduler
    if name in __all__:
        from . import scheduler

        return getattr(scheduler, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
