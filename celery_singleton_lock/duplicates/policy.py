"""The parts of what happens to a duplicate, and the small lifecycle they share.

A task's settings select its *parts*: one **policy** (``singleton_on_duplicate``: what a call
does when it meets a run holding its key) and every **modifier** that is on (permits, the rate
limit, debounce, the at-least window, publish-time dedup). Each part is an object with the
hooks below; each hook is empty here, and a part overrides the ones it needs. Nothing outside a
policy's own module asks which policy a task has: the task, its tracer hook, the worker's main
process and the release paths call the hooks of the parts :func:`parts_of` gives them
(tests/unit/test_parts.py checks that no other module compares a policy's name).

The lifecycle, in the order a call meets it:

====================  ======================================================================
``refuse``            when the settings are read (worker start): why this part cannot work
                      with the other settings, in one line that names both (None: it can)
``on_publish``        ``apply_async()``: whether the call is published (publish-time dedup)
``before_lock``       on the worker, before the lock: the call ends here (debounce's wait)
``on_contended``      the lock held by another run: what the call does (an :class:`Action`,
                      decided without a round trip: duplicates/gate.py)
``over_rate``         the key's rate limit allows no start now: what the call does
``carry_out``         the policy's own answer, when its action says so (coalesce, join)
``on_decided``        the gate decided, whatever it decided (publish-time dedup's marker)
``on_acquired``       the lock taken: whether the run goes on (a joiner's watch copy)
``release``           the run's end: release, and what it owes its waiting calls
``after_release``     a release made for the key elsewhere (a lost run, a CLI purge)
``on_lost``           a run terminated or timed out, ended by the worker's main process
``on_withdrawn``      a waiting or queued call revoked or expired before it ran
====================  ======================================================================

A policy is a subclass of :class:`Policy` with a ``name`` (the setting's value) in a module of
its own in this package, which is found here by its module: adding a policy touches its module
and the settings table (settings/table.py ``POLICIES``), nothing else.
"""

from __future__ import annotations

import enum
import importlib
import pkgutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

from ..errors import SingletonConfigError
from ..settings.options import Options, refuse_with

if TYPE_CHECKING:
    from ..core.backend import Contended, RateLimited
    from ..core.keys import LockKeys
    from ..core.renewer import HeldLock, Renewer
    from ..run.task_events import EventSink

__all__ = [
    "Action",
    "Call",
    "Fate",
    "Part",
    "Parts",
    "Policy",
    "Why",
    "parts_of",
    "policies",
]


class Fate(enum.Enum):
    """How a call goes on after its lock was asked for."""

    RUN = enum.auto()  #: the lock is the run's (or a rate alone holds none): the body runs
    RUN_UNLOCKED = enum.auto()  #: Redis failed, ``singleton_on_redis_error="run"``
    DROP = enum.auto()  #: its message already ran to its end: acknowledged, nothing stored
    SKIP = enum.auto()  #: ends as a skip: ``SUCCESS``, the skip marker
    REQUEUE = enum.auto()  #: published again, due in ``countdown``; this delivery ends RETRY
    RAISE = enum.auto()  #: fails (DuplicateTaskError, RateLimitedError, the Redis error)
    WAIT = enum.auto()  #: waits as a copy of its message: acknowledged, nothing stored
    POLICY = enum.auto()  #: the policy's own answer, carried out by it (``carry_out``)


class Why(enum.Enum):
    """What the call met: what its log line and signal say."""

    DUPLICATE = enum.auto()  #: another run holds its key
    REDELIVERED = enum.auto()  #: its own earlier delivery holds its key
    PARENT = enum.auto()  #: the run that published it holds its key (a chain step, a link)
    RATE = enum.auto()  #: the key's rate limit allows no start now
    REDIS = enum.auto()  #: Redis could not be asked
    SUPERSEDED = enum.auto()  #: a later call of its debounce burst
    QUEUE_FULL = enum.auto()  #: its key's queue holds ``singleton_queue_max`` calls already


class Call(NamedTuple):
    """What the gate knows of a call, read off its request on any path (a tuple: made for
    every contended call, so as cheap to make as Python allows)."""

    task_id: str
    parent_id: str | None = None
    #: its retries count: above 0, a run going on (``self.retry()``), not a new call
    retries: int = 0
    #: ``apply()`` (``task_always_eager``): nothing can be requeued or left waiting
    eager: bool = False
    #: a coalesced follow-up (never coalesced again)
    follow_up: bool = False
    #: requeued by the library to wait for its key (never dropped for the rate)
    requeued: bool = False


