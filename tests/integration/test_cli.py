"""The ``celery singleton`` command against real Redis, and a real worker holding a lock."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery
from celery.result import AsyncResult
from click.testing import CliRunner

from celery_singleton_lock import SkipInfo, skip_info
from celery_singleton_lock.core.admin import (
    ForceStatus,
    force_release,
    iter_locks,
    read_lock,
    stale_reason,
    stats,
)
from celery_singleton_lock.core.keys import derive_keys, keys_of, lock_keys
from celery_singleton_lock.core.pending import leave_pending, pending_key
from celery_singleton_lock.core.store import LockStore
from celery_singleton_lock.tools.cli import singleton
from tests.support.basic_app import SINGLETON_APP
from tests.support.cli import app_env, singleton_cli
from tests.support.client_tasks import COALESCE, coalesce_keys
from tests.support.waiting import wait_for
from tests.support.workers import WorkerFactory


def _celery(redis_url: str, prefix: str, *args: str, timeout: float = 60) -> Any:
    """Run ``celery -A tests.support.singleton_app singleton <args>`` as a real process."""
    return singleton_cli(SINGLETON_APP, app_env(redis_url, prefix), *args, timeout=timeout)


def _plant(client: redis.Redis, prefix: str, task: str, ident: bytes, host: str) -> str:
    """Take a lock the way a worker would, held by ``host``; return its key."""
    keys = lock_keys(prefix, task, ident)
    meta = {"task": task, "host": host, "pid": "4242", "args": repr(ident)}
    LockStore(client).acquire(keys, f"owner-{ident.decode()}", 0, 60_000, meta)
    return keys.lock


@pytest.mark.slow(seconds=8)
def test_list_purge_and_release_on_a_live_worker(
    worker_factory: WorkerFactory,
    client_app: Celery,
    redis_client: redis.Redis,
    redis_url: str,
    key_prefix: str,
) -> None:
    """list shows the worker's lock and holder; purge spares it; release makes the run lose it."""
    lock_prefix = f"{key_prefix}lock:"
    worker = worker_factory.start(SINGLETON_APP, env={"SINGLETON_TEST_TTL": "4"})
    dead = _plant(redis_client, lock_prefix, "t.hold", b"dead", "w-gone@nowhere")
    bare = _plant(redis_client, lock_prefix, "t.hold", b"bare", "w-gone@nowhere")
    redis_client.persist(bare)
    worker.wait_ready(client_app)
    # runs far longer than the test: the lock must only end by the release below
    result = client_app.send_task("t.hold", kwargs={"key": "held-k", "seconds": 120})

    def live_lock() -> dict[str, Any] | None:
        listed = _celery(redis_url, key_prefix, "list", "--json")
        assert listed.returncode == 0, listed.stderr
        mine = [lock for lock in json.loads(listed.stdout) if lock["owner"] == result.id]
        return mine[0] if mine else None

    lock = wait_for(live_lock, 30, "the worker's lock in `singleton list --json`")
    assert lock["task"] == "t.hold"
    assert lock["host"] == worker.nodename
    assert lock["pid"] in worker.child_pids()
    assert "held-k" in lock["args"]
    assert lock["token"] > 0
    assert 0 < lock["ttl_s"] <= 4.0
    assert lock["lease_s"] == 4.0
    assert 0 <= lock["renewed_s"] < 4.0  # renewed every 4/3 s, else it would be gone

    purged = _celery(redis_url, key_prefix, "purge", "--yes", "--timeout", "3")
    assert purged.returncode == 0, purged.stderr
    assert "released 2 of 2" in purged.stdout, purged.stdout
    assert redis_client.exists(dead, bare) == 0
    assert redis_client.exists(lock["key"]) == 1  # its holder answered the ping

    released = _celery(redis_url, key_prefix, "release", lock["key"], "--yes")
    assert released.returncode == 0, released.stderr
    assert f"singleton: force-released key={lock['key']}" in released.stderr

    def logged() -> set[str]:
        return {raw.decode() for raw in redis_client.lrange(f"{key_prefix}signals", 0, -1)}

    wait_for(lambda: f"lock_lost {result.id}" in logged(), 30, "lock_lost from the worker")
    assert f"lock_force_released {result.id}" in logged()  # sent by the command's process
    assert "singleton: lock lost: t.hold" in worker.log_text()


