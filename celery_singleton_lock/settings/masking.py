"""Hide the lock store's password where Celery prints the settings.

``celery report`` (``bugreport`` -> ``Settings.humanize``) and the ``conf`` remote control
command (``celery inspect conf``, answered by each worker) both list the settings through
``Settings.table``, which censors them with ``celery.app.utils.filter_hidden_settings``. That
function hides a setting by its *name* only (``HIDDEN_SETTINGS``: API, TOKEN, KEY, SECRET,
PASS, ...; the broker URLs; names containing "backend"), so ``singleton_redis_url`` (or
``CELERY_SINGLETON_REDIS_URL`` with ``namespace="CELERY"``) would be printed with its
password.

:func:`install` wraps that function once: what the original returns, with every setting whose
lower-cased name ends with ``singleton_redis_url`` passed through
:func:`~celery_singleton_lock.core.urls.redact_url` (password ``***``; scheme, host, port and db
kept). ``Settings.table`` and the original's own recursion into nested mappings look the
function up by its module global at call time, so both go through the wrapper. Installing
again is a no-op.

It is installed when the package is imported, which every process that prints the settings
does: the app module imports ``SingletonTask``, and the ``celery.commands`` entry point (the
``celery singleton`` command) makes every ``celery ...`` process (worker, report, inspect,
beat) import the package at start-up. Celery glue: the only module here that touches
``celery.app.utils``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

from celery.app import utils as celery_app_utils

from ..core.urls import redact_url

__all__ = ["install"]

#: Settings whose lower-cased name ends with this are lock store URLs.
URL_SETTING = "singleton_redis_url"
_INSTALLED = "_celery_singleton_lock_installed"


def _hide(key: object, value: object) -> object:
    if isinstance(key, str) and isinstance(value, str) and key.lower().endswith(URL_SETTING):
        return redact_url(value)
    return value


def install() -> None:
    """Wrap ``celery.app.utils.filter_hidden_settings`` (once) to hide the lock URL's password."""
    original: Callable[[Mapping[Any, Any]], dict[Any, Any]] = (
        celery_app_utils.filter_hidden_settings
    )
    if getattr(original, _INSTALLED, False):
        return

    @functools.wraps(original)
    def filter_hidden_settings(conf: Mapping[Any, Any]) -> dict[Any, Any]:
        return {key: _hide(key, value) for key, value in original(conf).items()}

    setattr(filter_hidden_settings, _INSTALLED, True)
    celery_app_utils.filter_hidden_settings = filter_hidden_settings
