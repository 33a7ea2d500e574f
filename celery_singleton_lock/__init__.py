"""Run each Celery job once: a renewed, fenced Redis lock taken on the worker.

::

    from celery_singleton_lock import SingletonTask

    @app.task(bind=True, base=SingletonTask, singleton_ttl=30)
    def sync_account(self, account_id):
        token = self.singleton.fencing_token
"""

from __future__ import annotations

from . import hidden_settings as _hidden_settings
from . import signals
from . import worker as _worker  # connects the worker-side hooks
from .beat import SingletonScheduler, SingletonSchedulerMixin
from .errors import (
    DuplicateTaskError,
    LockUnavailableError,
    SingletonConfigError,
    SingletonError,
    SingletonKeyError,
)
from .fencing import FencedWrite, fenced_get, fenced_set
from .task import LockHandle, SingletonTask, SkipInfo, skip_info
from .worker import SingletonRequest

__all__ = [
    "DuplicateTaskError",
    "FencedWrite",
    "LockHandle",
    "LockUnavailableError",
    "SingletonConfigError",
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

del _hidden_settings, _worker
