"""``celery singleton`` tells an operator the truth: an at-least window apart from a running lock,
and the keys that hold calls back beside a lock (publish-time markers, pending follow-ups,
joiners) listed, counted, shown and (a marker) released; against real Redis and a real worker."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
import redis
from celery import Celery
from click.testing import CliRunner

from celery_singleton_lock.core.admin import iter_locks, stats
from celery_singleton_lock.core.completion import ENDED_FIELD
from celery_singleton_lock.core.joiners import joiners_key
from celery_singleton_lock.core.keys import derive_keys, lock_keys, queued_key
from celery_singleton_lock.core.markers import iter_markers, read_marker, release_marker
from celery_singleton_lock.core.pending import leave_pending, pending_key
from celery_singleton_lock.core.store import LockStore
from celery_singleton_lock.tools.cli import singleton
from tests.support.basic_app import SINGLETON_APP, close_app
from tests.support.cli import app_env, singleton_cli
from tests.support.client_tasks import COALESCE, coalesce_keys, publish_client_app
from tests.support.waiting import wait_for
from tests.support.workers import WorkerFactory

SECRET = "s3cr3t-pw"


def _celery(redis_url: str, prefix: str, *args: str) -> Any:
    return singleton_cli(SINGLETON_APP, app_env(redis_url, prefix), *args)


def _with_secret(redis_url: str) -> str:
    """The test Redis's URL with a password in it (a server without one ignores it)."""
    scheme, rest = redis_url.split("://", 1)
    assert "@" not in rest, "the test Redis already has credentials"
    return f"{scheme}://:{SECRET}@{rest}"


def _by_key(key: str, seconds: float = 0.0) -> None:
    """Keyed as t.join and t.publish_hold are: on ``key`` only."""


def _key(prefix: str, task: str, key: str) -> str:
    return derive_keys(f"{prefix}lock:", task, _by_key, (key,), {}, ("key",)).lock


def _listed_and_counted(
    redis_client: redis.Redis,
    redis_url: str,
    key_prefix: str,
    queued: tuple[str, str],
    joined: tuple[str, str],
) -> None:
    """``list`` (JSON and table) and ``stats`` show the ``(marker, its call)`` and the joiner
    beside ``(lock, its holder)``, a running lock and a window."""
    marker, call = queued
    join_lock, holder = joined
    listed = _celery(redis_url, key_prefix, "list", "--json")
    assert listed.returncode == 0, listed.stderr
    found = {item["key"]: item for item in json.loads(listed.stdout)}
    locks = [item for item in found.values() if item["kind"] == "lock"]
    assert {item["state"] for item in locks} == {"running", "window"}
    assert all("owner" in item and "renewed_s" in item for item in locks)  # as before
    assert found[marker]["kind"] == "queued"
    assert found[marker]["owner"] is None  # a lock's fields, null: a script reading them works
    assert found[marker]["call"] == call
    assert 0 < found[marker]["ttl_s"] <= 300
    joiners = found[joiners_key(join_lock)]
    assert (joiners["kind"], joiners["call"], joiners["joiners"]) == ("joiners", holder, 1)
    assert joiners["ttl_s"] > 0

    table = _celery(redis_url, key_prefix, "list").stdout.splitlines()
    header = table[0].split("\t")
    rows = {line.split("\t")[-1]: line.split("\t") for line in table[1:]}
    state, ttl, queue = header.index("STATE"), header.index("TTL"), header.index("QUEUE")
    assert rows[marker][state] == "queued"
    assert rows[marker][ttl].endswith("s")
    assert rows[joiners_key(join_lock)][queue] == "1 joined"

    totals = json.loads(_celery(redis_url, key_prefix, "stats", "--json").stdout)
    assert (totals["locks"], totals["running"], totals["windows"]) == (2, 1, 1)
    assert (totals["queued"], totals["joined_keys"], totals["joiners"]) == (1, 1, 1)
    assert 0 < totals["longest_queued_s"] <= 300
    assert 0 < totals["longest_window_s"] <= 60
    running = [i for i in iter_locks(redis_client, f"{key_prefix}lock:") if i.ended_ms is None]
    assert totals["longest_since_renewal_s"] <= max(i.lease_s or 0 for i in running)


