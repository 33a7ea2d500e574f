"""Redis outages as one beat instance sees them: one line when one starts, one when it ends,
and what the instance no longer trusts after one.

While Redis does not answer, every call a beat makes fails: the claims of the runs due at each
tick, the claims it retries every second, the lease in leader mode. Rather than a line per run
and per tick, :class:`Outage` logs the first failure (ERROR) and, at the first call that
succeeds after it, how long Redis did not answer (WARNING). What the beat does meanwhile is the
callers' business (publishing.py retries the runs, leader.py judges its lease).

An outage may also have been a restart without the data: the claims seen before it may be gone.
A run seen claimed by another instance (pending) is claimed again when that claim's publish
lease ends, in case its claimer died before publishing it (:meth:`Outage.watch`); claimed on a
server that lost the claim, and the run's ``done`` record with it, it would be published a
second time. So a run seen pending before an outage is not claimed again after it
(:meth:`Outage.stale`): the claimer, alive, publishes it; one that died in that same window
loses it.

Knows nothing of Celery nor of Redis: it is told what failed and when.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .runs import Run

__all__ = ["Outage"]

#: the scheduler's logger
logger = logging.getLogger(f"{__package__}.scheduler")


class Outage:
    """Whether Redis answers one beat instance, logged once per change; the runs it watches."""

    def __init__(self, on_start: Callable[[], None] | None = None) -> None:
        #: called as an outage starts (the scheduler watches its entries again once Redis
        #: answers: the runs due meanwhile are caught up as each entry's choice says)
        self.on_start = on_start
        #: monotonic time of the first failure of the current outage; None while Redis answers
        self.since: float | None = None
        #: how many outages started so far
        self.count = 0
        #: runs seen claimed by another instance, pending: how many outages had started then
        self._watched: dict[Run, int] = {}

    @property
    def down(self) -> bool:
        """True between a failed call and the next one that succeeds."""
        return self.since is not None

    def failed(self, error: Exception, now: float) -> bool:
        """A call failed at monotonic time ``now``; True (and logged) if an outage starts."""
        if self.since is not None:
            return False
        self.since, self.count = now, self.count + 1
        logger.error("beat: redis unreachable, publishing nothing until it answers: %s", error)
        if self.on_start is not None:
            self.on_start()
        return True

    def answered(self, now: float) -> None:
        """A call succeeded at monotonic time ``now``: an outage going on ends (logged)."""
        if self.since is None:
            return
        lasted, self.since = now - self.since, None
        logger.warning("beat: redis answers again after %.1fs", lasted)

    def watch(self, run: Run) -> None:
        """``run`` was found claimed by another instance, not published yet."""
        self._watched[run] = self.count

    def settled(self, run: Run) -> None:
        """``run`` was won, or found published: no longer watched."""
        self._watched.pop(run, None)

    def stale(self, run: Run) -> bool:
        """Whether ``run``, about to be claimed again, was seen pending before an outage
        (logged; it is then no longer watched)."""
        seen = self._watched.get(run)
        if seen is None or seen == self.count:
            return False
        del self._watched[run]
        logger.warning(
            "beat: run claimed by another instance before a redis outage, not claimed again: "
            "entry=%s run=%s",
            run.entry_name,
            run.run,
        )
        return True
