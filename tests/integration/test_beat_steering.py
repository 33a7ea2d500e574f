"""Steering (beat/steering.py, beat/steered.py) on a real Redis, with schedulers in this process.

What the operator's verbs write and what the beats do with it: asks taken once across
instances, a paused entry's asked run, dead asks, an entry not in the schedule, leader mode,
a Redis that does not answer. Real beats and the real CLI go through it in test_beat_verbs.py.
"""

from __future__ import annotations

import logging

import pytest
import redis

from celery_singleton_lock.beat.claims import RUN_HEADER
from celery_singleton_lock.beat.steered import POLL_S
from celery_singleton_lock.beat.steering import Ask, Steering
from celery_singleton_lock.core.keys import beat_group_key
from celery_singleton_lock.errors import LockUnavailableError
from tests.support.cli import singleton_cli
from tests.support.recording_schedulers import (
    INTERVAL,
    Guarded,
    Monotonic,
    make_beat_app,
    two_instances,
)
from tests.support.servers import RedisServer

NOW = 1_790_000_000.0  # a whole 10 s slot
GROUP = "mixin-test"  # make_beat_app's main name
APP = "tests.support.catch_up_app"


def steering(client: redis.Redis, key_prefix: str) -> Steering:
    return Steering([client], f"{key_prefix}lock:", GROUP)


def asked_labels(*schedulers: Guarded) -> list[str]:
    return [
        s["headers"][RUN_HEADER]
        for scheduler in schedulers
        for s in scheduler.sent
        if "@ask-" in s["headers"].get(RUN_HEADER, "")
    ]


def tick_all(monotonic: Monotonic, *schedulers: Guarded) -> None:
    """One tick of each, a poll period apart from the last."""
    monotonic.now += POLL_S
    for scheduler in schedulers:
        scheduler.tick()


def driven_pair(pair: tuple[Guarded, Guarded]) -> Monotonic:
    monotonic = Monotonic()
    for scheduler in pair:
        scheduler.singleton_monotonic = monotonic
    return monotonic


# -- the keys ------------------------------------------------------------------------------------


