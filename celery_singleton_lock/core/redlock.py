"""Redlock: one lock over several independent Redis masters, behind the same Protocol as
:class:`LockStore` (:class:`~.backend.LockBackend`).

Each master holds its own copy of the lock, written by the same Lua scripts as on one Redis
(:class:`LockStore`, one per master). A lock is held when a majority (``N // 2 + 1``) of the
masters granted it within its *validity*: ``ttl - elapsed - drift``, where ``elapsed`` is how
long the acquire took and ``drift = ttl * drift_factor + drift_floor_ms`` allows for the
masters' clocks running at different rates. This is antirez's Redlock, with every master asked
at once (one thread per master and call) and a short per-master timeout.

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

Renew and release go to every master; see :meth:`RedlockStore.renew` and
:meth:`RedlockStore.release` for how the answers are combined. A master that is down, refuses,
or does not answer within ``master_timeout_s`` counts as a failure for that master only.
Knows nothing of Celery.
"""

from __future__ import annotations

import collections
import functools
import logging
import random
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import redis

from ..errors import LockUnavailableError
from . import _wire
from ._fanout import DEFAULT_MASTER_TIMEOUT_S, DEFAULT_MAX_IN_FLIGHT, Failed, Fanout, describe, why
from .backend import (
    FENCE_TTL_MS,
    Acquired,
    Completed,
    Contended,
    ReleaseStatus,
    RenewItem,
    RenewStatus,
    SequentialReleases,
    check_owner,
    check_ttl,
)
from .completion import Ending
from .keys import LockKeys
from .store import LockStore

__all__ = [
    "DEFAULT_MASTER_TIMEOUT_S",
    "DEFAULT_MAX_IN_FLIGHT",
    "DEFAULT_SPLIT_DELAY_S",
    "DEFAULT_SPLIT_RETRIES",
    "RedlockStore",
]

logger = logging.getLogger(__name__)

#: How often an acquire is tried again after a split vote: no owner got (or can have) a
#: majority, because several contenders each took some masters at the same moment.
DEFAULT_SPLIT_RETRIES = 3

#: Longest random pause, in seconds, before the first such retry; it doubles with each retry.
DEFAULT_SPLIT_DELAY_S = 0.05

T = TypeVar("T")


class _Split:
    """An acquire refused without any owner holding a majority (several took some masters)."""

    __slots__ = ("refusal",)

    def __init__(self, refusal: Contended) -> None:
        self.refusal = refusal


RAISE_FENCE = _wire.script("raise_fence.lua")


