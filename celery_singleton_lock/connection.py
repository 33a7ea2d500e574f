"""Redis clients, lock stores and renewers, one of each per URL and process.

redis-py's connection pools reset themselves after a fork; the renewer's thread does not
survive one, so :func:`renewer_for` hands out a renewer whose thread is (re)started in
the calling process. Knows nothing of Celery.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

import redis

from .config import redact_url
from .lock import LockStore
from .renewer import Renewer

__all__ = ["client_for", "renewer_for", "reset", "store_for"]

logger = logging.getLogger("celery_singleton_lock.connection")

#: Seconds a Redis call may take before it counts as an error. Small enough that a
#: renewal stalled on a dead server is retried well inside a ttl.
SOCKET_TIMEOUT_S = 5.0

_mutex = threading.Lock()
_stores: dict[tuple[int, str], LockStore] = {}
_renewers: dict[tuple[int, str], Renewer] = {}


def client_for(url: str) -> redis.Redis:
    """A new client for ``url`` with bounded timeouts."""
    try:
        return redis.Redis.from_url(
            url,
            socket_timeout=SOCKET_TIMEOUT_S,
            socket_connect_timeout=SOCKET_TIMEOUT_S,
            health_check_interval=30,
        )
    except ValueError as exc:  # never echo the URL: it may carry a password
        raise ValueError(f"bad Redis URL {redact_url(url)}: {exc}") from None


def store_for(url: str) -> LockStore:
    """The lock store for ``url`` in this process."""
    key = (os.getpid(), url)
    store = _stores.get(key)
    if store is None:
        with _mutex:
            store = _stores.get(key)
            if store is None:
                store = _stores[key] = LockStore(client_for(url))
    return store


def renewer_for(url: str, configure: Callable[[Renewer], None]) -> Renewer:
    """This process's renewer for ``url``, its thread running; ``configure`` runs once."""
    key = (os.getpid(), url)
    renewer = _renewers.get(key)
    if renewer is None:
        store = store_for(url)
        with _mutex:
            renewer = _renewers.get(key)
            if renewer is None:
                renewer = Renewer(store)
                configure(renewer)
                _renewers[key] = renewer
    renewer.ensure_started()
    return renewer


def reset() -> None:
    """Stop this process's renewers and forget every client (tests, shutdown)."""
    with _mutex:
        renewers = list(_renewers.values())
        _renewers.clear()
        _stores.clear()
    for renewer in renewers:
        renewer.stop()
