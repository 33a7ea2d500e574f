"""The lock store over a Redis Cluster: one script call per slot, one pipeline per node.

Every script call touches keys of one slot only: a lock and its fencing counter share a hash
tag, and :meth:`ClusterStore.renew` splits a batch into one call per slot, sent as one
pipeline per node. The client is built at the first call that needs it (``RedisCluster``
reads the slot map when built): a cluster that cannot be reached fails that call with
:class:`LockUnavailableError`, and the next call tries again. Nothing is written ahead: each
call is its own round trip (:class:`~.backend.SequentialReleases`). Knows nothing of Celery.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from typing import Any

import redis
from redis.cluster import RedisCluster

from . import _wire
from .backend import (
    FENCE_MARGIN_MS,
    REDIS_ERRORS,
    RenewItem,
    RenewStatus,
    SequentialReleases,
    fill_renewed,
    renew_args,
    renew_groups,
)
from .store import RENEW, AcquireCall, ScriptStore, acquire_and_wait

__all__ = ["ClusterStore", "pipeline_by_node", "script_calls"]


class ClusterStore(SequentialReleases, ScriptStore):
    """Acquire, renew and release locks on a Redis Cluster; implements
    :class:`~.backend.LockBackend`.

    ``connect()`` builds the ``RedisCluster`` at the first call that needs it.
    ``wait_replicas``: see :class:`~.store.ScriptStore`; ``WAIT`` goes to the node holding the
    lock.
    """

    def __init__(
        self,
        connect: Callable[[], RedisCluster],
        fence_margin_ms: int = FENCE_MARGIN_MS,
        *,
        wait_replicas: int = 0,
        wait_timeout_ms: int = 1000,
    ) -> None:
        super().__init__(fence_margin_ms, wait_replicas, wait_timeout_ms)
        self._connect = connect
        self._client: RedisCluster | None = None
        self._client_mutex = threading.Lock()

    @property
    def client(self) -> RedisCluster:
        """The cluster client, built at the first use."""
        client = self._client
        if client is None:
            with self._client_mutex:
                if self._client is None:
                    self._client = self._connect()
                client = self._client
        return client

    def close(self) -> None:
        """Close the cluster client's connections to every node; the next call builds it again."""
        with self._client_mutex:
            client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(*REDIS_ERRORS):
                client.close()

    # -- how a call reaches the cluster --------------------------------------------------

    def _call(self, lua: _wire.Script, args: Sequence[Any]) -> Any:
        return _wire.evalsha(self.client, lua, args)

    def _acquire_waiting(self, key: str, call: AcquireCall) -> tuple[Any, int]:
        try:
            return acquire_and_wait(self._node(key), call, self.wait_replicas, self.wait_timeout_ms)
        except redis.ResponseError as exc:
            if str(exc).startswith(("MOVED", "ASK")):
                self._refresh_slots()  # the script did not run; the next try goes to the owner
            raise

    def _node(self, key: str) -> redis.Redis:
        """The client of the node holding ``key``."""
        node = self.client.get_node_from_key(key)  # type: ignore[no-untyped-call]
        connection: redis.Redis | None = None if node is None else node.redis_connection
        if connection is None:
            raise redis.ConnectionError(f"no cluster node known for {key}")
        return connection

    def _refresh_slots(self) -> None:
        client = self._client
        if client is not None:
            with contextlib.suppress(*REDIS_ERRORS):  # the next call tries again
                client.nodes_manager.initialize()

    def _do_renew(self, items: Sequence[RenewItem]) -> list[RenewStatus]:
        """One renew.lua call per slot; the calls of one node in one pipeline
        (:func:`pipeline_by_node`). If a node cannot be asked, the locks on the other nodes are
        still renewed, and then the error is raised.
        """
        client = self.client
        by_slot: dict[int, list[int]] = {}
        for index, item in enumerate(items):
            slot: int = client.keyslot(item.key)  # type: ignore[no-untyped-call]
            by_slot.setdefault(slot, []).append(index)
        groups = [g for grouped in by_slot.values() for g in renew_groups(items, grouped)]
        replies = pipeline_by_node(client, [(RENEW, renew_args(items, g)) for g in groups])
        statuses: list[RenewStatus | None] = [None] * len(items)
        error: Exception | None = None
        for group, reply in zip(groups, replies, strict=True):
            if isinstance(reply, Exception):
                error = error or reply
            else:
                fill_renewed(statuses, group, reply)
        if error is not None:
            raise error
        return [status if status is not None else RenewStatus.GONE for status in statuses]


def pipeline_by_node(
    client: RedisCluster, calls: Sequence[tuple[_wire.Script, Sequence[Any]]]
) -> list[Any]:
    """Script calls on a cluster, each on keys of one slot (its first key is ``args[1]``); each
    reply or its error, in order.

    The calls of one node go in one pipeline. A node without the script (new, restarted, or a
    promoted replica) gets it loaded and its calls sent again (:func:`._wire.pipeline`). Calls
    the pipelines could not place (a slot that moved, an unknown or failed node) or that got an
    error go again, one by one, through the cluster client, which follows redirects and
    refreshes its slot map; a node that fails there too is given up for this batch (its other
    calls get that error).
    """
    by_node: dict[str, tuple[redis.Redis, list[int]]] = {}
    again: list[tuple[str, int]] = []
    for index, (_lua, args) in enumerate(calls):
        try:
            node = client.nodes_manager.get_node_from_slot(client.keyslot(args[1]))  # type: ignore[no-untyped-call]
        except REDIS_ERRORS:
            node = None
        connection = None if node is None else node.redis_connection
        if node is None or connection is None:
            again.append(("", index))
            continue
        by_node.setdefault(node.name, (connection, []))[1].append(index)
    replies: list[Any] = [None] * len(calls)
    for name, (connection, indexes) in by_node.items():
        try:
            got = _wire.pipeline(connection, [calls[i] for i in indexes])
        except REDIS_ERRORS:
            again.extend((name, i) for i in indexes)
            continue
        for index, reply in zip(indexes, got, strict=True):
            if isinstance(reply, Exception):
                again.append((name, index))
            else:
                replies[index] = reply
    failed: dict[str, Exception] = {}
    for name, index in again:
        if name and name in failed:
            replies[index] = failed[name]
            continue
        try:
            replies[index] = _wire.evalsha(client, *calls[index])
        except REDIS_ERRORS as exc:
            replies[index] = exc
            if name:
                failed[name] = exc
    return replies


def script_calls(client: Any, calls: Sequence[tuple[_wire.Script, Sequence[Any]]]) -> list[Any]:
    """Script calls in one round trip: one pipeline on a single server (:func:`._wire.pipeline`),
    one per node on a cluster (:func:`pipeline_by_node`); each reply or its error, in order."""
    if isinstance(client, RedisCluster):
        return pipeline_by_node(client, calls)
    return _wire.pipeline(client, calls)
