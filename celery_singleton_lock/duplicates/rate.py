"""``singleton_rate_limit="N/s"`` (or ``/m``, ``/h``): at most N runs of a key start within any
window of that length, counted across the cluster in the acquire's one round trip
(core/rates.py). A modifier of every policy.

A call over the rate meets its key's policy (each policy's ``over_rate``, with the moment the
next start is allowed):

- ``skip``: ends skipped; :func:`~.skips.skip_info` says ``reason="rate"`` and ``next_start``.
- ``retry`` and ``join`` (over the rate no run of a one-permit key is going: the lock was free):
  requeued to the moment the oldest start leaves the window, not polled.
- ``raise``: fails with :class:`~celery_singleton_lock.errors.RateLimitedError`.
- ``coalesce``: the first call over the rate is requeued to the next allowed moment and is the
  key's one follow-up (``{prefix}{tag}:rate_next`` names it until then); the calls over the rate
  after it end skipped, naming it. A follow-up (or any message the library requeued) is never
  dropped: over the rate again at its moment, it is requeued again.

A message its own task retried (``self.retry()``, ``autoretry_for``: a retries count above 0)
is a run going on, not a new call: over the rate it waits like ``retry`` whatever the policy
(duplicates/gate.py). An eager call (``apply()``) cannot be requeued: ``retry``, ``join`` and
``coalesce`` raise there.
"""

from __future__ import annotations

from ..settings.options import Options
from .policy import Part, modifier

__all__ = ["RateLimit", "rate_text"]

_PERIOD_NAMES = {1000: "s", 60_000: "m", 3_600_000: "h"}


def rate_text(rate: tuple[int, int]) -> str:
    """A rate as it was given: ``(5, 1000)`` is ``"5/s"``."""
    limit, period_ms = rate
    return f"{limit}/{_PERIOD_NAMES.get(period_ms, f'{period_ms}ms')}"


class RateLimit(Part):
    """A key's starts limited over a sliding window."""

    setting = "singleton_rate_limit"

    def applies(self, opts: Options) -> bool:
        return opts.rate_limit is not None

    def refuse(self, opts: Options) -> str | None:
        if opts.store_kind == "redlock":
            return (
                "singleton_rate_limit is not supported with a redis+redlock:// URL (the starts "
                "of a key would need a majority of their own on every master); use one server, "
                "Sentinel or Cluster"
            )
        if opts.lock_on != "execute":
            return (
                'singleton_rate_limit needs singleton_lock_on "execute" (the rate is counted '
                f"where a run starts), got lock_on {opts.lock_on!r}"
            )
        return None


modifier(RateLimit())
