"""The lock store over one Redis server, or the master a Sentinel names.

Public methods validate their input; the ``_do_*`` methods talk to Redis. Every Redis call
runs a Lua script from ``lua/`` (through :mod:`._wire`) that checks the owner before it
writes. On one server calls can share a connection: releases are written ahead and their
replies read with the next acquire (:class:`~.sendahead.SendAhead`), a batch of releases is
one pipeline, and a batch of renewals one stream of calls. Knows nothing of Celery.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import redis

from ..errors import LockUnavailableError
from . import _wire
from .backend import (
    FENCE_MARGIN_MS,
    REDIS_ERRORS,
    Acquired,
    Client,
    Contended,
    ReleaseItem,
    ReleaseStatus,
    RenewItem,
    RenewStatus,
    acquire_args,
    acquire_outcome,
    check_fence_margin,
    check_owner,
    check_releases,
    check_ttl,
    fill_failures,
    release_args,
    release_lost_args,
    release_outcome,
    renew_groups,
)
from .completion import Ending
from .keys import LockKeys
from .rates import rate_key
from .sendahead import SendAhead

__all__ = ["LockStore", "ScriptStore"]

logger = logging.getLogger(__name__)

ACQUIRE = _wire.script("acquire.lua")
ACQUIRE_PERMIT = _wire.script("acquire_permit.lua")
RENEW = _wire.script("renew.lua")
RELEASE = _wire.script("release.lua")
RELEASE_LOST = _wire.script("release_lost.lua")


class ScriptStore:
    """What :class:`LockStore` and :class:`~.cluster.ClusterStore` share: the lock scripts,
    their checks and their errors. A subclass says how a call reaches Redis (``_call``,
    ``_do_renew``, ``_acquire_waiting``) and gives the ``client``.

    ``wait_replicas`` > 0 makes every acquire wait (``WAIT``, in the same round trip) until
    that many replicas have the lock, at most ``wait_timeout_ms``; fewer acknowledgements are
    logged and reported in :attr:`Acquired.replicas`, the lock is kept either way.

    ``fence_margin_ms``: a lock's fencing counter expires its ttl plus this long after the
    acquire (docs/internals.md, "Fencing tokens": the bound a finished run's keys stay within).
    """

    def __init__(self, fence_margin_ms: int, wait_replicas: int, wait_timeout_ms: int) -> None:
        check_fence_margin(fence_margin_ms)
        if wait_replicas < 0:
            raise ValueError(f"wait_replicas must be >= 0, got {wait_replicas!r}")
        if wait_timeout_ms <= 0:
            raise ValueError(f"wait_timeout_ms must be positive, got {wait_timeout_ms!r}")
        self.fence_margin_ms = fence_margin_ms
        self.wait_replicas = wait_replicas
        self.wait_timeout_ms = wait_timeout_ms

    @property
    def client(self) -> Client:
        raise NotImplementedError

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
        check_owner(owner, generation)
        check_ttl(ttl_ms)
        try:
            return self._do_acquire(keys, owner, generation, ttl_ms, meta)
        except REDIS_ERRORS as exc:
            raise LockUnavailableError(
                f"could not acquire {keys.lock}: {exc}", key=keys.lock, task_id=owner
            ) from exc

    def renew(self, items: Sequence[RenewItem]) -> list[RenewStatus]:
        """Renew every item still held by its owner and generation (see ``_do_renew``)."""
        if not items:
            return []
        try:  # the items were checked when made
            return self._do_renew(items)
        except REDIS_ERRORS as exc:
            raise LockUnavailableError(
                f"could not renew {len(items)} lock(s): {exc}", key=items[0].key
            ) from exc

    def release(
        self,
        key: str,
        owner: str,
        generation: int | None,
        token: int | None = None,
        ending: Ending | None = None,
    ) -> ReleaseStatus:
        """Delete ``key`` if ``owner`` holds it (any generation when ``generation`` is None), with
        the fencing token ``token`` (any token when None: see :class:`RenewItem`). ``ending``:
        the completion record and at-least window a finished run leaves (core/completion.py)."""
        check_owner(owner, 0 if generation is None else generation)
        args = release_args(key, owner, generation, token, ending)
        return self._release(RELEASE, args, key, owner)

    def release_lost(
        self, key: str, owner: str, generation: int, at_least_ms: int = 0
    ) -> ReleaseStatus:
        """Delete ``key`` for a holder whose process is gone, unless it was handed over.

        Only if ``owner`` holds it with ``generation``, and not while its expiry is stretched
        past its ttl (a hand-over to a retry, which takes it over): ``HANDED_OVER`` then. With
        ``at_least_ms`` the lock stays as an at-least window (core/completion.py).
        """
        check_owner(owner, generation)
        args = release_lost_args(key, owner, generation, at_least_ms)
        return self._release(RELEASE_LOST, args, key, owner)

    def holder(self, key: str) -> dict[str, str]:
        """The lock's hash (owner, gen, token, since, ttl, metadata); empty when free."""
        items = self.client.hgetall(key).items()
        return {_wire.as_text(k): _wire.as_text(v) for k, v in items}

    def run_script(self, lua: _wire.Script, args: Sequence[Any]) -> Any:
        """One call of a package script beside the locks (see ``LockBackend.run_script``)."""
        return self._call(lua, args)

    # -- Redis round trips --------------------------------------------------------------

    def _release(self, lua: _wire.Script, args: list[Any], key: str, owner: str) -> ReleaseStatus:
        try:
            return ReleaseStatus(int(self._call(lua, args)))
        except REDIS_ERRORS as exc:
            raise LockUnavailableError(
                f"could not release {key}: {exc}", key=key, task_id=owner
            ) from exc

    def _do_acquire(
        self,
        keys: LockKeys,
        owner: str,
        generation: int,
        ttl_ms: int,
        meta: Mapping[str, str] | None,
    ) -> Acquired | Contended:
        call = acquire_call(keys, owner, generation, ttl_ms, self.fence_margin_ms, meta)
        if not self.wait_replicas:
            return acquire_outcome(self._call(*call), None, owner)
        reply, replicas = self._acquire_waiting(keys.lock, call)
        outcome = acquire_outcome(reply, replicas, owner)
        if replicas < self.wait_replicas:
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

    # -- how a call reaches Redis: per deployment ------------------------------------------

    def _call(self, lua: _wire.Script, args: Sequence[Any]) -> Any:
        """One script call; its reply, or raises its error."""
        raise NotImplementedError

    def _do_renew(self, items: Sequence[RenewItem]) -> list[RenewStatus]:
        raise NotImplementedError

    def _acquire_waiting(self, key: str, call: AcquireCall) -> tuple[Any, int]:
        """The acquire script and ``WAIT`` (:func:`acquire_and_wait`) on the server holding
        ``key``."""
        raise NotImplementedError


class LockStore(ScriptStore):
    """Acquire, renew and release locks on one server (or a Sentinel's master), one round trip
    each; implements :class:`~.backend.LockBackend`.

    ``wait_replicas``: see :class:`ScriptStore`. Releases are then not written ahead
    (``WAIT`` counts the writes of its own connection).
    """

    def __init__(
        self,
        client: redis.Redis,
        fence_margin_ms: int = FENCE_MARGIN_MS,
        *,
        wait_replicas: int = 0,
        wait_timeout_ms: int = 1000,
    ) -> None:
        super().__init__(fence_margin_ms, wait_replicas, wait_timeout_ms)
        self._client = client
        #: releases written now whose replies are read later
        self._ahead: SendAhead | None = None if wait_replicas else SendAhead(client)

    @property
    def client(self) -> redis.Redis:
        """The server's client (a Sentinel's: it follows the master)."""
        return self._client

    def close(self) -> None:
        """Disconnect every connection of the client's pool, the one kept for releases written
        ahead included (and, through a Sentinel, those to the sentinels)."""
        _wire.disconnect(self._client)

    def release_ahead(  # noqa: PLR0917 - release's arguments, and the tag
        self,
        key: str,
        owner: str,
        generation: int | None,
        tag: Any,
        token: int | None = None,
        ending: Ending | None = None,
    ) -> bool:
        """Write the release of ``key`` now; its reply is read later, ``tag`` with it.

        The lock is free as soon as Redis reads the release; :meth:`collect_released` (or the
        next acquire of this store, which is sent after it on the same connection and reads
        its reply) hands back ``(tag, status)``. False, with nothing sent, under
        ``wait_replicas`` or when the connection failed: release it some other way then.
        """
        check_owner(owner, 0 if generation is None else generation)
        ahead = self._ahead
        if ahead is None:
            return False
        try:
            args = release_args(key, owner, generation, token, ending)
            ahead.send(RELEASE, args, (key, owner, tag))
        except REDIS_ERRORS:
            return False
        return True

    def collect_released(self) -> list[tuple[Any, ReleaseStatus | LockUnavailableError]]:
        """``(tag, status)`` of every :meth:`release_ahead` not yet collected, in order."""
        ahead = self._ahead
        if ahead is None:
            return []
        return [
            (tag, release_outcome((key, owner), reply))
            for (key, owner, tag), reply in ahead.collect()
        ]

    def release_many(
        self, items: Sequence[ReleaseItem]
    ) -> list[ReleaseStatus | LockUnavailableError]:
        """Release several ``(key, owner, generation, token)`` locks, each owner-checked, in one
        pipeline. Each item gets its status, or the error that kept it from being released
        (the lock then expires after its ttl)."""
        check_releases(items)
        if not items:
            return []
        try:
            replies = _wire.pipeline(self.client, [(RELEASE, release_args(*i)) for i in items])
        except REDIS_ERRORS as exc:
            error = LockUnavailableError(
                f"could not release {len(items)} lock(s): {exc}", key=items[0][0]
            )
            return [error] * len(items)
        return [release_outcome(item, reply) for item, reply in zip(items, replies, strict=True)]

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
        free before the acquire looks at it. Under ``wait_replicas`` the two calls one after
        the other. Raises as :meth:`acquire` when the acquire could not be made.
        """
        if not releases:
            return [], self.acquire(keys, owner, generation, ttl_ms, meta)
        if self._ahead is None:
            return self.release_many(releases), self.acquire(keys, owner, generation, ttl_ms, meta)
        check_owner(owner, generation)
        check_ttl(ttl_ms)
        check_releases(releases)
        calls = [(RELEASE, release_args(*item)) for item in releases]
        calls.append(acquire_call(keys, owner, generation, ttl_ms, self.fence_margin_ms, meta))
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
            release_outcome(item, r) for item, r in zip(releases, replies[:-1], strict=True)
        ]
        return outcomes, acquire_outcome(reply, None, owner)

    def holder(self, key: str) -> dict[str, str]:
        """The lock's hash (owner, gen, token, since, ttl, metadata); empty when free."""
        items = self.client.hgetall(key).items()
        return {_wire.as_text(k): _wire.as_text(v) for k, v in items}

    # -- Redis round trips --------------------------------------------------------------

    def _acquire_waiting(self, key: str, call: AcquireCall) -> tuple[Any, int]:
        return acquire_and_wait(self.client, call, self.wait_replicas, self.wait_timeout_ms)

    def _call(self, lua: _wire.Script, args: Sequence[Any]) -> Any:
        """One script call: on the send-ahead connection when the store has one (after the
        releases written ahead), else through the client. One call at a time on that
        connection: a thread that finds it busy waits, so a call never overtakes a release
        written before it."""
        if self._ahead is None:
            return _wire.evalsha(self.client, lua, args)
        reply = self._ahead.call_one(lua, args)
        if isinstance(reply, Exception):
            raise reply
        return reply

    def _do_renew(self, items: Sequence[RenewItem]) -> list[RenewStatus]:
        groups = renew_groups(items, range(len(items)))
        # one round trip still; the server serves other clients between the calls
        calls = [_RenewCall(RENEW.sha, items, group) for group in groups]
        replies = _wire.send_then_read(self.client, RENEW, calls)
        statuses = [RenewStatus.RENEWED] * len(items)
        for group, reply in zip(groups, replies, strict=True):
            if isinstance(reply, Exception):
                raise reply
            fill_failures(statuses, group, reply)
        return statuses


#: One acquire: the script (acquire.lua, or acquire_permit.lua for permits > 1) and its args.
AcquireCall: TypeAlias = "tuple[_wire.Script, list[Any]]"


def acquire_call(  # noqa: PLR0917 - acquire's arguments
    keys: LockKeys,
    owner: str,
    generation: int,
    ttl_ms: int,
    fence_margin_ms: int,
    meta: Mapping[str, str] | None,
) -> AcquireCall:
    """The script call taking ``keys``: acquire.lua for one permit; acquire_permit.lua, which
    takes a free slot of ``keys.permits`` in the same one call, for more, and under a rate
    (which it counts in that call: core/rates.py)."""
    args = acquire_args(keys, owner, generation, ttl_ms, fence_margin_ms, meta)
    if keys.permits == 1 and keys.rate is None:
        return ACQUIRE, args
    slots = keys.slots  # KEYS: the record, the counter, the rate record, the slots
    return ACQUIRE_PERMIT, [
        len(slots) + 3,
        args[3],
        keys.fence,
        rate_key(keys.lock),
        *slots,
        *args[4:8],
        *(keys.rate or (0, 0)),
        *args[8:],
    ]


def acquire_and_wait(
    node: redis.Redis, call: AcquireCall, replicas: int, timeout_ms: int
) -> tuple[Any, int]:
    """The acquire script and ``WAIT`` in one pipeline on the server holding the lock (``WAIT``
    counts the writes of its own connection): the reply, and how many replicas acknowledged.
    Raises the script's error (``MOVED`` on a cluster whose slot map is stale)."""
    replies = _wire.pipeline_then(node, call, ("WAIT", replicas, timeout_ms))
    reply, acknowledged = replies
    if isinstance(reply, Exception):
        raise reply
    if isinstance(acknowledged, Exception):  # the lock is ours; only the count is missing
        acknowledged = 0
    return reply, int(acknowledged)


@dataclass(frozen=True)
class _RenewCall:
    """One renew.lua call, packed when called (by :func:`._wire.send_then_read`): the same bytes
    as ``EVALSHA sha`` with :func:`.backend.renew_args`, from the items' packed arguments."""

    sha: str
    items: Sequence[RenewItem]
    group: Sequence[int]

    def __call__(self) -> bytes:
        items, group = self.items, self.group
        packed = [items[index].packed for index in group]
        parts = [b"*%d\r\n$7\r\nEVALSHA\r\n" % (4 * len(group) + 4), _wire.bulk(self.sha)]
        parts.append(_wire.bulk(len(group)))
        parts += [key for key, _ in packed]
        parts.append(_wire.bulk(items[group[0]].ttl_ms))
        parts += [holder for _, holder in packed]
        return b"".join(parts)
