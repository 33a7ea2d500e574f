"""``singleton_on_duplicate="retry"``: a duplicate waits for its key, requeued.

It is published again (the same task id and retries count, as ``retry()`` would, without
spending ``max_retries``) with a countdown of ``singleton_retry_countdown``, and ends this
delivery as ``RETRY``; at the copy's time it asks for its key again. In an at-least window the
countdown is the window's end, when the key can be taken. Over the key's rate limit it waits
for the next allowed start. An eager call cannot wait: it fails with ``DuplicateTaskError``.
"""

from __future__ import annotations

from ..core.backend import Contended
from ..settings.options import Options
from .policy import Action, Call, Fate, Policy, Why

__all__ = ["RetryPolicy"]


class RetryPolicy(Policy):
    """A duplicate is requeued until it gets its key."""

    name = "retry"

    def on_contended(self, call: Call, held: Contended, opts: Options) -> Action:
        if call.eager:
            return Action(Fate.RAISE, Why.DUPLICATE, holder=held.holder, policy=self.name)
        countdown = opts.retry_countdown
        if held.finished:  # an at-least window: nothing can run before it ends, in pttl
            countdown = max(countdown, held.pttl_ms / 1000)
        return Action(Fate.REQUEUE, Why.DUPLICATE, countdown, held.holder, policy=self.name)
