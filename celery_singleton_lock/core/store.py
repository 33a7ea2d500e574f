"""The lock primitive: owner-checked acquire, renew and release over one Redis client.

Knows nothing of Celery. An *owner* is an opaque string (the Celery glue passes the task
id) and a *generation* an integer (the glue passes the retries count): the same owner may
take its lock over from an earlier generation, which is how a retried task re-enters the
lock its previous run still holds.

Public methods validate their input; the ``_do_*`` methods talk to Redis. Every Redis
call runs a Lua script from ``lua/`` that checks the owner before it writes.

The client is a ``redis.Redis`` (one server, or the master a Sentinel names) or a
``redis.cluster.RedisCluster``. On a cluster every script call touches keys of one slot
only: a lock and its fencing counter share a hash tag, and :meth:`LockStore.renew` splits a
batch into one script call per slot, sent as one pipeline per node.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import logging
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any, TypeAlias

import redis
from redis.cluster import RedisCluster
from redis.commands.core import Script
from redis.exceptions import NoScriptError, RedisClusterException

from ..errors import LockUnavailableError
from .keys import LockKeys
from .sendahead import SendAhead

__all__ = [
    "FENCE_TTL_MS",
    "REDIS_ERRORS",
    "Acquired",
    "Client",
    "Contended",
    "LockStore",
    "ReleaseItem",
    "ReleaseStatus",
    "RenewItem",
    "RenewStatus",
]

logger = logging.getLogger("celery_singleton_lock.core.store")

#: What the lock store accepts as a client: one server (or a Sentinel's master) or a cluster.
Client: TypeAlias = "redis.Redis | RedisCluster"
#: One lock to release: ``(key, owner, generation or None for any, fencing token or None)``.
ReleaseItem: TypeAlias = "tuple[str, str, int | None, int | None]"
#: Errors that mean "Redis could not be asked" (redis-py's cluster errors are not RedisErrors).
REDIS_ERRORS: tuple[type[Exception], ...] = (redis.RedisError, RedisClusterException)

#: How long a fencing counter outlives the last acquire of its lock. Tokens stay
#: increasing after it expires because they never fall below the server's clock.
FENCE_TTL_MS = 7 * 24 * 3600 * 1000


@dataclass(frozen=True)
class Acquired:
    """The lock is ours; ``token`` is its fencing token for this run.

    ``replicas`` is how many replicas acknowledged the lock (the reply of ``WAIT``) when the
    store waits for replicas, else None.
    """

    token: int
    reentered: bool
    replicas: int | None = None


@dataclass(frozen=True)
class Contended:
    """Another owner (or another run of the same generation) holds the lock."""

    holder: str
    holder_generation: int
    holder_token: int | None
    pttl_ms: int


@dataclass(frozen=True)
class RenewItem:
    """One lock to renew: the key, who must hold it, and the ttl to set.

    ``token`` is the fencing token of the run that holds it: with it, a lock that another run
    of the same owner and generation took (a redelivered copy of the message, after this run's
    lock expired) counts as taken. None: any token.

    Checked when made (``ValueError``), so the stores need not check it at every renewal (the
    renewer makes one per lock and renews it every interval).
    """

    key: str
    owner: str
    generation: int
    ttl_ms: int
    token: int | None = None

    def __post_init__(self) -> None:
        _check_owner(self.owner, self.generation)
        if self.ttl_ms <= 0:
            raise ValueError(f"ttl_ms must be positive, got {self.ttl_ms!r}")

    @functools.cached_property
    def _packed(self) -> tuple[bytes, bytes]:
        """Its key, and its owner, generation and token, as renew.lua's arguments on the wire
        (RESP).

        Made once: packing a lock's arguments anew at every renewal costs about 0.3 µs (3 ms of
        the renewer's time per interval for 10,000 locks); joining these costs a tenth of that.
        """
        token = "" if self.token is None else self.token
        return _bulk(self.key), _bulk(self.owner) + _bulk(self.generation) + _bulk(token)


class RenewStatus(enum.IntEnum):
    """What a renewal found."""

    RENEWED = 1
    GONE = 0
    TAKEN = -1


class ReleaseStatus(enum.IntEnum):
    """What a release found."""

    RELEASED = 1
    NOT_HELD = 0
    TAKEN = -1
    #: :meth:`LockStore.release_lost` only: the lock was handed over to a retry, left alone
    HANDED_OVER = 2


def load_script(name: str) -> str:
    return resources.files(__package__).joinpath("lua").joinpath(name).read_text(encoding="utf-8")


class LockStore:
    """Acquire, renew and release locks on one Redis client, one round trip each.

    ``wait_replicas`` > 0 makes every acquire wait (``WAIT``, in the same round trip) until
    that many replicas have the lock, at most ``wait_timeout_ms``; fewer acknowledgements are
    logged and reported in :attr:`Acquired.replicas`, the lock is kept either way.
    """

    def __init__(
        self,
        client: Client | None,
        fence_ttl_ms: int = FENCE_TTL_MS,
        *,
        connect: Callable[[], Client] | None = None,
        wait_replicas: int = 0,
        wait_timeout_ms: int = 1000,
    ) -> None:
        if fence_ttl_ms <= 0:
            raise ValueError(f"fence_ttl_ms must be positive, got {fence_ttl_ms!r}")
        if wait_replicas < 0:
            raise ValueError(f"wait_replicas must be >= 0, got {wait_replicas!r}")
        if wait_timeout_ms <= 0:
            raise ValueError(f"wait_timeout_ms must be positive, got {wait_timeout_ms!r}")
        if client is None and connect is None:
            raise ValueError("give a client, or a connect() that makes one")
        self.fence_ttl_ms = fence_ttl_ms
        self.wait_replicas = wait_replicas
        self.wait_timeout_ms = wait_timeout_ms
        self._connect = connect
        self._client: Client | None = None
        #: releases written now whose replies are read later (single server only)
        self._ahead: SendAhead | None = None
        self._client_mutex = threading.Lock()
        if client is not None:
            self._bind(client)

    @classmethod
    def connect_later(
        cls,
        connect: Callable[[], Client],
        fence_ttl_ms: int = FENCE_TTL_MS,
        *,
        wait_replicas: int = 0,
        wait_timeout_ms: int = 1000,
    ) -> LockStore:
        """A store whose client ``connect()`` builds at the first call that needs it.

        For clients that connect when built (``RedisCluster`` reads the slot map): a server
        that cannot be reached then fails that call with :class:`LockUnavailableError`, and
        the next call tries again.
        """
        return cls(
            None,
            fence_ttl_ms,
            connect=connect,
            wait_replicas=wait_replicas,
            wait_timeout_ms=wait_timeout_ms,
        )

    @property
    def client(self) -> Client:
        """The Redis client (built now if the store was made with :meth:`connect_later`)."""
        client = self._client
        if client is None:
            with self._client_mutex:
                if self._client is None:
                    assert self._connect is not None
                    self._bind(self._connect())
                client = self._client
                assert client is not None
        return client

    def _connected(self) -> None:
        """Build the client now if it is still to be built (the scripts come with it)."""
        if self._client is None:
            self.client  # noqa: B018 - the property connects

    def _bind(self, client: Client) -> None:
        self._acquire = client.register_script(load_script("acquire.lua"))
        self._renew = client.register_script(load_script("renew.lua"))
        self._release = client.register_script(load_script("release.lua"))
        self._release_lost = client.register_script(load_script("release_lost.lua"))
        self._client = client
        if self._pipelines() and not self.wait_replicas:
            assert not isinstance(client, RedisCluster)
            self._ahead = SendAhead(client)

    # -- public API: validate, then delegate -------------------------------------------

    def acquire(
        self,
        keys: LockKeys,
        owner: str,
        generation: int,
        ttl_ms: int,
        meta: Mapping[str, str] | None = None,
    ) -> Acquired | Contended:
        """Take ``keys.lock`` for ``owner``; re-enter if an earlier generation of it holds it."""
        _check_owner(owner, generation)
        if ttl_ms <= 0:
            raise ValueError(f"ttl_ms must be positive, got {ttl_ms!r}")
        try:
            return self._do_acquire(keys, owner, generation, ttl_ms, meta)
        except REDIS_ERRORS as exc:
            raise LockUnavailableError(
                f"could not acquire {keys.lock}: {exc}", key=keys.lock, task_id=owner
            ) from exc

    def renew(self, items: Sequence[RenewItem]) -> list[RenewStatus]:
        """Renew every item still held by its owner and generation, in one round trip.

        On a cluster: one round trip per node holding any of the locks (a pipeline of one
        script call per slot). If a node cannot be asked, the locks on the other nodes are
        still renewed, and then the error is raised.
        """
        if not items:
            return []
        try:  # the items were checked when made
            return self._do_renew(items)
        except REDIS_ERRORS as exc:
            raise LockUnavailableError(
                f"could not renew {len(items)} lock(s): {exc}", key=items[0].key
            ) from exc

    def release(
        self, key: str, owner: str, generation: int | None, token: int | None = None
    ) -> ReleaseStatus:
        """Delete ``key`` if ``owner`` holds it (any generation when ``generation`` is None), with
        the fencing token ``token`` (any token when None: see :class:`RenewItem`)."""
        _check_owner(owner, 0 if generation is None else generation)
        try:
            return self._do_release(key, owner, generation, token)
        except REDIS_ERRORS as exc:
            raise LockUnavailableError(
                f"could not release {key}: {exc}", key=key, task_id=owner
            ) from exc

    def release_lost(self, key: str, owner: str, generation: int) -> ReleaseStatus:
        """Delete ``key`` for a holder whose process is gone, unless it was handed over.

        Only if ``owner`` holds it with ``generation``, and not while its expiry is stretched
        past its ttl (a hand-over to a retry, which takes it over): ``HANDED_OVER`` then.
        """
        _check_owner(owner, generation)
        try:
            self._connected()
            args = [1, key, owner, generation]
            return _RELEASE_STATUSES[int(self._call(self._release_lost, args))]
        except REDIS_ERRORS as exc:
            raise LockUnavailableError(
                f"could not release {key}: {exc}", key=key, task_id=owner
            ) from exc

    def release_ahead(
        self, key: str, owner: str, generation: int | None, tag: Any, token: int | None = None
    ) -> bool:
        """Write the release of ``key`` now; its reply is read later, ``tag`` with it.

        The lock is free as soon as Redis reads the release; :meth:`collect_released` (or the
        next acquire of this store, which is sent after it on the same connection and reads
        its reply) hands back ``(tag, status)``. False, with nothing sent, when this store
        cannot send ahead (a cluster, Redlock, ``wait_replicas``) or the connection failed:
        release it some other way then.
        """
        _check_owner(owner, 0 if generation is None else generation)
        ahead = self._ahead
        if ahead is None:
            return False
        try:
            ahead.send(
                self._release, _release_args(key, owner, generation, token), (key, owner, tag)
            )
        except REDIS_ERRORS:
            return False
        return True

    def collect_released(self) -> list[tuple[Any, ReleaseStatus | LockUnavailableError]]:
        """``(tag, status)`` of every :meth:`release_ahead` not yet collected, in order."""
        ahead = self._ahead
        if ahead is None or not len(ahead):
            return []
        return [
            (tag, _release_outcome((key, owner), reply))
            for (key, owner, tag), reply in ahead.collect()
        ]

    def release_many(
        self, items: Sequence[ReleaseItem]
    ) -> list[ReleaseStatus | LockUnavailableError]:
        """Release several ``(key, owner, generation, token)`` locks, each owner-checked.

        One round trip on a single server (a pipeline); one call per lock on a cluster or in a
        store that overrides :meth:`release`. Each item gets its status, or the error that
        kept it from being released (the lock then expires after its ttl).
        """
        for _key, owner, generation, _token in items:
            _check_owner(owner, 0 if generation is None else generation)
        if not items:
            return []
        if self._pipelines():
            try:
                replies = self._pipeline([(self._release, _release_args(*item)) for item in items])
            except REDIS_ERRORS as exc:
                error = LockUnavailableError(
                    f"could not release {len(items)} lock(s): {exc}", key=items[0][0]
                )
                return [error] * len(items)
            return [
                _release_outcome(item, reply) for item, reply in zip(items, replies, strict=True)
            ]
        outcomes: list[ReleaseStatus | LockUnavailableError] = []
        for key, owner, generation, token in items:
            try:
                outcomes.append(self.release(key, owner, generation, token))
            except LockUnavailableError as exc:
                outcomes.append(exc)
        return outcomes

    def acquire_after(  # noqa: PLR0917 - acquire's positional arguments, after releases
        self,
        releases: Sequence[ReleaseItem],
        keys: LockKeys,
        owner: str,
        generation: int,
        ttl_ms: int,
        meta: Mapping[str, str] | None = None,
    ) -> tuple[list[ReleaseStatus | LockUnavailableError], Acquired | Contended]:
        """:meth:`release_many` of ``releases``, then :meth:`acquire`, in ONE round trip.

        The releases run first, in order, on the same connection: a lock released here is
        free before the acquire looks at it. One round trip on a single server without
        ``wait_replicas``; otherwise the two calls one after the other. Raises as
        :meth:`acquire` when the acquire could not be made.
        """
        if not releases:
            return [], self.acquire(keys, owner, generation, ttl_ms, meta)
        if self._ahead is None:
            return self.release_many(releases), self.acquire(keys, owner, generation, ttl_ms, meta)
        _check_owner(owner, generation)
        if ttl_ms <= 0:
            raise ValueError(f"ttl_ms must be positive, got {ttl_ms!r}")
        for _key, owner_, gen, _token in releases:
            _check_owner(owner_, 0 if gen is None else gen)
        calls = [(self._release, _release_args(*item)) for item in releases]
        calls.append((self._acquire, self._acquire_args(keys, owner, generation, ttl_ms, meta)))
        try:
            replies = self._ahead.call(calls)
        except REDIS_ERRORS as exc:
            raise LockUnavailableError(
                f"could not acquire {keys.lock}: {exc}", key=keys.lock, task_id=owner
            ) from exc
        reply = replies[-1]
        if isinstance(reply, Exception):
            raise LockUnavailableError(
                f"could not acquire {keys.lock}: {reply}", key=keys.lock, task_id=owner
            ) from reply
        outcomes = [
            _release_outcome(item, r) for item, r in zip(releases, replies[:-1], strict=True)
        ]
        return outcomes, _acquire_outcome(reply, None)

    def holder(self, key: str) -> dict[str, str]:
        """The lock's hash (owner, gen, token, since, ttl, metadata); empty when free."""
        return {as_text(k): as_text(v) for k, v in self.client.hgetall(key).items()}

    # -- Redis round trips --------------------------------------------------------------

    def _acquire_args(
        self,
        keys: LockKeys,
        owner: str,
        generation: int,
        ttl_ms: int,
        meta: Mapping[str, str] | None,
    ) -> list[Any]:
        """numkeys, KEYS and ARGV of acquire.lua."""
        args: list[Any] = [2, keys.lock, keys.fence, owner, generation, ttl_ms, self.fence_ttl_ms]
        if meta:
            for item in meta.items():
                args += item
        return args

    def _do_acquire(
        self,
        keys: LockKeys,
        owner: str,
        generation: int,
        ttl_ms: int,
        meta: Mapping[str, str] | None,
    ) -> Acquired | Contended:
        self._connected()
        args = self._acquire_args(keys, owner, generation, ttl_ms, meta)
        replicas: int | None = None
        if self.wait_replicas:
            reply, replicas = self._acquire_and_wait(keys, args)
        else:
            reply = self._call(self._acquire, args)
        outcome = _acquire_outcome(reply, replicas)
        if replicas is not None and replicas < self.wait_replicas:
            logger.warning(
                "singleton: only %d of %d replicas acknowledged the lock within %dms: "
                "key=%s token=%d",
                replicas,
                self.wait_replicas,
                self.wait_timeout_ms,
                keys.lock,
                getattr(outcome, "token", -1),
            )
        return outcome

    def _evalsha(self, script: Script, args: Sequence[Any]) -> Any:
        """``EVALSHA`` straight through the client (``args`` starts with numkeys)."""
        client = self.client
        try:
            return client.execute_command("EVALSHA", script.sha, *args)  # type: ignore[no-untyped-call]
        except NoScriptError:  # a new or restarted server
            client.script_load(script.script)
            return client.execute_command("EVALSHA", script.sha, *args)  # type: ignore[no-untyped-call]

    def _call(self, script: Script, args: Sequence[Any]) -> Any:
        """One script call: on the send-ahead connection when the store has one (after the
        releases written ahead, without redis-py's per-command layers), else through the
        client. One call at a time on that connection: a thread that finds it busy waits, so
        a call never overtakes a release written before it."""
        if self._ahead is None:
            return self._evalsha(script, args)
        reply = self._ahead.call([(script, args)])[0]
        if isinstance(reply, Exception):
            raise reply
        return reply

    def _pipelines(self) -> bool:
        """Whether this store may batch calls in one pipeline of a single-server client."""
        return (
            type(self).release is LockStore.release
            and type(self).acquire is LockStore.acquire
            and not isinstance(self.client, RedisCluster)
        )

    def _pipeline(self, calls: Sequence[tuple[Script, Sequence[Any]]]) -> list[Any]:
        """Script calls in one pipeline (single server); each reply or its error, in order.

        Calls that found their script missing (a new or restarted server) are loaded and
        sent again, once; calls that ran are never sent twice.
        """
        client = self.client
        assert not isinstance(client, RedisCluster)

        def send(todo: list[int]) -> list[Any]:
            pipe = client.pipeline(transaction=False)
            for index in todo:
                script, args = calls[index]
                pipe.execute_command("EVALSHA", script.sha, *args)  # type: ignore[no-untyped-call]
            replies: list[Any] = pipe.execute(raise_on_error=False)
            return replies

        def load(todo: list[int]) -> None:
            for script in {id(calls[i][0]): calls[i][0] for i in todo}.values():
                client.script_load(script.script)

        return _reloading(len(calls), send, load)

    def _acquire_and_wait(self, keys: LockKeys, args: list[Any]) -> tuple[list[Any], int]:
        """acquire.lua and ``WAIT`` in one pipeline: WAIT counts the writes of its connection."""
        node = self._node_client(keys.lock)
        for attempt in (1, 2):
            pipe = node.pipeline(transaction=False)
            pipe.execute_command(  # type: ignore[no-untyped-call]
                "EVALSHA", self._acquire.sha, *args
            )
            pipe.execute_command(  # type: ignore[no-untyped-call]
                "WAIT", self.wait_replicas, self.wait_timeout_ms
            )
            replies: list[Any] = pipe.execute(raise_on_error=False)
            reply, replicas = replies
            if isinstance(reply, NoScriptError) and attempt == 1:
                node.script_load(self._acquire.script)  # a new or restarted server
                continue
            if isinstance(reply, redis.ResponseError) and str(reply).startswith(("MOVED", "ASK")):
                self._refresh_slots()  # the script did not run; the next try goes to the owner
            if isinstance(reply, Exception):
                raise reply
            if isinstance(replicas, Exception):  # the lock is ours; only the count is missing
                replicas = 0
            return reply, int(replicas)
        raise AssertionError("unreachable")  # pragma: no cover

    def _node_client(self, key: str) -> redis.Redis:
        """The client of the server holding ``key``: the client itself, or a cluster node's."""
        client = self.client
        if not isinstance(client, RedisCluster):
            return client
        node = client.get_node_from_key(key)  # type: ignore[no-untyped-call]
        connection: redis.Redis | None = None if node is None else node.redis_connection
        if connection is None:
            raise redis.ConnectionError(f"no cluster node known for {key}")
        return connection

    def _refresh_slots(self) -> None:
        client = self._client
        if isinstance(client, RedisCluster):
            with contextlib.suppress(*REDIS_ERRORS):  # the next call tries again
                client.nodes_manager.initialize()

    def _do_renew(self, items: Sequence[RenewItem]) -> list[RenewStatus]:
        client = self.client
        if isinstance(client, RedisCluster):
            return self._renew_cluster(client, items)
        groups = _renew_groups(items, range(len(items)))
        # one round trip still; the server serves other clients between the calls
        sha = self._renew.sha
        replies = self._stream(client, self._renew, [_RenewCall(sha, items, g) for g in groups])
        statuses = [RenewStatus.RENEWED] * len(items)
        for group, reply in zip(groups, replies, strict=True):
            if isinstance(reply, Exception):
                raise reply
            _fill_failures(statuses, group, reply)
        return statuses

    def _stream(
        self, client: redis.Redis, script: Script, calls: Sequence[Callable[[], bytes]]
    ) -> list[Any]:
        """``EVALSHA`` calls of ``script`` (single server): each call is packed (``call()``) and
        written to the connection as soon as the previous call is written, and the replies are
        read once all are: one round trip of waiting, and the server runs a call while the next
        one is being packed. Each reply or its error, in order.

        Calls that found their script missing (a new or restarted server) are loaded and sent
        again, once (:func:`_reloading`); the calls that ran are not sent again (unless the
        connection fails: then redis-py retries them all, as it retries a pipeline).
        """
        return _reloading(
            len(calls),
            lambda todo: _send_then_read(client, [calls[i] for i in todo]),
            lambda _todo: client.script_load(script.script),
        )

    def _renew_cluster(self, client: RedisCluster, items: Sequence[RenewItem]) -> list[RenewStatus]:
        """One renew.lua call per slot; the calls of one node in one pipeline.

        A node without the script (new, restarted, or a promoted replica) gets it loaded and
        its calls sent again: two more round trips, once per node. Calls the pipelines could
        not place (a slot that moved, an unknown or failed node) go again, one by one, through
        the cluster client, which follows redirects and refreshes its slot map; a node that
        fails there too is given up for this batch.
        """
        by_slot: dict[int, list[int]] = {}
        for index, item in enumerate(items):
            slot: int = client.keyslot(item.key)  # type: ignore[no-untyped-call]
            by_slot.setdefault(slot, []).append(index)
        by_node: dict[str, tuple[redis.Redis, list[list[int]]]] = {}
        again: list[tuple[str, list[int]]] = []
        slot_groups = [
            (s, g) for s, grouped in by_slot.items() for g in _renew_groups(items, grouped)
        ]
        for slot, group in slot_groups:
            try:
                node = client.nodes_manager.get_node_from_slot(slot)
            except REDIS_ERRORS:
                node = None
            connection = None if node is None else node.redis_connection
            if node is None or connection is None:
                again.append(("", group))
                continue
            by_node.setdefault(node.name, (connection, []))[1].append(group)
        statuses: list[RenewStatus | None] = [None] * len(items)
        for name, (connection, groups) in by_node.items():
            try:
                replies = self._renew_on_node(connection, items, groups)
            except REDIS_ERRORS:
                again.extend((name, group) for group in groups)
                continue
            for group, reply in zip(groups, replies, strict=True):
                if isinstance(reply, Exception):
                    again.append((name, group))
                else:
                    _fill(statuses, group, reply)
        error: Exception | None = None
        failed: set[str] = set()
        for name, group in again:
            if name and name in failed:
                continue
            try:
                _fill(statuses, group, self._evalsha(self._renew, _renew_call(items, group)))
            except REDIS_ERRORS as exc:
                error = error or exc
                failed.add(name)
        if error is not None:
            raise error
        return [status if status is not None else RenewStatus.GONE for status in statuses]

    def _renew_on_node(
        self, connection: redis.Redis, items: Sequence[RenewItem], groups: list[list[int]]
    ) -> list[Any]:
        """One pipeline of renew.lua calls, one per group; loads the script where missing."""

        def send(todo: list[int]) -> list[Any]:
            pipe = connection.pipeline(transaction=False)
            for index in todo:
                pipe.execute_command(  # type: ignore[no-untyped-call]
                    "EVALSHA", self._renew.sha, *_renew_call(items, groups[index])
                )
            replies: list[Any] = pipe.execute(raise_on_error=False)
            return replies

        # a new, restarted or promoted node
        return _reloading(
            len(groups), send, lambda _todo: connection.script_load(self._renew.script)
        )

    def _do_release(
        self, key: str, owner: str, generation: int | None, token: int | None
    ) -> ReleaseStatus:
        self._connected()
        args = _release_args(key, owner, generation, token)
        return ReleaseStatus(int(self._call(self._release, args)))


