"""Redlock's acquire: a lock taken on a majority of the masters, with one fencing token.

Acquire, in three steps:

1. ``acquire.lua`` on every master. A master that refuses reports its holder; the store then
   also reads that master's fencing counter.
2. The final fencing token is the largest token any master issued, and at least one more than
   every counter read in step 1.
3. ``raise_fence.lua`` on every master that answered: its counter becomes
   ``max(counter, final token)`` and, where the lock is still ours, the lock's ``token`` field
   becomes the final token. The lock is ours when a majority confirmed it here and the whole
   acquire took less than the validity; otherwise it is released on every master and the store
   returns :class:`Contended` (a majority answered) or raises :class:`LockUnavailableError`.

Why the token then keeps increasing across holders: when A's acquire returns, a majority of the
masters hold A's lock *and* a counter of at least A's token. The next holder B needs a majority
too; the two majorities share a master, and B can take the lock there only after A's lock has
gone from it, so after A's counter was written: B's token there, hence B's final token, is
larger. See docs/redlock.md for the whole argument and its limits.

A split vote (the refusing masters name no owner that holds, or can hold, a majority) is tried
again after a short random pause. Knows nothing of Celery.
"""

from __future__ import annotations

import collections
import functools
import random
import time
from collections.abc import Mapping, Sequence

import redis

from ..errors import LockUnavailableError
from . import _wire
from ._fanout import Failed
from .backend import Acquired, Completed, Contended, check_owner, check_ttl, fence_ttl_ms
from .keys import LockKeys
from .redlock_masters import RedlockMasters

__all__ = ["RedlockAcquire"]


class _Split:
    """An acquire refused without any owner holding a majority (several took some masters)."""

    __slots__ = ("refusal",)

    def __init__(self, refusal: Contended) -> None:
        self.refusal = refusal


RAISE_FENCE = _wire.script("raise_fence.lua")


