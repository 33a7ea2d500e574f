"""``singleton_lock_at_least=S`` on a task: the key stays blocked until S seconds after each run
took its lock, on the Redis server's clock, however soon the run ends (ShedLock's
``lockAtLeastFor``). A modifier of every policy that has no run to hand its calls to.

A run's release leaves the key held as an at-least window (core/completion.py, written by the
release script: run/completion.py ``ending_for``); a call that meets the window meets its policy
with ``finished`` set (duplicates/gate.py): ``retry`` waits until the window's end, ``skip`` and
``raise`` end at once. ``coalesce`` and ``join`` refuse a window (their own modules say why): a
window has no run whose end would serve the calls left waiting.
"""

from __future__ import annotations

from ..settings.options import Options
from .policy import Part, modifier

__all__ = ["AtLeastWindow"]


class AtLeastWindow(Part):
    """A key held for a while after each run's start."""

    setting = "singleton_lock_at_least"

    def applies(self, opts: Options) -> bool:
        return opts.lock_at_least > 0


modifier(AtLeastWindow())
