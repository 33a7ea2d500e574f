"""What a skipped duplicate does to the canvas around it: everything after it stops, and the
results the caller waits on say why.

A skipped step has no result of its own to hand on (the run holding the lock does the work),
so nothing that would consume it runs: the rest of its chain, the body of a chord it belongs
to, its ``link`` callbacks. Celery's own ``Ignore`` stopped them too, but left every result
after it ``PENDING`` forever; a failure stores its exception in each of them instead
(``Backend._fail_chain``). A skip does the same with its marker: every result that will never
come (each remaining chain step, a chord body, and what follows those) is stored as
``SUCCESS`` with the skipped step's marker, so ``result.get()`` and :func:`~.skips.skip_info`
on the AsyncResult a caller holds for a chain or a chord name the key and the holder.

A skipped chord member does not count towards its chord (Celery's chord counter is left
short, so the body never runs with a marker among its arguments; the counter's keys expire
with ``result_expires``). Link callbacks (``link``) are not called, nor ``link_error`` (a skip
is no error), and nothing is stored for them: Celery stores nothing for them either when a
task fails. Groups need nothing: each member is its own result.

Eager runs (``apply()``, ``task_always_eager``) do not go through here for what follows:
Celery's eager chain and chord run every step themselves and hand the marker on as the next
step's argument (docs/configuration.md, "Canvas").
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from typing import Any

from celery import states
from celery.app.task import Context

__all__ = ["ignores_result", "store_skip"]

logger = logging.getLogger(__name__)


def store_skip(task: Any, task_id: str, marker: Mapping[str, Any], request: Any) -> int:
    """Store the skip's ``marker`` as the result of ``task_id`` (unless its result is ignored)
    and of every task of the canvas that will not run because of it; return how many of those
    (0 outside a canvas)."""
    backend = task.backend
    if not ignores_result(task, request):
        # store_result, not mark_as_done: a chord member must not count towards its chord
        backend.store_result(task_id, marker, states.SUCCESS, request=request)
    stopped = 0
    for step in _after(request):
        backend.store_result(step.id, marker, states.SUCCESS, request=step)
        stopped += 1
    return stopped


def ignores_result(task: Any, request: Any) -> bool:
    """Whether the run of ``request`` stores no result, as Celery's tracer decides it: the
    message's ``ignore_result`` when it carries one (``apply_async(ignore_result=...)``), else
    the task's (``@app.task(ignore_result=True)``, ``task_ignore_result``): a message sent by
    name (``send_task``, beat) carries none."""
    if isinstance(request, Context):
        explicit = request.__dict__.get("ignore_result")
    else:
        explicit = getattr(request, "ignore_result", None)
    return bool(task.ignore_result if explicit is None else explicit)


def _after(request: Any) -> Iterator[Context]:
    """The tasks (with an id) that run only after ``request``'s task: the rest of its chain,
    its chord's body, and theirs in turn."""
    pending: list[Any] = list(getattr(request, "chain", None) or ())
    chord = getattr(request, "chord", None)
    if chord:
        pending.append(chord)
    seen: set[str] = set()
    while pending:
        signature = pending.pop()
        if not isinstance(signature, Mapping):
            continue
        options = signature.get("options") or {}
        kwargs = signature.get("kwargs") or {}
        kind = signature.get("subtask_type")
        if kind in ("chain", "group"):  # its own steps (a group's members all wait on us)
            pending.extend(kwargs.get("tasks") or ())
        elif kind == "chord":  # its header is never sent either; its body is waited on
            if kwargs.get("body") is not None:
                pending.append(kwargs["body"])
        else:
            task_id = options.get("task_id")
            if task_id and task_id not in seen:
                seen.add(task_id)
                yield _context(signature, options, task_id)
        if options.get("chord"):  # the last step of a chain inside a chord's header
            pending.append(options["chord"])


def _context(signature: Mapping[str, Any], options: Mapping[str, Any], task_id: str) -> Context:
    """A request for a task that never ran, enough for a result backend (as Celery builds it)."""
    context = Context(signature)
    context.update(options)
    context.id = task_id
    context.group = options.get("group_id")
    return context
