"""Waiting on a condition instead of sleeping: the one polling loop of the test suite."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol, TypeVar

T = TypeVar("T")

__test__ = False


class _HasLog(Protocol):
    def log_tail(self, lines: int = ...) -> str: ...


def wait_for(
    predicate: Callable[[], T],
    timeout: float,
    what: str = "the condition",
    *workers: _HasLog,
    interval: float = 0.02,
    details: Callable[[], str] | None = None,
    ignore: tuple[type[BaseException], ...] = (),
    fail: bool = True,
) -> T:
    """Call ``predicate`` every ``interval`` seconds until it returns something truthy (returned).

    The predicate is called once more at the deadline, so a slow poll never fails a condition
    that holds. Exceptions of the types in ``ignore`` count as "not yet" (the last one is named
    on timeout). After ``timeout`` seconds, with ``fail`` (the default), it raises an
    AssertionError naming ``what``, the log tails of ``workers`` (anything with ``log_tail``:
    worker and beat processes) and ``details()``; without, it returns the predicate's last
    (falsy) value.
    """
    deadline = time.monotonic() + timeout
    last_error: BaseException | None = None
    while True:
        try:
            value = predicate()
        except ignore as exc:
            value, last_error = None, exc  # type: ignore[assignment]
        if value:
            return value
        if time.monotonic() >= deadline:
            break
        time.sleep(interval)
    if not fail:
        return value
    message = f"timed out after {timeout}s waiting for {what}"
    if last_error is not None:
        message += f" (last: {last_error!r})"
    for worker in workers:
        message += f"\n{worker.log_tail(60)}"
    if details is not None:
        message += f"\n{details()}"
    raise AssertionError(message)
