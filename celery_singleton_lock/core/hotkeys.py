"""Hot keys: the locks a process saw held by another run lately, each for a short horizon.

A process that has just seen a lock held (a duplicate of it was skipped) expects the next
message for that lock to be a duplicate too. :class:`HotKeys` remembers such keys, each until
a deadline (:data:`HORIZON_S` after it was last seen held, or sooner if the lock's own time
to live says so), at most :data:`SIZE` of them, the key seen longest ago dropped first. The
worker's main process asks Redis about a message only when its key is hot (worker/mainskip.py).

``entries`` is a plain dict: an empty one is the caller's "nothing hot" test, the cheapest
there is. Marks may come from other threads (the threads pool reports a run's end in the
thread that ran it): writes take a lock, reads do not. Knows nothing of Celery.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable

__all__ = ["HORIZON_S", "SIZE", "HotKeys"]

#: Seconds a key stays hot after it was last seen held.
HORIZON_S = 1.0
#: Most keys one :class:`HotKeys` remembers.
SIZE = 1024


class HotKeys:
    """Lock keys seen held lately, each with its deadline (``clock()`` seconds)."""

    def __init__(
        self,
        size: int = SIZE,
        horizon_s: float = HORIZON_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if size < 1 or horizon_s <= 0:
            raise ValueError(f"size and horizon_s must be positive, got {size!r}, {horizon_s!r}")
        self.size = size
        self.horizon_s = horizon_s
        self.clock = clock
        #: key -> deadline, the key seen held longest ago first
        self.entries: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()

    def mark(self, key: str, pttl_ms: int | None = None) -> None:
        """``key`` was seen held now; by a lock that expires in ``pttl_ms`` if known (a
        negative one: the lock has no expiry)."""
        horizon = self.horizon_s
        if pttl_ms is not None and 0 <= pttl_ms < horizon * 1000:
            horizon = pttl_ms / 1000
        deadline = self.clock() + horizon
        with self._lock:
            entries = self.entries
            entries[key] = deadline
            entries.move_to_end(key)
            if len(entries) > self.size:
                entries.popitem(last=False)

    def is_hot(self, key: str) -> bool:
        """Whether ``key`` was seen held within its horizon; keys past theirs are forgotten
        (``key``, and those at the front that were seen held longest ago)."""
        now = self.clock()
        entries = self.entries
        deadline = entries.get(key)
        if deadline is not None and deadline > now:
            return True
        with self._lock:
            if deadline is not None and entries.get(key) == deadline:
                del entries[key]
            while entries:
                first, until = next(iter(entries.items()))
                if until > now:
                    break
                del entries[first]
        return False

    def forget(self, key: str) -> None:
        """``key`` is not held (or not held by another run) any more."""
        with self._lock:
            self.entries.pop(key, None)

    def clear(self) -> None:
        """Forget every key (Redis could not be asked: nothing is known)."""
        with self._lock:
            self.entries.clear()
