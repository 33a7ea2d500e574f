"""A key's queue: the calls that wait, in order, for the runs holding their key
(``singleton_on_duplicate="queue"``).

A call that meets its key held does not run and takes no worker slot: it writes a record of
itself into the key's queue and ends. Two keys beside the lock (the same hash tag, so the same
cluster slot; one queue per key, whatever its ``singleton_permits``):

- ``{prefix}{tag}:queue``: a sorted set, member a waiting call's task id, score its place;
- ``{prefix}{tag}:queue_calls``: a hash, task id -> ``<retries>|<record>``, the record opaque
  here (the Celery side writes what publishing the call again needs), and field ``#`` the last
  place given, and fields ``task`` (the latest call's task name) and ``slots`` (how many
  slots the key has: a CLI purge finds a queue whose lock is gone by them).

Four scripts, each one round trip, each given the lock's key or a permit slot's:

- ``enqueue.lua`` (:func:`enqueue`) queues a call, only while every slot is held, so it is never
  queued after the release that would hand it the key; at most ``max_length`` calls, and a copy
  of a call already waiting is not queued twice.
- ``queue_release.lua`` (:func:`release_to_next`) releases a run's lock as ``release.lua`` does
  and, in the same call, rewrites it in the name of the call at the head of the queue: the
  key goes from run to run in the order the calls reached it, and no newer call can take it in
  between. The head's own message, published by the releaser, re-enters the lock with a fresh
  fencing token (its generation is one more than the one written).
- ``queue_pass.lua`` (:func:`pass_to_next`) does the same when no run's end does: a lock that
  is free (its run lost) or that waits for a queued call that will not run (revoked, expired).
- ``queue_put_back.lua`` (:func:`put_back`) returns a handed-over call whose publish failed.
- ``supersede.lua`` (:func:`supersede`): latest wins (``"cancel"``): a newer call takes the
  place of every waiting call, and asks the run holding the key to stop (the lock's field
  ``cancel``, which ``renew.lua`` reports to the holder).

The queue outlives the lock by the keep its caller gives, so calls waiting behind a run whose
node died stay for whoever takes the key next, or a CLI purge. Knows nothing of Celery.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ._wire import Script, as_text, script
from .keys import LockKeys, beside

__all__ = [
    "HANDED_FIELD",
    "QUEUE_CALLS_NAME",
    "QUEUE_NAME",
    "Handed",
    "Queued",
    "enqueue",
    "pass_to_next",
    "put_back",
    "queue_keys",
    "release_to_next",
    "supersede",
    "waiting",
]

#: what :func:`queue_keys` puts in place of a lock key's ``lock``
QUEUE_NAME = "queue"
QUEUE_CALLS_NAME = "queue_calls"
#: the field of a lock handed to a queued call, waiting for that call's message
HANDED_FIELD = "queued"

#: ``run_script`` of a store (``LockBackend.run_script``)
Run = Callable[[Script, Sequence[Any]], Any]


@dataclass(frozen=True)
class Queued:
    """What :func:`enqueue` did: ``status`` 1 queued, 2 already queued (``place`` in line, 1
    next); 0 not queued, a slot is free (``pttl_ms`` -2) or an at-least window (``finished``);
    -1 not queued, the queue is full (``place``: its length)."""

    status: int
    place: int = 0
    pttl_ms: int = -2
    finished: bool = False


@dataclass(frozen=True)
class Handed:
    """A call the key was handed to: publish it (its task id, retries count, record)."""

    task_id: str
    retries: int
    record: bytes


def queue_keys(lock_key: str) -> tuple[str, str]:
    """The queue and its calls beside ``lock_key`` (the lock, or any of its permit slots)."""
    return beside(lock_key, QUEUE_NAME), beside(lock_key, QUEUE_CALLS_NAME)


def enqueue(  # noqa: PLR0917 - the key, the call, and the queue's bounds
    run: Run,
    keys: LockKeys,
    task_id: str,
    retries: int,
    record: bytes,
    max_length: int,
    keep_ms: int,
    task_name: str = "",
) -> Queued:
    """Queue the call ``task_id`` (of ``task_name``) behind the runs holding ``keys`` (every
    slot held)."""
    queue, calls = queue_keys(keys.lock)
    slots = keys.slots
    args = [2 + len(slots), queue, calls, *slots, task_id, int(retries), record]
    args += [int(max_length), max(0, int(keep_ms)), task_name]
    reply = run(script("enqueue.lua"), args)
    status = int(reply[0])
    if status == 0:
        return Queued(0, pttl_ms=int(reply[1]), finished=int(reply[2]) == 1)
    return Queued(status, int(reply[1]))


def supersede(  # noqa: PLR0917 - the key, the newer call, and what it does
    run: Run,
    lock_key: str,
    task_id: str,
    retries: int,
    record: bytes,
    keep_ms: int,
    task_name: str,
    *,
    wait: bool,
) -> tuple[int, list[Handed]]:
    """Latest wins (``supersede.lua``): the newer call ``task_id`` takes the place of every call
    waiting for ``lock_key`` and, with ``wait``, waits itself and asks the holder to stop.
    ``(1, superseded)``; ``(0, [])`` with ``wait`` when the key is free (nothing written)."""
    queue, calls = queue_keys(lock_key)
    args = [3, queue, calls, lock_key, task_id, int(retries), record, max(0, int(keep_ms))]
    reply = run(script("supersede.lua"), [*args, task_name, "wait" if wait else "run"])
    if int(reply[0]) != 1:
        return 0, []
    superseded = []
    for i in range(1, len(reply), 2):
        value = reply[i + 1] if isinstance(reply[i + 1], bytes) else str(reply[i + 1]).encode()
        retries_text, _, body = value.partition(b"|")
        superseded.append(Handed(as_text(reply[i]), int(retries_text), body))
    return 1, superseded


def release_to_next(  # noqa: PLR0917 - release.lua's arguments, and the hand-over's
    run: Run,
    lock_key: str,
    done_key: str,
    owner: str,
    generation: int,
    token: int | None,
    completion_ms: int,
    wait_ms: int,
    keep_ms: int,
) -> tuple[int, Handed | None]:
    """Release the run ``owner`` (``generation``, ``token``) and hand its lock (or slot) to the
    queue's head: ``(1, None)`` released, none waits; ``(3, head)`` handed to ``head``;
    ``(0, None)`` not held; ``(-1, None)`` held by another run."""
    queue, calls = queue_keys(lock_key)
    args: list[Any] = [4, lock_key, done_key, queue, calls, owner, int(generation)]
    args += ["" if token is None else int(token), max(0, int(completion_ms))]
    reply = run(script("queue_release.lua"), [*args, max(1, int(wait_ms)), max(0, int(keep_ms))])
    return int(reply[0]), _handed(reply)


def pass_to_next(
    run: Run, lock_key: str, passed: str | None, wait_ms: int, keep_ms: int
) -> tuple[int, Handed | None]:
    """Hand the lock (or slot) ``lock_key`` to the queue's head: when it is free (``passed``
    None), or when it waits in the name of the queued call ``passed``, which will not run.
    ``(3, head)`` handed; ``(1, None)`` freed (none waits); ``(0, None)`` nothing done."""
    queue, calls = queue_keys(lock_key)
    args = [3, lock_key, queue, calls, passed or "", max(1, int(wait_ms)), max(0, int(keep_ms))]
    reply = run(script("queue_pass.lua"), args)
    return int(reply[0]), _handed(reply)


def put_back(run: Run, lock_key: str, handed: Handed, keep_ms: int) -> bool:
    """Return ``handed`` to the head of the queue, its publish having failed; False when the
    lock no longer waits in its name."""
    queue, calls = queue_keys(lock_key)
    args = [3, lock_key, queue, calls, handed.task_id, handed.retries, handed.record]
    return int(run(script("queue_put_back.lua"), [*args, max(1, int(keep_ms))])) == 1


def waiting(client: Any, lock_key: str) -> tuple[int, str | None]:
    """How many calls wait in the queue of ``lock_key``, and the head's task id."""
    queue, _ = queue_keys(lock_key)
    pipe = client.pipeline(transaction=False)
    pipe.zcard(queue)
    pipe.zrange(queue, 0, 0)
    length, head = pipe.execute()
    return int(length), (as_text(head[0]) if head else None)


def _handed(reply: Any) -> Handed | None:
    if int(reply[0]) != 3:
        return None
    record = reply[3]
    return Handed(
        as_text(reply[1]),
        int(reply[2]),
        record if isinstance(record, bytes) else str(record).encode(),
    )
