"""The joiners of a lock: what ``singleton_on_duplicate="join"`` keeps beside it.

A duplicate that meets a held lock under the join policy does not run: it writes a record of
itself into the lock's *joiners* ``{prefix}{tag}:joiners`` (a hash, the same hash tag as the
lock, so the same cluster slot), field its task id, value ``<holder>|<serial>|<record>``, and
ends; the record is opaque here (the Celery side writes what completing the duplicate needs).
When a run of the key ends, it takes every joiner that did not join the key's holder now
(itself, or an earlier holder that died without taking them) and completes them with its
outcome. Four scripts, each one round trip:

- ``join.lua`` (:func:`join`) writes a record, only while the holder the duplicate met holds
  the lock (owner-checked), so a record is never left after the end that would take it. Each
  join gives the record a new *serial*, that of the joiner's one live watch copy: a watch copy
  that joins again names its serial, and one that is not the live one (the broker handed a
  copy out again: Redis's ``visibility_timeout`` restores a countdown message the worker holds)
  is told it is :data:`STALE` and writes nothing, so the copies never multiply.
- ``take_joiners.lua`` (:func:`take_joiners`) takes and deletes them: whoever gets a record
  completes it, nobody else can get it (exactly once).
- ``unjoin.lua`` (:func:`unjoin`) withdraws one whose duplicate is requeued instead, or whose
  live watch copy runs the call itself (a stale copy withdraws nothing).
- ``record_done.lua`` (:func:`record_done`) records the completed ones as completed runs
  (core/completion.py), so a copy of their messages is dropped, not run.

The joiners outlive the lock's expiry by the keep a joiner gives; each joiner's own watch
copy (a copy of its message, due when the lock would expire) joins again while the holder
still runs, which renews them. Knows nothing of Celery.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ._wire import Script, as_text, script
from .completion import done_key
from .keys import beside

__all__ = [
    "JOINERS_NAME",
    "STALE",
    "Joiner",
    "join",
    "joiners_key",
    "record_done",
    "take_joiners",
    "unjoin",
]

#: what :func:`joiners_key` puts in place of a lock key's ``lock``
JOINERS_NAME = "joiners"

#: what :func:`join` and :func:`unjoin` return to a watch copy that is not its joiner's live one
STALE = -1

#: ``run_script`` of a store (``LockBackend.run_script``)
Run = Callable[[Script, Sequence[Any]], Any]


@dataclass(frozen=True)
class Joiner:
    """A joined duplicate taken for completion: its task id, the holder it met, its record."""

    task_id: str
    holder: str
    record: bytes


def joiners_key(lock_key: str) -> str:
    """``{prefix}{tag}:joiners`` beside ``{prefix}{tag}:lock``."""
    return beside(lock_key, JOINERS_NAME)


def join(  # noqa: PLR0917 - the lock, who is met, who joins, for how long, and which copy
    run: Run,
    lock_key: str,
    holder: str,
    joiner: str,
    record: bytes,
    keep_ms: int,
    serial: int | None = None,
) -> int:
    """Keep ``joiner``'s ``record`` beside ``lock_key`` if ``holder`` holds it: the serial of
    the joiner's next watch copy, its live one (>= 1). ``serial``: that of the watch copy
    joining again (None: the call's own message, which supersedes any copy). 0: nothing
    written, ``holder`` does not hold the lock; :data:`STALE`: ``serial`` is not the live
    copy's (the record names a newer one), nothing written, whoever holds the lock."""
    if not holder or not joiner or "|" in holder:
        raise ValueError(f"holder and joiner must be task ids, got {holder!r}, {joiner!r}")
    args = [
        2,
        lock_key,
        joiners_key(lock_key),
        holder,
        joiner,
        record,
        max(0, int(keep_ms)),
        "" if serial is None else int(serial),
    ]
    return int(run(script("join.lua"), args))


def take_joiners(run: Run, lock_key: str, ended: str) -> list[Joiner]:
    """The joiners that the end of ``ended`` (a task id) completes, taken (deleted)."""
    reply = run(script("take_joiners.lua"), [2, lock_key, joiners_key(lock_key), ended])
    return [
        Joiner(as_text(reply[i]), as_text(reply[i + 1]), _raw(reply[i + 2]))
        for i in range(0, len(reply or ()), 3)
    ]


def unjoin(run: Run, lock_key: str, joiner: str, serial: int | None = None) -> int:
    """Withdraw ``joiner``: 1 withdrawn; 0 a run's end took it already (or it never joined);
    :data:`STALE` the record names a live watch copy other than the one of ``serial`` (None:
    whichever is live), nothing withdrawn."""
    args = [1, joiners_key(lock_key), joiner, "" if serial is None else int(serial)]
    return int(run(script("unjoin.lua"), args))


def record_done(run: Run, lock_key: str, done: Sequence[tuple[str, int]], keep_ms: int) -> None:
    """Record each ``(task id, generation)`` of ``done`` as a completed run of ``lock_key``."""
    if not done:
        return
    keys = [done_key(lock_key, task_id) for task_id, _ in done]
    run(
        script("record_done.lua"),
        [len(keys), *keys, max(1, int(keep_ms)), *(generation for _, generation in done)],
    )


def _raw(value: bytes | str) -> bytes:
    return value if isinstance(value, bytes) else value.encode()
