"""Redis clients, lock stores and renewers, one of each per URL and process.

:func:`client_for` is the one place a client is built from a lock store URL (see
:func:`celery_singleton_lock.core.urls.parse_lock_url` for the syntax):

- ``redis://``, ``rediss://``, ``unix://``: ``redis.Redis.from_url``, so every redis-py URL
  option (``ssl_cert_reqs``, ``ssl_ca_certs``, ``ssl_certfile``, ``ssl_keyfile``, ...) works;
- ``redis+sentinel://`` and ``rediss+sentinel://``: a ``redis.Redis`` for the current master of
  a service, from ``redis.sentinel.Sentinel(...).master_for(...)``; it asks the sentinels again
  whenever it reconnects, so it follows a failover;
- ``redis+cluster://`` and ``rediss+cluster://``: a ``redis.cluster.RedisCluster``;
- ``redis+redlock://`` and ``rediss+redlock://``: no single client; :func:`redlock_clients`
  builds one ``redis.Redis`` per master (retries off) and :func:`store_for` a
  :class:`~celery_singleton_lock.core.redlock.RedlockStore` over them.

redis-py's connection pools reset themselves after a fork; the renewer's thread does not
survive one, so :func:`renewer_for` hands out a renewer whose thread is (re)started in
the calling process. Knows nothing of Celery.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import RedisClusterException
from redis.retry import Retry
from redis.sentinel import Sentinel

from ._fanout import DEFAULT_MASTER_TIMEOUT_S
from ._pid import current_pid
from .backend import FENCE_MARGIN_MS, Client, LockBackend
from .cluster import ClusterStore
from .redlock import RedlockStore
from .renewer import Renewer
from .sendahead import SendAhead
from .store import LockStore
from .urls import LockUrl, parse_lock_url, redact_url

__all__ = [
    "client_for",
    "flush_releases",
    "lock_url",
    "master_timeout",
    "new_store",
    "prober_for",
    "redlock_clients",
    "renewer_for",
    "reset",
    "store_for",
]

logger = logging.getLogger(__name__)

#: Seconds a Redis call may take before it counts as an error. Small enough that a
#: renewal stalled on a dead server is retried well inside a ttl.
SOCKET_TIMEOUT_S = 5.0
#: Connection keywords every client gets unless its URL sets them.
DEFAULTS: dict[str, Any] = {
    "socket_timeout": SOCKET_TIMEOUT_S,
    "socket_connect_timeout": SOCKET_TIMEOUT_S,
    "health_check_interval": 30,
}

#: Seconds a probe may take, connecting included, before it counts as an error
#: (:func:`probe_client_for`): the worker's main process waits for it in its event loop.
PROBE_TIMEOUT_S = 0.1

_mutex = threading.Lock()
_stores: dict[tuple[int, str], LockBackend] = {}
_renewers: dict[tuple[int, str], Renewer] = {}
_probers: dict[tuple[int, str], SendAhead | None] = {}


def lock_url(url: str) -> LockUrl:
    """``url`` parsed; ``ValueError`` naming the URL without its password."""
    try:
        return parse_lock_url(url)
    except ValueError as exc:  # never echo the URL: it may carry a password
        raise ValueError(f"bad Redis URL {redact_url(url)}: {exc}") from None


def client_for(url: str) -> Client:
    """A new client for ``url`` with bounded timeouts.

    A ``redis.Redis`` for single servers and Sentinel, a ``RedisCluster`` for a cluster. A
    cluster client reads the slot map when it is built: if no listed node answers, this raises
    ``redis.ConnectionError`` (its message without the password).
    """
    parsed = lock_url(url)
    if parsed.kind == "redlock":
        raise ValueError(
            f"{redact_url(url)} lists several independent masters: use redlock_clients()"
        )
    if parsed.kind == "cluster":
        return _cluster_client(parsed, url)
    return _server_client(parsed, url)


def _server_client(parsed: LockUrl, url: str, defaults: dict[str, Any] = DEFAULTS) -> redis.Redis:
    """The client of one server: a Sentinel's master, or the server a redis-py URL names;
    ``defaults`` are its connection keywords, unless the URL sets them."""
    if parsed.kind == "sentinel":
        return _sentinel_client(parsed, defaults)
    try:
        return redis.Redis.from_url(parsed.redis_url, **defaults)
    except ValueError as exc:  # never echo the URL: it may carry a password
        raise ValueError(f"bad Redis URL {redact_url(url)}: {exc}") from None


def _sentinel_client(parsed: LockUrl, defaults: dict[str, Any]) -> redis.Redis:
    sentinel_kwargs = {
        **{k: v for k, v in defaults.items() if k.startswith("socket_")},
        **parsed.sentinel_options,
    }
    sentinel = Sentinel(  # type: ignore[no-untyped-call]
        list(parsed.nodes), sentinel_kwargs=sentinel_kwargs, **{**defaults, **parsed.options}
    )
    master: redis.Redis = sentinel.master_for(parsed.service)  # type: ignore[no-untyped-call]
    return master


class _ClusterClient(RedisCluster):
    """A RedisCluster whose cluster-level failures are ``redis.ConnectionError``s.

    redis-py raises ``RedisClusterException`` (not a ``RedisError``) when, for example, no node
    answers while it rebuilds its slot map; the lock store, the run claims and fenced writes
    all treat a ``RedisError`` as "Redis could not be asked", so it is translated here once.
    """

    def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().execute_command(*args, **kwargs)  # type: ignore[no-untyped-call]
        except RedisClusterException as exc:
            raise redis.ConnectionError(f"Redis Cluster: {exc}") from exc


def _cluster_client(parsed: LockUrl, url: str) -> RedisCluster:
    options = {k: v for k, v in {**DEFAULTS, **parsed.options}.items() if k != "db"}
    options.pop("health_check_interval", None)  # not a cluster connection option
    nodes = [ClusterNode(host, port) for host, port in parsed.nodes]  # type: ignore[no-untyped-call]
    try:
        return _ClusterClient(startup_nodes=nodes, **options)
    except RedisClusterException as exc:
        raise redis.ConnectionError(
            f"no node of the cluster {redact_url(url)} answered: {exc}"
        ) from None


def prober_for(url: str) -> SendAhead | None:
    """This process's connection for read-only probes of ``url``'s locks (core/probe.py): a
    client of its own whose calls fail after :data:`PROBE_TIMEOUT_S`, connecting included,
    and are never retried, and one kept connection of it. None for a cluster or Redlock URL:
    a probe there is not one bounded round trip."""
    key = (current_pid(), url)
    try:
        return _probers[key]
    except KeyError:
        pass
    parsed = lock_url(url)
    prober = None
    if parsed.kind in ("single", "sentinel"):
        defaults = {
            **DEFAULTS,
            "socket_timeout": PROBE_TIMEOUT_S,
            "socket_connect_timeout": PROBE_TIMEOUT_S,
            "retry": Retry(NoBackoff(), 0),
        }
        prober = SendAhead(_server_client(parsed, url, defaults))
    with _mutex:
        return _probers.setdefault(key, prober)


def redlock_clients(url: str) -> list[redis.Redis]:
    """One client per master of a ``redis+redlock://`` URL, as RedlockStore wants them.

    Bounded timeouts and **no retries**: the store asks each master once per call, and a
    command redis-py retried late would leave a stray copy of a lock on that master.
    """
    parsed = lock_url(url)
    if parsed.kind != "redlock":
        raise ValueError(f"{redact_url(url)} is not a redis+redlock:// URL")
    options = {**DEFAULTS, **parsed.options, "retry": Retry(NoBackoff(), 0)}
    return [redis.Redis(host=host, port=port, **options) for host, port in parsed.nodes]


def master_timeout(parsed: LockUrl) -> float:
    return parsed.master_timeout_s or DEFAULT_MASTER_TIMEOUT_S


def fence_margin_ms(parsed: LockUrl) -> int:
    """The URL's ``fence_margin`` in ms, else the default (backend.FENCE_MARGIN_MS)."""
    if parsed.fence_margin_s is None:
        return FENCE_MARGIN_MS
    return round(parsed.fence_margin_s * 1000)


