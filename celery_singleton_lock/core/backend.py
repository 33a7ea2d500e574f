"""What every lock store is: the :class:`LockBackend` Protocol, its outcome types, and the
arguments and replies of the lock scripts.

Three stores implement it, one per deployment kind, chosen once from the URL
(:func:`~celery_singleton_lock.core.connection.new_store`): :class:`~.store.LockStore` (one
server, or the master a Sentinel names), :class:`~.cluster.ClusterStore` (Redis Cluster) and
:class:`~.redlock.RedlockStore` (a majority of independent masters). None subclasses another.

An *owner* is an opaque string (the Celery glue passes the task id) and a *generation* an
integer (the glue passes the retries count): the same owner may take its lock over from an
earlier generation, which is how a retried task re-enters the lock its previous run still
holds. Knows nothing of Celery.
"""

from __future__ import annotations

import enum
import functools
import itertools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeAlias

import redis
from redis.cluster import RedisCluster
from redis.exceptions import RedisClusterException

from ..errors import LockUnavailableError
from ._wire import Script, as_text, bulk
from .completion import Ending, done_key
from .keys import LockKeys

__all__ = [
    "FENCE_MARGIN_MS",
    "MAX_META_FIELDS",
    "MAX_META_NAME_BYTES",
    "MAX_META_VALUE_BYTES",
    "REDIS_ERRORS",
    "Acquired",
    "Client",
    "Completed",
    "Contended",
    "LockBackend",
    "RateLimited",
    "ReleaseItem",
    "ReleaseStatus",
    "RenewItem",
    "RenewStatus",
    "SequentialReleases",
    "release_lost_slot",
]

#: What a store accepts as a client: one server (or a Sentinel's master) or a cluster.
Client: TypeAlias = "redis.Redis | RedisCluster"
#: One lock to release: ``(key, owner, generation or None for any, fencing token or None)``,
#: and what the run's end leaves behind (:class:`~.completion.Ending`; none when left out).
ReleaseItem: TypeAlias = (
    "tuple[str, str, int | None, int | None] | tuple[str, str, int | None, int | None, Ending]"
)
#: Errors that mean "Redis could not be asked" (redis-py's cluster errors are not RedisErrors).
REDIS_ERRORS: tuple[type[Exception], ...] = (redis.RedisError, RedisClusterException)

#: How long a fencing counter outlives the ttl of the lock whose acquire wrote it, by default
#: (``fence_margin=`` in the URL, ``singleton_fence_margin``). The counter expires
#: :func:`fence_ttl_ms` after its token (on the server's clock), so once it is gone the clock
#: has passed the last token by that much, and the next token, taken from the clock, is larger
#: unless the clock stepped back by more: docs/internals.md, "Fencing tokens".
FENCE_MARGIN_MS = 60_000

#: The metadata a lock hash keeps, whatever the call (a huge argument preview, hostname or task
#: name): at most this many fields, each name and value cut to these many bytes (UTF-8, a cut
#: value ending in "..."). docs/internals.md, "The lock in Redis", states the hash's size.
MAX_META_FIELDS = 8
MAX_META_NAME_BYTES = 32
MAX_META_VALUE_BYTES = 200


@dataclass(frozen=True)
class Acquired:
    """The lock is ours; ``token`` is its fencing token for this run.

    ``replicas`` is how many replicas acknowledged the lock (the reply of ``WAIT``) when the
    store waits for replicas, else None.
    """

    token: int
    reentered: bool
    replicas: int | None = None
    #: the permit slot taken (1 to ``LockKeys.permits``): the run holds ``keys.slot(slot)``
    slot: int = 1


@dataclass(frozen=True)
class Contended:
    """Another owner (or another run of the same generation) holds the lock.

    ``finished``: the holder's run has ended and the key is held for its at-least window
    (:mod:`.completion`), which ends in ``pttl_ms``.
    """

    holder: str
    holder_generation: int
    holder_token: int | None
    pttl_ms: int
    finished: bool = False


@dataclass(frozen=True)
class RateLimited(Contended):
    """The key's rate limit (core/rates.py) allows no start now: the next one is allowed in
    ``pttl_ms`` (when the oldest start in the window leaves it). Nothing was taken or counted.
    ``holder`` and ``holder_generation`` name the last run that started; ``finished`` is True
    (nothing can start before ``pttl_ms``)."""


@dataclass(frozen=True)
class Completed(Contended):
    """The owner's message already ran to its end: its completion record names generation
    ``holder_generation`` (not smaller than the one asking), kept ``pttl_ms`` more. Nothing was
    written. A :class:`Contended` (the lock was not taken) whose holder is the owner itself."""


