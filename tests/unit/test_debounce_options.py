"""``singleton_debounce`` and ``singleton_debounce_max``: checked like every setting (a worker
refuses to start on them: the start-up check reads every task's options), and the rules
across settings."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest
from celery.app.task import Context

from celery_singleton_lock import SingletonConfigError
from celery_singleton_lock.core.debounce import Verdict
from celery_singleton_lock.core.keys import lock_keys
from celery_singleton_lock.duplicates import debounce as debounce_module
from celery_singleton_lock.duplicates.join import JOINED_HEADER
from celery_singleton_lock.duplicates.skips import skip_info, skip_marker
from celery_singleton_lock.settings.options import read_options


def _task(**options: Any) -> SimpleNamespace:
    return SimpleNamespace(name="t.debounced", **{f"singleton_{k}": v for k, v in options.items()})


def test_off_by_default_and_read_from_the_task_or_the_app() -> None:
    assert read_options({}, _task()).debounce is None
    opts = read_options({}, _task(debounce=2, debounce_max=10))
    assert (opts.debounce, opts.debounce_max) == (2.0, 10.0)
    assert read_options({"singleton_debounce": 1.5}, _task()).debounce == 1.5


@pytest.mark.parametrize("value", [-1, 0, math.inf, math.nan, "2", True])
@pytest.mark.parametrize("name", ["debounce", "debounce_max"])
def test_a_bad_value_is_refused_naming_the_setting_and_the_task(name: str, value: Any) -> None:
    options = {"debounce": 1.0, name: value}
    with pytest.raises(SingletonConfigError, match=rf"singleton_{name} \(task t\.debounced\)"):
        read_options({}, _task(**options))


def test_a_cap_shorter_than_the_window_or_without_one_is_refused() -> None:
    with pytest.raises(SingletonConfigError, match=r"task t\.debounced: singleton_debounce_max"):
        read_options({}, _task(debounce=5, debounce_max=2))
    with pytest.raises(SingletonConfigError, match="needs a singleton_debounce"):
        read_options({}, _task(debounce_max=2))
    assert read_options({}, _task(debounce=2, debounce_max=2)).debounce_max == 2.0


def test_publish_time_dedup_is_refused() -> None:
    """A call not published could not supersede the one before it."""
    with pytest.raises(SingletonConfigError, match="needs singleton_lock_on 'execute'"):
        read_options({}, _task(debounce=1, lock_on="publish"))


def test_a_superseded_calls_marker_names_the_later_call() -> None:
    marker = skip_marker("k", "later", "me", superseded_by="later")
    info = skip_info(marker)
    assert info is not None
    assert (info.holder, info.task_id, info.superseded_by, info.follow_up, info.reason) == (
        "later",
        "me",
        "later",
        None,
        "debounced",
    )
    assert skip_info(skip_marker("k", "h", "me")).superseded_by is None  # type: ignore[union-attr]


@pytest.mark.parametrize("joined", [False, True])
def test_a_joined_calls_watch_copy_is_not_debounced_again(
    monkeypatch: pytest.MonkeyPatch, joined: bool
) -> None:
    """Its call was debounced before it joined a run: a newer burst must not supersede the
    watch copy while that run's end still counts the call (it would end twice). Any other
    message of the task asks the debounce state."""
    asked: list[str] = []

    def ask(run: Any, keys: Any, task_id: str, *args: Any, **kwargs: Any) -> Verdict:
        asked.append(task_id)
        return Verdict("run")

    monkeypatch.setattr(debounce_module, "debounce", ask)
    monkeypatch.setattr(debounce_module, "store_for", lambda url: SimpleNamespace(run_script=None))
    opts = read_options({}, _task(debounce=1, on_duplicate="join"))
    task = SimpleNamespace(name="t.debounced", singleton_options=lambda: opts)
    headers = {JOINED_HEADER: "the-holder"} if joined else {}
    request = Context({"id": "call", "retries": 0, **headers})
    verdict = debounce_module.debounced(task, lock_keys("p:", "t.debounced", b"k"), request)
    assert (verdict, asked) == ((None, []) if joined else (Verdict("run"), ["call"]))
