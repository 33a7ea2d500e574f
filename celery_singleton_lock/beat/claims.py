"""Run claims: which beat instance publishes one scheduled run.

A claim key names one run (an entry and its nominal time). The first instance to claim it
holds a short *pending* claim while it publishes, then *confirms* it, which keeps the key
for a while so no other instance publishes the same run. An instance that dies between
claim and confirm leaves a pending claim that expires after the publish lease; any
instance that saw it pending claims it again then, so the run is late but not lost.

An instance that dies after publishing but before confirming leaves the same pending
claim, and the run would be published again. The *witness* closes that: the first worker
that receives a message of the run records its task id next to the claim
(:meth:`RunClaims.witness`); a later claim finds the witness and marks the run done, and a
message published again anyway (no worker had received the first one yet) is recognised by
the worker as the run's second message and dropped.

Knows nothing of Celery. Each method is one round trip running a script from ``lua/``; each
script touches one key, so it runs unchanged on a Redis Cluster (the claims of one entry even
share a slot). The ``*_many`` methods run the same scripts for many runs in one round trip: one
pipeline, or one per node on a cluster (a beat tick claims every run due at once).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from redis.cluster import RedisCluster

from ..core._wire import Script, as_text, evalsha, script
from ..core.backend import REDIS_ERRORS, Client
from ..core.cluster import script_calls
from ..core.compare_delete import delete_if_equal
from ..core.keys import beside_run
from ..errors import LockUnavailableError

__all__ = [
    "CLAIM_HEADER",
    "KEEP_HEADER",
    "NOT_RECORDED",
    "RUN_HEADER",
    "Claim",
    "Claims",
    "EntryRecord",
    "RunClaims",
    "RunNote",
    "merge_records",
    "only",
    "pause_key",
    "record_key",
    "witness_key",
]

T = TypeVar("T")

#: Header carrying "<entry name>@<run id>" on every message a SingletonScheduler publishes.
RUN_HEADER = "singleton_beat_run"
#: Header carrying the run's claim key, so a worker can witness the run's first message.
CLAIM_HEADER = "singleton_beat_claim"
#: Header carrying how long (ms) the run's claim, and so its witness, is kept.
KEEP_HEADER = "singleton_beat_keep_ms"

CLAIM = script("claim.lua")
CONFIRM = script("confirm.lua")
UNCLAIM = script("unclaim.lua")
WITNESS = script("witness.lua")

#: How many runs one call of claim.lua or confirm.lua takes on one server (a batch of runs goes
#: as several such calls in one pipeline, so the server stays free for others in between).
BATCH = 500


def witness_key(claim_key: str) -> str:
    """The witness key of the run claimed at ``claim_key``: the same Redis Cluster slot."""
    return f"{claim_key}:seen"


def record_key(claim_key: str) -> str:
    """The record of the entry whose run is claimed at ``claim_key`` (a hash: see claim.lua)."""
    return beside_run(claim_key, "record")


def pause_key(claim_key: str) -> str:
    """The pause of the entry whose run is claimed at ``claim_key``."""
    return beside_run(claim_key, "paused")


@dataclass(frozen=True)
class Claim:
    """The outcome of a claim: ``won``, or who holds it and in which state; or the entry is
    ``paused`` (``holder``: who paused it)."""

    won: bool
    holder: str | None = None
    published: bool = False
    pttl_ms: int = 0
    paused: bool = False


@dataclass(frozen=True)
class RunNote:
    """What a run's claim and confirm note in its entry's record: the run's nominal time (epoch
    ms; None for a run at no nominal time, which is not recorded), how long to keep the record,
    and whether the entry's pause passes the run over (an operator's run-now is not)."""

    nominal_ms: int | None = None
    record_ms: int = 1
    pausable: bool = True


#: A run that notes nothing in its entry's record (and that a pause passes over).
NOT_RECORDED = RunNote()


@dataclass(frozen=True)
class EntryRecord:
    """An entry's record: its runs up to ``through_ms`` (epoch ms) are accounted for; the last
    published nominal run (``nominal_ms``, by ``by`` at ``at_ms`` as ``task_id``), if any."""

    through_ms: int | None
    nominal_ms: int | None = None
    by: str | None = None
    at_ms: int | None = None
    task_id: str | None = None


class Claims(Protocol):
    """What beat and the workers' witness ask of run claims: :class:`RunClaims` on one
    server, Sentinel or cluster, :class:`.redlock_claims.RedlockClaims` on a majority of masters."""

    claimer: str

    @property
    def clients(self) -> list[Client]:
        """The clients the claims go through: one, or each master's."""
        ...

    def claim(self, key: str, lease_ms: int, keep_ms: int | None = None) -> Claim: ...

    def confirm(self, key: str, task_id: str, keep_ms: int) -> bool: ...

    def peek(self, keys: list[str]) -> list[Claim | None]: ...

    def witness(self, key: str, task_id: str, keep_ms: int) -> str | None: ...

    def unclaim(self, key: str) -> bool: ...

    def claim_many(
        self,
        keys: Sequence[str],
        lease_ms: int,
        keep_ms: Sequence[int],
        notes: Sequence[RunNote] | None = None,
    ) -> list[Claim | LockUnavailableError]: ...

    def confirm_many(
        self, items: Sequence[tuple[str, str, int]], notes: Sequence[RunNote] | None = None
    ) -> list[bool | LockUnavailableError]: ...

    def unclaim_many(self, keys: Sequence[str]) -> list[bool | LockUnavailableError]: ...

    def records(self, keys: Sequence[str]) -> list[EntryRecord | None]: ...