@dataclass(frozen=True)
class RenewItem:
    """One lock to renew: the key, who must hold it, and the ttl to set.

    ``token`` is the fencing token of the run that holds it: with it, a lock that another run
    of the same owner and generation took (a redelivered copy of the message, after this run's
    lock expired) counts as taken. None: any token.

    Checked when made (``ValueError``), so the stores need not check it at every renewal (the
    renewer makes one per lock and renews it every interval).
    """

    key: str
    owner: str
    generation: int
    ttl_ms: int
    token: int | None = None

    def __post_init__(self) -> None:
        check_owner(self.owner, self.generation)
        check_ttl(self.ttl_ms)

    @functools.cached_property
    def packed(self) -> tuple[bytes, bytes]:
        """Its key, and its owner, generation and token, as renew.lua's arguments on the wire
        (RESP): made once, not at every renewal (docs/performance.md, "Renewal")."""
        token = "" if self.token is None else self.token
        return bulk(self.key), bulk(self.owner) + bulk(self.generation) + bulk(token)


class RenewStatus(enum.IntEnum):
    """What a renewal found."""

    RENEWED = 1
    GONE = 0
    TAKEN = -1
    #: renewed, and a newer call asked the holder to stop (``singleton_on_duplicate="cancel"``)
    STOP_ASKED = 2


class ReleaseStatus(enum.IntEnum):
    """What a release found."""

    RELEASED = 1
    NOT_HELD = 0
    TAKEN = -1
    #: :meth:`LockBackend.release_lost` only: the lock was handed over to a retry, left alone
    HANDED_OVER = 2


class LockBackend(Protocol):
    """Owner-checked acquire, renew and release of locks; what the renewer, the task and the
    beat scheduler ask of a store. Every method raises :class:`LockUnavailableError` when
    Redis could not be asked, ``ValueError`` on a bad argument."""

    @property
    def client(self) -> Client:
        """The client of records kept beside the locks (publish-time markers, tests' cleanup):
        the server, the cluster, or Redlock's first master."""

    def acquire(
        self,
        keys: LockKeys,
        owner: str,
        generation: int,
        ttl_ms: int,
        meta: Mapping[str, str] | None = None,
    ) -> Acquired | Contended:
        """Take ``keys.lock`` for ``owner``; re-enter if an earlier generation of it holds it."""

    def renew(self, items: Sequence[RenewItem]) -> list[RenewStatus]:
        """Renew every item still held by its owner, generation and token; never shortens."""

    def release(
        self,
        key: str,
        owner: str,
        generation: int | None,
        token: int | None = None,
        ending: Ending | None = None,
    ) -> ReleaseStatus:
        """Delete ``key`` if ``owner`` holds it (any generation / token when None); leave what
        ``ending`` says behind (:mod:`.completion`)."""

    def release_lost(
        self, key: str, owner: str, generation: int, at_least_ms: int = 0
    ) -> ReleaseStatus:
        """Delete ``key`` for a holder whose process is gone, unless it was handed over; keep
        it as an at-least window when ``at_least_ms`` says so."""

    def release_many(
        self, items: Sequence[ReleaseItem]
    ) -> list[ReleaseStatus | LockUnavailableError]:
        """Release each item, owner-checked; its status or the error that kept it."""

    def release_ahead(  # noqa: PLR0917 - release's arguments, and the tag
        self,
        key: str,
        owner: str,
        generation: int | None,
        tag: Any,
        token: int | None = None,
        ending: Ending | None = None,
    ) -> bool:
        """Write a release now and read its reply later; False (nothing sent) if it cannot."""

    def collect_released(self) -> list[tuple[Any, ReleaseStatus | LockUnavailableError]]:
        """``(tag, status)`` of every :meth:`release_ahead` not yet collected, in order."""

    def acquire_after(  # noqa: PLR0917 - acquire's positional arguments, after releases
        self,
        releases: Sequence[ReleaseItem],
        keys: LockKeys,
        owner: str,
        generation: int,
        ttl_ms: int,
        meta: Mapping[str, str] | None = None,
    ) -> tuple[list[ReleaseStatus | LockUnavailableError], Acquired | Contended]:
        """:meth:`release_many`, then :meth:`acquire`: the releases land first."""

    def holder(self, key: str) -> dict[str, str]:
        """The lock's hash (owner, gen, token, since, ttl, metadata); empty when free."""

    def run_script(self, lua: Script, args: Sequence[Any]) -> Any:
        """One call of a package script (``_wire.script``) on the records beside the locks
        (publish-time markers): where :attr:`client` sends them, on the store's own connection
        when it has one. Raises Redis's errors."""

    def close(self) -> None:
        """Close the store's connections (a later call connects again); never raises."""


