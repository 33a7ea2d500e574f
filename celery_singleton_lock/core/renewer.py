"""One renewal timer per process for every lock that process holds.

The renewer keeps a weak registry of :class:`HeldLock` records. Whenever the earliest of
them is due (a third of its ttl after its last renewal) it renews *all* of them in one
round trip, so the number of round trips per interval does not grow with the number of
locks. A record whose run has ended and been garbage-collected simply drops out.

The renewer also keeps this process's releases in order with its acquires:
:meth:`Renewer.acquire` is the one way a run takes a lock, and it never overtakes a release
this process made before it (see "Deferred release" in docs/internals.md).

Time is injected: :meth:`Renewer.run_due` takes ``now`` and returns how long to wait, so
tests drive it without a thread or a sleep. :meth:`Renewer.ensure_started` starts a
daemon thread in the *current* process (it restarts after a fork) that calls it.
A renewal that lands when less than a third of the ttl was left (two intervals or more
after the last one: the thread was starved, or Redis failed in between) is reported to
``on_late``. Knows nothing of Celery: outcomes reach the caller through the callbacks.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import LockUnavailableError
from ._pid import current_pid
from .backend import (
    Acquired,
    Contended,
    LockBackend,
    ReleaseItem,
    ReleaseStatus,
    RenewItem,
    RenewStatus,
)
from .completion import Ending
from .keys import LockKeys

__all__ = ["HeldLock", "Renewer", "release_items"]

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class HeldLock:
    """A lock this process holds and renews, as seen by the run that took it.

    ``context`` is whatever the caller wants handed back to its callbacks (the task). ``key``,
    ``owner``, ``generation`` and ``ttl_ms`` never change once it is made. ``ending`` is what
    its release leaves behind (a completion record, an at-least window: core/completion.py);
    the caller sets it when the run ends, before it releases.
    """

    key: str
    owner: str
    generation: int
    ttl_ms: int
    token: int
    acquired_at: float
    max_hold_s: float | None = None
    lost: bool = False
    #: a renewal found that a newer call asked this run to stop (RenewStatus.STOP_ASKED)
    stop_asked: bool = False
    renewals: int = 0
    context: Any = field(default=None, repr=False)
    ending: Ending | None = field(default=None, repr=False)
    next_due: float = field(default=0.0, repr=False)
    #: seconds between renewals: a third of the ttl
    interval: float = field(default=0.0, init=False, repr=False)
    _item: RenewItem | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.interval = self.ttl_ms / 3000.0
        self.next_due = self.acquired_at + self.interval

    def as_item(self) -> RenewItem:
        """What the store renews: made at the first renewal, then kept."""
        item = self._item
        if item is None:
            item = RenewItem(self.key, self.owner, self.generation, self.ttl_ms, self.token)
            self._item = item
        return item


LostCallback = Callable[[HeldLock, RenewStatus], None]
HeldCallback = Callable[[HeldLock], None]
#: called with the lock and the seconds its ttl had left (by this process's clock)
LateCallback = Callable[[HeldLock, float], None]
ErrorCallback = Callable[[LockUnavailableError], None]
ReleasedCallback = Callable[[HeldLock, "ReleaseStatus | LockUnavailableError", str], None]


#: The longest the thread sleeps: it then reads the replies of releases written ahead that no
#: acquire has read, even when it holds no lock.
IDLE_S = 1.0


def _ignore(*_args: object) -> None:
    return None


class Renewer:
    """Renews every registered lock of this process in one batched round trip per interval."""

    def __init__(
        self,
        store: LockBackend,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_lost: LostCallback = _ignore,
        on_max_hold: HeldCallback = _ignore,
        on_error: ErrorCallback = _ignore,
        on_late: LateCallback = _ignore,
        on_released: ReleasedCallback = _ignore,
        error_retry_s: float = 1.0,
        idle_s: float = IDLE_S,
    ) -> None:
        self.store = store
        self.clock = clock
        self.on_lost = on_lost
        self.on_max_hold = on_max_hold
        self.on_error = on_error
        self.on_late = on_late
        self.error_retry_s = error_retry_s
        self.idle_s = idle_s
        self.round_trips = 0
        self.on_released = on_released
        self._held: weakref.WeakSet[HeldLock] = weakref.WeakSet()
        self._releases: list[tuple[HeldLock, str]] = []
        #: releases taken out of the queue and still on their way to Redis (see acquire)
        self._sending = 0
        self._adds = 0
        #: When the thread wakes up next (clock time); -inf while it is running, +inf when
        #: it waits for a lock to be added.
        self._deadline = float("-inf")
        self._mutex = threading.Lock()
        #: notified whenever the releases in flight (``_sending``) have all been answered
        self._sent = threading.Condition(self._mutex)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: True from the thread's start until its _run returns (cheaper than is_alive())
        self._thread_running = False
        self._pid = 0

    # -- registry ------------------------------------------------------------------------

    def add(self, held: HeldLock) -> None:
        """Start renewing ``held`` (the caller keeps the only strong reference).

        The thread is woken only when ``held`` falls due before the thread's next wake-up
        (the registry was empty, or ``held`` has a shorter ttl than the others): waking it on
        every acquire costs more CPU than the rest of the registry work.
        """
        with self._mutex:
            self._held.add(held)
            self._adds += 1
            wake = held.next_due < self._deadline
        if wake:
            self._wake.set()

    def remove(self, held: HeldLock) -> None:
        """Stop renewing ``held`` at once; a renewal already on the wire may still land."""
        with self._mutex:
            self._held.discard(held)

    # -- taking a lock, handing it over -------------------------------------------------------

    def acquire(
        self,
        keys: LockKeys,
        owner: str,
        generation: int,
        ttl_ms: int,
        meta: Mapping[str, str] | None = None,
    ) -> Acquired | Contended:
        """Take ``keys.lock`` (the store's ``acquire``), after every release this process made.

        A release this process queued goes to Redis in the same round trip, ahead of the
        acquire; one the thread is sending right now is waited for. So a run never finds a lock
        its own process already let go (on a cluster, Redlock or ``wait_replicas``, where
        releases are queued; on one server they are written ahead on the connection the acquire
        then uses). Raises :class:`LockUnavailableError` as the store does; the releases sent
        with it are reported either way.
        """
        if not self._releases and not self._sending:  # the common case: nothing in between
            try:
                return self.store.acquire(keys, owner, generation, ttl_ms, meta)
            finally:
                self.report_sent()  # replies of releases written ahead came with the acquire
        with self._mutex:
            while self._sending:
                self._sent.wait()
            pending, self._releases = self._releases, []
            self._sending += bool(pending)
        try:
            return self._acquire_after(pending, keys, owner, generation, ttl_ms, meta)
        finally:
            if pending:
                self._done_sending()
            self.report_sent()

    def _acquire_after(  # noqa: PLR0917 - acquire's arguments, after the releases
        self,
        pending: list[tuple[HeldLock, str]],
        keys: LockKeys,
        owner: str,
        generation: int,
        ttl_ms: int,
        meta: Mapping[str, str] | None,
    ) -> Acquired | Contended:
        if not pending:
            return self.store.acquire(keys, owner, generation, ttl_ms, meta)
        try:
            released, outcome = self.store.acquire_after(
                release_items(pending), keys, owner, generation, ttl_ms, meta
            )
        except LockUnavailableError as exc:
            self.report_releases(pending, [exc] * len(pending))
            raise
        except Exception:  # nothing was sent (a bad argument): the releases still must go
            self.report_releases(pending, self.store.release_many(release_items(pending)))
            raise
        self.report_releases(pending, released)
        return outcome

    def _done_sending(self) -> None:
        with self._mutex:
            self._sending -= 1
            if not self._sending:
                self._sent.notify_all()

    def hand_over(self, held: HeldLock, ttl_ms: int) -> None:
        """Stop renewing ``held`` and stretch it to ``ttl_ms`` for whoever takes it over next.

        The retry hand-over: the retried message (the same owner, a later generation) takes the
        lock over when it arrives. The stretch is a renewal, so it never shortens the lock, and
        a renewal of ``held`` still in flight cannot shorten it either (renew.lua).
        """
        self.remove(held)
        self.store.renew([RenewItem(held.key, held.owner, held.generation, ttl_ms, held.token)])

    def release_now(self, held: HeldLock) -> ReleaseStatus | LockUnavailableError:
        """Stop renewing ``held`` and release it in this call (eager runs): its status, or the
        error that kept it (the lock then expires after its ttl)."""
        self.remove(held)
        try:
            if not held.ending:  # a store written before endings existed is called as before
                return self.store.release(held.key, held.owner, held.generation, held.token)
            return self.store.release(
                held.key, held.owner, held.generation, held.token, held.ending
            )
        except LockUnavailableError as exc:
            return exc

    # -- deferred releases -------------------------------------------------------------------

    def release_later(self, held: HeldLock, reason: str, *, queue: bool = True) -> bool:
        """Stop renewing ``held`` and release it, off the caller's critical path; False when
        it was neither written nor queued (``queue`` False, and it could not be written
        ahead): the caller then releases it itself (:meth:`release_now`).

        On a single server the release is written at once on the store's send-ahead
        connection and its reply read later (:meth:`report_sent`): by the next acquire of
        this process, or by the thread within ``idle_s``. Otherwise (a cluster, Redlock, a
        failed write) it is queued and the thread woken: it sends the queue at once, all of it
        in one round trip, and the next acquire of this process sends whatever is still queued
        in its own round trip, ahead of the acquire, or waits for the thread's (:meth:`acquire`).
        """
        with self._mutex:
            self._held.discard(held)
        tag = (held, reason)
        if self.store.release_ahead(
            held.key, held.owner, held.generation, tag, held.token, held.ending or None
        ):
            return True
        if not queue:
            return False
        now = self.clock()
        with self._mutex:
            self._releases.append((held, reason))
            wake = self._deadline > now
        if wake:
            self._wake.set()
        return True

    def report_sent(self) -> int:
        """Hand the outcome of every release written ahead to ``on_released``; how many."""
        done = self.store.collect_released()
        if done:
            self._report(done)
        return len(done)

    def report_releases(
        self,
        taken: list[tuple[HeldLock, str]],
        outcomes: list[ReleaseStatus | LockUnavailableError],
    ) -> None:
        """Hand the outcome of each release in ``taken`` to ``on_released``."""
        self._report(zip(taken, outcomes, strict=True))

    def _report(
        self, done: Iterable[tuple[tuple[HeldLock, str], ReleaseStatus | LockUnavailableError]]
    ) -> None:
        for (held, reason), outcome in done:
            try:
                self.on_released(held, outcome, reason)
            except Exception:  # one callback must not lose the others' reports
                logger.exception("singleton: release callback failed: key=%s", held.key)

    def flush_releases(self) -> int:
        """Send every queued release now, in one round trip, and report those written ahead.

        Returns how many releases were reported.
        """
        sent = self.report_sent()
        if not self._releases:
            return sent
        with self._mutex:
            taken, self._releases = self._releases, []
            self._sending += bool(taken)  # an acquire meanwhile waits for these (acquire)
        if not taken:
            return sent
        outcomes: list[ReleaseStatus | LockUnavailableError]
        try:
            outcomes = list(self.store.release_many(release_items(taken)))
        except LockUnavailableError as exc:
            outcomes = [exc] * len(taken)
        finally:
            self._done_sending()
        self.report_releases(taken, outcomes)
        return sent + len(taken)

    def __len__(self) -> int:
        with self._mutex:
            return len(self._held)

    # -- the timer's body -------------------------------------------------------------------

    def run_due(self, now: float) -> float | None:
        """Renew everything if anything is due at ``now``; return seconds until the next due.

        The loops over the locks are kept lean: every Python step per lock is paid 10,000 times
        a round with 10,000 locks (docs/performance.md, "Figures behind the code").
        """
        with self._mutex:
            held = list(self._held)
        if not held:
            return None
        expired = [
            h for h in held if h.max_hold_s is not None and now - h.acquired_at >= h.max_hold_s
        ]
        if expired:
            for h in expired:  # the lock now expires within a ttl: the run cannot count on it
                self.remove(h)
                h.lost = True
                self.on_max_hold(h)
            ended = set(expired)
            held = [h for h in held if h not in ended]
            if not held:
                return None
        earliest = min([h.next_due for h in held])
        if earliest > now:
            return earliest - now
        try:
            statuses = self.store.renew([h._item or h.as_item() for h in held])
        except LockUnavailableError as exc:
            self.round_trips += 1
            self.on_error(exc)
            return self.error_retry_s
        self.round_trips += 1
        renewed = RenewStatus.RENEWED
        if RenewStatus.STOP_ASKED in statuses:  # renewed, and a newer call asks the run to stop
            for index, status in enumerate(statuses):
                if status is RenewStatus.STOP_ASKED:
                    held[index].stop_asked = True  # the run reads it when it checks
                    statuses[index] = renewed
        for h, status in zip(held, statuses, strict=True):
            if status is renewed:
                interval = h.interval
                # renewed late: less than a third of the ttl was left (two intervals passed)
                left = h.ttl_ms / 1000.0 - (now - (h.next_due - interval))
                h.renewals += 1
                h.next_due = now + interval
                if left < interval:
                    self.on_late(h, left)
                continue
            with self._mutex:
                still_held = h in self._held
                self._held.discard(h)
            if still_held:  # else the run ended and released while we were on the wire
                h.lost = True
                self.on_lost(h, status)
        with self._mutex:
            remaining = list(self._held)
        if not remaining:
            return None
        return max(0.0, min([h.next_due for h in remaining]) - now)

    # -- the thread ------------------------------------------------------------------------

    def ensure_started(self) -> None:
        """Run the timer in a daemon thread of this process (again after a fork)."""
        pid = current_pid()
        if self._pid == pid and self._thread_running:
            return
        with self._mutex:
            if self._pid == pid and self._thread_running:
                return
            self._pid = pid
            self._stop = threading.Event()
            self._wake = threading.Event()
            self._thread = threading.Thread(
                target=self._run, name="celery-singleton-renewer", daemon=True
            )
            self._thread_running = True
            self._thread.start()

    def stop(self, timeout: float | None = 5.0) -> None:
        """Stop the thread, after it sent the queued releases; locks are no longer renewed."""
        self._stop.set()
        self._wake.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        self._thread = None
        self._thread_running = False
        self.flush_releases()  # whatever the thread did not send (or no thread ran)

    def _run(self) -> None:
        try:
            self._loop()
        finally:  # a thread that stop() or a fork replaced must not speak for its successor
            if self._thread is threading.current_thread():
                self._thread_running = False

    def _loop(self) -> None:
        stop, wake, clock = self._stop, self._wake, self.clock
        while not stop.is_set():
            with self._mutex:
                self._deadline = float("-inf")  # running: add() need not wake us
                adds = self._adds
            try:
                if self._releases:
                    self.flush_releases()
                start = clock()
                timeout = self.run_due(start)
                if timeout is not None:  # from the end of the round trip, not its start
                    timeout = max(0.0, timeout - (clock() - start))
                self.report_sent()  # replies of releases written ahead that no acquire read
            except Exception:  # keep renewing whatever a callback did
                logger.exception("singleton: renewer tick failed")
                timeout = self.error_retry_s
            with self._mutex:
                if self._adds != adds:
                    continue  # a lock came in while we ran: look again
                now = clock()
                timeout = self.idle_s if timeout is None else min(timeout, self.idle_s)
                if self._releases:  # queued while we ran: send them now
                    timeout = 0.0
                self._deadline = now + timeout
            wake.wait(timeout)
            wake.clear()


def release_items(taken: list[tuple[HeldLock, str]]) -> list[ReleaseItem]:
    """Each queued release as ``LockBackend.release_many`` takes it: its run's lock, owner,
    generation, fencing token and what its end leaves behind."""
    return [
        (held.key, held.owner, held.generation, held.token, held.ending)
        if held.ending
        else (held.key, held.owner, held.generation, held.token)
        for held, _ in taken
    ]
