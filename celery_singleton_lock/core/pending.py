"""The pending follow-up of a lock: what ``singleton_on_duplicate="coalesce"`` leaves beside it.

A duplicate that meets a held lock under the coalesce policy does not run: it writes its call
into the lock's *pending record* ``{prefix}{tag}:pending`` (a hash, the same hash tag as the
lock, so the same cluster slot) and ends. Every later duplicate overwrites the call, so the
record holds the latest one; its ``id`` (the follow-up's task id) and ``count`` (duplicates
coalesced) are kept across the burst. Three scripts, each one round trip:

- ``coalesce.lua`` (:func:`leave_pending`) writes it, only while the run the duplicate met still
  holds the lock (owner-checked): a record is never written after that run's release looked.
- ``take_pending.lua`` (:func:`take_pending`) takes and deletes it, only while no run holds the
  lock. Whoever gets it publishes the follow-up; nobody else can get it (exactly once).
- ``put_back_pending.lua`` (:func:`put_back`) returns a record whose publish failed, unless a
  newer one was left meanwhile.

The record outlives the lock by :data:`PENDING_TTL_MS`, so a lock that expired (its holder's
worker killed outright) still has its follow-up for whoever releases or takes the key next.
Knows nothing of Celery: the call's fields are the caller's (coalesce.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ._wire import Script, as_text, script
from .completion import done_key

__all__ = [
    "PENDING_SUFFIX",
    "PENDING_TTL_MS",
    "Done",
    "Left",
    "leave_pending",
    "lock_key_of",
    "pending_key",
    "put_back",
    "take_pending",
]

#: How long a pending record outlives the lock it was left beside.
PENDING_TTL_MS = 24 * 3600 * 1000

_LOCK_SUFFIX = ":lock"
#: what :func:`pending_key` puts in place of a lock key's ``:lock``
PENDING_SUFFIX = ":pending"

#: ``run_script`` of a store (``LockBackend.run_script``)
Run = Callable[[Script, Sequence[Any]], Any]

#: A coalesced duplicate's message: its task id, generation and how long its completion is
#: kept, ms (core/completion.py)
Done = tuple[str, int, int]


@dataclass(frozen=True)
class Left:
    """What :func:`leave_pending` found: ``follow_up`` (its task id) and ``count`` when the
    call was left; else ``pttl_ms`` of the lock (-2: gone) and ``finished`` (an at-least
    window)."""

    follow_up: str | None
    count: int = 0
    pttl_ms: int = -2
    finished: bool = False


def pending_key(lock_key: str) -> str:
    """``{prefix}{tag}:pending`` beside ``{prefix}{tag}:lock`` (``<key>:pending`` beside a key
    of another shape)."""
    base = lock_key[: -len(_LOCK_SUFFIX)] if lock_key.endswith(_LOCK_SUFFIX) else lock_key
    return f"{base}{PENDING_SUFFIX}"


def lock_key_of(pending: str) -> str:
    """The lock key a pending record ``{prefix}{tag}:pending`` was left beside (the inverse of
    :func:`pending_key` for lock keys)."""
    if not pending.endswith(PENDING_SUFFIX):
        raise ValueError(f"{pending!r} is not a pending record's key")
    return pending[: -len(PENDING_SUFFIX)] + _LOCK_SUFFIX


def leave_pending(  # noqa: PLR0917 - the duplicate's call, and what it leaves behind
    run: Run,
    lock_key: str,
    holder: str,
    follow_up: str,
    call: Mapping[str, str | bytes],
    duplicate: Done | None = None,
) -> Left:
    """Leave ``call`` as the follow-up of ``lock_key`` if ``holder`` still holds it; with
    ``duplicate``, also record the duplicate's message as completed (the follow-up carries
    its call: a copy of it is dropped, not run again)."""
    owner, generation, keep_ms = duplicate or ("", 0, 0)
    args: list[Any] = [
        3,
        lock_key,
        pending_key(lock_key),
        done_key(lock_key, owner),
        holder,
        follow_up,
        PENDING_TTL_MS,
        generation,
        keep_ms if owner else 0,
    ]
    for item in call.items():
        args += item
    reply = run(script("coalesce.lua"), args)
    if int(reply[0]) == 1:
        return Left(as_text(reply[1]), int(reply[2]))
    return Left(None, pttl_ms=int(reply[1]), finished=int(reply[2]) == 1)


def take_pending(run: Run, lock_key: str) -> dict[str, bytes] | None:
    """The pending record of ``lock_key``, taken (deleted), if no run holds the lock."""
    reply = run(script("take_pending.lua"), [2, lock_key, pending_key(lock_key)])
    if not reply:
        return None
    return {as_text(reply[i]): _raw(reply[i + 1]) for i in range(0, len(reply), 2)}


def put_back(run: Run, lock_key: str, record: Mapping[str, str | bytes]) -> bool:
    """Return a taken record whose follow-up could not be published; False when a newer record
    is there (it is published instead)."""
    args: list[Any] = [1, pending_key(lock_key), PENDING_TTL_MS]
    for item in record.items():
        args += item
    return int(run(script("put_back_pending.lua"), args)) == 1


def _raw(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else value
