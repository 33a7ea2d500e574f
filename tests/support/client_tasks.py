"""singleton_app's tasks as the test process sees them: declared on a client app, so that
their ``apply_async`` runs the library's publish side, and their lock keys derived as a worker
of singleton_app derives them.
"""

from __future__ import annotations

from typing import Any

from celery import Celery

from celery_singleton_lock import SingletonTask
from celery_singleton_lock.core.keys import LockKeys, derive_keys
from tests.support.basic_app import make_app

__test__ = False


def publish_client_app(redis_url: str, prefix: str, **options: Any) -> tuple[Celery, Any]:
    """The client side of singleton_app with t.publish_hold defined on it (same keys)."""
    app = make_app(redis_url, prefix)
    app.conf.singleton_redis_url = redis_url
    app.conf.singleton_key_prefix = f"{prefix}lock:"

    @app.task(
        bind=True,
        base=SingletonTask,
        name="t.publish_hold",
        shared=False,
        singleton_key_args=("key",),
        singleton_lock_on="publish",
        **options,
    )
    def publish_hold(self: Any, key: str, seconds: float = 0.0, retries: int = 0) -> None:
        """Runs on the worker only."""

    return app, publish_hold


# -- t.export_permits_coalesce: 2 permits, duplicates coalesced ------------------------------

COALESCE = "t.export_permits_coalesce"


def _tenant(tenant: str, payload: object = None, until: str | None = None) -> None:
    """The parameters of t.export_permits_coalesce."""


def coalesce_keys(prefix: str, tenant: str = "a") -> LockKeys:
    """The keys of t.export_permits_coalesce(tenant) on a test worker (2 permits)."""
    keys = derive_keys(f"{prefix}lock:", COALESCE, _tenant, (tenant,), {}, ("tenant",))
    return keys.with_permits(2)
