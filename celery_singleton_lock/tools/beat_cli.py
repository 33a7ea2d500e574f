"""``celery -A proj singleton beat ...``: status, run, pause and resume the beat's entries.

The Redis work is :mod:`celery_singleton_lock.beat.steering`'s; this module is the click glue,
what it prints and its log lines. An entry is named as the schedule names it: the entries the
running beats registered, and those of the app's ``beat_schedule``. Any other name is refused
(exit code 1) before anything is written.
"""

from __future__ import annotations

import getpass
import json
import logging
import re
import socket
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, NoReturn, TypeVar

import click

from ..beat.described import next_due, schedule_text
from ..beat.steering import Ask, Steering, steering_clients
from ..core.backend import REDIS_ERRORS
from ..errors import LockUnavailableError
from .columns import aligned, tab_separated

__all__ = ["beat"]

logger = logging.getLogger("celery_singleton_lock.tools.cli")

T = TypeVar("T")

_FAILURES: tuple[type[Exception], ...] = (LockUnavailableError, *REDIS_ERRORS)
#: How often ``run`` looks whether a beat published the asked run (seconds).
WAIT_STEP_S = 0.1
_COLUMNS = ("ENTRY", "TASK", "SCHEDULE", "LAST RUN", "BY", "PUBLISHED", "NEXT DUE", "STATE")


@dataclass
class _Beat:
    """What a beat command works on: the group's steering, the app, where (for errors)."""

    target: Any
    group: str
    _steering: Steering | None = None

    @property
    def steering(self) -> Steering:
        if self._steering is None:
            clients = self._call(lambda: steering_clients(self.target.redis_url))
            self._steering = Steering(clients, self.target.prefix, self.group)
        return self._steering

    def _call(self, call: Callable[[], T]) -> T:
        try:
            return call()
        except _FAILURES as exc:  # REDIS_ERRORS: a cluster's client connects as it is made
            self.target.fail(exc)
            raise  # not reached: fail() raises

    def call(self, method: Callable[..., T], *args: Any) -> T:
        return self._call(lambda: method(*args))

    def close(self) -> None:
        if self._steering is not None:
            for client in self._steering.clients:
                client.close()

    def entries(self) -> dict[str, str]:
        """The schedule: the entries the beats registered, and the app's ``beat_schedule``
        (name -> description; "" for an entry no beat registered)."""
        found = self.call(self.steering.registered)
        conf = getattr(getattr(self.target, "app", None), "conf", None)
        for name in (conf.get("beat_schedule") if conf is not None else None) or {}:
            found.setdefault(str(name), "")
        return found

    def entry(self, name: str) -> str:
        """``name``, checked against the schedule."""
        entries = self.entries()
        if name in entries:
            return name
        if not entries:
            self.refuse(
                f"no entry {name!r}: no beat of group {self.group!r} registered a schedule "
                f"under prefix {self.target.prefix!r}, and the app has no beat_schedule"
            )
        known = sorted(entries)
        shown = ", ".join(known[:20]) + (f" and {len(known) - 20} more" if len(known) > 20 else "")
        self.refuse(f"no entry {name!r} in the schedule of beat group {self.group!r}: {shown}")

    @staticmethod
    def refuse(message: str) -> NoReturn:
        raise click.ClickException(message)


