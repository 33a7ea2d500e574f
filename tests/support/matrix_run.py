"""Running the composition matrix's cells (tests/support/matrix.py) on real workers, all the
cells of a test at once, and checking what each left behind.

Each cell is a scenario on a key of its own: a holder run (its body records its start and
holds until the test pushes to its go list), one or two duplicates sent meanwhile with a
``link`` that records their task id, the event applied to the call that waits, the holder
released. A scenario is a generator that yields :class:`Wait` conditions; :func:`run_cells`
polls every cell's current condition in one loop (one thread: Celery's result backend is
per thread), reading what the workers wrote (the history, the signal log, the link log, the
holders' log of the requests to stop they saw, the results) once per round. Then, with every
call ready, it waits until the broker holds no message of the prefix (queued, or reserved
unacknowledged: an eta, a watch copy, a link still running) and no cell's lock, slot,
pending, joiners, queued marker or key's queue is left, and checks each cell:

1. one run at a time per key (two with ``singleton_permits=2``), a rate's and a window's
   starts apart as they say, the runs its cell orders started in that order;
2. each call ended once: its state when first ready is its state at the end; its link was
   called once if it ended ``SUCCESS`` with a real value, else never; it ran at most once; it
   ended as its cell expects of its role;
3. nothing is left beside the lock but the documented records, each with a ttl.
"""

from __future__ import annotations

import itertools
import json
import re
import time
import traceback
import uuid
from collections import Counter
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass
from typing import Any

import pytest
import redis
from celery import Celery, states

from celery_singleton_lock import DuplicateTaskError, skip_info
from celery_singleton_lock.core.keys import queued_key
from celery_singleton_lock.core.queue import queue_keys
from tests.support.basic_app import close_app, history_key
from tests.support.chaos import Kill, close_killed, sigkill_pid
from tests.support.history import Execution, check_history, max_at_once, parse_history
from tests.support.matrix import (
    CANCELLED,
    COALESCED,
    DEBOUNCE_EXPIRES_S,
    DUPLICATE_ERROR,
    EXPIRES_S,
    JOINED,
    JOINED_FAILURE,
    LOST,
    NOT_PUBLISHED,
    OVERTAKEN,
    QUEUED_COUNTDOWN_S,
    QUEUED_EXPIRES_S,
    RAISED_AT_PUBLISH,
    RAN,
    RATE_ERROR,
    RATE_PERIOD_S,
    REDELIVERED_COUNTDOWN_S,
    REFUSED,
    REVOKED,
    SKIPPED,
    SUPERSEDED,
    WINDOW_S,
    Cell,
)
from tests.support.matrix_app import (
    LINK_TASK,
    MATRIX_APP,
    build,
    cancels_key,
    go_key,
    links_key,
    signals_key,
)
from tests.support.waiting import wait_for
from tests.support.workers import WorkerFactory, WorkerProcess

__test__ = False

#: the signals a duplicate sends when it meets its key's policy (``stop_asked``: it waits,
#: under ``"cancel"``)
MET = (
    "duplicate_skipped",
    "duplicate_retried",
    "duplicate_raised",
    "duplicate_joined",
    "duplicate_queued",
    "stop_asked",
)
#: the signals a delivery of a message sends once a worker took it up
HANDLED = (*MET, "rate_limited", "call_debounced", "redelivery_dropped", "lock_acquired")
#: a worker's log line for each delivery of a message
_RECEIVED = re.compile(r"Task [\w.]+\[([0-9a-f-]+)\] received")
#: how much later than its acquire a run may record its start (a round trip, a busy CPU)
SLACK_S = 0.25
#: the keys beside a lock that must be gone once every call ended; and those that may stay,
#: each with a ttl
GONE = ("lock", "pending", "joiners", "queued", "queue", "queue_calls")
KEPT = ("fence", "done", "rate", "rate_next", "debounce")

Scenario = Generator["Wait", None, None]


@dataclass
class Wait:
    """A condition a scenario waits for."""

    done: Callable[[], Any]
    what: str
    timeout: float = 30.0


@dataclass
class Call:
    """One call of a cell's scenario."""

    role: str
    #: the task id it was sent with
    sent_id: str
    #: the id of the result its caller holds: another call's under publish-time dedup
    id: str
    linked: bool
    #: what apply_async raised (publish-time dedup under "raise")
    raised: BaseException | None = None
    #: its result's meta when it was first seen ready
    first: dict[str, Any] | None = None
    #: its result's meta at the end
    last: dict[str, Any] | None = None

    @property
    def published(self) -> bool:
        return self.raised is None and self.id == self.sent_id


