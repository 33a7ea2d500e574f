"""Run claims (:mod:`.claims`) held on a majority of independent masters, and the claims and
lock store a beat or a worker builds for a lock URL.

Knows nothing of Celery.
"""

from __future__ import annotations

import collections
import functools
import random
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import redis

from ..core._fanout import (
    DEFAULT_MASTER_TIMEOUT_S,
    DEFAULT_MAX_IN_FLIGHT,
    Failed,
    Fanout,
    describe,
    why,
)
from ..core.backend import LockBackend
from ..core.connection import lock_url, master_timeout, new_store, redlock_clients
from ..core.redlock import RedlockStore
from ..errors import LockUnavailableError
from .claims import Claim, Claims, EntryRecord, RunClaims, RunNote, merge_records, only

__all__ = ["RedlockClaims", "claims_and_store"]

T = TypeVar("T")


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

    @property
    def clients(self) -> list[Any]:
        return [member.client for member in self.members]

    def claim(self, key: str, lease_ms: int, keep_ms: int | None = None) -> Claim:
        """Claim the run at ``key`` on every master; won with a majority, within the lease.

        Lost: the holder most masters named, or ``published`` as soon as any master that
        answered has the run confirmed (then even a majority for us is given up). A split
        vote (nobody holds, or can hold, a majority) reports a short random ``pttl_ms``, so the
        scheduler looks again soon instead of after the publish lease.
        """
        return only(self.claim_many([key], lease_ms, [lease_ms if keep_ms is None else keep_ms]))

    def claim_many(
        self,
        keys: Sequence[str],
        lease_ms: int,
        keep_ms: Sequence[int],
        notes: Sequence[RunNote] | None = None,
    ) -> list[Claim | LockUnavailableError]:
        """:meth:`claim` the runs at ``keys``: one round trip per master, in parallel. The
        claims this instance must give up (no majority, already published, or the entry paused
        on a master that answered) are given up in one more."""
        start = self.clock()
        replies = self._run(lambda c: c.claim_many(keys, lease_ms, keep_ms, notes))
        elapsed_ms = (self.clock() - start) * 1000
        validity_ms = lease_ms - elapsed_ms - (lease_ms * self.drift_factor + self.drift_floor_ms)
        outcomes: list[Claim | LockUnavailableError] = []
        give_up: list[str] = []
        for index, key in enumerate(keys):
            per_master = {i: _item(r, index) for i, r in replies.items()}
            outcome, unclaim = self._decide(key, per_master, validity_ms)
            outcomes.append(outcome)
            if unclaim:
                give_up.append(key)
        if give_up:
            self.unclaim_many(give_up)  # a failure here leaves claims that expire
        return outcomes

    def _decide(
        self, key: str, replies: Mapping[int, Claim | Failed], validity_ms: float
    ) -> tuple[Claim | LockUnavailableError, bool]:
        """The outcome of one run's claim from the masters' ``replies``, and whether this
        instance must give up what it was granted."""
        answers = {i: r for i, r in replies.items() if isinstance(r, Claim)}
        won = [i for i, r in answers.items() if r.won]
        published = [r for r in answers.values() if r.published or r.paused]
        if len(won) >= self.quorum and validity_ms > 0 and not published:
            return Claim(won=True, holder=self.claimer), False
        give_up = bool(won) or len(answers) < len(self.members)  # a silent one may have granted
        if published:  # even a majority for us: the run went out once already, or is paused
            return published[0], give_up
        if len(answers) < self.quorum:
            return LockUnavailableError(
                f"could not claim {key}: {len(answers)} of {len(self.members)} masters answered,"
                f" {self.quorum} needed{self._why(replies)}",
                key=key,
            ), give_up
        refusals = [r for r in answers.values() if not r.won and r.holder]
        named = collections.Counter(r.holder for r in refusals)
        failed = len(self.members) - len(answers)
        if not named or max(named.values()) + failed < self.quorum:
            pause_ms = random.randint(20, 200)  # spreads the contenders
            holder = named.most_common(1)[0][0] if named else None
            return Claim(False, holder, published=False, pttl_ms=pause_ms), give_up
        holder = named.most_common(1)[0][0]
        pttl = max(r.pttl_ms for r in refusals if r.holder == holder)
        return Claim(False, holder, published=False, pttl_ms=pttl), give_up

    def confirm(self, key: str, task_id: str, keep_ms: int) -> bool:
        """Confirm on every master; True when a majority confirmed our claim."""
        return only(self.confirm_many([(key, task_id, keep_ms)]))

    def confirm_many(
        self, items: Sequence[tuple[str, str, int]], notes: Sequence[RunNote] | None = None
    ) -> list[bool | LockUnavailableError]:
        """:meth:`confirm` runs given as ``(key, task_id, keep_ms)``: one round trip per
        master, in parallel."""
        replies = self._run(lambda c: c.confirm_many(items, notes))
        outcomes: list[bool | LockUnavailableError] = []
        for index, (key, _task, _keep) in enumerate(items):
            per_master = {i: _item(r, index) for i, r in replies.items()}
            answers = [r for r in per_master.values() if not isinstance(r, Failed)]
            if len(answers) < self.quorum:
                outcomes.append(
                    LockUnavailableError(
                        f"could not confirm {key}: {len(answers)} of {len(self.members)} masters "
                        f"answered{self._why(per_master)}",
                        key=key,
                    )
                )
            else:
                outcomes.append(sum(1 for r in answers if r) >= self.quorum)
        return outcomes

    def unclaim_many(self, keys: Sequence[str]) -> list[bool | LockUnavailableError]:
        """Give up our pending claims at ``keys`` on every master: True where any master gave
        it up; one round trip per master, in parallel."""
        replies = self._run(lambda c: c.unclaim_many(keys))
        outcomes: list[bool | LockUnavailableError] = []
        for index, key in enumerate(keys):
            per_master = {i: _item(r, index) for i, r in replies.items()}
            answers = [r for r in per_master.values() if not isinstance(r, Failed)]
            if any(answers) or len(answers) >= self.quorum:
                outcomes.append(any(answers))
            else:
                outcomes.append(
                    LockUnavailableError(
                        f"could not unclaim {key}: {len(answers)} of {len(self.members)} masters "
                        f"answered{self._why(per_master)}",
                        key=key,
                    )
                )
        return outcomes

    def peek(self, keys: list[str]) -> list[Claim | None]:
        """The claims at ``keys`` (see :meth:`RunClaims.peek`), read on every master.

        A run is published if any answering master says so; else pending if any says so
        (with the longest time left); else unclaimed. Raises when fewer than a majority
        answered.
        """
        answers = self._majority_read("claims", lambda c: c.peek(keys), keys)
        merged: list[Claim | None] = []
        for seen in zip(*answers, strict=True):
            found = [c for c in seen if c is not None]
            done = [c for c in found if c.published]
            pending = sorted(found, key=lambda c: c.pttl_ms, reverse=True)
            merged.append(done[0] if done else pending[0] if pending else None)
        return merged

    def records(self, keys: Sequence[str]) -> list[EntryRecord | None]:
        """The entry records at ``keys``, read on every master: the latest ``through`` any
        answering master has, and the latest published run. Raises when fewer than a majority
        answered."""
        answers = self._majority_read("records", lambda c: c.records(keys), keys)
        return [merge_records(seen) for seen in zip(*answers, strict=True)]

    def _majority_read(
        self, what: str, call: Callable[[RunClaims], list[T]], keys: Sequence[str]
    ) -> list[list[T]]:
        """``call`` on every master: the answers, or LockUnavailableError when fewer than a
        majority answered."""
        replies = self._run(call)
        answers = [r for r in replies.values() if not isinstance(r, Failed)]
        if len(answers) < self.quorum:
            raise LockUnavailableError(
                f"could not read {what}: {len(answers)} of {len(self.members)} masters "
                f"answered{self._why(replies)}",
                key=keys[0] if keys else None,
            )
        return answers

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


def _item(reply: Any, index: int) -> Any:
    """A master's reply to run ``index`` of a ``*_many`` call: a failed call or item as
    :class:`Failed`."""
    if isinstance(reply, Failed):
        return reply
    item = reply[index]
    return Failed(str(item)) if isinstance(item, LockUnavailableError) else item


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
