"""Lock keys: a canonical encoding of a task's arguments and the Redis key names built from it.

Pure module: it imports neither celery nor redis.

A task call is identified by its task name plus an *identity*: either the bound arguments
(``b"a" + canonical_encode({name: value})``) or the string returned by a ``key_fn``
(``b"k" + canonical_encode(text)``). The identity is hashed (blake2b, 16 bytes) and the two keys
of one lock share a Redis Cluster hash tag::

    {prefix}{<safe task name>:<32 hex digest>}:lock
    {prefix}{<safe task name>:<32 hex digest>}:fence
    {prefix}{<safe task name>:<32 hex digest>}:queued   (lock_on "publish"/"both" only)

:func:`lock_key_problem` is the inverse check: whether a key (one an operator typed, or one a
SCAN found) is a lock key of this shape under a prefix.

The canonical encoding is type-tagged and self-delimiting: every value is one tag byte followed
by a length (atoms) or an element count (compounds) and ``:``. Sets and dicts are sorted by the
encoded bytes of their elements / keys, so the result never depends on ``PYTHONHASHSEED`` or on
insertion order.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import decimal
import enum
import functools
import hashlib
import inspect
import re
import reprlib
import unicodedata
import uuid
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import SingletonConfigError, SingletonError, SingletonKeyError

__all__ = [
    "MAX_DEPTH",
    "MAX_NAME_CHARS",
    "MAX_PREFIX_CHARS",
    "MAX_PREVIEW_CHARS",
    "KeyDeriver",
    "LockKeys",
    "args_preview",
    "argument_digest",
    "bind_arguments",
    "canonical_encode",
    "check_key_args",
    "check_prefix",
    "derive_keys",
    "leader_keys",
    "lock_key_problem",
    "lock_keys",
    "queued_key",
    "run_claim_key",
    "safe_name",
]

MAX_NAME_CHARS = 120
"""The readable task-name part of a key is cut to this many characters."""

MAX_DEPTH = 200
"""Containers (list, tuple, dict, set, enum value) nested deeper than this are rejected."""

MAX_PREFIX_CHARS = 64
"""Longest key prefix :func:`check_prefix` accepts."""

# One tag byte per type. bytes, bytearray and memoryview share a tag; so do set and frozenset.
_T_NONE = b"N"
_T_TRUE = b"T"
_T_FALSE = b"F"
_T_INT = b"i"
_T_FLOAT = b"f"
_T_STR = b"s"
_T_BYTES = b"b"
_T_LIST = b"l"
_T_TUPLE = b"t"
_T_SET = b"S"
_T_DICT = b"d"
_T_UUID = b"u"
_T_DATETIME_NAIVE = b"D"
_T_DATETIME_AWARE = b"Z"
_T_DATE = b"c"
_T_TIME_NAIVE = b"h"
_T_TIME_AWARE = b"H"
_T_TIMEDELTA = b"r"
_T_DECIMAL = b"m"
_T_ENUM = b"e"

MAX_PREVIEW_CHARS = 100
"""Longest arguments preview :func:`args_preview` gives."""

#: The characters :func:`safe_name` keeps (a regex character class body).
_SAFE_NAME_CHARS = "A-Za-z0-9_.-"
_UNSAFE_NAME_CHARS = re.compile(f"[^{_SAFE_NAME_CHARS}]")
#: blake2b digest size of :func:`argument_digest`: twice as many lowercase hex digits
_DIGEST_BYTES = 16
_LOCK_SUFFIX = ":lock"
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
_MAX_PATH_IN_MESSAGE = 200

_repr = reprlib.Repr()
_repr.maxstring = 40
_repr.maxother = 40


class _EncodeError(Exception):
    """Internal: why a value cannot be encoded; path segments are collected while unwinding."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason
        self.segments: list[str] = []  # innermost first

    def path(self, root: str) -> str:
        path = root + "".join(reversed(self.segments))
        if len(path) > _MAX_PATH_IN_MESSAGE:
            half = _MAX_PATH_IN_MESSAGE // 2
            path = f"{path[:half]}...{path[-half:]}"
        return path


def _key_error(argument: str, exc: _EncodeError) -> SingletonKeyError:
    return SingletonKeyError(
        f"cannot encode argument {argument!r} at {exc.path(argument)}: {exc.reason}"
    )


