"""Redlock: one lock over several independent Redis masters, behind the same Protocol as
:class:`LockStore` (:class:`~.backend.LockBackend`).

Each master holds its own copy of the lock, written by the same Lua scripts as on one Redis
(:class:`LockStore`, one per master). A lock is held when a majority (``N // 2 + 1``) of the
masters granted it within its *validity*: ``ttl - elapsed - drift``, where ``elapsed`` is how
long the acquire took and ``drift = ttl * drift_factor + drift_floor_ms`` allows for the
masters' clocks running at different rates. This is antirez's Redlock, with every master asked
at once (one thread per master and call) and a short per-master timeout.

Taking a lock (the three steps, and why the fencing token keeps increasing across holders) is in
:mod:`.redlock_acquire`; the masters, the fan-out and what the store knows of each lock's
validity in :mod:`.redlock_masters`.

Renew and release go to every master; see :meth:`RedlockStore.renew` and
:meth:`RedlockStore.release` for how the answers are combined. A master that is down, refuses,
or does not answer within ``master_timeout_s`` counts as a failure for that master only.
Knows nothing of Celery.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import LockUnavailableError
from . import _wire
from ._fanout import DEFAULT_MASTER_TIMEOUT_S, DEFAULT_MAX_IN_FLIGHT, Failed
from .backend import ReleaseStatus, RenewItem, RenewStatus, check_owner
from .completion import Ending
from .redlock_acquire import RedlockAcquire
from .redlock_masters import DEFAULT_SPLIT_DELAY_S, DEFAULT_SPLIT_RETRIES
from .store import LockStore

__all__ = [
    "DEFAULT_MASTER_TIMEOUT_S",
    "DEFAULT_MAX_IN_FLIGHT",
    "DEFAULT_SPLIT_DELAY_S",
    "DEFAULT_SPLIT_RETRIES",
    "RedlockStore",
]


class RedlockStore(RedlockAcquire):
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
    - ``fence_margin_ms``: how long each master's fencing counter outlives the lock's ttl, as
      for :class:`LockStore`.
    - ``master_timeout_s``: longest wait for the masters in one step of a call.
    - ``max_in_flight``: unanswered calls one master may have before it counts as failed at once.
    - ``split_retries``, ``split_delay_s``: how often an acquire that lost a split vote (no
      other owner can hold a majority either) is tried again, after a random pause of up to
      ``split_delay_s`` (doubling with each retry), before it reports :class:`Contended`.

    It asks each master through the public methods of a plain :class:`LockStore` of its own
    (``stores``), so the Lua scripts stay in one place. ``clients`` and ``stores`` are all the
    masters.
    """

    def __repr__(self) -> str:
        return f"<RedlockStore {len(self.clients)} masters, quorum {self.quorum}>"

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
                renewed = per_master.count(RenewStatus.RENEWED)  # "cancel" refuses Redlock
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