def test_an_ask_is_the_live_one_until_its_end_then_a_new_one(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    steer = steering(redis_client, key_prefix)
    first = steer.ask(INTERVAL, "ann@host", 1000, 5000)
    assert steer.ask(INTERVAL, "bob@host", 2000, 5000) == first  # live: Bob's is Ann's run
    assert steer.asks() == [first]
    later = steer.ask(INTERVAL, "bob@host", 6001, 5000)  # Ann's ended
    assert (later.by, later.until_ms) == ("bob@host", 11001)
    assert not steer.forget(first)  # Bob's took its place: left alone
    assert steer.forget(later)
    assert steer.asks() == []


def test_a_pause_keeps_who_paused_first_and_a_resume_says_whether_there_was_one(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    steer = steering(redis_client, key_prefix)
    assert steer.pause(INTERVAL, "ann@host", 1000) == "ann@host 1000"
    assert steer.pause(INTERVAL, "bob@host", 2000) == "ann@host 1000"
    assert steer.pauses([INTERVAL, "other"]) == ["ann@host 1000", None]
    assert steer.resume(INTERVAL)
    assert not steer.resume(INTERVAL)


def test_asks_of_another_shape_are_ignored(redis_client: redis.Redis, key_prefix: str) -> None:
    """A field written by something else under the asks key is not an ask (never claimed)."""
    steer = steering(redis_client, key_prefix)
    redis_client.hset(steer.asks_key, mapping={"x": "garbage", "y": "a b c d"})
    assert steer.asks() == []
    assert Ask.parse("e", "id by 1 2") == Ask("e", "id", "by", 1, 2)


def test_the_beats_seen_more_than_an_hour_ago_are_dropped(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    steer = steering(redis_client, key_prefix)
    steer.heartbeat("old", 1_000)
    steer.heartbeat("new", 1_000 + 3600 * 1000 + 1)
    assert steer.beats() == {"new": 1_000 + 3600 * 1000 + 1}
    steer.gone("new")
    assert steer.beats() == {}


# -- the beats -----------------------------------------------------------------------------------


def test_an_asked_run_goes_out_once_across_instances_also_when_paused(
    redis_client: redis.Redis,
    redis_url: str,
    key_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two instances; the entry paused: its scheduled run is passed over, the asked run goes
    out from one instance, once, labelled ``<entry>@ask-<id>``, with the entry's arguments;
    the instances registered the schedule and themselves."""
    app = make_beat_app(redis_url, key_prefix)
    steer = steering(redis_client, key_prefix)
    with two_instances(app, monkeypatch, NOW) as pair:
        monotonic = driven_pair(pair)
        tick_all(monotonic, *pair)
        assert set(steer.registered()) == set(app.conf.beat_schedule)
        assert len(steer.beats()) == 2
        steer.pause(INTERVAL, "ann@host", int(NOW * 1000))
        ask = steer.ask(INTERVAL, "ann@host", int(NOW * 1000), 10_000)
        for _ in range(3):
            tick_all(monotonic, *pair)
        assert asked_labels(*pair) == [f"{INTERVAL}@{ask.run}"]
        sent = next(s for p in pair for s in p.sent if s["headers"][RUN_HEADER].endswith(ask.run))
        assert list(sent["args"]) == [1]
        assert steer.claim_of(ask) is not None
        assert steer.claim_of(ask).startswith("done ")  # type: ignore[union-attr]


def test_an_ask_for_an_entry_not_in_the_schedule_or_dead_is_not_taken(
    redis_client: redis.Redis,
    redis_url: str,
    key_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An ask for an entry this beat does not run stays for the beats that do; one past its
    end (and the skew) is forgotten, never claimed."""
    app = make_beat_app(redis_url, key_prefix)
    steer = steering(redis_client, key_prefix)
    with two_instances(app, monkeypatch, NOW) as pair:
        monotonic = driven_pair(pair)
        foreign = steer.ask("not-here", "ann@host", int(NOW * 1000), 10_000)
        dead = steer.ask(INTERVAL, "ann@host", int(NOW * 1000) - 60_000, 10_000)
        tick_all(monotonic, *pair)
        assert asked_labels(*pair) == []
        assert steer.asks() == [foreign]
        assert steer.claim_of(dead) is None


def test_in_leader_mode_only_the_leader_takes_an_ask(
    redis_client: redis.Redis,
    redis_url: str,
    key_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    app = make_beat_app(redis_url, key_prefix, mode="leader")
    steer = steering(redis_client, key_prefix)
    with two_instances(app, monkeypatch, NOW) as pair:
        monotonic = driven_pair(pair)
        tick_all(monotonic, *pair)
        leader = [s for s in pair if s._singleton is not None and s._singleton.leading]
        assert len(leader) == 1
        ask = steer.ask(INTERVAL, "ann@host", int(NOW * 1000), 10_000)
        for _ in range(3):
            tick_all(monotonic, *pair)
        assert asked_labels(*leader) == [f"{INTERVAL}@{ask.run}"]
        assert asked_labels(*pair) == asked_labels(*leader)
        assert len(steer.beats()) == 1  # the standby publishes nothing, looks for nothing


def test_a_beat_whose_redis_does_not_answer_logs_the_outage_once_and_takes_no_ask(
    key_prefix: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with RedisServer() as server:
        app = make_beat_app(server.url, key_prefix)
        with two_instances(app, monkeypatch, NOW) as pair:
            monotonic = driven_pair(pair)
            one = pair[0]
            tick_all(monotonic, one)
            server.stop()
            with caplog.at_level(logging.ERROR):
                for _ in range(3):
                    tick_all(monotonic, one)
            outages = [r for r in caplog.records if "redis unreachable" in r.getMessage()]
            assert len(outages) == 1, caplog.text
            assert asked_labels(one) == []


# -- the CLI -------------------------------------------------------------------------------------


@pytest.mark.slow(seconds=5)
def test_the_cli_fails_clearly_without_showing_the_password(key_prefix: str) -> None:
    """A Redis that does not answer: exit code 1, the URL shown without its password."""
    with RedisServer() as server:
        port = server.port
    url = f"redis://:s3cret-verbs@127.0.0.1:{port}/0"
    for args in (["status"], ["pause", "e"], ["run", "e"]):
        done = singleton_cli(
            APP, {"SINGLETON_TEST_PREFIX": key_prefix}, "--url", url, "beat", *args
        )
        assert done.returncode == 1, done
        assert f"redis://:***@127.0.0.1:{port}/0" in done.stderr, done.stderr
        assert "s3cret" not in done.stdout + done.stderr


def test_steering_on_a_server_that_does_not_answer_raises(key_prefix: str) -> None:
    with RedisServer() as server:
        client = redis.Redis.from_url(server.url, socket_connect_timeout=1)
    steer = Steering([client], key_prefix, GROUP)
    with pytest.raises(LockUnavailableError, match="could not read the schedule"):
        steer.registered()
    assert beat_group_key(key_prefix, GROUP, "asks") == steer.asks_key
