"""The workers' witness of scheduled runs: a scheduled run's second message is dropped.

Every message a SingletonScheduler publishes names its run's claim (headers, beat/claims.py).
When a worker receives one (``task_received``, in the main process; worker/hooks.py connects it), it
records the message as the run's witness; a second message of the same run (another task id:
its beat instance died between publishing and confirming, and another instance published the
run again) is dropped as revoked, for every task, not only SingletonTasks. Never imports
``celery.beat``: every worker loads it.
"""

from __future__ import annotations

import logging
import socket
from typing import Any

from celery.worker import state as worker_state

from ..core._pid import current_pid
from ..errors import LockUnavailableError, SingletonConfigError
from ..settings.options import read_options
from .claims import CLAIM_HEADER, KEEP_HEADER, RUN_HEADER, Claims
from .crons import close_dropped
from .redlock_claims import claims_and_store

__all__ = ["WITNESS_KEEP_MS", "witness_scheduled_run"]

logger = logging.getLogger(__name__)

#: How long a witness is kept when the message does not say (ms): a day.
WITNESS_KEEP_MS = 86_400_000

_witnesses: dict[tuple[int, str], Claims] = {}


def witness_scheduled_run(sender: Any = None, request: Any = None, **_: Any) -> None:
    """Drop a second message of one scheduled run; let the first (and its redeliveries) run."""
    headers = getattr(request, "request_dict", None) or {}
    key = headers.get(CLAIM_HEADER)
    if not key or request is None:
        return
    try:
        keep_ms = int(headers.get(KEEP_HEADER) or WITNESS_KEEP_MS)
        app = getattr(sender, "app", None) or request.task.app
        first = _witness_claims(read_options(app.conf).redis_url).witness(
            str(key), str(request.id), max(keep_ms, 1)
        )
    except (LockUnavailableError, SingletonConfigError, ValueError) as exc:
        logger.warning(
            "singleton: scheduled run not witnessed, running it: run=%s task_id=%s: %s",
            headers.get(RUN_HEADER),
            request.id,
            exc,
        )
        return
    if first is not None:
        logger.warning(
            "singleton: duplicate scheduled run dropped: run=%s task_id=%s first=%s",
            headers.get(RUN_HEADER),
            request.id,
            first,
        )
        worker_state.revoked.add(request.id)  # Celery discards it as revoked, and acks it
        close_dropped(headers)  # Sentry Crons: its check-in, if it has one


def _witness_claims(url: str) -> Claims:
    key = (current_pid(), url)
    claims = _witnesses.get(key)
    if claims is None:
        claimer = f"worker:{socket.gethostname()}:{current_pid()}"
        claims = _witnesses[key] = claims_and_store(url, claimer)[0]
    return claims
