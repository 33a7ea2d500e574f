"""Lock keys: the Redis key names of a call, of a beat run, and the checks of a key and a prefix.

Pure module: it imports neither celery nor redis.

A task call is identified by its task name plus an *identity*: either the bound arguments
(``b"a" + canonical_encode({name: value})``, :mod:`.arguments` binds and :mod:`.encoding`
encodes) or the string returned by a ``key_fn`` (``b"k" + canonical_encode(text)``). The
identity is hashed (blake2b, 16 bytes) and the two keys of one lock share a Redis Cluster hash
tag::

    {prefix}{<safe task name>:<32 hex digest>}:lock
    {prefix}{<safe task name>:<32 hex digest>}:fence
    {prefix}{<safe task name>:<32 hex digest>}:queued   (lock_on "publish" only)

:class:`KeyDeriver` turns one task's calls into these keys, with what does not change from call
to call worked out once. :func:`lock_key_problem` is the inverse check: whether a key (one an
operator typed, or one a SCAN found) is a lock key of this shape under a prefix.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import re
import unicodedata
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import SingletonConfigError, SingletonKeyError
from .arguments import Shape, bind_shape, describe_callable, key_arg_names, shape_of
from .encoding import (
    T_DICT,
    EncodeError,
    canonical_encode,
    encode_value,
    key_error,
    repr_of,
    too_deep_error,
)

__all__ = [
    "MAX_NAME_CHARS",
    "MAX_PREFIX_CHARS",
    "KeyDeriver",
    "LockKeys",
    "argument_digest",
    "beat_entry_key",
    "beat_group_key",
    "beside",
    "beside_run",
    "check_prefix",
    "derive_keys",
    "keys_of",
    "leader_keys",
    "lock_key_problem",
    "lock_keys",
    "queued_key",
    "run_claim_key",
    "safe_name",
]

MAX_NAME_CHARS = 120
"""The readable task-name part of a key is cut to this many characters."""

MAX_PREFIX_CHARS = 64
"""Longest key prefix :func:`check_prefix` accepts."""

#: The characters :func:`safe_name` keeps (a regex character class body).
_SAFE_NAME_CHARS = "A-Za-z0-9_.-"
_UNSAFE_NAME_CHARS = re.compile(f"[^{_SAFE_NAME_CHARS}]")
#: blake2b digest size of :func:`argument_digest`: twice as many lowercase hex digits
_DIGEST_BYTES = 16
_LOCK_SUFFIX = ":lock"
_FENCE_SUFFIX = ":fence"
#: the end of a lock key, or of one of its permit slots
_LOCK_END = re.compile(r":lock(?::[0-9]+)?\Z")
#: What follows the prefix in every key :func:`lock_keys` gives: ``{<safe name>:<digest>}:lock``
#: (a permit slot of a lock taken with permits > 1 adds ``:<slot>``: ``...:lock:2``)
_LOCK_TAIL = re.compile(
    rf"\{{[{_SAFE_NAME_CHARS}]{{0,{MAX_NAME_CHARS}}}:[0-9a-f]{{{2 * _DIGEST_BYTES}}}\}}"
    + re.escape(_LOCK_SUFFIX)
    + r"(?::[1-9][0-9]{0,3})?"
)
#: Most permits one key may have (``singleton_permits``): an acquire reads every slot
MAX_PERMITS = 1000
_FORBIDDEN_PREFIX_CHARS = frozenset("{}*?[]\\")


def argument_digest(task_name: str, identity: bytes) -> str:
    """32 hex chars: blake2b (16 bytes) over the UTF-8 task name, a NUL byte and ``identity``."""
    name = _name_parts(task_name)[1]
    return hashlib.blake2b(name + identity, digest_size=_DIGEST_BYTES).hexdigest()


@functools.lru_cache(maxsize=4096)
def _name_parts(task_name: str) -> tuple[str, bytes]:
    """A task name's readable key part, and its UTF-8 bytes and NUL as the digest starts."""
    safe = _UNSAFE_NAME_CHARS.sub("_", task_name[:MAX_NAME_CHARS])
    return safe, task_name.encode("utf-8", "surrogatepass") + b"\0"


def safe_name(task_name: str) -> str:
    """The readable part of a key: ``[A-Za-z0-9_.-]`` kept, anything else ``_``, cut to
    :data:`MAX_NAME_CHARS` (the digest covers the full name, so this may lose information)."""
    return _name_parts(task_name)[0]