class Bed:
    """A client app and the workers of a module on one prefix; what they recorded, read
    incrementally (each list is append-only)."""

    def __init__(
        self,
        app: Celery,
        client: redis.Redis,
        prefix: str,
        workers: dict[str, WorkerProcess],
    ) -> None:
        self.app, self.client, self.prefix = app, client, prefix
        #: the worker consuming each queue
        self.workers = workers
        self._raw_history: list[bytes] = []
        #: start events by task id
        self.starts: dict[str, list[dict[str, Any]]] = {}
        self.signals: Counter[tuple[str, str]] = Counter()
        self._signal_count = 0
        self.links: Counter[str] = Counter()
        self._link_count = 0
        #: the holders that saw a request to stop while they held (``"cancel"``)
        self.saw_cancel: set[str] = set()
        self._cancel_count = 0
        #: how many times each task id was received by a worker (its log's lines)
        self.received: Counter[str] = Counter()
        self._log_offsets: dict[str, int] = {}

    def refresh(self) -> None:
        pipe = self.client.pipeline(transaction=False)
        pipe.lrange(history_key(self.prefix), len(self._raw_history), -1)
        pipe.lrange(signals_key(self.prefix), self._signal_count, -1)
        pipe.lrange(links_key(self.prefix), self._link_count, -1)
        pipe.lrange(cancels_key(self.prefix), self._cancel_count, -1)
        history, signals, links, cancels = pipe.execute()
        for raw in history:
            self._raw_history.append(raw)
            event = json.loads(raw)
            if event["ev"] == "start":
                self.starts.setdefault(event["worker"].split()[-1], []).append(event)
        self._signal_count += len(signals)
        for raw in signals:
            name, _, task_id = raw.decode().partition(" ")
            self.signals[(name, task_id)] += 1
        self._link_count += len(links)
        self.links.update(raw.decode() for raw in links)
        self._cancel_count += len(cancels)
        self.saw_cancel.update(raw.decode() for raw in cancels)
        for worker in dict.fromkeys(self.workers.values()):
            self._read_log(worker)

    def _read_log(self, worker: WorkerProcess) -> None:
        offset = self._log_offsets.get(worker.name, 0)
        with open(worker.log_path, "rb") as log:
            log.seek(offset)
            data = log.read()
        whole = data[: data.rfind(b"\n") + 1]  # a line still being written: next time
        self._log_offsets[worker.name] = offset + len(whole)
        for match in _RECEIVED.finditer(whole.decode(errors="replace")):
            self.received[match.group(1)] += 1

    def executions(self, key: str) -> list[Execution]:
        return [e for e in parse_history(self._raw_history) if e.key == key]

    def metas(self, ids: Iterable[str]) -> dict[str, dict[str, Any] | None]:
        ids = list(dict.fromkeys(ids))
        if not ids:
            return {}
        backend = self.app.backend
        raws = self.client.mget([backend.get_key_for_task(i) for i in ids])
        return {
            i: None if raw is None else backend.decode_result(raw)
            for i, raw in zip(ids, raws, strict=True)
        }

    def broker_idle(self) -> bool:
        """No message of the prefix waits: queued, or reserved and unacknowledged."""
        pipe = self.client.pipeline(transaction=False)
        pipe.hlen(f"{self.prefix}unacked")
        for queue in self.workers:
            pipe.llen(f"{self.prefix}{queue}")
        return not any(pipe.execute())

    def log_lines(self, ids: Iterable[str]) -> list[str]:
        """The workers' log lines naming any of ``ids``."""
        ids = [i for i in ids if i]
        lines = []
        for worker in dict.fromkeys(self.workers.values()):
            lines += [
                line for line in worker.log_text().splitlines() if any(i in line for i in ids)
            ]
        return lines