class Action(NamedTuple):
    """What a call does: its :class:`Fate`, and what that needs."""

    fate: Fate
    why: Why = Why.DUPLICATE
    #: REQUEUE: seconds until the copy is due; SKIP and RAISE for the rate: until the next start
    countdown: float = 0.0
    #: the run the call met (its marker and log line name it); under debounce, the later call
    holder: str = ""
    #: SKIP: the follow-up its call was coalesced into
    follow_up: str | None = None
    #: the name of the policy that answered, as signals report it
    policy: str = ""
    #: RAISE for a full queue: the queue's length
    length: int = 0


RUN = Action(Fate.RUN)
DROP = Action(Fate.DROP)
WAIT = Action(Fate.WAIT)


class Part:
    """One part of what happens to a call beyond its lock. Every hook is empty: see the module's
    table for when each is called."""

    #: the setting that turns it on, as refusals name it
    setting: ClassVar[str] = ""

    def applies(self, opts: Options) -> bool:
        """Whether this part is on under ``opts`` (a policy is on when the setting names it)."""
        return True

    def refuse(self, opts: Options) -> str | None:
        """Why this part cannot work with the other settings: one line that names both settings;
        None when it can."""
        return None

    def on_publish(  # noqa: PLR0917 - apply_async's call, and Celery's own publish
        self,
        task: Any,
        args: Sequence[Any] | None,
        kwargs: Mapping[str, Any] | None,
        task_id: str | None,
        options: dict[str, Any],
        send: Callable[..., Any],
    ) -> Any:
        """``apply_async()``: publish the call with ``send`` (Celery's own) and return its
        AsyncResult, or return another's."""
        return send(args, kwargs, task_id, **options)

    def before_lock(self, task: Any, keys: LockKeys, request: Any) -> Action | None:
        """On a worker, before the lock is asked for (``request``, the run's Context, current):
        an action that ends the call here (WAIT, SKIP), or None: it goes on to its lock."""
        return None

    def on_decided(self, task: Any, task_id: str, keys: LockKeys, fate: Fate) -> None:
        """The gate decided the call's fate (a worker's call, never an eager one), whatever it
        is: what stood for the call until then is done with (its queued marker)."""

    def on_withdrawn(self, task: Any, request: Any) -> None:
        """A call that waited (queued, joined) was revoked or expired before it ran: the
        worker's main process discards its message (``request``: its Context, as
        ``task_revoked`` gives it)."""


class Policy(Part):
    """An answer to a duplicate: ``singleton_on_duplicate=<name>``."""

    setting = "singleton_on_duplicate"
    #: the setting's value that selects it
    name: ClassVar[str] = ""
    #: a duplicate it skips may end in front of Celery's tracer (task/tracer.py); its own
    #: answer (``carry_out``) is carried out there too
    ends_in_front: ClassVar[bool] = False
    #: a duplicate it skips may end in the worker's main process (worker/mainskip.py)
    ends_in_main_process: ClassVar[bool] = False
    #: a call publish-time dedup turns away fails (``DuplicateTaskError``) instead of
    #: returning the holder's AsyncResult
    refuses_at_publish: ClassVar[bool] = False
    #: a call that starts a canvas of its own (links, a chain) is always published: it meets
    #: the key on the worker, where its canvas goes on with the holder's outcome
    publishes_canvas: ClassVar[bool] = False
    #: its runs' ends owe calls that wait beside the key (a follow-up, joiners): every task of a
    #: scope must then use it, or a run of another policy would leave them waiting
    owes_waiting_calls: ClassVar[bool] = False
    #: under publish-time dedup, a newer call takes the place of an older one still in the
    #: broker's queue (it is published, the older revoked), and is published while a run holds
    #: the key (it meets the run on the worker)
    replaces_queued: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.name:
            _POLICIES[cls.name] = cls()

    def on_contended(self, call: Call, held: Contended, opts: Options) -> Action:
        """What ``call`` does when ``held`` (another run) holds its key. Pure: no round trip."""
        raise NotImplementedError

    def over_rate(self, call: Call, held: RateLimited, opts: Options) -> Action:
        """What ``call`` does over the key's rate limit (the next start in ``held.pttl_ms``): by
        default it waits for that start, requeued; an eager call cannot wait, and fails."""
        wait = held.pttl_ms / 1000
        if call.eager:
            return Action(Fate.RAISE, Why.RATE, wait, held.holder, policy=self.name)
        return Action(Fate.REQUEUE, Why.RATE, wait, held.holder, policy=self.name)

    def carry_out(
        self, task: Any, action: Action, keys: LockKeys, held: Contended, request: Any
    ) -> Action:
        """Carry out this policy's own answer (an action of Fate.POLICY) for the current call;
        the action that then ends it (this may also end it itself, raising)."""
        raise NotImplementedError

    def on_acquired(self, task: Any, key: str, request: Any) -> bool:
        """The run took its lock: whether it goes on (False: it is ended without running)."""
        return True

    def release(
        self,
        task: Any,
        held: HeldLock,
        renewer: Renewer,
        state: str,
        *,
        eager: bool,
        retval: Any = None,
    ) -> None:
        """The run's end (not a hand-over to its retry), for a policy whose end owes the calls
        waiting on it (a follow-up, joiners, the next call in line): release ``held`` and serve
        them. A policy that does not override this is released the usual way, written ahead
        off the run's path (task/endings.py ``release``), without this call."""
        raise NotImplementedError

    def after_release(
        self, task: Any, keys: LockKeys, reason: str, releaser: str | None = None
    ) -> None:
        """A lock of the key was released for a run that is gone, or a slot expired (the
        worker's main process, a run that never started): ``releaser`` is its task id."""

    def on_lost(  # noqa: PLR0917 - the run, and how it ended
        self,
        task: Any,
        task_id: str,
        keys: LockKeys,
        state: str,
        exc: BaseException,
        send_events: EventSink | None,
    ) -> None:
        """A run the worker's main process ends (terminated by a revoke, past its hard time
        limit): it ended in ``state`` with ``exc``."""


