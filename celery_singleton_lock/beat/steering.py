"""An operator's hold on the beats of one group, in Redis: what they run, pauses, run-now asks.

The beat instances of a group (the app's main name) and ``celery singleton beat ...`` meet in
the beat's Redis (one server, Sentinel or a cluster; each master of a Redlock deployment):

- **the schedule** (:meth:`Steering.register`, a hash ``...:schedule``): each entry's task and
  schedule as the beats run it (never its arguments), written by the beats when their schedule
  changes, so that an operator names only entries that exist, whichever scheduler holds them;
- **the beats** (:meth:`Steering.heartbeat`, a sorted set ``...:beats``): each instance and
  when it last looked for asks;
- **pauses** (a key per entry, ``...:paused``, "<by> <at ms>"): claim.lua passes over a paused
  entry's runs, so every beat skips them until the pause is gone;
- **asks** (a hash ``...:asks``, entry name -> "<ask id> <by> <at ms> <until ms>"): an
  operator's request to publish one run of an entry now. The beats look for asks once a second;
  each claims the run ``ask-<ask id>`` like any scheduled run, so one beat publishes it, once.
  An ask not taken by its ``until`` is dead: no beat claims it.

Knows nothing of Celery. Each method is one round trip to each server.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, TypeVar

from ..core._wire import as_text, evalsha, script
from ..core.backend import REDIS_ERRORS, Client
from ..core.keys import beat_entry_key, beat_group_key, run_claim_key
from ..errors import LockUnavailableError
from .claims import EntryRecord, RunClaims, merge_records
from .redlock_claims import claims_and_store

__all__ = ["ASK_KEEP_MS", "Ask", "Steering", "steering_clients"]

T = TypeVar("T")

ASK = script("ask.lua")
FORGET_ASK = script("forget_ask.lua")

#: How long the group's keys (schedule, beats, asks) are kept after their last write.
GROUP_KEEP_MS: Final = 35 * 86400 * 1000
#: How long a beat that stopped looking for asks still shows among the group's beats.
BEAT_SEEN_MS: Final = 3600 * 1000
#: How long the claim of an asked run is kept once published.
ASK_KEEP_MS: Final = 3600 * 1000


@dataclass(frozen=True)
class Ask:
    """An operator's request to publish one run of ``entry`` now (before ``until_ms``)."""

    entry: str
    ask_id: str
    by: str
    at_ms: int
    until_ms: int

    @property
    def run(self) -> str:
        """The run id the asked run is claimed under."""
        return f"ask-{self.ask_id}"

    @property
    def value(self) -> str:
        return f"{self.ask_id} {self.by} {self.at_ms} {self.until_ms}"

    @classmethod
    def parse(cls, entry: str, value: bytes | str) -> Ask | None:
        """The ask stored as ``value`` for ``entry``; None for a value of another shape."""
        parts = as_text(value).split(" ")
        if len(parts) != 4 or not parts[2].isdigit() or not parts[3].isdigit():
            return None
        return cls(entry, parts[0], parts[1], int(parts[2]), int(parts[3]))


def steering_clients(url: str) -> list[Client]:
    """The clients of the beat's Redis at ``url``, made as a beat makes its claims' (one, or
    each master of a Redlock URL)."""
    claims, _store = claims_and_store(url, "operator")  # the store shares these clients
    return claims.clients