class SequentialReleases:
    """The release batching of a store that cannot write ahead: one release after another.

    For stores whose every call is its own round trip (a cluster, Redlock): nothing is written
    ahead, a batch is released lock by lock, and an acquire after releases makes the releases
    first. Needs ``acquire`` and ``release``.
    """

    def release_ahead(  # noqa: PLR0917 - release's arguments, and the tag
        self,
        key: str,
        owner: str,
        generation: int | None,
        tag: Any,
        token: int | None = None,
        ending: Ending | None = None,
    ) -> bool:
        check_owner(owner, 0 if generation is None else generation)
        return False

    def collect_released(self) -> list[tuple[Any, ReleaseStatus | LockUnavailableError]]:
        return []

    def release_many(
        self: LockBackend, items: Sequence[ReleaseItem]
    ) -> list[ReleaseStatus | LockUnavailableError]:
        check_releases(items)
        outcomes: list[ReleaseStatus | LockUnavailableError] = []
        for item in items:
            try:
                outcomes.append(self.release(*item))
            except LockUnavailableError as exc:
                outcomes.append(exc)
        return outcomes

    def acquire_after(  # noqa: PLR0917 - acquire's positional arguments, after releases
        self: LockBackend,
        releases: Sequence[ReleaseItem],
        keys: LockKeys,
        owner: str,
        generation: int,
        ttl_ms: int,
        meta: Mapping[str, str] | None = None,
    ) -> tuple[list[ReleaseStatus | LockUnavailableError], Acquired | Contended]:
        released = self.release_many(releases) if releases else []
        return released, self.acquire(keys, owner, generation, ttl_ms, meta)


def release_lost_slot(
    store: LockBackend, keys: LockKeys, owner: str, generation: int, at_least_ms: int
) -> tuple[str, ReleaseStatus]:
    """``release_lost`` of the slot ``owner``'s lost run held: the lock itself for one permit;
    with more, each slot in turn (owner-checked: the others are left alone) until the one it
    held. The key it found (or the lock's), and the status: ``TAKEN`` when no slot is the
    run's but another run holds one."""
    status = ReleaseStatus.NOT_HELD
    for key in keys.slots:
        found = store.release_lost(key, owner, generation, at_least_ms)
        if found in (ReleaseStatus.RELEASED, ReleaseStatus.HANDED_OVER):
            return key, found
        if found is ReleaseStatus.TAKEN:
            status = found
    return keys.lock, status


# -- the lock scripts' arguments and replies ------------------------------------------------------


def check_owner(owner: str, generation: int) -> None:
    if not owner:
        raise ValueError("owner must be a non-empty string")
    if generation < 0:
        raise ValueError(f"generation must be >= 0, got {generation!r}")


def check_releases(items: Sequence[ReleaseItem]) -> None:
    """Each release's owner and generation (see :func:`check_owner`)."""
    for item in items:
        check_owner(item[1], 0 if item[2] is None else item[2])


def check_ttl(ttl_ms: int) -> None:
    if ttl_ms <= 0:
        raise ValueError(f"ttl_ms must be positive, got {ttl_ms!r}")


def check_fence_margin(margin_ms: int) -> None:
    if margin_ms < 0:
        raise ValueError(f"fence_margin_ms must be >= 0, got {margin_ms!r}")


def fence_ttl_ms(ttl_ms: int, margin_ms: int) -> int:
    """How long the fencing counter lives after an acquire with ``ttl_ms`` (the scripts add how
    far the token is ahead of the server's clock, after a backward step): the lock's ttl and
    the margin. The one bound a finished run's keys stay within (docs/internals.md)."""
    return ttl_ms + margin_ms


def acquire_args(  # noqa: PLR0917 - acquire.lua's KEYS and ARGV, in order
    keys: LockKeys,
    owner: str,
    generation: int,
    ttl_ms: int,
    fence_margin_ms: int,
    meta: Mapping[str, str] | None,
) -> list[Any]:
    """numkeys, KEYS and ARGV of acquire.lua; the metadata cut to :func:`bounded_meta`."""
    done = done_key(keys.lock, owner)
    fence = fence_ttl_ms(ttl_ms, fence_margin_ms)
    args: list[Any] = [3, keys.lock, keys.fence, done, owner, generation, ttl_ms, fence]
    if meta:
        if (  # C-level checks: a usual call's metadata is short enough whatever its characters
            len(meta) > MAX_META_FIELDS
            or 4 * max(map(len, meta)) > MAX_META_NAME_BYTES
            or 4 * max(map(len, meta.values())) > MAX_META_VALUE_BYTES
        ):
            meta = dict(bounded_meta(meta))
        args += itertools.chain.from_iterable(meta.items())
    return args


def bounded_meta(meta: Mapping[str, str]) -> Iterator[tuple[str, str]]:
    """The first :data:`MAX_META_FIELDS` fields of ``meta``, names and values cut to their
    byte bounds."""
    for name, value in itertools.islice(meta.items(), MAX_META_FIELDS):
        yield cut_utf8(name, MAX_META_NAME_BYTES), cut_utf8(value, MAX_META_VALUE_BYTES)


