"""The real sentry-sdk in beat and worker processes, its check-ins recorded in Redis.

:func:`init_sentry` (called by beat_app when ``SINGLETON_TEST_SENTRY`` is set) starts Sentry
with its Celery integration monitoring beat tasks and a transport that sends nothing: every
check-in envelope is appended, as JSON, to the list :func:`checkins_key` under the test's prefix,
with the process's role (``beat`` or ``worker``), its pid and, on a worker, the run label of the
task being run (the ``singleton_beat_run`` header). :func:`load_checkins` reads them back.

Sentry Crons takes no interval under a minute, so :class:`CronsInterval` is a short interval
that tells Sentry it is one minute: the beats fire it every few seconds, and Sentry's own code
(``_get_monitor_config``) still writes its monitor config.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import redis
from celery.schedules import schedule

__test__ = False


def checkins_key(prefix: str) -> str:
    return f"{prefix}sentry-checkins"


class CronsInterval(schedule):  # type: ignore[misc]
    """An interval that Sentry Crons reads as one minute (``seconds``); beats fire it at its
    real ``run_every``."""

    @property
    def seconds(self) -> float:
        return 60.0


@dataclass(frozen=True)
class CheckIn:
    """One recorded check-in."""

    role: str
    pid: int
    run: str | None
    slug: str
    check_in_id: str
    status: str
    duration: float | None = None


def init_sentry(redis_url: str, prefix: str) -> None:
    """sentry_sdk.init with the Celery integration (beat tasks monitored) and the recording
    transport; nothing else of Sentry's (no default or auto-enabled integrations)."""
    import sentry_sdk
    from sentry_sdk.integrations.celery import CeleryIntegration
    from sentry_sdk.transport import Transport

    role = "beat" if os.environ.get("SINGLETON_TEST_ROLE") == "beat" else "worker"
    key = checkins_key(prefix)
    clients: dict[int, redis.Redis] = {}

    class RecordingTransport(Transport):  # type: ignore[misc]
        """Appends each check-in to a Redis list instead of sending it."""

        def capture_envelope(self, envelope: Any) -> None:
            from celery._state import get_current_task

            task = get_current_task()
            run = task.request.get("singleton_beat_run") if task is not None else None
            client = clients.get(os.getpid())
            if client is None:
                client = clients[os.getpid()] = redis.Redis.from_url(redis_url)
            for item in envelope.items:
                if item.type != "check_in":
                    continue
                payload = json.loads(item.payload.get_bytes())
                record = {
                    "role": role,
                    "pid": os.getpid(),
                    "run": run,
                    "slug": payload["monitor_slug"],
                    "check_in_id": payload["check_in_id"],
                    "status": payload["status"],
                    "duration": payload.get("duration"),
                }
                client.rpush(key, json.dumps(record))

        def flush(self, timeout: float, callback: Any = None) -> None:
            return None

    sentry_sdk.init(
        dsn="http://public@127.0.0.1:9/1",
        transport=RecordingTransport,
        integrations=[CeleryIntegration(monitor_beat_tasks=True)],
        default_integrations=False,
        auto_enabling_integrations=False,
    )


def load_checkins(client: redis.Redis, prefix: str) -> list[CheckIn]:
    """Every check-in recorded under ``prefix``, in the order they were sent."""
    return [CheckIn(**json.loads(raw)) for raw in client.lrange(checkins_key(prefix), 0, -1)]
