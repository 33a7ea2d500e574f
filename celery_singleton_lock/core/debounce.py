"""The debounce state of a key: what ``singleton_debounce`` keeps beside its lock.

Calls of a key made within S seconds of each other form a *burst*; only the burst's latest
call runs, S seconds after it arrived (at the latest M seconds after the burst's first call,
``singleton_debounce_max``), and every earlier call of the burst is *superseded*. The state is
one hash ``{prefix}{tag}:debounce`` beside the lock (the same hash tag, so the same cluster
slot): the burst's latest call, when its first call came, when the latest is due, a field per
call still waiting. One script, ``debounce.lua`` (:func:`debounce`), one round trip:

- when a call's message arrives (``due=False``): it becomes its burst's latest and is told
  how long to wait (the caller keeps its message waiting that long, as a countdown; a
  redelivery of the same message is told the same);
- when that waiting copy comes due (``due=True``): it runs if it is still the latest (or the
  latest of an earlier burst whose due time passed before a new call came), else it is
  superseded by the latest, named. A copy whose state expired registers again and waits.

A call that already ran or runs (its completion record, a slot it holds) is never superseded:
its copy goes on, and the lock drops or requeues it as it does any copy of a run's message.
The state outlives the burst's due time by :data:`DEBOUNCE_KEEP_MS`. Times are the Redis
server's clock unless the caller passes ``now_ms`` (tests). Knows nothing of Celery.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ._wire import Script, as_text, script
from .completion import done_key
from .keys import LockKeys, beside

__all__ = ["DEBOUNCE_KEEP_MS", "DEBOUNCE_NAME", "Verdict", "debounce", "debounce_key"]

#: How long a key's debounce state outlives its burst's due time: a waiting copy that comes
#: late (its worker died and the broker gave it back after its visibility timeout) still
#: finds whether it was superseded.
DEBOUNCE_KEEP_MS = 24 * 3600 * 1000

#: what :func:`debounce_key` puts in place of a lock key's ``lock``
DEBOUNCE_NAME = "debounce"

#: ``run_script`` of a store (``LockBackend.run_script``)
Run = Callable[[Script, Sequence[Any]], Any]

_ACTIONS = ("wait", "run", "superseded")


@dataclass(frozen=True)
class Verdict:
    """What :func:`debounce` decided for a call: ``"wait"`` ``countdown`` seconds (its burst
    has ``calls`` calls so far), ``"run"``, or ``"superseded"`` by the call ``by``."""

    action: str
    countdown: float = 0.0
    calls: int = 0
    by: str | None = None


def debounce_key(lock_key: str) -> str:
    """``{prefix}{tag}:debounce`` beside ``{prefix}{tag}:lock`` or any of its permit slots."""
    return beside(lock_key, DEBOUNCE_NAME)


def debounce(
    run: Run,
    keys: LockKeys,
    task_id: str,
    generation: int,
    *,
    due: bool,
    window_s: float,
    max_s: float | None = None,
    now_ms: int | None = None,
) -> Verdict:
    """Decide a call of ``keys`` (``due``: its waiting copy came due; else its message
    arrived), debounced by ``window_s`` and capped at ``max_s`` after its burst's first call."""
    if not task_id:
        raise ValueError("a debounced call needs a task id")
    slots = keys.slots
    reply = run(
        script("debounce.lua"),
        [
            2 + len(slots),
            debounce_key(keys.lock),
            done_key(keys.lock, task_id),
            *slots,
            "due" if due else "call",
            task_id,
            max(1, round(window_s * 1000)),
            0 if max_s is None else max(1, round(max_s * 1000)),
            DEBOUNCE_KEEP_MS,
            "" if now_ms is None else int(now_ms),
            int(generation),
        ],
    )
    action = _ACTIONS[int(reply[0])]
    if action == "wait":
        return Verdict(action, max(0, int(reply[1])) / 1000, int(reply[2]))
    if action == "superseded":
        return Verdict(action, by=as_text(reply[2]))
    return Verdict(action)
