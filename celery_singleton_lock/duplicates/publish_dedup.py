"""``singleton_lock_on="publish"``: publish-time dedup, a modifier of every policy.

``delay()``/``apply_async()`` of a call whose key is held, or whose identical call is queued,
publishes nothing and returns the holder's AsyncResult (under ``"raise"``: raises
``DuplicateTaskError``); the run still takes its lock on the worker. The mechanics (the queued
marker beside the lock, one round trip) are in publish/dedup.py; this part says when: at
publish, once the gate decided the call's fate (the marker is handed over to the lock), and
when the call is revoked or expires before it runs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..core.keys import LockKeys
from ..publish.dedup import forget, forget_for, publish
from ..settings.options import Options
from .policy import Fate, Part, modifier

__all__ = ["PublishDedup"]


class PublishDedup(Part):
    """Duplicates turned away when published."""

    setting = "singleton_lock_on"

    def applies(self, opts: Options) -> bool:
        return opts.lock_on != "execute"

    def on_publish(  # noqa: PLR0917 - as Part's
        self,
        task: Any,
        args: Sequence[Any] | None,
        kwargs: Mapping[str, Any] | None,
        task_id: str | None,
        options: dict[str, Any],
        send: Callable[..., Any],
    ) -> Any:
        policy = task._singleton_parts().policy
        return publish(
            task,
            args,
            kwargs,
            task_id,
            options,
            send,
            refuses=policy.refuses_at_publish,
            publishes_canvas=policy.publishes_canvas,
            replaces=policy.replaces_queued,
        )

    def on_decided(self, task: Any, task_id: str, keys: LockKeys, fate: Fate) -> None:
        forget(task, task_id, keys, "skip" if fate is Fate.SKIP else "start")

    def on_withdrawn(self, task: Any, request: Any) -> None:
        forget_for(task, request.id, request.args, request.kwargs)


modifier(PublishDedup())
