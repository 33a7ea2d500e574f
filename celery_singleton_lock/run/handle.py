"""What a run knows of its lock: :class:`LockHandle`, ``self.singleton`` inside a bound task."""

from __future__ import annotations

import contextlib
from typing import Any

from celery.exceptions import Ignore, TaskRevokedError
from celery.states import READY_STATES

from ..core._wire import as_text, script
from ..core.connection import store_for
from ..core.renewer import HeldLock, Renewer
from .log import LOGGED_ERRORS, about, logger
from .task_events import run_sink

__all__ = ["NOT_HELD", "Cancelled", "LockHandle", "handle_of"]


def _ended(task: Any, task_id: str) -> bool:
    """Whether ``task_id``'s result says it ended (revoked: Celery 5.7 stores REVOKED at once)."""
    try:
        return task.backend.get_state(task_id) in READY_STATES
    except Exception:  # no backend to read, or it failed: the request stands
        return False


class Cancelled(Ignore):  # type: ignore[misc]
    """How a run that a newer call asked to stop ends (``LockHandle.end_cancelled``): its
    result stored ``REVOKED`` first, then acknowledged, nothing more stored, no link called."""


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
    def cancelled(self) -> bool:
        """True once a newer call of the key asked this run to stop
        (``singleton_on_duplicate="cancel"``): seen at the run's next renewal, at most a third of
        the ttl after the newer call reached a worker, with no round trip of its own. The run
        decides what to do: :meth:`end_cancelled` ends it."""
        return self._held is not None and self._held.stop_asked

    def end_cancelled(self) -> None:
        """End this run as cancelled: its state ``REVOKED``, its result
        ``TaskRevokedError("cancelled: superseded by <newer task id>")``, no link called, its
        chain stopped (as Celery ends a revoked task); the release hands the key to the newer
        call. Raises; call it from the task's body.

        Returns instead (and :attr:`cancelled` is False again) when the newer call that asked
        was revoked, or ended otherwise, meanwhile: its request is void, and the run goes on."""
        held = self._held
        task = None if held is None else held.context
        if held is None or task is None or self.task_id is None:
            raise RuntimeError("end_cancelled() needs a run that holds its lock")
        newer = "a newer call"
        store = store_for(task.singleton_options().redis_url)
        try:
            found = store.client.hget(held.key, "cancel")
        except LOGGED_ERRORS:
            found = None
        if found is not None:
            newer = as_text(found)
            if _ended(task, newer):  # revoked while it waited: its request is withdrawn
                with contextlib.suppress(*LOGGED_ERRORS):
                    store.run_script(script("withdraw_stop.lua"), [1, held.key, newer])
                held.stop_asked = False
                logger.info(
                    "singleton: stop request withdrawn, the newer call ended: %s[%s] key=%s by=%s",
                    task.name,
                    self.task_id,
                    self.key,
                    newer,
                    extra=about(task.name, self.task_id),
                )
                return
        reason = f"cancelled: superseded by {newer}"
        task.backend.mark_as_revoked(self.task_id, reason, request=task.request)
        logger.info(
            "singleton: run cancelled, a newer call takes the key: %s[%s] key=%s by=%s",
            task.name,
            self.task_id,
            self.key,
            newer,
            extra=about(task.name, self.task_id),
        )
        send_events = run_sink(task)
        if send_events is not None:  # Flower: REVOKED, as for Celery's own revoke
            fields = {"terminated": False, "signum": None, "expired": False}
            send_events([("task-revoked", self.task_id, fields)])
        raise Cancelled(TaskRevokedError(reason))

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
