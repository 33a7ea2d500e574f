"""Model-based test (hypothesis stateful) of debounce.lua against real Redis, on a clock the
test moves (``now_ms``).

Calls of one key arrive after random gaps (some within the window of the call before, some
after it, some after the cap), each told to wait; their waiting copies come due at their due
time or late, in any order; first deliveries and copies are delivered again (a broker's
redelivery); a call that runs leaves its completion record, as its release would; the state
expires (a copy that comes a day late). Every verdict is the one the model's burst says:
a call joins the burst while the burst's due time has not passed, the burst is due S after its
latest call and at most M after its first, only its latest call runs, an earlier one is
superseded by the latest, a call that ran is never superseded afterwards.

At the end every copy comes due: each burst ran exactly once, with its latest call, at or
after its due time; every other call was superseded by a later call; Redis holds no field for
a call that is not waiting.

``SINGLETON_MODEL_EXAMPLES`` and ``SINGLETON_MODEL_STEPS`` size the run as for
test_protocol_model.py.
"""

from __future__ import annotations

import uuid

import pytest
import redis
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from celery_singleton_lock.core.completion import done_key
from celery_singleton_lock.core.debounce import DEBOUNCE_KEEP_MS, Verdict, debounce, debounce_key
from celery_singleton_lock.core.keys import lock_keys
from celery_singleton_lock.core.store import LockStore
from tests.support.prefixes import delete_prefix
from tests.support.script_models import SETTINGS

WINDOW_MS = 1_000


