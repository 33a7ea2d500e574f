"""Locks on a private Redis Cluster of three masters, reached with a ``redis+cluster://`` URL.

A lock and its fencing counter share a hash tag, so every acquire and release is one script
call on one node. A batch renewal is split into one renew.lua call per slot, and the calls for
one node go out as one pipeline: a renewal of any number of locks costs one round trip per
node, never one per lock.
"""

from __future__ import annotations

import math
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from redis.cluster import RedisCluster
from redis.connection import AbstractConnection

from celery_singleton_lock import LockUnavailableError
from celery_singleton_lock.beat.claims import RunClaims
from celery_singleton_lock.beat.scheduler import ERROR_RETRY_S
from celery_singleton_lock.core.backend import (
    Acquired,
    Contended,
    ReleaseStatus,
    RenewItem,
    RenewStatus,
)
from celery_singleton_lock.core.cluster import ClusterStore
from celery_singleton_lock.core.compare_delete import native_command
from celery_singleton_lock.core.connection import client_for, store_for
from celery_singleton_lock.core.keys import LockKeys, lock_keys, run_claim_key
from celery_singleton_lock.core.pending import leave_pending, pending_key, take_pending
from tests.support.basic_app import close_app, history_key, make_app
from tests.support.history import assert_no_overlap, check_history, load_history
from tests.support.recording_schedulers import (
    INTERVAL,
    RENEWAL_FAILS,
    check_leadership_kept_after_a_failed_renewal,
    fire,
    instance,
    labels,
    long_lease_leader_app,
    make_beat_app,
    set_clock,
)
from tests.support.servers import free_port, paused
from tests.support.store_checks import check_pending_scripts, check_permit_slots
from tests.support.topologies import Cluster
from tests.support.waiting import wait_for
from tests.support.workers import WorkerFactory

#: store_for caches per URL and process: every test starts and ends without any
pytestmark = pytest.mark.usefixtures("forget_stores")

PREFIX = "cslt:cluster:"
TTL_MS = 30_000
#: an expiry the tests set before a renewal: only a renewal puts it back above this
AGED_MS = TTL_MS // 3
LOCKS = 200


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with Cluster() as topology:
        yield topology


@pytest.fixture
def store(cluster: Cluster) -> Iterator[ClusterStore]:
    store = store_for(cluster.url)
    yield store
    store.client.close()


def cluster_client(store: ClusterStore) -> RedisCluster:
    client = store.client
    assert isinstance(client, RedisCluster)
    return client


def node_of(client: RedisCluster, key: str) -> int:
    """The port of the master serving ``key``'s slot."""
    return int(client.get_node_from_key(key).port)


def many_keys(count: int) -> list[LockKeys]:
    run = uuid.uuid4().hex[:8]
    return [lock_keys(PREFIX, "t.many", f"{run}:{i}".encode()) for i in range(count)]


def age(client: RedisCluster, keys: list[LockKeys]) -> None:
    """Lower each lock's expiry to AGED_MS, as if two thirds of its ttl had gone by."""
    for k in keys:
        assert client.pexpire(k.lock, AGED_MS)