def cut_utf8(text: str, limit: int) -> str:
    """``text`` if its UTF-8 form fits in ``limit`` bytes, else its longest start that fits
    with "..." after it (never half a character)."""
    if len(text) * 4 <= limit:  # the common case: short enough whatever its characters
        return text
    raw = text.encode("utf-8", "replace")
    if len(raw) <= limit:
        return text
    return raw[: limit - 3].decode("utf-8", "ignore") + "..."


def acquire_outcome(reply: Any, replicas: int | None, owner: str = "") -> Acquired | Contended:
    """acquire.lua's reply: taken, held (by whom), or ``owner``'s message already completed."""
    if reply[0] == 1:
        slot = int(reply[3]) if len(reply) > 3 else 1
        return Acquired(int(reply[1]), bool(reply[2]), replicas, slot)
    if reply[0] == 2:
        return Completed(owner, int(reply[1]), None, int(reply[2]))
    if reply[0] == 3:  # over the rate (acquire_permit.lua)
        return RateLimited(as_text(reply[2]), int(reply[3]), None, max(int(reply[1]), 1), True)
    holder_token = None if reply[3] is None else int(reply[3])
    finished = len(reply) > 5 and reply[5] == 1
    return Contended(as_text(reply[1]), int(reply[2]), holder_token, int(reply[4]), finished)


def release_args(
    key: str,
    owner: str,
    generation: int | None,
    token: int | None = None,
    ending: Ending | None = None,
) -> list[Any]:
    """numkeys, KEYS and ARGV of release.lua (``ReleaseItem`` order). Without a completion
    to record the record's key is the lock's own (declared, never touched): a key that is not a
    lock key of this library then needs no record key of its slot on a cluster."""
    keep = ending is not None and ending.completion_ttl_ms > 0
    return [
        2,
        key,
        done_key(key, owner) if keep else key,
        owner,
        "" if generation is None else generation,
        "" if token is None else token,
        0 if ending is None else ending.completion_ttl_ms,
        0 if ending is None else ending.at_least_ms,
    ]


def release_lost_args(key: str, owner: str, generation: int, at_least_ms: int = 0) -> list[Any]:
    """numkeys, KEYS and ARGV of release_lost.lua."""
    return [1, key, owner, generation, at_least_ms]


def release_outcome(
    item: tuple[str, str] | ReleaseItem, reply: Any
) -> ReleaseStatus | LockUnavailableError:
    if isinstance(reply, Exception):
        return LockUnavailableError(
            f"could not release {item[0]}: {reply}", key=item[0], task_id=item[1]
        )
    return RELEASE_STATUSES[int(reply)]


#: release.lua's replies (a dict lookup: ReleaseStatus(n) goes through the enum machinery)
RELEASE_STATUSES = {status.value: status for status in ReleaseStatus}

#: Most locks one renew.lua call renews: the server runs one script at a time and answers
#: nobody else meanwhile; bigger batches are split into several calls, still one round trip.
RENEW_CHUNK = 1000


def renew_groups(items: Sequence[RenewItem], indexes: Sequence[int]) -> list[list[int]]:
    """``indexes`` in groups of one ttl and at most :data:`RENEW_CHUNK` locks each."""
    by_ttl: dict[int, list[int]] = {}
    for index in indexes:
        ttl = items[index].ttl_ms
        group = by_ttl.get(ttl)
        if group is None:
            group = by_ttl[ttl] = []
        group.append(index)
    return [
        group[start : start + RENEW_CHUNK]
        for group in by_ttl.values()
        for start in range(0, len(group), RENEW_CHUNK)
    ]


def renew_args(items: Sequence[RenewItem], group: Sequence[int]) -> list[Any]:
    """numkeys, KEYS and ARGV of renew.lua for ``items[i]``, ``i`` in ``group`` (one ttl)."""
    args: list[Any] = [len(group)]
    args += [items[index].key for index in group]
    args.append(items[group[0]].ttl_ms)
    for index in group:
        item = items[index]
        args += (item.owner, item.generation, "" if item.token is None else item.token)
    return args


def fill_renewed(statuses: list[Any], indexes: Sequence[int], reply: Any) -> None:
    """Statuses from renew.lua's reply, which lists only the locks it did not renew."""
    for index in indexes:
        statuses[index] = RenewStatus.RENEWED
    fill_failures(statuses, indexes, reply)


def fill_failures(statuses: list[Any], indexes: Sequence[int], reply: Any) -> None:
    """The statuses of the locks renew.lua's reply lists: those it did not renew."""
    for position in range(0, len(reply), 2):
        statuses[indexes[int(reply[position]) - 1]] = RenewStatus(int(reply[position + 1]))