def _too_deep(argument: str) -> SingletonKeyError:
    return SingletonKeyError(
        f"cannot encode argument {argument!r} at {argument}: nested too deeply "
        "(the interpreter's recursion limit was reached)"
    )


_preview = reprlib.Repr()
_preview.maxstring = 24
_preview.maxother = 24
_preview.maxlevel = 2
for _limit in ("maxlist", "maxtuple", "maxdict", "maxset", "maxfrozenset"):
    setattr(_preview, _limit, 4)


#: The longest repr of one value the preview shows whole (reprlib's maxstring and maxother).
_PREVIEW_WHOLE = _preview.maxother

#: Types whose repr the preview shows whole when it is short; reprlib would show the same.
_PLAIN_TYPES = frozenset({int, float, str, bool, type(None)})


def _plain_preview(args: Sequence[Any], kwargs: Mapping[str, Any]) -> str | None:
    """The preview of a call of a few short scalars, built without reprlib (which takes ten
    times longer), or None. Gives exactly what reprlib gives: nothing in it is shortened."""
    limit = _PREVIEW_WHOLE
    if len(args) > 4 or len(kwargs) > 4:  # reprlib's maxtuple and maxdict
        return None
    parts = []
    for value in args:
        if type(value) not in _PLAIN_TYPES:
            return None
        text = repr(value)
        if len(text) > limit:
            return None
        parts.append(text)
    shown = f"({', '.join(parts)},)" if len(parts) == 1 else f"({', '.join(parts)})"
    if not kwargs:
        return shown + " {}"
    items = []
    if any(type(name) is not str for name in kwargs):
        return None
    for name in sorted(kwargs):  # reprlib sorts a dict's keys
        value = kwargs[name]
        if type(value) not in _PLAIN_TYPES:
            return None
        key, text = repr(name), repr(value)
        if len(key) > limit or len(text) > limit:
            return None
        items.append(f"{key}: {text}")
    return f"{shown} {{{', '.join(items)}}}"


