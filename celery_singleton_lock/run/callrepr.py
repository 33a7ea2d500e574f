"""A call as Celery shows it: the caller's ``argsrepr``/``kwargsrepr``, read from a request.

Celery's documented way to keep a secret argument out of logs and monitoring is
``apply_async(..., argsrepr=..., kwargsrepr=...)``: two message headers shown in place of the
arguments (Celery computes a half not given from the arguments when it publishes). A secret
masked for Celery is masked for the library too:

- the lock's ``args`` preview (``celery singleton list``/``show``) shows each half given as it
  was given (:func:`preview_of`);
- a message the library publishes again for a call (a requeued duplicate, a coalesced
  duplicate's follow-up) carries the same two (:func:`repr_options`).

On a worker they are fields of the request (a Context, or the dict a worker's tracer gets). An
eager ``apply()`` drops them (Celery builds its request without them): SingletonTask's
``apply`` hands them on in the request's ``headers``, where they are read here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..core.arguments import args_preview

__all__ = ["REPR_OPTIONS", "preview_of", "repr_options", "reprs_of", "request_field"]

#: The ``apply_async`` options (and message headers) that say how Celery shows a call.
REPR_OPTIONS = ("argsrepr", "kwargsrepr")


def request_field(request: Any, name: str) -> Any:
    """A field of a Celery request: a Context, or the dict a worker's tracer gets."""
    return request.get(name) if isinstance(request, dict) else getattr(request, name, None)


def reprs_of(request: Any) -> tuple[str | None, str | None]:
    """``(argsrepr, kwargsrepr)`` of the call of ``request``; None for a half not given."""
    headers = request_field(request, "headers")
    found: list[str | None] = []
    for name in REPR_OPTIONS:
        value = request_field(request, name)
        if value is None and isinstance(headers, Mapping):  # an eager run's
            value = headers.get(name)
        found.append(value if isinstance(value, str) and value else None)
    return found[0], found[1]


def repr_options(request: Any) -> dict[str, str]:
    """The ``apply_async`` options that publish the call of ``request`` shown as it was."""
    argsrepr, kwargsrepr = reprs_of(request)
    options = {}
    if argsrepr is not None:
        options["argsrepr"] = argsrepr
    if kwargsrepr is not None:
        options["kwargsrepr"] = kwargsrepr
    return options


def preview_of(request: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
    """The short preview of the call of ``request`` (core/arguments.py :func:`args_preview`),
    each half the caller gave Celery shown as given."""
    argsrepr, kwargsrepr = reprs_of(request)
    return args_preview(args, kwargs, argsrepr, kwargsrepr)
