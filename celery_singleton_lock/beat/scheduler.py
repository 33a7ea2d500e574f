"""SingletonScheduler: several beat instances, each scheduled run published once.

Active-active (the default): every instance ticks its own schedule. Right before it
publishes a run, it claims the run in Redis under the entry's name and the run's
*nominal* time (schedules.py): the interval slot, the cron minute or the solar event.
The first claim wins; the others log and move on. Interval schedules are aligned to the
Unix epoch, so every instance computes the same slots whatever its start time.

Leader mode: one instance holds a renewed lease and publishes; the others poll for the
lease (leader.py). Runs are still claimed, so a failover never publishes a run twice.

A run's name, claim key and how long its claim is kept come from runs.py.

:class:`SingletonSchedulerMixin` goes in front of any scheduler class;
:class:`SingletonScheduler` is the mixin on Celery's PersistentScheduler.
"""

from __future__ import annotations

import copy
import logging
import socket
import time
import uuid
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any, SupportsIndex

from celery.beat import PersistentScheduler, ScheduleEntry
from celery.schedules import schedstate

from ..core._pid import current_pid
from ..core.backend import REDIS_ERRORS
from ..core.urls import redact_url
from ..errors import LockUnavailableError, SingletonConfigError
from ..settings.options import BeatOptions, read_beat_options
from .claims import CLAIM_HEADER, KEEP_HEADER, RUN_HEADER, claims_and_store
from .leader import ERROR_RETRY_S, BeatState
from .runs import Run, aware, bucket_run, is_interval, once_run, run_at
from .schedules import interval_slot, nominal_run, recent_runs, slot_start

__all__ = ["SingletonScheduler", "SingletonSchedulerMixin"]

logger = logging.getLogger(__name__)