@dataclass(frozen=True)
class LockKeys:
    """The Redis keys of one lock; both share the hash tag ``{name:digest}``.

    ``permits`` > 1: up to that many runs hold the key at once, each in a slot of its own
    (:meth:`slot`: ``{prefix}{tag}:lock:<i>``, an ordinary lock), all fenced by one counter.

    ``rate``: ``(limit, period_ms)``, at most ``limit`` runs of the key start within any
    ``period_ms`` (core/rates.py); with it ``permits`` may be 0: no limit on runs at once, a
    run holds no slot.
    """

    lock: str
    fence: str
    permits: int = 1
    rate: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.permits != 1 and not (1 if self.rate is None else 0) <= self.permits <= MAX_PERMITS:
            raise ValueError(f"permits must be 1 to {MAX_PERMITS}, got {self.permits!r}")

    def slot(self, index: int) -> str:
        """The key of permit slot ``index`` (1 to ``permits``); the lock itself for 1 permit."""
        if self.permits == 1:
            return self.lock
        if not 1 <= index <= self.permits:
            raise ValueError(f"slot must be 1 to {self.permits}, got {index!r}")
        return f"{self.lock}:{index}"

    @property
    def slots(self) -> list[str]:
        """The key of every slot a run may hold: ``[lock]`` for 1 permit, none for 0."""
        return [self.slot(index) for index in range(1, self.permits + 1)]

    def with_permits(self, permits: int) -> LockKeys:
        """These keys, with ``permits`` slots."""
        if permits == self.permits:
            return self
        return LockKeys(self.lock, self.fence, permits, self.rate)

    def with_rate(self, rate: tuple[int, int] | None) -> LockKeys:
        """These keys, under ``rate`` (``(limit, period_ms)``; None: none)."""
        return self if rate == self.rate else LockKeys(self.lock, self.fence, self.permits, rate)


def lock_keys(prefix: str, task_name: str, identity: bytes) -> LockKeys:
    """Keys for ``identity`` of ``task_name``: ``{prefix}{name:digest}:lock`` and ``:fence``."""
    safe, name = _name_parts(task_name)
    return _tagged_keys(f"{prefix}{{{safe}:", name, identity, 1)


def _tagged_keys(
    head: str,
    name: bytes,
    identity: bytes,
    permits: int,
    rate: tuple[int, int] | None = None,
) -> LockKeys:
    """The keys ``{head}<digest>}:lock`` and ``:fence``; ``head`` is ``{prefix}{<safe name>:``
    and ``name`` the task name's bytes as :func:`argument_digest` hashes them."""
    tag = head + hashlib.blake2b(name + identity, digest_size=_DIGEST_BYTES).hexdigest()
    return LockKeys(tag + "}" + _LOCK_SUFFIX, tag + "}" + _FENCE_SUFFIX, permits, rate)


def keys_of(key: str, permits: int = 1) -> LockKeys:
    """The keys of the lock that ``key`` is (``{prefix}{tag}:lock``) or is a permit slot of
    (``...:lock:<i>``), with ``permits`` slots: what a release or the CLI knows of a lock (the
    key it holds) made whole again. ValueError for a key of another shape."""
    match = _LOCK_END.search(key)
    if match is None:
        raise ValueError(f"not a lock key: {key!r}")
    base = key[: match.start()]
    return LockKeys(base + _LOCK_SUFFIX, base + _FENCE_SUFFIX, permits)


def beside(lock_key: str, name: str) -> str:
    """The key ``{prefix}{tag}:<name>`` beside the lock ``{prefix}{tag}:lock`` or one of its
    permit slots ``...:lock:<i>``: the same hash tag, so the same cluster slot, and one key per
    lock whichever slot (a completion record, a pending follow-up). Beside a key of another
    shape (a store's caller may lock any key): ``<key>:<name>``."""
    if lock_key.endswith(_LOCK_SUFFIX):  # a lock key: what the pattern finds there, at less cost
        return f"{lock_key[: -len(_LOCK_SUFFIX)]}:{name}"
    match = _LOCK_END.search(lock_key)
    base = lock_key[: match.start()] if match else lock_key
    return f"{base}:{name}"


