"""Waiting on a condition instead of sleeping: the one polling loop of the test suite."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol, TypeVar

T = TypeVar("T")


class _HasLog(Protocol):
    def log_tail(self, lines: int = ...) -> str: ...


def wait_for(
    predicate: Callable[[], T],
    timeout: float,
    what: str = "the condition",
    worker: _HasLog | None = None,
    *,
    interval: float = 0.02,
    details: Callable[[], str] | None = None,
) -> T:
    """Call ``predicate`` every ``interval`` seconds until it returns something truthy (returned).

    After ``timeout`` seconds it fails with an AssertionError naming ``what``, followed by the
    tail of ``worker``'s log and ``details()`` when given. The predicate is always called once
    more at the deadline, so a slow poll never fails a condition that holds.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            break
        time.sleep(interval)
    message = f"timed out after {timeout}s waiting for {what}"
    if worker is not None:
        message += f"\n{worker.log_tail(60)}"
    if details is not None:
        message += f"\n{details()}"
    raise AssertionError(message)