class RunClaims:
    """Claim, confirm and give up scheduled runs on one Redis client."""

    def __init__(self, client: Client, claimer: str) -> None:
        if not claimer or " " in claimer:
            raise ValueError(f"claimer must be a non-empty id without spaces, got {claimer!r}")
        self.client = client
        self.claimer = claimer

    @property
    def clients(self) -> list[Client]:
        return [self.client]

    def claim(self, key: str, lease_ms: int, keep_ms: int | None = None) -> Claim:
        """Claim the run at ``key`` for ``lease_ms`` while it is being published.

        A run that a worker already received (its witness is set) is not claimed: the claim
        is marked done, kept ``keep_ms`` (default ``lease_ms``), and reported published.
        """
        if lease_ms <= 0:
            raise ValueError(f"lease_ms must be positive, got {lease_ms!r}")
        keep_ms = lease_ms if keep_ms is None else keep_ms
        if keep_ms <= 0:
            raise ValueError(f"keep_ms must be positive, got {keep_ms!r}")
        return only(self.claim_many([key], lease_ms, [keep_ms]))

    def confirm(self, key: str, task_id: str, keep_ms: int) -> bool:
        """Mark the run published as ``task_id`` and keep the claim ``keep_ms``."""
        if keep_ms <= 0:
            raise ValueError(f"keep_ms must be positive, got {keep_ms!r}")
        return only(self.confirm_many([(key, task_id, keep_ms)]))

    def unclaim(self, key: str) -> bool:
        """Give up our pending claim at ``key`` (publishing failed).

        A compare-and-delete of a string: the server's ``DELIFEQ`` (Valkey 9) or ``DELEX ...
        IFEQ`` (Redis 8.4) where it has one, else ``unclaim.lua`` (see compare_delete.py).
        """
        try:
            deleted = delete_if_equal(self.client, key, f"pending {self.claimer}")
            if deleted is not None:
                return deleted
            return bool(evalsha(self.client, UNCLAIM, [1, key, self.claimer]))
        except REDIS_ERRORS as exc:
            raise LockUnavailableError(f"could not unclaim {key}: {exc}", key=key) from exc

    def peek(self, keys: list[str]) -> list[Claim | None]:
        """The claims at ``keys`` as other instances see them (None: unclaimed); one round trip.

        ``won`` is always False; ``pttl_ms`` is how long the claim stays.
        """
        replies = self._read("claim", keys, lambda pipe, key: (pipe.get(key), pipe.pttl(key)))
        claims: list[Claim | None] = []
        for value, pttl in zip(replies[::2], replies[1::2], strict=True):
            claims.append(None if value is None else _seen(value, pttl))
        return claims

    def claim_many(
        self,
        keys: Sequence[str],
        lease_ms: int,
        keep_ms: Sequence[int],
        notes: Sequence[RunNote] | None = None,
    ) -> list[Claim | LockUnavailableError]:
        """:meth:`claim` the runs at ``keys`` (each kept its ``keep_ms``) in one round trip.

        Each run gets its claim, or the error that kept it from being claimed (try it again).
        A run whose entry is paused is not claimed (``Claim.paused``) unless its note says
        so; it counts as accounted for in the entry's record, as does a run a worker received.
        """
        if lease_ms <= 0 or any(keep <= 0 for keep in keep_ms):
            raise ValueError(f"lease_ms and keep_ms must be positive, got {lease_ms!r}")
        notes = _notes(notes, len(keys))

        def call(chunk: Sequence[tuple[str, int, RunNote]]) -> list[Any]:
            keys_: list[str] = []
            argv: list[Any] = [self.claimer, lease_ms]
            for key, keep, note in chunk:
                keys_ += (key, witness_key(key), pause_key(key), record_key(key))
                argv += (keep, *_note_args(note), int(note.pausable))
            return [len(keys_), *keys_, *argv]

        items = list(zip(keys, keep_ms, notes, strict=True))
        replies = self._many("claim", CLAIM, items, call)
        return [
            r
            if isinstance(r, LockUnavailableError)
            else Claim(True, self.claimer)
            if r[0] == 1
            else _paused(r[1])
            if r[0] == 2
            else _seen(r[1], r[2])
            for r in replies
        ]

    def confirm_many(
        self, items: Sequence[tuple[str, str, int]], notes: Sequence[RunNote] | None = None
    ) -> list[bool | LockUnavailableError]:
        """:meth:`confirm` runs given as ``(key, task_id, keep_ms)``, in one round trip; each
        noted in its entry's record as its ``notes`` say."""
        if any(keep <= 0 for _key, _task, keep in items):
            raise ValueError("keep_ms must be positive")
        notes = _notes(notes, len(items))

        def call(chunk: Sequence[tuple[str, str, int, RunNote]]) -> list[Any]:
            keys_: list[str] = []
            argv: list[Any] = [self.claimer]
            for key, task_id, keep, note in chunk:
                keys_ += (key, record_key(key))
                argv += (task_id or "-", keep, *_note_args(note))
            return [len(keys_), *keys_, *argv]

        both = [(*item, note) for item, note in zip(items, notes, strict=True)]
        replies = self._many("confirm", CONFIRM, both, call)
        return [r if isinstance(r, LockUnavailableError) else bool(r) for r in replies]

    def records(self, keys: Sequence[str]) -> list[EntryRecord | None]:
        """The entry records at ``keys`` (from :func:`record_key`; None: none), one round trip."""
        replies = self._read("record", keys, lambda pipe, key: pipe.hgetall(key))
        return [_record(reply) for reply in replies]

    def _read(self, what: str, keys: Sequence[str], add: Callable[[Any, str], object]) -> list[Any]:
        """The replies of the reads ``add`` puts in one pipeline for each of ``keys``, in one
        round trip; a failure as LockUnavailableError."""
        if not keys:
            return []
        try:
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                add(pipe, key)
            return list(pipe.execute())
        except REDIS_ERRORS as exc:
            raise LockUnavailableError(
                f"could not read the {what} {keys[0]} and others: {exc}", key=keys[0]
            ) from exc

    def unclaim_many(self, keys: Sequence[str]) -> list[bool | LockUnavailableError]:
        """Give up our pending claims at ``keys`` (``unclaim.lua``), in one round trip."""
        replies = self._many(
            "unclaim", UNCLAIM, list(keys), lambda chunk: [1, chunk[0], self.claimer], batch=1
        )
        return [r if isinstance(r, LockUnavailableError) else bool(r) for r in replies]

    def _many(
        self,
        what: str,
        lua: Script,
        items: list[Any],
        call: Callable[[Sequence[Any]], list[Any]],
        batch: int = BATCH,
    ) -> list[Any]:
        """The replies for ``items`` (``items[i][0]`` is a key), in one round trip: ``lua``
        called with ``call(chunk)`` for chunks of ``batch`` items (of one item on a cluster,
        whose calls go in one pipeline per node); each item's reply, errors as
        :class:`LockUnavailableError`."""
        if not items:
            return []
        size = 1 if isinstance(self.client, RedisCluster) else batch
        chunks = [items[i : i + size] for i in range(0, len(items), size)]
        try:
            replies = script_calls(self.client, [(lua, call(chunk)) for chunk in chunks])
        except REDIS_ERRORS as exc:
            replies = [exc] * len(chunks)
        out: list[Any] = []
        for chunk, reply in zip(chunks, replies, strict=True):
            if isinstance(reply, Exception):
                out += [
                    LockUnavailableError(f"could not {what} {i[0]}: {reply}", key=i[0])
                    for i in chunk
                ]
            else:
                out += [reply] if lua is UNCLAIM else reply  # unclaim.lua: one run, one integer
        return out

    def witness(self, key: str, task_id: str, keep_ms: int) -> str | None:
        """A worker received message ``task_id`` of the run claimed at ``key``.

        Returns None when it is the run's first message (or a redelivery of it): run it.
        Returns the first message's task id when this is a second message of the run.
        """
        if not task_id or keep_ms <= 0:
            raise ValueError(f"need a task id and a positive keep_ms, got {task_id!r}, {keep_ms!r}")
        try:
            first = as_text(evalsha(self.client, WITNESS, [1, witness_key(key), task_id, keep_ms]))
        except REDIS_ERRORS as exc:
            raise LockUnavailableError(
                f"could not witness {key}: {exc}", key=key, task_id=task_id
            ) from exc
        return first or None


