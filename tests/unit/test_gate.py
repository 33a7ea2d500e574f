"""The gate's decision (duplicates/gate.py ``decide``), asked directly: no worker, no Redis.

For every outcome an acquire can give (taken, held by another run, by the call's own earlier
delivery, by its parent, an at-least window, the rate spent, a completion record, Redis down),
under every policy and for each kind of call (a worker's, a retry's, an eager one, a coalesced
follow-up, a requeued one), the action is the one the docs promise (docs/configuration.md,
"Duplicate policies"; docs/limits.md, "What a call over the rate meets").
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from celery_singleton_lock.core.backend import Acquired, Completed, Contended, RateLimited
from celery_singleton_lock.duplicates.gate import call_of, decide
from celery_singleton_lock.duplicates.policy import Action, Call, Fate, Why, policies
from celery_singleton_lock.errors import LockUnavailableError
from celery_singleton_lock.settings.options import Options, read_options

ME, PARENT, OTHER = "me", "my-parent", "another-run"
HELD = Contended(OTHER, 0, 7, 4_000)
WINDOW = Contended(OTHER, 0, 7, 9_000, finished=True)
RATE = RateLimited(OTHER, 0, None, 2_500, finished=True)
DONE = Completed(ME, 0, None, 60_000)
CALL = Call(ME, PARENT)


def _opts(policy: str, **more: object) -> Options:
    task = SimpleNamespace(name="t.gate", singleton_on_duplicate=policy)
    for name, value in more.items():
        setattr(task, f"singleton_{name}", value)
    return read_options({"singleton_retry_countdown": 5}, task)


def _decide(outcome: object, policy: str, call: Call = CALL, **more: object) -> Action:
    opts = _opts(policy, **more)
    return decide(outcome, call, opts, policies()[policy])  # type: ignore[arg-type]


ALL = ["skip", "retry", "raise", "coalesce", "join", "queue", "cancel"]


@pytest.mark.parametrize("policy", ALL)
def test_what_is_not_the_policys_to_answer_is_the_same_under_every_policy(policy: str) -> None:
    assert _decide(Acquired(token=1, reentered=False), policy).fate is Fate.RUN
    assert _decide(DONE, policy).fate is Fate.DROP
    own = _decide(replace(HELD, holder=ME), policy)
    assert (own.fate, own.why, own.countdown) == (Fate.REQUEUE, Why.REDELIVERED, 4.1)
    parent = _decide(replace(HELD, holder=PARENT), policy)
    assert (parent.fate, parent.why, parent.holder) == (Fate.REQUEUE, Why.PARENT, PARENT)
    in_window = _decide(replace(WINDOW, holder=ME), policy)  # waits for the window's end
    assert (in_window.fate, in_window.countdown) == (Fate.REQUEUE, 9.1)
    retried = _decide(RATE, policy, CALL._replace(retries=2))  # its own retry: never dropped
    assert (retried.fate, retried.why, retried.countdown) == (Fate.REQUEUE, Why.RATE, 2.5)
    assert retried.policy == "retry"


@pytest.mark.parametrize("policy", ALL)
def test_redis_down_is_by_on_redis_error(policy: str) -> None:
    down = LockUnavailableError("down")
    failed = _decide(down, policy)
    assert (failed.fate, failed.why, failed.countdown) == (Fate.REQUEUE, Why.REDIS, 5)
    assert _decide(down, policy, on_redis_error="run").fate is Fate.RUN_UNLOCKED


@pytest.mark.parametrize(
    ("policy", "fate", "eager_fate"),
    [
        ("skip", Fate.SKIP, Fate.SKIP),
        ("retry", Fate.REQUEUE, Fate.RAISE),
        ("raise", Fate.RAISE, Fate.RAISE),
        ("coalesce", Fate.POLICY, Fate.POLICY),
        ("join", Fate.POLICY, Fate.RAISE),
        ("queue", Fate.POLICY, Fate.RAISE),
        ("cancel", Fate.POLICY, Fate.RAISE),
    ],
)
def test_a_duplicate_meets_its_policy(policy: str, fate: Fate, eager_fate: Fate) -> None:
    action = _decide(HELD, policy)
    assert (action.fate, action.why, action.holder, action.policy) == (
        fate,
        Why.DUPLICATE,
        OTHER,
        policy,
    )
    assert _decide(HELD, policy, CALL._replace(eager=True)).fate is eager_fate


def test_retry_waits_out_an_at_least_window() -> None:
    assert _decide(HELD, "retry").countdown == 5
    assert _decide(WINDOW, "retry").countdown == 9.0


def test_a_coalesced_follow_up_is_never_coalesced_again() -> None:
    assert _decide(HELD, "coalesce", CALL._replace(follow_up=True)).fate is Fate.SKIP


@pytest.mark.parametrize(
    ("policy", "fate"),
    [
        ("skip", Fate.SKIP),
        ("retry", Fate.REQUEUE),
        ("raise", Fate.RAISE),
        ("coalesce", Fate.POLICY),
        ("join", Fate.REQUEUE),
    ],
)
def test_a_call_over_the_rate_meets_its_policy_with_the_next_start(policy: str, fate: Fate) -> None:
    action = _decide(RATE, policy, rate_limit="1/s")
    assert (action.fate, action.why, action.countdown) == (fate, Why.RATE, 2.5)
    eager = _decide(RATE, policy, CALL._replace(eager=True), rate_limit="1/s")
    assert eager.fate is (Fate.SKIP if policy == "skip" else Fate.RAISE)


def test_coalesce_never_drops_a_requeued_call_over_the_rate() -> None:
    for call in (CALL._replace(requeued=True), CALL._replace(follow_up=True)):
        action = _decide(RATE, "coalesce", call, rate_limit="1/s")
        assert (action.fate, action.policy) == (Fate.REQUEUE, "retry")


def test_a_call_is_read_off_a_context_or_a_tracer_dict() -> None:
    from celery.app.task import Context

    fields = {
        "id": ME,
        "parent_id": PARENT,
        "retries": 3,
        "singleton_follow_up": True,
        "singleton_waiting_since": [1.0, 3],
    }
    expected = Call(ME, PARENT, 3, False, True, True)
    assert call_of(fields) == expected
    assert call_of(Context(fields)) == expected
    assert call_of(Context(id=ME, is_eager=True)) == Call(ME, None, 0, True)
    stale = {**fields, "singleton_waiting_since": [1.0, 2]}  # a later retry carried it along
    assert call_of(stale).requeued is False


def test_a_workers_call_is_read_off_its_request_dict() -> None:
    """In front of Celery's tracer and in the worker's main process the id and retries are
    read already; the library's headers are fields of the dict itself."""
    from celery_singleton_lock.duplicates.gate import worker_call

    fields = {
        "retries": 3,
        "parent_id": PARENT,
        "singleton_follow_up": True,
        "singleton_waiting_since": [1.0, 3],
    }
    assert worker_call(ME, 3, fields) == Call(ME, PARENT, 3, False, True, True)
    assert worker_call(ME, 0, {"retries": 0}) == Call(ME)
    stale = {"retries": 2, "singleton_waiting_since": [1.0, 0]}  # a later retry carried it
    assert worker_call(ME, 2, stale).requeued is False