#: Most locks one renew.lua call renews: the server runs one script at a time and answers
#: nobody else meanwhile (about 6-8 ms per 1,000 locks); bigger batches are split into
#: several calls sent as one pipeline, still one round trip.
RENEW_CHUNK = 1000


def _renew_groups(items: Sequence[RenewItem], indexes: Iterable[int]) -> list[list[int]]:
    """``indexes`` in groups of one ttl and at most :data:`RENEW_CHUNK` locks each."""
    by_ttl: dict[int, list[int]] = {}
    for index in indexes:
        ttl = items[index].ttl_ms
        group = by_ttl.get(ttl)
        if group is None:
            group = by_ttl[ttl] = []
        group.append(index)
    return [
        group[start : start + RENEW_CHUNK]
        for group in by_ttl.values()
        for start in range(0, len(group), RENEW_CHUNK)
    ]


def _renew_call(items: Sequence[RenewItem], group: Sequence[int]) -> list[Any]:
    """numkeys, KEYS and ARGV of renew.lua for ``items[i]``, ``i`` in ``group`` (one ttl)."""
    args: list[Any] = [len(group)]
    args += [items[index].key for index in group]
    args.append(items[group[0]].ttl_ms)
    for index in group:
        item = items[index]
        args += (item.owner, item.generation, "" if item.token is None else item.token)
    return args