def only(outcomes: Sequence[T | LockUnavailableError]) -> T:
    """The one outcome of a batch of one (``claim_many`` and friends): raised if an error."""
    (outcome,) = outcomes
    if isinstance(outcome, LockUnavailableError):
        raise outcome
    return outcome


def _notes(notes: Sequence[RunNote] | None, count: int) -> Sequence[RunNote]:
    if notes is None:
        return [NOT_RECORDED] * count
    if len(notes) != count:
        raise ValueError(f"need one note per run: {len(notes)} for {count}")
    return notes


def _note_args(note: RunNote) -> tuple[str, int]:
    """A note's nominal time ("" for none) and record keep, as claim.lua and confirm.lua read
    them."""
    if note.record_ms <= 0:
        raise ValueError(f"record_ms must be positive, got {note.record_ms!r}")
    return ("" if note.nominal_ms is None else str(note.nominal_ms)), note.record_ms


def _paused(value: bytes | str) -> Claim:
    """The claim refused for a paused entry; the pause reads "<by> <at ms>"."""
    by = as_text(value).rpartition(" ")[0] or as_text(value)
    return Claim(False, by, paused=True)


def _record(fields: dict[Any, Any]) -> EntryRecord | None:
    """An entry record read with HGETALL (empty: none)."""
    if not fields:
        return None
    text = {as_text(k): as_text(v) for k, v in fields.items()}

    def number(name: str) -> int | None:
        value = text.get(name)
        return int(value) if value and value.lstrip("-").isdigit() else None

    return EntryRecord(
        through_ms=number("through"),
        nominal_ms=number("nominal"),
        by=text.get("by"),
        at_ms=number("at"),
        task_id=text.get("task"),
    )


def merge_records(seen: Sequence[EntryRecord | None]) -> EntryRecord | None:
    """One entry's records as several servers hold them, as one: the latest ``through``, and
    the latest published run."""
    found = [r for r in seen if r is not None]
    if not found:
        return None
    throughs = [r.through_ms for r in found if r.through_ms is not None]
    latest = max(found, key=lambda r: -1 if r.nominal_ms is None else r.nominal_ms)
    return dataclasses.replace(latest, through_ms=max(throughs) if throughs else None)


def _seen(value: bytes | str, pttl_ms: int) -> Claim:
    """Another instance's claim, from its value ("pending <id>", "done <id> <task>")."""
    state, holder, *_ = [*as_text(value).split(" "), ""]
    return Claim(False, holder, published=state == "done", pttl_ms=int(pttl_ms))
