"""Private key prefixes on the shared Redis: made unique, and every key under one deleted.

The shared Redis is used by others at the same time: a test touches only keys under a prefix of
its own and deletes them with :func:`delete_prefix` (SCAN, never KEYS, never a server-wide
command). The fixtures ``key_prefix`` and ``module_prefix`` (tests/conftest.py) are
:func:`private_prefix` blocks.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import redis

__test__ = False


def new_prefix() -> str:
    """A unique ``cslt:<uuid8>:`` prefix."""
    return f"cslt:{uuid.uuid4().hex[:8]}:"


def delete_prefix(client: redis.Redis, prefix: str) -> int:
    """Delete every key starting with ``prefix`` (SCAN, never KEYS); return how many."""
    deleted = 0
    batch: list[bytes] = []
    for key in client.scan_iter(match=f"{prefix}*", count=1000):
        batch.append(key)
        if len(batch) >= 500:
            deleted += int(client.delete(*batch))
            batch.clear()
    if batch:
        deleted += int(client.delete(*batch))
    return deleted


@contextmanager
def private_prefix(redis_url: str) -> Iterator[str]:
    """A unique ``cslt:<uuid8>:`` prefix; every key under it is deleted on leaving."""
    prefix = new_prefix()
    yield prefix
    client = redis.Redis.from_url(redis_url)
    try:
        delete_prefix(client, prefix)
    finally:
        client.close()
