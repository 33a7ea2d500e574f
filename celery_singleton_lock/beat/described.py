"""A beat entry as the beats register it for operators (steering.py): its task, its schedule and
its catch-up choice, as JSON; and, from that, when it next comes due.

Never its arguments nor its options beyond the catch-up choice: what an operator's tools show
must hold no secret an entry's arguments may carry.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Any

from celery.schedules import crontab, solar
from celery.utils.time import ffwd

from .catch_up import catch_up_of
from .runs import is_interval
from .schedules import interval_slot, slot_start

__all__ = ["describe", "next_due", "schedule_text"]


def describe(entry: Any, default_catch_up: str | float) -> str:
    """``entry`` (a Celery ``ScheduleEntry``) as registered: JSON of its task, schedule and
    catch-up choice."""
    sched = entry.schedule
    spec: dict[str, Any]
    if is_interval(sched):
        spec = {"every": sched.run_every.total_seconds()}
    elif isinstance(sched, crontab):
        fields = ("minute", "hour", "day_of_month", "month_of_year", "day_of_week")
        spec = {"crontab": " ".join(str(getattr(sched, f"_orig_{f}")) for f in fields)}
    elif isinstance(sched, solar):
        spec = {"solar": [sched.event, float(sched.lat), float(sched.lon)]}
    else:
        spec = {"other": type(sched).__name__}
    catch_up, _problem = catch_up_of(entry.options, default_catch_up)
    described = {"task": entry.task, "schedule": spec, "catch_up": str(catch_up)}
    return json.dumps(described, sort_keys=True, separators=(",", ":"))


def _read(described: str) -> dict[str, Any]:
    try:
        found = json.loads(described)
    except ValueError:
        return {}
    return found if isinstance(found, dict) else {}


def schedule_text(described: str) -> str:
    """The schedule of a registered entry, in words: ``every 10s``, ``crontab(0 4 * * *)``."""
    spec = _read(described).get("schedule") or {}
    if "every" in spec:
        return f"every {spec['every']:g}s"
    if "crontab" in spec:
        return f"crontab({spec['crontab']})"
    if "solar" in spec:
        event, lat, lon = spec["solar"]
        return f"solar({event}, {lat:g}, {lon:g})"
    return str(spec.get("other", "?"))


def next_due(described: str, now: datetime, app: Any) -> datetime | None:
    """When a registered entry next comes due after ``now`` (aware), by ``app``'s time zone;
    None for a schedule it cannot tell (a clocked one, a custom type)."""
    spec = _read(described).get("schedule") or {}
    if "every" in spec:
        every = float(spec["every"])
        return slot_start(every, interval_slot(every, now.timestamp()) + 1)
    if "crontab" in spec:
        minute, hour, day_of_month, month_of_year, day_of_week = spec["crontab"].split(" ")
        sched: Any = crontab(
            minute=minute,
            hour=hour,
            day_of_month=day_of_month,
            month_of_year=month_of_year,
            day_of_week=day_of_week,
            app=app,
        )
    elif "solar" in spec:
        sched = solar(*spec["solar"], app=app)
    else:
        return None
    local = now.astimezone(app.timezone) if app is not None else now
    if isinstance(sched, crontab):  # the next time after ``local``, by the app's time zone
        start, ends_in, _now = sched.remaining_delta(local, ffwd=ffwd)
        due: datetime = (start + ends_in).astimezone(timezone.utc)
    else:  # solar: how long from Celery's now until the next event after ``local``
        due = (sched.now() + sched.remaining_estimate(local)).astimezone(timezone.utc)
    return due
