"""Model-based test (hypothesis stateful) of the join scripts against real Redis: join.lua,
take_joiners.lua and unjoin.lua beside a lock taken and let go by acquire.lua and release.lua.

Runs take the lock, end (their end takes the joiners, they release, and take them again:
duplicates may join in between), die (their lock expires, nobody takes anything; also between
their end's take and their release) or are ended by the worker's main process while they still
hold the lock (a terminate, a hard time limit), which releases the lock after a grace and takes
the joiners again. Duplicates join the run they met (maybe gone
by now); a joiner's watch copy arrives (it joins the holder again, or takes the free lock and
runs in a dead holder's place); a joiner whose watch copy could not be published is withdrawn.
The broker hands a watch copy out again (a Redis ``visibility_timeout`` shorter than its
countdown): whichever of the copies of the live serial comes first acts, and every other one is
stale (join.lua and unjoin.lua say so and write nothing; one that finds the lock free releases
it without running).

After every step Redis holds the joiners the model says, each with the holder it joined last
and the serial of its live watch copy, no record names a run that released its lock (its end
completed every joiner it had), and no joined call has ended twice. At the end every run ends
and every watch copy comes: each joined call has then ended exactly once (completed by a run's
end, or run itself).

``SINGLETON_MODEL_EXAMPLES`` and ``SINGLETON_MODEL_STEPS`` size the run as for
test_protocol_model.py.
"""

from __future__ import annotations

import uuid
from collections import Counter

import redis
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from celery_singleton_lock.core.backend import Acquired, ReleaseStatus
from celery_singleton_lock.core.joiners import STALE, join, joiners_key, take_joiners, unjoin
from celery_singleton_lock.core.keys import lock_keys
from celery_singleton_lock.core.store import LockStore
from tests.support.prefixes import delete_prefix
from tests.support.script_models import SETTINGS, TTL_MS

KEEP_MS = 60_000