class RoundTrips:
    """Counts the writes to the network (one per command or pipeline) per server port."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.by_port: Counter[int] = Counter()
        original = AbstractConnection.send_packed_command
        counter = self.by_port

        def counting(connection: Any, command: Any, check_health: bool = True) -> Any:
            counter[int(connection.port)] += 1
            return original(connection, command, check_health)

        monkeypatch.setattr(AbstractConnection, "send_packed_command", counting)

    def reset(self) -> None:
        self.by_port.clear()


def evalsha_calls(cluster: Cluster) -> dict[int, int]:
    """``cmdstat_evalsha`` calls per node since the last CONFIG RESETSTAT."""
    calls = {}
    for port, client in cluster.node_clients().items():
        try:
            stats = client.info("commandstats")
            calls[port] = int(stats.get("cmdstat_evalsha", {}).get("calls", 0))
        finally:
            client.close()
    return calls


def reset_stats(cluster: Cluster) -> None:
    for client in cluster.node_clients().values():
        try:
            client.config_resetstat()
        finally:
            client.close()


# -- the lock cycle on three masters ----------------------------------------------------------


def test_many_locks_over_three_masters(store: ClusterStore, cluster: Cluster) -> None:
    """200 locks: acquired on the master of their slot, renewed in one batch, released."""
    client = cluster_client(store)
    keys = many_keys(LOCKS)
    tokens = {}
    for k in keys:
        taken = store.acquire(k, f"owner-{k.lock}", 0, TTL_MS)
        assert isinstance(taken, Acquired)
        tokens[k.lock] = taken.token
        assert client.keyslot(k.lock) == client.keyslot(k.fence)
    ports = {node_of(client, k.lock) for k in keys}
    assert ports == {node.port for node in cluster.nodes}  # the locks are spread over all three
    node_clients = cluster.node_clients()
    try:
        for k in keys:  # each lock lives on the master of its slot, with its token
            on_node = node_clients[node_of(client, k.lock)]
            assert on_node.hget(k.lock, "token") == str(tokens[k.lock]).encode()
    finally:
        for c in node_clients.values():
            c.close()

    age(client, keys)
    items = [RenewItem(k.lock, f"owner-{k.lock}", 0, TTL_MS) for k in keys]
    assert store.renew(items) == [RenewStatus.RENEWED] * LOCKS
    assert all(client.pttl(k.lock) > AGED_MS for k in keys)
    age(client, keys[:10])
    wrong = [RenewItem(k.lock, "someone-else", 0, TTL_MS) for k in keys[:10]]
    assert store.renew(wrong) == [RenewStatus.TAKEN] * 10
    assert all(client.pttl(k.lock) <= AGED_MS for k in keys[:10])

    for k in keys:
        assert store.release(k.lock, f"owner-{k.lock}", 0) is ReleaseStatus.RELEASED
    assert store.renew(items[:5]) == [RenewStatus.GONE] * 5
    assert all(store.holder(k.lock) == {} for k in keys)


def test_renew_costs_one_round_trip_per_node(
    store: ClusterStore, cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Renewing 20 or 200 locks sends exactly one pipeline to each of the three nodes, with one
    renew.lua call per slot (counted on the wire and in the servers' commandstats)."""
    client = cluster_client(store)
    keys = many_keys(LOCKS)
    for k in keys:
        assert isinstance(store.acquire(k, "owner", 0, TTL_MS), Acquired)
    store.renew([RenewItem(k.lock, "owner", 0, TTL_MS) for k in keys])  # every node has the script
    trips = RoundTrips(monkeypatch)
    for count in (20, LOCKS):
        items = [RenewItem(k.lock, "owner", 0, TTL_MS) for k in keys[:count]]
        expected_nodes = {node_of(client, k.lock) for k in keys[:count]}
        slots_per_node = Counter(
            node_of(client, item.key) for item in {client.keyslot(i.key): i for i in items}.values()
        )
        reset_stats(cluster)
        trips.reset()
        assert store.renew(items) == [RenewStatus.RENEWED] * count
        assert dict(trips.by_port) == dict.fromkeys(expected_nodes, 1), (count, trips.by_port)
        assert {p: n for p, n in evalsha_calls(cluster).items() if n} == dict(slots_per_node)
    for k in keys:
        store.release(k.lock, "owner", 0)