def args_preview(args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
    """A short, human-readable preview of a call's arguments (``reprlib``, at most
    :data:`MAX_PREVIEW_CHARS` characters), e.g. ``(42,) {'full': True}``; never raises."""
    if len(args) == 1 and not kwargs and type(args[0]) in _PLAIN_TYPES:  # the most common call
        text = repr(args[0])
        if len(text) <= _PREVIEW_WHOLE:  # as _plain_preview gives it
            return f"({text},) {{}}"
    try:
        text = _plain_preview(args, kwargs) or (
            f"{_preview.repr(tuple(args))} {_preview.repr(dict(kwargs))}"
        )
    except Exception as exc:
        text = f"<unprintable arguments: {type(exc).__name__}>"
    if len(text) > MAX_PREVIEW_CHARS:
        text = text[: MAX_PREVIEW_CHARS - 3] + "..."
    return text


def _atom(tag: bytes, payload: bytes | bytearray) -> bytes:
    return b"%s%d:%s" % (tag, len(payload), payload)


def _int_payload(value: int) -> bytes:
    # hex, not decimal: hex conversion has no int_max_str_digits limit
    return int.__format__(value, "x").encode("ascii")


def _decimal_payload(value: decimal.Decimal) -> bytes:
    if not value.is_finite():
        return decimal.Decimal.__str__(value).encode("ascii")  # NaN, -sNaN12, Infinity, ...
    if value.is_zero():
        return b"0"  # Decimal("-0.00") == Decimal("0")
    sign, digits, exponent = value.as_tuple()
    coefficient = "".join(map(str, digits))
    stripped = coefficient.rstrip("0")
    assert isinstance(exponent, int)
    exponent += len(coefficient) - len(stripped)
    return f"{'-' if sign else ''}{stripped}E{exponent}".encode("ascii")


def _micros(delta: _dt.timedelta) -> int:
    return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds


def _encode_datetime(value: _dt.datetime) -> bytes:
    try:
        if value.utcoffset() is None:
            return _atom(_T_DATETIME_NAIVE, _dt.datetime.isoformat(value).encode("ascii"))
        utc = value.astimezone(_dt.timezone.utc)
    except Exception as exc:
        raise _EncodeError(f"cannot convert datetime to UTC: {type(exc).__name__}: {exc}") from exc
    return _atom(_T_DATETIME_AWARE, _dt.datetime.isoformat(utc).encode("ascii"))


def _encode_time(value: _dt.time) -> bytes:
    try:
        offset = value.utcoffset()
    except Exception as exc:
        raise _EncodeError(f"cannot read time's UTC offset: {type(exc).__name__}: {exc}") from exc
    if offset is None:
        return _atom(_T_TIME_NAIVE, _dt.time.isoformat(value).encode("ascii"))
    # aware times compare equal when their UTC-adjusted times match: encode exactly that
    day_micros = ((value.hour * 60 + value.minute) * 60 + value.second) * 1_000_000
    return _atom(_T_TIME_AWARE, b"%d" % (day_micros + value.microsecond - _micros(offset)))


def _encode(value: object, depth: int, active: set[int]) -> bytes:
    """Encode one value; ``depth`` is the number of containers around it."""
    kind = type(value)
    if kind is int:  # the most common arguments first: what the int and str branches give
        payload = int.__format__(value, "x").encode("ascii")  # type: ignore[arg-type]
        return b"%s%d:%s" % (_T_INT, len(payload), payload)
    if kind is str:
        payload = str.encode(value, "utf-8", "surrogatepass")  # type: ignore[arg-type]
        return b"%s%d:%s" % (_T_STR, len(payload), payload)
    if value is None:
        return _T_NONE
    if isinstance(value, bool):
        return _T_TRUE if value else _T_FALSE
    if isinstance(value, enum.Enum):  # before int and str: IntEnum, StrEnum
        return _encode_container(value, depth, active)
    if isinstance(value, int):
        return _atom(_T_INT, _int_payload(value))
    if isinstance(value, float):
        return _atom(_T_FLOAT, float.__repr__(value).encode("ascii"))
    if isinstance(value, str):
        return _atom(_T_STR, str.encode(value, "utf-8", "surrogatepass"))
    if isinstance(value, (bytes, bytearray)):
        return _atom(_T_BYTES, value)
    if isinstance(value, memoryview):
        try:
            return _atom(_T_BYTES, value.tobytes())
        except ValueError as exc:
            raise _EncodeError(f"unreadable memoryview: {exc}") from exc
    if isinstance(value, (list, tuple, dict, set, frozenset)):
        return _encode_container(value, depth, active)
    if isinstance(value, uuid.UUID):
        return _atom(_T_UUID, value.hex.encode("ascii"))
    if isinstance(value, _dt.datetime):  # before date: datetime is a date
        return _encode_datetime(value)
    if isinstance(value, _dt.date):
        return _atom(_T_DATE, _dt.date.isoformat(value).encode("ascii"))
    if isinstance(value, _dt.time):
        return _encode_time(value)
    if isinstance(value, _dt.timedelta):
        return _atom(_T_TIMEDELTA, b"%d" % _micros(value))
    if isinstance(value, decimal.Decimal):
        return _atom(_T_DECIMAL, _decimal_payload(value))
    raise _EncodeError(f"unsupported type {type(value).__qualname__}")


def _encode_container(value: object, depth: int, active: set[int]) -> bytes:
    if depth >= MAX_DEPTH:
        raise _EncodeError(f"nested too deeply (more than {MAX_DEPTH} levels)")
    ident = id(value)
    if ident in active:
        raise _EncodeError("contains a reference cycle")
    active.add(ident)
    try:
        depth += 1
        if isinstance(value, enum.Enum):
            cls = type(value)
            name = f"{cls.__module__}.{cls.__qualname__}".encode("utf-8", "surrogatepass")
            try:
                encoded_value = _encode(value.value, depth, active)
            except _EncodeError as exc:
                exc.segments.append(".value")
                raise
            return _atom(_T_ENUM, name) + encoded_value
        if isinstance(value, dict):
            return _encode_dict_pairs(_encode_dict_items(dict.items(value), depth, active))
        if isinstance(value, (set, frozenset)):
            elements: list[bytes] = []
            for element in value:
                try:
                    elements.append(_encode(element, depth, active))
                except _EncodeError as exc:
                    exc.segments.append("[<element>]")
                    raise
            elements.sort()
            return b"%s%d:%s" % (_T_SET, len(elements), b"".join(elements))
        assert isinstance(value, (list, tuple))
        if isinstance(value, list):
            tag, items = _T_LIST, list.__iter__(value)
        else:
            tag, items = _T_TUPLE, tuple.__iter__(value)
        parts: list[bytes] = []
        for index, item in enumerate(items):
            try:
                parts.append(_encode(item, depth, active))
            except _EncodeError as exc:
                exc.segments.append(f"[{index}]")
                raise
        return b"%s%d:%s" % (tag, len(parts), b"".join(parts))
    finally:
        active.discard(ident)


def _encode_dict_items(
    items: Iterable[tuple[object, object]], depth: int, active: set[int]
) -> list[tuple[bytes, bytes]]:
    pairs: list[tuple[bytes, bytes]] = []
    for key, item in items:
        try:
            encoded_key = _encode(key, depth, active)
        except _EncodeError as exc:
            exc.segments.append("[<key>]")
            raise
        try:
            pairs.append((encoded_key, _encode(item, depth, active)))
        except _EncodeError as exc:
            exc.segments.append(f"[{_repr.repr(key)}]")
            raise
    return pairs


def _encode_dict_pairs(pairs: list[tuple[bytes, bytes]]) -> bytes:
    pairs.sort()
    body = b"".join(key + item for key, item in pairs)
    return b"%s%d:%s" % (_T_DICT, len(pairs), body)


def canonical_encode(value: object, path: str = "value") -> bytes:
    """Deterministic, type-tagged encoding; equal values of one type give equal bytes, values of
    different types never collide.

    ``path`` names the value in error messages. Raises :class:`SingletonKeyError` for an
    unsupported type, a reference cycle or nesting deeper than :data:`MAX_DEPTH`.
    """
    try:
        return _encode(value, 0, set())
    except _EncodeError as exc:
        raise _key_error(path, exc) from exc.__cause__
    except RecursionError:
        raise _too_deep(path) from None


def _describe(func: object) -> str:
    name = getattr(func, "__qualname__", None)
    return name if isinstance(name, str) else repr(func)


class _Shape:
    """A function's signature, read once, and a fast way to bind calls to it.

    Most task functions take positional-or-keyword parameters only. For those, :meth:`bind`
    binds a call that fits with a few dict operations, about a tenth of what
    ``Signature.bind`` plus ``apply_defaults`` cost; any other call (another kind of parameter,
    or arguments that do not fit) goes through ``Signature.bind``, which also words the error.
    """

    __slots__ = ("defaults", "names", "signature")

    def __init__(self, signature: inspect.Signature) -> None:
        self.signature = signature
        parameters = signature.parameters.values()
        simple = all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in parameters)
        #: the parameter names in order when all are positional-or-keyword, else None
        self.names: tuple[str, ...] | None = tuple(signature.parameters) if simple else None
        #: ``(name, default)`` of the parameters that have a default, in order
        self.defaults = tuple(
            (p.name, p.default) for p in parameters if p.default is not inspect.Parameter.empty
        )

    def bind(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any] | None:
        """``{name: value}`` in signature order, defaults applied, as ``Signature.bind`` and
        ``apply_defaults`` give it; None when the call needs ``Signature.bind``."""
        names = self.names
        if names is None or len(args) > len(names):
            return None
        arguments = dict(zip(names, args, strict=False))  # the rest: keywords, defaults
        if kwargs:
            for name, value in kwargs.items():
                if name in arguments or name not in self.signature.parameters:
                    return None  # given twice, or unknown: Signature.bind says which
                arguments[name] = value
        if len(arguments) < len(names):
            for name, default in self.defaults:
                if name not in arguments:
                    arguments[name] = default
            if len(arguments) < len(names):
                return None  # a required argument is missing
        if kwargs:
            return {name: arguments[name] for name in names}
        return arguments


