"""A model-based test of the lock protocol against real Redis (hypothesis stateful testing).

A few keys and owners; hypothesis interleaves the protocol's operations, the way a worker, its
main process, publishers and an operator would:

- publish a call (the queued marker, publish/dedup.py ``publish``), a chain step or
  callback (published by a running run, with its ``parent_id``), a retried message, a
  redelivered copy;
- start a message: ``Renewer.acquire``, then the queued marker handed over
  (publish/dedup.py ``forget``);
- renew (``Renewer.run_due``), and a renewal that was on the wire when the lock was handed over;
- end a run: release now, release deferred (written ahead on one server, queued for the
  renewer thread on a store that cannot write ahead), the retry hand-over, the loss of its pool
  child (the main process's ``release_lost``); a release may record the message's completion
  and keep the key for an at-least window;
- redeliver a message whose run finished (it must be dropped: ``Completed``), a renewal that
  lands on a window (it must not extend it);
- a lock that expires, an operator's force release (``celery singleton release``), a fencing
  counter that is gone (expired, or lost in a failover);

and checks each outcome against a small reference model of what Redis must hold. After every
step: each key's holder and queued marker are what the model says; fencing tokens strictly
increase per key, and the counter expires within the lock's ttl + the fence margin (checked at
each acquire); a renewal never shortens a lock (checked at each renewal); keys outside the
library's prefix are untouched. At the end of each example every run is ended and every message
started: no lock and no marker may be left behind, and what is left (counters, the completion
records asked for) expires within its bound.

The CI run is small (``SINGLETON_MODEL_EXAMPLES``, default 15 examples per store kind, of
``SINGLETON_MODEL_STEPS`` = 30 steps). A nightly-sized run::

    SINGLETON_MODEL_EXAMPLES=1000 SINGLETON_MODEL_STEPS=80 \
        pytest tests/integration/test_protocol_model.py
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

import pytest
import redis
from celery import Celery
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from celery_singleton_lock import SingletonTask
from celery_singleton_lock.core.admin import force_release, read_lock
from celery_singleton_lock.core.backend import (
    FENCE_MARGIN_MS,
    Acquired,
    Completed,
    Contended,
    ReleaseStatus,
    RenewItem,
    RenewStatus,
)
from celery_singleton_lock.core.completion import Ending
from celery_singleton_lock.core.keys import queued_key
from celery_singleton_lock.core.renewer import HeldLock, Renewer
from celery_singleton_lock.core.store import LockStore
from celery_singleton_lock.publish.dedup import forget, publish
from tests.support.prefixes import delete_prefix
from tests.support.script_models import SETTINGS

TTL_MS = 30_000
#: the longest a fencing counter lives after an acquire: the lock's ttl + the default margin
FENCE_TTL_MS = TTL_MS + FENCE_MARGIN_MS
COUNTDOWN_MS = 20_000
KEYS = ("a", "b")
#: How much a lock's PTTL may fall between two reads of one step (the step's own time).
SLACK_MS = 2_000
#: completion records and at-least windows outlive every example unless expired by a rule
KEEP_MS = 120_000
ENDINGS = [
    None,
    Ending(completion_ttl_ms=KEEP_MS),
    Ending(at_least_ms=KEEP_MS),
    Ending(completion_ttl_ms=KEEP_MS, at_least_ms=KEEP_MS),
]


@dataclass
class Message:
    """A message in the queue: its task id, key, retries count and the run that published it."""

    task_id: str
    key: str
    generation: int
    parent: str | None = None


@dataclass
class Run:
    """A run that took its lock and has not ended (its lock may have been lost since)."""

    message: Message
    held: HeldLock

    @property
    def owner(self) -> tuple[str, int]:
        return self.message.task_id, self.message.generation

    @property
    def ident(self) -> tuple[str, int, int]:
        """What tells this run's lock from any other's: owner, generation and fencing token (a
        redelivered copy of the message has the same owner and generation)."""
        return self.message.task_id, self.message.generation, self.held.token


class _Sent:
    """What Celery's apply_async returns, for the messages publish_once lets through."""

    def __init__(self, task_id: str) -> None:
        self.id = task_id


