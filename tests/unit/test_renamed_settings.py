"""Settings renamed before the first release (docs/migrating.md, "Renamed settings").

Each new spelling works; the old one is read as the new for one release, with a
DeprecationWarning that names the new one; both given is one SingletonConfigError line.

- beat's app-wide ``singleton_lock_at_least`` is ``singleton_beat_lock_at_least`` (the task
  option ``singleton_lock_at_least`` keeps its name and meaning).
- ``singleton_permits=None`` given on a task (no limit on runs at once) is
  ``singleton_permits="unlimited"``.
- ``singleton_lock_on="both"`` is ``"publish"`` (they never differed).

The last two are values of one setting, so old and new cannot be given together; a task's
value still overrides the app's, whichever spelling each uses.
"""

from __future__ import annotations

import logging
from datetime import datetime, timezone
from typing import Any

import pytest
from celery import Celery
from celery.beat import Scheduler
from celery.schedules import schedule

from celery_singleton_lock import SingletonConfigError, SingletonTask
from celery_singleton_lock.beat.runs import run_at
from celery_singleton_lock.beat.scheduler import SingletonSchedulerMixin
from celery_singleton_lock.settings.options import read_beat_options, read_options
from celery_singleton_lock.worker.hooks import _check_and_announce, banner_lines
from celery_singleton_lock.worker.scopes import check_scopes

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


# -- singleton_permits="unlimited" (None given on the task) -----------------------------------


def _task(**options: Any) -> Any:
    """A task object as ``@app.task(base=SingletonTask, **options)`` makes one."""
    attrs = {"name": "t.api", "__module__": "app.tasks", **options}
    return type("Made", (SingletonTask,), attrs)()


def test_unlimited_permits_with_a_rate() -> None:
    opts = read_options({}, _task(singleton_permits="unlimited", singleton_rate_limit="5/s"))
    assert (opts.permits, opts.rate_limit) == (0, (5, 1000))
    app_wide = {"singleton_permits": "unlimited", "singleton_rate_limit": "5/s"}
    assert read_options(app_wide, _task()).permits == 0  # a spelling of its own: app-wide too
    assert read_options(app_wide, _task(singleton_permits=2)).permits == 2


def test_unlimited_permits_need_a_rate() -> None:
    with pytest.raises(SingletonConfigError, match="needs singleton_rate_limit"):
        read_options({}, _task(singleton_permits="unlimited"))


def test_permits_none_on_the_task_is_read_as_unlimited() -> None:
    with pytest.warns(DeprecationWarning, match="unlimited") as caught:
        opts = read_options({}, _task(singleton_permits=None, singleton_rate_limit="5/s"))
    assert opts.permits == 0
    assert [str(w.message) for w in caught] == [
        "task t.api: singleton_permits=None is deprecated, use singleton_permits='unlimited'"
    ]


@pytest.mark.parametrize("value", ["Unlimited", "none", "inf", "", 0])
def test_other_spellings_of_no_limit_are_refused(value: Any) -> None:
    """Only "unlimited" says no limit: the refusal names it, in one line."""
    with pytest.raises(SingletonConfigError, match=r"or 'unlimited', got") as e:
        read_options({}, _task(singleton_permits=value, singleton_rate_limit="5/s"))
    assert "\n" not in str(e.value)
    assert "singleton_permits (task t.api)" in str(e.value)


def test_the_banner_and_the_scope_check_say_unlimited() -> None:
    app = Celery("renamed-permits", set_as_current=False)
    app.conf.singleton_redis_url = "redis://127.0.0.1:6379/0"
    scoped = {"base": SingletonTask, "shared": False, "singleton_scope": "api"}

    @app.task(name="t.read", singleton_permits="unlimited", singleton_rate_limit="5/s", **scoped)
    def read(customer: str) -> None: ...

    @app.task(name="t.write", singleton_rate_limit="5/s", **scoped)
    def write(customer: str) -> None: ...

    try:
        assert ".> permits:         t.read=unlimited\n" in banner_lines(app.conf, [read, write])
        with pytest.raises(SingletonConfigError, match=r"t\.read unlimited; t\.write 1"):
            check_scopes([read, write])
    finally:
        app.close()


# -- singleton_lock_on="publish" ("both") --------------------------------------------------------


def test_lock_on_publish() -> None:
    assert read_options({"singleton_lock_on": "publish"}).lock_on == "publish"
    assert read_options({}, _task(singleton_lock_on="publish")).lock_on == "publish"


def test_lock_on_both_is_read_as_publish() -> None:
    app_wide, on_task = {"singleton_lock_on": "both"}, _task(singleton_lock_on="both")
    with pytest.warns(
        DeprecationWarning, match=r"^singleton_lock_on: 'both' is deprecated, use 'publish'$"
    ):
        opts = read_options(app_wide)
    assert opts.lock_on == "publish"
    with pytest.warns(
        DeprecationWarning, match=r"^singleton_lock_on \(task t\.api\): 'both' .*'publish'$"
    ):
        opts = read_options({}, on_task)
    assert opts.lock_on == "publish"


def test_a_task_overrides_an_app_wide_both() -> None:
    """The task's own value wins; the app's old one is not even read."""
    task = _task(singleton_lock_on="execute")
    assert read_options({"singleton_lock_on": "both"}, task).lock_on == "execute"


def test_a_bad_lock_on_names_only_the_current_values() -> None:
    with pytest.raises(
        SingletonConfigError,
        match=r"^singleton_lock_on must be one of 'execute', 'publish', got 'queue'$",
    ):
        read_options({"singleton_lock_on": "queue"})


def test_the_worker_logs_an_app_wide_old_spelling_once(caplog: pytest.LogCaptureFixture) -> None:
    """Every task reads the app-wide "both": the worker's start logs it once, and the banner
    shows what it is read as."""
    app = Celery("renamed-lock-on", set_as_current=False)
    app.conf.singleton_redis_url = "redis://127.0.0.1:6379/0"
    app.conf.singleton_lock_on = "both"

    @app.task(base=SingletonTask, name="t.one", shared=False)
    def one(x: int) -> None: ...

    @app.task(base=SingletonTask, name="t.two", shared=False)
    def two(x: int) -> None: ...

    class Worker:
        app: Celery

        def extra_info(self) -> str:
            return ""

    worker = Worker()
    worker.app = app
    app.finalize()
    for name in [n for n in app.tasks if n not in ("t.one", "t.two")]:  # shared by other tests
        if isinstance(app.tasks[name], SingletonTask):
            del app.tasks[name]
    try:
        with caplog.at_level(logging.WARNING):
            _check_and_announce(instance=worker)
        shown = [r.getMessage() for r in caplog.records if "deprecated" in r.getMessage()]
        assert shown == [
            "singleton: deprecated option: singleton_lock_on: 'both' is deprecated, use 'publish'"
        ]
        assert ".> lock_on:         publish\n" in worker.extra_info()
    finally:
        app.close()