class CellRun:
    """One cell's scenario on its own key, and what it found."""

    def __init__(self, bed: Bed, cell: Cell, queue: str) -> None:
        self.bed, self.cell, self.queue = bed, cell, queue
        self.worker = bed.workers[queue]
        self.key = f"{cell.id}-{uuid.uuid4().hex[:8]}"
        self.task = bed.app.tasks[cell.task]
        self.calls: dict[str, Call] = {}
        self.kills: list[Kill] = []
        self.failures: list[str] = []
        self.lock = self.task.singleton_keys((self.key,), {}).lock
        self.tag = self.lock[: -len(":lock")]

    # -- actions -------------------------------------------------------------------------------

    def send(
        self,
        role: str,
        *,
        hold: str | None = None,
        end: str = "ok",
        link: bool = True,
        **options: Any,
    ) -> Call:
        """Send a call of the cell's task (through the task: publish-time dedup applies)."""
        sent_id = str(uuid.uuid4())
        link_to = self.bed.app.signature(LINK_TASK, kwargs={"tag": sent_id}) if link else None
        kwargs = {"hold": hold, "end": end}
        try:
            result = self.task.apply_async(
                (self.key,), kwargs, task_id=sent_id, link=link_to, queue=self.queue, **options
            )
        except DuplicateTaskError as exc:
            call = Call(role, sent_id, sent_id, link, raised=exc)
        else:
            call = Call(role, sent_id, result.id, link)
        self.calls[role] = call
        return call

    def send_copy(self, call: Call) -> None:
        """Publish the message of ``call`` again (its task id, arguments and link), as a
        broker's redelivery hands it out."""
        link_to = self.bed.app.signature(LINK_TASK, kwargs={"tag": call.sent_id})
        self.task.apply_async(
            (self.key,),
            {"hold": None, "end": "ok"},
            task_id=call.sent_id,
            link=link_to if call.linked else None,
            queue=self.queue,
        )

    def go(self, *roles: str) -> None:
        for role in roles:
            self.bed.client.rpush(go_key(self.bed.prefix, self.key, role), 1)

    def revoke(self, call: Call) -> None:
        """Revoke ``call`` and wait until the worker of the cell's queue has it as revoked."""
        replies = self.bed.app.control.revoke(
            call.id, destination=[self.worker.nodename], reply=True, timeout=10, limit=1
        )
        assert replies, f"{self.worker.nodename} did not answer the revoke"

    def kill(self, call: Call) -> None:
        """SIGKILL the pool child running ``call``."""
        pid = int(self.bed.starts[call.id][0]["pid"])
        at_us = sigkill_pid(self.bed.client, pid)
        self.kills.append(Kill("child", call.role, frozenset({pid}), at_us, time.time()))

    def follow_up(self, of: Call) -> Call:
        """The follow-up a coalesced call's marker names (tracked as ``F``, ``F2``, ...)."""
        assert of.first is not None
        info = skip_info(of.first["result"])
        assert info is not None, of.first
        assert info.follow_up is not None, info
        return self._track_follow_up(info.follow_up)

    def _track_follow_up(self, task_id: str) -> Call:
        for call in self.calls.values():
            if call.sent_id == task_id:
                return call
        count = sum(1 for role in self.calls if role.startswith("F"))
        role = "F" if not count else f"F{count + 1}"
        self.calls[role] = Call(role, task_id, task_id, linked=False)
        return self.calls[role]

    # -- conditions ----------------------------------------------------------------------------

    def started(self, call: Call) -> Wait:
        return Wait(lambda: call.id in self.bed.starts, f"{call.role} to start")

    def signalled(self, call: Call, *names: str, count: int = 1) -> Wait:
        def done() -> bool:
            return sum(self.bed.signals[(name, call.id)] for name in names) >= count

        return Wait(done, f"{call.role}: {count} of {names}")

    def redelivered(self, call: Call) -> Wait:
        """The broker handed the message of ``call`` (an eta, a countdown) out again before it
        was due: a worker received it twice before any delivery of it was taken up."""

        def done() -> bool:
            handled = sum(self.bed.signals[(name, call.id)] for name in HANDLED)
            received = self.bed.received[call.id]
            assert received >= 2 or not handled, f"{call.role} came due before it was redelivered"
            return received >= 2

        return Wait(done, f"{call.role}'s message to be handed out again")

    def met(self, call: Call) -> Wait:
        """``call`` met its key's policy (or its rate)."""
        return self.signalled(call, *MET, "rate_limited")

    def waiting(self, call: Call) -> Wait:
        """``call`` waits in its key's queue (``"queue"``, ``"cancel"``). Read in the order the
        worker writes: the signal it sends once the queue holds it; then the queue has it, its
        state is still PENDING (nothing stored), and under ``"cancel"`` the lock asks its
        holder to stop in its name (the scenario lets no holder go before)."""
        met = self.signalled(call, *MET)
        queue, _ = queue_keys(self.lock)

        def done() -> bool:
            if not met.done():
                return False
            pipe = self.bed.client.pipeline(transaction=False)
            pipe.zscore(queue, call.id)
            pipe.hget(self.lock, "cancel")
            place, asked = pipe.execute()
            assert place is not None, f"{call.role} met its key's policy, not in its queue"
            meta = self.bed.metas([call.id])[call.id]
            assert meta is None or meta["status"] == states.PENDING, (call.role, meta)
            if self.cell.policy == "cancel":
                assert asked is not None, f"{call.role} waits, no holder asked to stop"
                assert asked.decode() == call.id, (call.role, asked)
            return True

        return Wait(done, f"{call.role} to wait in its key's queue")

    def copy_handled(self, call: Call) -> Wait:
        """A copy of the message of ``call``, which ran, was dropped (or ran again)."""

        def done() -> bool:
            dropped = self.bed.signals[("redelivery_dropped", call.sent_id)]
            return dropped >= 1 or len(self.bed.starts.get(call.sent_id, [])) >= 2

        return Wait(done, f"a copy of {call.role}'s message to be dropped")

    def saw_cancel(self, call: Call) -> Wait:
        """The holding body of ``call`` saw a newer call's request to stop."""
        return Wait(lambda: call.id in self.bed.saw_cancel, f"{call.role} to see the stop request")

    def ready(self, call: Call) -> Wait:
        return Wait(lambda: call.first is not None, f"{call.role} to be ready")

    def passed(self, deadline: float) -> Wait:
        return Wait(lambda: time.monotonic() >= deadline, "the time to pass")

    def lock_free(self) -> Wait:
        return Wait(lambda: not self.bed.client.exists(self.lock), "the lock to be free")

    def no_marker(self) -> Wait:
        marker = queued_key(self.lock)
        return Wait(lambda: not self.bed.client.exists(marker), "the queued marker to go")

    def all_ready(self) -> Wait:
        def done() -> bool:
            self.discover()
            return all(c.first is not None for c in self.calls.values() if c.published)

        return Wait(done, "every call to be ready", timeout=45)

    def discover(self) -> None:
        """Track the follow-up each coalesced call's marker names."""
        for call in list(self.calls.values()):
            if call.first is not None and call.first["status"] == states.SUCCESS:
                info = skip_info(call.first["result"])
                if info is not None and info.follow_up is not None:
                    self._track_follow_up(info.follow_up)

    # -- what it left ------------------------------------------------------------------------

    def leftovers(self) -> dict[str, int]:
        """Every key beside the cell's lock (its hash tag), with its pttl."""
        keys = list(self.bed.client.scan_iter(match=f"{self.tag}*", count=1000))
        pipe = self.bed.client.pipeline(transaction=False)
        for key in keys:
            pipe.pttl(key)
        return {k.decode(): int(ttl) for k, ttl in zip(keys, pipe.execute(), strict=True)}

    def gone(self) -> bool:
        return not any(_kind(self.tag, key) in GONE for key in self.leftovers())

    def check(self) -> None:
        """The three invariants, and each call's expected end; failures to ``self.failures``."""
        self.failures += _check_history(self)
        self.failures += _check_calls(self)
        self.failures += _check_leftovers(self)

    def report(self) -> str:
        ids = [i for c in self.calls.values() for i in (c.sent_id, c.id)]
        calls = "\n".join(
            f"  {c.role}: sent {c.sent_id} result {c.id} first={_brief(c.first)} "
            f"last={_brief(c.last)} runs={len(self.bed.starts.get(c.sent_id, []))} "
            f"links={self.bed.links[c.sent_id]}"
            for c in self.calls.values()
        )
        lines = "\n".join(self.bed.log_lines([*ids, self.tag]))
        return (
            f"{self.cell.id} ({self.cell.task}, key {self.key}):\n"
            + "\n".join(f"  FAILED: {f}" for f in self.failures)
            + f"\n{calls}\n  worker log lines:\n{lines}"
        )


