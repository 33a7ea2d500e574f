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
share a slot).
"""

from __future__ import annotations

import collections
import functools
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import redis

from ..core._fanout import (
    DEFAULT_MASTER_TIMEOUT_S,
    DEFAULT_MAX_IN_FLIGHT,
    Failed,
    Fanout,
    describe,
    why,
)
from ..core._wire import as_text, evalsha, script
from ..core.backend import REDIS_ERRORS, Client, LockBackend
from ..core.compare_delete import delete_if_equal
from ..core.connection import lock_url, master_timeout, new_store, redlock_clients
from ..core.redlock import RedlockStore
from ..errors import LockUnavailableError

__all__ = [
    "CLAIM_HEADER",
    "KEEP_HEADER",
    "RUN_HEADER",
    "Claim",
    "Claims",
    "RedlockClaims",
    "RunClaims",
    "claims_and_store",
    "witness_key",
]

#: Header carrying "<entry name>@<run id>" on every message a SingletonScheduler publishes.
RUN_HEADER = "singleton_beat_run"
#: Header carrying the run's claim key, so a worker can witness the run's first message.
CLAIM_HEADER = "singleton_beat_claim"
#: Header carrying how long (ms) the run's claim, and so its witness, is kept.
KEEP_HEADER = "singleton_beat_keep_ms"

T = TypeVar("T")

CLAIM = script("claim.lua")
CONFIRM = script("confirm.lua")
UNCLAIM = script("unclaim.lua")
WITNESS = script("witness.lua")


def witness_key(claim_key: str) -> str:
    """The witness key of the run claimed at ``claim_key``: the same Redis Cluster slot."""
    return f"{claim_key}:seen"


@dataclass(frozen=True)
class Claim:
    """The outcome of a claim: ``won``, or who holds it and in which state."""

    won: bool
    holder: str | None = None
    published: bool = False
    pttl_ms: int = 0


class Claims(Protocol):
    """What beat and the workers' witness ask of run claims: :class:`RunClaims` on one
    server, Sentinel or cluster, :class:`RedlockClaims` on a majority of masters."""

    claimer: str

    def claim(self, key: str, lease_ms: int, keep_ms: int | None = None) -> Claim: ...

    def confirm(self, key: str, task_id: str, keep_ms: int) -> bool: ...

    def peek(self, keys: list[str]) -> list[Claim | None]: ...

    def witness(self, key: str, task_id: str, keep_ms: int) -> str | None: ...

    def unclaim(self, key: str) -> bool: ...


class RunClaims:
    """Claim, confirm and give up scheduled runs on one Redis client."""

    def __init__(self, client: Client, claimer: str) -> None:
        if not claimer or " " in claimer:
            raise ValueError(f"claimer must be a non-empty id without spaces, got {claimer!r}")
        self.client = client
        self.claimer = claimer

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
        try:
            reply: list[Any] = evalsha(
                self.client, CLAIM, [2, key, witness_key(key), self.claimer, lease_ms, keep_ms]
            )
        except REDIS_ERRORS as exc:
            raise LockUnavailableError(f"could not claim {key}: {exc}", key=key) from exc
        if reply[0] == 1:
            return Claim(won=True, holder=self.claimer)
        return _seen(reply[1], reply[2])

    def confirm(self, key: str, task_id: str, keep_ms: int) -> bool:
        """Mark the run published as ``task_id`` and keep the claim ``keep_ms``."""
        if keep_ms <= 0:
            raise ValueError(f"keep_ms must be positive, got {keep_ms!r}")
        try:
            return bool(
                evalsha(self.client, CONFIRM, [1, key, self.claimer, task_id or "-", keep_ms])
            )
        except REDIS_ERRORS as exc:
            raise LockUnavailableError(f"could not confirm {key}: {exc}", key=key) from exc

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
        if not keys:
            return []
        try:
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                pipe.get(key)
                pipe.pttl(key)
            replies: list[Any] = pipe.execute()
        except REDIS_ERRORS as exc:
            raise LockUnavailableError(
                f"could not read the claim {keys[0]} and others: {exc}", key=keys[0]
            ) from exc
        claims: list[Claim | None] = []
        for value, pttl in zip(replies[::2], replies[1::2], strict=True):
            claims.append(None if value is None else _seen(value, pttl))
        return claims

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


def _seen(value: bytes | str, pttl_ms: int) -> Claim:
    """Another instance's claim, from its value ("pending <id>", "done <id> <task>")."""
    state, holder, *_ = [*as_text(value).split(" "), ""]
    return Claim(False, holder, published=state == "done", pttl_ms=int(pttl_ms))


