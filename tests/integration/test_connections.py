"""Connection URLs on real private servers: rediss:// (TLS, certificate options in the query),
unix://, an ACL user; the URL syntax of Sentinel and Cluster; passwords kept out of every
message; the wait settings; and the fast integration suite on both Redis 7 and Valkey 8.

Sentinel and Cluster deployments themselves are in test_sentinel.py and test_cluster.py.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from redis.connection import SSLConnection, UnixDomainSocketConnection

from celery_singleton_lock import LockUnavailableError, SingletonConfigError
from celery_singleton_lock.beat.claims import RunClaims
from celery_singleton_lock.beat.steering import Steering
from celery_singleton_lock.core import connection as singleton_connection
from celery_singleton_lock.core.backend import (
    FENCE_MARGIN_MS,
    Acquired,
    Contended,
    ReleaseStatus,
    RenewItem,
    RenewStatus,
)
from celery_singleton_lock.core.connection import client_for, new_store, store_for
from celery_singleton_lock.core.keys import lock_keys, run_claim_key
from celery_singleton_lock.core.store import LockStore
from celery_singleton_lock.core.urls import LockUrl, parse_lock_url, redact_url
from celery_singleton_lock.settings.options import (
    read_beat_options,
    read_options,
    resolve_redis_url,
)
from tests.support.documented import documented_acl_commands
from tests.support.servers import (
    SERVER_ENV,
    RedisServer,
    find_server_binary,
    server_choice,
)
from tests.support.topologies import (
    TlsFiles,
    TlsServer,
    TlsUnsupported,
    make_tls_files,
    server_info,
    short_tempdir,
)
from tests.support.waiting import wait_for

#: store_for caches per URL and process: every test starts and ends without any
pytestmark = pytest.mark.usefixtures("forget_stores")

ROOT = Path(__file__).resolve().parents[2]
PASSWORD = "s3cret-Pw-e07"
SENTINEL_PASSWORD = "s3nt-Pw-1b8"
FAST_FILES = [
    "tests/integration/test_lock.py",
    "tests/integration/test_renewer.py",
    "tests/integration/test_claims.py",
    "tests/integration/test_fencing.py",
]


def lock_cycle(store: LockStore, prefix: str = "cslt:conn:") -> Acquired:
    """Acquire, contend, renew and release one lock on ``store``; the acquire's outcome."""
    keys = lock_keys(prefix, "t.conn", uuid.uuid4().bytes)
    taken = store.acquire(keys, "owner-a", 0, 5000, {"task": "t.conn"})
    assert isinstance(taken, Acquired), taken
    other = store.acquire(keys, "owner-b", 0, 5000)
    assert isinstance(other, Contended)
    assert other.holder == "owner-a"
    assert store.holder(keys.lock)["token"] == str(taken.token)
    assert store.renew([RenewItem(keys.lock, "owner-a", 0, 5000)]) == [RenewStatus.RENEWED]
    assert store.release(keys.lock, "owner-a", 0) is ReleaseStatus.RELEASED
    assert store.holder(keys.lock) == {}
    again = store.acquire(keys, "owner-b", 0, 5000)
    assert isinstance(again, Acquired)
    assert again.token > taken.token  # the fencing counter survived the release
    assert store.release(keys.lock, "owner-b", 0) is ReleaseStatus.RELEASED
    return taken


# -- URL syntax (no server) -----------------------------------------------------------------------


def test_sentinel_url_syntax() -> None:
    """redis+sentinel://[[user]:password@]host[:port],.../service[/db]?options."""
    url = (
        f"redis+sentinel://app:{PASSWORD}@s1:26380,s2,[::1]:26381/billing/3"
        f"?sentinel_password={SENTINEL_PASSWORD}&socket_timeout=2&wait_replicas=1"
    )
    parsed = parse_lock_url(url)
    assert parsed.kind == "sentinel"
    assert parsed.nodes == (("s1", 26380), ("s2", 26379), ("::1", 26381))
    assert parsed.service == "billing"
    assert dict(parsed.options) == {
        "username": "app",
        "password": PASSWORD,
        "db": 3,
        "socket_timeout": 2.0,
    }
    assert dict(parsed.sentinel_options) == {"socket_timeout": 2.0, "password": SENTINEL_PASSWORD}
    assert parsed.wait_replicas == 1
    assert PASSWORD not in repr(parsed)
    assert SENTINEL_PASSWORD not in repr(parsed)