class JoinModel(RuleBasedStateMachine):
    def __init__(self, redis_url: str) -> None:
        super().__init__()
        self.client = redis.Redis.from_url(redis_url)
        self.namespace = f"cslt:{uuid.uuid4().hex[:8]}:"
        self.store = LockStore(self.client)
        self.run = self.store.run_script
        self.keys = lock_keys(self.namespace, "m.join", b"k")
        self.holder: str | None = None
        self.ending: str | None = None  # the holder between its end's take and its release
        self.released: set[str] = set()  # runs that released their lock
        self.lost: set[str] = set()  # runs the main process ended (terminated, timed out)
        self.runs: list[str] = []  # every run that held the lock, gone or not
        self.joined: dict[str, str] = {}  # joiner -> the holder its record names
        self.waiting: set[str] = set()  # joiners whose watch copy is still to come
        self.serial: dict[str, int | None] = {}  # joiner -> the serial of its live watch copy
        self.before: dict[str, int | None] = {}  # joiner -> that of the copy that joined last
        self.copies: list[tuple[str, int | None]] = []  # copies the broker handed out again
        self.ended: Counter[str] = Counter()  # joiner -> how often it ended
        self.joiners: set[str] = set()  # every duplicate that joined once
        self.made = 0  # ids are made in order: a replay of the example draws the same ones

    def _id(self, kind: str) -> str:
        self.made += 1
        return f"{kind}{self.made:04d}"

    # -- runs ------------------------------------------------------------------------------

    def _take(self, owner: str) -> None:
        outcome = self.store.acquire(self.keys, owner, 0, TTL_MS)
        assert isinstance(outcome, Acquired)
        self.holder = owner
        self.runs.append(owner)

    @precondition(lambda self: self.holder is None)
    @rule()
    def a_run_takes_the_lock(self) -> None:
        self._take(self._id("run"))

    def _end_takes(self, ended: str) -> None:
        """What ``ended``'s end takes: every record but its own (dropped)."""
        expected = {j for j, met in self.joined.items() if j != ended}
        if self.holder is not None and self.holder != ended:
            expected = {j for j in expected if self.joined[j] != self.holder}
        taken = take_joiners(self.run, self.keys.lock, ended)
        assert {j.task_id for j in taken} == expected
        for joiner in taken:
            assert joiner.holder == self.joined[joiner.task_id]
            assert joiner.record == b"r-" + joiner.task_id.encode()
            self.ended[joiner.task_id] += 1
            self.waiting.discard(joiner.task_id)
            del self.joined[joiner.task_id]
        self.joined.pop(ended, None)

    @precondition(lambda self: self.holder is not None and self.ending is None)
    @rule(expire=st.booleans())
    def the_holder_lets_go(self, expire: bool) -> None:
        """Its end's first take (a watch copy that takes the freed lock finds its record
        gone), its release coming next; or its lock's expiry (its node died)."""
        holder = self.holder
        assert holder is not None
        if expire:
            self.holder = None
            self.client.delete(self.keys.lock)
            return
        self._end_takes(holder)
        self.ending = holder

    @precondition(lambda self: self.ending is not None)
    @rule(dies=st.booleans())
    def the_ending_run_releases(self, dies: bool) -> None:
        """Its release, then its end's second take (those that joined in between); or its
        node dies before the release (its lock expires)."""
        ending = self.ending
        assert ending is not None
        self.ending = self.holder = None
        if dies:
            self.client.delete(self.keys.lock)
            return
        assert self.store.release(self.keys.lock, ending, 0) is ReleaseStatus.RELEASED
        self.released.add(ending)
        self._end_takes(ending)

    @precondition(lambda self: self.holder is not None and self.ending is None)
    @rule()
    def the_main_process_ends_the_holder(self) -> None:
        """A terminate or a hard time limit: its joiners end while it still holds the lock."""
        assert self.holder is not None
        self._end_takes(self.holder)
        self.lost.add(self.holder)

    @precondition(lambda self: self.holder in self.lost and self.ending is None)
    @rule()
    def the_main_process_releases_the_lost_run(self) -> None:
        """After the grace: it releases the lost run's lock, then takes the joiners once more
        (those that joined during the grace)."""
        holder = self.holder
        assert holder is not None
        self.holder = None
        status = self.store.release_lost(self.keys.lock, holder, 0)
        assert status is ReleaseStatus.RELEASED
        self.released.add(holder)
        self._end_takes(holder)

    # -- joiners ---------------------------------------------------------------------------

    def _join(self, joiner: str, met: str, serial: int | None = None) -> bool:
        """``joiner``'s copy of ``serial`` (None: its own message) joins ``met``."""
        recorded = self.serial[joiner] if joiner in self.joined else None
        stale = joiner in self.joined and serial is not None and serial != recorded
        joined = join(
            self.run, self.keys.lock, met, joiner, b"r-" + joiner.encode(), KEEP_MS, serial
        )
        if stale:
            assert joined == STALE
            return False
        if met != self.holder:
            assert joined == 0
            return False
        assert joined == (recorded if joiner in self.joined else serial or 0) + 1
        self.joined[joiner] = met
        self.serial[joiner], self.before[joiner] = joined, serial
        self.waiting.add(joiner)
        self.joiners.add(joiner)
        return True

    @precondition(lambda self: self.runs)
    @rule(data=st.data())
    def a_duplicate_joins(self, data: st.DataObject) -> None:
        met = data.draw(st.sampled_from(self.runs), label="the holder it met")
        self._join(self._id("dup"), met)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def a_watch_copy_arrives(self, data: st.DataObject) -> None:
        joiner = data.draw(st.sampled_from(sorted(self.waiting)), label="whose")
        self._arrives(joiner, self.serial[joiner])

    def _arrives(self, joiner: str, serial: int | None, *, again: bool = False) -> None:
        """A copy of ``joiner``'s message, of ``serial``, comes due; ``again``: one the broker
        handed out again, whose live copy is still to come."""
        if joiner not in self.waiting:  # it ended: its completion record drops the copy
            return
        live = self.serial[joiner]
        if self.holder is None:  # runs in a dead holder's place, unless stale
            self._run_in_place(joiner, serial)
        elif self.holder != joiner and self._join(joiner, self.holder, serial) and again:
            # it acted as the live copy: the one still to come, of the serial before, is stale
            self.copies.append((joiner, live))

    def _run_in_place(self, joiner: str, serial: int | None) -> None:
        """A watch copy takes the free lock and withdraws its record: it ends by running. A
        stale one withdraws nothing and lets go of the lock: the live one is still to come."""
        self._take(joiner)
        stale = joiner in self.joined and serial is not None and serial != self.serial[joiner]
        withdrawn = unjoin(self.run, self.keys.lock, joiner, serial)
        if stale:
            assert withdrawn == STALE
            assert self.store.release(self.keys.lock, joiner, 0) is ReleaseStatus.RELEASED
            self.holder = None
            return
        assert withdrawn == (joiner in self.joined)
        self.joined.pop(joiner, None)
        self.waiting.discard(joiner)
        self.ended[joiner] += 1

    @precondition(lambda self: self.joined.keys() & self.waiting)
    @rule(data=st.data())
    def a_joiner_is_withdrawn(self, data: st.DataObject) -> None:
        """Its watch copy could not be published: requeued instead (it comes back, the copy
        that joined: of the serial before)."""
        joiner = data.draw(st.sampled_from(sorted(self.joined.keys() & self.waiting)))
        assert unjoin(self.run, self.keys.lock, joiner, self.serial[joiner]) == 1
        del self.joined[joiner]
        self.serial[joiner] = self.before[joiner]

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def the_broker_hands_a_copy_out_again(self, data: st.DataObject) -> None:
        """A copy of a joiner's live watch copy (or of an older one still in flight)."""
        joiner = data.draw(st.sampled_from(sorted(self.waiting)), label="whose")
        self.copies.append((joiner, self.serial[joiner]))

    @precondition(lambda self: self.copies)
    @rule(data=st.data())
    def a_copy_handed_out_again_arrives(self, data: st.DataObject) -> None:
        index = data.draw(st.integers(0, len(self.copies) - 1), label="which")
        joiner, serial = self.copies.pop(index)
        self._arrives(joiner, serial, again=True)

    # -- checks ----------------------------------------------------------------------------

    @invariant()
    def redis_holds_the_joiners_the_model_says(self) -> None:
        stored = self.client.hgetall(joiners_key(self.keys.lock))
        assert {k.decode(): v for k, v in stored.items()} == {
            j: f"{met}|{self.serial[j]}|r-{j}".encode() for j, met in self.joined.items()
        }
        assert all(count == 1 for count in self.ended.values()), self.ended
        assert not set(self.joined.values()) & self.released, self.joined

    def teardown(self) -> None:
        try:
            # every run ends, every copy comes
            for _ in range(6 * len(self.joiners) + 3 * len(self.copies) + 4):
                if self.ending is not None:
                    self.the_ending_run_releases(dies=False)
                elif self.holder is not None:
                    self.the_holder_lets_go(expire=False)
                elif self.copies:
                    self._arrives(*self.copies.pop(0), again=True)
                elif self.waiting:
                    joiner = sorted(self.waiting)[0]
                    self._run_in_place(joiner, self.serial[joiner])
                else:
                    break
            assert not self.waiting
            assert {j: self.ended[j] for j in self.joiners} == dict.fromkeys(self.joiners, 1)
            assert not self.client.exists(joiners_key(self.keys.lock))
        finally:
            delete_prefix(self.client, self.namespace)
            self.client.close()


def test_the_joiners_against_the_model(redis_url: str) -> None:
    run_state_machine_as_test(lambda: JoinModel(redis_url), settings=SETTINGS)
