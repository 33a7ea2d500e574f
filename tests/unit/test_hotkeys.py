"""HotKeys: each key hot for its horizon (or the lock's shorter time to live), at most ``size``
of them, the key seen held longest ago dropped first; expired keys leave the dict, so an
empty dict means "nothing hot" again."""

from __future__ import annotations

import threading

import pytest

from celery_singleton_lock.core.hotkeys import HORIZON_S, SIZE, HotKeys


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_key_is_hot_for_its_horizon_then_gone() -> None:
    clock = Clock()
    hot = HotKeys(horizon_s=1.0, clock=clock)
    assert not hot.entries
    assert not hot.is_hot("a")
    hot.mark("a")
    clock.now += 0.99
    assert hot.is_hot("a")
    clock.now += 0.02
    assert not hot.is_hot("a")
    assert not hot.entries  # forgotten: the strategy's test is an empty dict again


def test_marking_again_refreshes_the_horizon() -> None:
    clock = Clock()
    hot = HotKeys(horizon_s=1.0, clock=clock)
    hot.mark("a")
    clock.now += 0.8
    hot.mark("a")
    clock.now += 0.8
    assert hot.is_hot("a")


def test_the_locks_time_to_live_bounds_the_horizon() -> None:
    clock = Clock()
    hot = HotKeys(horizon_s=1.0, clock=clock)
    hot.mark("window", pttl_ms=300)  # an at-least window ending in 0.3 s
    hot.mark("renewed", pttl_ms=60_000)  # a renewed lock: the horizon
    hot.mark("no expiry", pttl_ms=-1)
    clock.now += 0.31
    assert not hot.is_hot("window")
    assert hot.is_hot("renewed")
    assert hot.is_hot("no expiry")


def test_a_miss_drops_the_expired_keys_seen_longest_ago() -> None:
    clock = Clock()
    hot = HotKeys(horizon_s=1.0, clock=clock)
    hot.mark("old")
    clock.now += 0.5
    hot.mark("newer")
    clock.now += 0.6  # "old" is past its horizon, "newer" is not
    assert not hot.is_hot("another")
    assert list(hot.entries) == ["newer"]


def test_at_most_size_keys_the_one_seen_longest_ago_dropped() -> None:
    hot = HotKeys(size=3, clock=Clock())
    for key in ("a", "b", "c"):
        hot.mark(key)
    hot.mark("a")  # seen again: now the newest
    hot.mark("d")
    assert list(hot.entries) == ["c", "a", "d"]


def test_forget_and_clear() -> None:
    hot = HotKeys(clock=Clock())
    hot.mark("a")
    hot.mark("b")
    hot.forget("a")
    hot.forget("never marked")
    assert list(hot.entries) == ["b"]
    hot.clear()
    assert not hot.entries


def test_defaults_and_checks() -> None:
    hot = HotKeys()
    assert (hot.size, hot.horizon_s) == (SIZE, HORIZON_S)
    with pytest.raises(ValueError, match="positive"):
        HotKeys(size=0)
    with pytest.raises(ValueError, match="positive"):
        HotKeys(horizon_s=0)


def test_marks_from_many_threads_keep_the_bound() -> None:
    """The threads pool reports each run's end in the thread that ran it."""
    hot = HotKeys(size=50)

    def mark(thread: int) -> None:
        for i in range(2000):
            hot.mark(f"{thread}:{i % 80}")
            hot.is_hot(f"{thread}:{i % 7}")

    threads = [threading.Thread(target=mark, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(hot.entries) == 50
