"""The broker as Celery resolves it: the defaults the library derives from it.

Celery's settings object resolves the broker itself (``Settings.broker_url``): the
``CELERY_BROKER_URL`` environment variable first, then the ``broker_url`` setting (given as
``Celery(broker=...)``, by ``config_from_object``, or as ``CELERY_BROKER_URL`` of a settings
module read with ``namespace="CELERY"``), then the old ``broker_host``. The raw
``conf.get("broker_url")`` misses the environment, so a conf with a ``broker_url`` attribute
(Celery's) is read through it; any other mapping through ``get``.

A failover list (a Python list of URLs, or URLs joined by ``;``) is tried by kombu in its order;
the first URL is the broker the library follows: its Redis holds the locks when no
``singleton_redis_url`` is set, and its transport's ``visibility_timeout`` gives the default
``singleton_completion_ttl``.

Knows nothing of Celery's classes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Protocol

__all__ = ["ConfLike", "broker_url", "redis_broker_url", "visibility_timeout"]

#: kombu's default visibility timeouts, by transport
_VISIBILITY_DEFAULTS = {"redis": 3600.0, "rediss": 3600.0, "sentinel": 3600.0, "sqs": 1800.0}
#: the broker schemes whose URL is also a lock URL
_REDIS_SCHEMES = ("redis", "rediss")


class ConfLike(Protocol):
    def get(self, key: str, default: Any = None) -> Any: ...


def broker_url(conf: ConfLike) -> str | None:
    """The first URL of the broker as Celery resolves it, or None when no broker is set."""
    value = getattr(conf, "broker_url", None)
    if value is None:
        value = conf.get("broker_url")
    if isinstance(value, str):
        value = value.split(";", 1)[0]
    elif isinstance(value, list | tuple):  # kombu's failover list: any non-str iterable
        value = value[0] if value else None
    if not isinstance(value, str) or not value.strip():
        return None
    return value.strip()


def _scheme(url: str | None) -> str:
    return url.split("://", 1)[0].lower() if url and "://" in url else ""


def redis_broker_url(conf: ConfLike) -> str | None:
    """The broker's first URL when it is ``redis://`` or ``rediss://``, else None."""
    url = broker_url(conf)
    return url if _scheme(url) in _REDIS_SCHEMES else None


def visibility_timeout(conf: ConfLike) -> float | None:
    """The broker's visibility timeout (Redis, SQS), or None for a broker without one (or with
    an infinite one: nothing comes back)."""
    scheme = _scheme(broker_url(conf)).split("+", 1)[0]
    if scheme not in _VISIBILITY_DEFAULTS:
        return None
    options = conf.get("broker_transport_options") or {}
    value = options.get("visibility_timeout") if isinstance(options, Mapping) else None
    if isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
        return float(value) if math.isfinite(value) else None
    return _VISIBILITY_DEFAULTS[scheme]