def _brief(meta: dict[str, Any] | None) -> str:
    if meta is None:
        return "None"
    return f"{meta['status']}:{meta['result']!r}"


def _kind(tag: str, key: str) -> str:
    """What a key beside a lock is: ``lock`` (also a slot), ``done``, ``fence``, ..."""
    suffix = key[len(tag) :].lstrip(":")
    return suffix.split(":", 1)[0]


# -- the scenarios ---------------------------------------------------------------------------


def scenario(run: CellRun) -> Scenario:
    """The cell's scenario: by its modifier (P x M) or its event (P x E, M x E)."""
    cell = run.cell
    if cell.table == "PxM":
        yield from _WITH_MODIFIER[cell.col](run)
    elif cell.row == "publish":
        yield from _publish_meets(run)
    elif cell.policy in _IN_LINE:
        yield from _in_line_meets(run)
    else:
        yield from _meets(run)
    yield run.all_ready()


#: the policies under which a duplicate waits in its key's queue (a record, its message
#: acknowledged, PENDING) until a release hands it the key
_IN_LINE = ("queue", "cancel")


def _met(run: CellRun, call: Call) -> Wait:
    """``call`` met its key's policy; in its key's queue, under the policies that queue it."""
    return run.waiting(call) if run.cell.policy in _IN_LINE else run.met(call)


def _let_go(run: CellRun, *roles: str) -> Scenario:
    """Let the holders ``roles`` go; one that is to end cancelled first saw the request to stop
    (a renewal reports it, a third of the ttl at most after it was made)."""
    for role in roles:
        if CANCELLED in run.cell.expect.get(role, ()):
            yield run.saw_cancel(run.calls[role])
    run.go(*roles)


def _holders(run: CellRun) -> tuple[str, ...]:
    return ("H1", "H2") if run.cell.modifier == "permits" else ("H",)


def _hold(run: CellRun, end: str = "ok") -> Generator[Wait, None, list[Call]]:
    """Send the holders (the first one ending ``end``); wait until each body started."""
    roles = _holders(run)
    held = [run.send(role, hold=role, end=end if i == 0 else "ok") for i, role in enumerate(roles)]
    for call in held:
        yield run.started(call)
    return held


def _with_permits(run: CellRun) -> Scenario:
    yield from _hold(run)
    if run.cell.policy == "queue":  # two calls in line; the slot freed goes to each in turn
        first = run.send("D1")
        yield run.waiting(first)
        second = run.send("D2")
        yield run.waiting(second)
        run.go("H1")
        yield run.ready(second)
        run.go("H2")
        return
    duplicate = run.send("D")
    yield run.met(duplicate)
    run.go("H1", "H2")


def _then_after(run: CellRun) -> Scenario:
    """A duplicate while the holder runs, another once it ended (a rate, a window)."""
    (holder,) = yield from _hold(run)
    first = run.send("D1")
    yield run.met(first)
    run.go("H")
    yield run.ready(holder)
    run.send("D2")


