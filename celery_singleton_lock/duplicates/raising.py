"""``singleton_on_duplicate="raise"``: a duplicate fails.

It ends ``FAILURE`` with :class:`~celery_singleton_lock.errors.DuplicateTaskError` (its
``key``, ``holder`` and ``task_id``); over the key's rate limit, with
:class:`~celery_singleton_lock.errors.RateLimitedError`. Its error links are called, as for
any failure. Under publish-time dedup, ``delay()`` of a duplicate raises the same error.
"""

from __future__ import annotations

from ..core.backend import Contended, RateLimited
from ..settings.options import Options
from .policy import Action, Call, Fate, Policy, Why

__all__ = ["RaisePolicy"]


class RaisePolicy(Policy):
    """A duplicate fails with DuplicateTaskError."""

    name = "raise"
    refuses_at_publish = True

    def on_contended(self, call: Call, held: Contended, opts: Options) -> Action:
        return Action(Fate.RAISE, Why.DUPLICATE, holder=held.holder, policy=self.name)

    def over_rate(self, call: Call, held: RateLimited, opts: Options) -> Action:
        return Action(Fate.RAISE, Why.RATE, held.pttl_ms / 1000, held.holder, policy=self.name)