class RedlockAcquire(RedlockMasters):
    """:meth:`acquire` on a majority of the masters; the rest of the store is
    :class:`~.redlock.RedlockStore`."""

    def acquire(
        self,
        keys: LockKeys,
        owner: str,
        generation: int,
        ttl_ms: int,
        meta: Mapping[str, str] | None = None,
    ) -> Acquired | Contended:
        """Take ``keys.lock`` for ``owner`` on a majority; re-enter as :meth:`LockStore.acquire`.

        :class:`Contended` names the holder most of the refusing masters named. A split vote
        (no owner holds, or can hold, a majority) is tried again up to ``split_retries`` times
        before it is reported. Raises :class:`LockUnavailableError` when fewer than a majority
        answered, or when a majority granted it but could not confirm the token, or only after
        the lock's validity.
        """
        check_owner(owner, generation)
        check_ttl(ttl_ms)
        if keys.permits != 1:  # settings/options.py refuses singleton_permits > 1 with redlock URLs
            raise ValueError("Redlock locks have one permit: permits > 1 is not supported")
        drift_ms = self.drift_ms(ttl_ms)
        if ttl_ms <= drift_ms:
            raise ValueError(f"ttl_ms {ttl_ms} leaves no validity after the drift {drift_ms} ms")
        for retry in range(self.split_retries):
            outcome = self._attempt(keys, owner, generation, ttl_ms, meta)
            if not isinstance(outcome, _Split):
                return outcome
            time.sleep(random.uniform(0, self.split_delay_s * 2**retry))  # spread the contenders
        outcome = self._attempt(keys, owner, generation, ttl_ms, meta)
        return outcome.refusal if isinstance(outcome, _Split) else outcome

    def _attempt(
        self,
        keys: LockKeys,
        owner: str,
        generation: int,
        ttl_ms: int,
        meta: Mapping[str, str] | None,
    ) -> Acquired | Contended | _Split:
        """One round of Redlock: take, pick the token, confirm; undo on failure."""
        drift_ms = self.drift_ms(ttl_ms)
        start = self.clock()
        wait_until = time.monotonic() + (ttl_ms - drift_ms) / 1000

        def step_timeout() -> float:
            return min(self.master_timeout_s, wait_until - time.monotonic())

        # 1. take the lock on every master; where refused, read the counter too
        replies = self._run(
            {
                i: functools.partial(
                    self._take, i, keys, owner, generation, ttl_ms=ttl_ms, meta=meta
                )
                for i in range(len(self.stores))
            },
            step_timeout(),
        )
        granted: dict[int, Acquired] = {}
        refused: dict[int, tuple[Contended, int]] = {}
        for i, reply in replies.items():
            if isinstance(reply, Failed):
                continue
            outcome, counter = reply
            if isinstance(outcome, Acquired):
                granted[i] = outcome
            else:
                refused[i] = (outcome, counter)
        answered = len(granted) + len(refused)
        completed = [c for c, _ in refused.values() if isinstance(c, Completed)]
        if completed:
            # the message ran to its end: one master's record is proof (only a finished run
            # writes it); nothing to take
            if granted or len(refused) < len(self.stores):
                self._release_everywhere(keys.lock, owner, generation)
            return max(completed, key=lambda c: c.holder_generation)

        if len(granted) >= self.quorum:
            # 2. the final token
            token = max(
                [outcome.token for outcome in granted.values()]
                + [counter + 1 for _, counter in refused.values()]
            )
            # 3. carry it to every master that answered; ours where the lock still is
            confirms = self._run(
                {
                    i: functools.partial(self._confirm, i, keys, owner, generation, token, ttl_ms)
                    for i in (*granted, *refused)
                },
                step_timeout(),
            )
            confirmed = sum(1 for i in granted if confirms.get(i) == 1)
            elapsed_ms = (self.clock() - start) * 1000
            validity_ms = ttl_ms - elapsed_ms - drift_ms
            if confirmed >= self.quorum and validity_ms > 0:
                self._remember(keys.lock, owner, generation, start + (ttl_ms - drift_ms) / 1000)
                return Acquired(token, any(o.reentered for o in granted.values()))
            self._release_everywhere(keys.lock, owner, generation)
            if confirmed < self.quorum:
                reason = f"only {confirmed} of {len(self.stores)} masters confirmed it"
            else:
                reason = f"taking it took {elapsed_ms:.0f} ms, past its validity"
            raise LockUnavailableError(
                f"could not acquire {keys.lock} on a majority: {reason}{self._why(confirms)}",
                key=keys.lock,
                task_id=owner,
            )

        if granted or len(refused) < len(self.stores):
            # a master that failed or timed out may have granted it after all
            self._release_everywhere(keys.lock, owner, generation)
        if answered < self.quorum:
            raise LockUnavailableError(
                f"could not acquire {keys.lock}: {answered} of {len(self.stores)} masters "
                f"answered, {self.quorum} needed{self._why(replies)}",
                key=keys.lock,
                task_id=owner,
            )
        refusals = [contended for contended, _ in refused.values()]
        failed = len(self.stores) - answered
        named = collections.Counter((c.holder, c.holder_generation) for c in refusals)
        refusal = _most_common_holder(refusals)
        if max(named.values()) + failed < self.quorum:
            return _Split(refusal)  # nobody can hold a majority: everyone backs off and retries
        return refusal

    def _take(
        self,
        index: int,
        keys: LockKeys,
        owner: str,
        generation: int,
        *,
        ttl_ms: int,
        meta: Mapping[str, str] | None,
    ) -> tuple[Acquired | Contended, int]:
        """One master: acquire.lua, and the counter (the token if granted, else a GET)."""
        outcome = self.stores[index].acquire(keys, owner, generation, ttl_ms, meta)
        if isinstance(outcome, Acquired):
            return outcome, outcome.token
        try:
            raw = self.clients[index].get(keys.fence)
        except redis.RedisError:
            return outcome, 0  # the refusal is what counts; the counter is only a bonus
        return outcome, int(raw) if raw is not None else 0

    def _confirm(  # noqa: PLR0917 - the acquire's keys, owner, token and ttl
        self, index: int, keys: LockKeys, owner: str, generation: int, token: int, ttl_ms: int
    ) -> int:
        """One master: raise_fence.lua; 1 if the lock there is still ours."""
        fence = fence_ttl_ms(ttl_ms, self.fence_margin_ms)
        args = [2, keys.lock, keys.fence, token, fence, owner, generation]
        return int(_wire.evalsha(self.clients[index], RAISE_FENCE, args))

    def _release_everywhere(self, key: str, owner: str, generation: int) -> None:
        """Undo a failed acquire: owner-checked release on every master, errors ignored."""
        self._run(
            {i: functools.partial(s.release, key, owner, generation) for i, s in self._each()},
            self.master_timeout_s,
        )


def _most_common_holder(refusals: Sequence[Contended]) -> Contended:
    """The holder most masters named (ties: the newest token); its largest token and pttl."""
    counts = collections.Counter((c.holder, c.holder_generation) for c in refusals)

    def rank(ident: tuple[str, int]) -> tuple[int, int]:
        tokens = [c.holder_token or 0 for c in refusals if (c.holder, c.holder_generation) == ident]
        return counts[ident], max(tokens)

    holder, generation = max(counts, key=rank)
    same = [c for c in refusals if (c.holder, c.holder_generation) == (holder, generation)]
    tokens = [c.holder_token for c in same if c.holder_token is not None]
    return Contended(
        holder=holder,
        holder_generation=generation,
        holder_token=max(tokens) if tokens else None,
        pttl_ms=max(c.pttl_ms for c in same),
        finished=any(c.finished for c in same),
    )