def test_tls_sentinel_url_uses_tls_to_sentinels_and_master() -> None:
    """rediss+sentinel://: ssl and the ssl_* options go to the sentinels and the data nodes."""
    parsed = parse_lock_url(
        "rediss+sentinel://s1,s2/m?ssl_ca_certs=/ca.pem&ssl_cert_reqs=required&socket_timeout=1"
    )
    tls = {"ssl": True, "ssl_ca_certs": "/ca.pem", "ssl_cert_reqs": "required"}
    assert dict(parsed.options) == {**tls, "socket_timeout": 1.0, "db": 0}
    assert dict(parsed.sentinel_options) == {**tls, "socket_timeout": 1.0}


def test_cluster_url_syntax() -> None:
    """redis+cluster://[[user]:password@]host[:port],...; rediss+cluster:// turns on TLS."""
    parsed = parse_lock_url(
        f"rediss+cluster://:{PASSWORD}@n1:7000,n2:7001,n3/0?ssl_ca_certs=/etc/ca.pem"
    )
    assert parsed == LockUrl(
        "cluster",
        nodes=(("n1", 7000), ("n2", 7001), ("n3", 6379)),
        tls=True,
        options={"password": PASSWORD, "ssl_ca_certs": "/etc/ca.pem", "ssl": True},
    )


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        (f"redis+sentinel://:{PASSWORD}@h1:26379", "no service name"),
        (f"redis+sentinel://:{PASSWORD}@h1:26379/m/x", "the database must be a number"),
        (f"redis+sentinel://:{PASSWORD}@h1:99999/m", "invalid port"),
        (f"redis+sentinel://:{PASSWORD}@h1,,h2/m", "empty host"),
        (f"redis+cluster://:{PASSWORD}@h1/2", "only database 0"),
        (f"redis+cluster://:{PASSWORD}@h1?bogus=1", "unknown option 'bogus'"),
        (f"redis+cluster://:{PASSWORD}@h1?ssl_ca_certs=/x", "needs TLS"),
        (f"redis://:{PASSWORD}@h1?sentinel_password=x", "need a redis+sentinel:// URL"),
        (f"redis://:{PASSWORD}@h1/0?wait_replicas=-1", "wait_replicas must be an integer"),
        (f"redis+sentinel://:{PASSWORD}@h1/m?wait_timeout=0", "wait_timeout must be"),
        (f"redis+sentinel://:ab?{PASSWORD}@h1/m", "empty host"),  # an unescaped ? in it
    ],
)
def test_bad_urls_are_refused_without_the_password(url: str, reason: str) -> None:
    """A URL that cannot work is a SingletonConfigError naming the setting and the reason."""
    with pytest.raises(SingletonConfigError, match="singleton_redis_url") as info:
        read_options({"singleton_redis_url": url})
    assert reason in str(info.value)
    assert PASSWORD not in str(info.value)
    with pytest.raises(ValueError, match="bad Redis URL") as raised:
        client_for(url)
    assert PASSWORD not in str(raised.value)


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        (
            f"redis+sentinel://:{PASSWORD}@h1:26379,h2:26379/m/0",
            "redis+sentinel://:***@h1:26379,h2:26379/m/0",
        ),
        (
            f"rediss+cluster://app:{PASSWORD}@h1:7000,h2:7001",
            "rediss+cluster://app:***@h1:7000,h2:7001",
        ),
        (
            f"redis+sentinel://h1,h2/m?sentinel_password={PASSWORD}&db=1",
            "redis+sentinel://h1,h2/m?sentinel_password=***&db=1",
        ),
        (f"unix:///tmp/r.sock?db=1&password={PASSWORD}", "unix:///tmp/r.sock?db=1&password=***"),
        (
            f"rediss://h/0?ssl_keyfile=/k.pem&ssl_password={PASSWORD}",
            "rediss://h/0?ssl_keyfile=/k.pem&ssl_password=***",
        ),
    ],
)
def test_redact_url_new_forms(url: str, shown: str) -> None:
    """Comma host lists keep their hosts; user-info and query passwords become ***."""
    assert redact_url(url) == shown


