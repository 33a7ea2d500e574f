"""Model-based test (hypothesis stateful) of the rate limit's script (acquire_permit.lua) against
real Redis: a key with a limit of 3 starts per 100 ms, with one permit (the lock and the rate
both apply) or none (``singleton_permits="unlimited"``: the rate alone).

Messages start (new ones, redelivered copies of one already started, retries of it), runs end
(released, or their lock expires) and time passes (for real: the script reads the server's
clock). After every step: every start the script let through is in the model, in no window of
100 ms were there more than 3 of them, a start is refused only when 3 fall in the window at
that moment (the wait it names is when the oldest leaves it), and never while the lock alone
would refuse it; the rate record holds at most 3 entries and expires within a period.

``SINGLETON_MODEL_EXAMPLES`` and ``SINGLETON_MODEL_STEPS`` size the run as for
test_protocol_model.py.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import pytest
from hypothesis import assume
from hypothesis import strategies as st
from hypothesis.stateful import invariant, rule, run_state_machine_as_test

from celery_singleton_lock.core.backend import Acquired, Contended, RateLimited, ReleaseStatus
from celery_singleton_lock.core.rates import rate_key, starts
from tests.support.history import server_time_us
from tests.support.script_models import SETTINGS, TTL_MS, OnRedis

LIMIT = 3
PERIOD_MS = 100


def _in_window(times: list[int], now_ms: int) -> int:
    """How many starts the window ending at ``now_ms`` holds: (now - period, now]."""
    return sum(1 for t in times if now_ms - PERIOD_MS < t <= now_ms)


class RateModel(OnRedis):
    def __init__(self, redis_url: str, permits: int) -> None:
        super().__init__(redis_url)
        self.permits = permits
        self.keys = self.keys.with_rate((LIMIT, PERIOD_MS)).with_permits(permits)
        self.ids = itertools.count()
        #: every start let through, in order: (owner, generation, its server time in ms)
        self.history: list[tuple[str, int, int]] = []
        #: the run holding the lock (one permit), and its token
        self.holder: tuple[str, int, int] | None = None

    def _now_ms(self) -> int:
        return server_time_us(self.client) // 1000

    def _acquire(self, owner: str, generation: int) -> tuple[Any, int, int]:
        before = self._now_ms()
        outcome = self.store.acquire(self.keys, owner, generation, TTL_MS, {"task": "m"})
        return outcome, before, self._now_ms()

    def _recorded(self, owner: str, generation: int, before: int) -> int:
        """The start time the rate record holds for ``owner:generation``, written at or after
        ``before``. If this process was held off the CPU for a period meanwhile (a loaded
        machine), the record may have expired before this read: the example is discarded."""
        recorded = starts(self.client, self.keys.lock).get(f"{owner}:{generation}")
        if recorded is None:
            assert self._now_ms() - before >= PERIOD_MS - 1, (owner, generation, before)
            assume(False)
        assert recorded is not None
        return recorded

    def _check_start(
        self, owner: str, generation: int, outcome: Any, before: int, after: int
    ) -> None:
        """A start that counts (a new message, a retry, a copy whose start left the window):
        let through while fewer than the limit are in the window, else refused with the wait."""
        times = [t for _, _, t in self.history]
        if isinstance(outcome, RateLimited):
            assert max(_in_window(times, before), _in_window(times, after)) >= LIMIT, outcome
            window = [t for t in times if t > before - PERIOD_MS]
            low = min(window) + PERIOD_MS - after
            assert low <= outcome.pttl_ms <= max(window) + PERIOD_MS - before + 1, outcome
            last = max(t for t in times)
            assert outcome.holder in {o for o, _, t in self.history if t == last}
            return
        assert isinstance(outcome, Acquired), outcome
        assert min(_in_window(times, before), _in_window(times, after)) < LIMIT, outcome
        score = self._recorded(owner, generation, before)
        assert before <= score <= after
        self.history.append((owner, generation, score))
        if self.permits:
            assert outcome.slot == 1
            assert outcome.token > 0
            self.holder = (owner, generation, outcome.token)
        else:
            assert (outcome.slot, outcome.token) == (0, 0)

    def _lock_refuses(self, owner: str, generation: int, outcome: Any) -> bool:
        """Whether the lock alone refused the call (held by another run or generation)."""
        holder = self.holder
        if holder is None or (holder[0] == owner and holder[1] < generation):
            return False
        assert type(outcome) is Contended, outcome
        assert outcome.holder == holder[0], outcome
        return True

    @rule()
    def a_new_message_starts(self) -> None:
        owner = f"m{next(self.ids)}"
        outcome, before, after = self._acquire(owner, 0)
        if not self._lock_refuses(owner, 0, outcome):
            self._check_start(owner, 0, outcome, before, after)

    @rule(pick=st.integers(0, 1000), retry=st.booleans())
    def a_started_message_comes_again(self, pick: int, retry: bool) -> None:
        """A redelivered copy of a message that started (the same generation), or its retry
        (the next one)."""
        if not self.history:
            return
        owner, generation, _ = self.history[pick % len(self.history)]
        generation += int(retry)
        seen = [t for o, g, t in self.history if (o, g) == (owner, generation)]
        latest = max(seen) if seen else None
        outcome, before, after = self._acquire(owner, generation)
        if self._lock_refuses(owner, generation, outcome):
            return
        if latest is not None and isinstance(outcome, Acquired):
            score = self._recorded(owner, generation, before)
            if score == latest:  # its start was still in the window: not counted again
                assert latest > before - PERIOD_MS, (latest, before)
                if self.permits:
                    self.holder = (owner, generation, outcome.token)
                return
        if latest is not None:  # its start had left the window: a new start
            assert latest <= after - PERIOD_MS, (latest, after)
        self._check_start(owner, generation, outcome, before, after)

    @rule(expire=st.booleans())
    def the_run_ends(self, expire: bool) -> None:
        if self.holder is None:
            return
        owner, generation, token = self.holder
        self.holder = None
        if expire:
            self.client.delete(self.keys.lock)
            return
        status = self.store.release(self.keys.lock, owner, generation, token)
        assert status is ReleaseStatus.RELEASED

    @rule(ms=st.sampled_from([5, 30, 60, 110]))
    def time_passes(self, ms: int) -> None:
        time.sleep(ms / 1000)

    @invariant()
    def never_more_than_the_limit_in_a_window(self) -> None:
        times = sorted(t for _, _, t in self.history)
        for first, last in zip(times, times[LIMIT:], strict=False):
            assert last - first >= PERIOD_MS, times

    @invariant()
    def the_record_is_small_and_expires(self) -> None:
        key = rate_key(self.keys.lock)
        assert self.client.zcard(key) <= LIMIT
        assert self.client.pttl(key) <= PERIOD_MS
        latest = {(o, g): t for o, g, t in self.history}
        for member, score in starts(self.client, self.keys.lock).items():
            owner, generation = member.rsplit(":", 1)
            assert latest[owner, int(generation)] == score


@pytest.mark.slow(seconds=4)
@pytest.mark.parametrize("permits", [1, 0], ids=["one-permit", "no-concurrency-limit"])
def test_the_rate_limit_against_the_model(redis_url: str, permits: int) -> None:
    run_state_machine_as_test(lambda: RateModel(redis_url, permits), settings=SETTINGS)
