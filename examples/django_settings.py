"""Django-style settings: every Celery setting, the lock's too, under the ``CELERY_`` namespace.

In a Django project these lines live in ``settings.py`` and ``proj/celery.py`` does::

    app = Celery("proj")
    app.config_from_object("django.conf:settings", namespace="CELERY")
    app.autodiscover_tasks()

Celery maps ``CELERY_SINGLETON_TTL`` onto ``singleton_ttl`` and so on (see
docs/configuration.md). :mod:`examples.django_celery` is that ``proj/celery.py``, reading this
module instead of ``django.conf:settings`` so the example runs without Django installed.
The URLs come from the environment here only so the test can point them at a private Redis.
"""

from __future__ import annotations

import os

_REDIS = os.environ.get("EXAMPLE_REDIS_URL", "redis://localhost:6379/0")
_PREFIX = os.environ.get("EXAMPLE_PREFIX", "proj:")

CELERY_BROKER_URL = _REDIS
CELERY_RESULT_BACKEND = _REDIS
CELERY_BROKER_TRANSPORT_OPTIONS = {"global_keyprefix": _PREFIX}
CELERY_RESULT_BACKEND_TRANSPORT_OPTIONS = {"global_keyprefix": _PREFIX}
CELERY_TASK_DEFAULT_QUEUE = f"{_PREFIX}celery"
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True

# the lock: read by SingletonTask as singleton_<name>
CELERY_SINGLETON_KEY_PREFIX = f"{_PREFIX}lock:"
CELERY_SINGLETON_TTL = 20
CELERY_SINGLETON_ON_DUPLICATE = "skip"
# the locks could live on another Redis than the broker:
# CELERY_SINGLETON_REDIS_URL = "redis://locks.internal:6379/0"
