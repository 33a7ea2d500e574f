"""The keys that hold a call back beside a lock, for the ``celery singleton`` command.

Three kinds of key stand for calls that wait on a key without holding its lock, each with a ttl
of its own and the lock's hash tag (so the same cluster slot), and each may outlive the lock:

=========  ===============================================================================
kind       what it is
=========  ===============================================================================
queued     ``{prefix}{tag}:queued``, a string: the publish-time marker of a call published
           under ``singleton_lock_on="publish"`` and not started (publish/dedup.py). While it
           lives, ``delay()`` of the same arguments publishes nothing
pending    ``{prefix}{tag}:pending``, a hash: the coalesced follow-up left by duplicates
           (core/pending.py); its ``id`` and ``count``
joiners    ``{prefix}{tag}:joiners``, a hash: the calls that joined a run (core/joiners.py),
           field the joiner's task id, value ``<holder>|<serial>|<record>``
=========  ===============================================================================

Found with ``SCAN MATCH <prefix>{*}:<kind>`` and kept only when the lock key beside them is a
lock key of this library under the prefix and the value has the kind's shape (a string; a hash
with an ``id``; a hash of ``<holder>|<serial>|...`` values): an application's key that happens
to match the glob is skipped, never shown. Only a queued marker may be released by hand
(:func:`release_marker`, compare-and-delete on the task id shown): a pending follow-up or a
joiner is a call somebody made, published or completed by the release of its lock.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from . import _wire
from ._wire import as_text
from .backend import Client
from .joiners import JOINERS_NAME
from .keys import check_prefix, lock_key_problem, safe_name

__all__ = [
    "KINDS",
    "Marker",
    "check_marker_key",
    "iter_markers",
    "marker_key_problem",
    "read_marker",
    "release_marker",
]

#: The kinds, in the order they are listed: the key's last part.
KINDS = ("queued", "pending", JOINERS_NAME)
UNQUEUE = _wire.script("unqueue.lua")
_JOINER_VALUE = re.compile(rb"([^|]+)\|[0-9]+\|", re.DOTALL)
_BATCH = 500


@dataclass(frozen=True)
class Marker:
    """One key of :data:`KINDS` as read from Redis."""

    key: str
    #: ``queued``, ``pending`` or ``joiners``
    kind: str
    #: the lock key it stands beside (which may not exist)
    lock_key: str
    #: the task name in the key (its safe form), or the pending record's ``task`` field
    task: str | None
    #: seconds until it expires; None when the key has no expiry
    ttl_s: float | None
    #: queued: the task id of the call it marks; joiners: the holder the first joiner met
    call: str | None = None
    #: pending: the follow-up's task id and how many duplicates it collapses
    pending_follow_up: str | None = None
    pending_count: int | None = None
    #: joiners: how many calls wait for the run's outcome
    joiners: int | None = None

    def as_dict(self) -> dict[str, Any]:
        """The fields as a JSON-friendly dict; ``state`` is the kind (as a lock's is
        ``running`` or ``window``)."""
        return {**asdict(self), "state": self.kind}


def _split(key: str) -> tuple[str, str] | None:
    """``(lock key, kind)`` of a key ending in ``:<kind>``, else None."""
    head, _, kind = key.rpartition(":")
    return (f"{head}:lock", kind) if head and kind in KINDS else None


def marker_key_problem(prefix: str, key: str, kinds: Sequence[str] = KINDS) -> str | None:
    """None when ``key`` has the shape of a marker of one of ``kinds`` beside a lock key of
    this library under ``prefix``; else why not, worded to follow "<key> is ..."."""
    found = _split(key)
    if found is None or found[1] not in kinds:
        return "not a marker key"
    return lock_key_problem(prefix, found[0])


def check_marker_key(key: str, prefix: str) -> None:
    """Raise ValueError unless ``key`` is the shape of a queued marker under ``prefix``."""
    problem = marker_key_problem(prefix, key, ("queued",))
    if problem is not None:
        raise ValueError(f"{key!r} is {problem}")


def _task_from_key(lock_key: str, prefix: str) -> str:
    return lock_key[len(prefix) + 1 :].split(":", 1)[0]


def _pattern(prefix: str, kind: str, task: str | None, scope: str | None) -> str:
    check_prefix(prefix)
    name = "*" if task is None else f"{safe_name(scope or task)}:*"
    return f"{prefix}{{{name}}}:{kind}"


def _read(client: Client, keys: Sequence[str], prefix: str) -> list[Marker]:
    """Each key's value and PTTL in one pipeline; keys gone or of another shape dropped."""
    pipe = client.pipeline(transaction=False)
    for key in keys:
        kind = key.rpartition(":")[2]
        if kind == "queued":
            pipe.get(key)
        elif kind == "pending":
            pipe.hmget(key, "id", "count", "task")
        else:
            pipe.hvals(key)
        pipe.pttl(key)
    replies: list[Any] = pipe.execute(raise_on_error=False)
    found = []
    for index, key in enumerate(keys):
        value, pttl = replies[2 * index : 2 * index + 2]
        if isinstance(value, Exception) or isinstance(pttl, Exception) or not value:
            continue  # gone since the SCAN, or another type (an application's key)
        lock_key, kind = key.rsplit(":", 1)[0] + ":lock", key.rpartition(":")[2]
        ttl = None if int(pttl) < 0 else int(pttl) / 1000
        task = _task_from_key(lock_key, prefix)
        if kind == "queued":
            found.append(Marker(key, kind, lock_key, task, ttl, call=as_text(value)))
        elif kind == "pending":
            follow_up, count, named = value
            if follow_up is None:
                continue
            found.append(
                Marker(
                    key,
                    kind,
                    lock_key,
                    task if named is None else as_text(named),
                    ttl,
                    pending_follow_up=as_text(follow_up),
                    pending_count=None if count is None else int(count),
                )
            )
        else:
            raw = [v if isinstance(v, bytes) else str(v).encode() for v in value]
            met = [_JOINER_VALUE.match(v) for v in raw]
            if not all(met):
                continue
            holder = as_text(met[0].group(1)) if met[0] else None
            found.append(Marker(key, kind, lock_key, task, ttl, call=holder, joiners=len(raw)))
    return found


