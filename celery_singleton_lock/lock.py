"""The lock primitive: owner-checked acquire, renew and release over one Redis client.

Knows nothing of Celery. An *owner* is an opaque string (the Celery glue passes the task
id) and a *generation* an integer (the glue passes the retries count): the same owner may
take its lock over from an earlier generation, which is how a retried task re-enters the
lock its previous run still holds.

Public methods validate their input; the ``_do_*`` methods talk to Redis. Every Redis
call runs a Lua script from ``lua/`` that checks the owner before it writes.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

import redis

from .errors import LockUnavailableError
from .keys import LockKeys

__all__ = [
    "FENCE_TTL_MS",
    "Acquired",
    "Contended",
    "LockStore",
    "ReleaseStatus",
    "RenewItem",
    "RenewStatus",
]

#: How long a fencing counter outlives the last acquire of its lock. Tokens stay
#: increasing after it expires because they never fall below the server's clock.
FENCE_TTL_MS = 7 * 24 * 3600 * 1000


@dataclass(frozen=True)
class Acquired:
    """The lock is ours; ``token`` is its fencing token for this run."""

    token: int
    reentered: bool


@dataclass(frozen=True)
class Contended:
    """Another owner (or another run of the same generation) holds the lock."""

    holder: str
    holder_generation: int
    holder_token: int | None
    pttl_ms: int


@dataclass(frozen=True)
class RenewItem:
    """One lock to renew: the key, who must hold it, and the ttl to set."""

    key: str
    owner: str
    generation: int
    ttl_ms: int


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


def load_script(name: str) -> str:
    return resources.files(__package__).joinpath("lua").joinpath(name).read_text(encoding="utf-8")


class LockStore:
    """Acquire, renew and release locks on one Redis client, one round trip each."""

    def __init__(self, client: redis.Redis, fence_ttl_ms: int = FENCE_TTL_MS) -> None:
        if fence_ttl_ms <= 0:
            raise ValueError(f"fence_ttl_ms must be positive, got {fence_ttl_ms!r}")
        self.client = client
        self.fence_ttl_ms = fence_ttl_ms
        self._acquire = client.register_script(load_script("acquire.lua"))
        self._renew = client.register_script(load_script("renew.lua"))
        self._release = client.register_script(load_script("release.lua"))

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
        fields: list[str] = []
        for field, value in (meta or {}).items():
            fields += [field, value]
        try:
            return self._do_acquire(keys, owner, generation, ttl_ms, fields)
        except redis.RedisError as exc:
            raise LockUnavailableError(
                f"could not acquire {keys.lock}: {exc}", key=keys.lock, task_id=owner
            ) from exc

    def renew(self, items: Sequence[RenewItem]) -> list[RenewStatus]:
        """Renew every item still held by its owner and generation, in one round trip."""
        if not items:
            return []
        for item in items:
            _check_owner(item.owner, item.generation)
            if item.ttl_ms <= 0:
                raise ValueError(f"ttl_ms must be positive, got {item.ttl_ms!r}")
        try:
            return self._do_renew(items)
        except redis.RedisError as exc:
            raise LockUnavailableError(
                f"could not renew {len(items)} lock(s): {exc}", key=items[0].key
            ) from exc

    def release(self, key: str, owner: str, generation: int | None) -> ReleaseStatus:
        """Delete ``key`` if ``owner`` holds it (any generation when ``generation`` is None)."""
        _check_owner(owner, 0 if generation is None else generation)
        try:
            return self._do_release(key, owner, generation)
        except redis.RedisError as exc:
            raise LockUnavailableError(
                f"could not release {key}: {exc}", key=key, task_id=owner
            ) from exc

    def holder(self, key: str) -> dict[str, str]:
        """The lock's hash (owner, gen, token, since, renewals, metadata); empty when free."""
        return {as_text(k): as_text(v) for k, v in self.client.hgetall(key).items()}

    # -- Redis round trips --------------------------------------------------------------

    def _do_acquire(
        self, keys: LockKeys, owner: str, generation: int, ttl_ms: int, fields: list[str]
    ) -> Acquired | Contended:
        reply: list[Any] = self._acquire(
            keys=[keys.lock, keys.fence],
            args=[owner, generation, ttl_ms, self.fence_ttl_ms, *fields],
        )
        if reply[0] == 1:
            return Acquired(token=int(reply[1]), reentered=bool(reply[2]))
        holder = as_text(reply[1])
        token = None if reply[3] is None else int(reply[3])
        return Contended(holder, int(reply[2]), token, int(reply[4]))

    def _do_renew(self, items: Sequence[RenewItem]) -> list[RenewStatus]:
        args: list[str | int] = []
        for item in items:
            args += [item.owner, item.generation, item.ttl_ms]
        reply: list[int] = self._renew(keys=[item.key for item in items], args=args)
        return [RenewStatus(status) for status in reply]

    def _do_release(self, key: str, owner: str, generation: int | None) -> ReleaseStatus:
        gen = "" if generation is None else generation
        return ReleaseStatus(int(self._release(keys=[key], args=[owner, gen])))


def as_text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _check_owner(owner: str, generation: int) -> None:
    if not owner:
        raise ValueError("owner must be a non-empty string")
    if generation < 0:
        raise ValueError(f"generation must be >= 0, got {generation!r}")
