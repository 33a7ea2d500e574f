"""``singleton_permits=N``: up to N runs of a key at once, each holding a permit slot of its own
(``<lock key>:<i>``: renewed, released and fenced like a single lock; core/keys.py). A modifier
of every policy: the call that meets a full set of slots meets the key's policy, the holder
being the run whose slot expires first. ``"unlimited"`` (with a rate limit): no limit on runs
at once, only the rate applies (a run then holds no lock).
"""

from __future__ import annotations

from ..settings.options import Options
from .policy import Part, modifier

__all__ = ["Permits"]


class Permits(Part):
    """Several runs of a key at once (or any number, under a rate limit)."""

    setting = "singleton_permits"

    def applies(self, opts: Options) -> bool:
        return opts.permits != 1

    def refuse(self, opts: Options) -> str | None:
        if opts.permits == 0 and opts.rate_limit is None:
            return (
                "singleton_permits 'unlimited' (no limit on runs at once) needs "
                "singleton_rate_limit: without a rate it would limit nothing"
            )
        if opts.permits == 0 and opts.lock_at_least > 0:
            return (
                "singleton_permits 'unlimited' does not go with singleton_lock_at_least (a run "
                "holds no lock to keep the key blocked with); the rate limits the starts"
            )
        if opts.store_kind == "redlock":
            return (
                "singleton_permits > 1 is not supported with a redis+redlock:// URL (a permit "
                "slot would need a majority of its own on every master); use 1 permit, or one "
                "server, Sentinel or Cluster"
            )
        if opts.lock_on != "execute":
            return (
                'singleton_permits > 1 needs singleton_lock_on "execute": a queued marker stands '
                f"for one run, got lock_on {opts.lock_on!r}"
            )
        return None


modifier(Permits())
