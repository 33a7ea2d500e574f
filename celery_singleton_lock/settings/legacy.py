"""Task options of celery-singleton and celery-once, mapped onto this library's options.

A task that still says ``unique_on=...``, ``lock_expiry=...``, ``raise_on_duplicate=...``
(celery-singleton) or ``once={"keys": ..., "timeout": ..., "graceful": ...}`` (celery-once)
keeps working: each old option is read as the new one(s), with a ``DeprecationWarning`` that
names the new spelling. Each reads as the old library behaved: ``lock_expiry`` and
``once["timeout"]`` bounded the lock taken at publish as well as the run's, so they set
``ttl`` and ``publish_ttl``; celery-once raised on a duplicate unless ``graceful`` was True,
so ``once=`` without it means ``on_duplicate="raise"`` (unless the task sets
``singleton_on_duplicate`` itself). docs/migrating.md lists the differences in behaviour.
This library's own settings renamed before its first release warn the same way
(:func:`renamed`, docs/migrating.md, "Renamed settings").

Knows nothing of Celery's classes: it reads attributes of any object.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from ..errors import SingletonConfigError

__all__ = ["LEGACY_OPTIONS", "legacy_options", "renamed"]

#: celery-singleton option -> the settings it becomes (docs/migrating.md).
LEGACY_OPTIONS = {
    "unique_on": ("key_args",),
    "lock_expiry": ("ttl", "publish_ttl"),
    "raise_on_duplicate": ("on_duplicate",),
}
#: celery-once's ``once`` keys -> the settings each becomes.
ONCE_KEYS = {
    "keys": ("key_args",),
    "timeout": ("ttl", "publish_ttl"),
    "graceful": ("on_duplicate",),
}
#: how the warning names celery-once's default when ``graceful`` is not given
_ONCE_DEFAULT = "once['graceful'] (not given: False)"


def _deprecated(task_name: str, old: str, new: list[tuple[str, Any]]) -> None:
    spelled = " and ".join(f"singleton_{setting}={value!r}" for setting, value in new)
    warnings.warn(
        f"task {task_name}: {old} is deprecated, use {spelled}",
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
    for old, settings in LEGACY_OPTIONS.items():
        value = getattr(task, old, None)
        if value is None:
            continue
        if old == "raise_on_duplicate":
            value = _on_duplicate(f"{old} (task {name})", value, raise_when=True)
        for setting in settings:
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
        for key, settings in ONCE_KEYS.items():
            if key not in once or once[key] is None:
                continue
            value = once[key]
            if key == "graceful":
                value = _on_duplicate(f"once['graceful'] (task {name})", value, raise_when=False)
            for setting in settings:
                if setting in found:
                    raise SingletonConfigError(
                        f"task {name}: once['{key}'] and {found[setting][0]} both set "
                        f"singleton_{setting}; keep one"
                    )
                found[setting] = (f"once['{key}']", value)
        if (
            "on_duplicate" not in found and getattr(task, "singleton_on_duplicate", None) is None
        ):  # celery-once's default: a duplicate raised AlreadyQueued
            found["on_duplicate"] = (_ONCE_DEFAULT, "raise")
    by_old: dict[str, list[tuple[str, Any]]] = {}
    for setting, (old, value) in found.items():
        by_old.setdefault(old, []).append((setting, value))
    for old, new in by_old.items():
        _deprecated(name, old, new)
    return {setting: value for setting, (_old, value) in found.items()}
