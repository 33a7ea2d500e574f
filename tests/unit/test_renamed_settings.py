"""Settings renamed before the first release (docs/migrating.md, "Renamed settings").

Each new spelling works; the old one is read as the new for one release, with a
DeprecationWarning that names the new one; both given is one SingletonConfigError line.

- beat's app-wide ``singleton_lock_at_least`` is ``singleton_beat_lock_at_least`` (the task
  option ``singleton_lock_at_least`` keeps its name and meaning).
"""

from __future__ import annotations

import logging
from datetime import datetime, timezone
from typing import Any

import pytest
from celery import Celery
from celery.beat import Scheduler
from celery.schedules import schedule

from celery_singleton_lock import SingletonConfigError
from celery_singleton_lock.beat.runs import run_at
from celery_singleton_lock.beat.scheduler import SingletonSchedulerMixin
from celery_singleton_lock.settings.options import read_beat_options, read_options

# -- singleton_beat_lock_at_least (app-wide singleton_lock_at_least) --------------------------

OLD_BEAT, NEW_BEAT = "singleton_lock_at_least", "singleton_beat_lock_at_least"


def test_beat_lock_at_least_keeps_each_claim_that_long() -> None:
    opts = read_beat_options({NEW_BEAT: 3600})
    assert opts.lock_at_least == 3600
    nominal = datetime(2030, 1, 1, tzinfo=timezone.utc)
    run = run_at("every-10s", schedule(10), opts, nominal)
    assert run.keep_ms == 3_600_000  # more than 2 periods + 2 x skew + 60 s
    assert run_at("every-10s", schedule(10), read_beat_options({}), nominal).keep_ms == 82_000


def test_beat_reads_the_app_wide_lock_at_least_as_its_old_spelling() -> None:
    with pytest.warns(DeprecationWarning, match=rf"{OLD_BEAT} .*deprecated, use {NEW_BEAT}=600"):
        assert read_beat_options({OLD_BEAT: 600}).lock_at_least == 600


def test_the_old_beat_spelling_is_checked_by_its_own_name() -> None:
    """A bad value is refused naming what was given, before any warning."""
    with pytest.raises(SingletonConfigError, match=rf"^{OLD_BEAT} must be .*got -1$"):
        read_beat_options({OLD_BEAT: -1})


def test_both_beat_spellings_are_refused_in_one_line() -> None:
    with pytest.raises(SingletonConfigError, match=f"{OLD_BEAT} and {NEW_BEAT} are both set") as e:
        read_beat_options({OLD_BEAT: 600, NEW_BEAT: 600})
    assert "\n" not in str(e.value)


def test_beat_lock_at_least_is_no_task_setting() -> None:
    """singleton_beat_lock_at_least never gives a task a window, nor does the old spelling."""
    task = type("T", (), {"name": "t.x"})()
    assert read_options({NEW_BEAT: 600}, task).lock_at_least == 0
    assert read_options({OLD_BEAT: 600}, task).lock_at_least == 0


class _Memory(SingletonSchedulerMixin, Scheduler):  # type: ignore[misc]
    """The mixin in front of a scheduler that keeps nothing and connects to nothing here."""

    def setup_schedule(self) -> None:
        self.data: dict[str, Any] = {}

    def sync(self) -> None:
        """Nothing to persist."""


def _beat_app(**conf: Any) -> Celery:
    app = Celery("renamed-beat", broker="memory://", set_as_current=False)
    app.conf.update(singleton_redis_url="redis://127.0.0.1:1/0", **conf)
    return app


def test_beat_logs_the_old_spelling_once_at_start(caplog: pytest.LogCaptureFixture) -> None:
    """Python hides DeprecationWarnings in beat: the scheduler logs each one, once."""
    app = _beat_app(singleton_lock_at_least=600)
    try:
        scheduler = _Memory(app=app, max_interval=1)
        with caplog.at_level(logging.WARNING, logger="celery_singleton_lock.beat.scheduler"):
            assert "singleton -> mode=active" in scheduler.info
            assert scheduler.singleton_options.lock_at_least == 600
        shown = [r.getMessage() for r in caplog.records if "deprecated" in r.getMessage()]
        assert shown == [
            f"beat: deprecated setting: app settings: {OLD_BEAT} (beat's claims) is deprecated, "
            f"use {NEW_BEAT}=600"
        ]
    finally:
        app.close()


def test_beat_with_both_spellings_stops_at_its_banner() -> None:
    app = _beat_app(singleton_lock_at_least=600, singleton_beat_lock_at_least=600)
    try:
        scheduler = _Memory(app=app, max_interval=1)
        with pytest.raises(SystemExit, match=f"invalid setting: .*{OLD_BEAT} and {NEW_BEAT}"):
            scheduler.info  # noqa: B018 - the banner reads the settings
    finally:
        app.close()
