"""Cluster-wide rate limits of a key: at most N runs start within any window of a period (a
sliding window), counted across every worker in the acquire's one script call
(acquire_permit.lua, which takes the key's slot, if any, in the same call).

A key's rate record is a sorted set beside its lock (``{prefix}{tag}:rate``, the lock's hash
slot): one small entry per start within the last period (``owner:generation``, scored by the
start's server time in ms), so at most N entries, and it expires one period after the last
start. Knows nothing of Celery.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from . import _wire
from .keys import beside

__all__ = ["MAX_RATE_LIMIT", "PERIODS_S", "parse_rate", "rate_key", "starts"]

#: The periods a rate may name, as Celery spells ``rate_limit``: per second, minute, hour.
PERIODS_S = {"s": 1, "m": 60, "h": 3600}
#: Most starts one rate allows per period: the rate record keeps one entry per start.
MAX_RATE_LIMIT = 10_000
_RATE = re.compile(r"\s*([0-9]+)\s*/\s*([smh])\s*")


def parse_rate(value: Any) -> tuple[int, int]:
    """``"N/s"``, ``"N/m"`` or ``"N/h"`` (an int N: per second, as Celery reads ``rate_limit``)
    as ``(N, period_ms)``; ValueError for anything else, or N outside 1 to
    :data:`MAX_RATE_LIMIT`."""
    if isinstance(value, int) and not isinstance(value, bool):
        limit, period = value, "s"
    else:
        match = _RATE.fullmatch(value) if isinstance(value, str) else None
        if match is None:
            raise ValueError('a rate is "N/s", "N/m" or "N/h" (N runs per second, minute, hour)')
        limit, period = int(match[1]), match[2]
    if not 1 <= limit <= MAX_RATE_LIMIT:
        raise ValueError(f"a rate's N must be 1 to {MAX_RATE_LIMIT}")
    return limit, PERIODS_S[period] * 1000


def rate_key(lock_key: str) -> str:
    """The rate record of the lock ``lock_key`` (or of one of its permit slots)."""
    return beside(lock_key, "rate")


def starts(client: Any, lock_key: str) -> Mapping[str, int]:
    """The starts a key's rate record holds: ``owner:generation`` -> server time in ms (starts
    older than one period may linger until the next acquire trims them)."""
    pairs = client.zrange(rate_key(lock_key), 0, -1, withscores=True)
    return {_wire.as_text(member): int(score) for member, score in pairs}
