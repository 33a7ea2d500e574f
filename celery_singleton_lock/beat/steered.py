"""A beat instance in an operator's hands: it registers its schedule and looks for asks.

Once a second at most (:data:`POLL_S`), in one round trip, an instance that publishes (every
instance in active mode, the leader in leader mode) notes itself among the group's beats and
reads the operators' asks (steering.py). Each live ask of an entry in its schedule becomes a
run, ``ask-<ask id>``, claimed and published like a scheduled run: one beat publishes it, once,
even when the entry is paused (an operator asked for it). An instance takes up each ask once;
a claim left pending by a beat that died is claimed again when its lease ends, as any run's.
A dead ask (its ``until`` passed) is forgotten. The schedule is registered, in one more round
trip, when it changed and every :data:`REGISTER_S`.

Knows the scheduler through what it asks of it: its clocks and its group.
"""

from __future__ import annotations

import logging
from typing import Any, Final

from ..core.keys import run_claim_key
from ..errors import LockUnavailableError
from .claims import RunNote
from .described import describe
from .leader import BeatState
from .runs import Run
from .steering import ASK_KEEP_MS, Ask, Steering

__all__ = ["POLL_S", "REGISTER_S", "Steered"]

#: the scheduler's logger
logger = logging.getLogger(f"{__package__}.scheduler")

#: How often a beat instance looks for asks, at most (seconds).
POLL_S: Final = 1.0
#: How often a beat instance looks for asks while Redis does not answer it (seconds).
OUTAGE_POLL_S: Final = 5.0
#: How often a beat instance registers its schedule again, unchanged (seconds).
REGISTER_S: Final = 600.0

#: An asked run: not at a nominal time (not in the entry's record), published while paused.
ASKED = RunNote(pausable=False)


class Steered:
    """One beat instance's side of steering: its registered schedule and the asks it took."""

    def __init__(self) -> None:
        self._steering: Steering | None = None
        self._state: BeatState | None = None
        #: monotonic time it last looked for asks, and registered its schedule
        self._polled_at = float("-inf")
        self._registered_at = float("-inf")
        #: what it last registered: (the schedule's identity and edits, the descriptions)
        self._registered: tuple[int, int, int] | None = None
        #: the asks it took up (their values)
        self._taken: set[str] = set()

    def steering(self, state: BeatState, group: str) -> Steering:
        if self._steering is None or self._state is not state:  # on the claims' clients
            steering = Steering(state.claims.clients, state.opts.key_prefix, group)
            self._steering, self._state = steering, state
        return self._steering

    def asked_runs(
        self, sched: Any, state: BeatState, schedule: Any, group: str, edits: int
    ) -> list[tuple[Any, Run]]:
        """The runs operators asked for that this instance should claim now (at most once a
        second); the schedule registered if it changed."""
        now = sched.singleton_monotonic()
        if now < self._polled_at + self._poll_every(state):
            return []
        self._polled_at = now
        steering = self.steering(state, group)
        now_ms = int(sched.singleton_clock() * 1000)
        try:
            self._register(steering, state, schedule, edits, now)
            asks = steering.heartbeat(state.claimer, now_ms)
        except LockUnavailableError as exc:  # logged once per outage
            state.outage.failed(exc, now)
            return []
        state.outage.answered(now)
        self._taken &= {ask.value for ask in asks}
        runs: list[tuple[Any, Run]] = []
        for ask in asks:
            if ask.value in self._taken:
                continue
            entry = schedule.get(ask.entry)
            if ask.until_ms < now_ms - state.opts.skew * 1000:  # dead: its operator gave up
                self._forget(steering, ask)
                continue
            if entry is None or ask.until_ms < now_ms:
                continue
            self._taken.add(ask.value)
            logger.info(
                "beat: run asked by an operator: entry=%s run=%s by=%s", ask.entry, ask.run, ask.by
            )
            key = run_claim_key(state.opts.key_prefix, ask.entry, ask.run)
            runs.append((entry, Run(ask.entry, ask.run, key, ASK_KEEP_MS, ASKED)))
        return runs

    @staticmethod
    def _poll_every(state: BeatState) -> float:
        """How often it looks for asks: :data:`POLL_S`; while Redis does not answer, every
        :data:`OUTAGE_POLL_S` (each try may take a socket timeout); never while a leader's
        lease is in doubt (judging it comes first)."""
        if state.opts.mode == "leader" and (state.lease_unsure or state.trusting):
            return float("inf")
        return OUTAGE_POLL_S if state.outage.down else POLL_S

    def next_poll_in(self, state: BeatState, now: float) -> float:
        """How long from monotonic time ``now`` until it looks for asks again (at most
        :data:`POLL_S`: woken up then, it decides again)."""
        every = self._poll_every(state)
        if every > POLL_S:  # less often, or not now: no need to be woken up for it
            return POLL_S
        return min(max(self._polled_at + every - now, 0.0), POLL_S)

    def _register(
        self, steering: Steering, state: BeatState, schedule: Any, edits: int, now: float
    ) -> None:
        seen = (id(schedule), len(schedule), edits)
        if seen == self._registered and now - self._registered_at < REGISTER_S:
            return
        entries = {
            name: describe(entry, state.opts.catch_up) for name, entry in list(schedule.items())
        }
        steering.register(entries)
        self._registered, self._registered_at = seen, now

    def _forget(self, steering: Steering, ask: Ask) -> None:
        try:
            steering.forget(ask)
        except LockUnavailableError as exc:
            logger.debug("beat: could not forget a dead ask: %s", exc)

    def gone(self) -> None:
        """The instance stops: no longer among the group's beats (best effort)."""
        if self._steering is None or self._state is None:
            return
        try:
            self._steering.gone(self._state.claimer)
        except LockUnavailableError as exc:
            logger.debug("beat: could not leave the group's beats: %s", exc)
