"""A scheduled run's name: the id it is claimed under, its claim key and how long it is kept.

Every beat instance must name a run alike: by its nominal instant (:mod:`.schedules`), a
schedule that runs once by its one instant, one that cannot be placed by a bucket of the skew
bound. A claim is kept two periods of its schedule past the run (plus the skew bound and a
minute; at least ``singleton_beat_lock_at_least``), so an instance that learns late that the
run happened still finds it claimed. A run at a nominal time is noted in its entry's record
(claims.py), which a beat reads to know which runs passed while no beat published.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

from celery.schedules import crontab, schedule, solar

from ..core.keys import run_claim_key
from ..settings.options import BeatOptions
from .claims import NOT_RECORDED, RunNote
from .schedules import nominal_run, run_id

__all__ = [
    "ONCE_PERIOD_S",
    "RECORD_KEEP_S",
    "Run",
    "aware",
    "bucket_run",
    "is_interval",
    "is_placed",
    "once_run",
    "run_at",
]

#: The least time an entry's record (its last published run, and up to when its runs are
#: accounted for) is kept after its last run: how long a downtime can be caught up after.
RECORD_KEEP_S = 35 * 86400.0

#: The period a schedule that runs once (a clocked time) counts as, to keep its run's claim:
#: an instance that learns late that the run happened must still find it claimed.
ONCE_PERIOD_S = 7 * 86400.0


def is_interval(sched: object) -> bool:
    return isinstance(sched, schedule) and not isinstance(sched, crontab | solar)


def is_placed(sched: object) -> bool:
    """Whether ``sched`` runs at nominal times every instance computes alike, one after
    another (an interval, a crontab, a solar event): runs that can be missed and caught up."""
    return isinstance(sched, schedule | crontab | solar)


@dataclass(frozen=True)
class Run:
    """One scheduled run: its entry, nominal run id, claim key and how long to keep it, and
    what its claim notes in the entry's record."""

    entry_name: str
    run: str
    key: str
    keep_ms: int
    note: RunNote = NOT_RECORDED


def aware(when: datetime) -> datetime:
    """``when``, a naive one taken as UTC (as Celery's ``maybe_make_aware`` does)."""
    return when.replace(tzinfo=timezone.utc) if when.tzinfo is None else when


def once_run(name: str, once: datetime, opts: BeatOptions) -> Run:
    """The run of an entry that runs only once, named by the instant ``once``."""
    run = f"once-{run_id(aware(once))}"
    keep = max(opts.lock_at_least, 2 * ONCE_PERIOD_S + 2 * opts.skew + 60)
    key = run_claim_key(opts.key_prefix, name, run)
    return Run(name, run, key, round(keep * 1000))


def bucket_run(name: str, opts: BeatOptions, now: datetime) -> Run:
    """The run at ``now`` of a schedule type we cannot place: buckets of the skew bound."""
    bucket = max(2 * opts.skew, 1.0)
    keep = max(opts.lock_at_least, 2 * opts.skew + 60)
    run = f"b{int(now.timestamp() // bucket)}"
    key = run_claim_key(opts.key_prefix, name, run)
    return Run(name, run, key, round(keep * 1000))


def run_at(
    name: str, sched: Any, opts: BeatOptions, nominal: datetime, reach_s: float = 0.0
) -> Run:
    """Entry ``name``'s run at ``nominal`` (its schedule: ``sched``): its run id, claim key and
    how long to keep it. The entry's record is kept :data:`RECORD_KEEP_S`, two claims' keep,
    or ``reach_s`` (how far back the entry catches up) past the claim, whichever is longest."""
    if is_interval(sched):
        period = sched.run_every.total_seconds()
    elif isinstance(sched, solar):  # the nearest event to a second earlier is this one
        period = 86400.0
    else:  # a schedule that runs once (a clocked one) has no previous run
        previous = nominal_run(sched, nominal - timedelta(seconds=1))
        if previous is None or previous >= nominal:
            period = ONCE_PERIOD_S
        else:
            period = (nominal - previous).total_seconds()
    keep = max(opts.lock_at_least, 2 * period + 2 * opts.skew + 60)
    run = run_id(nominal)
    key = run_claim_key(opts.key_prefix, name, run)
    record = max(RECORD_KEEP_S, 2 * keep, reach_s + keep)
    note = RunNote(nominal_ms=int(run), record_ms=round(record * 1000))
    return Run(name, run, key, round(keep * 1000), note)
