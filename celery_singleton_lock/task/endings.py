"""How a run of a SingletonTask ends: its lock released (or handed over to its retry), the
records its ending leaves, and the coalesced follow-up its release lets go.

:class:`RunEndings` is a base of :class:`~celery_singleton_lock.task.SingletonTask`:

- ``_singleton_after_run``: from the ``task_postrun`` signal (worker/hooks.py), which fires
  for every outcome of a traced run: success, failure, Ignore, Reject and Retry;
- ``singleton_release_for``: from the worker's main process, for a run whose pool child was
  lost (worker/hooks.py, worker/reaper.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from celery import Task, states
from celery.exceptions import Retry

from .. import signals
from ..core.backend import ReleaseStatus, release_lost_slot
from ..core.connection import store_for
from ..core.keys import LockKeys, keys_of
from ..duplicates.coalesce import publish_follow_up
from ..duplicates.join import complete_joiners, take_ended_joiners
from ..errors import LockUnavailableError, SingletonKeyError
from ..run.completion import ending_for
from ..run.events import on_released
from ..run.handle import LockHandle, handle_of
from ..run.log import LOGGED_ERRORS, about, logger
from ..run.task_events import EventSink, run_sink

if TYPE_CHECKING:
    from datetime import datetime

    from ..settings.options import Options

__all__ = ["RunEndings"]


class RunEndings(Task):  # type: ignore[misc]
    """The release paths of :class:`~celery_singleton_lock.task.SingletonTask`."""

    if TYPE_CHECKING:  # given by SingletonTask and RetryHandOver

        def singleton_options(self) -> Options: ...

        def singleton_keys(
            self, args: Sequence[Any] | None, kwargs: Mapping[str, Any] | None
        ) -> LockKeys: ...

        def _singleton_hand_over(
            self, handle: LockHandle, when: datetime | float | None
        ) -> None: ...

        _singleton_opts: Options | None

    def _singleton_after_run(self, state: str, retval: Any = None) -> None:
        """Stop renewing and release; after a hand-over (``retry()``, also with
        ``throw=False`` and the body went on), leave the lock for the retried message.

        A run that ends in ``RETRY`` without a hand-over hands over here when Celery published
        its retry (``retval`` is the ``Retry``, with the retried signature: a ``retry()``
        override that did not call this class's), and releases when nothing was published (a
        ``Retry`` raised by hand, an eager run: its retry, if any, runs after this ending).

        Outside eager runs the release leaves the run's critical path: written at once, its
        reply read later (``Renewer.release_later``; "Deferred release" in docs/design.md);
        one that records a completion and cannot be written ahead is made in the run.
        """
        request = self.request
        handle = handle_of(request)
        held, renewer = handle._held, handle._renewer
        if held is None or renewer is None:
            return
        if handle._handed_over:
            renewer.remove(held)
            return
        if (  # RETRY, and Celery published the retry (checked only then: every run ends here)
            state == states.RETRY
            and not request.is_eager
            and isinstance(retval, Retry)
            and retval.sig is not None
        ):
            self._singleton_hand_over(handle, retval.when)
            return
        self._singleton_release(
            handle, state, eager=request.is_eager, delayed=bool(request.eta), retval=retval
        )

    def _singleton_release(
        self,
        handle: LockHandle,
        state: str,
        *,
        eager: bool,
        delayed: bool = False,
        retval: Any = None,
    ) -> None:
        """Release the lock of a run that ended in ``state`` (see ``_singleton_after_run``);
        ``delayed``: its message carried an eta or countdown. Under the join policy, the
        duplicates that joined it are taken before the release and completed with ``state``
        and ``retval`` after it (duplicates/join.py)."""
        held, renewer = handle._held, handle._renewer
        assert held is not None
        assert renewer is not None
        handle._held = None
        opts = self._singleton_opts or self.singleton_options()
        held.ending = ending_for(
            opts.completion_ttl_of(delayed),
            opts.lock_at_least,
            state,
            opts.failure_is_final,
        )
        if opts.on_duplicate == "coalesce":  # released now: the follow-up goes out at once
            on_released(held, renewer.release_now(held), state)
            self._singleton_follow_up(keys_of(held.key, opts.permits), state, held.owner)
            return
        if opts.on_duplicate == "join":  # released now: the joiners complete at once
            # taken while the lock is held: a watch copy that takes the released lock finds
            # its record gone and waits for its completion, instead of running itself; and
            # again after the release: those that joined in the round trip between
            ends = state in (states.SUCCESS, states.FAILURE) and not eager
            taken = take_ended_joiners(self, held.key, held.owner) if ends else []
            on_released(held, renewer.release_now(held), state)
            if ends:
                taken += take_ended_joiners(self, held.key, held.owner)
            if taken:
                complete_joiners(
                    self, held.key, held.owner, taken, state, retval, send_events=run_sink(self)
                )
            return
        # A completion record must reach Redis before the message's acknowledgement, which
        # follows this hook: written ahead it is on the wire now; else (Cluster, Redlock,
        # wait_replicas, a failed write) the release is made here, not left to the thread.
        if not eager and renewer.release_later(
            held, state, queue=not held.ending.completion_ttl_ms
        ):
            return
        on_released(held, renewer.release_now(held), state)

    def singleton_end_joiners_for(
        self,
        task_id: str,
        args: Sequence[Any] | None,
        kwargs: Mapping[str, Any] | None,
        state: str,
        exc: BaseException,
        *,
        send_events: EventSink | None,
    ) -> None:
        """Complete the duplicates that joined the run ``task_id`` with its end (``state`` and
        ``exc``), from the worker's main process: a run terminated by a revoke, or stopped by
        its hard time limit, whose own process does not end it (duplicates/join.py). Their task
        events go to ``send_events`` (run/task_events.py)."""
        if self.singleton_options().on_duplicate != "join":
            return
        try:
            keys = self.singleton_keys(args, kwargs)
        except SingletonKeyError:
            return
        taken = take_ended_joiners(self, keys.lock, task_id)
        complete_joiners(self, keys.lock, task_id, taken, state, exc, send_events=send_events)

    def _singleton_follow_up(
        self, keys: LockKeys, reason: str, releaser: str | None = None
    ) -> None:
        """Publish the pending follow-up of ``keys``, if it has one and a slot is free
        (duplicates/coalesce.py); only under the coalesce policy. ``releaser``: the task id of the
        run
        whose release this is (a follow-up left beside older runs only is superseded by it)."""
        if self.singleton_options().on_duplicate != "coalesce":
            return
        try:
            publish_follow_up(
                self,
                store_for(self.singleton_options().redis_url).run_script,
                keys,
                reason,
                releaser,
            )
        except LOGGED_ERRORS as exc:
            logger.warning(
                "singleton: could not take coalesced follow-up, it waits for the next release "
                "or purge: %s key=%s: %s",
                self.name,
                keys.lock,
                exc,
                extra=about(self.name, ""),
            )

    def singleton_release_for(
        self,
        task_id: str,
        args: Sequence[Any] | None,
        kwargs: Mapping[str, Any] | None,
        generation: int,
        reason: str,
    ) -> ReleaseStatus | None:
        """Release the lock a lost run of this task held, from outside it (main process).

        Only that run's generation, and never a lock it handed over to a retry
        (``release_lost.lua``).
        """
        try:
            keys = self.singleton_keys(args, kwargs)
            opts = self.singleton_options()
            key, status = release_lost_slot(
                store_for(opts.redis_url),
                keys,
                task_id,
                generation,
                round(opts.lock_at_least * 1000),
            )
        except (SingletonKeyError, LockUnavailableError) as exc:
            logger.warning(
                "singleton: could not release after %s, lock expires in its ttl: %s[%s]: %s",
                reason,
                self.name,
                task_id,
                exc,
                extra=about(self.name, task_id),
            )
            return None
        if status is ReleaseStatus.RELEASED:
            logger.warning(
                "singleton: released by main process after %s: %s[%s] key=%s",
                reason,
                self.name,
                task_id,
                key,
                extra=about(self.name, task_id),
            )
            signals.lock_released.send(sender=self, key=key, task_id=task_id, reason=reason)
        elif status is not ReleaseStatus.NOT_HELD:
            handed_over = status is ReleaseStatus.HANDED_OVER
            logger.info(
                "singleton: not released by main process after %s, %s: %s[%s] key=%s",
                reason,
                "handed over to its retry"
                if handed_over
                else "no slot of its own left, the others held"
                if keys.permits > 1
                else "held by another run",
                self.name,
                task_id,
                key,
                extra=about(self.name, task_id),
            )
        # Whatever became of its own lock or slot (released, expired, taken, handed over): a
        # follow-up left meanwhile goes out if a slot is free (take_pending.lua checks), not at
        # the next release (with permits, a lost run's expired slot is free beside held ones).
        self._singleton_follow_up(keys, reason, task_id)
        return status