#: Shapes already read, per function (a bound method is keyed by its function and its class,
#: never by the instance). Weak keys: a function that goes away drops out.
_shapes: weakref.WeakKeyDictionary[Any, dict[Any, _Shape]] = weakref.WeakKeyDictionary()


def _shape(func: Callable[..., Any], error: type[SingletonError]) -> _Shape:
    """``func``'s signature and binder, read once per function and cached (~15 us each)."""
    target: Any = getattr(func, "__func__", func) if inspect.ismethod(func) else func
    variant: Any = type(func.__self__) if inspect.ismethod(func) else None
    try:
        return _shapes[target][variant]
    except (KeyError, TypeError):  # not cached yet, or not weakly referenceable
        pass
    try:
        shape = _Shape(inspect.signature(func))
    except (TypeError, ValueError) as exc:
        raise error(f"cannot read the signature of {_describe(func)}: {exc}") from exc
    with contextlib.suppress(TypeError):  # a callable that cannot be weakly referenced
        _shapes.setdefault(target, {})[variant] = shape
    return shape


def _key_arg_names(
    func: Callable[..., Any], signature: inspect.Signature, key_args: Sequence[str] | None
) -> tuple[str, ...] | None:
    if key_args is None:
        return None
    if isinstance(key_args, (str, bytes)):
        raise SingletonConfigError(
            f"key_args of {_describe(func)} must be a list of argument names, "
            f"not the single string {key_args!r}"
        )
    names = tuple(key_args)
    for name in names:
        if not isinstance(name, str) or name not in signature.parameters:
            raise SingletonConfigError(
                f"key_args of {_describe(func)} names {name!r}, which is not one of its "
                f"parameters {list(signature.parameters)}"
            )
    return names


