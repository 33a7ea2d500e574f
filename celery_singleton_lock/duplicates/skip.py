"""``singleton_on_duplicate="skip"`` (the default): a duplicate does not run.

It ends at once as a ``SUCCESS`` whose result is the skip marker naming the key and the run
holding it (duplicates/skips.py ``skip_info``); what follows it in a canvas stops
(duplicates/canvas.py). A worker ends it in front of Celery's tracer (task/tracer.py), and in
the solo and threads pools the worker's main process turns the next duplicates of a hot key
away itself (worker/mainskip.py). Over the key's rate limit it is skipped the same way, its
marker saying when the next start is allowed.
"""

from __future__ import annotations

from ..core.backend import Contended, RateLimited
from ..settings.options import Options
from .policy import Action, Call, Fate, Policy, Why

__all__ = ["SkipPolicy"]


class SkipPolicy(Policy):
    """A duplicate ends skipped."""

    name = "skip"
    ends_in_front = True
    ends_in_main_process = True

    def on_contended(self, call: Call, held: Contended, opts: Options) -> Action:
        return Action(Fate.SKIP, Why.DUPLICATE, holder=held.holder, policy=self.name)

    def over_rate(self, call: Call, held: RateLimited, opts: Options) -> Action:
        return Action(Fate.SKIP, Why.RATE, held.pttl_ms / 1000, held.holder, policy=self.name)
