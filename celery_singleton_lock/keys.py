"""Lock keys: a canonical encoding of a task's arguments and the Redis key names built from it.

Pure module: it imports neither celery nor redis.

A task call is identified by its task name plus an *identity*: either the bound arguments
(``b"a" + canonical_encode({name: value})``) or the string returned by a ``key_fn``
(``b"k" + canonical_encode(text)``). The identity is hashed (blake2b, 16 bytes) and the two keys
of one lock share a Redis Cluster hash tag::

    {prefix}{<safe task name>:<32 hex digest>}:lock
    {prefix}{<safe task name>:<32 hex digest>}:fence
    {prefix}{<safe task name>:<32 hex digest>}:queued   (lock_on "publish"/"both" only)

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

from .errors import SingletonConfigError, SingletonError, SingletonKeyError

__all__ = [
    "MAX_DEPTH",
    "MAX_NAME_CHARS",
    "MAX_PREFIX_CHARS",
    "MAX_PREVIEW_CHARS",
    "LockKeys",
    "args_preview",
    "argument_digest",
    "bind_arguments",
    "canonical_encode",
    "check_key_args",
    "check_prefix",
    "derive_keys",
    "leader_keys",
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

_UNSAFE_NAME_CHARS = re.compile(r"[^A-Za-z0-9_.-]")
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


def args_preview(args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
    """A short, human-readable preview of a call's arguments (``reprlib``, at most
    :data:`MAX_PREVIEW_CHARS` characters), e.g. ``(42,) {'full': True}``; never raises."""
    try:
        text = f"{_preview.repr(tuple(args))} {_preview.repr(dict(kwargs))}"
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


def _encode_arguments(arguments: Mapping[str, Any]) -> bytes:
    """``canonical_encode(dict(arguments))``, but errors name the argument, not ``value``."""
    active: set[int] = set()
    pairs: list[tuple[bytes, bytes]] = []
    for name, value in arguments.items():
        try:
            pairs.append((_encode(name, 1, active), _encode(value, 1, active)))
        except _EncodeError as exc:
            raise _key_error(name, exc) from exc.__cause__
        except RecursionError:
            raise _too_deep(name) from None
    return _encode_dict_pairs(pairs)


def _describe(func: object) -> str:
    name = getattr(func, "__qualname__", None)
    return name if isinstance(name, str) else repr(func)


#: Signatures already read, per function (a bound method is keyed by its function and its
#: class, never by the instance). Weak keys: a function that goes away drops out.
_signatures: weakref.WeakKeyDictionary[Any, dict[Any, inspect.Signature]] = (
    weakref.WeakKeyDictionary()
)


def _signature(func: Callable[..., Any], error: type[SingletonError]) -> inspect.Signature:
    """``inspect.signature(func)``, read once per function and cached (it costs ~15 us)."""
    target: Any = getattr(func, "__func__", func) if inspect.ismethod(func) else func
    variant: Any = type(func.__self__) if inspect.ismethod(func) else None
    try:
        return _signatures[target][variant]
    except (KeyError, TypeError):  # not cached yet, or not weakly referenceable
        pass
    try:
        signature = inspect.signature(func)
    except (TypeError, ValueError) as exc:
        raise error(f"cannot read the signature of {_describe(func)}: {exc}") from exc
    with contextlib.suppress(TypeError):  # a callable that cannot be weakly referenced
        _signatures.setdefault(target, {})[variant] = signature
    return signature


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
    _key_arg_names(func, _signature(func, SingletonConfigError), key_args)


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
    signature = _signature(func, SingletonKeyError)
    names = _key_arg_names(func, signature, key_args)
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as exc:
        raise SingletonKeyError(
            f"arguments do not match the signature of {_describe(func)}: {exc}"
        ) from exc
    bound.apply_defaults()
    arguments = dict(bound.arguments)
    if names is None:
        return arguments
    return {name: arguments[name] for name in names}


def argument_digest(task_name: str, identity: bytes) -> str:
    """32 hex chars: blake2b (16 bytes) over the UTF-8 task name, a NUL byte and ``identity``."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(task_name.encode("utf-8", "surrogatepass"))
    digest.update(b"\0")
    digest.update(identity)
    return digest.hexdigest()


def safe_name(task_name: str) -> str:
    """The readable part of a key: ``[A-Za-z0-9_.-]`` kept, anything else ``_``, cut to
    :data:`MAX_NAME_CHARS` (the digest covers the full name, so this may lose information)."""
    return _UNSAFE_NAME_CHARS.sub("_", task_name[:MAX_NAME_CHARS])


@dataclass(frozen=True)
class LockKeys:
    """The Redis keys of one lock; both share the hash tag ``{name:digest}``."""

    lock: str
    fence: str


def lock_keys(prefix: str, task_name: str, identity: bytes) -> LockKeys:
    """Keys for ``identity`` of ``task_name``: ``{prefix}{name:digest}:lock`` and ``:fence``."""
    tag = f"{{{safe_name(task_name)}:{argument_digest(task_name, identity)}}}"
    return LockKeys(lock=f"{prefix}{tag}:lock", fence=f"{prefix}{tag}:fence")


def queued_key(lock_key: str) -> str:
    """The queued marker beside ``{prefix}{tag}:lock``: ``{prefix}{tag}:queued`` (same slot)."""
    if not lock_key.endswith(":lock"):
        raise ValueError(f"not a lock key: {lock_key!r}")
    return f"{lock_key[: -len(':lock')]}:queued"


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
    if key_fn is not None:
        identity = b"k" + _key_fn_identity(key_fn, args, kwargs)
    else:
        identity = b"a" + _encode_arguments(bind_arguments(func, args, kwargs, key_args))
    return lock_keys(prefix, task_name, identity)