def _with_debounce(run: CellRun) -> Scenario:
    """The holder runs once its own debounce ended; a burst of two calls meanwhile: the first
    superseded, the second meets the policy when it comes due."""
    yield from _hold(run)
    first = run.send("D1")
    yield run.signalled(first, "call_debounced")
    second = run.send("D2")
    yield run.signalled(second, "call_debounced")
    yield _met(run, second)
    yield run.ready(first)
    yield from _let_go(run, "H")


def _with_publish(run: CellRun) -> Scenario:
    if run.cell.policy == "cancel":
        yield from _replaced_at_publish(run)
        return
    yield from _hold(run)
    duplicate = run.send("D")
    if run.cell.policy == "join":  # a call with a link is published, and joins
        yield run.met(duplicate)
        run.send("D2", link=False)
    run.go("H")


def _replaced_at_publish(run: CellRun) -> Scenario:
    """Under "cancel": a call published while an older one waits in the broker (both with a
    countdown) takes its place, the older one revoked; the newer one holds the key when due; a
    call sent while it runs is published (a run holds the key) and asks it to stop."""
    older = run.send("Q", countdown=QUEUED_COUNTDOWN_S)
    holder = run.send("H", hold="H", countdown=QUEUED_COUNTDOWN_S)
    yield run.ready(older)
    yield run.started(holder)
    duplicate = run.send("D")
    yield run.waiting(duplicate)
    yield from _let_go(run, "H")


_WITH_MODIFIER: dict[str, Callable[[CellRun], Scenario]] = {
    "permits": _with_permits,
    "rate": _then_after,
    "debounce": _with_debounce,
    "window": _then_after,
    "publish": _with_publish,
}

#: the policies under which a duplicate waits (requeued, joined) rather than ends at once
_WAITING = ("retry", "join")


def _meets(run: CellRun) -> Scenario:
    """A duplicate sent while the holders run meets the cell's event."""
    cell, event = run.cell, run.cell.event
    debounced = cell.modifier == "debounce"
    holders = yield from _hold(run, end="refuse" if event == "refused_retry" else "ok")
    options: dict[str, Any] = {}
    if event == "expires":
        options["expires"] = DEBOUNCE_EXPIRES_S if debounced else EXPIRES_S
    if event == "redelivered":
        options["countdown"] = REDELIVERED_COUNTDOWN_S
    sent = time.monotonic()
    duplicate = run.send("D", **options)
    if event == "redelivered":  # the broker handed its message out again before it was due
        yield run.redelivered(duplicate)
        yield run.signalled(duplicate, *HANDLED, count=2)
    elif event == "expires" and (debounced or cell.policy in _WAITING):
        yield run.ready(duplicate)  # it expired while it waited
    else:
        yield run.signalled(duplicate, "call_debounced") if debounced else run.met(duplicate)
    released = [h.role for h in holders]
    if event == "revoke":
        target = duplicate
        if cell.policy == "coalesce":  # what waits is its follow-up
            yield run.ready(duplicate)
            target = run.follow_up(duplicate)
        run.revoke(target)
        yield run.ready(target)  # REVOKED (Celery 5.7 marks it at once), before the holder ends
    elif event == "expires":
        yield run.passed(sent + options["expires"])
    elif event == "kill":
        run.kill(holders[0])
        released.remove(holders[0].role)
    elif event == "redelivered" and cell.policy == "join":
        yield from _copy_as_the_holder_ends(run, duplicate, released)
        return
    run.go(*released)


#: the calls that join beside the redelivered one, so that the holder's end takes a while to
#: complete them all
EXTRA_JOINERS = 40


def _copy_as_the_holder_ends(run: CellRun, joined: Call, holders: list[str]) -> Scenario:
    """Under "join", a copy of the joined call's message also comes as the holder ends, as one
    Redis hands out while the worker acknowledges the copies that came due (seen in this
    column): many calls joined beside it (their completions take a while), the holder let go,
    and the copy published the moment its lock is gone."""
    extra = [run.send(f"X{i}", link=False) for i in range(1, EXTRA_JOINERS + 1)]
    for call in extra:
        yield run.met(call)
    run.go(*holders)
    deadline = time.monotonic() + 20
    while run.bed.client.exists(run.lock) and time.monotonic() < deadline:
        pass
    run.send_copy(joined)


