"""What a run knows of its lock: :class:`LockHandle`, ``self.singleton`` inside a bound task."""

from __future__ import annotations

from typing import Any

from ..core.renewer import HeldLock, Renewer

__all__ = ["NOT_HELD", "LockHandle", "handle_of"]


class LockHandle:
    """What a run knows of its lock: ``self.singleton`` inside a bound task."""

    __slots__ = ("_handed_over", "_held", "_renewer", "key", "reentered", "task_id")

    def __init__(
        self,
        key: str | None = None,
        task_id: str | None = None,
        held: HeldLock | None = None,
        reentered: bool = False,
        renewer: Renewer | None = None,
    ) -> None:
        self.key = key
        self.task_id = task_id
        self.reentered = reentered
        self._held = held
        self._renewer = renewer  # the one renewing it: the release goes through it
        #: retry() handed the lock over to the retried message: the run no longer holds it
        self._handed_over = False

    @property
    def held(self) -> bool:
        """True while this run holds the lock (False outside a worker run, once lost, and once
        ``retry()`` handed it over to the retried message)."""
        return self._held is not None and not self._held.lost and not self._handed_over

    @property
    def fencing_token(self) -> int | None:
        """Strictly increasing per lock key; pass it to writes that must reject stale runs."""
        return None if self._held is None else self._held.token

    @property
    def lost(self) -> bool:
        """True once a renewal found the lock gone or taken, or max_hold stopped renewing it."""
        return self._held is not None and self._held.lost

    @property
    def renewals(self) -> int:
        """How many times this process renewed the lock for this run so far (0 without a lock)."""
        return 0 if self._held is None else self._held.renewals

    def __repr__(self) -> str:
        return (
            f"<LockHandle key={self.key!r} task_id={self.task_id!r} "
            f"token={self.fencing_token!r} lost={self.lost}>"
        )


NOT_HELD = LockHandle()


def handle_of(request: Any) -> LockHandle:
    """The lock handle of the run of ``request`` (:data:`NOT_HELD` when it holds none)."""
    handle = getattr(request, "_singleton_handle", None)
    return handle if isinstance(handle, LockHandle) else NOT_HELD
