"""Look at and clean up the locks in Redis: the core of the ``celery singleton`` command.

Knows nothing of Celery: every function takes a redis-py client (``redis.Redis`` or
``RedisCluster``) and the key prefix. Locks are found with ``SCAN MATCH <prefix>{*}:lock*``
(never ``KEYS``), read in batches with one pipeline per batch, so it is safe on a big
database: a batch costs one SCAN page and one round trip. Only lock keys of this library under
the prefix are ever read or released (:func:`celery_singleton_lock.core.keys.lock_key_problem`):
the SCAN glob's ``*`` also matches ``}`` and ``:``, so what it finds is checked key by key,
and a key given by hand that is not one is refused (:func:`check_lock_key`). The keys beside a
lock that hold calls back (publish-time markers, pending follow-ups, joiners) are read by
:mod:`.markers`; :func:`stats` counts them.

Everything shown is read from the lock hash itself (written by ``lua/acquire.lua``) and its
``PTTL``: it lives in the lock's key, so in the lock's cluster slot, and goes with it. How long
ago a lock was last renewed is ``ttl`` minus its ``PTTL`` (the hash keeps no renewal count: a
write per lock per renewal cost a quarter of the server's renewal time).

====================  =====================================================================
hash field            meaning
====================  =====================================================================
``owner``             holder: the Celery task id
``gen``               the holder's retries count
``token``             fencing token of the holder's run
``since``             when it was taken, ms since the epoch (the Redis server's clock)
``ttl``               the ttl it is renewed to, ms (every renewal sets the key's expiry to it)
``task``              task name
``host``              the holder's worker node name (``name@host``)
``pid``               pid of the process running the task
``args``              a short preview of the arguments (``repr``, cut)
``ended``             only in an at-least window: when the run ended, ms since the epoch; the
                      key then expires at the window's end (core/completion.py)
``permit``            only in a permit slot (``<lock key>:<i>``, ``singleton_permits`` > 1):
                      the slot ``i``, 1 to ``permits``
``permits``           ... and how many runs of the key may hold a slot at once
====================  =====================================================================

A lock with ``ended`` is shown as state ``window`` (its run finished; the key stays blocked
until it expires), any other as ``running``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

from . import _wire
from ._wire import as_text
from .backend import Client
from .completion import ENDED_FIELD
from .keys import check_prefix, keys_of, lock_key_problem, safe_name
from .markers import Marker
from .pending import HOLDERS_FIELD, PENDING_SUFFIX, holders_of, lock_key_of, pending_key
from .queue import HANDED_FIELD, QUEUE_NAME, queue_keys

__all__ = [
    "ForceStatus",
    "LockInfo",
    "Orphan",
    "QueueOrphan",
    "Stats",
    "check_lock_key",
    "force_release",
    "iter_locks",
    "iter_orphans",
    "iter_queue_orphans",
    "lock_pattern",
    "read_lock",
    "stale_reason",
    "stats",
]

T = TypeVar("T")

#: Keys asked for per SCAN page, and read per pipeline.
BATCH = 500
FORCE_RELEASE = _wire.script("force_release.lua")


class ForceStatus(enum.IntEnum):
    """What a force release found."""

    RELEASED = 1
    GONE = 0
    CHANGED = -1


@dataclass(frozen=True)
class LockInfo:
    """One lock as read from Redis; a field is None when the hash does not have it."""

    key: str
    task: str | None
    args: str | None
    owner: str | None
    generation: int | None
    host: str | None
    pid: int | None
    token: int | None
    since_ms: int | None
    #: seconds since it was taken (Redis server clock)
    age_s: float | None
    #: seconds until it expires unless renewed; None when the key has no expiry
    ttl_s: float | None
    #: the ttl it is renewed to, seconds
    lease_s: float | None
    #: seconds since it was last renewed (or taken): ``lease_s - ttl_s``. A live holder renews
    #: every third of the ttl; negative when the key was given a longer expiry than its ttl (a
    #: lock handed over to a retry is stretched over the countdown). None without a ttl field
    #: or without an expiry
    renewed_s: float | None
    #: only in an at-least window: when the run ended, ms since the epoch (server clock)
    ended_ms: int | None = None
    #: under the coalesce policy: the task id of the follow-up waiting beside the lock
    #: (core/pending.py), and how many duplicates it collapses; one per key, so every permit
    #: slot of a key shows the same
    pending_follow_up: str | None = None
    pending_count: int | None = None
    #: a slot of a key taken with ``singleton_permits`` > 1: which one (1 to ``permits``)
    permit: int | None = None
    #: ... and how many runs the key admits at once; both None for a single lock
    permits: int | None = None
    #: under the queue policy (core/queue.py): how many calls wait in the key's queue (one
    #: queue per key: every slot shows the same), and the next one's task id
    queue_length: int | None = None
    queue_head: str | None = None
    #: the lock was handed to the queued call ``owner``: it waits for that call's message
    handed: bool = False

    @property
    def state(self) -> str:
        """``"window"``: the run finished and the key is held for its at-least window (it
        expires by itself, nobody renews it); ``"running"``: a run holds it."""
        return "running" if self.ended_ms is None else "window"

    def as_dict(self) -> dict[str, Any]:
        """The fields as a JSON-friendly dict, the ``state``, and ``kind`` ``"lock"`` (a
        marker's object, core/markers.py, has its own kind)."""
        return {**asdict(self), "state": self.state, "kind": "lock"}


def lock_pattern(prefix: str, task: str | None = None, scope: str | None = None) -> str:
    """The SCAN MATCH pattern of every lock under ``prefix`` (of ``task`` only, if given).

    A task of a ``singleton_scope`` has the scope's name in its keys, not its own: give
    ``scope`` too. ``check_prefix`` keeps glob characters out of prefixes and ``safe_name``
    out of task names, so the pattern matches literally. Different task names may share a
    safe name (and the tasks of a scope share its keys): :func:`iter_locks` also compares
    the ``task`` field.
    """
    check_prefix(prefix)
    name = "*" if task is None else f"{safe_name(scope or task)}:*"
    return f"{prefix}{{{name}}}:lock*"  # and the permit slots, ``:lock:<i>``


def check_lock_key(key: str, prefix: str) -> None:
    """Raise ValueError, naming ``key`` and why, unless it is a lock key under ``prefix``."""
    problem = lock_key_problem(prefix, key)
    if problem is not None:
        raise ValueError(f"{key!r} is {problem}")


def _int(value: str | None) -> int | None:
    try:
        return None if value is None else int(value)
    except ValueError:
        return None


def _task_from_key(key: str, prefix: str) -> str | None:
    """The readable task name inside the key's hash tag (locks written without a task field)."""
    tag = key[len(prefix) :]
    if tag.startswith("{") and ":" in tag:
        return tag[1:].split(":", 1)[0]
    return None


def _info(  # noqa: PLR0917 - what one pipeline read of a lock gives
    key: str,
    fields: dict[str, str],
    pttl: int,
    now_ms: int,
    prefix: str,
    pending: Sequence[Any] = (None, None),
    queue: Sequence[Any] = (0, ()),
) -> LockInfo:
    since = _int(fields.get("since"))
    length, head = int(queue[0] or 0), list(queue[1] or ())
    lease = _int(fields.get("ttl"))
    return LockInfo(
        key=key,
        task=fields.get("task") or _task_from_key(key, prefix),
        args=fields.get("args"),
        owner=fields.get("owner"),
        generation=_int(fields.get("gen")),
        host=fields.get("host"),
        pid=_int(fields.get("pid")),
        token=_int(fields.get("token")),
        since_ms=since,
        age_s=None if since is None else max(0.0, (now_ms - since) / 1000),
        ttl_s=None if pttl < 0 else pttl / 1000,
        lease_s=None if lease is None else lease / 1000,
        renewed_s=None if lease is None or pttl < 0 else (lease - pttl) / 1000,
        ended_ms=_int(fields.get(ENDED_FIELD)),
        pending_follow_up=None if pending[0] is None else as_text(pending[0]),
        pending_count=None if pending[1] is None else int(pending[1]),
        permit=_int(fields.get("permit")),
        permits=_int(fields.get("permits")),
        queue_length=length or None,
        queue_head=as_text(head[0]) if head else None,
        handed=fields.get(HANDED_FIELD) is not None,
    )


def _server_ms(client: Client) -> int:
    seconds, micros = client.time()  # on a cluster: one node's clock
    return int(seconds) * 1000 + int(micros) // 1000


def _read_batch(client: Client, keys: Sequence[str], prefix: str) -> list[LockInfo]:
    """HGETALL and PTTL of every key, its pending follow-up's id and count (coalesce) and its
    queue's length and head (queue), in one pipeline; keys gone or not hashes are dropped."""
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.hgetall(key)
        pipe.pttl(key)
        pipe.hmget(pending_key(key), "id", "count")
        line, _ = queue_keys(key)
        pipe.zcard(line)
        pipe.zrange(line, 0, 0)
    replies: list[Any] = pipe.execute(raise_on_error=False)
    now_ms = _server_ms(client)
    found: list[LockInfo] = []
    for index, key in enumerate(keys):
        raw, pttl, pending, length, head = replies[5 * index : 5 * index + 5]
        if isinstance(raw, Exception) or isinstance(pttl, Exception) or not raw:
            continue  # expired since the SCAN, or not a lock hash
        fields = {as_text(k): as_text(v) for k, v in raw.items()}
        if isinstance(pending, Exception):
            pending = (None, None)
        waiting: Sequence[Any] = (length, head)
        if isinstance(length, Exception) or isinstance(head, Exception):
            waiting = (0, ())
        found.append(_info(key, fields, int(pttl), now_ms, prefix, pending, waiting))
    return found


def _scan(client: Client, pattern: str, count: int) -> Iterator[str]:
    seen: set[str] = set()  # SCAN may return a key twice (while the table is resized)
    for raw in client.scan_iter(match=pattern, count=count):
        key = as_text(raw)
        if key not in seen:
            seen.add(key)
            yield key


def _batches(items: Iterable[T], size: int) -> Iterator[list[T]]:
    batch: list[T] = []
    for item in items:
        batch.append(item)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch


def iter_locks(
    client: Client,
    prefix: str,
    task: str | None = None,
    batch: int = BATCH,
    *,
    scope: str | None = None,
) -> Iterator[LockInfo]:
    """Every lock under ``prefix`` (only those ``task`` holds if given: with ``scope``, the
    scope ``task`` belongs to), read ``batch`` keys at a time.

    Keys the SCAN glob matches that are not lock keys of this library are skipped unread.

    SCAN guarantees every key that exists for the whole scan is returned; locks taken or
    released meanwhile may or may not be. On a cluster every primary is scanned.
    """
    if batch <= 0:
        raise ValueError(f"batch must be positive, got {batch!r}")
    found = _scan(client, lock_pattern(prefix, task, scope), batch)
    locks = (key for key in found if lock_key_problem(prefix, key) is None)
    for keys in _batches(locks, batch):
        for info in _read_batch(client, keys, prefix):
            if task is None or info.task == task:
                yield info


@dataclass(frozen=True)
class Orphan:
    """A pending follow-up (coalesce) whose lock is gone: its holder's node died and the lock
    expired (with ``singleton_permits`` > 1: every slot of the key did), and no later run of
    the key came to publish it."""

    lock_key: str
    task: str | None
    follow_up: str | None
    #: the key's ``singleton_permits``: how many slots its duplicates found held
    permits: int = 1


def iter_orphans(client: Client, prefix: str, batch: int = BATCH) -> Iterator[Orphan]:
    """Every pending record under ``prefix`` whose lock key (or every permit slot of it) does
    not exist, read ``batch`` at a time: two round trips a batch (the records, then their
    locks); records beside keys that are not lock keys of this library are skipped."""
    pairs = ((key, lock_key_of(key)) for key in _scan(client, f"{prefix}*{PENDING_SUFFIX}", batch))
    records = ((key, lock) for key, lock in pairs if lock_key_problem(prefix, lock) is None)
    for chunk in _batches(records, batch):
        pipe = client.pipeline(transaction=False)
        for key, _lock in chunk:
            pipe.hmget(key, "task", "id", HOLDERS_FIELD)
        read: list[tuple[Orphan, list[str]]] = []
        for (_key, lock), fields in zip(chunk, pipe.execute(raise_on_error=False), strict=True):
            if isinstance(fields, Exception):
                continue
            task, follow_up = (None if v is None else as_text(v) for v in fields[:2])
            holders = holders_of(fields[2])
            keys = keys_of(lock, len(holders) if holders else 1)
            read.append((Orphan(keys.lock, task, follow_up, keys.permits), keys.slots))
        pipe = client.pipeline(transaction=False)
        for _orphan, slots in read:
            pipe.exists(*slots)
        for (orphan, _slots), exists in zip(read, pipe.execute(raise_on_error=False), strict=True):
            if not isinstance(exists, Exception) and not exists:
                yield orphan


@dataclass(frozen=True)
class QueueOrphan:
    """A key's queue (core/queue.py) whose lock is gone: the run holding it was lost with its
    node, the lock expired (every permit slot of it), and no later call of the key came."""

    lock_key: str
    task: str | None
    length: int
    #: the key's ``singleton_permits``
    permits: int = 1


def iter_queue_orphans(client: Client, prefix: str, batch: int = BATCH) -> Iterator[QueueOrphan]:
    """Every non-empty queue under ``prefix`` whose lock key (any permit slot: ``:lock*``)
    does not exist; queues beside keys that are not lock keys of this library are skipped."""
    suffix = ":" + QUEUE_NAME
    pairs = ((k, k[: -len(suffix)] + ":lock") for k in _scan(client, f"{prefix}*{suffix}", batch))
    found = ((key, lock) for key, lock in pairs if lock_key_problem(prefix, lock) is None)
    for chunk in _batches(found, batch):
        pipe = client.pipeline(transaction=False)
        for key, lock in chunk:
            pipe.zcard(key)
            pipe.hmget(queue_keys(lock)[1], "task", "slots")
        replies = pipe.execute(raise_on_error=False)
        read: list[tuple[QueueOrphan, list[str]]] = []
        for index, (_key, lock) in enumerate(chunk):
            length, fields = replies[2 * index], replies[2 * index + 1]
            if isinstance(length, Exception) or isinstance(fields, Exception) or not length:
                continue
            task, slots = fields
            keys = keys_of(lock, int(slots or 1))
            name = None if task is None else as_text(task)
            read.append((QueueOrphan(lock, name, int(length), keys.permits), keys.slots))
        pipe = client.pipeline(transaction=False)
        for _orphan, held in read:
            pipe.exists(*held)
        for (orphan, _held), exists in zip(read, pipe.execute(raise_on_error=False), strict=True):
            if not isinstance(exists, Exception) and not exists:
                yield orphan


def read_lock(client: Client, key: str, prefix: str) -> LockInfo | None:
    """The lock at ``key``, or None when it is not held; ValueError (before any read) when
    ``key`` is not a lock key under ``prefix`` (:func:`check_lock_key`)."""
    check_lock_key(key, prefix)
    found = _read_batch(client, [key], prefix)
    return found[0] if found else None


def force_release(client: Client, info: LockInfo) -> ForceStatus:
    """Delete the lock ``info`` shows, only if it still has that owner and fencing token.

    The fencing counter is kept, so the next holder still gets a larger token; the holder's
    renewer finds the lock gone at its next renewal and marks its run as lost.
    """
    owner = info.owner or ""
    token = "" if info.token is None else str(info.token)
    return ForceStatus(int(_wire.evalsha(client, FORCE_RELEASE, [1, info.key, owner, token])))


def stale_reason(info: LockInfo, live_hosts: Callable[[], set[str] | None]) -> str | None:
    """Why the lock is stale, or None when it may still be held by a live run.

    - ``no owner``: a hash without an owner is not a lock anybody holds;
    - ``no ttl``: the key never expires (the library always sets one: it was written or
      changed by hand, or by a foreign tool);
    - an at-least window is never stale: its run has ended, and it expires at its end;
    - ``holder down``: its ``host`` is a worker node name (``name@host``) that is not among
      ``live_hosts()`` (the nodes that answered a ping); None from ``live_hosts`` means
      "unknown", and then no lock is stale for that reason.

    ``live_hosts`` is only called for locks that pass the first two checks.
    """
    if not info.owner:
        return "no owner"
    if info.ttl_s is None:
        return "no ttl"
    if info.ended_ms is not None:
        return None
    if info.host and "@" in info.host:
        hosts = live_hosts()
        if hosts is not None and info.host not in hosts:
            return "holder down"
    return None


@dataclass
class Stats:
    """Totals over the locks and markers :func:`stats` found."""

    locks: int = 0
    by_task: dict[str, int] = field(default_factory=dict)
    by_host: dict[str, int] = field(default_factory=dict)
    without_ttl: int = 0
    oldest_age_s: float | None = None
    #: the longest time since a running lock was last renewed (the stalest run): more than a
    #: third of its ttl points at a holder whose renewer is starved or dead. At-least windows
    #: and locks handed to a queued call are never renewed, so they are not counted here
    longest_since_renewal_s: float | None = None
    #: of ``locks``: held by a run (renewed), kept as an at-least window after the run ended
    #: (expires by itself), handed to a queued call (waits for its message)
    running: int = 0
    windows: int = 0
    handed: int = 0
    #: the longest an at-least window still blocks its key, seconds
    longest_window_s: float | None = None
    #: publish-time markers (``...:queued``), pending follow-ups (``...:pending``) and joiners
    #: hashes (``...:joiners``) found (core/markers.py), and the calls those joiners hold
    queued: int = 0
    pending: int = 0
    joined_keys: int = 0
    joiners: int = 0
    #: the longest a publish-time marker still blocks ``delay()``, seconds
    longest_queued_s: float | None = None

    def as_dict(self) -> dict[str, Any]:
        """The totals as a JSON-friendly dict."""
        return asdict(self)


def _longer(current: float | None, value: float | None) -> float | None:
    if value is None:
        return current
    return value if current is None or value > current else current


def stats(locks: Iterable[LockInfo], markers: Iterable[Marker] = ()) -> Stats:
    """Count ``locks`` by task, host and state, the oldest, the longest since a renewal of a
    running lock; count ``markers`` by kind."""
    result = Stats()
    for info in locks:
        result.locks += 1
        task = info.task or "?"
        result.by_task[task] = result.by_task.get(task, 0) + 1
        host = info.host or "?"
        result.by_host[host] = result.by_host.get(host, 0) + 1
        if info.ttl_s is None:
            result.without_ttl += 1
        if info.age_s is not None:
            result.oldest_age_s = max(result.oldest_age_s or 0.0, info.age_s)
        if info.ended_ms is not None:
            result.windows += 1
            result.longest_window_s = _longer(result.longest_window_s, info.ttl_s)
        elif info.handed:
            result.handed += 1
        else:
            result.running += 1
            result.longest_since_renewal_s = _longer(result.longest_since_renewal_s, info.renewed_s)
    for marker in markers:
        if marker.kind == "queued":
            result.queued += 1
            result.longest_queued_s = _longer(result.longest_queued_s, marker.ttl_s)
        elif marker.kind == "pending":
            result.pending += 1
        else:
            result.joined_keys += 1
            result.joiners += marker.joiners or 0
    return result
