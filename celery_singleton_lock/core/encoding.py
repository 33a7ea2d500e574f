"""The canonical encoding of values: equal arguments give equal bytes, whatever their type's hash.

Pure module: it imports neither celery nor redis. :mod:`.keys` hashes these bytes into key names.

The encoding is type-tagged and self-delimiting: every value is one tag byte followed by a length
(atoms) or an element count (compounds) and ``:``. Sets and dicts are sorted by the encoded bytes
of their elements / keys, so the result never depends on ``PYTHONHASHSEED`` or on insertion
order. The bytes are part of every key: they never change between releases
(``tests/unit/test_keys.py`` pins them).
"""

from __future__ import annotations

import datetime as _dt
import decimal
import enum
import reprlib
import uuid
from collections.abc import Iterable

from ..errors import SingletonKeyError

__all__ = [
    "MAX_DEPTH",
    "T_DICT",
    "EncodeError",
    "canonical_encode",
    "encode_value",
    "key_error",
    "repr_of",
    "too_deep_error",
]

MAX_DEPTH = 200
"""Containers (list, tuple, dict, set, enum value) nested deeper than this are rejected."""

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
T_DICT = b"d"
_T_UUID = b"u"
_T_DATETIME_NAIVE = b"D"
_T_DATETIME_AWARE = b"Z"
_T_DATE = b"c"
_T_TIME_NAIVE = b"h"
_T_TIME_AWARE = b"H"
_T_TIMEDELTA = b"r"
_T_DECIMAL = b"m"
_T_ENUM = b"e"

_MAX_PATH_IN_MESSAGE = 200

repr_of = reprlib.Repr()
repr_of.maxstring = 40
repr_of.maxother = 40


class EncodeError(Exception):
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


def key_error(argument: str, exc: EncodeError) -> SingletonKeyError:
    return SingletonKeyError(
        f"cannot encode argument {argument!r} at {exc.path(argument)}: {exc.reason}"
    )


def too_deep_error(argument: str) -> SingletonKeyError:
    return SingletonKeyError(
        f"cannot encode argument {argument!r} at {argument}: nested too deeply "
        "(the interpreter's recursion limit was reached)"
    )


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
        raise EncodeError(f"cannot convert datetime to UTC: {type(exc).__name__}: {exc}") from exc
    return _atom(_T_DATETIME_AWARE, _dt.datetime.isoformat(utc).encode("ascii"))


def _encode_time(value: _dt.time) -> bytes:
    try:
        offset = value.utcoffset()
    except Exception as exc:
        raise EncodeError(f"cannot read time's UTC offset: {type(exc).__name__}: {exc}") from exc
    if offset is None:
        return _atom(_T_TIME_NAIVE, _dt.time.isoformat(value).encode("ascii"))
    # aware times compare equal when their UTC-adjusted times match: encode exactly that
    day_micros = ((value.hour * 60 + value.minute) * 60 + value.second) * 1_000_000
    return _atom(_T_TIME_AWARE, b"%d" % (day_micros + value.microsecond - _micros(offset)))


def encode_value(value: object, depth: int, active: set[int]) -> bytes:
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
            raise EncodeError(f"unreadable memoryview: {exc}") from exc
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
    raise EncodeError(f"unsupported type {type(value).__qualname__}")


def _encode_container(value: object, depth: int, active: set[int]) -> bytes:
    if depth >= MAX_DEPTH:
        raise EncodeError(f"nested too deeply (more than {MAX_DEPTH} levels)")
    ident = id(value)
    if ident in active:
        raise EncodeError("contains a reference cycle")
    active.add(ident)
    try:
        depth += 1
        if isinstance(value, enum.Enum):
            cls = type(value)
            name = f"{cls.__module__}.{cls.__qualname__}".encode("utf-8", "surrogatepass")
            try:
                encoded_value = encode_value(value.value, depth, active)
            except EncodeError as exc:
                exc.segments.append(".value")
                raise
            return _atom(_T_ENUM, name) + encoded_value
        if isinstance(value, dict):
            return _encode_dict_pairs(_encode_dict_items(dict.items(value), depth, active))
        if isinstance(value, (set, frozenset)):
            elements: list[bytes] = []
            for element in value:
                try:
                    elements.append(encode_value(element, depth, active))
                except EncodeError as exc:
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
                parts.append(encode_value(item, depth, active))
            except EncodeError as exc:
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
            encoded_key = encode_value(key, depth, active)
        except EncodeError as exc:
            exc.segments.append("[<key>]")
            raise
        try:
            pairs.append((encoded_key, encode_value(item, depth, active)))
        except EncodeError as exc:
            exc.segments.append(f"[{repr_of.repr(key)}]")
            raise
    return pairs


def _encode_dict_pairs(pairs: list[tuple[bytes, bytes]]) -> bytes:
    pairs.sort()
    body = b"".join(key + item for key, item in pairs)
    return b"%s%d:%s" % (T_DICT, len(pairs), body)


def canonical_encode(value: object, path: str = "value") -> bytes:
    """Deterministic, type-tagged encoding; equal values of one type give equal bytes, values of
    different types never collide.

    ``path`` names the value in error messages. Raises :class:`SingletonKeyError` for an
    unsupported type, a reference cycle or nesting deeper than :data:`MAX_DEPTH`.
    """
    try:
        return encode_value(value, 0, set())
    except EncodeError as exc:
        raise key_error(path, exc) from exc.__cause__
    except RecursionError:
        raise too_deep_error(path) from None