def _reloading(
    count: int,
    send: Callable[[list[int]], list[Any]],
    load: Callable[[list[int]], object],
) -> list[Any]:
    """Replies of ``count`` script calls sent as a batch by ``send(indexes)``, each reply or its
    error, in order. Calls that found their script missing (``NOSCRIPT``: they did not run)
    get it loaded by ``load(indexes)`` and are sent again, once; calls that ran are never sent
    twice."""
    replies: list[Any] = [None] * count
    todo = list(range(count))
    for attempt in (1, 2):
        for index, reply in zip(todo, send(todo), strict=True):
            replies[index] = reply
        todo = [i for i in todo if isinstance(replies[i], NoScriptError)]
        if not todo or attempt == 2:
            break
        load(todo)
    return replies


def _bulk(value: str | int) -> bytes:
    """``value`` as a RESP bulk string, as redis-py packs it (UTF-8; an int in decimal)."""
    data = value.encode() if isinstance(value, str) else b"%d" % value
    return b"$%d\r\n%s\r\n" % (len(data), data)


@dataclass(frozen=True)
class _RenewCall:
    """One renew.lua call, packed when called (by :meth:`LockStore._stream`): the same bytes as
    ``EVALSHA sha`` with :func:`_renew_call`'s arguments, from the items' packed arguments."""

    sha: str
    items: Sequence[RenewItem]
    group: Sequence[int]

    def __call__(self) -> bytes:
        items, group = self.items, self.group
        packed = [items[index]._packed for index in group]
        parts = [b"*%d\r\n$7\r\nEVALSHA\r\n" % (4 * len(group) + 4), _bulk(self.sha)]
        parts.append(_bulk(len(group)))
        parts += [key for key, _ in packed]
        parts.append(_bulk(items[group[0]].ttl_ms))
        parts += [holder for _, holder in packed]
        return b"".join(parts)


