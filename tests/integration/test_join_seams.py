"""``singleton_on_duplicate="join"`` where it meets another feature, on real workers: a joined
call revoked while it waits (its watch copy discarded by the worker, or its holder ending
first), a joined call of a debounced task whose watch copy meets a newer burst, and a broker
that hands each watch copy out again (a short ``visibility_timeout``). Every call ends once:
one state, its links called at most once; one run at a time per key.

Two workers, each shared by the module's tests: a prefork one for the first three, and one
whose broker restores every message left unacknowledged for 1 s (its own prefix: a sweep
restores every queue's messages under the prefix). The completion's reading of each joiner's
state is also checked in this process, with no worker.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from typing import Any

import celery
import pytest
import redis
from celery import Celery, states
from celery.app.task import Context
from packaging.version import Version

from celery_singleton_lock import SingletonTask
from celery_singleton_lock.core.completion import done_key
from celery_singleton_lock.core.joiners import Joiner, joiners_key
from celery_singleton_lock.core.keys import derive_keys
from celery_singleton_lock.duplicates.join_completion import complete_joiners, record_of
from tests.support.bed import Bed, new_key
from tests.support.prefixes import private_prefix
from tests.support.waiting import wait_for

#: the lock ttl and the broker's visibility timeout of the redelivering worker
_TTL_S, _VISIBILITY_S = 2, 1


def _signature(key: str, seconds: float = 0.0, value: Any = None) -> None:
    """Same parameters as t.join and its kin."""


def join_lock(bed: Bed, task: str, key: str) -> str:
    """The lock key of ``task(key, ...)``."""
    return derive_keys(f"{bed.prefix}lock:", task, _signature, (key,), {}, ("key",)).lock


def links(bed: Bed, tag: str) -> list[str]:
    """What the links tagged ``tag`` (t.join_next) were given, in order."""
    raw = bed.client.lrange(f"{bed.prefix}join:next", 0, -1)
    return [v.decode().partition(":")[2] for v in raw if v.decode().startswith(f"{tag}:")]


def count(bed: Bed, pattern: str) -> int:
    """How many times ``pattern`` is in the worker's log."""
    return len(re.findall(pattern, bed.worker.log_text()))


def log_of(bed: Bed, pattern: str) -> str:
    """Wait for ``pattern`` in the worker's log; the line it is in."""
    match = bed.worker.wait_for_log(pattern)
    text = match.string
    start = text.rfind("\n", 0, match.start()) + 1
    end = text.find("\n", match.end())
    return text[start : end if end >= 0 else len(text)]


def _bed(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, name: str, **env: str
) -> Iterator[Bed]:
    """A worker of singleton_app on a prefix and a queue of its own."""
    queue = f"join-seams-{uuid.uuid4().hex[:6]}"
    with (
        private_prefix(redis_url) as prefix,
        Bed(redis_url, prefix, tmp_path_factory.mktemp(name), queue=queue, env=env) as made,
    ):
        made.start(concurrency=3)
        yield made


