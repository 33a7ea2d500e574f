"""Model-based tests (hypothesis stateful) of the coalesce scripts against real Redis: the
pending follow-up of a coalescing lock (coalesce.lua, take_pending.lua, put_back_pending.lua)
and the permit slots of a key (acquire_permit.lua with release.lua).

Pending record, of a single lock and of a key with 3 permits: runs take and lose slots (released,
or expired with their node) while duplicates, each having met some holder (maybe one gone by
now), leave their calls, releases (of any run that held a slot) and purges take the record and
failed publishes put it back. After every step Redis holds what the model says: a call is left
only while every slot is held, the holder it met among them, every duplicate until the record is
taken joins one follow-up (one id, a count of them, the latest call, the holders met last), the
record is taken only while a slot is free, and only once; taken at the release of a run not
among its holders, it is superseded by that run.

Permit slots: owners take, release and lose (expiry) slots of one key with N permits, and
redelivered copies and retries of their messages come back. After every step: at most N holders,
never one owner in two slots, tokens strictly increasing per key, each slot's holder as the model
says.

``SINGLETON_MODEL_EXAMPLES`` and ``SINGLETON_MODEL_STEPS`` size the run as for
test_protocol_model.py.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import (
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from celery_singleton_lock.core.backend import Acquired, Completed, Contended, ReleaseStatus
from celery_singleton_lock.core.pending import (
    leave_pending,
    pending_key,
    put_back,
    superseded_by,
    take_pending,
)
from tests.support.script_models import SETTINGS, TTL_MS, OnRedis


class PendingModel(OnRedis):
    """The pending record of a key with ``permits`` slots (1: the lock itself)."""

    def __init__(self, redis_url: str, permits: int = 1) -> None:
        super().__init__(redis_url, permits)
        self.permits = permits
        self.run = self.store.run_script
        #: slot (1..N) -> the run holding it
        self.slots: dict[int, str] = {}
        self.holders: list[str] = []  # every run that held a slot, gone or not
        #: the record: follow-up id, how many duplicates, the latest call, and the runs that
        #: held the slots at its latest write
        self.pending: tuple[str, int, str, list[str]] | None = None
        self.taken: list[dict[str, bytes]] = []
        self.ids: set[str] = set()  # follow-up ids taken so far: a burst is taken once

    @precondition(lambda self: len(self.slots) < self.permits)
    @rule()
    def a_run_takes_a_slot(self) -> None:
        owner = uuid.uuid4().hex
        outcome = self.store.acquire(self.keys, owner, 0, TTL_MS)
        assert isinstance(outcome, Acquired)
        assert outcome.slot == min(set(range(1, self.permits + 1)) - set(self.slots))
        self.slots[outcome.slot] = owner
        self.holders.append(owner)

    @precondition(lambda self: self.holders)
    @rule(data=st.data(), call=st.text("abc", min_size=1, max_size=3))
    def a_duplicate_leaves_its_call(self, data: st.DataObject, call: str) -> None:
        met = data.draw(st.sampled_from(self.holders), label="the holder it met")
        fresh = uuid.uuid4().hex
        left = leave_pending(self.run, self.keys, met, fresh, {"call": call})
        if len(self.slots) < self.permits or met not in self.slots.values():
            assert left.follow_up is None  # a slot let go since: nothing written
            return
        follow_up, count = (fresh, 1) if self.pending is None else self.pending[:2]
        if self.pending is not None:
            count += 1
        assert (left.follow_up, left.count) == (follow_up, count)
        holders = [self.slots[slot] for slot in sorted(self.slots)]
        self.pending = (follow_up, count, call, holders)

    @precondition(lambda self: self.slots)
    @rule(data=st.data(), expire=st.booleans())
    def a_run_lets_go(self, data: st.DataObject, expire: bool) -> None:
        """Its release, or its lock's expiry (its node died: nobody released it)."""
        slot = data.draw(st.sampled_from(sorted(self.slots)), label="slot")
        owner = self.slots.pop(slot)
        if expire:
            self.client.delete(self.keys.slot(slot))
            return
        status = self.store.release(self.keys.slot(slot), owner, 0)
        assert status is ReleaseStatus.RELEASED

    @rule(data=st.data())
    def a_release_or_purge_takes_the_record(self, data: st.DataObject) -> None:
        """Taken at the release of a run (any that held a slot) or by a purge (None)."""
        releaser = data.draw(st.sampled_from([None, *self.holders]), label="whose release")
        record = take_pending(self.run, self.keys)
        if len(self.slots) == self.permits or self.pending is None:
            assert record is None
            return
        assert record is not None
        follow_up, count, call, holders = self.pending
        assert {**record, "holders": json.loads(record["holders"])} == {
            "id": follow_up.encode(),
            "count": b"%d" % count,
            "call": call.encode(),
            "holders": holders,
        }
        newer = None if releaser is None or releaser in holders else releaser
        assert superseded_by(record, releaser) == newer
        assert follow_up not in self.ids, "a burst's follow-up taken twice"
        self.ids.add(follow_up)
        self.taken.append(record)
        self.pending = None

    @precondition(lambda self: self.taken)
    @rule()
    def a_failed_publish_puts_it_back(self) -> None:
        record = self.taken.pop()
        back = put_back(self.run, self.keys, record)
        assert back == (self.pending is None)
        if back:
            self.ids.discard(record["id"].decode())
            self.pending = (
                record["id"].decode(),
                int(record["count"]),
                record["call"].decode(),
                json.loads(record["holders"]),
            )

    @invariant()
    def redis_holds_what_the_model_says(self) -> None:
        stored = self.client.hgetall(pending_key(self.keys.lock))
        if self.pending is None:
            assert stored == {}
        else:
            follow_up, count, call, holders = self.pending
            assert stored.keys() == {b"id", b"count", b"call", b"holders"}
            assert (stored[b"id"], stored[b"count"], stored[b"call"]) == (
                follow_up.encode(),
                b"%d" % count,
                call.encode(),
            )
            assert json.loads(stored[b"holders"]) == holders
        for slot in range(1, self.permits + 1):
            owner = self.client.hget(self.keys.slot(slot), "owner")
            expected = self.slots.get(slot)
            assert owner == (None if expected is None else expected.encode())