def test_renew_survives_a_node_that_lost_its_scripts(
    store: ClusterStore, cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node without renew.lua (restarted, or a promoted replica) answers NOSCRIPT: the
    script is loaded on that node and its calls sent again; nothing is misreported."""
    client = cluster_client(store)
    keys = many_keys(60)
    for k in keys:
        assert isinstance(store.acquire(k, "owner", 0, TTL_MS), Acquired)
    items = [RenewItem(k.lock, "owner", 0, TTL_MS) for k in keys]
    assert store.renew(items) == [RenewStatus.RENEWED] * len(items)
    age(client, keys)
    flushed = cluster.nodes[1]
    assert flushed.port in {node_of(client, k.lock) for k in keys}
    admin = flushed.client()
    try:
        admin.script_flush()
    finally:
        admin.close()
    trips = RoundTrips(monkeypatch)
    assert store.renew(items) == [RenewStatus.RENEWED] * len(items)
    # pipeline (NOSCRIPT), SCRIPT LOAD, pipeline again on that node; one trip elsewhere
    assert trips.by_port[flushed.port] == 3
    assert all(n == 1 for port, n in trips.by_port.items() if port != flushed.port)
    assert all(client.pttl(k.lock) > AGED_MS for k in keys)  # renewed on every node
    for k in keys:
        assert store.release(k.lock, "owner", 0) is ReleaseStatus.RELEASED


# -- fencing counter, claims, wait --------------------------------------------------------------


def test_fence_counter_and_contention(store: ClusterStore) -> None:
    """Tokens of one key keep increasing; the counter sits in the lock's slot."""
    client = cluster_client(store)
    k = many_keys(1)[0]
    assert client.keyslot(k.lock) == client.keyslot(k.fence)
    tokens = []
    for owner in ("a", "b", "c"):
        taken = store.acquire(k, owner, 0, TTL_MS)
        assert isinstance(taken, Acquired)
        tokens.append(taken.token)
        held = store.acquire(k, "intruder", 0, TTL_MS)
        assert isinstance(held, Contended)
        assert held.holder == owner
        assert held.holder_token == taken.token
        assert store.release(k.lock, owner, 0) is ReleaseStatus.RELEASED
    assert tokens == sorted(tokens)
    assert len(set(tokens)) == 3
    assert int(client.get(k.fence)) == tokens[-1]
    handed_over = store.acquire(k, "a", 0, TTL_MS)
    assert isinstance(handed_over, Acquired)
    retried = store.acquire(k, "a", 1, TTL_MS)  # a retried run takes its own lock over
    assert isinstance(retried, Acquired)
    assert retried.reentered
    assert retried.token > handed_over.token
    assert store.release(k.lock, "a", 1) is ReleaseStatus.RELEASED


@pytest.mark.parametrize("wait", ["", "?wait_replicas=1&wait_timeout=0.05"])
def test_permit_slots_on_a_cluster(cluster: Cluster, wait: str) -> None:
    """The slots of a key with permits share its cluster slot: one script call takes one,
    with or without WAIT; the main process's search finds a lost run's slot."""
    store = store_for(cluster.url + wait)
    try:
        k = many_keys(1)[0].with_permits(3)
        client = cluster_client(store)
        assert {client.keyslot(key) for key in [k.lock, k.fence, *k.slots]} == {
            client.keyslot(k.lock)
        }
        check_permit_slots(store, k)
    finally:
        store.client.close()


def test_pending_follow_up_on_a_cluster(store: ClusterStore) -> None:
    """A coalesced follow-up's record shares its lock's cluster slot: each of its scripts is
    one call on the lock's node, owner-checked as on one server. A key with permits has one
    record for its slots, which purge finds orphaned once every slot is gone (one EXISTS of the
    slots, in their one cluster slot)."""
    from celery_singleton_lock.core.admin import iter_orphans

    k, permits = many_keys(2)
    permits = permits.with_permits(2)
    client = cluster_client(store)
    assert client.keyslot(pending_key(k.lock)) == client.keyslot(k.lock)
    check_pending_scripts(store, k)
    for owner in ("a", "b"):
        assert isinstance(store.acquire(permits, owner, 0, TTL_MS), Acquired)
    left = leave_pending(store.run_script, permits, "b", "f-p", {"call": "c"})
    assert left.follow_up == "f-p"
    assert client.keyslot(pending_key(permits.slot(2))) == client.keyslot(permits.lock)

    def orphans() -> list[tuple[str, int]]:
        found = iter_orphans(client, PREFIX)
        return [(o.lock_key, o.permits) for o in found if o.lock_key == permits.lock]

    client.delete(permits.slot(1))
    assert orphans() == []  # slot 2's run still holds
    client.delete(permits.slot(2))
    assert orphans() == [(permits.lock, 2)]
    assert take_pending(store.run_script, permits) is not None


def test_run_claims_on_a_cluster(cluster: Cluster) -> None:
    """Beat's run claims work on the cluster; all runs of one entry share a slot."""
    client = client_for(cluster.url)
    try:
        assert isinstance(client, RedisCluster)
        entry = f"report-{uuid.uuid4().hex[:6]}"
        first, second = (run_claim_key(PREFIX, entry, run) for run in ("r1", "r2"))
        assert client.keyslot(first) == client.keyslot(second)
        a, b = RunClaims(client, "beat-a"), RunClaims(client, "beat-b")
        assert a.claim(first, 5000).won
        lost = b.claim(first, 5000)
        assert not lost.won
        assert lost.holder == "beat-a"
        assert a.confirm(first, "task-1", 5000)
        assert b.claim(first, 5000).published
        assert b.claim(second, 5000).won
        assert b.unclaim(second)
        assert native_command(client) == "", "asked a node: no DELIFEQ/DELEX, so unclaim.lua"
        assert a.claim(second, 5000).won
        client.delete(first)
        client.delete(second)
    finally:
        client.close()


def test_wait_replicas_on_a_cluster_node(cluster: Cluster) -> None:
    """wait_replicas goes to the node of the lock's slot (no replicas here: 0, lock kept)."""
    store = store_for(f"{cluster.url}?wait_replicas=1&wait_timeout=0.05")
    try:
        k = many_keys(1)[0]
        taken = store.acquire(k, "owner", 0, TTL_MS)
        assert isinstance(taken, Acquired)
        assert taken.replicas == 0
        assert store.release(k.lock, "owner", 0) is ReleaseStatus.RELEASED
    finally:
        store.client.close()


def test_beat_publishes_each_run_once_on_a_cluster(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two SingletonSchedulerMixin instances claiming on the cluster: one publish per run."""
    app = make_beat_app(cluster.url, f"{PREFIX}{uuid.uuid4().hex[:6]}:")
    try:
        slot = math.floor(time.time() / 10) * 10
        a = instance(app, monkeypatch, slot + 0.3)
        b = instance(app, monkeypatch, slot + 6.8)
        fire(a, INTERVAL)
        fire(b, INTERVAL)
        assert labels(a, b) == [f"{INTERVAL}@{slot * 1000}"]
        set_clock(b, monkeypatch, slot + 10.2)
        set_clock(a, monkeypatch, slot + 10.5)
        fire(b, INTERVAL)
        fire(a, INTERVAL)  # the same next slot: b has it
        assert labels(a, b) == [f"{INTERVAL}@{slot * 1000}", f"{INTERVAL}@{(slot + 10) * 1000}"]
    finally:
        app.close()


@pytest.mark.parametrize("when", list(RENEWAL_FAILS))
def test_beat_leader_takes_its_lease_back_after_a_failed_cluster_renewal(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, when: str
) -> None:
    """Leader mode on a cluster of its own, every node paused while the leader renews (past
    the 0.2 s socket timeout, shorter than the node timeout): the leader keeps its lease."""
    with Cluster() as topology:
        app = long_lease_leader_app(
            f"{topology.url}?socket_timeout=0.2", f"{PREFIX}{uuid.uuid4().hex[:6]}:"
        )
        try:
            check_leadership_kept_after_a_failed_renewal(
                app, monkeypatch, caplog, lambda: paused(*topology.nodes), when
            )
        finally:
            app.close()


def test_beat_stands_by_while_no_cluster_node_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    """A beat whose cluster cannot be reached at its first tick logs and tries again later."""
    app = make_beat_app(f"redis+cluster://127.0.0.1:{free_port()}", PREFIX)
    try:
        scheduler = instance(app, monkeypatch, time.time())
        assert scheduler.tick() == ERROR_RETRY_S
        assert scheduler.sent == []
    finally:
        app.close()


# -- failures ---------------------------------------------------------------------------------


def test_unreachable_cluster_is_lock_unavailable() -> None:
    """No listed node answers: store_for still returns a store, and each call is a
    LockUnavailableError (the policy of singleton_on_redis_error applies), not a crash."""
    url = f"redis+cluster://:s3cret@127.0.0.1:{free_port()},127.0.0.1:{free_port()}"
    store = store_for(url)
    for _ in range(2):
        with pytest.raises(LockUnavailableError) as info:
            store.acquire(many_keys(1)[0], "owner", 0, TTL_MS)
        assert "s3cret" not in str(info.value)
    with pytest.raises(LockUnavailableError):
        store.renew([RenewItem("k", "owner", 0, TTL_MS)])


def test_a_dead_node_does_not_stop_the_others_renewals() -> None:
    """One master killed: the renewal raises (so the renewer retries), but the locks on the
    two live masters were renewed all the same."""
    with Cluster() as topology:
        store = store_for(topology.url)
        try:
            client = cluster_client(store)
            keys = many_keys(30)
            for k in keys:
                assert isinstance(store.acquire(k, "owner", 0, TTL_MS), Acquired)
            victim = topology.nodes[2]
            live = [k for k in keys if node_of(client, k.lock) != victim.port]
            assert live
            age(client, keys)
            victim.kill()
            started = time.monotonic()
            with pytest.raises(LockUnavailableError):
                store.renew([RenewItem(k.lock, "owner", 0, TTL_MS) for k in keys])
            assert time.monotonic() - started < 20
            node_clients = topology.node_clients()
            try:
                for k in live:
                    assert node_clients[node_of(client, k.lock)].pttl(k.lock) > AGED_MS, k
            finally:
                for c in node_clients.values():
                    c.close()
        finally:
            store.client.close()


# -- a real worker --------------------------------------------------------------------------------


def test_worker_locks_on_the_cluster(
    cluster: Cluster, redis_url: str, key_prefix: str, tmp_path: Path
) -> None:
    """A prefork worker whose singleton_redis_url is the cluster URL (broker on the test Redis):
    duplicates of a running call are skipped, distinct calls run, no lock is left behind."""
    factory = WorkerFactory(
        tmp_path,
        base_env={"SINGLETON_TEST_REDIS_URL": redis_url, "SINGLETON_TEST_PREFIX": key_prefix},
    )
    app: Celery = make_app(redis_url, key_prefix)
    client = client_for(cluster.url)
    broker = redis.Redis.from_url(redis_url)
    try:
        worker = factory.start(
            "tests.support.singleton_app",
            concurrency=3,
            env={"SINGLETON_TEST_LOCK_URL": cluster.url, "SINGLETON_TEST_TTL": "2"},
        )
        worker.wait_ready(app)
        run = uuid.uuid4().hex[:6]
        same = [
            app.send_task("t.hold", kwargs={"key": f"{run}-same", "seconds": 2.5}) for _ in range(3)
        ]
        other = [
            app.send_task("t.hold", kwargs={"key": f"{run}-{i}", "seconds": 0.2}) for i in range(3)
        ]
        values = [r.get(timeout=30) for r in [*same, *other]]
        ran = [v for v in values[:3] if isinstance(v, dict) and "token" in v]
        assert len(ran) == 1, (values, worker.log_tail(80))
        assert not ran[0]["lost"]  # held 2.5 s with a 2 s ttl: renewed on the cluster
        assert all(isinstance(v, dict) and "token" in v for v in values[3:])
        history = load_history(broker, history_key(key_prefix))
        assert_no_overlap(check_history(history), allow_unfinished=False)
        # A run's release on a cluster is queued for its renewer's thread, which sends it at
        # once: it may land just after the result. Well within the 2 s ttl (renewed every
        # 2/3 s, so more than 1.3 s left when the run ended): gone by a release, not expiry.
        wait_for(
            lambda: not list(client.scan_iter(count=1000, match=f"{key_prefix}*:lock")),
            1.0,
            "the runs' releases",
            worker,
        )
    finally:
        factory.close()
        close_app(app)
        client.close()
        broker.close()


def test_admin_lists_and_force_releases_locks_on_every_node(
    cluster: Cluster, store: ClusterStore
) -> None:
    """The CLI's core scans every master (SCAN, never KEYS) and force-releases in the slot."""
    from celery_singleton_lock.core.admin import ForceStatus, force_release, iter_locks, read_lock

    prefix = f"cslt:admin-{uuid.uuid4().hex[:8]}:"
    client = cluster_client(store)
    keys = [lock_keys(prefix, "t.admin", f"{i}".encode()) for i in range(30)]
    for index, k in enumerate(keys):
        store.acquire(k, f"owner-{index}", 0, TTL_MS, {"task": "t.admin", "host": "w1@h"})
    assert len({node_of(client, k.lock) for k in keys}) == 3

    def keys_calls() -> dict[int, int]:
        calls = {}
        for port, node in cluster.node_clients().items():
            try:
                stats = node.info("commandstats")
                calls[port] = int(stats.get("cmdstat_keys", {}).get("calls", 0))
            finally:
                node.close()
        return calls

    before = keys_calls()
    found = {info.key: info for info in iter_locks(client, prefix, batch=7)}
    assert set(found) == {k.lock for k in keys}
    assert found[keys[0].lock].owner == "owner-0"
    assert found[keys[0].lock].age_s is not None
    assert force_release(client, found[keys[0].lock]) is ForceStatus.RELEASED
    assert read_lock(client, keys[0].lock, prefix) is None
    assert client.exists(keys[0].fence) == 1
    assert keys_calls() == before
