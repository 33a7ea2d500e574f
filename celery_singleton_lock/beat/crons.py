"""Sentry Crons behind several beats: one in-progress check-in per scheduled run, sent by the
instance that published it, and closed once on the worker, a skipped run included.

sentry-sdk's Celery integration (``CeleryIntegration(monitor_beat_tasks=True)``) wraps Celery's
``Scheduler.apply_entry``: it sends an in-progress check-in, puts its id in the entry's headers
and lets ``apply_entry`` publish; the worker's ``task_success`` / ``task_failure`` /
``task_retry`` close it. The mixin calls ``apply_entry`` only for runs whose claim it won (a
tick of a scheduler's own that calls ``apply_entry`` claims first), so an instance that loses a
claim sends nothing. What is left is the order inside the winner: a check-in sent before the
message went out stays open when the publish fails or the instance dies before its batch is
sent, and the run, published again by another instance, gets a second one. So, for the runs
the mixin publishes, :class:`BeatCrons` writes the same headers itself (Sentry's slug and
monitor config, a fresh check-in id), holds Sentry's own check-in off for that call and sends
the in-progress check-in once the message is out (:meth:`BeatCrons.sent`).

On the worker, Sentry closes a check-in at ``task_success``, which a duplicate skipped by the
library never sends: :func:`close_skipped` (called where a skip is reported) closes it as
``ok``, as Sentry closes a run that succeeded. Sentry also closes it as ``error`` at every
``task_retry``, also when the library puts a duplicate back in the queue: :func:`requeued`
leaves that to the copy, which carries the check-in. A run's second message, which the
worker's witness drops, is closed as ``ok`` (:func:`close_dropped`).

Nothing is imported from sentry_sdk: its modules are looked up in ``sys.modules``, so this does
something only in a process that set up Sentry's Celery integration.
"""

from __future__ import annotations

import contextlib
import sys
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["BeatCrons", "CheckIn", "beat_crons", "close_dropped", "close_skipped", "requeued"]

_CELERY = "sentry_sdk.integrations.celery"
_BEAT = "sentry_sdk.integrations.celery.beat"
#: the header Sentry's closers look for: a delivery without it closes no check-in
_SLUG = "sentry-monitor-slug"
_CHECK_IN_ID = "sentry-monitor-check-in-id"


@dataclass(frozen=True)
class CheckIn:
    """A run's check-in, written in its message's headers, not sent yet."""

    slug: str
    check_in_id: str
    config: Any


def _integration() -> Any:
    """Sentry's Celery integration if this process set it up with beat monitoring, else None."""
    celery_integration = sys.modules.get(_CELERY)
    if celery_integration is None or _BEAT not in sys.modules:
        return None
    client = sys.modules["sentry_sdk"].get_client()
    integration = client.get_integration(celery_integration.CeleryIntegration)
    if integration is None or not integration.monitor_beat_tasks:
        return None
    return integration


def beat_crons(app: Any) -> BeatCrons | None:
    """The check-ins of ``app``'s scheduled runs, if Sentry monitors them in this process."""
    integration = _integration()
    if integration is None:
        return None
    beat = sys.modules[_BEAT]
    if not all(  # a Sentry we do not know: its own apply_entry wrapper sends the check-ins
        callable(getattr(beat, name, None))
        for name in ("_get_monitor_config", "match_regex_list", "capture_checkin")
    ):
        return None
    return BeatCrons(app, integration, beat)


class BeatCrons:
    """Sentry Crons' check-ins of the runs one batch publishes (see the module's docstring)."""

    def __init__(self, app: Any, integration: Any, beat: Any) -> None:
        self._app, self._integration, self._beat = app, integration, beat

    def label(self, entry: Any, labelled: Any) -> CheckIn | None:
        """Write the check-in of ``entry``'s run into ``labelled``'s headers (a copy of the
        entry, its options its own), as Sentry's ``apply_entry`` wrapper would; None for an
        entry Sentry does not monitor (excluded, or a schedule Crons cannot take)."""
        if self._beat.match_regex_list(entry.name, self._integration.exclude_beat_tasks):
            return None
        config = self._beat._get_monitor_config(entry.schedule, self._app, entry.name)
        if not config:
            return None
        check_in = CheckIn(entry.name, uuid.uuid4().hex, config)
        labelled.options.setdefault("headers", {}).update(
            {
                _SLUG: check_in.slug,
                "sentry-monitor-config": config,
                _CHECK_IN_ID: check_in.check_in_id,
                # what Sentry's apply_async wrapper adds when it monitors: the run's duration
                "sentry-monitor-start-timestamp-s": f"{time.time():.9f}",
            }
        )
        return check_in

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Sentry's own check-in held off while a labelled run is published (its wrappers of
        ``apply_entry`` and ``apply_async`` look at ``monitor_beat_tasks`` then). Beat's tick
        runs in one thread."""
        integration = self._integration
        monitoring, integration.monitor_beat_tasks = integration.monitor_beat_tasks, False
        try:
            yield
        finally:
            integration.monitor_beat_tasks = monitoring

    def sent(self, check_in: CheckIn) -> None:
        """The run's message went out: its in-progress check-in."""
        self._beat.capture_checkin(
            monitor_slug=check_in.slug,
            check_in_id=check_in.check_in_id,
            monitor_config=check_in.config,
            status="in_progress",
        )


def close_skipped(task: Any) -> None:
    """``task``'s current run is a skipped duplicate (its request current): the check-in its
    message carries, if any, closed as ``ok`` by Sentry's own ``task_success`` closer, which
    reads the request's headers."""
    if _integration() is not None:
        sys.modules[_BEAT].crons_task_success(task)


def close_dropped(headers: Mapping[str, Any]) -> None:
    """A scheduled run's second message, dropped by the worker's witness (witness.py) before
    it ran: its check-in (sent by the instance that published the run again) closed as ``ok``,
    the run having run from its first message, so that Sentry does not report it timed out.
    ``headers``: the message's."""
    inner = headers.get("headers")
    fields = inner if isinstance(inner, Mapping) and _SLUG in inner else headers
    slug, check_in_id = fields.get(_SLUG), fields.get(_CHECK_IN_ID)
    if not slug or not check_in_id or _integration() is None:
        return
    sys.modules[_BEAT].capture_checkin(
        monitor_slug=slug,
        check_in_id=check_in_id,
        monitor_config=fields.get("sentry-monitor-config") or None,
        status="ok",
    )


def requeued(request: Any) -> None:
    """This delivery was put back in the queue (a duplicate waiting for the lock, Redis down)
    and its copy published: the copy carries the run's check-in and closes it when it ends. The
    check-in's slug is taken off this delivery's headers, so Sentry's ``task_retry`` closer,
    which reads them, does not close it as ``error`` now."""
    if _BEAT not in sys.modules:
        return
    for headers in (request.get("headers"), request.get("properties")):
        if isinstance(headers, dict):
            headers.pop(_SLUG, None)
            inner = headers.get("headers")
            if isinstance(inner, dict):
                inner.pop(_SLUG, None)
