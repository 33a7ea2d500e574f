"""RedlockStore over 3 and 5 private masters: majority, failures, fencing tokens, renewer, race."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis

from celery_singleton_lock.core.backend import (
    FENCE_MARGIN_MS,
    Acquired,
    Contended,
    ReleaseStatus,
    RenewItem,
    RenewStatus,
)
from celery_singleton_lock.core.redlock import RedlockStore
from celery_singleton_lock.core.renewer import HeldLock, Renewer
from celery_singleton_lock.core.store import LockStore
from celery_singleton_lock.errors import LockUnavailableError
from tests.support.history import (
    assert_no_overlap,
    check_history,
    load_history,
)
from tests.support.redlock_race import PROCESSES, client_for, job_keys
from tests.support.servers import RedisServer
from tests.support.waiting import wait_for

ROOT = Path(__file__).resolve().parents[2]
#: a master whose clock (and so its fencing counter) runs this far ahead, in microseconds
SKEW_US = 10**12


@dataclass
class Masters:
    """N private servers, one client each, and the stores built over them."""

    servers: list[RedisServer]
    clients: list[redis.Redis] = field(default_factory=list)
    stores: list[RedlockStore] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.clients = [client_for(s.url) for s in self.servers]

    @property
    def n(self) -> int:
        return len(self.servers)

    @property
    def quorum(self) -> int:
        return self.n // 2 + 1

    @property
    def minority(self) -> int:
        """The most masters that may fail while a majority stays."""
        return self.n - self.quorum

    def store(self, **options: object) -> RedlockStore:
        # a loaded CI machine can keep one of five masters past the 0.25 s default, and
        # Redlock rightly counts it as failed; tests of the basics want every master's answer
        # (tests of a slow master pass their own timeout)
        options.setdefault("master_timeout_s", 2.0)
        store = RedlockStore(self.clients, **options)  # type: ignore[arg-type]
        self.stores.append(store)
        return store

    def single(self, index: int) -> LockStore:
        """A plain store on one master, to plant or inspect a lock there."""
        return LockStore(self.clients[index])

    def kill(self, *indices: int) -> None:
        for i in indices:
            self.servers[i].kill()

    def restart(self, *indices: int) -> None:
        """Start again on the same port, with no data (as after a crash without persistence)."""
        for i in indices:
            self.servers[i].restart()

    def holders(self, key: str) -> list[dict[str, str]]:
        """The lock's hash on every running master (empty dict where absent)."""
        return [
            self.single(i).holder(key) if self.servers[i].is_running() else {}
            for i in range(self.n)
        ]

    def close(self) -> None:
        for client in self.clients:
            client.close()
        for server in self.servers:
            server.close()


def start_masters(count: int) -> Masters:
    servers: list[RedisServer] = []
    try:
        with ThreadPoolExecutor(count) as pool:
            for server in pool.map(lambda _: RedisServer(), range(count)):
                servers.append(server)
    except BaseException:
        for server in servers:
            server.close()
        raise
    return Masters(servers)


@pytest.fixture(params=[3, 5], ids=["3-masters", "5-masters"])
def masters(request: pytest.FixtureRequest) -> Iterator[Masters]:
    """3 or 5 private masters, all stopped and removed afterwards."""
    group = start_masters(request.param)
    try:
        yield group
    finally:
        group.close()


@pytest.fixture
def three_masters() -> Iterator[Masters]:
    """3 private masters, all stopped and removed afterwards."""
    group = start_masters(3)
    try:
        yield group
    finally:
        group.close()


def acquired(outcome: Acquired | Contended) -> Acquired:
    assert isinstance(outcome, Acquired), outcome
    return outcome


# -- the basics -----------------------------------------------------------------------------------


