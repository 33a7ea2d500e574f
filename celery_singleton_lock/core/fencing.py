"""Fenced writes: let the store reject a write from a run that lost its lock.

A lock can be lost while its task still runs (a long pause, a partition). The fencing
token (``self.singleton.fencing_token``) is strictly increasing per lock key, so a store
that remembers the largest token it accepted can refuse writes that carry a smaller one.

:func:`fenced_set` does that for a value kept in Redis. For SQL, guard the UPDATE with
the token column (see docs/internals.md, "Fencing tokens")::

    UPDATE accounts SET balance = :balance, fence_token = :token
     WHERE id = :id AND fence_token < :token

and treat "0 rows updated" as "a newer run already wrote". Knows nothing of Celery.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis

from ..errors import LockUnavailableError
from . import _wire

__all__ = ["FencedWrite", "fenced_get", "fenced_set"]

FENCED_SET = _wire.script("fenced_set.lua")


@dataclass(frozen=True)
class FencedWrite:
    """Whether the write landed, and the token the record now carries."""

    written: bool
    token: int


def fenced_set(
    client: redis.Redis, key: str, value: str | bytes, token: int, ttl_ms: int = 0
) -> FencedWrite:
    """Set ``key`` to ``value`` unless a write with a token >= ``token`` already landed."""
    if isinstance(token, bool) or not isinstance(token, int) or token <= 0:
        raise ValueError(
            f"token must be a positive int (self.singleton.fencing_token), got {token!r}"
        )
    try:
        reply = _wire.evalsha(client, FENCED_SET, [1, key, value, token, max(0, ttl_ms)])
    except redis.RedisError as exc:
        raise LockUnavailableError(f"fenced write to {key} failed: {exc}", key=key) from exc
    return FencedWrite(bool(reply[0]), int(reply[1]))


def fenced_get(client: redis.Redis, key: str) -> tuple[bytes | str | None, int | None]:
    """The value and token of a record written by :func:`fenced_set` (``None``s if absent)."""
    value, token = client.hmget(key, ["value", "token"])
    return value, None if token is None else int(token)