@pytest.mark.slow(seconds=10)
def test_a_worker_s_window_joiners_and_a_stuck_marker_are_listed_counted_and_cleared(
    worker_factory: WorkerFactory,
    client_app: Celery,
    redis_client: redis.Redis,
    redis_url: str,
    key_prefix: str,
) -> None:
    """A finished run's at-least window counts as a window, not as the stalest renewal; a
    duplicate joined to a running holder and a publish-time marker whose message no worker
    takes are listed with their ttl and counted; the marker is shown and deleted, after which
    ``delay()`` publishes again."""
    worker = worker_factory.start(
        SINGLETON_APP, concurrency=3, env={"SINGLETON_TEST_AT_LEAST": "60"}
    )
    worker.wait_ready(client_app)
    lock_prefix = f"{key_prefix}lock:"
    app, publish_hold = publish_client_app(redis_url, key_prefix)
    name = uuid.uuid4().hex[:8]
    window = client_app.send_task("t.window_skip", kwargs={"key": f"w-{name}"})
    window.get(timeout=30)  # its lock stays 60 s from its start, unrenewed
    holder = client_app.send_task("t.join", args=(f"j-{name}", -1))
    join_lock = _key(key_prefix, "t.join", f"j-{name}")
    wait_for(lambda: redis_client.exists(join_lock), 30, "the holder's lock", worker)
    joined = client_app.send_task("t.join", args=(f"j-{name}", 0))
    wait_for(lambda: redis_client.hlen(joiners_key(join_lock)), 30, "the duplicate to join", worker)
    # published to a queue no worker reads: the marker blocks delay() until it expires
    stuck = publish_hold.apply_async((f"m-{name}",), queue=f"{key_prefix}nobody")
    marker = queued_key(_key(key_prefix, "t.publish_hold", f"m-{name}"))
    assert redis_client.get(marker) == stuck.id.encode()
    assert publish_hold.delay(f"m-{name}").id == stuck.id  # blocked: nothing published

    _listed_and_counted(
        redis_client, redis_url, key_prefix, (marker, stuck.id), (join_lock, holder.id)
    )
    shown = _celery(redis_url, key_prefix, "show", marker)
    assert shown.returncode == 0, shown.stderr
    as_json = json.loads(_celery(redis_url, key_prefix, "show", marker, "--json").stdout)
    assert (as_json["kind"], as_json["call"], as_json["owner"]) == ("queued", stuck.id, None)
    assert f"the call {stuck.id} was published and has not started" in shown.stdout
    asked = CliRunner().invoke(
        singleton, ["--url", redis_url, "--prefix", lock_prefix, "release", marker], input="n\n"
    )
    assert asked.exit_code == 1
    assert "Delete this marker?" in asked.output
    assert redis_client.get(marker) == stuck.id.encode()
    released = _celery(redis_url, key_prefix, "release", marker, "--yes")
    assert released.returncode == 0, released.stderr
    assert f"singleton: queued marker deleted key={marker}" in released.stderr
    assert redis_client.exists(marker) == 0
    again = publish_hold.delay(f"m-{name}")
    assert again.id != stuck.id  # published: the operator unblocked the key
    close_app(app)
    redis_client.rpush(f"j-{name}:go", 1)
    assert joined.get(timeout=30) is None  # the joined call ends with its holder's value


def test_stats_counts_a_window_apart_from_the_renewed_locks(
    redis_client: redis.Redis, redis_url: str, key_prefix: str
) -> None:
    """A window long unrenewed (by design) does not make "longest since renewal"; it is
    counted as a window, and the running lock's figure stays its own."""
    store = LockStore(redis_client)
    meta = {"task": "t.a", "host": "w1@h", "pid": "1"}
    running = lock_keys(key_prefix, "t.a", b"running")
    store.acquire(running, "run-1", 0, 60_000, meta)
    window = lock_keys(key_prefix, "t.a", b"window")
    store.acquire(window, "run-2", 0, 60_000, meta)
    redis_client.hset(window.lock, ENDED_FIELD, "1")
    redis_client.pexpire(window.lock, 10_000)  # 50 s of its 60 s ttl gone: never renewed
    totals = stats(iter_locks(redis_client, key_prefix))
    assert (totals.locks, totals.running, totals.windows) == (2, 1, 1)
    assert totals.longest_since_renewal_s is not None
    assert totals.longest_since_renewal_s < 50
    assert totals.longest_window_s is not None
    assert 0 < totals.longest_window_s <= 10
    text = CliRunner().invoke(singleton, ["--url", redis_url, "--prefix", key_prefix, "stats"])
    assert "at-least windows:        1" in text.output, text.output


