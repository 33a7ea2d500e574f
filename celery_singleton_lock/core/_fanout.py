"""Ask several Redis masters at once and wait a bounded time: Redlock's fan-out.

One daemon thread per master and call, a per-master bound on unanswered calls, and a
:class:`Failed` answer for a master that errs, times out or has too many calls in flight.
Used by :class:`~celery_singleton_lock.core.redlock.RedlockStore` and beat's Redlock claims.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, wait
from typing import TypeVar

import redis

from ..errors import LockUnavailableError
from ._pid import current_pid

__all__ = [
    "DEFAULT_MASTER_TIMEOUT_S",
    "DEFAULT_MAX_IN_FLIGHT",
    "Failed",
    "Fanout",
    "describe",
    "why",
]

#: Longest wait, in seconds, for the masters' answers in one step of a call. A master that has
#: not answered by then counts as failed for that call (its thread finishes in the background).
DEFAULT_MASTER_TIMEOUT_S = 0.25

#: Calls to one master that may be waiting at once; a master with this many unanswered calls
#: (it hangs) counts as failed at once instead of tying up yet another thread.
DEFAULT_MAX_IN_FLIGHT = 16

T = TypeVar("T")


class Failed:
    """A master that could not answer a call: an error, a timeout, too many calls in flight."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def __repr__(self) -> str:
        return f"Failed({self.reason!r})"


class Fanout:
    """Run one call per master, each on its own daemon thread, and wait a bounded time.

    Daemon threads, not a pool: a thread stuck on a hung master never delays interpreter exit,
    and nothing queued behind it can run late. ``max_in_flight`` bounds the threads per master.
    """

    def __init__(self, size: int, max_in_flight: int) -> None:
        self._max_in_flight = max_in_flight
        self._mutex = threading.Lock()
        self._pid = current_pid()
        self._in_flight = [0] * size

    def run(self, calls: Mapping[int, Callable[[], T]], timeout_s: float) -> dict[int, T | Failed]:
        """Start every call, wait up to ``timeout_s`` for all of them; master index -> answer."""
        results: dict[int, T | Failed] = {}
        futures: dict[int, Future[T]] = {}
        for index, call in calls.items():
            if not self._enter(index):
                results[index] = Failed(f"{self._max_in_flight} calls still unanswered")
                continue
            future: Future[T] = Future()
            thread = threading.Thread(
                target=self._work,
                args=(index, call, future),
                name=f"celery-singleton-redlock-{index}",
                daemon=True,
            )
            try:
                thread.start()
            except RuntimeError as exc:  # cannot start new thread
                self._leave(index)
                results[index] = Failed(f"cannot start a thread: {exc}")
                continue
            futures[index] = future
        if futures:
            wait(futures.values(), timeout=max(timeout_s, 0.0))
        for index, future in futures.items():
            if not future.done():
                results[index] = Failed(f"no answer within {timeout_s * 1000:.0f} ms")
                continue
            error = future.exception()
            if error is None:
                results[index] = future.result()
            elif isinstance(error, (redis.RedisError, OSError, LockUnavailableError)):
                cause = error.__cause__ if isinstance(error, LockUnavailableError) else None
                error = cause if isinstance(cause, (redis.RedisError, OSError)) else error
                results[index] = Failed(f"{type(error).__name__}: {error}")
            else:  # a bug, not a failing master: let it surface
                raise error
        return dict(sorted(results.items()))

    def _enter(self, index: int) -> bool:
        with self._mutex:
            if self._pid != current_pid():  # forked: the parent's threads do not exist here
                self._pid = current_pid()
                self._in_flight = [0] * len(self._in_flight)
            if self._in_flight[index] >= self._max_in_flight:
                return False
            self._in_flight[index] += 1
            return True

    def _leave(self, index: int) -> None:
        with self._mutex:
            if self._pid == current_pid() and self._in_flight[index] > 0:
                self._in_flight[index] -= 1

    def _work(self, index: int, call: Callable[[], T], future: Future[T]) -> None:
        try:
            result = call()
        except BaseException as exc:
            future.set_exception(exc)
        else:
            future.set_result(result)
        finally:
            self._leave(index)


def describe(client: redis.Redis) -> str:
    """``host:port`` (or the socket path) of a client: never its password."""
    kwargs = client.connection_pool.connection_kwargs
    if "path" in kwargs:
        return str(kwargs["path"])
    return f"{kwargs.get('host', '?')}:{kwargs.get('port', '?')}"


def why(names: Sequence[str], replies: Mapping[int, object]) -> str:
    """`` [master i (host:port): reason; ...]`` for the masters that failed, else ``""``."""
    reasons = [
        f"master {i} ({names[i]}): {reply.reason}"
        for i, reply in replies.items()
        if isinstance(reply, Failed)
    ]
    return f" [{'; '.join(reasons)}]" if reasons else ""
