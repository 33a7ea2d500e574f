"""SingletonScheduler: several beat instances, each scheduled run published once.

Active-active (the default): every instance ticks its own schedule. Right before it
publishes a run, it claims the run in Redis under the entry's name and the run's
*nominal* time (schedules.py): the interval slot, the cron minute or the solar event.
The first claim wins; the others log and move on. Interval schedules are aligned to the
Unix epoch, so every instance computes the same slots whatever its start time.

Leader mode: one instance holds a renewed lease and publishes; the others poll for the
lease (leader.py). Runs are still claimed, so a failover never publishes a run twice.

A run's name, claim key and how long its claim is kept come from runs.py. A tick takes every
entry due at that moment off the heap and notices a change of schedule without comparing it
whole (ticks.py); their runs are claimed in one round trip and confirmed in one more
(publishing.py).

:class:`SingletonSchedulerMixin` goes in front of any scheduler class;
:class:`SingletonScheduler` is the mixin on Celery's PersistentScheduler.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import time
import uuid
import warnings
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any, SupportsIndex

from celery.beat import PersistentScheduler, ScheduleEntry
from celery.schedules import schedstate

from ..core._pid import current_pid
from ..core.backend import REDIS_ERRORS
from ..core.urls import redact_url
from ..errors import SingletonConfigError
from ..settings.options import BeatOptions, read_beat_options
from .leader import ERROR_RETRY_S, BeatState
from .outage import Outage
from .publishing import NOT_PUBLISHED, NotPublished, claim_and_publish
from .redlock_claims import claims_and_store
from .runs import Run, aware, bucket_run, is_interval, once_run, run_at
from .schedules import interval_slot, nominal_run, slot_start
from .steered import Steered
from .ticks import (
    ScheduleWatch,
    base_tick_is_celerys,
    next_delay,
    pop_due,
    push_next,
    tracked_schedule,
)
from .watching import Watching

__all__ = ["SingletonScheduler", "SingletonSchedulerMixin"]

logger = logging.getLogger(__name__)


class SingletonSchedulerMixin:
    """Publish each scheduled run from one beat instance only; put it before a Scheduler."""

    app: Any
    schedule: Any
    max_interval: float

    #: Wall clock (epoch seconds) and monotonic clock; tests may replace them.
    singleton_clock: Callable[[], float] = staticmethod(time.time)
    singleton_monotonic: Callable[[], float] = staticmethod(time.monotonic)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._singleton: BeatState | None = None
        #: per interval entry: its interval and the last slot this instance saw begin
        self._aligned_last: dict[str, tuple[float, int]] = {}
        self._due_slot: dict[str, int] = {}
        #: runs to claim again at a monotonic time: their claimer may have died, or Redis failed
        self._rechecks: dict[Run, float] = {}
        #: the entries this instance watches, since when (watching.py)
        self._singleton_watching = Watching()
        #: calls of the schedule's own editing methods (ticks.py notices a change by them)
        self._singleton_edits = 0
        self._singleton_watch = ScheduleWatch()
        #: labelled entries of claimed runs being published through apply_entry: their outcome
        self._singleton_claimed: dict[int, Any] = {}
        #: the DeprecationWarnings of the settings this scheduler logged
        self._singleton_deprecations: set[str] = set()
        #: whether Redis answers this instance: an outage is logged once (outage.py)
        self._singleton_outage = Outage(on_start=self.singleton_watch_again)
        #: its schedule registered for operators, the runs they asked for (steered.py)
        self._singleton_steered = Steered()
        super().__init__(*args, **kwargs)

    # -- settings and connections ----------------------------------------------------------

    @property
    def singleton_options(self) -> BeatOptions:
        """The beat settings. An old spelling's DeprecationWarning is logged, once per
        scheduler: Python hides DeprecationWarnings in beat, as in a worker."""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", DeprecationWarning)
            opts = read_beat_options(self.app.conf)
        for warning in caught:
            if not issubclass(warning.category, DeprecationWarning):
                warnings.warn_explicit(
                    warning.message, warning.category, warning.filename, warning.lineno
                )
            elif str(warning.message) not in self._singleton_deprecations:
                self._singleton_deprecations.add(str(warning.message))
                logger.warning("beat: deprecated setting: %s", warning.message)
        return opts

    def _singleton_state(self) -> BeatState:
        state = self._singleton
        if state is None or state.pid != current_pid():
            opts = self.singleton_options
            claimer = f"{socket.gethostname()}:{current_pid()}:{uuid.uuid4().hex[:8]}"
            claims, store = claims_and_store(opts.redis_url, claimer)
            state = self._singleton = BeatState(
                opts=opts,
                pid=current_pid(),
                claimer=claimer,
                claims=claims,
                store=store,
                outage=self._singleton_outage,
            )
            logger.info(
                "beat: singleton scheduler started: mode=%s redis=%s prefix=%s instance=%s",
                opts.mode,
                redact_url(opts.redis_url),
                opts.key_prefix,
                claimer,
            )
        return state

    @property
    def info(self) -> str:
        """Celery's scheduler info plus the singleton settings, for beat's banner.

        The banner is the first thing ``celery beat`` reads the settings for: a bad one stops
        beat here, at start-up, with one line naming it (as a worker does).
        """
        try:
            opts = self.singleton_options
        except SingletonConfigError as exc:
            raise SystemExit(f"celery_singleton_lock: invalid setting: {exc}") from None
        base = str(super().info or "")  # type: ignore[misc]
        line = (
            f"    . singleton -> mode={opts.mode} redis={redact_url(opts.redis_url)} "
            f"prefix={opts.key_prefix} skew={opts.skew:g}s"
        )
        if opts.mode == "leader":
            line += f" lease={opts.lease:g}s"
        return f"{base}\n{line}" if base else line

    # -- the schedule ----------------------------------------------------------------------

    def is_due(self, entry: ScheduleEntry) -> tuple[bool, float]:
        """Interval entries are due at epoch-aligned slots; others as Celery decides.

        Either way the entry's own ``is_due`` runs: an entry class that checks more than its
        schedule (django-celery-beat's ``ModelEntry``: enabled, ``start_time``, ``expires``,
        ``one_off``) still decides those. For an interval entry its schedule is stood in for,
        for that call only, by one that answers on the epoch grid.
        """
        sched = entry.schedule
        if not is_interval(sched):
            state: tuple[bool, float] = super().is_due(entry)  # type: ignore[misc]
            return state

        def aligned(last_run_at: datetime | None) -> tuple[bool, float]:
            return self._interval_due(entry, sched, last_run_at)

        return self._is_due_with(entry, aligned)

    def singleton_may_run(self, entry: ScheduleEntry) -> bool:
        """Whether what ``entry`` checks besides its schedule lets it run now (always, for
        Celery's entries; django-celery-beat's ``ModelEntry`` checks enabled, ``start_time``,
        ``expires`` and ``one_off``). Catch-up publishes no run of an entry that may not."""
        return self._is_due_with(entry, lambda _last_run_at: (True, 0.0))[0]

    def _is_due_with(
        self, entry: ScheduleEntry, answer: Callable[[datetime | None], tuple[bool, float]]
    ) -> tuple[bool, float]:
        """The entry's own ``is_due``, its schedule stood in for, for that call only, by one
        whose ``is_due`` is ``answer``."""
        sched = entry.schedule
        entry.schedule = _StandIn(sched, answer)
        try:
            state: tuple[bool, float] = super().is_due(entry)  # type: ignore[misc]
        finally:
            entry.schedule = sched
        return state

    def singleton_not_before(self, entry: ScheduleEntry) -> datetime | None:
        """The first instant a run of ``entry`` may be due at (an interval run's slot may not
        start before it), or None. The database scheduler gives the entry's ``start_time``."""
        return None

    def _interval_due(
        self, entry: ScheduleEntry, sched: Any, last_run_at: datetime | None
    ) -> tuple[bool, float]:
        """Whether a new epoch-aligned slot of interval entry ``entry`` has begun."""
        interval = sched.run_every.total_seconds()
        now = self.singleton_clock()
        slot = interval_slot(interval, now)
        seen = self._aligned_last.get(entry.name)
        if seen is None or seen[0] != interval:  # new to this instance, or its interval changed
            last = slot if last_run_at is None else min(slot, _slot_of(interval, last_run_at))
        else:
            last = seen[1]
        not_before = self.singleton_not_before(entry)
        if not_before is not None and slot_start(interval, slot) < aware(not_before):
            last = max(last, slot)  # this slot began before the entry's start: not its run
        due = slot > last
        self._aligned_last[entry.name] = (interval, slot if due else last)
        if due:
            self._due_slot[entry.name] = slot
        next_in = slot_start(interval, slot + 1).timestamp() - now
        return schedstate(due, max(next_in, 0.0))  # type: ignore[no-any-return]

    def tick(self, *args: Any, **kwargs: Any) -> float:
        """Stand by unless leading (leader mode); then one tick: every due run claimed in one
        round trip and published (ticks.py), or, before a scheduler with a tick of its own,
        pending claims retried and that tick."""
        try:
            state = self._singleton_state()
        except REDIS_ERRORS as exc:  # a cluster client reads the slot map when it is built
            self._singleton_outage.failed(exc, self.singleton_monotonic())
            return ERROR_RETRY_S
        leader = state.opts.mode == "leader"
        if leader:
            was_leading = state.leading
            if not self._singleton_lead(state):
                return min(self.max_interval, state.opts.lease / 10)
            if not was_leading:  # the runs due while no leader published: catch-up's
                self.singleton_watch_again()
        schedule = self.schedule  # read once: the database scheduler looks for changes here
        asked = self._singleton_steered.asked_runs(
            self, state, schedule, self._group(), self._singleton_edits
        )
        if base_tick_is_celerys(type(self), SingletonSchedulerMixin):
            delay = self._batched_tick(state, schedule, asked)
        else:
            self._singleton_watching.sight(self, state, schedule)
            self._publish_many(state, [*self._due_rechecks(schedule), *asked])
            delay = float(super().tick(*args, **kwargs))  # type: ignore[misc]
        if self._rechecks:
            first = min(self._rechecks.values())
            delay = min(delay, max(first - self.singleton_monotonic(), 0.0))
        # wake up to look for operators' asks
        delay = min(delay, self._singleton_steered.next_poll_in(state, self.singleton_monotonic()))
        if leader and state.leading:  # wake up to renew the lease, not at the next due run
            delay = min(delay, max(state.renew_at - self.singleton_monotonic(), 0.0))
        return delay

    def _batched_tick(
        self, state: BeatState, schedule: Any, asked: list[tuple[ScheduleEntry, Run]]
    ) -> float:
        """Every event due now off the heap, reserved, and their runs (with the pending claims
        to retry and the runs operators ``asked`` for) claimed in one round trip and
        published."""
        tracked = self.singleton_schedule_tracked or tracked_schedule(type(self))
        if self._singleton_watching.sight(self, state, schedule):
            self._heap = None  # placed again from the due state the sight set
        self._singleton_watch.refresh(self, schedule, self._singleton_edits, tracked)
        runs = [*self._due_rechecks(schedule), *asked]
        for due in pop_due(self):
            entry = due[1]
            run = self._run(entry, state.opts)  # as it was due, before reserve
            # an entry not watched yet: Redis did not answer its sight, and catch-up decides
            # about this run once it does, from a record no run published meanwhile has moved
            watching = self._singleton_watching
            if watching.watches(entry.name) and not watching.passes_over(run):
                runs.append((entry, run))
            push_next(self, due, self.reserve(entry))  # type: ignore[attr-defined]
        if runs:
            self._publish_many(state, runs)
        return next_delay(self)

    def apply_async(
        self, entry: ScheduleEntry, producer: Any = None, advance: bool = True, **kwargs: Any
    ) -> Any:
        """Publish ``entry``'s due run if this instance claims it first."""
        if id(entry) in self._singleton_claimed:  # a run claimed by a tick, via apply_entry
            result = super().apply_async(  # type: ignore[misc]
                entry, producer=producer, advance=False, **kwargs
            )
            self._singleton_claimed[id(entry)] = result
            return result
        state = self._singleton_state()
        run = self._run(entry, state.opts)  # of the entry as it was due, before reserve()
        if advance:
            entry = self.reserve(entry)  # type: ignore[attr-defined]
        if state.opts.mode == "leader" and not self._singleton_lead(state):
            logger.warning("beat: not the leader, run not published: entry=%s", entry.name)
            return None
        if self._singleton_watching.passes_over(run):
            return None

        def publish(labelled: ScheduleEntry) -> Any:
            return super(SingletonSchedulerMixin, self).apply_async(  # type: ignore[misc]
                labelled, producer=producer, advance=False, **kwargs
            )

        return claim_and_publish(self, state, [(entry, run)], publish)[0]

    def apply_entry(self, entry: ScheduleEntry, producer: Any = None) -> None:
        """Celery's ``apply_entry`` (its log line, its error handling, and what wraps it: Sentry
        Crons' check-in) for a run this instance claimed. A tick of a scheduler's own that
        calls it claims the run first, so that nothing around ``apply_entry`` sees a run
        another instance publishes."""
        if id(entry) in self._singleton_claimed:  # a run claimed by _publish_many
            super().apply_entry(entry, producer=producer)  # type: ignore[misc]
            return
        state = self._singleton_state()
        run = self._run(entry, state.opts)
        if not self._singleton_watching.passes_over(run):
            self._publish_many(state, [(entry, run)], producer)

    # -- the schedule's own editing methods: counted, so a tick notices the change (ticks.py)

    #: True when the base scheduler's schedule changes only through its own methods or by
    #: becoming another dict (Celery's own schedulers are found out; the database one says so).
    singleton_schedule_tracked = False

    def add(self, **kwargs: Any) -> Any:
        self._singleton_edits += 1
        return super().add(**kwargs)  # type: ignore[misc]

    def update_from_dict(self, dict_: Any) -> None:
        self._singleton_edits += 1
        super().update_from_dict(dict_)  # type: ignore[misc]

    def merge_inplace(self, b: Any) -> None:
        self._singleton_edits += 1
        super().merge_inplace(b)  # type: ignore[misc]

    def close(self) -> None:
        """Give up the leader lease (if held) so a standby takes over at once."""
        state = self._singleton
        if state is not None and state.pid == current_pid():
            self._singleton_steered.gone()
            if state.leading:
                state.give_up(self._group())
        super().close()  # type: ignore[misc]

    # -- leader mode (leader.py) -------------------------------------------------------------

    def _group(self) -> str:
        return str(self.app.main or "celery")

    def _singleton_lead(self, state: BeatState) -> bool:
        """True if this instance holds the leader lease (taken or renewed as it falls due)."""
        return state.lead(self._group(), self.singleton_monotonic)

    # -- claims ------------------------------------------------------------------------------

    def _publish_many(
        self, state: BeatState, runs: list[tuple[ScheduleEntry, Run]], producer: Any = None
    ) -> None:
        """Claim ``runs`` in one round trip; publish those won through ``apply_entry`` (Celery's
        log line and error handling, and what hooks it sees them), confirm them in one more."""
        if not runs:
            return
        if state.opts.mode == "leader" and not self._singleton_lead(state):
            for entry, _run in runs:
                logger.warning("beat: not the leader, run not published: entry=%s", entry.name)
            return
        producer = producer or self.producer  # type: ignore[attr-defined]

        def publish(labelled: ScheduleEntry) -> Any:
            self._singleton_claimed[id(labelled)] = NOT_PUBLISHED
            try:
                self.apply_entry(labelled, producer=producer)
            finally:
                outcome = self._singleton_claimed.pop(id(labelled))
            if outcome is NOT_PUBLISHED:  # apply_entry logged why
                raise NotPublished
            return outcome

        batch = getattr(producer, "batch", None)  # kombu 5.7: one pipeline to a Redis broker
        claim_and_publish(self, state, runs, publish, batch or contextlib.nullcontext)

    def _recheck_later(self, run: Run, delay: float) -> None:
        self._rechecks[run] = self.singleton_monotonic() + delay

    def _due_rechecks(self, schedule: Any) -> list[tuple[ScheduleEntry, Run]]:
        """The runs whose recheck is due, with their entries (taken off the rechecks); not
        those seen claimed by another instance before a Redis outage (outage.py), nor those of
        an entry this instance does not watch yet (catch-up decides about them: watching.py)."""
        now = self.singleton_monotonic()
        due: list[tuple[ScheduleEntry, Run]] = []
        for run, when in list(self._rechecks.items()):
            if when > now:
                continue
            del self._rechecks[run]
            if self._singleton_outage.stale(run):
                continue
            if not self._singleton_watching.watches(run.entry_name):
                continue
            entry = schedule.get(run.entry_name)
            if entry is not None:
                due.append((entry, run))
        return due

    def singleton_watch_again(self) -> None:
        """Start to watch every entry again at the next tick, as at start-up (watching.py):
        the runs that came due since are published as each entry's catch-up choice says,
        not each on its own. Called when this instance takes the lead, and when Redis answers
        again after an outage."""
        self._singleton_watching.again()

    def singleton_once(self, entry: ScheduleEntry) -> datetime | None:
        """For an entry that runs only once: an instant naming that one run, else None.

        Such a run is claimed under ``once-<that instant>`` instead of its nominal time, so
        an instance that fires it later (it learnt late that it ran) finds it claimed. The
        database scheduler names a one-off entry's run by the ``last_run_at`` it had before it
        ran, which every instance reads alike from the database.
        """
        return None

    def _run(self, entry: ScheduleEntry, opts: BeatOptions) -> Run:
        """``entry``'s due run: its nominal run id and claim key."""
        once = self.singleton_once(entry)
        if once is not None:
            self._due_slot.pop(entry.name, None)
            return once_run(entry.name, once, opts)
        sched = entry.schedule
        if is_interval(sched):
            interval = sched.run_every.total_seconds()
            slot = self._due_slot.pop(entry.name, None)
            if slot is None:
                slot = interval_slot(interval, self.singleton_clock())
            return run_at(entry.name, sched, opts, slot_start(interval, slot))
        now = datetime.fromtimestamp(self.singleton_clock(), timezone.utc)
        nominal = nominal_run(sched, now)
        if nominal is None:  # a schedule type we cannot place: buckets of the skew bound
            return bucket_run(entry.name, opts, now)
        return run_at(entry.name, sched, opts, nominal)


def _slot_of(interval: float, when: datetime) -> int:
    return interval_slot(interval, aware(when).timestamp())


class _StandIn:
    """A schedule answering ``is_due`` with ``answer``, for one entry and one call.

    Stands in for the entry's schedule while the entry's own ``is_due`` runs, so what the entry
    checks besides its schedule still counts (see :meth:`SingletonSchedulerMixin.is_due`).
    """

    def __init__(self, sched: Any, answer: Callable[[datetime | None], tuple[bool, float]]):
        self._sched, self._answer = sched, answer

    def is_due(self, last_run_at: datetime | None) -> tuple[bool, float]:
        return self._answer(last_run_at)

    def __reduce_ex__(self, protocol: SupportsIndex) -> str | tuple[Any, ...]:
        """Pickled as the entry's own schedule. Beat's SIGTERM handler writes the schedule file
        whenever it lands, also while this stands in: it must neither fail there (the beat
        would go on running) nor write the scheduler into the file."""
        return self._sched.__reduce_ex__(protocol)  # type: ignore[no-any-return]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sched, name)


class SingletonScheduler(SingletonSchedulerMixin, PersistentScheduler):  # type: ignore[misc]
    """Celery's PersistentScheduler, publishing each scheduled run once across instances."""