_POLICIES: dict[str, Policy] = {}
_MODIFIERS: list[Part] = []


def policies() -> Mapping[str, Policy]:
    """Every policy, by name: the :class:`Policy` subclasses of this package's modules."""
    if not _FOUND:
        package = __name__.rpartition(".")[0]
        for module in pkgutil.iter_modules(importlib.import_module(package).__path__):
            importlib.import_module(f"{package}.{module.name}")
        _FOUND.append(True)
    return _POLICIES


_FOUND: list[bool] = []


def modifier(part: Part) -> Part:
    """Register a modifier (once, at its module's import): asked by every task it applies to."""
    _MODIFIERS.append(part)
    return part


@dataclass(frozen=True)
class Parts:
    """The parts a task's settings select, with the hooks each path calls: worked out once per
    settings read (``SingletonTask._singleton_parts``), so the run's path loops over no part that
    does nothing there."""

    policy: Policy
    modifiers: tuple[Part, ...] = ()
    #: the parts with a ``before_lock``, an ``on_decided``, an ``on_publish`` of their own
    before_lock: tuple[Part, ...] = field(default=(), repr=False)
    on_decided: tuple[Part, ...] = field(default=(), repr=False)
    on_publish: tuple[Part, ...] = field(default=(), repr=False)
    #: whether the policy's ``release`` is its own (else a run's end releases the usual way,
    #: run/release.py, without the call)
    own_release: bool = field(default=False, repr=False)
    #: whether the policy's ``on_acquired`` is its own (else a run that took its lock goes on)
    owns_acquired: bool = field(default=False, repr=False)

    @property
    def all(self) -> tuple[Part, ...]:
        return (self.policy, *self.modifiers)


def parts_of(opts: Options) -> Parts:
    """The parts ``opts`` select: its policy, and each modifier that applies."""
    policy = policies()[opts.on_duplicate]
    modifiers = tuple(part for part in _MODIFIERS if part.applies(opts))
    chosen = (policy, *modifiers)
    return Parts(
        policy,
        modifiers,
        _overriding(chosen, "before_lock"),
        _overriding(chosen, "on_decided"),
        _overriding(chosen, "on_publish"),
        type(policy).release is not Policy.release,
        type(policy).on_acquired is not Policy.on_acquired,
    )


def _overriding(parts: Sequence[Part], hook: str) -> tuple[Part, ...]:
    empty = getattr(Part, hook)
    return tuple(part for part in parts if getattr(type(part), hook) is not empty)


def _refusal(opts: Options) -> str | None:
    """The first refusal of the parts ``opts`` select (settings/options.py asks it)."""
    known = policies()
    if opts.on_duplicate not in known:  # the table's choice, with no module: a bug of ours
        raise SingletonConfigError(f"no policy module for {opts.on_duplicate!r}")
    for part in (known[opts.on_duplicate], *(p for p in _MODIFIERS if p.applies(opts))):
        reason = part.refuse(opts)
        if reason is not None:
            return reason
    return None


refuse_with(_refusal)
