"""The entries a beat instance watches, and since when: what it does as it starts to watch one.

An instance *starts to watch* an entry at its first tick with it (it started, or the entry is
new to its schedule), when it takes the lead (leader mode) and when Redis answers again after
an outage (:meth:`Watching.again`). Then, in one round trip for all the new entries:

- **catch-up** (catch_up.py): the entry's record says up to which nominal time its runs are
  accounted for; the runs missed since, as the entry's catch-up choice picks them, and the run
  due now are handed to the scheduler to publish at this tick (as rechecks, oldest first). The
  instant it started to watch is the entry's *floor*: from then on the entry's own due state
  publishes only runs after it (:meth:`Watching.before`), so a local schedule file's old
  ``last_run_at`` makes no run due that catch-up passed over, and an interval entry's next run
  is its next slot, whatever the file said;
- **claims left pending** (:meth:`Watching.look_at_recent_claims`): an instance fires only the
  runs that come due while it runs, so one started after a run's nominal time would not notice
  that the run's claimer died before publishing. The claims of the recent runs (within the
  publish lease and the skew bound) are looked at once, and those found pending are claimed
  again when their lease ends, like the runs the instance fired itself.

Knows the scheduler through what it asks of it: its clocks, its rechecks, ``singleton_once``
and ``singleton_may_run``.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta, timezone
from typing import Any

from celery.schedules import crontab

from ..core.keys import beat_entry_key
from ..errors import LockUnavailableError
from .catch_up import catch_up_of, grace, runs_on_sight
from .leader import BeatState
from .publishing import PUBLISH_LEASE_S
from .runs import Run, is_interval, is_placed, run_at
from .schedules import interval_slot, recent_runs, run_id, slot_start

__all__ = ["RECENT_RUNS_MAX", "Watching"]

#: the scheduler's logger
logger = logging.getLogger(f"{__package__}.scheduler")

#: How many recent runs of each entry are looked at for a claim left pending.
RECENT_RUNS_MAX = 32


class Watching:
    """The entries one beat instance watches: since when (their floor), and whether it looked
    at their recent runs' claims."""

    def __init__(self) -> None:
        #: entries this instance started to watch (it decided about their missed runs)
        self._sighted: set[str] = set()
        #: per entry, the instant (epoch ms) it started to watch it: its due state publishes
        #: only runs after that
        self._floor_ms: dict[str, int] = {}
        #: entries whose recent runs' claims it looked at
        self._looked: set[str] = set()
        #: per entry, the latest nominal run (epoch ms) this instance claimed or saw claimed:
        #: what it knows of the entry's record, should Redis come back without its data
        self._seen_ms: dict[str, int] = {}

    def again(self) -> None:
        """Start to watch every entry again at the next :meth:`sight`."""
        self._sighted.clear()
        self._looked.clear()

    def saw(self, run: Run) -> None:
        """``run`` was claimed, by this instance or another (published, or being published)."""
        nominal = run.note.nominal_ms
        if nominal is not None and nominal > self._seen_ms.get(run.entry_name, nominal - 1):
            self._seen_ms[run.entry_name] = nominal

    def watches(self, entry_name: str) -> bool:
        """Whether this instance started to watch entry ``entry_name``."""
        return entry_name in self._sighted

    def passes_over(self, run: Run) -> bool:
        """Whether ``run`` came due before this instance started to watch its entry: catch-up
        decided about it then (logged at debug level)."""
        if not self._before_floor(run):
            return False
        logger.debug("beat: run left to catch-up: entry=%s run=%s", run.entry_name, run.run)
        return True

    def _before_floor(self, run: Run) -> bool:
        floor, nominal = self._floor_ms.get(run.entry_name), run.note.nominal_ms
        return floor is not None and nominal is not None and nominal <= floor

    def sight(self, sched: Any, state: BeatState, schedule: Any) -> bool:
        """Start to watch the entries of ``schedule`` new to scheduler ``sched``; True if any
        were (an interval entry's ``last_run_at`` was set: the scheduler places it again).
        Their recent runs' claims are looked at too."""
        new = [(name, entry) for name, entry in list(schedule.items()) if name not in self._sighted]
        sighted = bool(new) and self._catch_up(sched, state, new)
        self.look_at_recent_claims(sched, state, schedule)
        return sighted

    def _catch_up(self, sched: Any, state: BeatState, new: list[tuple[str, Any]]) -> bool:
        prefix = state.opts.key_prefix
        try:
            records = state.claims.records([beat_entry_key(prefix, n, "record") for n, _e in new])
        except LockUnavailableError as exc:  # logged once per outage; catch-up waits for it
            state.outage.failed(exc, sched.singleton_monotonic())
            return False
        state.outage.answered(sched.singleton_monotonic())
        now_s = sched.singleton_clock()
        now = datetime.fromtimestamp(now_s, timezone.utc)
        floor_ms, at = int(now_s * 1000), sched.singleton_monotonic()
        logger.info("beat: watching entries: new=%d since=%d", len(new), floor_ms)
        for (name, entry), record in zip(new, records, strict=True):
            self._sighted.add(name)
            schedule = entry.schedule
            if not is_placed(schedule) or sched.singleton_once(entry) is not None:
                continue
            if not sched.singleton_may_run(entry):  # disabled, expired, not started yet
                continue
            self._floor_ms[name] = floor_ms
            for run in [r for r in sched._rechecks if r.entry_name == name]:
                if self._before_floor(run):  # a retry, a look again: catch-up decides now
                    del sched._rechecks[run]
            catch_up, problem = catch_up_of(entry.options, state.opts.catch_up)
            if problem:
                logger.error(
                    "beat: invalid catch-up header, the app's choice applies: entry=%s: %s",
                    name,
                    problem,
                )
            through = _latest(
                None if record is None else record.through_ms, self._seen_ms.get(name)
            )
            deadline = sched.app.conf.beat_cron_starting_deadline
            if not isinstance(schedule, crontab):
                deadline = None  # Celery's deadline is a crontab's only
            sight = runs_on_sight(
                schedule, catch_up, through, now, grace(state.opts.skew), deadline_s=deadline
            )
            if sight.missed:
                logger.info(
                    "beat: catching up missed runs: entry=%s catch_up=%s runs=%d first=%s",
                    name,
                    catch_up,
                    len(sight.missed),
                    run_id(sight.missed[0]),
                )
            if sight.capped:
                logger.warning(
                    "beat: catch-up capped, older missed runs not published: entry=%s runs=%d",
                    name,
                    len(sight.missed),
                )
            for nominal in [*sight.missed, *sight.due]:
                run = run_at(name, schedule, state.opts, nominal, catch_up.reach_s)
                sched._rechecks[run] = at
            if is_interval(schedule):  # its next run is the next slot
                interval = schedule.run_every.total_seconds()
                entry.last_run_at = slot_start(interval, interval_slot(interval, now_s))
        return True

    def look_at_recent_claims(self, sched: Any, state: BeatState, schedule: Any) -> None:
        """Look once at the claims of the recent runs of entries new to ``sched``: those found
        pending are claimed again when their lease ends (see the module docstring)."""
        if len(self._looked) >= len(schedule) and self._looked.issuperset(schedule):
            return
        now = datetime.fromtimestamp(sched.singleton_clock(), timezone.utc)
        since = now - timedelta(seconds=PUBLISH_LEASE_S + 2 * state.opts.skew + 1)
        runs: list[Run] = []
        for name, entry in list(schedule.items()):
            if name in self._looked:
                continue
            self._looked.add(name)
            for nominal in recent_runs(entry.schedule, now, since, RECENT_RUNS_MAX):
                runs.append(run_at(entry.name, entry.schedule, state.opts, nominal))
        try:
            claims = state.claims.peek([run.key for run in runs])
        except LockUnavailableError as exc:  # logged once per outage; looked at again after
            state.outage.failed(exc, sched.singleton_monotonic())
            return
        for run, claim in zip(runs, claims, strict=True):
            # a claim of this instance's own (sent before an outage, run by the server after
            # it, its reply lost) is taken again at its next try, not after its lease
            if claim is not None and not claim.published and claim.holder != state.claimer:
                logger.info(
                    "beat: watching a run claimed by another instance: entry=%s run=%s by=%s",
                    run.entry_name,
                    run.run,
                    claim.holder,
                )
                sched._recheck_later(run, claim.pttl_ms / 1000 + 0.05)


def _latest(recorded: int | None, seen: int | None) -> int | None:
    """An entry's runs are accounted for up to the later of its record's ``through`` and the
    latest run this instance saw claimed: a Redis that came back without its data has no
    record, and the runs before the outage must not go out again."""
    known = [ms for ms in (recorded, seen) if ms is not None]
    return max(known) if known else None
