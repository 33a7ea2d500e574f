"""The joiners of a lock: what ``singleton_on_duplicate="join"`` keeps beside it.

A duplicate that meets a held lock under the join policy does not run: it writes a record of
itself into the lock's *joiners* ``{prefix}{tag}:joiners`` (a hash, the same hash tag as the
lock, so the same cluster slot), field its task id, value ``<holder>|<record>``, and ends; the
record is opaque here (the Celery side writes what completing the duplicate needs). When a
run of the key ends, it takes every joiner that did not join the key's holder now (itself,
or an earlier holder that died without taking them) and completes them with its outcome.
Four scripts, each one round trip:

- ``join.lua`` (:func:`join`) writes a record, only while the holder the duplicate met holds
  the lock (owner-checked), so a record is never left after the end that would take it.
- ``take_joiners.lua`` (:func:`take_joiners`) takes and deletes them: whoever gets a record
  completes it, nobody else can get it (exactly once).
- ``unjoin.lua`` (:func:`unjoin`) withdraws one whose duplicate is requeued instead.
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

__all__ = ["JOINERS_NAME", "Joiner", "join", "joiners_key", "record_done", "take_joiners", "unjoin"]

#: what :func:`joiners_key` puts in place of a lock key's ``lock``
JOINERS_NAME = "joiners"

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


def join(  # noqa: PLR0917 - the lock, who is met, who joins, and for how long
    run: Run, lock_key: str, holder: str, joiner: str, record: bytes, keep_ms: int
) -> bool:
    """Keep ``joiner``'s ``record`` beside ``lock_key`` if ``holder`` holds it (True)."""
    if not holder or not joiner or "|" in holder:
        raise ValueError(f"holder and joiner must be task ids, got {holder!r}, {joiner!r}")
    args = [2, lock_key, joiners_key(lock_key), holder, joiner, record, max(0, int(keep_ms))]
    return int(run(script("join.lua"), args)) == 1


def take_joiners(run: Run, lock_key: str, ended: str) -> list[Joiner]:
    """The joiners that the end of ``ended`` (a task id) completes, taken (deleted)."""
    reply = run(script("take_joiners.lua"), [2, lock_key, joiners_key(lock_key), ended])
    return [
        Joiner(as_text(reply[i]), as_text(reply[i + 1]), _raw(reply[i + 2]))
        for i in range(0, len(reply or ()), 3)
    ]


def unjoin(run: Run, lock_key: str, joiner: str) -> bool:
    """Withdraw ``joiner`` (True), unless a run's end took it already."""
    return int(run(script("unjoin.lua"), [1, joiners_key(lock_key), joiner])) == 1


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