def test_good_new_urls_are_accepted_unchanged() -> None:
    for url in (
        "redis+sentinel://h1:26379,h2:26380/mymaster",
        "rediss+sentinel://:pw@h1/mymaster/2?ssl_cert_reqs=none",
        "redis+cluster://h1:7000,h2:7001,h3:7002",
        "redis://h/0?wait_replicas=1&wait_timeout=0.25",
    ):
        assert read_options({"singleton_redis_url": url}).redis_url == url
        assert read_beat_options({"singleton_redis_url": url}).redis_url == url


def test_wait_settings_are_folded_into_the_url() -> None:
    """singleton_wait_replicas/_timeout end up in the URL's query; the URL's own values win."""
    conf = {"singleton_redis_url": "redis://h:6379/0", "singleton_wait_replicas": 1}
    assert resolve_redis_url(conf) == "redis://h:6379/0?wait_replicas=1"
    conf["singleton_wait_timeout"] = 0.25
    assert resolve_redis_url(conf) == "redis://h:6379/0?wait_replicas=1&wait_timeout=0.25"
    conf["singleton_redis_url"] = "redis://h:6379/0?wait_replicas=2"
    assert resolve_redis_url(conf) == "redis://h:6379/0?wait_replicas=2&wait_timeout=0.25"
    assert read_options(conf).redis_url == resolve_redis_url(conf)
    broker = {"broker_url": "redis://b:6379/1", "singleton_wait_replicas": 1}
    assert read_options(broker).redis_url == "redis://b:6379/1?wait_replicas=1"
    assert resolve_redis_url({"singleton_redis_url": "redis://h/0"}) == "redis://h/0"


def test_the_fence_margin_is_folded_into_the_url_and_reaches_every_store() -> None:
    """singleton_fence_margin ends up in the URL's query (the URL's own value wins), and every
    kind of store is built with it; a bad one stops the worker at start-up."""
    conf: dict[str, object] = {"singleton_redis_url": "redis://h:6379/0"}
    assert resolve_redis_url(conf) == "redis://h:6379/0"  # the default adds nothing
    conf["singleton_fence_margin"] = 2.5
    assert resolve_redis_url(conf) == "redis://h:6379/0?fence_margin=2.5"
    conf["singleton_redis_url"] = "redis://h:6379/0?fence_margin=0"
    assert resolve_redis_url(conf) == "redis://h:6379/0?fence_margin=0"
    for url in (
        "redis://h:6379/0?fence_margin=2.5",
        "redis+sentinel://s1:26379/mymaster?fence_margin=2.5",
        "redis+cluster://h1:7000?fence_margin=2.5",
        "redis+redlock://h1:6379,h2:6379,h3:6379?fence_margin=2.5",
    ):
        store = new_store(url)
        assert store.fence_margin_ms == 2500, url  # type: ignore[attr-defined]
        store.close()
    assert new_store("redis://h:6379/0").fence_margin_ms == FENCE_MARGIN_MS  # type: ignore[attr-defined]
    with pytest.raises(SingletonConfigError, match="fence_margin"):
        read_options({"singleton_redis_url": "redis://h/0?fence_margin=-1"})
    with pytest.raises(SingletonConfigError, match="singleton_fence_margin"):
        read_options({"singleton_fence_margin": -1})