def test_acquire_contend_renew_release(masters: Masters) -> None:
    """The lock is written on every master with one token; others contend; renew and release."""
    store = masters.store()
    keys = job_keys()
    first = acquired(store.acquire(keys, "a", 0, 5000, {"host": "h1"}))
    assert not first.reentered
    for i, fields in enumerate(masters.holders(keys.lock)):
        assert fields["owner"] == "a"
        assert fields["host"] == "h1"
        assert fields["token"] == str(first.token)
        assert int(masters.clients[i].get(keys.fence) or 0) == first.token
    assert store.holder(keys.lock)["token"] == str(first.token)

    other = store.acquire(keys, "b", 0, 5000)
    assert isinstance(other, Contended)
    assert (other.holder, other.holder_generation, other.holder_token) == ("a", 0, first.token)
    assert 0 < other.pttl_ms <= 5000
    assert all(not fields or fields["owner"] == "a" for fields in masters.holders(keys.lock))

    assert store.renew([RenewItem(keys.lock, "a", 0, 9000)]) == [RenewStatus.RENEWED]
    assert all(client.pttl(keys.lock) > 5000 for client in masters.clients)
    assert store.renew([RenewItem(keys.lock, "b", 0, 9000)]) == [RenewStatus.TAKEN]

    assert store.release(keys.lock, "b", 0) is ReleaseStatus.TAKEN
    assert store.release(keys.lock, "a", 0) is ReleaseStatus.RELEASED
    assert masters.holders(keys.lock) == [{}] * masters.n
    assert store.holder(keys.lock) == {}
    assert store.release(keys.lock, "a", 0) is ReleaseStatus.NOT_HELD
    assert store.renew([RenewItem(keys.lock, "a", 0, 5000)]) == [RenewStatus.GONE]

    second = acquired(store.acquire(keys, "b", 0, 5000))
    assert second.token > first.token


def test_hand_over_to_a_later_generation(masters: Masters) -> None:
    """The same owner with a larger generation takes the lock over, as on one master."""
    store = masters.store()
    keys = job_keys()
    first = acquired(store.acquire(keys, "a", 0, 5000))
    again = acquired(store.acquire(keys, "a", 1, 5000))
    assert again.reentered
    assert again.token > first.token
    assert all(fields["gen"] == "1" for fields in masters.holders(keys.lock))
    assert isinstance(store.acquire(keys, "a", 1, 5000), Contended)  # a redelivery: same gen
    assert isinstance(store.acquire(keys, "a", 0, 5000), Contended)
    assert store.renew([RenewItem(keys.lock, "a", 0, 5000)]) == [RenewStatus.TAKEN]
    assert store.release(keys.lock, "a", 0) is ReleaseStatus.TAKEN
    assert store.release(keys.lock, "a", None) is ReleaseStatus.RELEASED


def test_release_lost_on_every_master(masters: Masters) -> None:
    """release_lost: its generation only; a hand-over on any master keeps it (HANDED_OVER)."""
    store = masters.store()
    keys = job_keys()
    acquired(store.acquire(keys, "a", 1, 5000))
    assert store.release_lost(keys.lock, "a", 0) is ReleaseStatus.TAKEN
    assert store.renew([RenewItem(keys.lock, "a", 1, 65_000)]) == [RenewStatus.RENEWED]
    assert store.release_lost(keys.lock, "a", 1) is ReleaseStatus.HANDED_OVER
    assert all(fields["owner"] == "a" for fields in masters.holders(keys.lock))
    for client in masters.clients:
        client.pexpire(keys.lock, 5000)
    assert store.release_lost(keys.lock, "a", 1) is ReleaseStatus.RELEASED
    assert masters.holders(keys.lock) == [{}] * masters.n
    assert store.release_lost(keys.lock, "a", 1) is ReleaseStatus.NOT_HELD


def test_contended_names_the_most_common_holder(masters: Masters) -> None:
    """A refused acquire names the holder most masters report, and undoes its partial grant."""
    store = masters.store()
    keys = job_keys()
    k = masters.minority  # x holds k masters, y one more, the rest (fewer than a quorum) are free
    assert isinstance(masters.single(k).acquire(keys, "y", 0, 5000), Acquired)
    for i in range(k):
        assert isinstance(masters.single(i).acquire(keys, "x", 3, 5000), Acquired)
    x_token = max(int(masters.single(i).holder(keys.lock)["token"]) for i in range(k))

    outcome = store.acquire(keys, "c", 0, 5000)
    assert isinstance(outcome, Contended)
    assert (outcome.holder, outcome.holder_generation, outcome.holder_token) == ("x", 3, x_token)
    owners = [fields.get("owner") for fields in masters.holders(keys.lock)]
    assert owners == ["x"] * k + ["y"] + [None] * (masters.n - k - 1)  # c's copies released