def check_key_args(func: Callable[..., Any], key_args: Sequence[str] | None) -> None:
    """Raise :class:`SingletonConfigError` unless every name in ``key_args`` is a parameter of
    ``func`` (meant for start-up, so a typo fails before the first task runs)."""
    _key_arg_names(func, _shape(func, SingletonConfigError).signature, key_args)


def scope_key_names(func: Callable[..., Any], key_args: Sequence[str] | None) -> tuple[str, ...]:
    """The argument names a task of a scope keys on, sorted: its ``key_args``, else all its
    parameters. Tasks of one scope must have the same (the worker checks at start), so equal
    values of them give one key whatever each function's parameter order."""
    signature = _shape(func, SingletonConfigError).signature
    names = _key_arg_names(func, signature, key_args)
    return tuple(sorted(names if names is not None else signature.parameters))


def bind_arguments(
    func: Callable[..., Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    key_args: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Bind a call to ``func``'s signature, defaults applied: ``{parameter name: value}``.

    A ``*args`` parameter keeps its tuple, a ``**kwargs`` parameter its dict. With ``key_args``
    only those parameters are returned, in the given order; a name that is not a parameter
    raises :class:`SingletonConfigError`. Arguments that do not fit the signature raise
    :class:`SingletonKeyError` carrying the ``TypeError`` text.
    """
    shape = _shape(func, SingletonKeyError)
    names = _key_arg_names(func, shape.signature, key_args)
    arguments = _bind(shape, func, args, kwargs)
    if names is None:
        return arguments
    return {name: arguments[name] for name in names}


def _bind(
    shape: _Shape, func: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]
) -> dict[str, Any]:
    """Every parameter of ``func`` (``shape``) bound to this call, defaults applied."""
    arguments = shape.bind(args, kwargs)
    if arguments is None:
        try:
            bound = shape.signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise SingletonKeyError(
                f"arguments do not match the signature of {_describe(func)}: {exc}"
            ) from exc
        bound.apply_defaults()
        arguments = dict(bound.arguments)
    return arguments


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
    """

    lock: str
    fence: str
    permits: int = 1

    def __post_init__(self) -> None:
        if self.permits != 1 and not 1 <= self.permits <= MAX_PERMITS:
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
        """The key of every slot a run may hold: ``[lock]`` for 1 permit."""
        return [self.slot(index) for index in range(1, self.permits + 1)]

    def with_permits(self, permits: int) -> LockKeys:
        """These keys, with ``permits`` slots."""
        return self if permits == self.permits else LockKeys(self.lock, self.fence, permits)


def lock_keys(prefix: str, task_name: str, identity: bytes) -> LockKeys:
    """Keys for ``identity`` of ``task_name``: ``{prefix}{name:digest}:lock`` and ``:fence``."""
    safe, name = _name_parts(task_name)
    return _tagged_keys(f"{prefix}{{{safe}:", name, identity, 1)


def _tagged_keys(head: str, name: bytes, identity: bytes, permits: int) -> LockKeys:
    """The keys ``{head}<digest>}:lock`` and ``:fence``; ``head`` is ``{prefix}{<safe name>:``
    and ``name`` the task name's bytes as :func:`argument_digest` hashes them."""
    tag = head + hashlib.blake2b(name + identity, digest_size=_DIGEST_BYTES).hexdigest()
    return LockKeys(tag + "}" + _LOCK_SUFFIX, tag + "}:fence", permits)


def lock_key_problem(prefix: str, key: str) -> str | None:
    """None when ``key`` has the shape of a lock key :func:`lock_keys` gives under ``prefix``
    (``{prefix}{<safe name>:<32 lowercase hex>}:lock``, any task and arguments; a beat
    leader's lease too); else why not, worded to follow "<key> is ...".

    Fencing counters, queued markers, beat claims and every key outside ``prefix`` are not
    lock keys: the ``celery singleton`` command refuses them, and skips them when a SCAN glob
    (whose ``*`` also matches ``}`` and ``:``) finds them.
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
    tag = f"{{beat.{safe_name(entry_name)}:{argument_digest('beat', entry_name.encode())}}}"
    return f"{prefix}{tag}:run:{run_id}"


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
            f"{_repr.repr(prefix)} has {len(prefix)}"
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
            f"key_fn {_describe(key_fn)} raised {type(exc).__name__}: {exc}"
        ) from exc
    if not isinstance(result, str):
        raise SingletonKeyError(
            f"key_fn {_describe(key_fn)} must return a str, not {type(result).__qualname__}"
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
    the encoding sorts them. A task keeps one (task.py): a call then costs its binding, its
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
    )

    def __init__(  # noqa: PLR0917 - derive_keys' arguments, and the permits
        self,
        prefix: str,
        task_name: str,
        func: Callable[..., Any],
        key_args: Sequence[str] | None = None,
        key_fn: Callable[[Sequence[Any], Mapping[str, Any]], str] | None = None,
        permits: int = 1,
    ) -> None:
        safe, self._name = _name_parts(task_name)
        self._head = f"{prefix}{{{safe}:"
        self._func = func
        self._key_fn = key_fn
        self.permits = permits
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
        shape = self._shape = _shape(func, SingletonKeyError)
        names = _key_arg_names(func, shape.signature, key_args)
        keyed = dict.fromkeys(names if names is not None else shape.signature.parameters)
        encoded = [(name, _encode(name, 1, set())) for name in keyed]
        self._order = tuple(sorted(encoded, key=_second))
        self._start = b"a%s%d:" % (_T_DICT, len(self._order))
        if shape.names:  # all positional-or-keyword (and at least one)
            position = {name: index for index, name in enumerate(shape.names)}
            self._positional = tuple((position[n], n, code) for n, code in self._order)
            self._arity = len(shape.names)

    def derive(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> LockKeys:
        """The lock keys of one call (``derive_keys`` with this task's arguments)."""
        if self._key_fn is not None:
            identity = b"k" + _key_fn_identity(self._key_fn, args, kwargs)
            return _tagged_keys(self._head, self._name, identity, self.permits)
        active: set[int] = set()
        parts: list[bytes] = []
        name = ""
        try:
            if not kwargs and len(args) == self._arity:
                for index, name, encoded in self._positional:  # noqa: B007 - in the error
                    parts.append(encoded + _encode(args[index], 1, active))
            else:  # keywords, defaults, *args or **kwargs: bound as bind_arguments binds
                arguments = _bind(self._shape, self._func, args, kwargs)
                for name, encoded in self._order:
                    parts.append(encoded + _encode(arguments[name], 1, active))
        except _EncodeError as exc:
            raise _key_error(name, exc) from exc.__cause__
        except RecursionError:
            raise _too_deep(name) from None
        identity = self._start + b"".join(parts)
        return _tagged_keys(self._head, self._name, identity, self.permits)


#: the shape of a KeyDeriver with a key_fn (it binds nothing)
_NO_SHAPE = _Shape(inspect.Signature())


def _second(pair: tuple[str, bytes]) -> bytes:
    return pair[1]