def lock_key_problem(prefix: str, key: str) -> str | None:
    """None when ``key`` has the shape of a lock key :func:`lock_keys` gives under ``prefix``
    (``{prefix}{<safe name>:<32 lowercase hex>}:lock``, any task and arguments; a beat
    leader's lease too); else why not, worded to follow "<key> is ...".

    Fencing counters, queued markers, beat claims and every key outside ``prefix`` are not
    lock keys: the ``celery singleton`` command refuses them as locks (a queued marker beside
    a lock key is read as a marker: core/markers.py), and skips them when a SCAN glob (whose
    ``*`` also matches ``}`` and ``:``) finds them.
    """
    if not key.startswith(prefix):
        return f"outside the prefix {prefix!r}"
    if _LOCK_TAIL.fullmatch(key, len(prefix)) is None:
        return (
            f"not a lock key of this library (those read "
            f"{prefix}{{<task name>:<{2 * _DIGEST_BYTES} hex digits>}}{_LOCK_SUFFIX})"
        )
    return None


def queued_key(lock_key: str) -> str:
    """The queued marker beside ``{prefix}{tag}:lock``: ``{prefix}{tag}:queued`` (same slot)."""
    if not lock_key.endswith(_LOCK_SUFFIX):
        raise ValueError(f"not a lock key: {lock_key!r}")
    return f"{lock_key[: -len(_LOCK_SUFFIX)]}:queued"


def run_claim_key(prefix: str, entry_name: str, run_id: str) -> str:
    """Claim key of one scheduled run: ``{prefix}{beat.<entry>:<digest>}:run:<run id>``.

    All runs of one entry share a hash tag, so they live in one Redis Cluster slot."""
    return f"{beat_entry_key(prefix, entry_name)}:run:{run_id}"


def beat_entry_key(prefix: str, entry_name: str, name: str | None = None) -> str:
    """A beat entry's key ``{prefix}{beat.<entry>:<digest>}:<name>`` (its record of runs,
    its pause, an operator's run-now request), in its runs' Redis Cluster slot; without
    ``name``, the part its keys share."""
    tag = f"{{beat.{safe_name(entry_name)}:{argument_digest('beat', entry_name.encode())}}}"
    return f"{prefix}{tag}" if name is None else f"{prefix}{tag}:{name}"


def beside_run(claim_key: str, name: str) -> str:
    """The key ``name`` of the entry whose run is claimed at ``claim_key`` (see
    :func:`beat_entry_key`): the same slot. Beside a key of another shape: ``<key>:<name>``."""
    base, found, _run = claim_key.rpartition(":run:")
    return f"{base}:{name}" if found else f"{claim_key}:{name}"


def beat_group_key(prefix: str, group: str, name: str) -> str:
    """A key of the beat instances of ``group`` (the app's main name) as a whole:
    ``{prefix}{beat-group.<group>:<digest>}:<name>`` (the entries they run, the run-now
    requests)."""
    tag = f"{{beat-group.{safe_name(group)}:{argument_digest('beat-group', group.encode())}}}"
    return f"{prefix}{tag}:{name}"


def leader_keys(prefix: str, group: str) -> LockKeys:
    """The lease of the leader among the beat instances of ``group`` (a lock of its own)."""
    return lock_keys(prefix, "beat-leader", group.encode())


def check_prefix(prefix: str) -> None:
    """Raise :class:`SingletonConfigError` unless ``prefix`` is a str of 1 to
    :data:`MAX_PREFIX_CHARS` characters without ``{ } * ? [ ] \\``, whitespace or control
    (Unicode category C) characters."""
    if not isinstance(prefix, str):
        raise SingletonConfigError(f"key prefix must be a str, not {type(prefix).__qualname__}")
    if not 1 <= len(prefix) <= MAX_PREFIX_CHARS:
        raise SingletonConfigError(
            f"key prefix must have 1 to {MAX_PREFIX_CHARS} characters, "
            f"{repr_of.repr(prefix)} has {len(prefix)}"
        )
    for char in prefix:
        if (
            char in _FORBIDDEN_PREFIX_CHARS
            or char.isspace()
            or unicodedata.category(char).startswith("C")
        ):
            raise SingletonConfigError(
                f"key prefix {prefix!r} contains the forbidden character {char!r} "
                "(no { } * ? [ ] \\, whitespace or control characters)"
            )


def _key_fn_identity(
    key_fn: Callable[[Sequence[Any], Mapping[str, Any]], str],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
) -> bytes:
    try:
        result: object = key_fn(args, kwargs)
    except SingletonKeyError:
        raise
    except Exception as exc:
        raise SingletonKeyError(
            f"key_fn {describe_callable(key_fn)} raised {type(exc).__name__}: {exc}"
        ) from exc
    if not isinstance(result, str):
        raise SingletonKeyError(
            f"key_fn {describe_callable(key_fn)} must return a str, not {type(result).__qualname__}"
        )
    return canonical_encode(result, "key_fn()")