def _redlock_store(url: str) -> RedlockStore:
    parsed = lock_url(url)
    store = RedlockStore(
        redlock_clients(url),
        fence_margin_ms=fence_margin_ms(parsed),
        master_timeout_s=master_timeout(parsed),
    )
    if len(store.clients) % 2 == 0:
        logger.warning(
            "singleton: redlock over an even number of masters (%d) tolerates no more "
            "failures than %d: %s",
            len(store.clients),
            len(store.clients) - 1,
            redact_url(url),
        )
    return store


def new_store(url: str) -> LockBackend:
    """A new lock store for ``url``: the one place that picks the store for a deployment kind."""
    parsed = lock_url(url)
    if parsed.kind == "redlock":
        return _redlock_store(url)
    replicas, timeout_ms = parsed.wait_replicas, _ms(parsed.wait_timeout_s)
    margin_ms = fence_margin_ms(parsed)
    if parsed.kind == "cluster":  # it connects when built: an unreachable cluster must be an
        return ClusterStore(  # error of the call, not of building the store
            lambda: _cluster_client(parsed, url),
            margin_ms,
            wait_replicas=replicas,
            wait_timeout_ms=timeout_ms,
        )
    return LockStore(
        _server_client(parsed, url), margin_ms, wait_replicas=replicas, wait_timeout_ms=timeout_ms
    )


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


def store_for(url: str) -> LockBackend:
    """The lock store for ``url`` in this process."""
    key = (current_pid(), url)
    store = _stores.get(key)
    if store is None:
        with _mutex:
            store = _stores.get(key)
            if store is None:
                store = _stores[key] = new_store(url)
    return store


def renewer_for(url: str, configure: Callable[[Renewer], None]) -> Renewer:
    """This process's renewer for ``url``, its thread running; ``configure`` runs once."""
    key = (current_pid(), url)
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


def flush_releases() -> None:
    """Send the releases this process's renewers still have queued (at shutdown)."""
    pid = current_pid()
    with _mutex:
        renewers = [r for (owner_pid, _), r in _renewers.items() if owner_pid == pid]
    for renewer in renewers:
        renewer.flush_releases()


def reset() -> None:
    """Stop this process's renewers, close and forget its stores (tests, embedders).

    A store made before a fork is forgotten without closing: its sockets are the parent's.
    """
    pid = current_pid()
    with _mutex:
        renewers = list(_renewers.values())
        stores = [store for (owner_pid, _), store in _stores.items() if owner_pid == pid]
        _renewers.clear()
        _stores.clear()
        probers = [p for (o, _), p in _probers.items() if o == pid and p is not None]
        _probers.clear()
    for prober in probers:
        prober.close()
    for renewer in renewers:
        renewer.stop()
    for store in stores:
        store.close()
