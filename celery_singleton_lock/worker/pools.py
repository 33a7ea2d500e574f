"""The worker pools the library runs under, and the one pool set-up it refuses at start-up.

- ``solo``, ``threads``, ``prefork``: as they are. Under prefork with Celery 5.7's
  ``worker_pool_start_method="spawn"`` each child is a fresh interpreter: it imports the tasks
  again, Celery builds their tracers again (``SingletonTask.__trace__`` wraps them there too),
  and its renewer starts at its first lock; the main process releases for a lost child from
  the message, as under fork.
- ``gevent``, ``eventlet``: tasks are green threads of the worker's process. The library's
  per-run state is a ``threading.local`` and its renewer a ``threading.Thread``; both are
  green only when ``threading`` (and ``socket``) were monkey-patched *before* the library was
  imported. ``celery worker -P gevent`` (``-P eventlet``) patches first thing. A pool named only
  by the ``worker_pool`` setting is not patched by Celery (it reads ``-P`` from the command
  line only), and a program that imports its tasks before it patches leaves the library's
  state shared by every green thread: a run could release the lock another one just took, or
  block every green thread on a real lock. :func:`check_pool` refuses both at start-up
  (worker/hooks.py), with a ``SingletonConfigError`` naming ``worker_pool``.

See docs/deployments.md, "Worker pools".
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Mapping
from typing import Any

from celery.concurrency import ALIASES

from ..errors import SingletonConfigError
from ..task.tracer import follows_threading_local

__all__ = [
    "GREEN_POOLS",
    "TERMINATING_POOLS",
    "check_cancel_grace",
    "check_pool",
    "pool_module",
    "worker_pool_of",
]

#: The green pools, by the module of their TaskPool: the name ``-P`` takes.
GREEN_POOLS = {"celery.concurrency.gevent": "gevent", "celery.concurrency.eventlet": "eventlet"}


def worker_pool_of(conf: Any, options: Mapping[str, Any]) -> Any:
    """The pool a starting worker will run, as ``celeryd_init`` sees it: the worker's ``pool``
    or ``pool_cls`` argument (``-P`` gives a class), else the ``worker_pool`` setting, in the
    order Celery's ``WorkController.setup_defaults`` takes them."""
    for given in (options.get("pool"), options.get("pool_cls")):
        if given is not None:
            return given
    return conf.get("worker_pool")


def pool_module(pool: Any) -> str:
    """The module of ``pool``'s TaskPool: a class, an alias (``"gevent"``) or a dotted path."""
    if pool is None:
        return "celery.concurrency.prefork"
    if isinstance(pool, str):
        target = ALIASES.get(pool) or pool
        return target.split(":", 1)[0] if ":" in target else target.rpartition(".")[0]
    return str(getattr(pool, "__module__", ""))


def check_pool(pool: Any) -> None:
    """Raise :class:`SingletonConfigError` when ``pool`` is gevent or eventlet and this process
    is not monkey-patched as the library needs (see the module doc)."""
    name = GREEN_POOLS.get(pool_module(pool))
    if name is None:
        return
    if _patched(name) and follows_threading_local():
        return
    raise SingletonConfigError(
        f"worker_pool {name!r} needs threading and socket monkey-patched by {name} before "
        "celery_singleton_lock is imported, and they are not (a pool set by worker_pool alone "
        f"is not patched by Celery): start the worker with `celery worker -P {name}`, or "
        f"monkey-patch first thing in the program that starts it"
    )


#: The pools whose runs Celery's ``revoke(terminate=True)`` can end, by their TaskPool's module.
TERMINATING_POOLS = frozenset(
    {"celery.concurrency.prefork", "celery.concurrency.gevent", "celery.concurrency.eventlet"}
)


def check_cancel_grace(tasks: Iterable[Any], pool: Any) -> None:
    """Raise :class:`SingletonConfigError` when a task has ``singleton_cancel_grace`` (a holder
    that does not stop is terminated) and ``pool`` cannot terminate a run (solo, threads)."""
    if pool_module(pool) in TERMINATING_POOLS:
        return
    for task in tasks:
        if task.singleton_options().cancel_grace is not None:
            raise SingletonConfigError(
                f"singleton_cancel_grace (task {task.name}) needs a pool that can terminate a "
                f"run (prefork, gevent or eventlet), got {pool_module(pool).rpartition('.')[2]}"
                ": drop the setting (the holder is still asked to stop) or change the pool"
            )


def _patched(name: str) -> bool:
    """Whether ``threading`` and ``socket`` are patched by ``name`` (gevent or eventlet)."""
    if name == "gevent":
        monkey: Any = importlib.import_module("gevent.monkey")
        return bool(monkey.is_module_patched("threading") and monkey.is_module_patched("socket"))
    patcher: Any = importlib.import_module("eventlet.patcher")
    return bool(patcher.is_monkey_patched("thread") and patcher.is_monkey_patched("socket"))
