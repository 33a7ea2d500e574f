"""The library's exceptions: one base, a few leaves.

::

    SingletonError                  base; carries key, task_id and holder when known
    ├── SingletonConfigError        a setting or task option is invalid (names the setting)
    ├── SingletonKeyError           an argument cannot be turned into a lock key (names it)
    ├── DuplicateTaskError          the lock is held by another run ("raise" policy)
    ├── RateLimitedError            the key's rate limit allows no start now ("raise" policy)
    └── LockUnavailableError        Redis could not be asked (down, timed out, auth)

Every exception is picklable and survives Celery's JSON result serialiser: its
``args`` are ``(message, key, task_id, holder)`` so ``cls(*args)`` rebuilds it.
"""

from __future__ import annotations

__all__ = [
    "DuplicateTaskError",
    "LockUnavailableError",
    "RateLimitedError",
    "SingletonConfigError",
    "SingletonError",
    "SingletonKeyError",
]


class SingletonError(Exception):
    """Base of every error raised by celery_singleton_lock."""

    def __init__(
        self,
        message: str,
        key: str | None = None,
        task_id: str | None = None,
        holder: str | None = None,
    ) -> None:
        super().__init__(message, key, task_id, holder)
        self.message = message
        self.key = key
        self.task_id = task_id
        self.holder = holder

    def __str__(self) -> str:
        return self.message


class SingletonConfigError(SingletonError, ValueError):
    """A setting or task option has a value the library cannot use."""


class SingletonKeyError(SingletonError, ValueError):
    """The task's arguments cannot be encoded into a lock key."""


class DuplicateTaskError(SingletonError):
    """Another run holds the lock for the same task and arguments."""


class RateLimitedError(SingletonError):
    """The key's ``singleton_rate_limit`` allows no start now; the message says when the next
    start is allowed, and ``holder`` names the last run that started."""


class LockUnavailableError(SingletonError):
    """Redis could not be reached or answered with an error."""