class ProtocolModel(RuleBasedStateMachine):
    """The lock protocol of one worker process (``kind``: its lock store) against the model."""

    def __init__(self, redis_url: str, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.client = redis.Redis.from_url(redis_url)
        self.namespace = f"cslt:{uuid.uuid4().hex[:8]}:"
        self.prefix = f"{self.namespace}lock:"
        self.app = Celery("protocol-model", set_as_current=False)
        self.app.conf.singleton_redis_url = redis_url
        self.app.conf.singleton_key_prefix = self.prefix

        @self.app.task(
            bind=True,
            base=SingletonTask,
            name="m.job",
            shared=False,
            singleton_key_args=("key",),
            singleton_lock_on="publish",
        )
        def job(self: Any, key: str) -> None: ...

        self.task = job._get_current_object()
        if kind == "write-ahead":  # one server: releases written ahead on the acquire connection
            self.store = LockStore(redis.Redis.from_url(redis_url))
        else:  # cannot write ahead (as a Cluster or Redlock): releases queued for the thread
            self.store = LockStore(
                redis.Redis.from_url(redis_url), wait_replicas=1, wait_timeout_ms=1
            )
        self.now = 1000.0
        self.renewer = Renewer(self.store, clock=lambda: self.now)
        self.sent: list[_Sent] = []
        # -- the model ----------------------------------------------------------------------
        #: owner, generation and fencing token of each key's lock in Redis
        self.holder: dict[str, tuple[str, int, int] | None] = dict.fromkeys(KEYS)
        self.stretched: dict[str, bool] = dict.fromkeys(KEYS, False)
        #: the key's lock is an at-least window: its run ended, the hash stays until it expires
        self.window: dict[str, bool] = dict.fromkeys(KEYS, False)
        #: completion records: task id -> the largest generation of it that finished
        self.done: dict[str, int] = {}
        #: messages whose run finished with a completion record (a copy of one is dropped)
        self.finished: list[Message] = []
        self.marker: dict[str, str | None] = dict.fromkeys(KEYS)
        self.last_token: dict[str, int] = dict.fromkeys(KEYS, 0)
        self.queue: list[Message] = []
        self.runs: list[Run] = []
        #: releases written ahead whose reply is unread: Redis may or may not have run them yet
        self.unsettled: set[str] = set()
        #: releases queued for the renewer thread, not sent yet: key, the run's ident and
        #: whether it leaves a window
        self.pending: list[tuple[str, tuple[str, int, int], bool]] = []
        # -- keys that are not the library's: never touched ---------------------------------
        self.foreign = {
            f"{self.namespace}app:user:1000": {"owner": "", "token": "", "name": "Ada"},
            f"{self.prefix}{{x}}:lock": {"owner": "x", "gen": "0"},
        }
        for key, fields in self.foreign.items():
            self.client.hset(key, mapping=fields)

    # -- helpers ------------------------------------------------------------------------------

    def lock(self, key: str) -> str:
        return str(self.task.singleton_keys((key,), {}).lock)

    def publish(self, key: str, task_id: str | None = None, **options: Any) -> Any:
        def send(args: Any, kwargs: Any, task_id: str | None, **_: Any) -> _Sent:
            sent = _Sent(task_id or str(uuid.uuid4()))  # Celery gives a canvas member its id
            self.sent.append(sent)
            return sent

        return publish(
            self.task, (key,), {}, task_id, options, send, refuses=False, publishes_canvas=False
        )

    def settle_all(self) -> None:
        """What a round trip on the acquire connection or a flush makes certain."""
        for key, ident, window in self.pending:
            if self.holder[key] == ident and not self.window[key]:
                self.end_lock(key, window)
        self.pending.clear()
        self.unsettled.clear()

    def holds(self, run: Run) -> bool:
        key = run.message.key
        return self.holder[key] == run.ident and not self.window[key]

    def end_lock(self, key: str, window: bool) -> None:
        """The lock of ``key`` released: gone, or kept as an at-least window."""
        if window:
            self.window[key] = True
        else:
            self.holder[key] = None
        self.stretched[key] = False

    def finish(self, run: Run, ending: Ending | None) -> bool:
        """A run ends with ``ending``: its completion is recorded whatever its lock's state;
        whether its release leaves a window."""
        if ending is not None and ending.completion_ttl_ms:
            task_id, generation = run.owner
            self.done[task_id] = max(self.done.get(task_id, -1), generation)
            self.finished.append(run.message)
        return ending is not None and bool(ending.at_least_ms)

    # -- publishing ---------------------------------------------------------------------------

    @rule(key=st.sampled_from(KEYS))
    def publish_a_call(self, key: str) -> None:
        """delay(): one round trip finds the running or queued holder, or marks the message."""
        if key in self.unsettled:  # another process's publish: no order with our releases
            self.collect()
        sent = len(self.sent)
        result = self.publish(key)
        holder, marker = self.holder[key], self.marker[key]
        if holder is not None or marker is not None:  # the running, else the queued holder
            assert len(self.sent) == sent, "a duplicate was published"
            assert result.id == (holder[0] if holder is not None else marker)
            return
        assert len(self.sent) == sent + 1, "not published"
        assert self.sent[-1].id == result.id
        self.marker[key] = result.id
        self.queue.append(Message(result.id, key, 0))

    @precondition(lambda self: self.runs)
    @rule(data=st.data())
    def publish_a_chain_step(self, data: st.DataObject) -> None:
        """A running run publishes its chain's next step (or a callback) of the same key: always
        published, marking nothing."""
        run = data.draw(st.sampled_from(self.runs))
        before = len(self.sent)
        result = self.publish(run.message.key, parent_id=run.message.task_id)
        assert len(self.sent) == before + 1
        assert result.id == self.sent[-1].id
        self.queue.append(Message(result.id, run.message.key, 0, parent=run.message.task_id))

    @precondition(lambda self: self.runs)
    @rule(data=st.data())
    def redeliver(self, data: st.DataObject) -> None:
        """The broker delivers a running run's message again (acks_late, visibility timeout)."""
        run = data.draw(st.sampled_from(self.runs))
        message = run.message
        self.queue.append(Message(message.task_id, message.key, message.generation, message.parent))

    # -- starting a message -------------------------------------------------------------------

    @precondition(lambda self: self.queue)
    @rule(data=st.data())
    def start(self, data: st.DataObject) -> None:
        """A worker starts a message: acquire (after this process's releases), hand the marker
        over; the run holds the lock, or waits (its own earlier delivery or the run that
        published it holds it), or is a duplicate (skipped)."""
        message = data.draw(st.sampled_from(self.queue))
        key = message.key
        keys = self.task.singleton_keys((key,), {})
        outcome = self.renewer.acquire(
            keys, message.task_id, message.generation, TTL_MS, {"task": "m.job"}
        )
        self.settle_all()  # the acquire went after every release this process made
        forget(self.task, message.task_id, keys, "start")
        if self.marker[key] == message.task_id:
            self.marker[key] = None
        if self.done.get(message.task_id, -1) >= message.generation:
            assert isinstance(outcome, Completed), (outcome, message, self.done)
            assert outcome.holder == message.task_id
            self.queue.remove(message)  # dropped: the message already ran to its end
            return
        holder = self.holder[key]
        takes_over = (  # acquire looks at owner and generation only; a window is never entered
            holder is not None
            and not self.window[key]
            and holder[0] == message.task_id
            and message.generation > holder[1]
        )
        if holder is None or takes_over:
            assert isinstance(outcome, Acquired), (outcome, holder, message)
            assert outcome.token > self.last_token[key], "fencing token did not increase"
            assert 0 < self.client.pttl(keys.fence) <= FENCE_TTL_MS, "counter outlives its bound"
            assert outcome.reentered == takes_over
            self.last_token[key] = outcome.token
            self.holder[key] = (message.task_id, message.generation, outcome.token)
            self.stretched[key] = False
            held = HeldLock(
                keys.lock, message.task_id, message.generation, TTL_MS, outcome.token, self.now
            )
            self.renewer.add(held)
            self.runs.append(Run(message, held))
            self.queue.remove(message)
            return
        assert isinstance(outcome, Contended), (outcome, holder, message)
        assert not isinstance(outcome, Completed), (outcome, message)
        assert (outcome.holder, outcome.holder_generation) == holder[:2]
        assert outcome.finished == self.window[key], (outcome, self.window[key])
        if outcome.holder not in (message.task_id, message.parent):
            self.queue.remove(message)  # a duplicate: skipped (or retried later: the same)

    # -- renewals -----------------------------------------------------------------------------

    @precondition(lambda self: len(self.renewer))
    @rule()
    def renew(self) -> None:
        """A renewal of every lock the process holds; each lock still ours is renewed and never
        shortened, each one gone or taken is reported lost."""
        live = [run for run in self.runs if not run.held.lost]  # what the renewer renews
        before = {run.message.key: self.client.pttl(run.held.key) for run in live}
        self.now += TTL_MS / 1000  # everything is due
        self.renewer.run_due(self.now)
        for run in live:
            if not self.holds(run):
                assert run.held.lost, f"a lock gone or taken was not reported lost: {run}"
                continue
            assert not run.held.lost, f"a lock still held was reported lost: {run}"
            after = self.client.pttl(run.held.key)
            assert after >= min(before[run.message.key], TTL_MS) - SLACK_MS, "shortened"

    @precondition(lambda self: any(self.stretched.values()))
    @rule(data=st.data())
    def late_renewal_after_a_hand_over(self, data: st.DataObject) -> None:
        """A renewal sent before retry() stretched the lock lands after it: no shortening."""
        key = data.draw(st.sampled_from([k for k in KEYS if self.stretched[k]]))
        owner, generation, token = self.holder[key] or ("", 0, 0)
        before = self.client.pttl(self.lock(key))
        item = RenewItem(self.lock(key), owner, generation, TTL_MS, token)
        assert self.store.renew([item]) == [RenewStatus.RENEWED]
        assert self.client.pttl(self.lock(key)) >= before - SLACK_MS > TTL_MS

    # -- ending a run -------------------------------------------------------------------------

    @precondition(lambda self: self.runs)
    @rule(data=st.data())
    def release_now(self, data: st.DataObject) -> None:
        """The run ends and releases in its own round trip (eager runs)."""
        run = data.draw(st.sampled_from(self.runs))
        ending = data.draw(st.sampled_from(ENDINGS))
        self.renewer.remove(run.held)
        status = self.store.release(run.held.key, *run.ident, ending)
        if self.kind == "write-ahead":
            self.settle_all()  # the call went after the releases written ahead
        window = self.finish(run, ending)
        self.assert_release(status, run.message.key, run.ident, window=window)
        self.runs.remove(run)

    @precondition(lambda self: self.runs)
    @rule(data=st.data())
    def release_deferred(self, data: st.DataObject) -> None:
        """The run ends; task_postrun releases off its critical path (Renewer.release_later)."""
        run = data.draw(st.sampled_from(self.runs))
        key = run.message.key
        run.held.ending = data.draw(st.sampled_from(ENDINGS))
        window = self.finish(run, run.held.ending)
        self.renewer.release_later(run.held, "SUCCESS")
        if self.kind == "write-ahead":  # written now; Redis runs it before the next acquire
            if self.holds(run):
                self.end_lock(key, window)
            self.unsettled.add(key)
        else:  # queued until the thread or the next acquire sends it
            self.pending.append((key, run.ident, window))
        self.runs.remove(run)

    @rule()
    def collect(self) -> None:
        """The renewer thread's tick: sends what is queued, reads the replies written ahead."""
        self.renewer.flush_releases()
        self.settle_all()

    @precondition(lambda self: any(not run.held.lost for run in self.runs))
    @rule(data=st.data())
    def retry(self, data: st.DataObject) -> None:
        """self.retry(countdown=20): the lock, if still ours, is stretched over the countdown and
        the retried message (same task id, one more retry) is published; the run ends RETRY."""
        run = data.draw(st.sampled_from([run for run in self.runs if not run.held.lost]))
        key = run.message.key
        self.renewer.hand_over(run.held, COUNTDOWN_MS + TTL_MS)
        if self.holds(run):
            self.stretched[key] = True
            assert self.client.pttl(self.lock(key)) > TTL_MS
        self.task.push_request(id=run.message.task_id)
        try:
            result = self.publish(key, run.message.task_id, countdown=COUNTDOWN_MS / 1000)
        finally:
            self.task.pop_request()
        assert result.id == run.message.task_id  # never its own duplicate
        retried = Message(run.message.task_id, key, run.message.generation + 1, run.message.parent)
        self.queue.append(retried)
        self.runs.remove(run)

    @precondition(lambda self: self.runs or any(self.stretched.values()))
    @rule(data=st.data())
    def lose_the_child(self, data: st.DataObject) -> None:
        """The pool child dies (a run, or one that just called retry()): the main process
        releases that generation only, and leaves a lock handed over to a retry alone."""
        choices: list[Any] = list(self.runs)
        choices += [(k, self.holder[k]) for k in KEYS if self.stretched[k] or self.window[k]]
        chosen = data.draw(st.sampled_from(choices))
        at_least = data.draw(st.sampled_from([0, KEEP_MS]))
        if isinstance(chosen, Run):
            self.renewer.remove(chosen.held)
            key, owner = chosen.message.key, chosen.ident
            self.runs.remove(chosen)
        else:
            key, owner = chosen
        if key in self.unsettled:
            self.collect()
        status = self.store.release_lost(self.lock(key), *owner[:2], at_least)
        if self.kind == "write-ahead":
            self.settle_all()
        self.assert_release(status, key, owner, lost=True, window=bool(at_least))

    def assert_release(
        self,
        status: ReleaseStatus,
        key: str,
        ident: tuple[str, int, int],
        *,
        lost: bool = False,
        window: bool = False,
    ) -> None:
        """A run's release matches owner, generation and token; the main process's release of a
        lost run (which cannot know the token) owner and generation, and spares a hand-over. A
        window is held by no run: no release touches it. ``window``: the release keeps one."""
        holder = self.holder[key]
        if holder is None or self.window[key]:
            assert status is ReleaseStatus.NOT_HELD, (status, key)
        elif holder[: 2 if lost else 3] != ident[: 2 if lost else 3]:
            assert status is ReleaseStatus.TAKEN, (status, key)
        elif lost and self.stretched[key]:
            assert status is ReleaseStatus.HANDED_OVER, (status, key)
        else:
            assert status is ReleaseStatus.RELEASED, (status, key)
            self.end_lock(key, window)

    @precondition(lambda self: self.finished)
    @rule(data=st.data())
    def redeliver_a_finished_message(self, data: st.DataObject) -> None:
        """The broker delivers a message again after its run finished (a worker killed between
        the body and the ack, a visibility timeout): it must be dropped when it starts."""
        message = data.draw(st.sampled_from(self.finished))
        self.queue.append(Message(message.task_id, message.key, message.generation, message.parent))

    @precondition(lambda self: any(self.window[k] and k not in self.unsettled for k in KEYS))
    @rule(data=st.data())
    def renewal_lands_on_a_window(self, data: st.DataObject) -> None:
        """A renewal of the finished run that was on the wire when its release made the window:
        the window is not the run's lock any more, and is never extended."""
        key = data.draw(st.sampled_from([k for k in KEYS if self.window[k]]))
        owner, generation, token = self.holder[key] or ("", 0, 0)
        before = self.client.pttl(self.lock(key))
        item = RenewItem(self.lock(key), owner, generation, KEEP_MS * 2, token)
        assert self.store.renew([item]) == [RenewStatus.GONE]
        assert self.client.pttl(self.lock(key)) <= before

    # -- outside events -----------------------------------------------------------------------

    @precondition(lambda self: any(self.holder[k] and k not in self.unsettled for k in KEYS))
    @rule(data=st.data())
    def expire(self, data: st.DataObject) -> None:
        """A lock expires (its holder stopped renewing: paused, partitioned, killed)."""
        key = data.draw(st.sampled_from([k for k in KEYS if self.holder[k]]))
        lock = self.lock(key)
        self.client.pexpire(lock, 1)
        deadline = time.monotonic() + 2
        while self.client.exists(lock) and time.monotonic() < deadline:
            time.sleep(0.002)
        assert not self.client.exists(lock)
        self.holder[key], self.stretched[key], self.window[key] = None, False, False

    @rule(key=st.sampled_from(KEYS))
    def counter_expires(self, key: str) -> None:
        """The fencing counter is gone (expired, a failover to a replica that never had it, a
        restart without persistence): the next token comes from the server's clock, still
        larger than every token before (the clock did not step back)."""
        self.client.delete(str(self.task.singleton_keys((key,), {}).fence))

    @precondition(lambda self: any(self.holder[k] and k not in self.unsettled for k in KEYS))
    @rule(data=st.data())
    def operator_release(self, data: st.DataObject) -> None:
        """celery singleton release KEY: the lock shown is force-released; a key that is not a
        lock of the library is refused before it is read."""
        key = data.draw(st.sampled_from([k for k in KEYS if self.holder[k]]))
        info = read_lock(self.client, self.lock(key), self.prefix)
        assert info is not None
        assert (info.owner, info.generation, info.token) == self.holder[key]
        assert info.state == ("window" if self.window[key] else "running")
        force_release(self.client, info)
        self.holder[key], self.stretched[key], self.window[key] = None, False, False
        for foreign in self.foreign:
            with pytest.raises(ValueError, match="is "):
                read_lock(self.client, foreign, self.prefix)

    # -- invariants ---------------------------------------------------------------------------

    @invariant()
    def redis_holds_what_the_model_says(self) -> None:
        for key in KEYS:
            lock = self.lock(key)
            owner, generation, token = self.client.hmget(lock, "owner", "gen", "token")
            marker = self.client.get(queued_key(lock))
            assert (marker.decode() if marker else None) == self.marker[key], key
            if key in self.unsettled:
                continue
            shown = None if owner is None else (owner.decode(), int(generation), int(token))
            assert shown == self.holder[key], (key, shown, self.holder[key])

    @invariant()
    def one_holder_per_key_among_the_runs(self) -> None:
        for key in KEYS:
            holding = [run for run in self.runs if run.message.key == key and self.holds(run)]
            assert len(holding) <= 1, holding

    @invariant()
    def keys_outside_the_library_are_untouched(self) -> None:
        for key, fields in self.foreign.items():
            stored = {k.decode(): v.decode() for k, v in self.client.hgetall(key).items()}
            assert stored == fields, key

    # -- the end of an example ----------------------------------------------------------------

    def teardown(self) -> None:
        try:
            self.drain()
            left = sorted(
                k.decode()
                for pattern in ("*:lock", "*:queued")
                for k in self.client.scan_iter(count=1000, match=f"{self.prefix}{pattern}")
                if k.decode() not in self.foreign
            )
            assert left == [], f"left behind once every run ended: {left}"
            self.everything_left_expires_within_its_bound()
            assert len(self.renewer) == 0
            self.keys_outside_the_library_are_untouched()
        finally:
            delete_prefix(self.client, self.namespace)
            self.client.close()
            self.store.client.close()

    def everything_left_expires_within_its_bound(self) -> None:
        """What every run's end leaves: fencing counters, expiring within ttl + margin of their
        acquire, and the completion records the endings asked for (KEEP_MS); nothing else, and
        nothing without an expiry."""
        for raw in self.client.scan_iter(count=1000, match=f"{self.prefix}*"):
            key = raw.decode()
            if key in self.foreign:
                continue
            pttl = self.client.pttl(key)
            bound = FENCE_TTL_MS if key.endswith(":fence") else KEEP_MS
            assert ":fence" in key or ":done:" in key, f"left behind: {key}"
            assert pttl == -2 or 0 < pttl <= bound, (key, pttl, bound)

    def expire_windows(self) -> None:
        """Every settled at-least window ends now (as if its time had passed)."""
        for key in KEYS:
            if self.window[key] and key not in self.unsettled:
                self.client.delete(self.lock(key))
                self.holder[key], self.window[key] = None, False

    def drain(self) -> None:
        """End every run, then start every message (ending each run it starts), until none.
        Windows are expired first (they would hold their keys for KEEP_MS)."""
        for _ in range(100):
            self.expire_windows()
            for run in list(self.runs):
                self.renewer.remove(run.held)
                self.store.release(run.held.key, *run.ident)
                if self.holds(run):
                    self.holder[run.message.key] = None
                self.runs.remove(run)
            self.renewer.flush_releases()
            self.settle_all()
            self.expire_windows()  # a release just settled may have left one
            if not self.queue:
                return
            for message in list(self.queue):
                keys = self.task.singleton_keys((message.key,), {})
                outcome = self.renewer.acquire(keys, message.task_id, message.generation, TTL_MS)
                forget(self.task, message.task_id, keys, "start")
                if isinstance(outcome, Acquired):
                    self.store.release(keys.lock, message.task_id, message.generation, None)
                    self.queue.remove(message)
                elif isinstance(outcome, Completed) or outcome.holder not in (
                    message.task_id,
                    message.parent,
                ):
                    self.queue.remove(message)
        raise AssertionError(f"messages still waiting: {self.queue}")


@pytest.mark.parametrize("kind", ["write-ahead", "queued"])
def test_lock_protocol_against_the_model(redis_url: str, kind: str) -> None:
    """Interleaved operations of the protocol agree with the model, on both release schemes."""
    run_state_machine_as_test(
        lambda: ProtocolModel(redis_url, kind),
        settings=SETTINGS,
    )
