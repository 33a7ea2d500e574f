"""Unit tests for what the lock store writes to the wire for a renewal, and RenewItem's checks."""

from __future__ import annotations

import hiredis
import pytest
from redis.connection import Encoder, PythonRespSerializer

from celery_singleton_lock.core.backend import RenewItem, renew_args
from celery_singleton_lock.core.store import _RenewCall

SHA = "0123456789abcdef0123456789abcdef01234567"


def _items() -> list[RenewItem]:
    return [
        RenewItem("p:{t.a:1}:lock", "3f2b-task-id", 0, 30_000),
        RenewItem("p:{t.a:2}:lock", "übergabe-ñ", 12, 30_000),
        RenewItem("p:{t.b:3}:lock", "x", 3, 30_000),
    ]


@pytest.mark.parametrize("group", [[0], [0, 1, 2], [2, 0]])
def test_packed_renew_call_is_what_redis_py_would_send(group: list[int]) -> None:
    """The pre-packed EVALSHA equals redis-py's packing (hiredis and pure Python) of the args."""
    items = _items()
    args = ("EVALSHA", SHA, *renew_args(items, group))
    packed = _RenewCall(SHA, items, group)()
    assert packed == hiredis.pack_command(args)
    python = PythonRespSerializer(6000, Encoder("utf-8", "strict", False).encode)
    assert packed == b"".join(python.pack(*args))


@pytest.mark.parametrize(
    ("owner", "generation", "ttl_ms"), [("", 0, 1000), ("o", -1, 1000), ("o", 0, 0)]
)
def test_renew_item_is_checked_when_made(owner: str, generation: int, ttl_ms: int) -> None:
    """An empty owner, a negative generation or a ttl not above 0 is refused at once."""
    with pytest.raises(ValueError, match=r"owner|generation|ttl_ms"):
        RenewItem("k", owner, generation, ttl_ms)
