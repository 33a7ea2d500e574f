"""Run each Celery job once: a renewed, fenced Redis lock taken on the worker.

::

    from celery_singleton_lock import SingletonTask

    @app.task(bind=True, base=SingletonTask, singleton_ttl=30)
    def sync_account(self, account_id):
        token = self.singleton.fencing_token
"""

from __future__ import annotations

from importlib.util import find_spec as _find_spec
from typing import TYPE_CHECKING, Any

from . import signals
from .core.fencing import FencedWrite, fenced_get, fenced_set
from .duplicates.skips import SkipInfo, skip_info
from .errors import (
    DuplicateTaskError,
    LockUnavailableError,
    RateLimitedError,
    SingletonConfigError,
    SingletonError,
    SingletonKeyError,
)
from .settings import masking as _hidden_settings
from .task.singleton_task import LockHandle, SingletonTask
from .worker import hooks as _worker  # connects the worker-side hooks
from .worker.hooks import SingletonRequest

if TYPE_CHECKING:
    from .beat.django_beat import SingletonDatabaseScheduler
    from .beat.scheduler import SingletonScheduler, SingletonSchedulerMixin

__all__ = [
    "DuplicateTaskError",
    "FencedWrite",
    "LockHandle",
    "LockUnavailableError",
    "RateLimitedError",
    "SingletonConfigError",
    "SingletonDatabaseScheduler",
    "SingletonError",
    "SingletonKeyError",
    "SingletonRequest",
    "SingletonScheduler",
    "SingletonSchedulerMixin",
    "SingletonTask",
    "SkipInfo",
    "fenced_get",
    "fenced_set",
    "signals",
    "skip_info",
]

_hidden_settings.install()  # `celery report`, `celery inspect conf`: the lock URL's password
if _find_spec("opentelemetry") is not None:  # not installed: nothing more imported (tools/otel.py)
    from .tools import otel as _otel

    _otel.install()  # the lock's outcome on OpenTelemetry spans
    del _otel

del _find_spec, _hidden_settings, _worker

_LAZY = frozenset({"SingletonDatabaseScheduler", "SingletonScheduler", "SingletonSchedulerMixin"})


def __getattr__(name: str) -> Any:
    """The schedulers are loaded when asked for: a worker need not import ``celery.beat``, nor
    anything import Django unless it asks for ``SingletonDatabaseScheduler``."""
    if name in _LAZY:
        from . import beat

        return getattr(beat, name)  # beat's own __getattr__ loads the scheduler
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
