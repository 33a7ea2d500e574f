"""The masters behind a :class:`~.redlock.RedlockStore`, and what the store knows of them.

One redis-py client and one plain :class:`LockStore` per master (the Lua scripts stay in one
place), the store's settings, and the bookkeeping every Redlock call shares: every master
asked at once through the fan-out (:mod:`._fanout`), a master's failing and recovering logged
once each, the drift allowance, and each lock's last confirmed validity (until when a majority
is known to hold it). The protocol itself is in :mod:`.redlock_acquire` (taking a lock) and
:mod:`.redlock` (renewing, releasing, reading it). Knows nothing of Celery.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

import redis

from ._fanout import DEFAULT_MASTER_TIMEOUT_S, DEFAULT_MAX_IN_FLIGHT, Failed, Fanout, describe, why
from .backend import FENCE_MARGIN_MS, SequentialReleases, check_fence_margin
from .store import LockStore

__all__ = ["DEFAULT_SPLIT_DELAY_S", "DEFAULT_SPLIT_RETRIES", "RedlockMasters"]

#: RedlockStore's logger, as before the store was split into modules
logger = logging.getLogger(f"{__package__}.redlock")

#: How often an acquire is tried again after a split vote: no owner got (or can have) a
#: majority, because several contenders each took some masters at the same moment.
DEFAULT_SPLIT_RETRIES = 3

#: Longest random pause, in seconds, before the first such retry; it doubles with each retry.
DEFAULT_SPLIT_DELAY_S = 0.05

T = TypeVar("T")


class RedlockMasters(SequentialReleases):
    """The masters, settings and shared bookkeeping of a :class:`~.redlock.RedlockStore`.

    Takes the store's arguments (documented there) and checks them. ``clients`` and ``stores``
    are all the masters, ``quorum`` how many of them make a majority.
    """

    def __init__(
        self,
        clients: Sequence[redis.Redis],
        *,
        clock: Callable[[], float] = time.monotonic,
        drift_factor: float = 0.01,
        drift_floor_ms: int = 2,
        fence_margin_ms: int = FENCE_MARGIN_MS,
        master_timeout_s: float = DEFAULT_MASTER_TIMEOUT_S,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
        split_retries: int = DEFAULT_SPLIT_RETRIES,
        split_delay_s: float = DEFAULT_SPLIT_DELAY_S,
    ) -> None:
        clients = list(clients)
        if not clients:
            raise ValueError("RedlockStore needs at least one client")
        if len({id(client) for client in clients}) != len(clients):
            raise ValueError("RedlockStore was given the same client twice")
        if not 0 <= drift_factor < 1:
            raise ValueError(f"drift_factor must be in [0, 1), got {drift_factor!r}")
        if drift_floor_ms < 0:
            raise ValueError(f"drift_floor_ms must be >= 0, got {drift_floor_ms!r}")
        if master_timeout_s <= 0:
            raise ValueError(f"master_timeout_s must be positive, got {master_timeout_s!r}")
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight!r}")
        if split_retries < 0 or split_delay_s < 0:
            raise ValueError(
                f"split_retries and split_delay_s must be >= 0, got {split_retries!r}, "
                f"{split_delay_s!r}"
            )
        check_fence_margin(fence_margin_ms)
        self.fence_margin_ms = fence_margin_ms
        self.clients: tuple[redis.Redis, ...] = tuple(clients)
        self.stores: tuple[LockStore, ...] = tuple(
            LockStore(c, fence_margin_ms=fence_margin_ms) for c in clients
        )
        self.quorum = len(clients) // 2 + 1
        self.clock = clock
        self.drift_factor = drift_factor
        self.drift_floor_ms = drift_floor_ms
        self.master_timeout_s = master_timeout_s
        self.split_retries = split_retries
        self.split_delay_s = split_delay_s
        self._fanout = Fanout(len(clients), max_in_flight)
        self._names = [describe(client) for client in clients]
        self._failing = [False] * len(clients)
        self._mutex = threading.Lock()
        # (key, owner, generation) -> clock time until which a majority is known to hold it
        self._valid_until: dict[tuple[str, str, int], float] = {}

    @property
    def client(self) -> redis.Redis:
        """The first master: where single-key records beside the locks live (publish-time
        markers; see docs/internals.md, "Known limits")."""
        return self.clients[0]

    def close(self) -> None:
        """Close every master's connections."""
        for store in self.stores:
            store.close()

    def drift_ms(self, ttl_ms: int) -> float:
        """The clock-drift allowance for a lock of ``ttl_ms``."""
        return ttl_ms * self.drift_factor + self.drift_floor_ms

    # -- helpers ------------------------------------------------------------------------------

    def _each(self) -> list[tuple[int, LockStore]]:
        return list(enumerate(self.stores))

    def _run(self, calls: Mapping[int, Callable[[], T]], timeout_s: float) -> dict[int, T | Failed]:
        replies = self._fanout.run(calls, timeout_s)
        self._log_changes(replies)
        return replies

    def _log_changes(self, replies: Mapping[int, object]) -> None:
        """WARNING when a master starts failing, INFO when it answers again (not every call)."""
        for i, reply in replies.items():
            failing = isinstance(reply, Failed)
            with self._mutex:
                changed = failing != self._failing[i]
                self._failing[i] = failing
            if not changed:
                continue
            if isinstance(reply, Failed):
                logger.warning(
                    "singleton: redlock master %d (%s) failing: %s", i, self._names[i], reply.reason
                )
            else:
                logger.info("singleton: redlock master %d (%s) answers again", i, self._names[i])

    def _why(self, replies: Mapping[int, object]) -> str:
        return why(self._names, replies)

    def _remember(self, key: str, owner: str, generation: int, until: float) -> None:
        with self._mutex:
            if len(self._valid_until) > 1024:
                self._forget_expired(self.clock())
            self._valid_until[(key, owner, generation)] = until

    def _forget_expired(self, now: float) -> None:
        """Drop validity records that have run out (call with ``_mutex`` held)."""
        for ident in [i for i, until in self._valid_until.items() if until <= now]:
            del self._valid_until[ident]
