"""A call's arguments: bound to the task function's signature (which ``key_args`` must name),
and previewed short for log lines and the lock's metadata (the caller's ``argsrepr`` and
``kwargsrepr`` in place of the arguments they mask).

Pure module: it imports neither celery nor redis. :mod:`.keys` derives a call's keys from what
it binds.
"""

from __future__ import annotations

import contextlib
import inspect
import reprlib
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..errors import SingletonConfigError, SingletonError, SingletonKeyError

__all__ = [
    "MAX_PREVIEW_CHARS",
    "Shape",
    "args_preview",
    "bind_arguments",
    "bind_shape",
    "check_key_args",
    "describe_callable",
    "key_arg_names",
    "scope_key_names",
    "shape_of",
]

MAX_PREVIEW_CHARS = 100
"""Longest arguments preview :func:`args_preview` gives."""
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


def args_preview(
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    argsrepr: str | None = None,
    kwargsrepr: str | None = None,
) -> str:
    """A short, human-readable preview of a call's arguments (``reprlib``, at most
    :data:`MAX_PREVIEW_CHARS` characters), e.g. ``(42,) {'full': True}``; never raises.

    ``argsrepr``/``kwargsrepr``: how the caller has Celery show each half (``apply_async``'s
    options of those names, which keep a secret out of logs and monitoring). A half given is
    shown as given, never from the arguments; a half not given (None or empty) is previewed,
    as Celery's own log lines do."""
    if argsrepr or kwargsrepr:
        return _cut(f"{argsrepr or _half(tuple(args))} {kwargsrepr or _half(dict(kwargs))}")
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
    return _cut(text)


def _half(value: tuple[Any, ...] | dict[str, Any]) -> str:
    """The preview of one half of a call (its args, or its kwargs); never raises."""
    try:
        return _preview.repr(value)
    except Exception as exc:
        return f"<unprintable arguments: {type(exc).__name__}>"


def _cut(text: str) -> str:
    """``text`` cut to :data:`MAX_PREVIEW_CHARS` characters."""
    if len(text) > MAX_PREVIEW_CHARS:
        text = text[: MAX_PREVIEW_CHARS - 3] + "..."
    return text


def describe_callable(func: object) -> str:
    name = getattr(func, "__qualname__", None)
    return name if isinstance(name, str) else repr(func)


class Shape:
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
_shapes: weakref.WeakKeyDictionary[Any, dict[Any, Shape]] = weakref.WeakKeyDictionary()


def shape_of(func: Callable[..., Any], error: type[SingletonError]) -> Shape:
    """``func``'s signature and binder, read once per function and cached (~15 us each)."""
    target: Any = getattr(func, "__func__", func) if inspect.ismethod(func) else func
    variant: Any = type(func.__self__) if inspect.ismethod(func) else None
    try:
        return _shapes[target][variant]
    except (KeyError, TypeError):  # not cached yet, or not weakly referenceable
        pass
    try:
        shape = Shape(inspect.signature(func))
    except (TypeError, ValueError) as exc:
        raise error(f"cannot read the signature of {describe_callable(func)}: {exc}") from exc
    with contextlib.suppress(TypeError):  # a callable that cannot be weakly referenced
        _shapes.setdefault(target, {})[variant] = shape
    return shape


def key_arg_names(
    func: Callable[..., Any], signature: inspect.Signature, key_args: Sequence[str] | None
) -> tuple[str, ...] | None:
    if key_args is None:
        return None
    if isinstance(key_args, (str, bytes)):
        raise SingletonConfigError(
            f"key_args of {describe_callable(func)} must be a list of argument names, "
            f"not the single string {key_args!r}"
        )
    names = tuple(key_args)
    for name in names:
        if not isinstance(name, str) or name not in signature.parameters:
            raise SingletonConfigError(
                f"key_args of {describe_callable(func)} names {name!r}, which is not one of its "
                f"parameters {list(signature.parameters)}"
            )
    return names


def check_key_args(func: Callable[..., Any], key_args: Sequence[str] | None) -> None:
    """Raise :class:`SingletonConfigError` unless every name in ``key_args`` is a parameter of
    ``func`` (meant for start-up, so a typo fails before the first task runs)."""
    key_arg_names(func, shape_of(func, SingletonConfigError).signature, key_args)


def scope_key_names(func: Callable[..., Any], key_args: Sequence[str] | None) -> tuple[str, ...]:
    """The argument names a task of a scope keys on, sorted: its ``key_args``, else all its
    parameters. Tasks of one scope must have the same (the worker checks at start), so equal
    values of them give one key whatever each function's parameter order."""
    signature = shape_of(func, SingletonConfigError).signature
    names = key_arg_names(func, signature, key_args)
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
    shape = shape_of(func, SingletonKeyError)
    names = key_arg_names(func, shape.signature, key_args)
    arguments = bind_shape(shape, func, args, kwargs)
    if names is None:
        return arguments
    return {name: arguments[name] for name in names}


def bind_shape(
    shape: Shape, func: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]
) -> dict[str, Any]:
    """Every parameter of ``func`` (``shape``) bound to this call, defaults applied."""
    arguments = shape.bind(args, kwargs)
    if arguments is None:
        try:
            bound = shape.signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise SingletonKeyError(
                f"arguments do not match the signature of {describe_callable(func)}: {exc}"
            ) from exc
        bound.apply_defaults()
        arguments = dict(bound.arguments)
    return arguments