def derive_keys(  # noqa: PLR0917 - the documented positional API
    prefix: str,
    task_name: str,
    func: Callable[..., Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    key_args: Sequence[str] | None = None,
    key_fn: Callable[[Sequence[Any], Mapping[str, Any]], str] | None = None,
) -> LockKeys:
    """The lock keys of one call of ``task_name``.

    With ``key_fn`` (which takes precedence over ``key_args``) the identity is the str it
    returns; otherwise it is the bound arguments (all, or the ``key_args`` subset). Raises
    :class:`SingletonKeyError` when the call cannot be turned into a key.
    """
    return KeyDeriver(prefix, task_name, func, key_args, key_fn).derive(args, kwargs)


class KeyDeriver:
    """:func:`derive_keys` for one task, with what does not change from call to call worked
    out once: the key's head, the parameters keyed on and their encoded names, in the order
    the encoding sorts them. A task keeps one (task/singleton_task.py): a call then costs its
    binding, its
    values' encoding and the digest.

    Raises as :func:`derive_keys`: when made (a ``key_args`` name that is not a parameter, an
    unreadable signature), and from :meth:`derive` (a call that cannot be turned into a key).
    """

    __slots__ = (
        "_arity",
        "_func",
        "_head",
        "_key_fn",
        "_name",
        "_order",
        "_positional",
        "_shape",
        "_start",
        "permits",
        "rate",
    )

    def __init__(  # noqa: PLR0917 - derive_keys' arguments, the permits and the rate
        self,
        prefix: str,
        task_name: str,
        func: Callable[..., Any],
        key_args: Sequence[str] | None = None,
        key_fn: Callable[[Sequence[Any], Mapping[str, Any]], str] | None = None,
        permits: int = 1,
        rate: tuple[int, int] | None = None,
    ) -> None:
        safe, self._name = _name_parts(task_name)
        self._head = f"{prefix}{{{safe}:"
        self._func = func
        self._key_fn = key_fn
        self.permits = permits
        self.rate = rate
        #: (parameter name, its encoding), sorted as the encoding of their dict sorts them
        self._order: tuple[tuple[str, bytes], ...] = ()
        #: (position, name, its encoding) in that order, for a call that gives every parameter
        #: by position; empty when the signature has other kinds of parameters
        self._positional: tuple[tuple[int, str, bytes], ...] = ()
        self._shape = _NO_SHAPE
        #: how many arguments a call gives when it gives every parameter by position (-1: none
        #: can), and the identity's start: the tag and count of the dict of the arguments
        self._arity = -1
        self._start = b""
        if key_fn is not None:  # the signature is never read: key_fn alone makes the key
            return
        shape = self._shape = shape_of(func, SingletonKeyError)
        names = key_arg_names(func, shape.signature, key_args)
        keyed = dict.fromkeys(names if names is not None else shape.signature.parameters)
        encoded = [(name, encode_value(name, 1, set())) for name in keyed]
        self._order = tuple(sorted(encoded, key=_second))
        self._start = b"a%s%d:" % (T_DICT, len(self._order))
        if shape.names:  # all positional-or-keyword (and at least one)
            position = {name: index for index, name in enumerate(shape.names)}
            self._positional = tuple((position[n], n, code) for n, code in self._order)
            self._arity = len(shape.names)

    def derive(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> LockKeys:
        """The lock keys of one call (``derive_keys`` with this task's arguments)."""
        if self._key_fn is not None:
            identity = b"k" + _key_fn_identity(self._key_fn, args, kwargs)
            return _tagged_keys(self._head, self._name, identity, self.permits, self.rate)
        active: set[int] = set()
        parts: list[bytes] = []
        name = ""
        try:
            if not kwargs and len(args) == self._arity:
                for index, name, encoded in self._positional:  # noqa: B007 - in the error
                    parts.append(encoded + encode_value(args[index], 1, active))
            else:  # keywords, defaults, *args or **kwargs: bound as bind_arguments binds
                arguments = bind_shape(self._shape, self._func, args, kwargs)
                for name, encoded in self._order:
                    parts.append(encoded + encode_value(arguments[name], 1, active))
        except EncodeError as exc:
            raise key_error(name, exc) from exc.__cause__
        except RecursionError:
            raise too_deep_error(name) from None
        identity = self._start + b"".join(parts)
        return _tagged_keys(self._head, self._name, identity, self.permits, self.rate)


#: the shape of a KeyDeriver with a key_fn (it binds nothing)
_NO_SHAPE = Shape(inspect.Signature())


def _second(pair: tuple[str, bytes]) -> bytes:
    return pair[1]
