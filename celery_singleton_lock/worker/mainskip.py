"""The main-process skip: duplicates of a held lock turned away by the worker's main process,
before any Request, pool hand-off or Celery tracer.

``SingletonTask.Strategy`` is :func:`singleton_strategy`: Celery's default strategy behind one
test. A message of a task with no hot key (core/hotkeys.py) goes to Celery's handler at once:
an empty-dict test is all a run pays. A key becomes hot when a skip decided in the executing
process comes back to the main process (:func:`learning` wraps the ``on_success`` of the
task's Request class, worker/hooks.py); while a key of the task is hot, each of its messages is
decoded (Celery decodes it in the main process anyway), its keys are derived, and when its
own key is hot Redis is asked in one read-only round trip (core/probe.py) what an acquire
would find. A skip (held by another run than this message's earlier delivery and than the
run that published it, or an at-least window, or every permit slot held) ends here, with
what the executing process does for one (task/tracer.py :func:`~.tracing.end_skip`: the marker
stored, ``task_prerun``, the one ``singleton: duplicate skipped`` line, ``duplicate_skipped``,
``task_postrun``), the events Flower reads (task-received, task-started, task-succeeded) and
the message acknowledged; the probe refreshes the key. Anything else (the lock free, this
message's own earlier delivery or parent holding it, its completion record) forgets the key
and goes to Celery's handler, which runs, requeues or drops it as before.

Only in the solo and threads pools (:data:`MAIN_PROCESS_POOLS`); under prefork every message
goes to Celery's handler, and the pool's child skips as before. Celery's handler also takes,
untouched: a message with an ETA or countdown, or an expiry; one
revoked (by id, or while any stamped revoke is in force); a scheduled run's (beat's witness
sees it); protocol 1; every message of a rate-limited task, or of a policy whose skips do not
end in the main process, or with a part decided before the lock (debounce) (the strategy is
then Celery's own); every message when the lock store is a cluster or
Redlock. A failed probe (Redis down, or slower than
:data:`~.core.connection.PROBE_TIMEOUT_S`) or a failed result store forgets every hot key of
the task: the message and the next ones go to Celery's handler until a skip in the executing
process makes a key hot again. See docs/internals.md, "The main-process skip".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from celery.utils.saferepr import saferepr
from celery.worker.request import logger as request_logger
from celery.worker.strategy import default

from ..beat.claims import CLAIM_HEADER
from ..core.connection import prober_for
from ..core.hotkeys import HotKeys
from ..core.probe import probe
from ..duplicates.gate import decide, worker_call
from ..duplicates.policy import Fate
from ..duplicates.skips import SKIP_MARKER
from ..errors import LockUnavailableError
from ..run.log import about, logger
from ..task.tracer import end_skip

if TYPE_CHECKING:
    from ..task.singleton_task import SingletonTask

__all__ = ["MAIN_PROCESS_POOLS", "hot_keys_of", "learning", "singleton_strategy"]

Handler = Callable[..., Any]

#: How the repr of a skip's marker starts: what a pool hands the main process back for a
#: skipped duplicate (Celery passes it the repr of a run's return value, in every pool).
_SKIP_REPR = repr({SKIP_MARKER: True})[:-1]
#: in a skip's repr when it was skipped for the rate, not a held key: nothing to probe for
_RATE_REPR = "'reason': 'rate'"


def hot_keys_of(task: Any) -> HotKeys | None:
    """The hot keys of ``task`` in this process; None unless its strategy turns duplicates away."""
    hot: HotKeys | None = task.__dict__.get("_singleton_hot")
    return hot


#: The pools whose tasks run in the worker's main process (solo: in its main thread; threads:
#: in threads of it, which share one interpreter lock with the main thread). Only there does a
#: skip ended by the main process take no parallel work away: under prefork the children skip
#: in parallel, and the main process, which receives and acknowledges every message, would do
#: each skip's blocking round trips in its event loop, one after the other (a flood drained at
#: 0.76-0.78x instead of 0.95x of a plain flood's rate, docs/performance.md), and call the
#: result backend there. Other pools (prefork, gevent, eventlet) keep the executing process's
#: skip.
MAIN_PROCESS_POOLS = frozenset({"celery.concurrency.solo", "celery.concurrency.thread"})


def singleton_strategy(task: SingletonTask, app: Any, consumer: Any, **options: Any) -> Handler:
    """``SingletonTask.Strategy``: Celery's default strategy, with the main-process skip in the
    pools of :data:`MAIN_PROCESS_POOLS`."""
    handler: Handler = default(task, app, consumer, **options)
    opts = task.singleton_options()
    parts = task._singleton_parts()
    if (
        not parts.policy.ends_in_main_process
        or parts.before_lock  # a call is decided before its lock (debounce: task/tracer.py)
        or type(getattr(consumer, "pool", None)).__module__ not in MAIN_PROCESS_POOLS
        or prober_for(opts.redis_url) is None
    ):
        return handler
    hot = task.__dict__.setdefault("_singleton_hot", HotKeys())
    entries = hot.entries
    skip = _MainSkip(task, consumer, hot).skipped

    def on_message(message: Any, body: Any, ack: Any, reject: Any, callbacks: Any) -> Any:
        if entries and skip(message, body, ack):
            return None
        return handler(message, body, ack, reject, callbacks)

    return on_message


def learning(on_success: Callable[..., Any]) -> Callable[..., Any]:
    """A Request's ``on_success`` that first makes the key of a skipped duplicate hot."""
    if getattr(on_success, "_singleton_learns", False):
        return on_success

    def learns(self: Any, failed__retval__runtime: Any, **kwargs: Any) -> Any:
        retval = failed__retval__runtime[1]
        if type(retval) is str and retval.startswith(_SKIP_REPR) and _RATE_REPR not in retval:
            _learn(self, failed__retval__runtime[0])
        return on_success(self, failed__retval__runtime, **kwargs)

    learns._singleton_learns = True  # type: ignore[attr-defined]
    return learns


