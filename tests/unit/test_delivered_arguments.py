"""publish.delivered_arguments: the arguments as a worker receives them, and its shortcut for
plain scalars, which must give what a real trip through each serializer gives."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kombu import serialization

from celery_singleton_lock.publish.dedup import delivered_arguments

SERIALIZERS = ["json", "msgpack", "yaml", "pickle"]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.floats(allow_nan=False),
    st.text(max_size=20),
)


def _through(serializer: str, args: Any, kwargs: Any) -> tuple[Any, Any]:
    content_type, encoding, data = serialization.dumps((args, kwargs), serializer)  # type: ignore[no-untyped-call]
    return serialization.loads(data, content_type, encoding, accept=[content_type])  # type: ignore[no-untyped-call,no-any-return]


@pytest.mark.parametrize("serializer", SERIALIZERS)
@settings(max_examples=150, deadline=None)
@given(
    args=st.lists(scalars, max_size=4),
    kwargs=st.dictionaries(st.text(min_size=1, max_size=8), scalars, max_size=3),
)
def test_plain_scalars_are_what_the_serializer_brings_back(
    serializer: str, args: list[Any], kwargs: dict[str, Any]
) -> None:
    got_args, got_kwargs = delivered_arguments(args, kwargs, serializer)
    want_args, want_kwargs = _through(serializer, tuple(args), kwargs)
    assert list(got_args) == list(want_args)
    assert got_kwargs == want_kwargs
    for got, want in zip(got_args, want_args, strict=True):
        assert type(got) is type(want)
    for name, want in want_kwargs.items():
        assert type(got_kwargs[name]) is type(want)


@pytest.mark.parametrize("serializer", ["json", "msgpack", "yaml"])
def test_anything_else_goes_through_the_serializer(serializer: str) -> None:
    """A tuple becomes a list, an int dict key a str (json), an int too big for msgpack is
    refused: the shortcut leaves these to the serializer."""
    args, kwargs = delivered_arguments(((1, 2),), {"d": {1: "x"}}, "json")
    assert args[0] == [1, 2]
    assert kwargs["d"] == {"1": "x"}
    big = 2**70
    if serializer == "msgpack":
        with pytest.raises(Exception, match=r"(?i)int"):
            delivered_arguments((big,), {}, serializer)
    else:
        assert delivered_arguments((big,), {}, serializer)[0][0] == big


def test_nan_is_left_to_the_serializer() -> None:
    args, _ = delivered_arguments((float("nan"),), {}, "json")
    assert math.isnan(args[0])
