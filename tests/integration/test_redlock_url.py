"""Redlock through ``singleton_redis_url``: the redis+redlock:// URL, a real worker running a
SingletonTask over 3 private masters while one dies, and SingletonScheduler's claims on them."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterator
from typing import Any

import pytest

from celery_singleton_lock import SingletonConfigError, skip_info
from celery_singleton_lock.beat.claims import RunClaims
from celery_singleton_lock.beat.redlock_claims import RedlockClaims
from celery_singleton_lock.core import connection as singleton_connection
from celery_singleton_lock.core.backend import Acquired, Contended
from celery_singleton_lock.core.connection import client_for, redlock_clients, store_for
from celery_singleton_lock.core.keys import lock_keys
from celery_singleton_lock.core.pending import pending_key, put_back, take_pending
from celery_singleton_lock.core.redlock import RedlockStore
from celery_singleton_lock.core.store import LockStore
from celery_singleton_lock.core.urls import parse_lock_url, redact_url
from celery_singleton_lock.settings.options import read_options
from tests.support.basic_app import SINGLETON_APP, close_app, make_app
from tests.support.recording_schedulers import (
    INTERVAL,
    RENEWAL_FAILS,
    check_leader_hand_over,
    check_leadership_kept_after_a_failed_renewal,
    fire,
    instance,
    labels,
    long_lease_leader_app,
    make_beat_app,
)
from tests.support.servers import RedisServer, paused
from tests.support.store_checks import check_pending_scripts
from tests.support.waiting import wait_for
from tests.support.workers import WorkerFactory

PASSWORD = "rl-Pw-9c1e"


@pytest.fixture(scope="module")
def masters() -> Iterator[list[RedisServer]]:
    """Three private servers, each asking for ``PASSWORD``."""
    servers = [RedisServer() for _ in range(3)]
    for server in servers:
        server.client().config_set("requirepass", PASSWORD)
    yield servers
    for server in servers:
        server.close()


def redlock_url(servers: list[RedisServer], password: str = PASSWORD) -> str:
    hosts = ",".join(f"127.0.0.1:{s.port}" for s in servers)
    userinfo = f":{password}@" if password else ""
    return f"redis+redlock://{userinfo}{hosts}/0?master_timeout=1"


def test_redlock_url_syntax() -> None:
    """Hosts, default port, db, TLS, ACL user and master_timeout are read from the URL."""
    parsed = parse_lock_url(
        "rediss+redlock://locks:pw@a:7000,b,c:7002/3?master_timeout=0.5&ssl_cert_reqs=none"
    )
    assert parsed.kind == "redlock"
    assert parsed.nodes == (("a", 7000), ("b", 6379), ("c", 7002))
    assert parsed.master_timeout_s == 0.5
    assert dict(parsed.options) == {
        "username": "locks",
        "password": "pw",
        "ssl": True,
        "ssl_cert_reqs": "none",
        "db": 3,
    }
    assert "pw" not in repr(parsed)


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        (f"redis+redlock://:{PASSWORD}@a,b/0", "at least 3 masters"),
        (f"redis+redlock://:{PASSWORD}@a,b:6379,a", "listed twice"),
        (f"redis+redlock://:{PASSWORD}@a,b,c?wait_replicas=1", "do not apply"),
        (f"redis+redlock://:{PASSWORD}@a,b,c?master_timeout=0", "master_timeout must be"),
        (f"redis+redlock://:{PASSWORD}@a,b,c?ssl_ca_certs=/x", "needs TLS"),
        (f"redis://:{PASSWORD}@a?master_timeout=1", "needs a redis+redlock"),
    ],
)
def test_bad_redlock_urls_are_refused_without_the_password(url: str, reason: str) -> None:
    """A bad Redlock URL is a config error naming the reason, never the password."""
    with pytest.raises(SingletonConfigError) as info:
        read_options({"singleton_redis_url": url})
    assert reason in str(info.value)
    assert PASSWORD not in str(info.value)


def test_wait_replicas_setting_is_refused_with_redlock() -> None:
    """singleton_wait_replicas cannot apply to independent masters: a clear config error."""
    conf = {"singleton_redis_url": "redis+redlock://a,b,c", "singleton_wait_replicas": 1}
    with pytest.raises(SingletonConfigError, match="do not apply"):
        read_options(conf)


def test_store_for_builds_a_redlock_store_with_retries_off(
    masters: list[RedisServer], request: pytest.FixtureRequest
) -> None:
    """store_for gives a RedlockStore over every master, each client without retries."""
    url = redlock_url(masters)
    assert redact_url(url).count(PASSWORD) == 0
    store = store_for(url)
    request.addfinalizer(singleton_connection.reset)  # forget the store and its clients
    assert isinstance(store, RedlockStore)
    assert store.quorum == 2
    assert store.master_timeout_s == 1.0
    for client, server in zip(store.clients, masters, strict=True):
        kwargs = client.connection_pool.connection_kwargs
        assert (kwargs["port"], kwargs["password"]) == (server.port, PASSWORD)
        assert kwargs["retry"].get_retries() == 0
    keys = lock_keys("cslt:rlurl:", "t", b"k")
    outcome = store.acquire(keys, "owner-1", 0, 5000)
    assert isinstance(outcome, Acquired)
    assert all(LockStore(c).holder(keys.lock)["owner"] == "owner-1" for c in store.clients)
    assert isinstance(store.acquire(keys, "owner-2", 0, 5000), Contended)
    assert store.release(keys.lock, "owner-1", 0) == 1
    with pytest.raises(ValueError, match="redlock_clients"):
        client_for(url)


def test_pending_follow_ups_over_redlock(
    masters: list[RedisServer], request: pytest.FixtureRequest
) -> None:
    """Coalesce's pending record over Redlock: its scripts run on the first master (as
    publish-time markers do), against that master's copy of the lock."""
    store = store_for(redlock_url(masters))
    request.addfinalizer(singleton_connection.reset)
    assert isinstance(store, RedlockStore)
    keys = lock_keys("cslt:rlurl:", "t.pending", b"k")
    check_pending_scripts(store, keys)
    assert put_back(store.run_script, keys, {"id": "f-1"})
    assert [c.exists(pending_key(keys.lock)) for c in store.clients] == [1, 0, 0]
    assert take_pending(store.run_script, keys) == {"id": b"f-1"}