def _in_line_meets(run: CellRun) -> Scenario:
    """Under "queue" and "cancel": the duplicate that meets the event waits in its key's queue.
    Under "queue" a second call waits behind it (not behind a redelivered one); under
    "cancel" an older call waited before it came, and made way for it. A redelivered call's
    message comes once more after it ran (published again with its task id, as the broker's
    redelivery is): the copy must be dropped."""
    event = run.cell.event
    cancel = run.cell.policy == "cancel"
    (holder,) = yield from _hold(run, end="refuse" if event == "refused_retry" else "ok")
    if cancel:
        older = run.send("W")
        yield run.waiting(older)
    options: dict[str, Any] = {}
    if event == "expires":
        options["expires"] = EXPIRES_S
    if event == "redelivered":
        options["countdown"] = REDELIVERED_COUNTDOWN_S
    sent = time.monotonic()
    duplicate = run.send("D", **options)
    if event == "redelivered":  # the broker handed its message out again before it was due
        yield run.redelivered(duplicate)
        yield run.signalled(duplicate, *HANDLED, count=2)
    yield run.waiting(duplicate)
    if cancel:
        yield run.ready(older)  # a skip naming the newer call
    elif event != "redelivered":
        yield run.waiting(run.send("D2"))
    if event == "revoke":
        run.revoke(duplicate)
        yield run.ready(duplicate)  # REVOKED while it waits, before the holder ends
    elif event == "expires":
        yield run.passed(sent + EXPIRES_S)
    elif event == "kill":
        run.kill(holder)
        return
    yield from _let_go(run, "H")
    if event == "redelivered":  # one more copy of its message, once it ran: dropped
        yield run.ready(duplicate)
        run.send_copy(duplicate)
        yield run.copy_handled(duplicate)


def _publish_meets(run: CellRun) -> Scenario:
    """Publish-time dedup: the call that waits is the holder, queued (a revoke, an expiry, a
    redelivery of its eta message) or running (a kill, a refused retry); a duplicate sent
    meanwhile is not published; a new call after the event is."""
    event = run.cell.event
    if event in ("revoke", "expires", "redelivered"):
        countdown = REDELIVERED_COUNTDOWN_S if event == "redelivered" else QUEUED_COUNTDOWN_S
        options: dict[str, Any] = {"countdown": countdown}
        if event == "expires":
            options["expires"] = QUEUED_EXPIRES_S
        holder = run.send("H", **options)
        run.send("D")
        if event == "revoke":
            run.revoke(holder)
        if event == "redelivered":
            yield run.redelivered(holder)
            return
        yield run.ready(holder)
        yield run.no_marker()
    else:
        (holder,) = yield from _hold(run, end="refuse" if event == "refused_retry" else "ok")
        run.send("D")
        if event == "kill":
            run.kill(holder)
        else:
            run.go("H")
        yield run.ready(holder)
        yield run.lock_free()
    run.send("N")


# -- running a set of cells at once ------------------------------------------------------------


def run_cells(bed: Bed, runs: list[CellRun], interval: float = 0.03) -> None:
    """Run every cell's scenario at once; when all are done, wait until the broker is idle and
    each cell's keys are gone; then check each cell (failures in ``run.failures``)."""
    scenarios = {id(run): scenario(run) for run in runs}
    waits: dict[int, tuple[CellRun, Wait, float]] = {}

    def advance(run: CellRun) -> None:
        try:
            wait = next(scenarios[id(run)])
        except StopIteration:
            waits.pop(id(run), None)
            return
        except Exception:
            run.failures.append("scenario raised:\n" + traceback.format_exc())
            give_up(run)
            return
        waits[id(run)] = (run, wait, time.monotonic() + wait.timeout)

    def give_up(run: CellRun) -> None:
        """A cell that failed midway: its holders let go, so that the others still settle."""
        waits.pop(id(run), None)
        run.go("H", "H1", "H2")

    for run in runs:
        advance(run)
    while waits:
        _observe(bed, runs)
        for run, wait, deadline in list(waits.values()):
            try:
                done = wait.done()
            except Exception:
                run.failures.append(f"waiting for {wait.what} raised:\n{traceback.format_exc()}")
                give_up(run)
                continue
            if done:
                advance(run)
            elif time.monotonic() > deadline:
                run.failures.append(f"timed out waiting for {wait.what}")
                give_up(run)
        time.sleep(interval)
    if not wait_for(bed.broker_idle, 30, "the broker to be idle", fail=False):
        _blame_messages(bed, runs)
    deadline = time.monotonic() + WINDOW_S * 3 + 10
    while time.monotonic() < deadline and not all(run.gone() for run in runs):
        time.sleep(0.1)
    _observe(bed, runs)
    finals = bed.metas(c.sent_id for run in runs for c in run.calls.values())
    for run in runs:
        for call in run.calls.values():
            call.last = finals.get(call.sent_id)
        if not run.failures:
            try:
                run.check()
            except Exception:
                run.failures.append("check raised:\n" + traceback.format_exc())


def _blame_messages(bed: Bed, runs: list[CellRun]) -> None:
    """The broker is not idle: each message left (queued, or reserved unacknowledged) is a
    failure of the cell whose call it is (of every cell when it is nobody's)."""
    messages = [json.loads(raw)[0] for raw in bed.client.hvals(f"{bed.prefix}unacked")]
    for queue in bed.workers:
        messages += [json.loads(raw) for raw in bed.client.lrange(f"{bed.prefix}{queue}", 0, -1)]
    for message in messages:
        headers = message.get("headers") or {}
        task_id, task = headers.get("id"), headers.get("task")
        owners = [
            run for run in runs if any(task_id in (c.sent_id, c.id) for c in run.calls.values())
        ]
        for run in owners or runs:
            run.failures.append(f"a message left in the broker: {task}[{task_id}] {headers}")