def _learn(request: Any, failed: Any) -> None:
    """A duplicate of ``request``'s key was skipped by the executing process: the key is hot."""
    hot = hot_keys_of(request.task)
    if failed or hot is None:
        return
    try:
        keys = request.task.singleton_keys(request.args, request.kwargs)
    except Exception:  # a key callable's error is the run's to report
        return
    hot.mark(keys.lock)


class _MainSkip:
    """Whether a message is a duplicate to turn away here, and ending it if so."""

    def __init__(self, task: SingletonTask, consumer: Any, hot: HotKeys) -> None:
        self.task = task
        self.hot = hot
        self.hostname = consumer.hostname
        self.connection_errors = consumer.connection_errors
        state = consumer.controller.state
        self.revoked = state.revoked
        self.revoked_stamps = state.revoked_stamps
        self.buckets = None if consumer.disable_rate_limits else consumer.task_buckets
        eventer = consumer.event_dispatcher
        self.eventer = eventer if eventer and eventer.enabled and task.send_events else None

    def skipped(self, message: Any, body: Any, ack: Any) -> bool:
        """End ``message`` here if it is a duplicate of a hot key's holder; whether it did."""
        task = self.task
        headers = message.headers
        if body is not None or headers.get("eta") or headers.get("expires"):
            return False  # protocol 1, or scheduled: Celery's handler
        task_id = headers.get("id")
        if (
            not task_id
            or task_id in self.revoked
            or (self.revoked_stamps and headers.get("stamped_headers"))
            or CLAIM_HEADER in headers
            or (self.buckets is not None and self.buckets[task.name] is not None)
        ):
            return False
        try:  # Celery's handler decodes it again from kombu's cache
            args, kwargs, embed = message.payload
            keys = task.singleton_keys(args, kwargs)
            generation = int(headers.get("retries") or 0)
        except Exception:  # a bad message is Celery's, or the run's, to report
            return False
        hot = self.hot
        if not hot.is_hot(keys.lock):
            return False
        opts = task._singleton_opts or task.singleton_options()
        prober = prober_for(opts.redis_url)
        if prober is None:
            return False
        try:
            held = probe(prober, keys, task_id, generation)
        except LockUnavailableError as exc:
            self.hot.clear()
            logger.warning(
                "singleton: could not probe lock, duplicates go to the pool: %s[%s] key=%s: %s",
                task.name,
                task_id,
                keys.lock,
                exc,
                extra=about(task.name, task_id),
            )
            return False
        call = worker_call(task_id, generation, headers)
        action = None if held is None else decide(held, call, opts, task._singleton_parts().policy)
        if held is None or action is None or action.fate is not Fate.SKIP:
            hot.forget(keys.lock)  # free, or this message's own delivery or parent: not a skip
            return False
        hot.mark(keys.lock, held.pttl_ms)
        request = self._request(message, headers, args, kwargs, embed)
        try:
            marker, runtime = end_skip(task, keys, action, task_id, args, kwargs, request)
        except Exception as exc:  # storing failed: nothing was sent yet
            self.hot.clear()
            logger.warning(
                "singleton: could not end skipped duplicate, handing it to celery: %s[%s]: %s",
                task.name,
                task_id,
                exc,
                extra=about(task.name, task_id),
            )
            return False
        if self.eventer is not None:
            self._events(headers, task_id, marker, runtime)
        ack(request_logger, self.connection_errors)  # as Celery's Request acknowledges
        return True

    def _request(
        self, message: Any, headers: Any, args: Any, kwargs: Any, embed: Any
    ) -> dict[str, Any]:
        """The request dict Celery's tracer would get for ``message`` (worker/request.py's
        ``Request`` and app/trace.py's ``fast_trace_task``)."""
        delivery_info = message.delivery_info or {}
        properties = message.properties or {}
        request = dict(headers)
        request.update(
            properties=properties,
            reply_to=properties.get("reply_to"),
            correlation_id=properties.get("correlation_id"),
            hostname=self.hostname,
            delivery_info={
                "exchange": delivery_info.get("exchange"),
                "routing_key": delivery_info.get("routing_key"),
                "priority": properties.get("priority"),
                "redelivered": delivery_info.get("redelivered", False),
            },
            args=args,
            kwargs=kwargs,
            is_eager=False,
        )
        if embed:
            request.update(embed)
        return request

    def _events(self, headers: Any, task_id: str, marker: Any, runtime: float) -> None:
        """The events Celery's worker sends for a message that ran and succeeded, with the
        fields it gives them (worker/strategy.py, worker/request.py)."""
        send = self.eventer.send  # type: ignore[union-attr]
        send(
            "task-received",
            uuid=task_id,
            name=headers.get("shadow") or headers.get("task"),
            args=headers.get("argsrepr", ""),
            kwargs=headers.get("kwargsrepr", ""),
            root_id=headers.get("root_id"),
            parent_id=headers.get("parent_id"),
            retries=headers.get("retries", 0),
            eta=None,
            expires=None,
        )
        send("task-started", uuid=task_id)
        send("task-succeeded", uuid=task_id, result=saferepr(marker), runtime=runtime)
