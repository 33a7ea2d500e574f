"""What ``celery singleton release`` and ``purge`` do with the calls waiting beside a lock
they free: a coalesced follow-up is published (duplicates/coalesce.py), a queue is handed on to
its next call (duplicates/queue.py); with the lock's task not in the app (``-A``), each says
where its calls stay. No waiting call is left without a line saying so."""

from __future__ import annotations

from typing import Any, NoReturn, Protocol

import click

from ..core.admin import Orphan, QueueOrphan, iter_orphans, iter_queue_orphans
from ..core.backend import REDIS_ERRORS
from ..core.connection import store_for
from ..core.keys import LockKeys
from ..core.queue import waiting as waiting_calls


class _Target(Protocol):
    """What the CLI knows of where the locks are (tools/cli.py's ``_Target``)."""

    app: Any
    prefix: str
    redis_url: str

    @property
    def client(self) -> Any: ...

    def fail(self, exc: Exception) -> NoReturn: ...


__all__ = ["hand_on", "orphaned_follow_ups", "orphaned_queues", "publish_pending"]


def publish_pending(  # noqa: PLR0917 - the lock, its follow-up, and who let it go
    target: _Target,
    keys: LockKeys,
    task_name: str | None,
    pending: str | None,
    reason: str,
    releaser: str | None = None,
) -> bool:
    """Publish the coalesced follow-up waiting beside a lock a release or purge freed
    (duplicates/coalesce.py): ``releaser`` is the owner of the lock released (None: an orphan's,
    whose
    lock is gone); a follow-up it supersedes is not published. Without the task in this app,
    say where it stays. True when published."""
    task = None if target.app is None else target.app.tasks.get(task_name or "")
    if task is None:
        click.echo(
            f"{keys.lock}: its pending follow-up {pending} was left: task {task_name!r} is not "
            "in this app (-A); the key's next run publishes it",
            err=True,
        )
        return False
    from ..duplicates.coalesce import publish_follow_up  # the Celery side, only when there is one

    run = store_for(target.redis_url).run_script
    try:
        taken = publish_follow_up(task, run, keys, reason, releaser)
    except REDIS_ERRORS as exc:
        target.fail(exc)
    if taken is None:
        return False
    if taken.superseded_by is not None:
        click.echo(
            f"{keys.lock}: its pending follow-up {taken.follow_up} was superseded by the newer "
            f"run {taken.superseded_by}: not published (its result is the skip marker)"
        )
        return False
    click.echo(f"{keys.lock}: published its pending follow-up {taken.follow_up}")
    return True


def hand_on(  # noqa: PLR0917 - the key, its task, and who let it go
    target: _Target,
    keys: LockKeys,
    task_name: str | None,
    waiting: int,
    reason: str,
    releaser: str | None = None,
) -> None:
    """The key a release or purge freed goes to the next call in its queue (its task's policy
    hands it on, as the worker's main process does for a lost run). Without the task in this
    app the calls stay where they are, and say so: the key's next call hands it on."""
    task = None if target.app is None else target.app.tasks.get(task_name or "")
    parts = getattr(task, "_singleton_parts", None)
    if parts is None:
        click.echo(
            f"{keys.lock}: {waiting} queued call(s) wait: task {task_name!r} is not in this app "
            "(-A); the key's next call hands it on",
            err=True,
        )
        return
    try:
        parts().policy.after_release(task, keys, reason, releaser)
        length, head = waiting_calls(target.client, keys.lock)
    except REDIS_ERRORS as exc:
        target.fail(exc)
    click.echo(
        f"{keys.lock}: handed to the next queued call; {length} wait behind it"
        + ("" if head is None else f", next {head}")
    )


def orphaned_queues(target: _Target) -> list[QueueOrphan]:
    """Queues whose lock is gone (an expired lock nobody released, no later call)."""
    try:
        return list(iter_queue_orphans(target.client, target.prefix))
    except REDIS_ERRORS as exc:
        target.fail(exc)


def orphaned_follow_ups(target: _Target) -> list[Orphan]:
    """Pending follow-ups whose lock is gone (an expired lock nobody released)."""
    try:
        return list(iter_orphans(target.client, target.prefix))
    except REDIS_ERRORS as exc:
        target.fail(exc)