def _observe(bed: Bed, runs: list[CellRun]) -> None:
    """Read what the workers wrote; note each call's meta when first seen ready."""
    bed.refresh()
    waiting = [c for run in runs for c in run.calls.values() if c.published and c.first is None]
    metas = bed.metas(c.id for c in waiting)
    for call in waiting:
        meta = metas.get(call.id)
        if meta is not None and meta["status"] in states.READY_STATES:
            call.first = meta
    for run in runs:
        run.discover()


# -- the checks ------------------------------------------------------------------------------


def _check_history(run: CellRun) -> list[str]:
    failures = []
    executions = close_killed(run.bed.executions(run.key), run.kills)
    report = check_history(executions)
    if report.unfinished:
        failures.append("unfinished runs:\n" + report.summary())
    if run.cell.modifier == "permits":
        most = max_at_once(executions).get(run.key, 0)
        if most > 2:
            failures.append(f"{most} runs at once with 2 permits")
    elif not report.ok:
        failures.append(report.summary())
    starts = sorted(e.start_us / 1e6 for e in executions)
    if run.cell.modifier == "rate":
        close = [(a, b) for a, b in itertools.pairwise(starts) if b - a < RATE_PERIOD_S - SLACK_S]
        if close:
            failures.append(f"two starts within the rate's period: {close}")
    if run.cell.modifier == "window":
        close = [(a, b) for a, b in itertools.pairwise(starts) if b - a < WINDOW_S - SLACK_S]
        if close:
            failures.append(f"a start inside the window of the one before: {close}")
    ran = [
        role
        for role in run.cell.order
        if role in run.calls and run.bed.starts.get(run.calls[role].sent_id)
    ]
    firsts = {role: min(e["ts"] for e in run.bed.starts[run.calls[role].sent_id]) for role in ran}
    if list(firsts.values()) != sorted(firsts.values()):  # one that did not run: its outcome
        failures.append(f"runs started out of order: {sorted(firsts, key=firsts.__getitem__)}")
    known = {c.sent_id for c in run.calls.values()}
    stray = [i for e in executions for i in [_task_id(run, e)] if i not in known]
    if stray:
        failures.append(f"runs of calls the scenario does not know: {stray}")
    return failures


def _task_id(run: CellRun, execution: Execution) -> str:
    return execution.worker.split()[-1]


def _outcome(run: CellRun, call: Call) -> str:
    """How ``call`` ended, in the words of tests/support/matrix.py."""
    if call.raised is not None:
        return (
            RAISED_AT_PUBLISH if isinstance(call.raised, DuplicateTaskError) else repr(call.raised)
        )
    if not call.published:
        holder = next((c for c in run.calls.values() if c.sent_id == call.id), None)
        return NOT_PUBLISHED if holder is not None else f"the result of an unknown {call.id}"
    meta = call.first
    if meta is None:  # a cell that failed midway (its report says why)
        return "never ready"
    status, result = meta["status"], meta["result"]
    ran = len(run.bed.starts.get(call.sent_id, []))
    if status == states.REVOKED:
        if not ran:
            return REVOKED
        reason = str(result)
        if reason.startswith(_CANCELLED_BY) and reason[len(_CANCELLED_BY) :] in _sent_after(
            run, call
        ):
            return CANCELLED
        return f"REVOKED {result!r} after it ran"
    if status == states.FAILURE:
        name = type(result).__name__
        if name in ("DuplicateTaskError", "RateLimitedError"):
            return DUPLICATE_ERROR if name == "DuplicateTaskError" else RATE_ERROR
        if name == "WorkerLostError":
            return LOST
        if ran == 0 and any(
            c is not call and c.first is not None and type(c.first["result"]).__name__ == name
            for c in run.calls.values()
        ):
            return JOINED_FAILURE
        if name == "MaxRetriesExceededError":
            return REFUSED
        return f"FAILURE {result!r}"
    if status == states.SUCCESS:
        info = skip_info(result)
        if info is not None:
            if info.reason == "debounced":
                return SUPERSEDED
            if info.follow_up is not None:
                return COALESCED
            return OVERTAKEN if info.holder in _sent_after(run, call) else SKIPPED
        if isinstance(result, dict) and result.get("ran") == call.sent_id:
            return RAN
        if isinstance(result, dict) and result.get("ran") in {
            c.sent_id for c in run.calls.values()
        }:
            return JOINED
        return f"SUCCESS {result!r}"
    return f"{status} {result!r}"


#: how the result of a run that ended with ``self.singleton.end_cancelled()`` begins
_CANCELLED_BY = "cancelled: superseded by "


def _sent_after(run: CellRun, call: Call) -> set[str]:
    """The task ids of the calls the scenario sent after ``call``."""
    calls = list(run.calls.values())
    return {c.sent_id for c in calls[calls.index(call) + 1 :]}


