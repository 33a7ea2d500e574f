"""The pending follow-up of a lock: what ``singleton_on_duplicate="coalesce"`` leaves beside it.

A duplicate that meets a held lock under the coalesce policy does not run: it writes its call
into the lock's *pending record* ``{prefix}{tag}:pending`` (a hash, the same hash tag as the
lock, so the same cluster slot; one per key, whatever its ``singleton_permits``) and ends.
Every later duplicate overwrites the call, so the record holds the latest one; its ``id`` (the
follow-up's task id) and ``count`` (duplicates coalesced) are kept across the burst, and
``holders`` names the runs that held the key's slots at the latest write. Three scripts, each
one round trip, each given the lock's key or all N of its permit slots:

- ``coalesce.lua`` (:func:`leave_pending`) writes it, only while every slot is held by a run,
  the one the duplicate met among them (owner-checked): a record is never written after the
  release that would take it looked.
- ``take_pending.lua`` (:func:`take_pending`) takes and deletes it, only while a slot is not
  held by a run (one permit: the lock is free). Whoever gets it publishes the follow-up;
  nobody else can get it (exactly once).
- ``put_back_pending.lua`` (:func:`put_back`) returns a record whose publish failed, unless a
  newer one was left meanwhile.

The record outlives the lock by :data:`PENDING_TTL_MS`, so a lock that expired (its holder's
worker killed outright) still has its follow-up for whoever releases or takes the key next. A
record taken at the release of a run that is not among its ``holders`` is *superseded*
(:func:`superseded_by`): that run took its slot after every call the record carries.
Knows nothing of Celery: the call's fields are the caller's (duplicates/coalesce.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ._wire import Script, as_text, script
from .completion import done_key
from .keys import LockKeys, beside

__all__ = [
    "HOLDERS_FIELD",
    "PENDING_SUFFIX",
    "PENDING_TTL_MS",
    "Done",
    "Left",
    "holders_of",
    "leave_pending",
    "lock_key_of",
    "pending_key",
    "put_back",
    "superseded_by",
    "take_pending",
]

#: How long a pending record outlives the lock it was left beside.
PENDING_TTL_MS = 24 * 3600 * 1000

_LOCK_SUFFIX = ":lock"
#: what :func:`pending_key` puts in place of a lock key's ``:lock``
PENDING_SUFFIX = ":pending"
#: the record's field naming the runs that held the key's slots at its latest write
HOLDERS_FIELD = "holders"

#: ``run_script`` of a store (``LockBackend.run_script``)
Run = Callable[[Script, Sequence[Any]], Any]

#: A coalesced duplicate's message: its task id, generation and how long its completion is
#: kept, ms (core/completion.py)
Done = tuple[str, int, int]


@dataclass(frozen=True)
class Left:
    """What :func:`leave_pending` found: ``follow_up`` (its task id) and ``count`` when the
    call was left; else ``pttl_ms`` of the slot that let go (-2: gone) and ``finished`` (an
    at-least window)."""

    follow_up: str | None
    count: int = 0
    pttl_ms: int = -2
    finished: bool = False


def pending_key(lock_key: str) -> str:
    """``{prefix}{tag}:pending`` beside ``{prefix}{tag}:lock`` or any of its permit slots
    ``...:lock:<i>`` (``<key>:pending`` beside a key of another shape)."""
    return beside(lock_key, PENDING_SUFFIX[1:])


def lock_key_of(pending: str) -> str:
    """The lock key a pending record ``{prefix}{tag}:pending`` was left beside (the inverse of
    :func:`pending_key` for lock keys)."""
    if not pending.endswith(PENDING_SUFFIX):
        raise ValueError(f"{pending!r} is not a pending record's key")
    return pending[: -len(PENDING_SUFFIX)] + _LOCK_SUFFIX


def leave_pending(  # noqa: PLR0917 - the duplicate's call, and what it leaves behind
    run: Run,
    keys: LockKeys,
    holder: str,
    follow_up: str,
    call: Mapping[str, str | bytes],
    duplicate: Done | None = None,
) -> Left:
    """Leave ``call`` as the follow-up of ``keys`` if every slot is held by a run, ``holder``
    among them; with ``duplicate``, also record the duplicate's message as completed (the
    follow-up carries its call: a copy of it is dropped, not run again)."""
    owner, generation, keep_ms = duplicate or ("", 0, 0)
    slots = keys.slots
    args: list[Any] = [
        2 + len(slots),
        pending_key(keys.lock),
        done_key(keys.lock, owner),
        *slots,
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


def take_pending(run: Run, keys: LockKeys) -> dict[str, bytes] | None:
    """The pending record of ``keys``, taken (deleted), if a slot is not held by a run."""
    slots = keys.slots
    reply = run(script("take_pending.lua"), [1 + len(slots), pending_key(keys.lock), *slots])
    if not reply:
        return None
    return {as_text(reply[i]): _raw(reply[i + 1]) for i in range(0, len(reply), 2)}


def put_back(run: Run, keys: LockKeys, record: Mapping[str, str | bytes]) -> bool:
    """Return a taken record whose follow-up could not be published; False when a newer record
    is there (it is published instead)."""
    args: list[Any] = [1, pending_key(keys.lock), PENDING_TTL_MS]
    for item in record.items():
        args += item
    return int(run(script("put_back_pending.lua"), args)) == 1


def holders_of(value: str | bytes | None) -> list[str] | None:
    """The owners a record's ``holders`` field names (one per slot of its key), or None for a
    record without one or with one that does not read as a list of names."""
    if value is None:
        return None
    try:
        holders = json.loads(value)
    except ValueError:
        return None
    if not isinstance(holders, list) or not all(isinstance(h, str) for h in holders):
        return None
    return holders


def superseded_by(record: Mapping[str, bytes], releaser: str | None) -> str | None:
    """``releaser`` when its release took a record it is not among the ``holders`` of: the
    record was left beside older runs (their node died, their locks expired) and ``releaser``
    took its slot after every call the record carries, so its run is newer and the follow-up
    would only run an older call after it. None when the record is the releaser's own, when
    nobody's run released (a purge, a run that never started) or the record names no holders
    (published as it is)."""
    if releaser is None:
        return None
    holders = holders_of(record.get(HOLDERS_FIELD))
    if holders is None or releaser in holders:
        return None
    return releaser


def _raw(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else value