def test_worker_runs_over_redlock_and_survives_a_dead_master(
    worker_factory: WorkerFactory, redis_url: str, key_prefix: str
) -> None:
    """A real worker: the run holds its lock on the masters, a duplicate is skipped, one master
    is killed mid-run and renewal goes on on the other two; the lock is released at the end."""
    servers = [RedisServer() for _ in range(3)]
    try:
        for server in servers:
            server.client().config_set("requirepass", PASSWORD)
        url = redlock_url(servers)
        worker = worker_factory.start(
            SINGLETON_APP, pool="prefork", env={"SINGLETON_TEST_LOCK_URL": url}
        )
        app = make_app(redis_url, key_prefix)
        try:
            worker.wait_ready(app)
            first = app.send_task("t.hold", kwargs={"key": "rl", "seconds": 3.0})
            clients = redlock_clients(url)

            def first_lock() -> Any:
                for key in clients[1].scan_iter(
                    count=1000, match=f"{key_prefix}lock:*", _type="hash"
                ):
                    if LockStore(clients[1]).holder(key).get("owner") == first.id:
                        return key
                return None

            lock = wait_for(first_lock, 30, "the first run's lock on master 1", worker)

            def holders() -> list[Any]:
                return [LockStore(c).holder(lock).get("owner") for c in clients]

            # the takes run side by side: master 1 may show it before the others do. A majority
            # comes to hold it; a master slower than the fan-out's bounded wait (a busy machine)
            # may not, and the run goes on on the others
            held = wait_for(
                lambda: (h := holders()).count(first.id) >= 2 and h,
                30,
                "the first run's lock on a majority of the masters",
                worker,
                details=lambda: f"holders: {holders()}",
            )
            assert set(held) <= {first.id, None}, held
            duplicate = app.send_task("t.hold", kwargs={"key": "rl", "seconds": 0})
            info = skip_info(duplicate.get(timeout=30))
            assert info is not None, "the duplicate was skipped"
            assert info.holder == first.id
            servers[0].kill()  # ttl is 1 s: the 3 s run needs renewals on the other two
            value: dict[str, Any] = first.get(timeout=60)
            assert value["lost"] is False, worker.log_tail()
            # task_postrun releases after the result is stored
            wait_for(
                lambda: not any(c.exists(lock) for c in clients[1:]),
                30,
                "the lock released on the live masters",
                worker,
            )
            for client in clients[1:]:
                assert LockStore(client).holder(lock) == {}, "released on the live masters"
            log = worker.log_text()
            assert "singleton: redlock master 0" in log
            assert "redis+redlock://:***@" in log, "the banner shows the URL, password hidden"
            assert PASSWORD not in log
        finally:
            close_app(app)
    finally:
        for server in servers:
            server.close()