def _send_then_read(client: redis.Redis, calls: Sequence[Callable[[], bytes]]) -> list[Any]:
    """The packed ``EVALSHA`` of each call, written one by one, then every reply read.

    On one pooled connection, retried as redis-py retries a pipeline (the calls must be safe to
    run twice). A connection that fails, or whose replies are not all read, is disconnected
    before it goes back to the pool, so no later command reads a reply meant for these.
    """
    pool = client.connection_pool
    connection: Any = pool.get_connection()  # redis-py's connections are untyped

    def write_then_read() -> list[Any]:
        try:
            for count, call in enumerate(calls):
                connection.send_packed_command([call()], check_health=count == 0)
            replies: list[Any] = []
            for _ in calls:
                try:
                    replies.append(client.parse_response(connection, "EVALSHA"))  # type: ignore[no-untyped-call]
                except redis.ResponseError as exc:  # this call's error (NOSCRIPT, ...)
                    replies.append(exc)
        except BaseException:
            connection.disconnect()
            raise
        return replies

    try:
        replies: list[Any] = connection.retry.call_with_retry(
            write_then_read, lambda _error: connection.disconnect()
        )
        return replies
    finally:
        pool.release(connection)


def _fill(statuses: list[RenewStatus | None], indexes: Sequence[int], reply: Any) -> None:
    """Statuses from renew.lua's reply, which lists only the locks it did not renew."""
    for index in indexes:
        statuses[index] = RenewStatus.RENEWED
    _fill_failures(statuses, indexes, reply)


