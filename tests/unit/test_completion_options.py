"""The completion options: ``singleton_completion_ttl`` (its default from the broker and the task's
acks_late) and ``singleton_lock_at_least`` on a task (never the app-wide, beat's, value); what a
run's end leaves behind (``completion.ending_for``)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from celery_singleton_lock import SingletonConfigError
from celery_singleton_lock.core.completion import NO_ENDING, Ending, done_key
from celery_singleton_lock.run.completion import ending_for
from celery_singleton_lock.settings.options import describe, read_beat_options, read_options
from celery_singleton_lock.settings.table import COMPLETION_MARGIN_S, DEFAULT_COMPLETION_TTL_S


def _task(**attributes: Any) -> Any:
    return SimpleNamespace(**{"name": "t.job", "acks_late": False, **attributes})


@pytest.mark.parametrize(
    ("conf", "expected"),
    [
        ({"broker_url": "redis://h:6379/0"}, 3600 + COMPLETION_MARGIN_S),
        ({"broker_url": "rediss://h:6379/0"}, 3600 + COMPLETION_MARGIN_S),
        ({"broker_url": "sentinel://h:26379"}, 3600 + COMPLETION_MARGIN_S),
        ({"broker_url": "sqs://"}, 1800 + COMPLETION_MARGIN_S),
        (
            {"broker_url": "redis://h/0", "broker_transport_options": {"visibility_timeout": 60}},
            60 + COMPLETION_MARGIN_S,
        ),
        ({"broker_url": "amqp://guest@h//"}, DEFAULT_COMPLETION_TTL_S),
        ({}, DEFAULT_COMPLETION_TTL_S),
    ],
)
def test_completion_ttl_default_for_a_task_acked_late(
    conf: dict[str, Any], expected: float
) -> None:
    """A late-acked task keeps its completion for the broker's visibility timeout + a margin
    (Redis, SQS), else a constant."""
    assert read_options(conf, _task(acks_late=True)).completion_ttl == expected


def test_completion_ttl_default_follows_task_acks_late() -> None:
    """A task acked early records nothing by default (its message is acked before the run);
    the app's task_acks_late counts when the task does not say."""
    conf = {"broker_url": "redis://h/0"}
    assert read_options(conf, _task()).completion_ttl == 0
    assert read_options({**conf, "task_acks_late": True}, _task(acks_late=None)).completion_ttl
    assert read_options(conf, _task(acks_late=None)).completion_ttl == 0


def test_completion_ttl_set_on_the_app_or_the_task() -> None:
    """The usual pattern: the task's option, else the app's setting; 0 turns it off."""
    conf = {"broker_url": "redis://h/0", "singleton_completion_ttl": 120}
    assert read_options(conf, _task()).completion_ttl == 120
    task = _task(acks_late=True, singleton_completion_ttl=0)
    assert read_options(conf, task).completion_ttl == 0
    with pytest.raises(SingletonConfigError, match="singleton_completion_ttl"):
        read_options({"singleton_completion_ttl": -1}, _task())


def test_lock_at_least_is_read_from_the_task_only() -> None:
    """An app-wide singleton_lock_at_least (beat's old spelling of
    singleton_beat_lock_at_least) never gives a task a window; the task's own attribute does."""
    conf = {"singleton_lock_at_least": 90}
    assert read_options(conf, _task()).lock_at_least == 0
    assert read_options(conf, _task(singleton_lock_at_least=5)).lock_at_least == 5
    with pytest.warns(DeprecationWarning, match="singleton_beat_lock_at_least"):
        assert read_beat_options(conf).lock_at_least == 90
    beat_conf = {"singleton_beat_lock_at_least": 90}
    assert read_options(beat_conf, _task()).lock_at_least == 0
    assert read_beat_options(beat_conf).lock_at_least == 90
    with pytest.raises(SingletonConfigError, match="singleton_lock_at_least"):
        read_options({}, _task(singleton_lock_at_least=-2))


def test_banner_shows_the_completion_ttl() -> None:
    """describe(): the task-less options show the default a late-acked task gets."""
    shown = describe(read_options({"broker_url": "redis://h/0"}), {"broker_url": "redis://h/0"})
    assert shown["completion_ttl"] == "acks_late tasks: 3900s (visibility_timeout + 300s)"
    shown = describe(read_options({"singleton_completion_ttl": 10}))
    assert shown["completion_ttl"] == "10s"


@pytest.mark.parametrize(
    ("state", "expected"),
    [
        ("SUCCESS", Ending(60_000, 5_000)),
        ("FAILURE", Ending(60_000, 5_000)),
        ("IGNORED", Ending(0, 5_000)),
        ("REJECTED", Ending(0, 5_000)),
    ],
)
def test_ending_for_each_state(state: str, expected: Ending) -> None:
    """A completion only when the message will not run again; the window after every end."""
    assert ending_for(60, 5, state) == expected


def test_ending_for_nothing_to_leave() -> None:
    assert ending_for(None, 0, "SUCCESS") is NO_ENDING
    assert ending_for(60, 0, "IGNORED") is NO_ENDING
    with pytest.raises(ValueError, match=">= 0"):
        Ending(-1, 0)


def test_done_key_shares_the_lock_hash_tag() -> None:
    assert done_key("p:{t.job:ab}:lock", "id-1") == "p:{t.job:ab}:done:id-1"
    assert done_key("p:{t.job:ab}:other", "id-1") == "p:{t.job:ab}:other:done:id-1"


@pytest.mark.parametrize(
    ("task", "conf", "expected"),
    [
        ({}, {}, True),  # acked early: the failure was acked before the run
        ({"acks_late": True}, {}, True),  # Celery's default: a failure is acknowledged
        ({"acks_late": True, "acks_on_failure_or_timeout": False}, {}, False),
        ({"acks_late": True, "acks_on_failure": False}, {}, False),  # Celery 5.7's spelling
        (
            {"acks_late": True, "acks_on_failure": True, "acks_on_failure_or_timeout": False},
            {},
            True,
        ),
        (
            {"acks_late": None},
            {"task_acks_late": True, "task_acks_on_failure_or_timeout": False},
            False,
        ),
        ({"acks_late": False, "acks_on_failure_or_timeout": False}, {}, True),
    ],
)
def test_a_failure_is_final_unless_acked_late_and_not_acknowledged(
    task: dict[str, Any], conf: dict[str, Any], expected: bool
) -> None:
    """A FAILURE the worker rejects instead of acknowledging (acks_late, acks_on_failure False)
    may be delivered again by the broker (SQS, a dead-letter queue): it records no completion."""
    opts = read_options({"broker_url": "sqs://", **conf}, _task(**task))
    assert opts.failure_is_final is expected
    ending = ending_for(opts.completion_ttl, 0, "FAILURE", opts.failure_is_final)
    assert bool(ending.completion_ttl_ms) is (expected and bool(opts.completion_ttl))
    assert ending_for(60, 5, "FAILURE", False) == Ending(0, 5_000)  # the window stays
    assert ending_for(60, 0, "SUCCESS", False) == Ending(60_000, 0)