def test_beat_claims_over_redlock_publish_each_run_once(
    key_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two SingletonScheduler instances over 3 masters publish a run once, also with one dead."""
    servers = [RedisServer() for _ in range(3)]
    app = make_beat_app(redlock_url(servers, password=""), key_prefix)
    try:
        slot = math.floor(time.time() / 10) * 10
        a = instance(app, monkeypatch, slot + 0.3)
        b = instance(app, monkeypatch, slot + 4.1)
        fire(a, INTERVAL)
        fire(b, INTERVAL)
        assert labels(a, b) == [f"{INTERVAL}@{slot * 1000}"]
        state = a._singleton
        assert state is not None
        assert isinstance(state.claims, RedlockClaims)
        assert isinstance(state.store, RedlockStore)

        servers[2].kill()
        for scheduler, at in ((b, 10.2), (a, 10.9)):
            monkeypatch.setattr(scheduler, "singleton_clock", lambda at=at: slot + at)
            fire(scheduler, INTERVAL)
        assert labels(a, b)[1:] == [f"{INTERVAL}@{(slot + 10) * 1000}"]

        servers[1].kill()  # no majority: nothing is published, the run is retried later
        monkeypatch.setattr(a, "singleton_clock", lambda: slot + 20.5)
        fire(a, INTERVAL)
        assert len(labels(a, b)) == 2
    finally:
        app.close()
        for server in servers:
            server.close()


def test_beat_leader_lease_over_redlock(key_prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Leader mode over 3 masters: the lease is a Redlock lock; the standby publishes nothing."""
    servers = [RedisServer() for _ in range(3)]
    app = make_beat_app(redlock_url(servers, password=""), key_prefix, mode="leader")
    try:
        check_leader_hand_over(app, monkeypatch)
    finally:
        app.close()
        for server in servers:
            server.close()


@pytest.mark.parametrize("when", list(RENEWAL_FAILS))
def test_beat_leader_takes_its_lease_back_after_a_failed_redlock_renewal(
    key_prefix: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, when: str
) -> None:
    """Two of three masters paused while the leader renews: the renewal raises (no majority
    answered within the lease's validity); once they answer, the leader renews its own lease
    at its next tick and publishes, and the standby never leads."""
    servers = [RedisServer() for _ in range(3)]
    app = long_lease_leader_app(
        f"{redlock_url(servers, password='')}&socket_timeout=0.2", key_prefix
    )
    try:
        check_leadership_kept_after_a_failed_renewal(
            app, monkeypatch, caplog, lambda: paused(*servers[1:]), when
        )
    finally:
        app.close()
        for server in servers:
            server.close()


def test_even_master_count_is_logged(
    caplog: pytest.LogCaptureFixture, request: pytest.FixtureRequest
) -> None:
    """Four masters work but survive no more than three: a WARNING says so, password hidden."""
    url = f"redis+redlock://:{PASSWORD}@a:1,b:2,c:3,d:4/0"
    request.addfinalizer(singleton_connection.reset)
    with caplog.at_level("WARNING", logger="celery_singleton_lock.core.connection"):
        store = store_for(url)
    assert isinstance(store, RedlockStore)
    assert store.quorum == 3
    assert "singleton: redlock over an even number of masters (4)" in caplog.text
    assert PASSWORD not in caplog.text


def test_redlock_claims_split_vote_and_published_minority() -> None:
    """A split vote is given up and looked at again soon; a run confirmed on any master that
    answered counts as published."""
    servers = [RedisServer() for _ in range(3)]
    clients = redlock_clients(redlock_url(servers, password=""))
    try:
        key = "cslt:rlclaims:run"
        RunClaims(clients[0], "x").claim(key, 60_000)
        RunClaims(clients[1], "y").claim(key, 60_000)
        split = RedlockClaims(clients, "z").claim(key, 60_000)
        assert not split.won
        assert not split.published
        assert 0 < split.pttl_ms <= 200, "looked at again soon, not after the lease"
        assert not clients[2].exists(key), "the split claim was given up where granted"

        other = "cslt:rlclaims:done"
        x = RunClaims(clients[0], "x")
        assert x.claim(other, 60_000).won
        assert x.confirm(other, "task-1", 60_000)
        seen = RedlockClaims(clients, "z").claim(other, 60_000)
        assert not seen.won
        assert seen.published
        assert seen.holder == "x"
        assert not clients[1].exists(other), "z's claims were given up"
    finally:
        for client in clients:
            client.close()
        for server in servers:
            server.close()


def test_redlock_witness_and_peek_follow_the_majority(masters: list[RedisServer]) -> None:
    """A scheduled run's first message is the one a majority recorded; peek merges masters."""
    clients = redlock_clients(redlock_url(masters))
    try:
        key = f"cslt:rlwitness:{os.getpid()}:run"
        RunClaims(clients[2], "w").witness(key, "task-b", 60_000)  # b reached one master first
        worker = RedlockClaims(clients, "worker")
        assert worker.witness(key, "task-a", 60_000) is None  # a has masters 0 and 1
        assert worker.witness(key, "task-b", 60_000) == "task-a"
        assert worker.witness(key, "task-a", 60_000) is None  # a redelivery of a

        pending = f"cslt:rlwitness:{os.getpid()}:pending"
        RunClaims(clients[1], "beat-x").claim(pending, 5000)
        free = f"cslt:rlwitness:{os.getpid()}:free"
        seen_pending, seen_free = RedlockClaims(clients, "beat-y").peek([pending, free])
        assert seen_pending is not None
        assert (seen_pending.holder, seen_pending.published) == ("beat-x", False)
        assert seen_free is None
    finally:
        for client in clients:
            client.close()
