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

from dataclasses import dataclass
from typing import Any

from .compare_delete import delete_if_equal
from .errors import LockUnavailableError
from .lock import REDIS_ERRORS, Client, as_text, load_script

__all__ = ["Claim", "RunClaims", "witness_key"]


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


class RunClaims:
    """Claim, confirm and give up scheduled runs on one Redis client."""

    def __init__(self, client: Client, claimer: str) -> None:
        if not claimer or " " in claimer:
            raise ValueError(f"claimer must be a non-empty id without spaces, got {claimer!r}")
        self.client = client
        self.claimer = claimer
        self._claim = client.register_script(load_script("claim.lua"))
        self._confirm = client.register_script(load_script("confirm.lua"))
        self._unclaim = client.register_script(load_script("unclaim.lua"))
        self._witness = client.register_script(load_script("witness.lua"))

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
            reply: list[Any] = self._claim(
                keys=[key, witness_key(key)], args=[self.claimer, lease_ms, keep_ms]
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
            return bool(self._confirm(keys=[key], args=[self.claimer, task_id or "-", keep_ms]))
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
            return bool(self._unclaim(keys=[key], args=[self.claimer]))
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
            first = as_text(self._witness(keys=[witness_key(key)], args=[task_id, keep_ms]))
        except REDIS_ERRORS as exc:
            raise LockUnavailableError(
                f"could not witness {key}: {exc}", key=key, task_id=task_id
            ) from exc
        return first or None


def _seen(value: bytes | str, pttl_ms: int) -> Claim:
    """Another instance's claim, from its value ("pending <id>", "done <id> <task>")."""
    state, holder, *_ = [*as_text(value).split(" "), ""]
    return Claim(False, holder, published=state == "done", pttl_ms=int(pttl_ms))