@pytest.mark.parametrize("permits", [1, 3])
def test_the_pending_record_against_the_model(redis_url: str, permits: int) -> None:
    run_state_machine_as_test(lambda: PendingModel(redis_url, permits), settings=SETTINGS)


PERMITS = 3
OWNERS = ("a", "b", "c", "d", "e")


class PermitModel(OnRedis):
    def __init__(self, redis_url: str) -> None:
        super().__init__(redis_url, PERMITS)
        #: slot (1..N) -> the (owner, generation) holding it
        self.slots: dict[int, tuple[str, int]] = {}
        self.tokens: dict[int, int] = {}
        self.last_token = 0

    def slot_of(self, owner: str) -> int | None:
        return next((i for i, (o, _) in self.slots.items() if o == owner), None)

    @rule(owner=st.sampled_from(OWNERS), retry=st.booleans())
    def a_message_starts(self, owner: str, retry: bool) -> None:
        """A message of ``owner`` (a new one, a redelivered copy, or its retry) acquires."""
        own = self.slot_of(owner)
        generation = 0 if own is None else self.slots[own][1] + int(retry)
        outcome: Any = self.store.acquire(self.keys, owner, generation, TTL_MS)
        assert not isinstance(outcome, Completed)
        if own is not None and not retry:  # a copy of the running message meets its own slot
            assert isinstance(outcome, Contended)
            assert (outcome.holder, outcome.holder_generation) == (owner, generation)
            return
        if own is None and len(self.slots) == PERMITS:
            assert isinstance(outcome, Contended)
            assert outcome.holder in {o for o, _ in self.slots.values()}
            return
        assert isinstance(outcome, Acquired), outcome
        free = min(set(range(1, PERMITS + 1)) - set(self.slots)) if own is None else own
        assert (outcome.slot, outcome.reentered) == (free, own is not None)
        assert outcome.token > self.last_token  # one counter for every slot
        self.last_token = outcome.token
        self.slots[free] = (owner, generation)
        self.tokens[free] = outcome.token

    @precondition(lambda self: self.slots)
    @rule(data=st.data(), expire=st.booleans())
    def a_run_ends(self, data: st.DataObject, expire: bool) -> None:
        slot = data.draw(st.sampled_from(sorted(self.slots)), label="slot")
        owner, generation = self.slots.pop(slot)
        token = self.tokens.pop(slot)
        if expire:
            self.client.delete(self.keys.slot(slot))
            return
        status = self.store.release(self.keys.slot(slot), owner, generation, token)
        assert status is ReleaseStatus.RELEASED

    @invariant()
    def slots_hold_what_the_model_says(self) -> None:
        held = {}
        for slot in range(1, PERMITS + 1):
            fields = self.client.hmget(self.keys.slot(slot), "owner", "gen")
            if fields[0] is not None:
                held[slot] = (fields[0].decode(), int(fields[1]))
        assert held == self.slots
        assert len({owner for owner, _ in held.values()}) == len(held)  # one slot per owner
        assert not self.client.exists(self.keys.lock)  # N > 1: the bare key is never written


def test_the_permit_slots_against_the_model(redis_url: str) -> None:
    run_state_machine_as_test(lambda: PermitModel(redis_url), settings=SETTINGS)
