"""A run's release on its usual path: written ahead, off the run's critical path.

Outside eager runs the release is written at once and its reply read later
(``Renewer.release_later``; docs/internals.md, "Deferred release"). A release that records a
completion and cannot be written ahead (Cluster, Redlock, ``wait_replicas``, a failed write) is
made in the run, before the message's acknowledgement, which follows the run's end. A policy
whose release owes something at once (a follow-up, joiners) releases now instead
(duplicates/policy.py ``Policy.release``).
"""

from __future__ import annotations

from ..core.renewer import HeldLock, Renewer
from .events import on_released

__all__ = ["release_run"]


def release_run(held: HeldLock, renewer: Renewer, state: str, *, eager: bool) -> None:
    """Release ``held``, whose run ended in ``state`` (its ``ending`` set)."""
    assert held.ending is not None
    if not eager and renewer.release_later(held, state, queue=not held.ending.completion_ttl_ms):
        return
    on_released(held, renewer.release_now(held), state)