class DebounceModel(RuleBasedStateMachine):
    def __init__(self, redis_url: str, cap_ms: int | None) -> None:
        super().__init__()
        self.client = redis.Redis.from_url(redis_url)
        self.namespace = f"cslt:{uuid.uuid4().hex[:8]}:"
        self.run = LockStore(self.client).run_script
        self.keys = lock_keys(self.namespace, "m.debounce", b"k")
        self.cap_ms = cap_ms
        self.now = 1_000_000_000
        self.made: list[str] = []  # every call, in the order they arrived
        self.copies: dict[str, int] = {}  # a call whose copy waits -> when it is due
        self.waiting: set[str] = set()  # the calls the state has a field for
        self.decided: dict[str, tuple[str, str | None]] = {}  # a call -> its first end
        self.ran_at: dict[str, int] = {}
        self.running: str | None = None  # the call whose run holds the lock
        # the burst, as the spec says
        self.burst: list[str] = []
        self.first = self.due = 0
        self.fired = False
        self.closed: set[str] = set()  # latest calls of earlier bursts, due, not come yet
        self.bursts: list[tuple[list[str], int]] = []  # each burst's calls and due, in order
        self.cut: set[int] = set()  # bursts whose state expired before they ran

    # -- the spec ----------------------------------------------------------------------------

    def _registered(self, call: str) -> Verdict:
        """A call joins the burst (or starts one): it waits for the burst's due time."""
        if not self.burst or self.fired or self.now >= self.due:
            if self.burst and not self.fired:
                self.closed.add(self.burst[-1])
            self.burst, self.first, self.fired = [], self.now, False
            self.bursts.append((self.burst, 0))
        self.burst.append(call)
        due = self.now + WINDOW_MS
        if self.cap_ms is not None:
            due = max(min(due, self.first + self.cap_ms), self.now)
        self.due = due
        self.bursts[-1] = (self.burst, due)
        self.copies[call] = due
        self.waiting.add(call)
        return Verdict("wait", (due - self.now) / 1000, len(self.burst))

    def _expected(self, call: str, *, due: bool) -> Verdict:
        latest = self.burst[-1] if self.burst else None
        if call == latest or call in self.closed:
            if not due and call == latest and not self.fired and self.now < self.due:
                return Verdict("wait", (self.due - self.now) / 1000, len(self.burst))
            if call == latest:
                self.fired = True
            self.closed.discard(call)
            self.copies.pop(call, None)
            self.waiting.discard(call)
            return Verdict("run")
        if call in self.ran_at:
            return Verdict("run")
        if latest is not None and (due or call in self.waiting):
            self.copies.pop(call, None)
            self.waiting.discard(call)
            return Verdict("superseded", by=latest)
        return self._registered(call)

    def _decide(self, call: str, *, due: bool) -> None:
        expected = self._expected(call, due=due)
        got = debounce(
            self.run,
            self.keys,
            call,
            0,
            due=due,
            window_s=WINDOW_MS / 1000,
            max_s=None if self.cap_ms is None else self.cap_ms / 1000,
            now_ms=self.now,
        )
        assert got == expected, (call, due)
        if got.action == "run" and call not in self.ran_at:
            self.ran_at[call] = self.now
            if self.running is None:  # it holds the lock while it runs
                self.client.hset(self.keys.lock, "owner", call)
                self.running = call
            else:  # it ran (its own lock's ending is not this test's)
                self.client.set(done_key(self.keys.lock, call), 0)
        if got.action != "wait":
            self.decided.setdefault(call, (got.action, got.by))

    # -- rules -------------------------------------------------------------------------------

    @rule(gap=st.sampled_from([0, 1, 300, 700, 999, 999, 1_000, 1_500, 2_600]))
    def a_call_arrives(self, gap: int) -> None:
        self.now += gap
        call = f"c{len(self.made):04d}"
        self.made.append(call)
        self._decide(call, due=False)

    @precondition(lambda self: self.copies)
    @rule(data=st.data(), late=st.sampled_from([0, 0, 1, 400]))
    def a_copy_comes_due(self, data: st.DataObject, late: int) -> None:
        call = data.draw(st.sampled_from(sorted(self.copies)), label="whose")
        self.now = max(self.now, self.copies[call] + late)
        self._decide(call, due=True)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def a_first_delivery_comes_again(self, data: st.DataObject) -> None:
        """Its worker died before acknowledging it (its copy is out, still waiting): the
        broker gives it back at once, not a day later."""
        self._decide(data.draw(st.sampled_from(sorted(self.waiting)), label="whose"), due=False)

    @precondition(lambda self: self.decided)
    @rule(data=st.data())
    def a_decided_copy_comes_again(self, data: st.DataObject) -> None:
        """A broker's redelivery of a copy that ran, or was superseded, already."""
        call = data.draw(st.sampled_from(sorted(self.decided)), label="whose")
        if call in self.ran_at or self.burst:
            self._decide(call, due=True)

    @precondition(lambda self: self.running is not None)
    @rule()
    def the_run_ends(self) -> None:
        """Its release deletes the lock and records its completion."""
        assert self.running is not None
        self.client.delete(self.keys.lock)
        self.client.set(done_key(self.keys.lock, self.running), 0)
        self.running = None

    @rule()
    def the_state_expires(self) -> None:
        """A day past its due time: copies still waiting register again when they come."""
        self.now += DEBOUNCE_KEEP_MS
        self.client.delete(debounce_key(self.keys.lock))
        # every burst a copy of which still waits: it registers again when it comes
        pending = set(self.copies)
        self.cut.update(i for i, (calls, _) in enumerate(self.bursts) if pending & set(calls))
        self.burst, self.fired = [], False
        self.closed.clear()
        self.waiting.clear()

    # -- checks ------------------------------------------------------------------------------

    @invariant()
    def redis_holds_the_burst_the_model_says(self) -> None:
        state = {
            k.decode(): v.decode()
            for k, v in self.client.hgetall(debounce_key(self.keys.lock)).items()
        }
        if not self.burst:
            assert state == {}
            return
        assert state["latest"] == self.burst[-1]
        assert int(state["due"]) == self.due
        assert {k[2:] for k in state if k.startswith("c:")} == self.waiting
        assert {k[2:] for k, v in state.items() if v == "r"} == self.closed

    def teardown(self) -> None:
        try:
            while self.copies:  # every copy comes, in the order of their due times
                call = min(self.copies, key=lambda c: (self.copies[c], c))
                self.now = max(self.now, self.copies[call])
                self._decide(call, due=True)
            order = {c: i for i, c in enumerate(self.made)}
            whole = {
                c for i, (calls, _) in enumerate(self.bursts) if i not in self.cut for c in calls
            }
            for call in self.made:  # every call ended: it ran, or a later call superseded it
                action, by = self.decided[call]
                if call in whole:  # else its state expired under it: it waited again
                    assert action == "run" or order[str(by)] > order[call], (call, by)
            for i, (calls, due) in enumerate(self.bursts):
                if i in self.cut:
                    continue
                ran = [c for c in calls if self.decided[c][0] == "run"]
                assert ran == [calls[-1]], (calls, ran)  # once, with its latest call
                assert self.ran_at[calls[-1]] >= due  # not before its due time
            assert not self.waiting
        finally:
            delete_prefix(self.client, self.namespace)
            self.client.close()


@pytest.mark.parametrize("cap_ms", [None, 2_500], ids=["no cap", "cap"])
def test_debounce_against_the_model(redis_url: str, cap_ms: int | None) -> None:
    run_state_machine_as_test(lambda: DebounceModel(redis_url, cap_ms), settings=SETTINGS)
