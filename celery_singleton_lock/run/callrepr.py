"""A call as Celery shows it: the caller's ``argsrepr``/``kwargsrepr``, read from a request.

Celery's documented way to keep a secret argument out of logs and monitoring is
``apply_async(..., argsrepr=..., kwargsrepr=...)``: two message headers shown in place of the
arguments (Celery computes a half not given from the arguments when it publishes). A secret
masked for Celery is masked for the library too:

- the lock's ``args`` preview (``celery singleton list``/``show``) shows each half given as it
  was given (:func:`preview_of`);
- a message the library publishes again for a call (a requeued duplicate, a joined call's
  watch copy, a retry's hand-over) carries the same two, and the message's serializer
  (:func:`copy_options`); a coalesced duplicate's follow-up carries them from its record.

On a worker they are fields of the request (a Context, or the dict a worker's tracer gets). An
eager ``apply()`` drops them (Celery builds its request without them): SingletonTask's
``apply`` hands them on in the request's ``headers``, where they are read here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kombu.serialization import registry

from ..core.arguments import args_preview

__all__ = [
    "CONTENT_TYPE_FIELD",
    "REPR_OPTIONS",
    "copy_options",
    "preview_of",
    "reprs_of",
    "request_field",
]

#: The ``apply_async`` options (and message headers) that say how Celery shows a call.
REPR_OPTIONS = ("argsrepr", "kwargsrepr")

#: Request field: the content type of the message (``application/json``, ...), written by the
#: worker's main process (worker/hooks.py ``SingletonRequest``): Celery's request does not carry
#: it to the pool.
CONTENT_TYPE_FIELD = "singleton_content_type"


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


def copy_options(request: Any) -> dict[str, str]:
    """The ``apply_async`` options that publish a copy of the message of ``request`` shown as
    it was, and in the serializer it came in (a call sent in pickle to a json task may carry
    what json cannot write): see :data:`CONTENT_TYPE_FIELD`."""
    argsrepr, kwargsrepr = reprs_of(request)
    options = {}
    if argsrepr is not None:
        options["argsrepr"] = argsrepr
    if kwargsrepr is not None:
        options["kwargsrepr"] = kwargsrepr
    serializer = registry.type_to_name.get(request_field(request, CONTENT_TYPE_FIELD))
    if serializer is not None:
        options["serializer"] = serializer
    return options


def preview_of(request: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
    """The short preview of the call of ``request`` (core/arguments.py :func:`args_preview`),
    each half the caller gave Celery shown as given."""
    argsrepr, kwargsrepr = reprs_of(request)
    return args_preview(args, kwargs, argsrepr, kwargsrepr)
