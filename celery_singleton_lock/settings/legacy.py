"""Task options of celery-singleton and celery-once, mapped onto this library's options.

A task that still says ``unique_on=...``, ``lock_expiry=...``, ``raise_on_duplicate=...``
(celery-singleton) or ``once={"keys": ..., "timeout": ..., "graceful": ...}`` (celery-once)
keeps working: each old option is read as the new one, with a ``DeprecationWarning`` that
names the new spelling. docs/migrating.md lists the differences in behaviour. This library's
own settings renamed before its first release warn the same way (:func:`renamed`, docs/migrating.md,
"Renamed settings").

Knows nothing of Celery's classes: it reads attributes of any object.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from ..errors import SingletonConfigError

__all__ = ["LEGACY_OPTIONS", "legacy_options", "renamed"]

#: celery-singleton option -> the setting it becomes (docs/migrating.md).
LEGACY_OPTIONS = {
    "unique_on": "key_args",
    "lock_expiry": "ttl",
    "raise_on_duplicate": "on_duplicate",
}
#: celery-once's ``once`` keys -> the setting each becomes.
ONCE_KEYS = {"keys": "key_args", "timeout": "ttl", "graceful": "on_duplicate"}


def _deprecated(task_name: str, old: str, setting: str, value: Any) -> None:
    warnings.warn(
        f"task {task_name}: {old} is deprecated, use singleton_{setting}={value!r}",
        DeprecationWarning,
        stacklevel=4,
    )


def renamed(where: str, old: str, new: str) -> None:
    """Warn that ``old``, an old spelling of this library's, is read as ``new``:
    ``"<where>: <old> is deprecated, use <new>"`` (a worker or beat logs it at start)."""
    warnings.warn(f"{where}: {old} is deprecated, use {new}", DeprecationWarning, stacklevel=4)


def _on_duplicate(where: str, value: Any, raise_when: bool) -> str:
    if not isinstance(value, bool):
        raise SingletonConfigError(f"{where} must be True or False, got {value!r}")
    return "raise" if value is raise_when else "skip"


def legacy_options(task: object) -> dict[str, Any]:
    """``{setting name: value}`` from the old option spellings ``task`` carries (warns)."""
    name = str(getattr(task, "name", None) or type(task).__name__)
    found: dict[str, tuple[str, Any]] = {}  # setting -> (old spelling, value)
    for old, setting in LEGACY_OPTIONS.items():
        value = getattr(task, old, None)
        if value is None:
            continue
        if old == "raise_on_duplicate":
            value = _on_duplicate(f"{old} (task {name})", value, raise_when=True)
        found[setting] = (old, value)
    once = getattr(task, "once", None)
    if once is not None:
        if not isinstance(once, Mapping):
            raise SingletonConfigError(f"once (task {name}) must be a dict, got {once!r}")
        unknown = sorted(set(once) - set(ONCE_KEYS))
        if unknown:
            raise SingletonConfigError(
                f"once (task {name}) has keys {unknown} this library has no equivalent for; "
                f"it understands {sorted(ONCE_KEYS)} (see docs/migrating.md)"
            )
        for key, setting in ONCE_KEYS.items():
            if key not in once or once[key] is None:
                continue
            value = once[key]
            if key == "graceful":
                value = _on_duplicate(f"once['graceful'] (task {name})", value, raise_when=False)
            if setting in found:
                raise SingletonConfigError(
                    f"task {name}: once['{key}'] and {found[setting][0]} both set "
                    f"singleton_{setting}; keep one"
                )
            found[setting] = (f"once['{key}']", value)
    for setting, (old, value) in found.items():
        _deprecated(name, old, setting, value)
    return {setting: value for setting, (_old, value) in found.items()}
