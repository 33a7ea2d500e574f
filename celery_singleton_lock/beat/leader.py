"""Leader mode's lease, held in the state a beat instance keeps per process.

In leader mode one instance holds a renewed lease (the lock at ``leader_keys``) and publishes;
the others poll for it. :class:`BeatState` is what the scheduler builds once per process (its
settings, instance id, run claims and lock store) together with the lease it may hold:
:meth:`BeatState.lead` takes or renews the lease, :meth:`BeatState.give_up` releases it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from ..core.backend import Acquired, Contended, LockBackend, RenewItem, RenewStatus
from ..core.keys import leader_keys
from ..errors import LockUnavailableError
from ..settings.options import BeatOptions
from .claims import Claims
from .outage import Outage

__all__ = ["ERROR_RETRY_S", "LEASE_TRUSTED", "BeatState"]

#: the scheduler's logger, as before the lease moved out of scheduler.py
logger = logging.getLogger(f"{__package__}.scheduler")

#: How soon to try again a run that could not be claimed because Redis failed (the scheduler),
#: or a lease renewal Redis did not answer.
ERROR_RETRY_S = 1.0
#: Leader mode: after renewals Redis did not answer, the leader goes on leading until this
#: part of the lease has passed since it last confirmed the lease (before the lease can end).
LEASE_TRUSTED = 0.9


@dataclass
class BeatState:
    """A beat instance in one process: its settings, instance id, claims, store and lease."""

    opts: BeatOptions
    pid: int
    claimer: str
    claims: Claims
    store: LockBackend
    leading: bool = False
    #: monotonic time the lease was last taken or renewed, and of its next renewal
    lead_confirmed: float = 0.0
    renew_at: float = 0.0
    #: a Redis call about the lease failed: the lease may be this instance's (or still be)
    lease_unsure: bool = False
    #: leading on trust: a renewal failed, the lease surely lives yet (logged once)
    trusting: bool = False
    #: whether Redis answers this instance (its claims and its lease)
    outage: Outage = field(default_factory=Outage)

    def confirmed(self, now: float) -> None:
        """The lease was taken or renewed at ``now``: lead, renew it a third of its ttl later."""
        self.leading, self.lease_unsure, self.trusting = True, False, False
        self.lead_confirmed, self.renew_at = now, now + self.opts.lease / 3

    def lead(self, group: str, clock: Callable[[], float]) -> bool:
        """True if this instance holds the leader lease of ``group`` now (``clock``: the
        scheduler's monotonic clock); renews it a third of its ttl after it was last confirmed.

        A renewal Redis does not answer does not depose the leader while its lease surely lives
        (:data:`LEASE_TRUSTED`): nobody else can take it before it ends, and its runs are still
        claimed, so those Redis refuses are retried as usual; the renewal is tried again
        :data:`ERROR_RETRY_S` later. That is judged on the clock read after the failed call,
        which may have waited for its socket timeouts: a leader whose call outlived the trusted
        part of its lease stands by, and one that reaches it unrenewed stands by before it tries
        again. After any Redis error the lease may be this instance's (a renewal that got no
        answer, an acquire that ran but whose reply was lost): the next attempt renews it first,
        and a lease the acquire finds held by this instance is renewed too. Renewals are
        owner-checked: a lease another instance holds is never taken. Every call's outcome goes
        to the instance's :class:`.outage.Outage` (an outage is logged once).
        """
        now = clock()
        if self.leading and now < self.renew_at:
            return True
        if self.trusting and now >= self._trusted_until():  # tried again as a standby below
            self._stand_by(now)
        try:
            leads = self._take_or_renew(group, now)
        except LockUnavailableError as exc:
            return self._lease_failed(exc, clock())
        self.outage.answered(clock())
        return leads

    def _take_or_renew(self, group: str, now: float) -> bool:
        """Renew the lease (this instance leads, or may) or take it; True if this instance
        leads. ``now``: the clock before the calls (the lease lives at least a ttl from it)."""
        keys = leader_keys(self.opts.key_prefix, group)
        lease = RenewItem(keys.lock, self.claimer, 0, round(self.opts.lease * 1000))
        if (self.leading or self.lease_unsure) and self._renew_lease(lease, now):
            return True
        outcome = self.store.acquire(keys, self.claimer, 0, lease.ttl_ms, {"role": "beat-leader"})
        if isinstance(outcome, Contended) and outcome.holder == self.claimer:
            self.lease_unsure = True  # an earlier acquire took it; its reply was lost
            return self._renew_lease(lease, now)
        self.lease_unsure = False
        if isinstance(outcome, Acquired):
            self.confirmed(now)
            logger.info("beat: became leader: instance=%s token=%d", self.claimer, outcome.token)
            return True
        return False

    def _lease_failed(self, error: LockUnavailableError, now: float) -> bool:
        """A call about the lease failed; ``now`` is the clock after it (the call may have
        waited for its socket timeouts). Still leading while the lease surely lives (logged
        once), else standing by (logged, as a leader)."""
        self.lease_unsure = True
        self.outage.failed(error, now)
        trusted_until = self._trusted_until()
        if self.leading and now < trusted_until:
            self.renew_at = min(now + ERROR_RETRY_S, trusted_until)
            if not self.trusting:
                self.trusting = True
                logger.error(
                    "beat: redis error, lease not renewed, still leading for %.1fs at most: %s",
                    trusted_until - now,
                    error,
                )
            return True
        if self.leading:
            self._stand_by(now)
        return False

    def _trusted_until(self) -> float:
        """Until when the lease surely lives, unrenewed (monotonic)."""
        return self.lead_confirmed + self.opts.lease * LEASE_TRUSTED

    def _stand_by(self, now: float) -> None:
        """Stop leading at ``now``: the lease was not renewed and may end soon."""
        logger.error(
            "beat: redis error, standing by: lease not renewed for %.1fs (lease %gs)",
            now - self.lead_confirmed,
            self.opts.lease,
        )
        self.leading = self.trusting = False

    def _renew_lease(self, lease: RenewItem, now: float) -> bool:
        """Renew the lease if this instance holds it; True if it does (it leads then)."""
        status = self.store.renew([lease])[0]
        if status is RenewStatus.RENEWED:
            if self.lease_unsure:
                logger.warning(
                    "beat: leadership kept after a redis error: instance=%s", self.claimer
                )
            self.confirmed(now)
            return True
        if self.leading:
            logger.error("beat: leadership lost: instance=%s reason=%s", self.claimer, status.name)
        self.leading = self.lease_unsure = self.trusting = False
        return False

    def give_up(self, group: str) -> None:
        """Release the leader lease (this instance leads) so a standby takes over at once."""
        keys = leader_keys(self.opts.key_prefix, group)
        try:
            self.store.release(keys.lock, self.claimer, 0)
            logger.info("beat: leadership released: instance=%s", self.claimer)
        except LockUnavailableError as exc:
            logger.warning("beat: could not release leadership: %s", exc)
        self.leading = False
