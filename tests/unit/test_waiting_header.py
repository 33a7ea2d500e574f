"""The header a requeued duplicate carries: since when it waits, for this retries count only."""

from __future__ import annotations

import time

from celery.app.task import Context

from celery_singleton_lock.duplicates.copies import WAITING_HEADER, waited
from celery_singleton_lock.duplicates.copies import waiting_since as _waiting_since


def test_no_header_no_wait() -> None:
    assert _waiting_since(Context(retries=0)) is None
    assert waited(Context(retries=0)) is None


def test_header_of_this_retries_count_gives_the_wait() -> None:
    since = time.time() - 2.5
    request = Context({WAITING_HEADER: [since, 1]}, retries=1)
    assert _waiting_since(request) == [since, 1]
    wait = waited(request)
    assert wait is not None
    assert wait >= 2.5


def test_header_carried_along_by_a_later_retry_is_ignored() -> None:
    """self.retry() copies custom headers into the retried message (retries + 1): that message
    did not wait as a duplicate."""
    request = Context({WAITING_HEADER: [time.time() - 60, 0]}, retries=1)
    assert _waiting_since(request) is None
    assert waited(request) is None


def test_a_clock_behind_never_gives_a_negative_wait() -> None:
    """The first requeue's worker's clock may be ahead of this one's."""
    request = Context({WAITING_HEADER: [time.time() + 30, 0]}, retries=0)
    assert waited(request) == 0.0


def test_malformed_header_is_no_wait() -> None:
    for value in ("soon", [1.0], None, {"since": 1}, ["a", "b"], [None, 0]):
        assert _waiting_since(Context({WAITING_HEADER: value}, retries=0)) is None
