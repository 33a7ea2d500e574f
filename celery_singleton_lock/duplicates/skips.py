"""What a skipped duplicate leaves behind: its result marker, and how callers read it.

A duplicate skipped under ``singleton_on_duplicate="skip"`` ends as a ``SUCCESS`` whose result
is the marker below, naming the lock key and the run holding it (under ``"coalesce"`` also the
follow-up run its call was coalesced into, duplicates/coalesce.py); :func:`skip_info` decodes it
from a result or an AsyncResult. The body, ``on_success`` and ``task_success`` do not run; on a
worker, what follows it in a canvas does not run either and holds the same marker
(duplicates/canvas.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from celery.exceptions import Ignore

__all__ = ["SKIP_MARKER", "SkipInfo", "Skipped", "skip_info", "skip_marker"]

#: Key of the result a skipped duplicate stores (its value is True).
SKIP_MARKER = "__singleton_skipped__"


@dataclass(frozen=True)
class SkipInfo:
    """Why a duplicate was skipped: its lock key and the task id holding it.

    ``task_id`` is the skipped duplicate's. A canvas step that did not run because of it (the
    rest of a chain, a chord's body: duplicates/canvas.py) holds the same marker, so there
    ``task_id``
    names the step that was skipped, not the step itself.
    """

    key: str
    holder: str
    task_id: str
    #: under ``singleton_on_duplicate="coalesce"``: the task id of the one follow-up run its
    #: call was coalesced into (published when ``holder`` releases the lock), else None
    follow_up: str | None = None
    #: why it was skipped: ``"duplicate"`` (its key was held), ``"rate"`` (the key's
    #: ``singleton_rate_limit`` allowed no start; ``holder`` is then the last run that started)
    #: or ``"debounced"`` (a later call of its burst superseded it)
    reason: str = "duplicate"
    #: under ``"rate"``: when the next start of the key is allowed (epoch seconds), else None
    next_start: float | None = None
    #: under ``singleton_debounce``: the later call of its burst that superseded it (also
    #: ``holder``), else None
    superseded_by: str | None = None


def skip_marker(
    key: str,
    holder: str,
    task_id: str,
    follow_up: str | None = None,
    next_start: float | None = None,
    *,
    superseded_by: str | None = None,
) -> dict[str, Any]:
    """The result a skipped duplicate stores; a coalesced one also names its follow-up, one
    over a rate limit (``next_start``, epoch seconds) when the next start is allowed, a
    debounced call the later call that superseded it."""
    marker = {SKIP_MARKER: True, "key": key, "holder": holder, "task_id": task_id}
    if follow_up is not None:
        marker["coalesced_into"] = follow_up
    if next_start is not None:
        marker["reason"] = "rate"
        marker["next_start"] = next_start
    if superseded_by is not None:
        marker["reason"] = "debounced"
        marker["superseded_by"] = superseded_by
    return marker


def skip_info(value: Any) -> SkipInfo | None:
    """The :class:`SkipInfo` when ``value`` (a result or an AsyncResult) is a skipped duplicate."""
    if hasattr(value, "ready") and hasattr(value, "result"):
        value = value.result if value.ready() else None
    if isinstance(value, Mapping) and value.get(SKIP_MARKER) is True:
        follow_up = value.get("coalesced_into")
        next_start, superseded_by = value.get("next_start"), value.get("superseded_by")
        return SkipInfo(
            str(value["key"]),
            str(value["holder"]),
            str(value["task_id"]),
            None if follow_up is None else str(follow_up),
            str(value.get("reason", "duplicate")),
            None if next_start is None else float(next_start),
            None if superseded_by is None else str(superseded_by),
        )
    return None


class Skipped(Ignore):  # type: ignore[misc]
    """How a skip ends where Celery's tracer runs it: an eager ``apply()`` (which returns the
    marker as a ``SUCCESS``), or a direct ``__call__``. A worker's run ends without it
    (task/tracer.py)."""

    def __init__(self, marker: Mapping[str, Any]) -> None:
        super().__init__(dict(marker))  # args = (marker,): pickles from a pool child
        self.marker = dict(marker)