def _fill_failures(statuses: list[Any], indexes: Sequence[int], reply: Any) -> None:
    """The statuses of the locks renew.lua's reply lists: those it did not renew."""
    for position in range(0, len(reply), 2):
        statuses[indexes[int(reply[position]) - 1]] = RenewStatus(int(reply[position + 1]))


def _release_args(
    key: str, owner: str, generation: int | None, token: int | None = None
) -> list[Any]:
    """numkeys, KEYS and ARGV of release.lua."""
    return [
        1,
        key,
        owner,
        "" if generation is None else generation,
        "" if token is None else token,
    ]


def _release_outcome(
    item: tuple[str, str] | ReleaseItem, reply: Any
) -> ReleaseStatus | LockUnavailableError:
    if isinstance(reply, Exception):
        return LockUnavailableError(
            f"could not release {item[0]}: {reply}", key=item[0], task_id=item[1]
        )
    return _RELEASE_STATUSES[int(reply)]


#: release.lua's replies (a dict lookup: ReleaseStatus(n) goes through the enum machinery)
_RELEASE_STATUSES = {status.value: status for status in ReleaseStatus}


def _acquire_outcome(reply: Any, replicas: int | None) -> Acquired | Contended:
    if reply[0] == 1:
        return Acquired(token=int(reply[1]), reentered=bool(reply[2]), replicas=replicas)
    holder_token = None if reply[3] is None else int(reply[3])
    return Contended(as_text(reply[1]), int(reply[2]), holder_token, int(reply[4]))


def as_text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _check_owner(owner: str, generation: int) -> None:
    if not owner:
        raise ValueError("owner must be a non-empty string")
    if generation < 0:
        raise ValueError(f"generation must be >= 0, got {generation!r}")