@pytest.fixture(scope="module")
def bed(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[Bed]:
    yield from _bed(tmp_path_factory, redis_url, "join-seams")


@pytest.fixture(scope="module")
def redelivering(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[Bed]:
    yield from _bed(
        tmp_path_factory,
        redis_url,
        "join-seams-redelivering",
        SINGLETON_TEST_VISIBILITY=str(_VISIBILITY_S),
        SINGLETON_TEST_TTL=str(_TTL_S),
    )


def _end_of(bed: Bed, task: str, task_id: str) -> str:
    """The line a holder's end logs for a joiner it took: completed, or found ended."""
    return log_of(
        bed,
        rf"singleton: joined duplicate (?:completed|already ended, not completed): "
        rf"{re.escape(task)}\[{task_id}\]",
    )


@pytest.mark.slow(seconds=2)
def test_a_joined_call_revoked_while_it_waits_stays_revoked_without_its_link(bed: Bed) -> None:
    """``revoke(dup.id)`` once it joined: its watch copy, when due, is discarded by the worker
    (REVOKED), which withdraws its record. The holder's end does not complete it: its link is
    not called. (A holder that ends first finds it REVOKED: the next test.)"""
    key = new_key()
    join = bed.app.signature("t.join")
    holder = join.clone((key, -1, "v")).apply_async()
    bed.wait_started(key)
    dup = join.clone((key, 0, "not run")).apply_async(
        link=bed.app.signature("t.join_next", kwargs={"tag": key})
    )
    bed.worker.wait_for_log(rf"singleton: duplicate joined: t\.join\[{dup.id}\]")
    bed.app.control.revoke(dup.id)
    bed.worker.wait_for_log(rf"Discarding revoked task: t\.join\[{dup.id}\]")
    wait_for(lambda: dup.state == "REVOKED", 10, "the joined call REVOKED", bed.worker)
    joiners = joiners_key(join_lock(bed, "t.join", key))
    wait_for(  # the worker that discarded it withdrew its record (task_revoked)
        lambda: not bed.client.hexists(joiners, dup.id), 10, "its record withdrawn", bed.worker
    )
    bed.client.rpush(f"{key}:go", 1)

    assert holder.get(timeout=20) == "v"
    assert dup.state == "REVOKED"
    assert links(bed, key) == []
    assert len(bed.runs(key)) == 1
    assert not bed.client.exists(joiners_key(join_lock(bed, "t.join", key)))


@pytest.mark.skipif(
    Version(celery.__version__) < Version("5.6.2"),
    reason="Celery before 5.6.2 does not mark a revoked waiting call REVOKED at once",
)
def test_a_joined_call_revoked_before_its_holder_ends_stays_revoked_without_its_link(
    bed: Bed,
) -> None:
    """The same, the holder ending before the watch copy is due (30 s: ``t.join_long_ttl``):
    Celery's revoke marked the waiting call REVOKED at once, and the holder's end leaves it
    so."""
    key = new_key()
    join = bed.app.signature("t.join_long_ttl")
    holder = join.clone((key, -1, "v")).apply_async()
    bed.wait_started(key)
    dup = join.clone((key, 0, "not run")).apply_async(
        link=bed.app.signature("t.join_next", kwargs={"tag": key})
    )
    bed.worker.wait_for_log(rf"singleton: duplicate joined: t\.join_long_ttl\[{dup.id}\]")
    bed.app.control.revoke(dup.id)
    wait_for(lambda: dup.state == "REVOKED", 10, "the joined call REVOKED", bed.worker)
    bed.client.rpush(f"{key}:go", 1)

    assert holder.get(timeout=20) == "v"
    line = _end_of(bed, "t.join_long_ttl", dup.id)
    assert re.search(r"already ended, not completed: .* state=REVOKED", line), line
    assert dup.state == "REVOKED"
    assert links(bed, key) == []
    assert not bed.client.exists(joiners_key(join_lock(bed, "t.join_long_ttl", key)))


@pytest.mark.slow(seconds=5)
def test_a_joined_call_of_a_debounced_task_ends_once_with_its_holders_value(bed: Bed) -> None:
    """``singleton_debounce=1`` and ``"join"``: B joins the run R of the key; C, a call of a
    new burst, comes before B's watch copy. The watch copy is not debounced again (B's burst
    ran: B joined): it joins R again. R's end completes B and C with its value, each link
    once; B is never superseded."""
    key = new_key()
    task = bed.app.signature("t.join_debounce")
    holder = task.clone((key, -1, "r")).apply_async()
    bed.wait_started(key)
    link = bed.app.signature("t.join_next", kwargs={"tag": key})
    b = task.clone((key, 0, "b")).apply_async(link=link)
    joined_b = rf"singleton: duplicate joined: t\.join_debounce\[{b.id}\]"
    bed.worker.wait_for_log(joined_b)
    c = task.clone((key, 0, "c")).apply_async(link=link)
    bed.worker.wait_for_log(rf"singleton: debounced, runs in .*: t\.join_debounce\[{c.id}\]")
    superseded_b = rf"singleton: debounced call superseded: t\.join_debounce\[{b.id}\]"
    wait_for(
        lambda: count(bed, joined_b) >= 2 or count(bed, superseded_b),
        20,
        "B's watch copy",
        bed.worker,
    )
    bed.worker.wait_for_log(rf"singleton: duplicate joined: t\.join_debounce\[{c.id}\]")
    bed.client.rpush(f"{key}:go", 1)

    assert holder.get(timeout=20) == "r"
    assert c.get(timeout=20) == "r"
    for call in (b, c):
        assert "completed" in _end_of(bed, "t.join_debounce", call.id)
    assert b.get(timeout=5) == "r", b.result
    assert count(bed, superseded_b) == 0
    wait_for(lambda: len(links(bed, key)) >= 2, 10, "the links", bed.worker)
    assert links(bed, key) == ["'r'", "'r'"]
    assert count(bed, rf"joined duplicate completed: t\.join_debounce\[{b.id}\]") == 1
    assert len(bed.runs(key)) == 1
    assert not bed.client.exists(joiners_key(join_lock(bed, "t.join_debounce", key)))


@pytest.mark.slow(seconds=8)
def test_a_joiner_keeps_one_live_watch_copy_when_the_broker_hands_copies_out_again(
    redelivering: Bed,
) -> None:
    """The broker restores each watch copy (a countdown message the worker holds unacked)
    every second: the copy that is not the joiner's live one is dropped, so the joined call
    joins again once per watch copy due (about one per ttl), never once per restored copy, and
    ends once."""
    bed, holding_s = redelivering, 6.0
    key = new_key()
    join = bed.app.signature("t.join")
    holder = join.clone((key, holding_s, "v")).apply_async()
    bed.wait_started(key)
    dup = join.clone((key, 0, "not run")).apply_async(
        link=bed.app.signature("t.join_next", kwargs={"tag": key})
    )
    assert holder.get(timeout=30) == "v"
    assert dup.get(timeout=20) == "v"
    joins = count(bed, rf"singleton: duplicate joined: t\.join\[{dup.id}\]")
    stale = count(bed, rf"singleton: stale watch copy dropped: t\.join\[{dup.id}\]")
    # a watch copy is due 0.5 s past the lock's expiry, renewed at a third of the ttl left
    most = int(holding_s / (_TTL_S * 2 / 3 + 0.5)) + 2
    assert joins <= most, (joins, stale, bed.worker.log_tail(80))
    assert stale >= 1, "no watch copy was handed out again"
    wait_for(lambda: links(bed, key), 10, "the link", bed.worker)
    assert links(bed, key) == ["'v'"]
    assert count(bed, rf"joined duplicate completed: t\.join\[{dup.id}\]") == 1
    bed.assert_no_overlap(allow_unfinished=True)
    assert len(bed.runs(key)) == 1
    assert not bed.client.exists(joiners_key(join_lock(bed, "t.join", key)))


def test_a_runs_end_leaves_a_joiner_that_already_ended_and_records_it_completed(
    redis_url: str, redis_client: redis.Redis, key_prefix: str
) -> None:
    """In this process (eager links, an in-memory result backend): of three joiners a run's end
    took, one revoked and one whose result was stored meanwhile are left as they are, their
    links not called; the one still waiting is completed. All three are recorded as completed
    (their watch copies are dropped)."""
    app = Celery("seams", broker="memory://", backend="cache+memory://", set_as_current=False)
    app.conf.update(task_always_eager=True, task_store_eager_result=True)
    app.conf.singleton_redis_url = redis_url
    app.conf.singleton_key_prefix = f"{key_prefix}lock:"
    linked: list[tuple[str, Any]] = []

    @app.task(bind=True, base=SingletonTask, name="s.join", singleton_on_duplicate="join")
    def joined(self: Any, key: str) -> None:
        """Never runs here."""

    @app.task(name="s.link")
    def link(value: Any, tag: str) -> None:
        linked.append((tag, value))

    try:
        ids = {tag: f"{tag}-{uuid.uuid4().hex[:6]}" for tag in ("revoked", "stored", "waiting")}
        joiners = [
            Joiner(task_id, "the-holder", record_of(joined, _request(task_id, link.s(tag=tag))))
            for tag, task_id in ids.items()
        ]
        app.backend.mark_as_revoked(ids["revoked"], reason="revoked")
        app.backend.mark_as_done(ids["stored"], "its own")
        lock = joined.singleton_keys(("k",), {}).lock
        ended = complete_joiners(
            joined, lock, "the-holder", joiners, states.SUCCESS, 42, send_events=None
        )
        assert ended == 1
        assert app.backend.get_state(ids["revoked"]) == states.REVOKED
        assert app.backend.get_result(ids["stored"]) == "its own"
        assert app.backend.get_result(ids["waiting"]) == 42
        assert linked == [("waiting", 42)]
        assert all(redis_client.exists(done_key(lock, task_id)) for task_id in ids.values())
    finally:
        app.close()


def _request(task_id: str, link: Any) -> Context:
    return Context(
        id=task_id, task="s.join", args=["k"], kwargs={}, callbacks=[dict(link)], retries=0
    )