def test_a_split_vote_is_tried_again(three_masters: Masters) -> None:
    """When no owner holds a majority (copies of other attempts on the rest), acquire backs off
    and tries again instead of reporting a holder that holds nothing."""
    keys = job_keys()
    for i, owner in ((0, "x"), (1, "y")):  # two other attempts, each with one master
        assert isinstance(three_masters.single(i).acquire(keys, owner, 0, 60_000), Acquired)
    eager = three_masters.store(split_retries=0)
    assert isinstance(eager.acquire(keys, "c", 0, 5000), Contended)
    for i, owner in ((0, "x"), (1, "y")):
        three_masters.single(i).release(keys.lock, owner, 0)  # again, going in 30 ms
        assert isinstance(three_masters.single(i).acquire(keys, owner, 0, 30), Acquired)
    patient = three_masters.store(split_retries=8, split_delay_s=0.05)
    outcome = acquired(patient.acquire(keys, "c", 0, 5000))
    owners = [f.get("owner") for f in three_masters.holders(keys.lock)]
    assert owners.count("c") >= 2, owners  # a copy of x or y may not have expired yet
    assert outcome.token > 0


def test_renew_reports_gone_and_taken(masters: Masters) -> None:
    """Renew is RENEWED only on a majority: GONE when a majority lost it, TAKEN when retaken."""
    store = masters.store()
    gone, taken, kept = job_keys("gone"), job_keys("taken"), job_keys("kept")
    for keys in (gone, taken, kept):
        acquired(store.acquire(keys, "a", 0, 5000))
    for i in range(masters.quorum):
        masters.clients[i].delete(gone.lock, taken.lock)
        assert isinstance(masters.single(i).acquire(taken, "z", 0, 5000), Acquired)
    for i in range(masters.minority):  # a minority losing it changes nothing
        masters.clients[i].delete(kept.lock)
    items = [RenewItem(keys.lock, "a", 0, 5000) for keys in (gone, taken, kept)]
    assert store.renew(items) == [RenewStatus.GONE, RenewStatus.TAKEN, RenewStatus.RENEWED]


# -- failures -------------------------------------------------------------------------------------


def test_a_minority_down_keeps_working(masters: Masters) -> None:
    """With a minority killed, acquire, contention, renew and release all work, and fast."""
    store = masters.store()
    keys = job_keys()
    masters.kill(*range(masters.n - masters.minority, masters.n))
    began = time.monotonic()
    first = acquired(store.acquire(keys, "a", 0, 5000))
    assert isinstance(store.acquire(keys, "b", 0, 5000), Contended)
    assert store.renew([RenewItem(keys.lock, "a", 0, 5000)]) == [RenewStatus.RENEWED]
    assert store.holder(keys.lock)["owner"] == "a"
    assert store.release(keys.lock, "a", 0) is ReleaseStatus.RELEASED
    second = acquired(store.acquire(keys, "b", 0, 5000))
    assert second.token > first.token
    assert time.monotonic() - began < 2.0


def test_losing_the_majority_fails_safe(masters: Masters) -> None:
    """No majority: acquire raises, a held lock is never reported RENEWED, then reported lost."""
    store = masters.store()
    keys, other = job_keys(), job_keys("other")
    ttl_ms = 1500
    held = acquired(store.acquire(keys, "a", 0, ttl_ms))
    taken_at = time.monotonic()  # the store counts its validity from before this
    masters.kill(*range(masters.quorum))

    with pytest.raises(LockUnavailableError, match="masters answered"):
        store.acquire(keys, "b", 0, ttl_ms)
    with pytest.raises(LockUnavailableError, match="masters answered"):
        store.acquire(other, "b", 0, ttl_ms)  # a free lock cannot be taken either
    item = RenewItem(keys.lock, "a", 0, ttl_ms)
    with pytest.raises(LockUnavailableError):  # may still be held: the renewer tries again
        store.renew([item])
    time.sleep(max(0.0, taken_at + ttl_ms / 1000 - time.monotonic()))
    assert store.renew([item]) == [RenewStatus.GONE]  # no majority vouched for it in its ttl
    assert store.renew([item]) == [RenewStatus.GONE]
    assert [f.get("owner") for f in masters.holders(other.lock)] == [None] * masters.n

    masters.restart(*range(masters.quorum))  # back, empty: the lock has expired everywhere
    after = acquired(store.acquire(keys, "b", 0, ttl_ms))
    assert after.token > held.token


