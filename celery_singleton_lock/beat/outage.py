"""Redis outages as one beat instance sees them: one line when one starts, one when it ends.

While Redis does not answer, every call a beat makes fails: the claims of the runs due at each
tick, the claims it retries every second, the lease in leader mode. Rather than a line per run
and per tick, :class:`Outage` logs the first failure (ERROR) and, at the first call that
succeeds after it, how long Redis did not answer (WARNING). What the beat does meanwhile is the
callers' business (publishing.py retries the runs, leader.py judges its lease).

Knows nothing of Celery nor of Redis: it is told what failed and when.
"""

from __future__ import annotations

import logging

__all__ = ["Outage"]

#: the scheduler's logger
logger = logging.getLogger(f"{__package__}.scheduler")


class Outage:
    """Whether Redis answers one beat instance, logged once per change."""

    def __init__(self) -> None:
        #: monotonic time of the first failure of the current outage; None while Redis answers
        self.since: float | None = None

    @property
    def down(self) -> bool:
        """True between a failed call and the next one that succeeds."""
        return self.since is not None

    def failed(self, error: Exception, now: float) -> bool:
        """A call failed at monotonic time ``now``; True (and logged) if an outage starts."""
        if self.since is not None:
            return False
        self.since = now
        logger.error("beat: redis unreachable, publishing nothing until it answers: %s", error)
        return True

    def answered(self, now: float) -> None:
        """A call succeeded at monotonic time ``now``: an outage going on ends (logged)."""
        if self.since is None:
            return
        lasted, self.since = now - self.since, None
        logger.warning("beat: redis answers again after %.1fs", lasted)