@pytest.mark.parametrize(
    ("conf", "setting"),
    [
        ({"singleton_wait_replicas": -1}, "singleton_wait_replicas"),
        ({"singleton_wait_replicas": 1.5}, "singleton_wait_replicas"),
        ({"singleton_wait_replicas": True}, "singleton_wait_replicas"),
        ({"singleton_wait_timeout": 0}, "singleton_wait_timeout"),
    ],
)
def test_bad_wait_settings(conf: dict[str, object], setting: str) -> None:
    with pytest.raises(SingletonConfigError, match=setting):
        read_options(conf)


def test_store_takes_the_wait_options_from_the_url(private_redis: RedisServer) -> None:
    """store_for builds its LockStore with the URL's wait_replicas and wait_timeout."""
    store = store_for(f"{private_redis.url}?wait_replicas=2&wait_timeout=0.05")
    assert (store.wait_replicas, store.wait_timeout_ms) == (2, 50)
    assert isinstance(store.client, redis.Redis)
    assert "wait_replicas" not in store.client.connection_pool.connection_kwargs
    store.close()


def test_wait_replicas_without_replicas_keeps_the_lock(
    private_redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Fewer replicas than asked (here: none) is logged; the acquire still holds the lock."""
    store = store_for(f"{private_redis.url}?wait_replicas=1&wait_timeout=0.05")
    keys = lock_keys("cslt:conn:", "t.wait", b"1")
    with caplog.at_level(logging.WARNING, logger="celery_singleton_lock.core.store"):
        taken = store.acquire(keys, "owner", 0, 5000)
    assert isinstance(taken, Acquired)
    assert taken.replicas == 0
    assert "singleton: only 0 of 1 replicas acknowledged the lock within 50ms" in caplog.text
    assert isinstance(store.acquire(keys, "other", 0, 5000), Contended)
    assert store.release(keys.lock, "owner", 0) is ReleaseStatus.RELEASED
    store.close()


# -- TLS ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tls_files() -> Iterator[TlsFiles]:
    directory = short_tempdir("cslt-tls-")
    try:
        yield make_tls_files(directory)
    except TlsUnsupported as exc:
        pytest.skip(str(exc))
    finally:
        subprocess.run(["rm", "-rf", str(directory)], check=False)


@pytest.fixture(scope="module")
def tls_server(tls_files: TlsFiles) -> Iterator[TlsServer]:
    """A private server with TLS that demands a client certificate (skipped without TLS)."""
    try:
        server = TlsServer(tls_files, auth_clients=True)
    except TlsUnsupported as exc:
        pytest.skip(str(exc))
    yield server
    server.close()


def test_tls_certificate_options_pass_through(tls_files: TlsFiles) -> None:
    """ssl_cert_reqs, ssl_ca_certs, ssl_certfile and ssl_keyfile reach redis-py's connection."""
    url = (
        f"rediss://:{PASSWORD}@127.0.0.1:6380/0?ssl_cert_reqs=required"
        f"&ssl_ca_certs={tls_files.ca_cert}&ssl_certfile={tls_files.client_cert}"
        f"&ssl_keyfile={tls_files.client_key}&wait_replicas=1"
    )
    client = client_for(url)
    try:
        pool = client.connection_pool
        assert pool.connection_class is SSLConnection
        kwargs = pool.connection_kwargs
        assert kwargs["ssl_cert_reqs"] == "required"
        assert kwargs["ssl_ca_certs"] == str(tls_files.ca_cert)
        assert kwargs["ssl_certfile"] == str(tls_files.client_cert)
        assert kwargs["ssl_keyfile"] == str(tls_files.client_key)
        assert kwargs["password"] == PASSWORD
        assert "wait_replicas" not in kwargs  # ours, taken out before redis-py sees the URL
        assert kwargs["socket_timeout"] == singleton_connection.SOCKET_TIMEOUT_S
    finally:
        client.close()


def test_tls_lock_cycle(tls_server: TlsServer) -> None:
    """A rediss:// URL with a CA, a client certificate and its key: the full lock cycle."""
    store = store_for(tls_server.tls_url())
    try:
        assert store.client.connection_pool.connection_class is SSLConnection
        lock_cycle(store)
        connections = store.client.client_list()
        assert connections  # this connection is the TLS one: the plain port has no clients
    finally:
        store.close()


def test_tls_refuses_a_server_it_cannot_verify(tls_server: TlsServer) -> None:
    """Without the test CA the server's certificate does not verify: Redis cannot be asked."""
    store = store_for(tls_server.tls_url(ca=False))
    try:
        with pytest.raises(LockUnavailableError, match="could not acquire") as info:
            store.acquire(lock_keys("cslt:conn:", "t.tls", b"1"), "owner", 0, 1000)
        assert "certificate verify failed" in str(info.value).lower()
    finally:
        store.close()


def test_tls_client_certificate_is_required(tls_server: TlsServer) -> None:
    """The server demands a client certificate: without ssl_certfile the handshake fails."""
    store = store_for(tls_server.tls_url(client_cert=False))
    try:
        with pytest.raises(LockUnavailableError):
            store.acquire(lock_keys("cslt:conn:", "t.tls", b"2"), "owner", 0, 1000)
    finally:
        store.close()


# -- unix socket and ACL --------------------------------------------------------------------------


def test_unix_socket_lock_cycle() -> None:
    """unix:///path/to.sock?db=N: the full lock cycle over a private server's socket."""
    directory = short_tempdir("cslt-sock-")
    socket_path = directory / "redis.sock"
    server = RedisServer(extra_args=("--unixsocket", str(socket_path), "--unixsocketperm", "700"))
    try:
        store = store_for(f"unix://{socket_path}?db=2")
        try:
            assert store.client.connection_pool.connection_class is UnixDomainSocketConnection
            lock_cycle(store)
            assert store.client.connection_pool.connection_kwargs["db"] == 2
        finally:
            store.close()
    finally:
        server.close()
        subprocess.run(["rm", "-rf", str(directory)], check=False)


def test_acl_user_and_password(private_redis: RedisServer) -> None:
    """redis://user:password@...: an ACL user with only the documented commands, on the lock
    keys only, takes, renews and releases locks, claims runs and waits for replicas; a wrong
    password is LockUnavailableError, and no message shows either password."""
    admin = private_redis.client()
    try:
        admin.execute_command(
            "ACL",
            "SETUSER",
            "locker",
            "on",
            f">{PASSWORD}",
            "~cslt:acl:*",
            *documented_acl_commands(),
        )
    finally:
        admin.close()
    url = f"redis://locker:{PASSWORD}@127.0.0.1:{private_redis.port}/0"
    store = store_for(url)
    waiting = store_for(f"{url}?wait_replicas=1&wait_timeout=0.01")
    try:
        lock_cycle(store, prefix="cslt:acl:")
        taken = waiting.acquire(lock_keys("cslt:acl:", "t.acl", b"w"), "owner", 0, 1000)
        assert isinstance(taken, Acquired)
        assert taken.replicas == 0
        claims = RunClaims(store.client, "beat-a")
        claim = run_claim_key("cslt:acl:", "entry", "run-1")
        assert claims.claim(claim, 1000).won
        assert claims.confirm(claim, "task-1", 1000)
        steer = Steering([store.client], "cslt:acl:", "group")  # the beat verbs
        steer.register({"entry": "{}"})
        assert steer.heartbeat("beat-a", 1000) == []
        assert steer.pause("entry", "ann@host", 1000) == "ann@host 1000"
        assert steer.pauses(["entry"]) == ["ann@host 1000"]
        assert steer.resume("entry")
        ask = steer.ask("entry", "ann@host", 1000, 5000)
        assert steer.claim_of(ask) is None
        assert steer.forget(ask)
        assert (steer.registered(), steer.beats()) == ({"entry": "{}"}, {"beat-a": 1000})
        assert steer.records(["entry"]) == [None]  # no run at a nominal time noted
        steer.gone("beat-a")
        with pytest.raises(redis.exceptions.NoPermissionError):
            store.client.set("elsewhere", "1")  # the ACL is in force
    finally:
        store.close()
        waiting.close()
    wrong = store_for(f"redis://locker:Wr0ng-{PASSWORD[::-1]}@127.0.0.1:{private_redis.port}/0")
    try:
        with pytest.raises(LockUnavailableError) as info:
            wrong.acquire(lock_keys("cslt:acl:", "t.acl", b"1"), "owner", 0, 1000)
        assert PASSWORD not in str(info.value)
        assert PASSWORD[::-1] not in str(info.value)
    finally:
        wrong.close()


# -- Redis 7 and Valkey 8 -------------------------------------------------------------------------


def test_test_server_matches_the_choice(redis_client: redis.Redis) -> None:
    """Under SINGLETON_TEST_SERVER=valkey the suite's Redis is Valkey; under redis, Redis."""
    info = server_info(redis_client, "server")
    choice = server_choice()
    if choice == "valkey":
        assert info.get("server_name") == "valkey", info
        assert int(str(info["valkey_version"]).split(".")[0]) >= 8
    elif choice == "redis":
        assert "valkey_version" not in info, info
        assert int(str(info["redis_version"]).split(".")[0]) >= 7


def _other_server() -> str:
    return "redis" if server_choice() == "valkey" else "valkey"


@pytest.mark.skipif(os.environ.get("SINGLETON_TEST_NESTED") == "1", reason="already the nested run")
@pytest.mark.slow(seconds=10)
def test_fast_suite_on_the_other_server() -> None:
    """The fast integration files pass on the other server too (Valkey 8 when this run uses
    Redis 7, and the other way round), on private servers of that binary."""
    other = _other_server()
    env = {**os.environ, SERVER_ENV: other, "SINGLETON_TEST_NESTED": "1"}
    env.pop("SINGLETON_TEST_REDIS_URL", None)
    try:
        subprocess.run(
            [sys.executable, "-c", "import tests.support.servers as s; s.find_server_binary()"],
            cwd=ROOT,
            env=env,
            check=True,
            capture_output=True,
            timeout=30,
        )
    except subprocess.CalledProcessError:
        pytest.skip(f"no {other} server binary installed")
    node = "tests/integration/test_connections.py::test_test_server_matches_the_choice"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-n",
            "0",
            "-p",
            "no:cacheprovider",
            *FAST_FILES,
            node,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout
    assert find_server_binary()  # and this run's binary is still found


def test_reset_closes_the_stores_it_forgets(private_redis: RedisServer, key_prefix: str) -> None:
    """`connection.reset()` (shutdown, tests) closes the connections of the stores it forgets,
    the one kept for releases written ahead included: none is left to the garbage collector."""
    store = store_for(private_redis.url)
    assert isinstance(store, LockStore)
    keys = lock_keys(f"{key_prefix}lock:", "tests.reset", b"k")
    assert isinstance(store.acquire(keys, "run-1", 0, 30_000), Acquired)
    assert store.release_ahead(keys.lock, "run-1", 0, "k")  # takes the kept connection
    watcher = private_redis.client()
    assert watcher.client_list()  # the store's connections are open
    before = {c["id"] for c in watcher.client_list()}
    assert len(before) >= 3, before  # the watcher's, the store's, the one kept for releases
    singleton_connection.reset()

    # the server reads each closed socket's end in its own time: a CLIENT LIST sent right
    # after can still name them
    def only_the_watchers() -> set[str] | None:
        ids = {c["id"] for c in watcher.client_list()}
        return ids if len(ids) == 1 else None

    left = wait_for(
        only_the_watchers,
        5,
        "the store's connections to close",
        details=lambda: str(watcher.client_list()),
    )
    assert left < before  # only the watcher's
    assert store_for(private_redis.url) is not store  # forgotten: a new one next time