class Steering:
    """The group's schedule, beats, pauses and asks on ``clients`` (each master: writes go to
    all, reads merge what those that answer hold)."""

    def __init__(self, clients: Sequence[Client], prefix: str, group: str) -> None:
        if not clients:
            raise ValueError("need at least one client")
        self.clients = list(clients)
        self.prefix = prefix
        self.group = group
        self.schedule_key = beat_group_key(prefix, group, "schedule")
        self.beats_key = beat_group_key(prefix, group, "beats")
        self.asks_key = beat_group_key(prefix, group, "asks")

    # -- the beats' side ---------------------------------------------------------------------

    def register(self, entries: Mapping[str, str]) -> None:
        """The group's schedule is ``entries`` (name -> description), replacing what was."""

        def call(client: Client) -> None:
            pipe = client.pipeline(transaction=True)
            pipe.delete(self.schedule_key)
            if entries:
                pipe.hset(self.schedule_key, mapping=dict(entries))  # type: ignore[arg-type]
                pipe.pexpire(self.schedule_key, GROUP_KEEP_MS)
            pipe.execute()

        self._each("register the schedule", call, every=True)

    def heartbeat(self, beat: str, now_ms: int) -> list[Ask]:
        """Beat instance ``beat`` looks for asks at ``now_ms``: noted among the group's beats;
        returns the asks there are (dead ones included)."""

        def call(client: Client) -> list[Ask]:
            pipe = client.pipeline(transaction=False)
            pipe.zadd(self.beats_key, {beat: now_ms})
            pipe.zremrangebyscore(self.beats_key, "-inf", now_ms - BEAT_SEEN_MS)
            pipe.pexpire(self.beats_key, GROUP_KEEP_MS)
            pipe.hgetall(self.asks_key)
            return _asks(pipe.execute()[-1])

        found: dict[str, Ask] = {}
        for asks in self._each("look for asks", call):
            for ask in asks:
                found.setdefault(ask.value, ask)
        return list(found.values())

    def gone(self, beat: str) -> None:
        """Beat instance ``beat`` stopped: no longer among the group's beats."""
        self._each("forget the beat", lambda client: client.zrem(self.beats_key, beat))

    # -- the operator's side -----------------------------------------------------------------

    def registered(self) -> dict[str, str]:
        """The group's schedule as the beats registered it (name -> description)."""
        found: dict[str, str] = {}
        for entries in self._each("read the schedule", lambda c: c.hgetall(self.schedule_key)):
            for name, described in entries.items():
                found.setdefault(as_text(name), as_text(described))
        return found

    def beats(self) -> dict[str, int]:
        """The group's beats seen in the last hour: instance -> when it last looked (epoch ms)."""
        found: dict[str, int] = {}

        def call(client: Client) -> Any:
            return client.zrange(self.beats_key, 0, -1, withscores=True)

        for members in self._each("read the beats", call):
            for member, score in members:
                name = as_text(member)
                found[name] = max(found.get(name, 0), int(score))
        return found

    def records(self, entries: Sequence[str]) -> list[EntryRecord | None]:
        """Each entry's record: its last published nominal run, by whom and when."""
        keys = [beat_entry_key(self.prefix, name, "record") for name in entries]
        per_client = self._each(
            "read the records", lambda client: RunClaims(client, "operator").records(keys)
        )
        return [merge_records(list(seen)) for seen in zip(*per_client, strict=True)]

    def pauses(self, entries: Sequence[str]) -> list[str | None]:
        """Each entry's pause ("<by> <at ms>"), or None."""
        keys = [beat_entry_key(self.prefix, name, "paused") for name in entries]

        def call(client: Client) -> list[Any]:
            pipe = client.pipeline(transaction=False)  # one slot each: a cluster's too
            for key in keys:
                pipe.get(key)
            return list(pipe.execute()) if keys else []

        per_client = self._each("read the pauses", call)
        return [
            next((as_text(v) for v in seen if v is not None), None)
            for seen in zip(*per_client, strict=True)
        ]

    def pause(self, entry: str, by: str, now_ms: int) -> str:
        """Pause ``entry`` (kept until :meth:`resume`); returns its pause: this one, or the one
        that was there."""
        key = beat_entry_key(self.prefix, entry, "paused")
        value = f"{by} {now_ms}"

        def call(client: Client) -> str:
            pipe = client.pipeline(transaction=False)
            pipe.set(key, value, nx=True)
            pipe.get(key)
            return as_text(pipe.execute()[1])

        return self._each("pause the entry", call, every=True)[0]

    def resume(self, entry: str) -> bool:
        """Resume ``entry``; False if it was not paused."""
        key = beat_entry_key(self.prefix, entry, "paused")
        return any(self._each("resume the entry", lambda c: c.delete(key), every=True))

    def ask(self, entry: str, by: str, now_ms: int, timeout_ms: int) -> Ask:
        """Ask the beats to publish one run of ``entry`` now, taken within ``timeout_ms``; the
        entry's live ask if there is one already (it is the run that goes out)."""
        new = Ask(entry, uuid.uuid4().hex[:12], by, now_ms, now_ms + timeout_ms)

        def call(client: Client) -> Ask | None:
            args = [1, self.asks_key, entry, new.value, now_ms, GROUP_KEEP_MS]
            return Ask.parse(entry, evalsha(client, ASK, args))

        return next((a for a in self._each("ask", call, every=True) if a is not None), new)

    def asks(self) -> list[Ask]:
        """The asks there are (dead ones included)."""
        found: dict[str, Ask] = {}
        for asks in self._each("read the asks", lambda c: _asks(c.hgetall(self.asks_key))):
            for ask in asks:
                found.setdefault(ask.value, ask)
        return list(found.values())

    def forget(self, ask: Ask) -> bool:
        """Forget ``ask`` (taken, dead or withdrawn) unless another took its place."""

        def call(client: Client) -> bool:
            return bool(evalsha(client, FORGET_ASK, [1, self.asks_key, ask.entry, ask.value]))

        return any(self._each("forget the ask", call))

    def claim_of(self, ask: Ask) -> str | None:
        """The claim of the asked run: "pending <beat>", "done <beat> <task id>" or None."""
        key = run_claim_key(self.prefix, ask.entry, ask.run)
        seen = [as_text(v) for v in self._each("read the claim", lambda c: c.get(key)) if v]
        return next((v for v in seen if v.startswith("done ")), seen[0] if seen else None)

    # -- one call on each server -------------------------------------------------------------

    def _each(self, what: str, call: Callable[[Client], T], *, every: bool = False) -> list[T]:
        """``call`` on each client: the replies of those that answered. Raises
        :class:`LockUnavailableError` if none did, or (``every``: a write that must reach
        them all) if any did not; what the others did stays done."""
        replies: list[T] = []
        errors: list[str] = []
        for client in self.clients:
            try:
                replies.append(call(client))
            except REDIS_ERRORS as exc:
                errors.append(str(exc))
        if errors and (every or not replies):
            raise LockUnavailableError(
                f"could not {what}: {'; '.join(errors)}", key=self.schedule_key
            )
        return replies


def _asks(fields: Mapping[Any, Any]) -> list[Ask]:
    parsed = (Ask.parse(as_text(name), value) for name, value in fields.items())
    return [ask for ask in parsed if ask is not None]