def test_a_hung_master_is_timed_out(three_masters: Masters) -> None:
    """A paused master costs at most the per-master timeout; two paused fail within it."""
    for client in three_masters.clients:
        client.close()
    three_masters.clients = [client_for(s.url, timeout=5.0) for s in three_masters.servers]
    store = three_masters.store(master_timeout_s=0.2)
    keys, other = job_keys(), job_keys("other")
    three_masters.servers[0].pause()
    try:
        began = time.monotonic()
        acquired(store.acquire(keys, "a", 0, 5000))
        assert store.renew([RenewItem(keys.lock, "a", 0, 5000)]) == [RenewStatus.RENEWED]
        assert store.release(keys.lock, "a", 0) is ReleaseStatus.RELEASED
        assert time.monotonic() - began < 2.0

        three_masters.servers[1].pause()
        began = time.monotonic()
        with pytest.raises(LockUnavailableError, match="no answer within 200 ms"):
            store.acquire(other, "b", 0, 5000)
        assert time.monotonic() - began < 1.0
    finally:
        for server in three_masters.servers:
            server.resume()


def test_an_acquire_slower_than_its_validity_is_undone(three_masters: Masters) -> None:
    """When taking the lock took longer than ttl - drift, it is released everywhere."""
    ticks = itertools.count()

    def clock() -> float:  # every reading after the first is 10 s later
        return 1000.0 + 10.0 * min(next(ticks), 1)

    store = three_masters.store(clock=clock)
    keys = job_keys()
    with pytest.raises(LockUnavailableError, match="past its validity"):
        store.acquire(keys, "a", 0, 5000)
    assert three_masters.holders(keys.lock) == [{}, {}, {}]
    with pytest.raises(ValueError, match="no validity"):
        store.acquire(keys, "a", 0, 2)


def test_constructor_checks_its_arguments(three_masters: Masters) -> None:
    """Bad constructor arguments raise ValueError."""
    clients = three_masters.clients
    with pytest.raises(ValueError, match="at least one"):
        RedlockStore([])
    with pytest.raises(ValueError, match="same client"):
        RedlockStore([clients[0], clients[0]])
    with pytest.raises(ValueError, match="drift_factor"):
        RedlockStore(clients, drift_factor=1.0)
    with pytest.raises(ValueError, match="master_timeout_s"):
        RedlockStore(clients, master_timeout_s=0)
    assert RedlockStore(clients).quorum == 2


# -- fencing tokens -------------------------------------------------------------------------------


def test_tokens_increase_across_changing_majorities(masters: Masters) -> None:
    """Holders reached through ever different majorities, with minorities restarted empty in
    between, get strictly increasing tokens, even above a master whose counter ran far ahead."""
    rng = random.Random(masters.n)
    store = masters.store()
    keys = job_keys()
    skewed = int(masters.clients[0].time()[0]) * 10**6 + SKEW_US
    masters.clients[0].set(keys.fence, skewed)  # as if master 0's clock were 11 days ahead

    others = list(range(1, masters.n))
    plan = [rng.sample(others, masters.minority), [0]]  # first with master 0, then without it
    plan += [rng.sample(range(masters.n), masters.minority) for _ in range(8)]
    tokens: list[int] = []
    for round_, down in enumerate(plan):
        masters.kill(*down)
        outcome = acquired(store.acquire(keys, f"holder-{round_}", 0, 5000))
        tokens.append(outcome.token)
        assert store.holder(keys.lock)["token"] == str(outcome.token)
        assert store.release(keys.lock, f"holder-{round_}", 0) is ReleaseStatus.RELEASED
        masters.restart(*down)  # its counter is gone with its data
    assert tokens[0] > skewed
    assert all(b > a for a, b in itertools.pairwise(tokens)), tokens


def test_token_clears_the_counter_of_a_refusing_master(three_masters: Masters) -> None:
    """A master that refuses (a stray copy of another owner is there) still lifts the token above
    its counter, and the token is carried to the masters that granted it."""
    store = three_masters.store()
    keys = job_keys()
    assert isinstance(three_masters.single(2).acquire(keys, "z", 0, 5000), Acquired)
    read_at = time.monotonic()
    skewed = int(three_masters.clients[2].time()[0]) * 10**6 + SKEW_US
    three_masters.clients[2].set(keys.fence, skewed)
    outcome = acquired(store.acquire(keys, "a", 0, 5000))
    assert outcome.token == skewed + 1
    # a counter raised above a master's clock expires ttl + margin after the token, on that
    # master's clock: its next token from the clock is larger, however far the masters differ
    lives_ms = 5000 + FENCE_MARGIN_MS + SKEW_US // 1000
    for i in (0, 1):
        assert int(three_masters.clients[i].get(keys.fence) or 0) == skewed + 1
        assert three_masters.single(i).holder(keys.lock)["token"] == str(skewed + 1)
        # the token is a whole second of the clock read (up to 1 s before it) plus the skew,
        # and time passed since: on a loaded machine more than a second
        since_ms = (time.monotonic() - read_at) * 1000
        assert lives_ms - 1000 - since_ms < three_masters.clients[i].pttl(keys.fence) <= lives_ms
    assert three_masters.single(2).holder(keys.lock)["owner"] == "z"