def _operator() -> str:
    """Who acts: ``user@host``, without spaces (the values it goes in are space-separated)."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return re.sub(r"\s", "_", f"{user}@{socket.gethostname()}") or "operator"


def _iso(ms: int | None) -> str | None:
    if ms is None:
        return None
    return datetime.fromtimestamp(ms / 1000, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _pause_of(value: str | None) -> dict[str, Any] | None:
    if value is None:
        return None
    by, _sep, at = value.rpartition(" ")
    return {"by": by or value, "at": _iso(int(at)) if at.isdigit() else None}


@click.group(name="beat")
@click.option(
    "--group", default=None, help="The beat group: the app's main name (default: the app's)."
)
@click.pass_context
def beat(ctx: click.Context, group: str | None) -> None:
    """Status, run, pause and resume the entries of the beats that use SingletonScheduler."""
    target = ctx.obj
    app = getattr(target, "app", None)
    group = group or str(getattr(app, "main", None) or "celery")
    ctx.obj = state = _Beat(target, group)
    ctx.call_on_close(state.close)


@beat.command(name="status")
@click.option("--json", "as_json", is_flag=True, help="One JSON object.")
@click.pass_obj
def status(state: _Beat, as_json: bool) -> None:
    """Each entry: its last run, which beat published it and when, its next due time, and
    whether it is paused or a run of it was asked for."""
    entries = state.entries()
    names = sorted(entries)
    steering = state.steering
    records = state.call(steering.records, names)
    pauses = state.call(steering.pauses, names)
    asks = {ask.entry: ask for ask in state.call(steering.asks)}
    beats = state.call(steering.beats)
    now = datetime.now(timezone.utc)
    app = getattr(state.target, "app", None)
    rows: list[dict[str, Any]] = []
    for name, record, pause in zip(names, records, pauses, strict=True):
        described = entries[name]
        found = json.loads(described) if described else {}
        ask = asks.get(name)
        due = next_due(described, now, app) if described else None
        rows.append(
            {
                "entry": name,
                "task": found.get("task"),
                "schedule": schedule_text(described) if described else None,
                "catch_up": found.get("catch_up"),
                "registered": bool(described),
                "last_run": _iso(record.nominal_ms) if record else None,
                "last_run_by": record.by if record else None,
                "published_at": _iso(record.at_ms) if record else None,
                "task_id": record.task_id if record else None,
                "next_due": None if due is None else due.strftime("%Y-%m-%dT%H:%M:%SZ"),
                "paused": _pause_of(pause),
                "asked": None if ask is None else {"by": ask.by, "at": _iso(ask.at_ms)},
            }
        )
    seen = [{"instance": b, "seen_at": _iso(ms)} for b, ms in sorted(beats.items())]
    if as_json:
        click.echo(json.dumps({"group": state.group, "beats": seen, "entries": rows}, indent=2))
        return
    click.echo(f"beat group {state.group}: {len(seen)} beat(s) publishing in the last hour")
    for one in seen:
        click.echo(f"  {one['instance']}  last seen {one['seen_at']}")
    table = (_cells(row) for row in rows)
    lines = aligned(_COLUMNS, table) if sys.stdout.isatty() else tab_separated(_COLUMNS, table)
    for line in lines:
        click.echo(line)


def _cells(row: dict[str, Any]) -> list[str]:
    state = "active"
    if row["paused"] is not None:
        state = f"paused by {row['paused']['by']} since {row['paused']['at']}"
    if row["asked"] is not None:
        state += f", run asked by {row['asked']['by']}"
    if not row["registered"]:
        state += " (no beat registered it)"
    return [
        row["entry"],
        row["task"] or "-",
        row["schedule"] or "-",
        row["last_run"] or "-",
        row["last_run_by"] or "-",
        row["published_at"] or "-",
        row["next_due"] or "-",
        state,
    ]


@beat.command(name="pause")
@click.argument("entry")
@click.pass_obj
def pause(state: _Beat, entry: str) -> None:
    """Every beat skips ENTRY's runs until it is resumed (an asked run still goes out)."""
    name = state.entry(entry)
    by, now_ms = _operator(), int(time.time() * 1000)
    found = state.call(state.steering.pause, name, by, now_ms)
    paused = _pause_of(found) or {}
    if found != f"{by} {now_ms}":
        click.echo(f"already paused: entry={name} by={paused['by']} since={paused['at']}")
        return
    click.echo(f"paused: entry={name} by={by} since={paused['at']}")
    logger.info("beat entry paused: entry=%s by=%s", name, by)


@beat.command(name="resume")
@click.argument("entry")
@click.pass_obj
def resume(state: _Beat, entry: str) -> None:
    """Every beat publishes ENTRY's runs again, from its next one (the runs skipped meanwhile
    are not caught up)."""
    name = state.entry(entry)
    if state.call(state.steering.resume, name):
        click.echo(f"resumed: entry={name}")
        logger.info("beat entry resumed: entry=%s by=%s", name, _operator())
    else:
        click.echo(f"not paused: entry={name}")


@beat.command(name="run")
@click.argument("entry")
@click.option(
    "--timeout",
    default=10.0,
    show_default=True,
    type=click.FloatRange(min=1.0),
    help="Seconds to wait for a beat to publish the run.",
)
@click.pass_obj
def run_now(state: _Beat, entry: str, timeout: float) -> None:
    """Publish one run of ENTRY now, through the running beats: one beat publishes it, once.
    Asked again within the timeout (by anyone), it is the same run. Fails if no beat took it
    within the timeout (then nothing is published)."""
    name = state.entry(entry)
    steering = state.steering
    by = _operator()
    ask = state.call(steering.ask, name, by, int(time.time() * 1000), round(timeout * 1000))
    if ask.by != by:
        click.echo(f"a run of {name} was asked already by {ask.by} at {_iso(ask.at_ms)}: waiting")
    logger.info("beat run asked: entry=%s run=%s by=%s", name, ask.run, by)
    claim = _wait(state, ask)
    if claim is None:  # past its `until` (and a beat's skew): no beat will take it now
        state.call(steering.forget, ask)
        claim = state.call(steering.claim_of, ask)
    if claim is None:
        state.refuse(
            f"no beat of group {state.group!r} took the run of {name} within {timeout:g}s: "
            "nothing was published (is a beat with SingletonScheduler running?)"
        )
    kind, beat_id, *task = claim.split(" ")
    if kind == "done":  # the ask stays until its end: asked again meanwhile, it is this run
        click.echo(f"published: entry={name} run={ask.run} task_id={task[-1]} by={beat_id}")
    else:
        click.echo(f"claimed: entry={name} run={ask.run} by={beat_id} (publishing)")


def _wait(state: _Beat, ask: Ask) -> str | None:
    """The asked run's claim once published; None if not published by the ask's end (plus a
    second: a beat does not take an ask past its end)."""
    for _ in _until(ask.until_ms / 1000 + 1.0):
        claim = state.call(state.steering.claim_of, ask)
        if claim is not None and claim.startswith("done "):
            return claim
    return None


def _until(deadline: float) -> Iterator[None]:
    while True:
        yield None
        if time.time() >= deadline:
            return
        time.sleep(WAIT_STEP_S)
