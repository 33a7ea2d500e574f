"""Checks of one setting's value: each takes the setting's name (for the message) and the
value, and returns the value as the library uses it or raises :class:`SingletonConfigError`
with one line naming the setting. The settings table (:mod:`.table`) puts them in its rows.
"""

from __future__ import annotations

import inspect
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

from ..core.keys import check_prefix
from ..core.rates import parse_rate
from ..core.urls import URL_KINDS, parse_lock_url, redact_url, url_scheme
from ..errors import SingletonConfigError

__all__ = [
    "choice",
    "key_args",
    "key_fn",
    "non_negative",
    "non_negative_int",
    "optional_non_negative",
    "optional_positive",
    "positive",
    "prefix",
    "rate",
    "scope",
    "seconds",
    "shown",
    "url",
]


def seconds(name: str, value: Any, *, zero: bool) -> float:
    """A finite number of seconds, > 0 (>= 0 with ``zero``): never a bool, a string, NaN or an
    infinity (a lock's ttl in milliseconds, a completion record's expiry, must be a number)."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        try:
            number = float(value)
        except OverflowError:  # an int too large for a float
            number = math.inf
        if math.isfinite(number) and (number >= 0 if zero else number > 0):
            return number
    bound = ">= 0" if zero else "> 0"
    raise SingletonConfigError(
        f"{name} must be a finite number of seconds {bound}, got {shown(value)}"
    )


def shown(value: Any) -> str:
    """``repr(value)``, cut short: an int of thousands of digits has no repr (ValueError)."""
    try:
        text = repr(value)
    except ValueError:
        return f"an integer of {value.bit_length()} bits"
    return text if len(text) <= 80 else f"{text[:77]}..."


def positive(name: str, value: Any) -> float:
    return seconds(name, value, zero=False)


def non_negative(name: str, value: Any) -> float:
    return seconds(name, value, zero=True)


def optional_positive(name: str, value: Any) -> float | None:
    return None if value is None else positive(name, value)


def optional_non_negative(name: str, value: Any) -> float | None:
    return None if value is None else non_negative(name, value)


def choice(choices: tuple[str, ...]) -> Callable[[str, Any], str]:
    """A check that accepts one of ``choices``."""

    def check(name: str, value: Any) -> str:
        if value not in choices:
            listed = ", ".join(repr(c) for c in choices)
            raise SingletonConfigError(f"{name} must be one of {listed}, got {value!r}")
        return str(value)

    return check


def prefix(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise SingletonConfigError(f"{name} must be a string, got {value!r}")
    try:
        check_prefix(value)
    except SingletonConfigError as exc:
        raise SingletonConfigError(f"{name}: {exc}") from exc
    return value


def key_args(name: str, value: Any) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, Sequence) or not all(isinstance(v, str) for v in value):
        raise SingletonConfigError(f"{name} must be a sequence of argument names, got {value!r}")
    return tuple(value)


def scope(name: str, value: Any) -> str | None:
    """A scope name: what the keys of its tasks show in place of the task name."""
    if value is None:
        return None
    if not isinstance(value, str) or not _SCOPE.fullmatch(value):
        raise SingletonConfigError(
            f"{name} must be a name of letters, digits, '_', '.' or '-' (at most 64), got {value!r}"
        )
    return value


_SCOPE = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def key_fn(name: str, value: Any) -> Callable[..., str] | None:
    """A callable that can be called as ``key(args, kwargs)`` (checked on its signature)."""
    if value is None:
        return None
    if not callable(value):
        raise SingletonConfigError(f"{name} must be a callable(args, kwargs) -> str, got {value!r}")
    try:
        signature = inspect.signature(value)
    except (TypeError, ValueError):  # a builtin without a signature: called as it is
        return value  # type: ignore[no-any-return]
    try:
        signature.bind(None, None)
    except TypeError as exc:
        raise SingletonConfigError(
            f"{name} must be a callable(args, kwargs) -> str; "
            f"{getattr(value, '__qualname__', value)!s}{signature} cannot be called so: {exc}"
        ) from None
    return value  # type: ignore[no-any-return]


def non_negative_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise SingletonConfigError(f"{name} must be an integer >= 0, got {shown(value)}")
    return value


def rate(name: str, value: Any) -> tuple[int, int] | None:
    """A rate as Celery spells ``rate_limit`` (``"N/s"``, ``"N/m"``, ``"N/h"``), or None."""
    if value is None:
        return None
    try:
        return parse_rate(value)
    except ValueError as exc:
        raise SingletonConfigError(f"{name}: {exc}, got {shown(value)}") from None


def url(name: str, value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or url_scheme(value) not in URL_KINDS:
        shown = redact_url(value) if isinstance(value, str) else repr(value)
        raise SingletonConfigError(
            f"{name} must be a redis://, rediss:// or unix:// URL, or a redis+sentinel://, "
            f"redis+cluster:// or redis+redlock:// one (rediss+... for TLS), got {shown}"
        )
    try:  # what redis-py would refuse at the first task: the port, the db, query options
        parse_lock_url(value)
    except ValueError as exc:
        raise SingletonConfigError(
            f"{name} is not a usable Redis URL ({exc}), got {redact_url(value)}"
        ) from None
    return value