def iter_markers(
    client: Client,
    prefix: str,
    task: str | None = None,
    *,
    scope: str | None = None,
    batch: int = _BATCH,
) -> Iterator[Marker]:
    """Every queued marker, then every pending record, then every joiners hash under
    ``prefix`` (with ``task``: those whose key carries its name, or its ``scope``'s)."""
    for kind in KINDS:
        seen: set[str] = set()
        chunk: list[str] = []
        for raw in client.scan_iter(match=_pattern(prefix, kind, task, scope), count=batch):
            key = as_text(raw)
            if key in seen or marker_key_problem(prefix, key) is not None:
                continue
            seen.add(key)
            chunk.append(key)
            if len(chunk) >= batch:
                yield from _read(client, chunk, prefix)
                chunk = []
        if chunk:
            yield from _read(client, chunk, prefix)


def read_marker(client: Client, key: str, prefix: str) -> Marker | None:
    """The queued marker at ``key``, None when there is none; ValueError (before any read)
    when ``key`` is not a queued marker's key under ``prefix``, or (after a ``TYPE``) when what
    is there is not a string."""
    check_marker_key(key, prefix)
    kind = as_text(client.type(key))
    if kind == "none":
        return None
    if kind != "string":
        raise ValueError(f"{key!r} is not a publish-time marker of this library (a {kind})")
    found = _read(client, [key], prefix)
    return found[0] if found else None


def release_marker(client: Client, marker: Marker) -> int:
    """Delete the queued marker only if it still names the task id shown: 1 deleted, 0 gone,
    -1 it names another call now (left alone)."""
    return int(_wire.evalsha(client, UNQUEUE, [1, marker.key, marker.call or ""]))