def test_a_pending_follow_up_is_listed_and_counted_with_its_ttl(
    redis_client: redis.Redis, redis_url: str, key_prefix: str
) -> None:
    """A follow-up left beside a lock has a row of its own with its ttl; stats counts it."""
    lock_prefix = f"{key_prefix}lock:"
    keys = coalesce_keys(key_prefix)
    store = LockStore(redis_client)
    for owner in ("run-a", "run-b"):
        store.acquire(keys, owner, 0, 60_000, {"task": COALESCE, "host": "w@h", "pid": "1"})
    call = {"task": COALESCE, "body": "[[], {}]", "ctype": "application/json", "cenc": "utf-8"}
    assert leave_pending(store.run_script, keys, "run-a", "follow-up-p", call).follow_up
    (record,) = [m for m in iter_markers(redis_client, lock_prefix) if m.kind == "pending"]
    assert record.key == pending_key(keys.lock)
    assert (record.pending_follow_up, record.pending_count, record.task) == (
        "follow-up-p",
        1,
        COALESCE,
    )
    assert record.ttl_s is not None
    assert record.ttl_s > 60
    base = ["--url", redis_url, "--prefix", lock_prefix]
    totals = CliRunner().invoke(singleton, [*base, "stats", "--json"])
    assert json.loads(totals.output)["pending"] == 1


def test_a_marker_that_changed_is_left_alone(redis_client: redis.Redis, key_prefix: str) -> None:
    """The delete compares the call shown: a marker that names another call now stays."""
    marker = queued_key(lock_keys(key_prefix, "t.a", b"m").lock)
    redis_client.set(marker, "call-1", px=60_000)
    shown = read_marker(redis_client, marker, key_prefix)
    assert shown is not None
    redis_client.set(marker, "call-2", px=60_000)
    assert release_marker(redis_client, shown) == -1
    assert redis_client.get(marker) == b"call-2"
    redis_client.delete(marker)
    assert release_marker(redis_client, shown) == 0


def test_keys_not_ours_are_refused_and_a_secret_never_printed(
    redis_client: redis.Redis, redis_url: str, key_prefix: str
) -> None:
    """A string beside no lock key of ours, or outside the prefix, is refused (exit 2) and left
    alone; a marker's key holding another type too; the URL's password shows nowhere."""
    lock_prefix = f"{key_prefix}lock:"
    tag = lock_keys(lock_prefix, "t.a", b"x").lock[: -len(":lock")]
    foreign = {
        f"{key_prefix}app:queued": "string",  # outside the prefix
        f"{lock_prefix}{{x}}:queued": "string",  # no digest
        f"{lock_prefix}{tag}:x:queued": "string",  # more after the tag
        f"{lock_prefix}{tag}:pending": "hash",  # listed, but never released by hand
        f"{lock_prefix}{tag}:queued": "hash",  # a marker's name, an application's hash
    }
    for key, kind in foreign.items():
        if kind == "string":
            redis_client.set(key, "alice")
        else:
            redis_client.hset(key, mapping={"name": "alice"})
    mine = queued_key(lock_keys(lock_prefix, "t.a", b"mine").lock)
    redis_client.set(mine, "call-1", px=60_000)
    runner = CliRunner()
    base = ["--url", _with_secret(redis_url), "--prefix", lock_prefix]
    for key in foreign:
        for args in (["show", key], ["release", key, "--yes"]):
            out = runner.invoke(singleton, [*base, *args])
            assert out.exit_code == 2, (key, out.output)
            assert "alice" not in out.output
            assert SECRET not in out.output
    assert redis_client.get(f"{key_prefix}app:queued") == b"alice"
    assert redis_client.get(f"{lock_prefix}{{x}}:queued") == b"alice"
    assert redis_client.hgetall(f"{lock_prefix}{tag}:queued") == {b"name": b"alice"}
    listed = runner.invoke(singleton, [*base, "list", "--json"])
    assert [item["key"] for item in json.loads(listed.output)] == [mine]
    for args in (["list"], ["stats"], ["stats", "--json"], ["show", mine], ["release", mine, "-y"]):
        out = runner.invoke(singleton, [*base, *args])
        assert out.exit_code == 0, out.output
        assert SECRET not in out.output
    assert redis_client.exists(mine) == 0
