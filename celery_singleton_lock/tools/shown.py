"""What ``celery singleton`` prints for people: the rows of ``list`` and ``purge``, the text of
``show`` and ``stats``.

Every value goes through :func:`celery_singleton_lock.tools.columns.cell` (an argument preview
or a task name can hold any character: a tab or an escape sequence must not reach the
terminal). A lock and a marker (core/markers.py) share the columns: a marker's row has its kind
as STATE, the call it marks as HOLDER (queued), its follow-up as PENDING (pending), its calls
as QUEUE (joiners), and its own ttl and key.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import fields
from typing import Any

from ..core.admin import LockInfo, Stats
from ..core.markers import Marker
from .columns import cell

__all__ = [
    "COLUMNS",
    "ago",
    "describe",
    "describe_marker",
    "json_object",
    "marker_row",
    "pending_cell",
    "permit_cell",
    "queue_cell",
    "row",
    "seconds",
    "stats_lines",
    "text",
]


def seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}s"


def ago(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}s ago"


def text(value: object) -> str:
    return "-" if value is None else str(value)


COLUMNS = (
    "TASK",
    "HOLDER",
    "STATE",
    "HOST",
    "PID",
    "AGE",
    "TTL",
    "TOKEN",
    "RENEWED",
    "PENDING",
    "QUEUE",
    "PERMIT",
    "ARGS",
    "KEY",
)


def row(info: LockInfo) -> tuple[str, ...]:
    return (
        text(info.task),
        text(info.owner),
        info.state,
        text(info.host),
        text(info.pid),
        seconds(info.age_s),
        seconds(info.ttl_s),
        text(info.token),
        "-" if info.ended_ms is not None else seconds(info.renewed_s),
        pending_cell(info),
        queue_cell(info),
        permit_cell(info),
        text(info.args),
        info.key,
    )


def permit_cell(info: LockInfo) -> str:
    """``2/3``: the slot a run holds of a key with 3 permits; ``-`` for a single lock."""
    return "-" if info.permit is None else f"{info.permit}/{text(info.permits)}"


def describe(info: LockInfo) -> str:
    """Every field of one lock, a line each."""
    lines = [
        f"key:       {info.key}",
        f"task:      {text(info.task)}",
        f"args:      {text(info.args)}",
        f"holder:    {text(info.owner)} (retries {text(info.generation)})",
        f"worker:    {text(info.host)} pid {text(info.pid)}",
        f"age:       {seconds(info.age_s)}",
        f"ttl:       {seconds(info.ttl_s)} left of {seconds(info.lease_s)}",
        f"token:     {text(info.token)}",
    ]
    if info.permit is not None:
        lines.append(f"permit:    {info.permit} of {text(info.permits)} (runs of this key at once)")
    if info.handed:  # nobody renews it until the call's message comes
        lines.append(
            f"state:     handed to the queued call {text(info.owner)}: waits "
            f"{seconds(info.ttl_s)} more for its message"
        )
    elif info.ended_ms is None:
        lines.append(f"renewed:   {ago(info.renewed_s)}")
        lines.append("state:     running")
    else:  # an at-least window: nobody renews it, it expires at the window's end
        ended_s = None if info.since_ms is None else (info.ended_ms - info.since_ms) / 1000
        lines.append(
            f"state:     window: the run ended {seconds(ended_s)} after it started; the key "
            f"stays blocked for {seconds(info.ttl_s)} more"
        )
    if info.pending_follow_up is not None:
        who = "the run releases" if info.permit is None else "the first of the key's runs releases"
        lines.append(f"pending:   {pending_cell(info)} (published when {who})")
    if info.queue_length:
        lines.append(
            f"queue:     {info.queue_length} calls wait, next {text(info.queue_head)} (each "
            "release hands the key to the next)"
        )
    return "\n".join(cell(line) for line in lines)


def queue_cell(info: LockInfo) -> str:
    """The calls waiting in line for the key: ``<n> next=<id>``, else ``-``."""
    if not info.queue_length:
        return "-"
    return f"{info.queue_length} next={text(info.queue_head)}"


def pending_cell(info: LockInfo) -> str:
    """The coalesced follow-up waiting beside the lock: ``<id> (<n> duplicates)``, else ``-``."""
    if info.pending_follow_up is None:
        return "-"
    return f"{info.pending_follow_up} ({text(info.pending_count)} duplicates)"


#: Every field of a lock object of ``list --json``: a marker's object has them all too (those
#: that are not its own are null), so a script that reads a lock's fields reads a marker's
_LOCK_FIELDS = dict.fromkeys(field.name for field in fields(LockInfo))


def json_object(item: LockInfo | Marker) -> dict[str, Any]:
    """The object ``list --json`` prints for a lock or a marker."""
    return item.as_dict() if isinstance(item, LockInfo) else {**_LOCK_FIELDS, **item.as_dict()}


def marker_row(marker: Marker) -> tuple[str, ...]:
    """The cells of a marker under :data:`COLUMNS`."""
    follow_up = "-"
    if marker.pending_follow_up is not None:
        follow_up = f"{marker.pending_follow_up} ({text(marker.pending_count)} duplicates)"
    return (
        text(marker.task),
        text(marker.call),
        marker.kind,
        "-",
        "-",
        "-",
        seconds(marker.ttl_s),
        "-",
        "-",
        follow_up,
        "-" if marker.joiners is None else f"{marker.joiners} joined",
        "-",
        "-",
        marker.key,
    )


def describe_marker(marker: Marker) -> str:
    """Every field of a publish-time marker, a line each."""
    lines = [
        f"key:       {marker.key}",
        f"task:      {text(marker.task)}",
        f"state:     queued: the call {text(marker.call)} was published and has not started",
        f"ttl:       {seconds(marker.ttl_s)} (until then delay() of these arguments publishes "
        "nothing)",
        f"lock:      {marker.lock_key}",
    ]
    return "\n".join(cell(line) for line in lines)


def stats_lines(redis: str, prefix: str, totals: Stats) -> Iterator[str]:
    """The totals of ``stats``, labels padded to one column, counts right-aligned."""
    pairs = [
        ("redis", redis),
        ("prefix", prefix),
        ("locks", str(totals.locks)),
        ("  running", str(totals.running)),
        ("  at-least windows", str(totals.windows)),
        ("  handed to a queued call", str(totals.handed)),
        ("without ttl", str(totals.without_ttl)),
        ("oldest", seconds(totals.oldest_age_s)),
        ("longest since renewal", seconds(totals.longest_since_renewal_s)),
        ("longest window left", seconds(totals.longest_window_s)),
        ("publish-time markers", str(totals.queued)),
        ("longest marker left", seconds(totals.longest_queued_s)),
        ("pending follow-ups", str(totals.pending)),
        ("joined calls", f"{totals.joiners} (beside {totals.joined_keys} locks)"),
    ]
    label = max(len(name) for name, _ in pairs) + 2
    for name, value in pairs:
        yield cell(f"{name + ':':<{label}}{value}")
    for title, counts in (("by task", totals.by_task), ("by worker", totals.by_host)):
        yield f"{title}:"
        ordered = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
        size = max((len(str(count)) for _, count in ordered), default=1)
        for name, count in ordered:
            yield cell(f"  {count:>{size}}  {name}")