class RedlockStore(SequentialReleases):
    """Acquire, renew and release locks on a majority of ``clients``, independent masters.

    Implements :class:`~.backend.LockBackend`, so it goes wherever a store does (the renewer,
    ``store_for``); it subclasses no store.

    - ``clients``: one redis-py client per master, each its own independent server (no
      replication between them). Use an odd number: 3 tolerates one failed master, 5 two.
      Give each client socket timeouts and turn its retries off
      (``retry=redis.retry.Retry(redis.backoff.NoBackoff(), 0)``): the store asks every master
      once per call, and a retry that lands late only leaves a stray copy of the lock behind
      on that master (owner-checked, gone after its ttl).
    - ``clock``: seconds, monotonic; measures how long a call took (tests inject one).
    - ``drift_factor``, ``drift_floor_ms``: the clock-drift allowance,
      ``ttl * drift_factor + drift_floor_ms`` milliseconds, subtracted from the validity.
    - ``fence_ttl_ms``: lifetime of the fencing counters, as for :class:`LockStore`.
    - ``master_timeout_s``: longest wait for the masters in one step of a call.
    - ``max_in_flight``: unanswered calls one master may have before it counts as failed at once.
    - ``split_retries``, ``split_delay_s``: how often an acquire that lost a split vote (no
      other owner can hold a majority either) is tried again, after a random pause of up to
      ``split_delay_s`` (doubling with each retry), before it reports :class:`Contended`.

    It asks each master through the public methods of a plain :class:`LockStore` of its own
    (``stores``), so the Lua scripts stay in one place. ``clients`` and ``stores`` are all the
    masters.
    """

    def __init__(
        self,
        clients: Sequence[redis.Redis],
        *,
        clock: Callable[[], float] = time.monotonic,
        drift_factor: float = 0.01,
        drift_floor_ms: int = 2,
        fence_ttl_ms: int = FENCE_TTL_MS,
        master_timeout_s: float = DEFAULT_MASTER_TIMEOUT_S,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
        split_retries: int = DEFAULT_SPLIT_RETRIES,
        split_delay_s: float = DEFAULT_SPLIT_DELAY_S,
    ) -> None:
        clients = list(clients)
        if not clients:
            raise ValueError("RedlockStore needs at least one client")
        if len({id(client) for client in clients}) != len(clients):
            raise ValueError("RedlockStore was given the same client twice")
        if not 0 <= drift_factor < 1:
            raise ValueError(f"drift_factor must be in [0, 1), got {drift_factor!r}")
        if drift_floor_ms < 0:
            raise ValueError(f"drift_floor_ms must be >= 0, got {drift_floor_ms!r}")
        if master_timeout_s <= 0:
            raise ValueError(f"master_timeout_s must be positive, got {master_timeout_s!r}")
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight!r}")
        if split_retries < 0 or split_delay_s < 0:
            raise ValueError(
                f"split_retries and split_delay_s must be >= 0, got {split_retries!r}, "
                f"{split_delay_s!r}"
            )
        if fence_ttl_ms <= 0:
            raise ValueError(f"fence_ttl_ms must be positive, got {fence_ttl_ms!r}")
        self.fence_ttl_ms = fence_ttl_ms
        self.clients: tuple[redis.Redis, ...] = tuple(clients)
        self.stores: tuple[LockStore, ...] = tuple(
            LockStore(c, fence_ttl_ms=fence_ttl_ms) for c in clients
        )
        self.quorum = len(clients) // 2 + 1
        self.clock = clock
        self.drift_factor = drift_factor
        self.drift_floor_ms = drift_floor_ms
        self.master_timeout_s = master_timeout_s
        self.split_retries = split_retries
        self.split_delay_s = split_delay_s
        self._fanout = Fanout(len(clients), max_in_flight)
        self._names = [describe(client) for client in clients]
        self._failing = [False] * len(clients)
        self._mutex = threading.Lock()
        # (key, owner, generation) -> clock time until which a majority is known to hold it
        self._valid_until: dict[tuple[str, str, int], float] = {}

    def __repr__(self) -> str:
        return f"<RedlockStore {len(self.clients)} masters, quorum {self.quorum}>"

    @property
    def client(self) -> redis.Redis:
        """The first master: where single-key records beside the locks live (publish-time
        markers; see docs/design.md, "Known limits")."""
        return self.clients[0]

    def close(self) -> None:
        """Close every master's connections."""
        for store in self.stores:
            store.close()

    def drift_ms(self, ttl_ms: int) -> float:
        """The clock-drift allowance for a lock of ``ttl_ms``."""
        return ttl_ms * self.drift_factor + self.drift_floor_ms

    # -- acquire ------------------------------------------------------------------------------

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
                    i: functools.partial(self._confirm, i, keys, owner, generation, token)
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

    def _confirm(self, index: int, keys: LockKeys, owner: str, generation: int, token: int) -> int:
        """One master: raise_fence.lua; 1 if the lock there is still ours."""
        args = [2, keys.lock, keys.fence, token, self.fence_ttl_ms, owner, generation]
        return int(_wire.evalsha(self.clients[index], RAISE_FENCE, args))

    def _release_everywhere(self, key: str, owner: str, generation: int) -> None:
        """Undo a failed acquire: owner-checked release on every master, errors ignored."""
        self._run(
            {i: functools.partial(s.release, key, owner, generation) for i, s in self._each()},
            self.master_timeout_s,
        )

    # -- renew --------------------------------------------------------------------------------

    def renew(self, items: Sequence[RenewItem]) -> list[RenewStatus]:
        """Renew every item on every master (one batched call each), then decide per lock.

        - ``RENEWED`` when a majority renewed it and the call ended within its validity.
        - Otherwise, when the answers settle it (the masters that renewed it plus those that
          failed are fewer than a majority, or its validity has run out): ``TAKEN`` when any
          master holds it for another owner or generation (someone else may hold it now),
          else ``GONE``. A majority renewed, but too late to count, is ``GONE`` too.
        - When the failed masters could still make the difference and the lock's last
          confirmed validity (from this store's acquire or renewal) has not run out yet,
          :class:`LockUnavailableError` is raised for the batch: the renewer tries again
          a second later, as it does when a single Redis is down. Once the validity has run
          out the lock is reported lost, so a run never counts on a lock that no majority
          vouched for within its ttl.
        """
        if not items:
            return []
        start = self.clock()  # the items were checked when made
        replies = self._run(
            {i: functools.partial(s.renew, items) for i, s in self._each()},
            min(
                self.master_timeout_s,
                min(it.ttl_ms - self.drift_ms(it.ttl_ms) for it in items) / 1000,
            ),
        )
        answers = [reply for reply in replies.values() if not isinstance(reply, Failed)]
        failed = len(replies) - len(answers)
        now = self.clock()
        elapsed_ms = (now - start) * 1000
        statuses: list[RenewStatus] = []
        unsettled: list[RenewItem] = []
        with self._mutex:
            self._forget_expired(now)
            for j, item in enumerate(items):
                ident = (item.key, item.owner, item.generation)
                per_master = [answer[j] for answer in answers]
                renewed = per_master.count(RenewStatus.RENEWED)
                drift_ms = self.drift_ms(item.ttl_ms)
                if renewed >= self.quorum and item.ttl_ms - elapsed_ms - drift_ms > 0:
                    self._valid_until[ident] = start + (item.ttl_ms - drift_ms) / 1000
                    statuses.append(RenewStatus.RENEWED)
                    continue
                if renewed < self.quorum <= renewed + failed and ident in self._valid_until:
                    unsettled.append(item)
                    statuses.append(RenewStatus.GONE)  # replaced by the raise below
                    continue
                self._valid_until.pop(ident, None)
                taken = RenewStatus.TAKEN in per_master
                statuses.append(RenewStatus.TAKEN if taken else RenewStatus.GONE)
        if unsettled:
            raise LockUnavailableError(
                f"could not renew {len(unsettled)} lock(s): {len(answers)} of "
                f"{len(self.stores)} masters answered, {self.quorum} needed"
                f"{self._why(replies)}",
                key=unsettled[0].key,
                task_id=unsettled[0].owner,
            )
        return statuses

    # -- release ------------------------------------------------------------------------------

    def release(
        self,
        key: str,
        owner: str,
        generation: int | None,
        token: int | None = None,
        ending: Ending | None = None,
    ) -> ReleaseStatus:
        """Release on every master, owner-checked (any generation when ``generation`` is None,
        any token when ``token`` is None); each master records what ``ending`` says (its own
        completion record and at-least window, on its own clock).

        ``RELEASED`` if any master released it. Otherwise, with fewer than a majority
        answering, :class:`LockUnavailableError`; else ``TAKEN`` if any master holds it for
        someone else, ``NOT_HELD`` if none holds it.
        """
        check_owner(owner, 0 if generation is None else generation)
        return self._release_on_each(
            lambda store: store.release(key, owner, generation, token, ending),
            key,
            owner,
            generation,
        )

    def release_lost(
        self, key: str, owner: str, generation: int, at_least_ms: int = 0
    ) -> ReleaseStatus:
        """:meth:`LockStore.release_lost` on every master, combined as :meth:`release` does;
        ``HANDED_OVER`` (before ``TAKEN``) when a master kept it as handed over to a retry."""
        check_owner(owner, generation)
        return self._release_on_each(
            lambda store: store.release_lost(key, owner, generation, at_least_ms),
            key,
            owner,
            generation,
        )

    def _release_on_each(
        self,
        release: Callable[[LockStore], ReleaseStatus],
        key: str,
        owner: str,
        generation: int | None,
    ) -> ReleaseStatus:
        """``release(store)`` on every master's store; the answers combined (see release)."""
        replies = self._run(
            {i: functools.partial(release, s) for i, s in self._each()},
            self.master_timeout_s,
        )
        with self._mutex:
            for ident in [i for i in self._valid_until if i[0] == key and i[1] == owner]:
                if generation is None or ident[2] == generation:
                    del self._valid_until[ident]
        answers = [reply for reply in replies.values() if not isinstance(reply, Failed)]
        if ReleaseStatus.RELEASED in answers:
            return ReleaseStatus.RELEASED
        if len(answers) < self.quorum:
            raise LockUnavailableError(
                f"could not release {key}: {len(answers)} of {len(self.stores)} masters "
                f"answered, {self.quorum} needed{self._why(replies)}",
                key=key,
                task_id=owner,
            )
        for status in (ReleaseStatus.HANDED_OVER, ReleaseStatus.TAKEN):
            if status in answers:
                return status
        return ReleaseStatus.NOT_HELD

    # -- holder -------------------------------------------------------------------------------

    def holder(self, key: str) -> dict[str, str]:
        """The lock's hash from the first master (in ``clients`` order) that has it; empty when
        none of the masters that answered has it. Raises :class:`LockUnavailableError` when it
        is on none of them and fewer than a majority answered."""
        replies = self._run(
            {i: functools.partial(s.holder, key) for i, s in self._each()}, self.master_timeout_s
        )
        answers = [reply for reply in replies.values() if not isinstance(reply, Failed)]
        for answer in answers:
            if answer:
                return dict(answer)
        if len(answers) < self.quorum:
            raise LockUnavailableError(
                f"could not read {key}: {len(answers)} of {len(self.stores)} masters answered"
                f"{self._why(replies)}",
                key=key,
            )
        return {}

    def run_script(self, lua: _wire.Script, args: Sequence[Any]) -> Any:
        """One call of a package script on the first master, where :attr:`client` keeps the
        records beside the locks (publish-time markers)."""
        return self.stores[0].run_script(lua, args)

    # -- helpers ------------------------------------------------------------------------------

    def _each(self) -> list[tuple[int, LockStore]]:
        return list(enumerate(self.stores))

    def _run(self, calls: Mapping[int, Callable[[], T]], timeout_s: float) -> dict[int, T | Failed]:
        replies = self._fanout.run(calls, timeout_s)
        self._log_changes(replies)
        return replies

    def _log_changes(self, replies: Mapping[int, object]) -> None:
        """WARNING when a master starts failing, INFO when it answers again (not every call)."""
        for i, reply in replies.items():
            failing = isinstance(reply, Failed)
            with self._mutex:
                changed = failing != self._failing[i]
                self._failing[i] = failing
            if not changed:
                continue
            if isinstance(reply, Failed):
                logger.warning(
                    "singleton: redlock master %d (%s) failing: %s", i, self._names[i], reply.reason
                )
            else:
                logger.info("singleton: redlock master %d (%s) answers again", i, self._names[i])

    def _why(self, replies: Mapping[int, object]) -> str:
        return why(self._names, replies)

    def _remember(self, key: str, owner: str, generation: int, until: float) -> None:
        with self._mutex:
            if len(self._valid_until) > 1024:
                self._forget_expired(self.clock())
            self._valid_until[(key, owner, generation)] = until

    def _forget_expired(self, now: float) -> None:
        """Drop validity records that have run out (call with ``_mutex`` held)."""
        for ident in [i for i, until in self._valid_until.items() if until <= now]:
            del self._valid_until[ident]


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