#: How long a claim may stay unconfirmed while its instance publishes the run. An
#: instance that dies in that window delays the run by at most this much.
PUBLISH_LEASE_S = 10.0
#: At start-up, how many recent runs of each entry are checked for a claim left pending.
RECENT_RUNS_MAX = 32


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
        #: entries whose recent runs this instance checked for claims left pending
        self._watched: set[str] = set()
        super().__init__(*args, **kwargs)

    # -- settings and connections ----------------------------------------------------------

    @property
    def singleton_options(self) -> BeatOptions:
        return read_beat_options(self.app.conf)

    def _singleton_state(self) -> BeatState:
        state = self._singleton
        if state is None or state.pid != current_pid():
            opts = self.singleton_options
            claimer = f"{socket.gethostname()}:{current_pid()}:{uuid.uuid4().hex[:8]}"
            claims, store = claims_and_store(opts.redis_url, claimer)
            state = self._singleton = BeatState(
                opts=opts, pid=current_pid(), claimer=claimer, claims=claims, store=store
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
        entry.schedule = _AlignedInterval(self, entry, sched)
        try:
            aligned: tuple[bool, float] = super().is_due(entry)  # type: ignore[misc]
        finally:
            entry.schedule = sched
        return aligned

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
        """Stand by unless leading (leader mode); retry pending claims; then Celery's tick."""
        try:
            state = self._singleton_state()
        except REDIS_ERRORS as exc:  # a cluster client reads the slot map when it is built
            logger.error("beat: redis error, standing by: %s", exc)
            return ERROR_RETRY_S
        if state.opts.mode == "leader" and not self._singleton_lead(state):
            return min(self.max_interval, state.opts.lease / 10)
        self._watch_recent_runs(state)
        self._run_rechecks(state)
        delay = float(super().tick(*args, **kwargs))  # type: ignore[misc]
        if self._rechecks:
            first = min(self._rechecks.values())
            delay = min(delay, max(first - self.singleton_monotonic(), 0.0))
        return delay

    def apply_async(
        self, entry: ScheduleEntry, producer: Any = None, advance: bool = True, **kwargs: Any
    ) -> Any:
        """Publish ``entry``'s due run if this instance claims it first."""
        state = self._singleton_state()
        run = self._run(entry, state.opts)  # of the entry as it was due, before reserve()
        if advance:
            entry = self.reserve(entry)  # type: ignore[attr-defined]
        if state.opts.mode == "leader" and not self._singleton_lead(state):
            logger.warning("beat: not the leader, run not published: entry=%s", entry.name)
            return None
        return self._claim_and_publish(state, entry, run, producer, **kwargs)

    def close(self) -> None:
        """Give up the leader lease (if held) so a standby takes over at once."""
        state = self._singleton
        if state is not None and state.leading and state.pid == current_pid():
            state.give_up(self._group())
        super().close()  # type: ignore[misc]

    # -- leader mode (leader.py) -------------------------------------------------------------

    def _group(self) -> str:
        return str(self.app.main or "celery")

    def _singleton_lead(self, state: BeatState) -> bool:
        """True if this instance holds the leader lease (taken or renewed as it falls due)."""
        return state.lead(self._group(), self.singleton_monotonic())

    # -- claims ------------------------------------------------------------------------------

    def _claim_and_publish(
        self, state: BeatState, entry: ScheduleEntry, run: Run, producer: Any, **kwargs: Any
    ) -> Any:
        key = run.key
        claimed_at = self.singleton_monotonic()
        try:
            claim = state.claims.claim(key, round(PUBLISH_LEASE_S * 1000), run.keep_ms)
        except LockUnavailableError as exc:
            logger.error(
                "beat: redis error, run not published yet, retrying: entry=%s run=%s: %s",
                entry.name,
                run.run,
                exc,
            )
            self._recheck_later(run, ERROR_RETRY_S)
            return None
        if not claim.won:
            logger.info(
                "beat: run already claimed: entry=%s run=%s by=%s published=%s",
                entry.name,
                run.run,
                claim.holder,
                claim.published,
            )
            if not claim.published:  # its claimer may die before publishing: look again
                self._recheck_later(run, claim.pttl_ms / 1000 + 0.05)
            return None
        if self.singleton_monotonic() - claimed_at > PUBLISH_LEASE_S / 2:
            # paused right after claiming: the claim may be about to expire and be taken by
            # another instance, which would then publish the run too. Let it go and look again.
            _quietly(state.claims.unclaim, key)
            logger.warning(
                "beat: claim too old to publish, retrying: entry=%s run=%s", entry.name, run.run
            )
            self._recheck_later(run, 0.0)
            return None
        labelled = _shallow_copy(entry)
        labelled.options = copy.deepcopy(entry.options)
        labelled.options.setdefault("headers", {}).update(
            {RUN_HEADER: f"{entry.name}@{run.run}", CLAIM_HEADER: key, KEEP_HEADER: run.keep_ms}
        )
        try:
            result = super().apply_async(  # type: ignore[misc]
                labelled, producer=producer, advance=False, **kwargs
            )
        except BaseException:
            _quietly(state.claims.unclaim, key)
            raise
        task_id = str(getattr(result, "id", "") or "-")
        try:
            confirmed = state.claims.confirm(key, task_id, run.keep_ms)
        except LockUnavailableError as exc:  # the pending claim still blocks others
            logger.warning(
                "beat: could not confirm run: entry=%s run=%s: %s", entry.name, run.run, exc
            )
        else:
            if not confirmed:  # our claim expired while publishing: another may publish too
                logger.error(
                    "beat: claim expired while publishing, run may be duplicated: "
                    "entry=%s run=%s task_id=%s",
                    entry.name,
                    run.run,
                    task_id,
                )
        logger.info("beat: published run: entry=%s run=%s task_id=%s", entry.name, run.run, task_id)
        return result

    def _recheck_later(self, run: Run, delay: float) -> None:
        self._rechecks[run] = self.singleton_monotonic() + delay

    def _run_rechecks(self, state: BeatState) -> None:
        now = self.singleton_monotonic()
        for run, due in list(self._rechecks.items()):
            if due > now:
                continue
            del self._rechecks[run]
            entry = self.schedule.get(run.entry_name)
            if entry is not None:
                self._claim_and_publish(state, entry, run, self.producer)  # type: ignore[attr-defined]

    def _watch_recent_runs(self, state: BeatState) -> None:
        """Look once at the recent runs of entries new to this instance for pending claims.

        An instance fires only the runs that come due while it runs: one started after a
        run's nominal time never claims that run, so it would not notice that the run's
        claimer died before publishing. Runs whose claim may still be pending (within the
        publish lease and the skew bound) are looked at once, and those found pending are
        claimed again when their lease ends, like the runs this instance fired.
        """
        if self._watched.issuperset(self.schedule):
            return
        now = datetime.fromtimestamp(self.singleton_clock(), timezone.utc)
        since = now - timedelta(seconds=PUBLISH_LEASE_S + 2 * state.opts.skew + 1)
        runs: list[Run] = []
        for name, entry in list(self.schedule.items()):
            if name in self._watched:
                continue
            self._watched.add(name)
            for nominal in recent_runs(entry.schedule, now, since, RECENT_RUNS_MAX):
                runs.append(run_at(entry.name, entry.schedule, state.opts, nominal))
        try:
            claims = state.claims.peek([run.key for run in runs])
        except LockUnavailableError as exc:
            logger.warning("beat: could not look at recent runs' claims: %s", exc)
            return
        for run, claim in zip(runs, claims, strict=True):
            if claim is not None and not claim.published:
                logger.info(
                    "beat: watching a run claimed by another instance: entry=%s run=%s by=%s",
                    run.entry_name,
                    run.run,
                    claim.holder,
                )
                self._recheck_later(run, claim.pttl_ms / 1000 + 0.05)

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


def _shallow_copy(entry: ScheduleEntry) -> ScheduleEntry:
    """A shallow copy of ``entry``, its attributes shared.

    Not ``copy.copy``: that goes through ``ScheduleEntry.__reduce__``, which calls the class with
    ScheduleEntry's own arguments, and an entry class with another signature (django-celery-beat's
    ``ModelEntry(model, app)``) fails there with a TypeError, so no run would be published.
    """
    clone: ScheduleEntry = object.__new__(type(entry))
    clone.__dict__.update(entry.__dict__)
    return clone


def _slot_of(interval: float, when: datetime) -> int:
    return interval_slot(interval, aware(when).timestamp())


class _AlignedInterval:
    """An interval schedule answering ``is_due`` on the epoch grid, for one entry and one call.

    Stands in for the entry's schedule while the entry's own ``is_due`` runs, so what the entry
    checks besides its schedule still counts (see :meth:`SingletonSchedulerMixin.is_due`).
    """

    def __init__(self, scheduler: SingletonSchedulerMixin, entry: ScheduleEntry, sched: Any):
        self._scheduler, self._entry, self._sched = scheduler, entry, sched

    def is_due(self, last_run_at: datetime | None) -> tuple[bool, float]:
        return self._scheduler._interval_due(self._entry, self._sched, last_run_at)

    def __reduce_ex__(self, protocol: SupportsIndex) -> str | tuple[Any, ...]:
        """Pickled as the entry's own schedule. Beat's SIGTERM handler writes the schedule file
        whenever it lands, also while this stands in: it must neither fail there (the beat
        would go on running) nor write the scheduler into the file."""
        return self._sched.__reduce_ex__(protocol)  # type: ignore[no-any-return]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sched, name)


def _quietly(fn: Callable[[str], object], key: str) -> None:
    try:
        fn(key)
    except LockUnavailableError as exc:
        logger.warning("beat: could not give up claim %s: %s", key, exc)


class SingletonScheduler(SingletonSchedulerMixin, PersistentScheduler):  # type: ignore[misc]
    """Celery's PersistentScheduler, publishing each scheduled run once across instances."""
