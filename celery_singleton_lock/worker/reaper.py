"""Notice a killed prefork pool child at once, so that its lock is released at once.

The worker's main process releases the lock of a lost pool child when Celery reports the
child lost (``task_failure(WorkerLostError)``, worker/hooks.py). Celery's AsynPool learns that a
child exited when the child's sentinel pipe becomes readable: it stops watching the sentinel
and runs billiard's ``maintain_pool()``, which reaps exited children (``waitpid`` with
``WNOHANG``) and reports their jobs lost. The pipe closes while the kernel tears the dying
child down, a moment before the child can be reaped; when ``maintain_pool()`` runs in that
moment it finds the child still there, and nothing looks again until the pool's periodic
maintenance, every 5 s (``AsynPool.timers``): the lock is released that much later
(docs/performance.md, section 6, has the measured distribution).

:class:`ChildReaper`, a worker bootstep added by worker/hooks.py at ``celeryd_init``, closes that
gap for the prefork pool: every :data:`REAP_INTERVAL_S` it looks for a child whose sentinel
the pool no longer watches although the child was not reaped, and once such a child can be
reaped it runs ``maintain_pool()``, which reaps it and reports its job lost. The look reads
two attributes per child; only in the moment after an exit does it make a ``waitpid``
system call (per such child). Other pools are left as they are.
"""

from __future__ import annotations

from typing import Any

from celery import bootsteps
from celery.concurrency.prefork import TaskPool

__all__ = ["REAP_INTERVAL_S", "ChildReaper", "reap_exited_children"]

#: Seconds between two looks for an exited, unreaped pool child.
REAP_INTERVAL_S = 0.25


def reap_exited_children(pool: Any) -> bool:
    """Run ``pool.maintain_pool()`` if a child whose exit it saw can be reaped now.

    ``pool`` is billiard's (Celery's Async) pool. A child whose sentinel is still watched
    (``_sentinel_poll`` set) is alive as far as the pool knows: it is not asked. True if the
    pool was maintained.
    """
    for proc in list(pool._pool):
        if getattr(proc, "_sentinel_poll", None) is not None or proc._popen is None:
            continue
        try:
            exited = proc.exitcode is not None  # waitpid(WNOHANG): reaps it if it can
        except ValueError:  # a closed process object
            continue
        if exited:
            pool.maintain_pool()
            return True
    return False


class ChildReaper(bootsteps.StartStopStep):  # type: ignore[misc]
    """A worker bootstep: prompt notice of exited prefork children (see the module doc)."""

    requires = ("celery.worker.components:Pool",)

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self._timer: Any = None

    def register_with_event_loop(self, w: Any, hub: Any) -> None:
        """Look every REAP_INTERVAL_S, with the prefork pool only (once per event loop)."""
        pool = getattr(w.pool, "_pool", None)
        if not isinstance(w.pool, TaskPool) or not hasattr(pool, "maintain_pool"):
            return
        if self._timer is not None:  # the consumer restarted and registers again
            self._timer.cancel()
        self._timer = hub.call_repeatedly(REAP_INTERVAL_S, reap_exited_children, pool)