class RedlockClaims:
    """Run claims (:class:`RunClaims`) held on a majority of independent masters.

    The beat scheduler's claims, with the store's rules: a run is won when a majority granted
    the claim within the publish lease less the drift allowance; anything less is given up
    where it was granted. A run counts as published as soon as any master that answered has
    it confirmed: a lagging instance never publishes it again because a minority kept it.
    Every call raises :class:`LockUnavailableError` when fewer than a majority answered.
    """

    def __init__(
        self,
        clients: Sequence[redis.Redis],
        claimer: str,
        *,
        master_timeout_s: float = DEFAULT_MASTER_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
        drift_factor: float = 0.01,
        drift_floor_ms: int = 2,
    ) -> None:
        if len(clients) < 1 or len({id(c) for c in clients}) != len(clients):
            raise ValueError("RedlockClaims needs distinct clients, one per master")
        self.claimer = claimer
        self.members = tuple(RunClaims(client, claimer) for client in clients)
        self.quorum = len(clients) // 2 + 1
        self.master_timeout_s = master_timeout_s
        self.clock = clock
        self.drift_factor = drift_factor
        self.drift_floor_ms = drift_floor_ms
        self._fanout = Fanout(len(clients), DEFAULT_MAX_IN_FLIGHT)
        self._names = [describe(client) for client in clients]

    def claim(self, key: str, lease_ms: int, keep_ms: int | None = None) -> Claim:
        """Claim the run at ``key`` on every master; won with a majority, within the lease.

        Lost: the holder most masters named, or ``published`` as soon as any master that
        answered has the run confirmed (then even a majority for us is given up). A split
        vote (nobody holds, or can hold, a majority) reports a short random ``pttl_ms``, so the
        scheduler looks again soon instead of after the publish lease.
        """
        start = self.clock()
        replies = self._run(lambda c: c.claim(key, lease_ms, keep_ms))
        answers = {i: r for i, r in replies.items() if not isinstance(r, Failed)}
        won = [i for i, r in answers.items() if r.won]
        published = [r for r in answers.values() if r.published]
        elapsed_ms = (self.clock() - start) * 1000
        validity_ms = lease_ms - elapsed_ms - (lease_ms * self.drift_factor + self.drift_floor_ms)
        if len(won) >= self.quorum and validity_ms > 0 and not published:
            return Claim(won=True, holder=self.claimer)
        if won or len(answers) < len(self.members):  # a silent master may have granted it
            self.unclaim(key, quietly=True)
        if published:  # even a majority for us: the run went out once already
            return published[0]
        if len(answers) < self.quorum:
            raise LockUnavailableError(
                f"could not claim {key}: {len(answers)} of {len(self.members)} masters answered,"
                f" {self.quorum} needed{self._why(replies)}",
                key=key,
            )
        refusals = [r for r in answers.values() if not r.won and r.holder]
        named = collections.Counter(r.holder for r in refusals)
        failed = len(self.members) - len(answers)
        if not named or max(named.values()) + failed < self.quorum:
            pause_ms = random.randint(20, 200)  # spreads the contenders
            holder = named.most_common(1)[0][0] if named else None
            return Claim(False, holder, published=False, pttl_ms=pause_ms)
        holder = named.most_common(1)[0][0]
        pttl = max(r.pttl_ms for r in refusals if r.holder == holder)
        return Claim(False, holder, published=False, pttl_ms=pttl)

    def confirm(self, key: str, task_id: str, keep_ms: int) -> bool:
        """Confirm on every master; True when a majority confirmed our claim."""
        replies = self._run(lambda c: c.confirm(key, task_id, keep_ms))
        answers = [r for r in replies.values() if not isinstance(r, Failed)]
        if len(answers) < self.quorum:
            raise LockUnavailableError(
                f"could not confirm {key}: {len(answers)} of {len(self.members)} masters "
                f"answered{self._why(replies)}",
                key=key,
            )
        return sum(1 for r in answers if r) >= self.quorum

    def peek(self, keys: list[str]) -> list[Claim | None]:
        """The claims at ``keys`` (see :meth:`RunClaims.peek`), read on every master.

        A run is published if any answering master says so; else pending if any says so
        (with the longest time left); else unclaimed. Raises when fewer than a majority
        answered.
        """
        replies = self._run(lambda c: c.peek(keys))
        answers = [r for r in replies.values() if not isinstance(r, Failed)]
        if len(answers) < self.quorum:
            raise LockUnavailableError(
                f"could not read claims: {len(answers)} of {len(self.members)} masters "
                f"answered{self._why(replies)}",
                key=keys[0] if keys else None,
            )
        merged: list[Claim | None] = []
        for seen in zip(*answers, strict=True):
            found = [c for c in seen if c is not None]
            done = [c for c in found if c.published]
            pending = sorted(found, key=lambda c: c.pttl_ms, reverse=True)
            merged.append(done[0] if done else pending[0] if pending else None)
        return merged

    def witness(self, key: str, task_id: str, keep_ms: int) -> str | None:
        """Witness a scheduled run's message on every master (see :meth:`RunClaims.witness`).

        The majority decides: None (run it) when a majority recorded this message as the
        run's first; else the other task id most masters named. Raises when fewer than a
        majority answered, and the message is neither recorded nor named as a duplicate.
        """
        replies = self._run(lambda c: c.witness(key, task_id, keep_ms))
        answers = [r for r in replies.values() if not isinstance(r, Failed)]
        if sum(1 for r in answers if r is None) >= self.quorum:
            return None
        named = collections.Counter(r for r in answers if r is not None)
        if len(answers) < self.quorum or not named:
            raise LockUnavailableError(
                f"could not witness {key}: {len(answers)} of {len(self.members)} masters "
                f"answered{self._why(replies)}",
                key=key,
                task_id=task_id,
            )
        return named.most_common(1)[0][0]

    def unclaim(self, key: str, *, quietly: bool = False) -> bool:
        """Give up our pending claim on every master; True if any master gave it up."""
        replies = self._run(lambda c: c.unclaim(key))
        answers = [r for r in replies.values() if not isinstance(r, Failed)]
        if any(answers):
            return True
        if len(answers) < self.quorum and not quietly:
            raise LockUnavailableError(
                f"could not unclaim {key}: {len(answers)} of {len(self.members)} masters "
                f"answered{self._why(replies)}",
                key=key,
            )
        return False

    def _run(self, call: Callable[[RunClaims], T]) -> dict[int, T | Failed]:
        return self._fanout.run(
            {i: functools.partial(call, member) for i, member in enumerate(self.members)},
            self.master_timeout_s,
        )

    def _why(self, replies: Mapping[int, object]) -> str:
        return why(self._names, replies)


def claims_and_store(url: str, claimer: str) -> tuple[Claims, LockBackend]:
    """New run claims for ``url`` as ``claimer``, and a lock store for the same deployment.

    Beat's claims and leader lease, the workers' witness of scheduled runs. Over a
    ``redis+redlock://`` URL both go to a majority of the masters (on the same clients), as
    the workers' locks do.
    """
    parsed = lock_url(url)
    if parsed.kind == "redlock":
        clients, timeout = redlock_clients(url), master_timeout(parsed)
        return (
            RedlockClaims(clients, claimer, master_timeout_s=timeout),
            RedlockStore(clients, master_timeout_s=timeout),
        )
    store = new_store(url)
    return RunClaims(store.client, claimer), store  # one client for both
