"""What a finished run leaves beside its lock: a completion record and an at-least window.

Two records, both written by the release of the run (``release.lua``, in the same call that
frees the lock, so a run pays no round trip for them) and read by the acquire of a later
delivery (``acquire.lua``, in its one round trip):

- **The completion record** ``{prefix}{tag}:done:<owner>`` (a string, same hash tag as the
  lock, so the same cluster slot): the largest generation of ``owner`` whose run finished,
  kept for :attr:`Ending.completion_ttl_ms`. An acquire by that owner with a generation not
  larger than it is :class:`~.backend.Completed`: the message already ran to its end, and this
  delivery is a copy of it (a broker redelivery). A later generation (a retried message) runs.
- **The at-least window**: instead of deleting the lock, the release keeps the lock's hash and
  marks it ended (field :data:`ENDED_FIELD`, the server's time in ms), expiring
  :attr:`Ending.at_least_ms` after the run's ``since`` (both on the Redis server's clock). Until
  then every acquire meets a holder (:attr:`~.backend.Contended.finished`), renewals and
  releases leave it alone, and publish-time dedup names the finished run. A run that ends after
  the window's length has passed deletes its lock as before.

Knows nothing of Celery: which run ends write what is the caller's choice (task/singleton_task.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from .keys import beside

__all__ = ["ENDED_FIELD", "NO_ENDING", "Ending", "done_key"]

#: The lock hash's field that marks an at-least window: when the run ended (server ms).
ENDED_FIELD = "ended"


@dataclass(frozen=True)
class Ending:
    """What the release of a finished run leaves behind (0: nothing of that kind).

    ``completion_ttl_ms``: keep the run's completion record this long (a redelivered copy of
    its message is then dropped, not run). ``at_least_ms``: keep the key blocked until this
    long after the run took its lock.
    """

    completion_ttl_ms: int = 0
    at_least_ms: int = 0

    def __post_init__(self) -> None:
        if self.completion_ttl_ms < 0 or self.at_least_ms < 0:
            raise ValueError(f"an Ending's durations must be >= 0, got {self!r}")

    def __bool__(self) -> bool:
        """False when it leaves nothing behind (a plain release)."""
        return bool(self.completion_ttl_ms or self.at_least_ms)


#: A release that leaves nothing behind (the lock is deleted, nothing is recorded).
NO_ENDING = Ending()


def done_key(lock_key: str, owner: str) -> str:
    """The completion record of ``owner`` beside ``{prefix}{tag}:lock``:
    ``{prefix}{tag}:done:<owner>`` (the same hash tag, so the same cluster slot); beside a
    permit slot ``{prefix}{tag}:lock:<i>`` the same one (one record per owner, whichever slot
    its run held). Beside a key of another shape (a store's caller may lock any key):
    ``<key>:done:<owner>``."""
    return beside(lock_key, f"done:{owner}")
