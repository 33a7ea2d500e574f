"""Run claims against real Redis: one claimer per run, confirm, give up, expiry."""

from __future__ import annotations

import pytest
import redis

from celery_singleton_lock.claims import Claim, RunClaims
from celery_singleton_lock.keys import run_claim_key


def test_first_claim_wins(redis_client: redis.Redis, key_prefix: str) -> None:
    """The first instance wins; the second sees the pending claim and its holder."""
    key = run_claim_key(key_prefix, "every-second", "1795320000000")
    a, b = RunClaims(redis_client, "beat-a"), RunClaims(redis_client, "beat-b")
    assert a.claim(key, 5000) == Claim(won=True, holder="beat-a")
    lost = b.claim(key, 5000)
    assert not lost.won
    assert lost.holder == "beat-a"
    assert not lost.published
    assert 0 < lost.pttl_ms <= 5000


def test_confirm_keeps_the_claim(redis_client: redis.Redis, key_prefix: str) -> None:
    """A confirmed claim says published, names the task, and lives keep_ms."""
    key = run_claim_key(key_prefix, "every-second", "1")
    a, b = RunClaims(redis_client, "beat-a"), RunClaims(redis_client, "beat-b")
    a.claim(key, 5000)
    assert a.confirm(key, "task-1", 60_000)
    assert redis_client.get(key) == b"done beat-a task-1"
    assert redis_client.pttl(key) > 5000
    seen = b.claim(key, 5000)
    assert seen.published
    assert seen.holder == "beat-a"


def test_only_the_claimer_confirms_or_unclaims(redis_client: redis.Redis, key_prefix: str) -> None:
    """Another instance can neither confirm nor give up someone else's claim."""
    key = run_claim_key(key_prefix, "e", "1")
    a, b = RunClaims(redis_client, "beat-a"), RunClaims(redis_client, "beat-b")
    a.claim(key, 5000)
    assert not b.confirm(key, "task-x", 60_000)
    assert not b.unclaim(key)
    assert redis_client.get(key) == b"pending beat-a"
    assert a.unclaim(key)
    assert b.claim(key, 5000).won


def test_expired_pending_claim_can_be_taken(redis_client: redis.Redis, key_prefix: str) -> None:
    """A claimer that died before confirming loses the run once the lease runs out."""
    key = run_claim_key(key_prefix, "e", "1")
    a, b = RunClaims(redis_client, "beat-a"), RunClaims(redis_client, "beat-b")
    a.claim(key, 30)
    redis_client.pexpire(key, 1)
    while redis_client.exists(key):
        pass
    assert b.claim(key, 5000).won
    assert not a.confirm(key, "late", 60_000)  # the dead claimer cannot confirm any more


def test_runs_of_one_entry_share_a_slot(key_prefix: str) -> None:
    """Every run key of one entry carries the same hash tag."""
    tags = {run_claim_key(key_prefix, "nightly report", str(n)).split("}")[0] for n in range(5)}
    assert len(tags) == 1
    assert "*" not in run_claim_key(key_prefix, "weird*name?[x]", "1")


def test_claimer_id_is_checked(redis_client: redis.Redis) -> None:
    """A claimer id with a space would break the claim's value format."""
    with pytest.raises(ValueError, match="claimer"):
        RunClaims(redis_client, "beat a")
