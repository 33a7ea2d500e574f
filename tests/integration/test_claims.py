"""Run claims against real Redis: one claimer per run, confirm, give up, expiry."""

from __future__ import annotations

import pytest
import redis

from celery_singleton_lock.beat.claims import Claim, RunClaims, witness_key
from celery_singleton_lock.core.keys import run_claim_key


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


def test_witness_lets_the_first_message_and_its_redeliveries_run(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    """The first message of a run is witnessed; a second task id is named as a duplicate."""
    key = run_claim_key(key_prefix, "e", "1")
    worker = RunClaims(redis_client, "worker-a")
    assert worker.witness(key, "task-1", 60_000) is None
    assert worker.witness(key, "task-1", 60_000) is None  # a redelivery of the same message
    assert worker.witness(key, "task-2", 60_000) == "task-1"
    assert 0 < redis_client.pttl(witness_key(key)) <= 60_000


def test_a_witnessed_run_is_not_claimed_again(redis_client: redis.Redis, key_prefix: str) -> None:
    """A claim left pending by a dead beat, whose run a worker received, reads as done."""
    key = run_claim_key(key_prefix, "e", "1")
    dead, survivor = RunClaims(redis_client, "beat-a"), RunClaims(redis_client, "beat-b")
    assert dead.claim(key, 5000).won
    assert RunClaims(redis_client, "worker").witness(key, "task-1", 60_000) is None
    redis_client.delete(key)  # the dead claimer's publish lease ran out
    seen = survivor.claim(key, 5000, 60_000)
    assert not seen.won
    assert seen.published
    assert redis_client.get(key) == b"done witness task-1"
    assert redis_client.pttl(key) > 5000


def test_peek_reads_claims_without_taking_them(redis_client: redis.Redis, key_prefix: str) -> None:
    """Peek reports unclaimed, pending and done runs, and claims nothing."""
    keys = [run_claim_key(key_prefix, "e", str(n)) for n in range(3)]
    a = RunClaims(redis_client, "beat-a")
    a.claim(keys[1], 5000)
    a.claim(keys[2], 5000)
    a.confirm(keys[2], "task-2", 60_000)
    free, pending, done = RunClaims(redis_client, "beat-b").peek(keys)
    assert free is None
    assert pending is not None
    assert (pending.won, pending.holder, pending.published) == (False, "beat-a", False)
    assert 0 < pending.pttl_ms <= 5000
    assert done is not None
    assert done.published
    assert not redis_client.exists(keys[0])
    assert RunClaims(redis_client, "beat-b").peek([]) == []


def test_a_claim_whose_reply_was_lost_is_still_its_claimers(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    """The claim ran on the server but its reply never came back (a timeout): the same instance
    claims the run again and wins at once, with a fresh lease, instead of waiting out its own
    pending claim as if another instance held it; any other instance still loses."""
    key = run_claim_key(key_prefix, "every-second", "2")
    a, b = RunClaims(redis_client, "beat-a"), RunClaims(redis_client, "beat-b")
    assert a.claim(key, 5000).won  # the reply that "was lost"
    redis_client.pexpire(key, 100)
    assert a.claim(key, 5000) == Claim(won=True, holder="beat-a")
    assert redis_client.pttl(key) > 4000
    assert not b.claim(key, 5000).won
    assert a.confirm(key, "task-1", 60_000)
    assert not a.claim(key, 5000).won  # published once: never again, not even by its claimer