def test_iter_locks_scans_a_database_with_many_keys(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    """SCAN finds every lock among many other keys, in small batches, and filters by task."""
    pipe = redis_client.pipeline(transaction=False)
    for index in range(20_000):
        pipe.set(f"{key_prefix}noise:{index}", "x")
    for index in range(50):  # fencing counters sit next to the locks: not locks themselves
        pipe.set(f"{key_prefix}lock:{{t.other:{index}}}:fence", "1")
    pipe.execute()
    prefix = f"{key_prefix}lock:"
    keys = {_plant(redis_client, prefix, "t.a", f"a{i}".encode(), "w1@h") for i in range(25)}
    keys |= {_plant(redis_client, prefix, "t.b", f"b{i}".encode(), "w2@h") for i in range(5)}
    found = list(iter_locks(redis_client, prefix, batch=100))
    assert {info.key for info in found} == keys
    only_b = list(iter_locks(redis_client, prefix, task="t.b"))
    assert {info.task for info in only_b} == {"t.b"}
    assert len(only_b) == 5
    totals = stats(found)
    assert totals.locks == 30
    assert totals.by_task == {"t.a": 25, "t.b": 5}
    assert totals.by_host == {"w1@h": 25, "w2@h": 5}


def test_task_filter_finds_the_locks_of_a_scoped_task(
    redis_client: redis.Redis, redis_url: str, key_prefix: str
) -> None:
    """The keys of a task of a ``singleton_scope`` carry the scope's name, not the task's:
    `list`, `stats` and `purge --all` with ``--task`` find the locks that task holds through
    the app (``-A``), and leave those another task of the scope holds."""
    prefix = f"{key_prefix}lock:"
    imported = _plant(redis_client, prefix, "tenant-sync", b"a", "w1@h")  # the scope's lock
    redis_client.hset(imported, "task", "t.tenant_import")
    exported = _plant(redis_client, prefix, "tenant-sync", b"b", "w1@h")
    redis_client.hset(exported, "task", "t.tenant_export")
    listed = _celery(redis_url, key_prefix, "list", "--json", "--task", "t.tenant_import")
    assert listed.returncode == 0, listed.stderr
    assert [lock["key"] for lock in json.loads(listed.stdout)] == [imported]
    counted = _celery(redis_url, key_prefix, "stats", "--json", "--task", "t.tenant_export")
    assert counted.returncode == 0, counted.stderr
    assert json.loads(counted.stdout)["by_task"] == {"t.tenant_export": 1}
    purged = _celery(redis_url, key_prefix, "purge", "--all", "--yes", "--task", "t.tenant_import")
    assert purged.returncode == 0, purged.stderr
    assert "released 1 of 1 lock(s)" in purged.stdout, purged.stdout
    assert (redis_client.exists(imported), redis_client.exists(exported)) == (0, 1)


def test_force_release_leaves_a_lock_that_changed_hands(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    """Only the owner and token that were read are deleted; the fencing counter stays."""
    keys = lock_keys(key_prefix, "t.a", b"x")
    store = LockStore(redis_client)
    store.acquire(keys, "first", 0, 60_000, {"task": "t.a", "host": "w1@h"})
    shown = read_lock(redis_client, keys.lock, key_prefix)
    assert shown is not None
    assert shown.owner == "first"
    store.release(keys.lock, "first", 0)
    store.acquire(keys, "second", 0, 60_000, {"task": "t.a", "host": "w1@h"})
    assert force_release(redis_client, shown) is ForceStatus.CHANGED
    assert redis_client.hget(keys.lock, "owner") == b"second"
    now = read_lock(redis_client, keys.lock, key_prefix)
    assert now is not None
    assert force_release(redis_client, now) is ForceStatus.RELEASED
    assert force_release(redis_client, now) is ForceStatus.GONE
    assert redis_client.exists(keys.fence) == 1


def test_stale_reasons(redis_client: redis.Redis, key_prefix: str) -> None:
    """No owner, no ttl and a holder node that is not alive are stale; the rest are not."""
    live = _plant(redis_client, key_prefix, "t.a", b"live", "w1@h")
    gone = _plant(redis_client, key_prefix, "t.a", b"gone", "w9@h")
    local = _plant(redis_client, key_prefix, "t.a", b"local", "laptop")  # not a node name
    bare = _plant(redis_client, key_prefix, "t.a", b"bare", "w1@h")
    redis_client.persist(bare)
    orphan = _plant(redis_client, key_prefix, "t.a", b"orphan", "w1@h")
    redis_client.hdel(orphan, "owner")
    infos = {info.key: info for info in iter_locks(redis_client, key_prefix)}

    def reason(key: str, alive: bool = True) -> str | None:
        return stale_reason(infos[key], lambda: {"w1@h"} if alive else None)

    assert reason(live) is None
    assert reason(gone) == "holder down"
    assert reason(gone, alive=False) is None  # nobody answered: unknown, not down
    assert reason(local) is None
    assert reason(bare) == "no ttl"
    assert reason(orphan) == "no owner"


def test_renewed_is_the_ttl_minus_the_time_left(
    redis_client: redis.Redis, redis_url: str, key_prefix: str
) -> None:
    """`renewed` is ttl - PTTL: about 0 right after the acquire, 15 s once 15 s went unrenewed."""
    fresh = _plant(redis_client, key_prefix, "t.a", b"fresh", "w1@h")
    stale = _plant(redis_client, key_prefix, "t.a", b"stale", "w1@h")
    assert redis_client.pexpire(stale, 45_000)  # 15 s of its 60 s ttl went by without a renewal
    infos = {info.key: info for info in iter_locks(redis_client, key_prefix)}
    assert infos[fresh].renewed_s is not None
    assert 0 <= infos[fresh].renewed_s < 1
    assert infos[stale].renewed_s is not None
    assert 15 <= infos[stale].renewed_s < 16
    longest = stats(infos.values()).longest_since_renewal_s
    assert longest is not None
    assert 15 <= longest < 16
    runner = CliRunner()
    base = ["--url", redis_url, "--prefix", key_prefix]
    shown = runner.invoke(singleton, [*base, "show", stale])
    assert shown.exit_code == 0, shown.output
    assert re.search(r"^renewed: +15\.\ds ago$", shown.output, re.MULTILINE), shown.output
    totals = runner.invoke(singleton, [*base, "stats"])
    assert totals.exit_code == 0, totals.output
    assert re.search(r"^longest since renewal: +15\.\ds$", totals.output, re.MULTILINE)


def test_cli_never_shows_the_password(key_prefix: str) -> None:
    """A URL's password is redacted in errors and in stats."""
    runner = CliRunner()
    url = "redis://user:s3cr3t-pw@127.0.0.1:1/0"
    out = runner.invoke(singleton, ["--url", url, "--prefix", key_prefix, "stats"])
    assert out.exit_code == 1
    assert "s3cr3t-pw" not in out.output
    assert "user:***@127.0.0.1:1" in out.output


def test_cli_release_asks_first(redis_client: redis.Redis, redis_url: str, key_prefix: str) -> None:
    """Without --yes, release asks; answering no leaves the lock."""
    key = _plant(redis_client, key_prefix, "t.a", b"ask", "w1@h")
    runner = CliRunner()
    base = ["--url", redis_url, "--prefix", key_prefix]
    shown = runner.invoke(singleton, [*base, "show", key, "--json"])
    assert shown.exit_code == 0, shown.output
    assert json.loads(shown.output)["owner"] == "owner-ask"
    out = runner.invoke(singleton, [*base, "release", key], input="n\n")
    assert out.exit_code == 1
    assert "Force-release this lock?" in out.output
    assert redis_client.exists(key) == 1
    out = runner.invoke(singleton, [*base, "release", key], input="y\n")
    assert out.exit_code == 0, out.output
    assert redis_client.exists(key) == 0
    out = runner.invoke(singleton, [*base, "show", key])
    assert out.exit_code == 1
    assert f"no lock at {key}" in out.output


#: An application's hash, as it might sit in the same database as the locks.
_APP_FIELDS = {b"name": b"alice", b"email": b"alice@example.com", b"plan": b"pro"}


@pytest.fixture
def foreign(redis_client: redis.Redis, key_prefix: str) -> Iterator[list[str]]:
    """The foreign keys below, deleted at teardown (one lies outside ``key_prefix``, so the
    prefix cleanup would miss it)."""
    keys = _plant_foreign(redis_client, key_prefix)
    yield keys
    redis_client.delete(*keys)


def _plant_foreign(client: redis.Redis, key_prefix: str) -> list[str]:
    """Plant an application's hash at every key the CLI (prefix ``{key_prefix}lock:``) must never
    read or delete: outside the prefix, or under it without the shape of a lock key. Most match
    SCAN's ``prefix{*}:lock`` glob. Return the keys."""
    lock_prefix = f"{key_prefix}lock:"
    real = lock_keys(lock_prefix, "t.a", b"real")  # a genuine lock's tag, to misuse
    tag = real.lock[len(lock_prefix) : -len(":lock")]  # {t.a:<32 hex>}
    keys = [
        f"{key_prefix}app:user:1000",  # outside the prefix
        lock_keys(f"{key_prefix}other:", "t.a", b"real").lock,  # a lock under another prefix
        f"{lock_prefix}{{x}}:lock",  # no digest
        f"{lock_prefix}{{t.a:nodigest}}:lock",  # not a digest; its task part reads "t.a"
        f"{lock_prefix}{{app}}:user:{{1000}}:lock",  # glob's * spans } and :
        f"{lock_prefix}{tag}:x:{{y}}:lock",  # a lock's tag, then more before :lock
        f"{lock_prefix}{tag.upper()}:lock",  # upper-case digest (and name)
        f"{lock_prefix}{{t a:{'0' * 32}}}:lock",  # a name character safe_name never keeps
        f"{lock_prefix}{tag}:lockx",
        f"{lock_prefix}{tag}:fence",
        f"{lock_prefix}{tag}:queued",
        f"{lock_prefix}{tag}:pending",  # a coalesced follow-up's record
        f"{lock_prefix}{tag}:joiners",  # the calls that joined a run (a hash, as a lock is)
        f"{lock_prefix}{tag}:done:x}}:lock",  # a completion record: its task id ends "}:lock"
        f"{lock_prefix}{tag}:done:{tag}:lock",  # ... a task id shaped as a lock's tail
        f"{lock_prefix}{tag}:lock:0",  # no permit slot 0
        f"{lock_prefix}{tag}:run:1",
        f"x{lock_prefix}{tag}:lock",  # a lock key with something in front of the prefix
    ]
    for key in keys:
        client.hset(key, mapping=_APP_FIELDS)
    return keys


def test_release_and_show_refuse_keys_that_are_not_locks_of_the_library(
    redis_client: redis.Redis, redis_url: str, key_prefix: str, foreign: list[str]
) -> None:
    """show and release name the key and why, exit 2, and never read or delete a foreign hash."""
    lock_prefix = f"{key_prefix}lock:"
    runner = CliRunner()
    base = ["--url", redis_url, "--prefix", lock_prefix]
    for key in foreign:
        for args in (["show", key], ["show", key, "--json"], ["release", key, "--yes"]):
            out = runner.invoke(singleton, [*base, *args])
            assert out.exit_code == 2, (key, args, out.output)
            assert out.exception is None or isinstance(out.exception, SystemExit), out.exception
            outside = not key.startswith(lock_prefix)
            why = f"outside the prefix {lock_prefix!r}" if outside else "not a lock key"
            if key.endswith(":queued"):  # a marker's name, but an application's hash there
                why = "not a publish-time marker of this library (a hash)"
            assert key in out.output, out.output
            assert why in out.output, out.output
            assert "alice" not in out.output  # the hash was never read
        assert redis_client.hgetall(key) == _APP_FIELDS, key
    # the real command, as an operator types it
    released = _celery(redis_url, key_prefix, "release", f"{key_prefix}app:user:1000", "--yes")
    assert released.returncode == 2, (released.stdout, released.stderr)
    assert f"outside the prefix {lock_prefix!r}" in released.stderr, released.stderr
    assert "Traceback" not in released.stderr
    assert redis_client.hgetall(f"{key_prefix}app:user:1000") == _APP_FIELDS


def test_purge_list_and_stats_pass_over_keys_that_are_not_locks(
    redis_client: redis.Redis, redis_url: str, key_prefix: str, foreign: list[str]
) -> None:
    """Keys that match SCAN's glob but are not lock keys are never listed, counted or purged."""
    lock_prefix = f"{key_prefix}lock:"
    # the foreign keys have no owner: "stale" if taken for locks
    stale = _plant(redis_client, lock_prefix, "t.a", b"stale", "w1@h")
    redis_client.persist(stale)  # no ttl: stale
    held = _plant(redis_client, lock_prefix, "t.a", b"held", "w1@h")
    runner = CliRunner()
    base = ["--url", redis_url, "--prefix", lock_prefix]
    listed = runner.invoke(singleton, [*base, "list", "--json"])
    assert listed.exit_code == 0, listed.output
    assert {lock["key"] for lock in json.loads(listed.output)} == {stale, held}
    totals = runner.invoke(singleton, [*base, "stats", "--json"])
    assert totals.exit_code == 0, totals.output
    assert json.loads(totals.output)["locks"] == 2
    purged = runner.invoke(singleton, [*base, "purge", "--yes", "--timeout", "0.1"])
    assert purged.exit_code == 0, purged.output
    assert "released 1 of 1" in purged.output, purged.output
    assert redis_client.exists(stale) == 0
    purged = runner.invoke(singleton, [*base, "purge", "--all", "--task", "t.a", "--yes"])
    assert purged.exit_code == 0, purged.output
    assert "released 1 of 1" in purged.output, purged.output
    assert redis_client.exists(held) == 0
    for key in foreign:
        assert redis_client.hgetall(key) == _APP_FIELDS, key


def test_list_and_show_tell_a_pending_follow_up(
    redis_client: redis.Redis, redis_url: str, key_prefix: str
) -> None:
    """A lock with a coalesced follow-up waiting beside it (core/pending.py) shows its id and
    how many duplicates it collapses; a lock without one shows none."""
    busy = _plant(redis_client, key_prefix, "t.a", b"busy", "w1@h")
    quiet = _plant(redis_client, key_prefix, "t.a", b"quiet", "w1@h")
    run = LockStore(redis_client).run_script
    for n in range(3):  # a burst of three duplicates: one follow-up, the latest call
        left = leave_pending(run, keys_of(busy), "owner-busy", "follow-up-1", {"call": f"c{n}"})
        assert left.follow_up == "follow-up-1"
    runner = CliRunner()
    base = ["--url", redis_url, "--prefix", key_prefix]
    shown = runner.invoke(singleton, [*base, "show", busy])
    assert shown.exit_code == 0, shown.output
    assert "pending:   follow-up-1 (3 duplicates)" in shown.output
    assert "pending:" not in runner.invoke(singleton, [*base, "show", quiet]).output
    listed = runner.invoke(singleton, [*base, "list", "--json"])
    by_key = {lock["key"]: lock for lock in json.loads(listed.output)}
    assert (by_key[busy]["pending_follow_up"], by_key[busy]["pending_count"]) == ("follow-up-1", 3)
    assert by_key[quiet]["pending_follow_up"] is None
    table = runner.invoke(singleton, [*base, "list"]).output.splitlines()
    assert table[0].split("\t")[9] == "PENDING"
    rows = {row.split("\t")[-1]: row.split("\t") for row in table[1:]}
    assert rows[busy][9] == "follow-up-1 (3 duplicates)"
    assert rows[quiet][9] == "-"


def _hold_signature(key: str, seconds: float = 0.0, payload: Any = None) -> None:
    """The parameters of t.hold."""


def _plant_pending(
    client: redis.Redis, key_prefix: str, ident: bytes, follow_up: str, call_key: str = ""
) -> str:
    """The lock of ``t.hold(key=ident)``, its holder dead, with a coalesced call
    ``t.hold(key=call_key or ident)`` left beside it as ``follow_up``; return the lock's key."""
    keys = derive_keys(
        f"{key_prefix}lock:", "t.hold", _hold_signature, (), {"key": ident.decode()}, ("key",)
    )
    meta = {"task": "t.hold", "host": "w-gone@nowhere", "pid": "4242"}
    LockStore(client).acquire(keys, f"owner-{ident.decode()}", 0, 60_000, meta)
    key = keys.lock
    body = json.dumps([[], {"key": call_key or ident.decode(), "seconds": 0}])
    call = {"task": "t.hold", "body": body, "ctype": "application/json", "cenc": "utf-8"}
    run = LockStore(client).run_script
    assert leave_pending(run, keys, f"owner-{ident.decode()}", follow_up, call).count == 1
    return key


def test_release_publishes_the_pending_follow_up_of_the_lock_it_frees(
    redis_client: redis.Redis, redis_url: str, key_prefix: str, client_app: Celery
) -> None:
    """`celery -A app singleton release` of a lock with a coalesced follow-up waiting beside it
    publishes that follow-up once (the key's owner is gone: nobody else would, for 24 h)."""
    key = _plant_pending(redis_client, key_prefix, b"coalesced", "follow-up-2")
    released = _celery(redis_url, key_prefix, "release", key, "--yes")
    assert released.returncode == 0, released.stderr
    assert f"{key}: published its pending follow-up follow-up-2" in released.stdout
    assert redis_client.exists(pending_key(key)) == 0
    assert client_app.control.purge() == 1  # the follow-up, waiting for a worker


def test_purge_publishes_a_follow_up_whose_lock_expired(
    redis_client: redis.Redis, redis_url: str, key_prefix: str, client_app: Celery
) -> None:
    """A holder's node died, its lock expired with a coalesced follow-up beside it, and no later
    run of the key came: `purge` finds the orphaned record and publishes it once."""
    key = _plant_pending(redis_client, key_prefix, b"expired", "follow-up-3")
    redis_client.delete(key)  # the lock expired
    dry = _celery(redis_url, key_prefix, "purge", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert f"orphaned follow-up\tfollow-up-3\tt.hold\t{key}" in dry.stdout
    assert "1 orphaned follow-up(s) published (dry run)" in dry.stdout
    purged = _celery(redis_url, key_prefix, "purge", "--yes")
    assert purged.returncode == 0, purged.stderr
    assert "published 1 of 1 orphaned follow-up(s)" in purged.stdout
    assert redis_client.exists(pending_key(key)) == 0
    assert client_app.control.purge() == 1
    again = _celery(redis_url, key_prefix, "purge", "--yes")
    assert "nothing to purge" in again.stdout


def test_purge_drops_a_follow_up_whose_call_takes_another_lock(
    redis_client: redis.Redis, redis_url: str, key_prefix: str, client_app: Celery
) -> None:
    """A pending record beside a lock whose call would not take that lock (another key's call;
    written by hand or by another app on the prefix) was not left by a duplicate of the lock:
    `purge` takes it and drops it with an ERROR line, and publishes nothing."""
    key = _plant_pending(redis_client, key_prefix, b"mine", "follow-up-4", call_key="theirs")
    redis_client.delete(key)  # the lock expired
    purged = _celery(redis_url, key_prefix, "purge", "--yes")
    assert purged.returncode == 0, purged.stderr
    assert "published 0 of 1 orphaned follow-up(s)" in purged.stdout
    assert "singleton: coalesced follow-up dropped" in purged.stderr
    assert "its call takes another lock" in purged.stderr
    assert redis_client.exists(pending_key(key)) == 0
    assert client_app.control.purge() == 0


def test_the_follow_up_of_a_permit_lock_is_listed_released_and_purged(
    redis_client: redis.Redis, redis_url: str, key_prefix: str, client_app: Celery
) -> None:
    """A key with 2 permits, both slots held, a follow-up coalesced beside them (one record for
    the key): `list` shows it on each slot's row, `show` on the slot. `release` of one slot
    publishes it (a slot is free now, and its holder is one the duplicates met). A record whose
    slots are all gone is an orphan for `purge`; while one slot is held it is not."""
    keys = coalesce_keys(key_prefix)
    store = LockStore(redis_client)
    meta = {"task": COALESCE, "host": "w-gone@nowhere", "pid": "4242"}
    for owner in ("run-a", "run-b"):
        store.acquire(keys, owner, 0, 60_000, meta)
    body = json.dumps([["a"], {"payload": "p"}])
    call = {"task": COALESCE, "body": body, "ctype": "application/json", "cenc": "utf-8"}
    for _ in range(2):
        assert leave_pending(store.run_script, keys, "run-a", "follow-up-p", call).follow_up
    runner = CliRunner()
    base = ["--url", redis_url, "--prefix", f"{key_prefix}lock:"]
    table = runner.invoke(singleton, [*base, "list"]).output.splitlines()
    header = table[0].split("\t")
    rows = {row.split("\t")[-1]: row.split("\t") for row in table[1:]}
    state, pending = header.index("STATE"), header.index("PENDING")
    record = rows.pop(pending_key(keys.lock))  # the record's own row: its kind and ttl
    assert record[state] == "pending"
    assert record[pending] == "follow-up-p (2 duplicates)"
    assert set(rows) == set(keys.slots)
    assert {row[pending] for row in rows.values()} == {"follow-up-p (2 duplicates)"}
    shown = runner.invoke(singleton, [*base, "show", keys.slot(2)])
    assert shown.exit_code == 0, shown.output
    assert (
        "pending:   follow-up-p (2 duplicates) (published when the first of the key's runs "
        "releases)"
    ) in shown.output

    released = _celery(redis_url, key_prefix, "release", keys.slot(1), "--yes")
    assert released.returncode == 0, released.stderr
    assert f"{keys.lock}: published its pending follow-up follow-up-p" in released.stdout
    assert not redis_client.exists(pending_key(keys.lock))
    assert client_app.control.purge() == 1

    store.acquire(keys, "run-c", 0, 60_000, meta)  # slot 1 again: both held
    assert leave_pending(store.run_script, keys, "run-c", "follow-up-q", call).follow_up
    redis_client.delete(keys.slot(1))  # its node died: the slot expired
    held = _celery(redis_url, key_prefix, "purge", "--dry-run", "--timeout", "0.1")
    assert "orphaned follow-up" not in held.stdout, held.stdout  # slot 2's run still holds
    redis_client.delete(keys.slot(2))
    dry = _celery(redis_url, key_prefix, "purge", "--dry-run", "--timeout", "0.1")
    assert f"orphaned follow-up\tfollow-up-q\t{COALESCE}\t{keys.lock}" in dry.stdout, dry.stdout
    purged = _celery(redis_url, key_prefix, "purge", "--yes", "--timeout", "0.1")
    assert "published 1 of 1 orphaned follow-up(s)" in purged.stdout, purged.stdout
    assert client_app.control.purge() == 1
    assert not redis_client.exists(pending_key(keys.lock))


def test_release_of_a_newer_runs_lock_supersedes_an_orphaned_follow_up(
    redis_client: redis.Redis, redis_url: str, key_prefix: str, client_app: Celery
) -> None:
    """A follow-up left beside a holder whose lock expired (its node died), and a newer run
    took the lock since: `release` of that run's lock takes the record but does not publish it
    (the newer run is not among the holders its duplicates met): the follow-up's result is the
    skip marker naming that run, and nothing is sent."""
    key = _plant_pending(redis_client, key_prefix, b"orphan", "follow-up-5")
    redis_client.delete(key)  # the lock expired
    meta = {"task": "t.hold", "host": "w-gone@nowhere", "pid": "4243"}
    LockStore(redis_client).acquire(keys_of(key), "newer-run", 0, 60_000, meta)
    released = _celery(redis_url, key_prefix, "release", key, "--yes")
    assert released.returncode == 0, released.stderr
    assert (
        f"{key}: its pending follow-up follow-up-5 was superseded by the newer run newer-run: "
        "not published"
    ) in released.stdout
    assert redis_client.exists(pending_key(key)) == 0
    assert client_app.control.purge() == 0
    result = AsyncResult("follow-up-5", app=client_app)
    assert skip_info(result) == SkipInfo(key=key, holder="newer-run", task_id="follow-up-5")
