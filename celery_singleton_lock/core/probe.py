"""The read-only probe of a lock: what an acquire would answer an owner, without taking anything.

``probe.lua`` reads the owner's completion record and the lock's slots in one round trip and
answers as ``acquire.lua`` and ``acquire_permit.lua`` would, up to the point where they write:
a :class:`~.backend.Contended` (every slot held; by whom, for how long, whether in an at-least
window), a :class:`~.backend.Completed` (this message already ran to its end), or None (a run
would take a slot, or re-enter its own). The worker's main process asks it before it turns a
duplicate away without handing it to its pool (the Celery glue: worker/mainskip.py).

The probe goes through a connection of its own (:func:`~.connection.prober_for`), whose
calls fail fast: a caller that cannot wait answers a failure by doing what it would have done
without asking. Knows nothing of Celery.
"""

from __future__ import annotations

from typing import Any

from ..errors import LockUnavailableError
from ._wire import script
from .backend import REDIS_ERRORS, Contended, acquire_outcome
from .completion import done_key
from .keys import LockKeys
from .sendahead import SendAhead

__all__ = ["PROBE", "probe", "probe_args", "probe_outcome"]

PROBE = script("probe.lua")


def probe_args(keys: LockKeys, owner: str, generation: int) -> list[Any]:
    """numkeys, KEYS and ARGV of probe.lua."""
    slots = keys.slots
    return [1 + len(slots), done_key(keys.lock, owner), *slots, owner, generation]


def probe_outcome(reply: Any, owner: str) -> Contended | None:
    """probe.lua's reply: held (a :class:`Completed` for this owner's own finished message),
    or None when a run would take the lock. Held, it is an acquire's reply, read as one."""
    if reply[0] == 1:
        return None
    outcome = acquire_outcome(reply, None, owner)
    assert isinstance(outcome, Contended)
    return outcome


def probe(prober: SendAhead, keys: LockKeys, owner: str, generation: int) -> Contended | None:
    """What an acquire of ``keys`` by ``owner`` (``generation``) would find, read in one round
    trip on ``prober``'s connection; raises :class:`LockUnavailableError` when Redis could not
    be asked."""
    try:
        reply = prober.call_one(PROBE, probe_args(keys, owner, generation))
    except REDIS_ERRORS as exc:  # not written: the connection was down
        reply = exc
    if isinstance(reply, Exception):
        raise LockUnavailableError(
            f"could not probe {keys.lock}: {reply}", key=keys.lock, task_id=owner
        ) from reply
    return probe_outcome(reply, owner)
