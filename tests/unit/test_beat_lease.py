"""Leader mode's lease judged on the clock (beat/leader.py) and a beat's Redis outages
(beat/outage.py), with a lock store that answers, fails or hangs as the test says, and a clock
the test moves: no Redis, no processes."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from celery_singleton_lock.beat.leader import BeatState
from celery_singleton_lock.beat.outage import Outage
from celery_singleton_lock.beat.runs import Run
from celery_singleton_lock.core.backend import Acquired, RenewItem, RenewStatus
from celery_singleton_lock.errors import LockUnavailableError
from celery_singleton_lock.settings.options import BeatOptions

LEASE_S = 3.0
LOGGER = "celery_singleton_lock.beat.scheduler"


class Clock:
    """A monotonic clock the test (and the store) moves."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Store:
    """A lock store whose next renewals do what the test queued: answer or raise, after
    moving the clock by how long the call took."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.renewals: list[tuple[float, RenewStatus | None]] = []
        self.calls = 0

    def answer(self, took: float = 0.0, status: RenewStatus = RenewStatus.RENEWED) -> None:
        self.renewals.append((took, status))

    def fail(self, took: float = 0.0) -> None:
        self.renewals.append((took, None))

    def renew(self, items: Sequence[RenewItem]) -> list[RenewStatus]:
        self.calls += 1
        took, status = self.renewals.pop(0)
        self.clock.now += took
        if status is None:
            raise LockUnavailableError("could not renew 1 lock(s): Timeout reading from socket")
        return [status]

    def acquire(self, *args: Any, **kwargs: Any) -> Acquired:
        return Acquired(token=1, reentered=False)


def leading(clock: Clock) -> tuple[BeatState, Store]:
    """A state that took the lease at the clock's time."""
    opts = BeatOptions(
        redis_url="redis://127.0.0.1:1/0",
        key_prefix="p:",
        mode="leader",
        skew=1.0,
        lock_at_least=0.0,
        lease=LEASE_S,
    )
    store = Store(clock)
    state = BeatState(opts=opts, pid=1, claimer="me", claims=None, store=store)  # type: ignore[arg-type]
    assert state.lead("app", clock)
    assert state.leading
    return state, store


def messages(caplog: pytest.LogCaptureFixture, needle: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if needle in r.getMessage()]


@pytest.fixture
def caplog_info(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.INFO, logger=LOGGER)
    return caplog


def test_a_renewal_that_hangs_past_the_lease_is_judged_on_the_clock_after_it(
    caplog_info: pytest.LogCaptureFixture,
) -> None:
    """The renewal, due a third of the lease in, waits for its socket timeouts until the lease
    has ended, then fails: the leader stands by. Judged on the clock read before the call, it
    would have gone on leading (and publishing) beside the instance that took the lease."""
    clock = Clock()
    state, store = leading(clock)
    clock.now += LEASE_S / 3 + 0.1
    store.fail(took=LEASE_S)
    assert state.lead("app", clock) is False
    assert not state.leading
    assert not messages(caplog_info, "still leading")
    assert messages(caplog_info, "beat: redis error, standing by") == [
        f"beat: redis error, standing by: lease not renewed for {LEASE_S / 3 + 0.1 + LEASE_S:.1f}s"
        f" (lease {LEASE_S:g}s)"
    ]


def test_a_failed_renewal_leads_on_while_the_lease_surely_lives_then_stands_by_in_time(
    caplog_info: pytest.LogCaptureFixture,
) -> None:
    """Renewals fail at once: the leader leads on, logged once, trying every second, and
    stands by at 0.9 of the lease by its clock, before it tries again (as a standby, whose
    renewal of its own lease would keep it leading)."""
    clock = Clock()
    state, store = leading(clock)
    took_at = clock.now
    clock.now += LEASE_S / 3
    store.fail()
    assert state.lead("app", clock) is True
    assert state.renew_at == clock.now + 1.0
    clock.now = state.renew_at
    store.fail()
    assert state.lead("app", clock) is True
    assert state.renew_at == pytest.approx(took_at + 0.9 * LEASE_S)
    clock.now = state.renew_at
    store.fail(took=0.5)
    assert state.lead("app", clock) is False
    assert len(messages(caplog_info, "still leading")) == 1
    (stood,) = messages(caplog_info, "standing by")
    assert f"lease not renewed for {0.9 * LEASE_S:.1f}s" in stood  # before that call
    assert len(messages(caplog_info, "beat: redis unreachable")) == 1
    assert store.calls == 3
    assert not store.renewals


def test_the_leader_keeps_its_lease_when_redis_answers_again_in_time(
    caplog_info: pytest.LogCaptureFixture,
) -> None:
    """One renewal fails, the next succeeds: leading throughout; the outage starts and ends."""
    clock = Clock()
    state, store = leading(clock)
    clock.now += LEASE_S / 3
    store.fail(took=0.2)
    assert state.lead("app", clock) is True
    clock.now = state.renew_at
    store.answer(took=0.1)
    assert state.lead("app", clock) is True
    assert state.leading
    assert not state.trusting
    assert messages(caplog_info, "leadership kept after a redis error") == [
        "beat: leadership kept after a redis error: instance=me"
    ]
    assert messages(caplog_info, "beat: redis answers again after") == [
        "beat: redis answers again after 1.1s"
    ]


def test_an_outage_is_logged_once_and_its_end_with_its_length(
    caplog_info: pytest.LogCaptureFixture,
) -> None:
    outage = Outage()
    error = LockUnavailableError("could not claim k: Connection refused")
    assert outage.failed(error, 10.0) is True
    assert outage.failed(error, 11.0) is False
    assert outage.down
    outage.answered(14.5)
    outage.answered(15.0)
    assert not outage.down
    assert [(r.levelname, r.getMessage()) for r in caplog_info.records] == [
        (
            "ERROR",
            "beat: redis unreachable, publishing nothing until it answers: "
            "could not claim k: Connection refused",
        ),
        ("WARNING", "beat: redis answers again after 4.5s"),
    ]


def run(n: int) -> Run:
    return Run("every-second", str(n), f"p:{{beat.every-second:x}}:run:{n}", 60_000)


@pytest.mark.parametrize(
    ("steps", "stale"),
    [
        ([], False),  # seen pending, looked at again: claimed again (its claimer may be dead)
        (["outage"], True),  # an outage since: Redis may have lost the claim, not claimed
        (["outage", "settled"], False),  # found published meanwhile: nothing to decide
        (["outage", "watch"], False),  # seen pending again after the outage
    ],
)
def test_a_run_seen_pending_before_an_outage_is_not_claimed_again(
    caplog_info: pytest.LogCaptureFixture, steps: list[str], stale: bool
) -> None:
    outage = Outage()
    outage.watch(run(1))
    do: dict[str, Callable[[], object]] = {
        "outage": lambda: (outage.failed(OSError("down"), 1.0), outage.answered(2.0)),
        "settled": lambda: outage.settled(run(1)),
        "watch": lambda: outage.watch(run(1)),
    }
    for step in steps:
        do[step]()
    assert outage.stale(run(1)) is stale
    assert outage.stale(run(1)) is False  # decided once
    assert outage.stale(run(2)) is False  # never watched
    dropped = messages(caplog_info, "not claimed again")
    assert dropped == (
        [
            "beat: run claimed by another instance before a redis outage, not claimed again: "
            "entry=every-second run=1"
        ]
        if stale
        else []
    )