# -- the renewer ----------------------------------------------------------------------------------


def test_renewer_keeps_a_redlock_and_reports_its_loss(three_masters: Masters) -> None:
    """The renewer renews through RedlockStore, survives a dead master, and reports the lock
    lost once the majority has been gone for longer than its validity."""
    store = three_masters.store()
    keys = job_keys()
    ttl_ms = 600
    lost: list[RenewStatus] = []
    errors: list[LockUnavailableError] = []
    renewer = Renewer(
        store,
        on_lost=lambda _held, status: lost.append(status),
        on_error=errors.append,
        error_retry_s=0.1,
    )
    outcome = acquired(store.acquire(keys, "a", 0, ttl_ms))
    held = HeldLock(keys.lock, "a", 0, ttl_ms, outcome.token, acquired_at=time.monotonic())
    renewer.add(held)
    renewer.ensure_started()
    try:
        time.sleep(1.5)  # 2.5 ttls: only renewals keep it
        assert held.renewals >= 3
        assert not held.lost
        assert all(f.get("owner") == "a" for f in three_masters.holders(keys.lock))

        three_masters.kill(2)
        before = held.renewals
        time.sleep(1.0)
        assert held.renewals >= before + 2
        assert not held.lost
        assert not errors

        three_masters.kill(1)
        wait_for(lambda: held.lost, 3.0, "the lock reported lost")
        assert errors  # first: could not tell, try again
        assert lost == [RenewStatus.GONE]  # then: not vouched for within its validity
        assert len(renewer) == 0
    finally:
        renewer.stop()


# -- a race of processes --------------------------------------------------------------------------


@pytest.mark.slow(seconds=5)
def test_twenty_processes_never_overlap(three_masters: Masters, private_redis: RedisServer) -> None:
    """20 processes racing for one lock over 3 masters (one killed after the 10th run and
    restarted empty after the 20th) never run at once, and their tokens increase in the order
    they ran. The race goes by runs, not by time: a loaded machine makes it slower, not shorter."""
    history = private_redis.client()
    config = {
        "masters": [s.url for s in three_masters.servers],
        "history": private_redis.url,
        "processes": PROCESSES,
    }
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from tests.support.redlock_race import race_launcher; "
            "race_launcher(sys.argv[1])",
            json.dumps(config),
        ],
        cwd=ROOT,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: the cleanup kills every racer
    )

    def runs() -> int:
        return int(history.get("runs") or 0)

    def details() -> str:
        return f"launcher: {launcher.poll()}, ready: {history.llen('ready')}, runs: {runs()}"

    try:
        wait_for(lambda: history.llen("ready") == PROCESSES, 60, "racers ready", details=details)
        history.set("go", 1)
        wait_for(lambda: runs() >= 10, 30, "10 runs", details=details)
        three_masters.kill(2)
        wait_for(lambda: runs() >= 20, 30, "20 runs, one master down", details=details)
        three_masters.restart(2)  # empty
        wait_for(lambda: runs() >= 40, 30, "40 runs", details=details)
        history.set("stop", 1)
        _, errors = launcher.communicate(timeout=60)
        assert launcher.returncode == 0, errors
    finally:
        if launcher.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()

    counts = [json.loads(raw) for raw in history.lrange("counts", 0, -1)]
    assert len(counts) == PROCESSES
    executions = load_history(history, "history")
    report = check_history(executions)
    assert_no_overlap(report, allow_unfinished=False)
    assert len(executions) == sum(c["runs"] for c in counts) >= 40
    assert len({e.worker for e in executions}) >= 5, counts
    assert sum(c["contended"] for c in counts) > 0, counts
    history.close()