def _base(role: str) -> str:
    """The role a call's expectation is declared for: ``F`` for each follow-up (``F``, ``F2``,
    ...), ``X`` for each call joined beside another (``X1``, ...)."""
    return role[0] if role[0] in "FX" else role


#: the outcomes of a call that ran
_RUNS = (RAN, LOST, REFUSED, CANCELLED)


def _check_calls(run: CellRun) -> list[str]:
    failures = []
    expect = run.cell.expect
    roles = {_base(role) for role in run.calls}
    missing = set(expect) - roles
    if missing:
        failures.append(f"the scenario made no call {sorted(missing)}")
    for role, call in run.calls.items():
        outcome = _outcome(run, call)
        allowed = expect.get(_base(role), frozenset())
        if outcome not in allowed:
            failures.append(f"{role} ended {outcome!r}, expected one of {sorted(allowed)}")
        ran = len(run.bed.starts.get(call.sent_id, []))
        if ran > 1:
            failures.append(f"{role} ran {ran} times")
        if outcome in _RUNS and ran != 1:
            failures.append(f"{role} ended {outcome!r} but ran {ran} times")
        if outcome not in _RUNS and ran:
            failures.append(f"{role} ended {outcome!r} but ran {ran} times")
        links = run.bed.links[call.sent_id]
        meta = call.first if call.published else None
        real = (
            meta is not None
            and meta["status"] == states.SUCCESS
            and skip_info(meta["result"]) is None
        )
        if links != (1 if real and call.linked else 0):
            failures.append(f"{role} ({outcome}) had its link called {links} times")
        if call.published:
            last = call.last
            if last is None or _brief(last) != _brief(meta):
                failures.append(f"{role} ended {_brief(meta)} first, {_brief(last)} at the end")
    return failures


def _check_leftovers(run: CellRun) -> list[str]:
    failures = []
    for key, pttl in sorted(run.leftovers().items()):
        kind = _kind(run.tag, key)
        if kind in GONE:
            failures.append(f"left in Redis: {key} (pttl {pttl})")
        elif kind not in KEPT:
            failures.append(f"an undocumented key left in Redis: {key} (pttl {pttl})")
        elif pttl < 0:
            failures.append(f"kept for ever: {key}")
    return failures


def summary(run: CellRun) -> str:
    """One line: how each call of the cell ended."""
    ends = ", ".join(
        f"{role}={_outcome(run, call)}"
        + (f" (received {run.bed.received[call.sent_id]}x)" if call.published else "")
        for role, call in run.calls.items()
    )
    kept = sorted({_kind(run.tag, key) for key in run.leftovers()})
    return f"{run.cell.id}: {'FAILED' if run.failures else 'ok'}: {ends}; kept {kept}"


def known_failure(cell: Cell) -> Any:
    """The mark of a cell that shows a defect of the library: it must fail until fixed."""
    return pytest.mark.xfail(strict=True, reason=f"{cell.id}: {cell.known_failure}")


def assert_cells(runs: Iterable[CellRun]) -> None:
    """Fail with every failed cell's report (each cell's line printed: ``-rP`` shows them)."""
    runs = list(runs)
    for run in runs:
        print(summary(run))
    failed = [run for run in runs if run.failures]
    assert not failed, f"{len(failed)} cells failed:\n\n" + "\n\n".join(r.report() for r in failed)


# -- the workers of a module -----------------------------------------------------------------


class Beds:
    """A module's workers and a client app, all on the module's prefix: ``pools`` maps each
    queue to the pool and concurrency of the worker that consumes it (the first queue is the
    app's default one, where the links go). Each set of cells is run once (:meth:`runs`),
    however many tests read it."""

    def __init__(
        self,
        factory: WorkerFactory,
        redis_url: str,
        prefix: str,
        pools: dict[str, tuple[str, int]],
        env: dict[str, str] | None = None,
    ) -> None:
        first = next(iter(pools))
        self.app = build(redis_url, prefix, first)
        self.client = redis.Redis.from_url(redis_url)
        workers = {
            queue: factory.start(
                MATRIX_APP,
                pool=pool,
                concurrency=concurrency,
                env={"SINGLETON_TEST_QUEUE": first, **(env or {})},
                extra_args=("-Q", queue),
            )
            for queue, (pool, concurrency) in pools.items()
        }
        for worker in workers.values():
            worker.wait_ready(self.app, timeout=60)
        self.bed = Bed(self.app, self.client, prefix, workers)
        self._runs: dict[str, list[CellRun]] = {}

    def runs(self, name: str, cells: Iterable[Cell], queue: Callable[[Cell], str]) -> list[CellRun]:
        """The runs of ``cells`` (run together the first time ``name`` is asked for)."""
        if name not in self._runs:
            runs = [CellRun(self.bed, cell, queue(cell)) for cell in cells]
            run_cells(self.bed, runs)
            self._runs[name] = runs
        return self._runs[name]

    def close(self) -> None:
        close_app(self.app)
        self.client.close()
