"""Claiming and publishing scheduled runs: many in a round trip, each published once.

:func:`claim_and_publish` claims runs in one round trip (:meth:`.claims.Claims.claim_many`),
publishes each run this instance won, labelled with the run's headers, and confirms those
published in one more round trip. A run lost to another instance, or that Redis could not
claim, is looked at again later (the scheduler's rechecks). With Sentry Crons on, a run's
in-progress check-in is sent once its message went out (crons.py).
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Callable
from typing import Any

from celery.beat import ScheduleEntry

from ..errors import LockUnavailableError
from .claims import CLAIM_HEADER, KEEP_HEADER, RUN_HEADER, Claim
from .crons import BeatCrons, CheckIn, beat_crons
from .leader import ERROR_RETRY_S, BeatState
from .runs import Run

__all__ = ["NOT_PUBLISHED", "PUBLISH_LEASE_S", "NotPublished", "claim_and_publish"]

#: the scheduler's logger
logger = logging.getLogger(f"{__package__}.scheduler")

#: How long a claim may stay unconfirmed while its instance publishes the run. An
#: instance that dies in that window delays the run by at most this much.
PUBLISH_LEASE_S = 10.0
#: How many runs' messages go to the broker in one publish batch.
PUBLISH_CHUNK = 500


def claim_and_publish(
    sched: Any,
    state: BeatState,
    runs: list[tuple[ScheduleEntry, Run]],
    publish: Callable[[ScheduleEntry], Any],
    batch: Callable[[], contextlib.AbstractContextManager[object]] = contextlib.nullcontext,
) -> list[Any]:
    """Claim ``runs`` in one round trip, publish each run won with ``publish`` (given the
    entry labelled with the run's headers), confirm those published in one round trip.

    The publishes go in chunks of :data:`PUBLISH_CHUNK`, each inside ``batch()`` (the
    producer's publish batch: one pipeline to a Redis broker, sent as the block ends); a run
    counts as published once its chunk went out. Returns what ``publish`` returned, None for a
    run not published. A run is published only while its claim is younger than half the publish
    lease: once half of it has gone, the runs published are confirmed and the claims not
    published yet are claimed again, in a round trip each. ``publish`` raising gives up the
    claims not published yet (its chunk's too: the batch drops them), confirms those published,
    and raises (``NotPublished``: only that run). A chunk whose batch fails as it is sent may
    have gone out in part: its claims are left pending, and the runs looked at again when they
    expire.
    """
    results: list[Any] = [None] * len(runs)
    if not runs:
        return results
    claimed_at = sched.singleton_monotonic()
    claims = _claim_many(sched, state, [run for _e, run in runs])
    if state.opts.mode == "leader" and _deposed(sched, state, runs, claims):
        return results
    crons = beat_crons(sched.app)  # Sentry Crons' check-ins, sent once a chunk went out
    give_up: list[Run] = []
    published: list[tuple[Run, str]] = []
    out: list[CheckIn] = []  # the check-ins of runs whose message went out, not sent yet
    try:
        for start in range(0, len(runs), PUBLISH_CHUNK):
            sent: list[tuple[Run, str]] = []
            check_ins: list[CheckIn] = []
            stop = min(start + PUBLISH_CHUNK, len(runs))
            index, sending = start, False
            try:
                with batch():
                    for index in range(start, stop):
                        entry, run = runs[index]
                        if sched.singleton_monotonic() - claimed_at > PUBLISH_LEASE_S / 2 and (
                            _is_won(claims[index])
                        ):
                            # half the lease gone (a long batch, or a pause): another instance
                            # may take these claims soon. Confirm what is published; claim the
                            # rest again (our own pending claims get a fresh lease; one taken
                            # meanwhile is lost).
                            _end_claims(state, [], published)
                            published = []
                            rest = [j for j in range(index, len(runs)) if _is_won(claims[j])]
                            claimed_at = sched.singleton_monotonic()
                            again = _claim_many(sched, state, [runs[j][1] for j in rest])
                            for j, claim in zip(rest, again, strict=True):
                                claims[j] = claim
                        if not _won(sched, state, entry, run, claims[index]):
                            continue
                        try:
                            results[index] = _publish(publish, entry, run, crons, check_ins)
                        except NotPublished:
                            give_up.append(run)
                            continue
                        sent.append((run, str(getattr(results[index], "id", "") or "-")))
                    sending = True
            except BaseException as exc:
                if sending:  # the batch failed as it was sent: it may have gone out in part
                    logger.error("beat: publishing a batch of runs failed, retrying: %s", exc)
                    for run, _task in sent:
                        sched._recheck_later(run, PUBLISH_LEASE_S + 0.05)
                    index = stop
                else:  # a publish raised: the batch dropped the messages it held
                    give_up += [run for run, _task in sent]
                give_up += [
                    r for j, (_e, r) in enumerate(runs) if j >= index and _is_won(claims[j])
                ]
                raise
            published += sent
            out += check_ins
            _send_check_ins(crons, out)
    finally:
        _send_check_ins(crons, out)  # also when beat's SIGTERM lands after a chunk went out
        _end_claims(state, give_up, published)
    return results


def _send_check_ins(crons: BeatCrons | None, out: list[CheckIn]) -> None:
    """Send (and take off ``out``) the in-progress check-ins of runs whose message went out."""
    while crons is not None and out:
        crons.sent(out.pop(0))


def _publish(
    publish: Callable[[ScheduleEntry], Any],
    entry: ScheduleEntry,
    run: Run,
    crons: BeatCrons | None,
    check_ins: list[CheckIn],
) -> Any:
    """``publish`` the run labelled with its headers; with Sentry Crons, its check-in's too
    (sent once the message went out: noted in ``check_ins``), Sentry's own held off."""
    labelled = _labelled(entry, run)
    if crons is None or (check_in := crons.label(entry, labelled)) is None:
        return publish(labelled)
    with crons.held():
        result = publish(labelled)
    check_ins.append(check_in)
    return result


def _claim_many(
    sched: Any, state: BeatState, runs: list[Run]
) -> list[Claim | LockUnavailableError]:
    """Claim ``runs`` for the publish lease, in one round trip; each its claim or error. What
    the round trip says of Redis goes to the instance's outage (logged once)."""
    lease_ms = round(PUBLISH_LEASE_S * 1000)
    keeps = [run.keep_ms for run in runs]
    notes = [run.note for run in runs]
    keys = [run.key for run in runs]
    claims = _many(lambda items: state.claims.claim_many(items, lease_ms, keeps, notes), keys)
    _heard(sched, state, claims)
    return claims


def _is_won(claim: Claim | LockUnavailableError) -> bool:
    return isinstance(claim, Claim) and claim.won


def _won(
    sched: Any,
    state: BeatState,
    entry: ScheduleEntry,
    run: Run,
    claim: Claim | LockUnavailableError,
) -> bool:
    """Whether ``claim`` won ``run``; else logged, and looked at again when it may end (a
    claim of another instance's is watched: outage.py)."""
    if isinstance(claim, LockUnavailableError):  # the outage is logged once (_heard)
        logger.debug("beat: run not claimed, retrying: entry=%s run=%s", entry.name, run.run)
        sched._recheck_later(run, ERROR_RETRY_S)
        return False
    if claim.won or claim.published:
        state.outage.settled(run)
    sched._singleton_watching.saw(run)  # won, or another's: not caught up again
    if claim.won:
        return True
    if claim.paused:
        logger.info(
            "beat: entry paused, run not published: entry=%s run=%s paused_by=%s",
            entry.name,
            run.run,
            claim.holder,
        )
        return False
    logger.info(
        "beat: run already claimed: entry=%s run=%s by=%s published=%s",
        entry.name,
        run.run,
        claim.holder,
        claim.published,
    )
    if not claim.published:  # its claimer may die before publishing: look again
        state.outage.watch(run)
        sched._recheck_later(run, claim.pttl_ms / 1000 + 0.05)
    return False


def _heard(sched: Any, state: BeatState, claims: list[Claim | LockUnavailableError]) -> None:
    """What a round trip of claims says of Redis: an outage starts, or one ends (logged once)."""
    error = next((c for c in claims if isinstance(c, LockUnavailableError)), None)
    if error is not None:
        state.outage.failed(error, sched.singleton_monotonic())
    elif claims:
        state.outage.answered(sched.singleton_monotonic())


def _deposed(
    sched: Any,
    state: BeatState,
    runs: list[tuple[ScheduleEntry, Run]],
    claims: list[Claim | LockUnavailableError],
) -> bool:
    """Leader mode: whether this instance stopped leading while its claims were out (a call
    that waited for its timeouts can outlive the lease); if so, the runs it won are given up."""
    won = [j for j, claim in enumerate(claims) if _is_won(claim)]
    if not won or sched._singleton_lead(state):
        return False
    for j in won:
        logger.warning("beat: not the leader, run not published: entry=%s", runs[j][0].name)
    _end_claims(state, [runs[j][1] for j in won], [])
    return True


def _end_claims(state: BeatState, give_up: list[Run], published: list[tuple[Run, str]]) -> None:
    """Give up the claims of runs not published and confirm those published: a round trip
    each."""
    if give_up:
        for run, outcome in zip(
            give_up, _many(state.claims.unclaim_many, [r.key for r in give_up]), strict=True
        ):
            if isinstance(outcome, LockUnavailableError):
                logger.warning("beat: could not give up claim %s: %s", run.key, outcome)
    if not published:
        return
    items = [(run.key, task_id, run.keep_ms) for run, task_id in published]
    notes = [run.note for run, _task in published]
    confirmed_all = _many(lambda items_: state.claims.confirm_many(items_, notes), items)
    for (run, task_id), confirmed in zip(published, confirmed_all, strict=True):
        if isinstance(confirmed, LockUnavailableError):  # the pending claim still blocks others
            logger.warning(
                "beat: could not confirm run: entry=%s run=%s: %s",
                run.entry_name,
                run.run,
                confirmed,
            )
        elif not confirmed:  # our claim expired while publishing: another may publish too
            logger.error(
                "beat: claim expired while publishing, run may be duplicated: "
                "entry=%s run=%s task_id=%s",
                run.entry_name,
                run.run,
                task_id,
            )
        logger.info(
            "beat: published run: entry=%s run=%s task_id=%s", run.entry_name, run.run, task_id
        )


#: What a claimed run's publish through ``apply_entry`` left when it did not publish.
NOT_PUBLISHED = object()


class NotPublished(Exception):
    """``apply_entry`` did not publish the run (it logged why)."""


def _many(call: Callable[[Any], list[Any]], items: list[Any]) -> list[Any]:
    """``call(items)``, each item's outcome; a call that raised: its error for every item."""
    try:
        return call(items)
    except LockUnavailableError as exc:
        return [exc] * len(items)


def _labelled(entry: ScheduleEntry, run: Run) -> ScheduleEntry:
    """A copy of ``entry`` whose message carries ``run``'s headers (its options copied)."""
    labelled = _shallow_copy(entry)
    labelled.options = copy.deepcopy(entry.options)
    labelled.options.setdefault("headers", {}).update(
        {RUN_HEADER: f"{entry.name}@{run.run}", CLAIM_HEADER: run.key, KEEP_HEADER: run.keep_ms}
    )
    return labelled


def _shallow_copy(entry: ScheduleEntry) -> ScheduleEntry:
    """A shallow copy of ``entry``, its attributes shared.

    Not ``copy.copy``: that goes through ``ScheduleEntry.__reduce__``, which calls the class with
    ScheduleEntry's own arguments, and an entry class with another signature (django-celery-beat's
    ``ModelEntry(model, app)``) fails there with a TypeError, so no run would be published.
    """
    clone: ScheduleEntry = object.__new__(type(entry))
    clone.__dict__.update(entry.__dict__)
    return clone
