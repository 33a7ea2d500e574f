"""The ``proj/celery.py`` of a Django project, with one singleton task.

Settings come from :mod:`examples.django_settings` under the ``CELERY_`` namespace, exactly as
``app.config_from_object("django.conf:settings", namespace="CELERY")`` reads them in Django.
"""

from __future__ import annotations

import time
from typing import Any

from celery import Celery

from celery_singleton_lock import SingletonTask

app = Celery("proj")
app.config_from_object("examples.django_settings", namespace="CELERY")


@app.task(bind=True, base=SingletonTask, singleton_key_args=("report_id",))  # type: ignore[untyped-decorator]
def rebuild_report(self: Any, report_id: int, seconds: float = 1.0) -> dict[str, Any]:
    """Rebuild one report; a second request for the same report while it runs is skipped."""
    time.sleep(seconds)
    return {
        "report_id": report_id,
        "key": self.singleton.key,
        "token": self.singleton.fencing_token,
    }
