"""The suite's own test order (tests/support/scheduling.py): long tests first, a short one after
each of the first ones."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.scheduling import expected_seconds, longest_first, pick


class FakeItem:
    """What longest_first reads of a pytest.Item: its node id and its closest marker."""

    def __init__(self, nodeid: str, *args: Any, **kwargs: Any) -> None:
        self.nodeid = nodeid
        self.marker = pytest.mark.slow(*args, **kwargs).mark if (args or kwargs) else None

    def get_closest_marker(self, name: str) -> pytest.Mark | None:
        return self.marker if name == "slow" else None

    def __repr__(self) -> str:
        return self.nodeid


def names(items: list[Any]) -> list[str]:
    return [item.nodeid for item in items]


def test_long_tests_come_first_each_followed_by_a_short_one() -> None:
    items: list[Any] = [
        FakeItem("a"),
        FakeItem("load", seconds=190),
        FakeItem("b"),
        FakeItem("beat", seconds=80),
        FakeItem("c"),
        FakeItem("chaos", seconds=32),
        FakeItem("d"),
    ]
    # the short ones are taken from the end of the collection (tests/unit comes last)
    assert names(longest_first(items)) == ["load", "d", "beat", "c", "chaos", "b", "a"]


def test_only_the_first_long_tests_are_followed_by_a_short_one() -> None:
    items: list[Any] = [
        FakeItem("a"),
        FakeItem("m1", seconds=12),
        FakeItem("load", seconds=190),
        FakeItem("m2", seconds=12),
        FakeItem("b"),
        FakeItem("beat", seconds=80),
        FakeItem("c"),
    ]
    # after the first two, the long ones back to back: m1 and m2 (one module) stay together
    ordered = ["load", "c", "beat", "b", "m1", "m2", "a"]
    assert names(longest_first(items, interleaved=2)) == ordered


def test_equal_lengths_keep_their_order_and_nothing_is_lost() -> None:
    items: list[Any] = [FakeItem("x", seconds=5), FakeItem("y", seconds=5), FakeItem("z", 5)]
    assert names(longest_first(items)) == ["x", "y", "z"]
    assert longest_first([]) == []


def test_seconds_must_be_given() -> None:
    assert expected_seconds(FakeItem("plain")) == 0.0
    assert expected_seconds(FakeItem("positional", 12.5)) == 12.5
    with pytest.raises(pytest.UsageError, match=r"slow\(seconds=N\)"):
        expected_seconds(FakeItem("bare", reason="no number"))
    with pytest.raises(pytest.UsageError):
        expected_seconds(FakeItem("zero", seconds=0))


def test_a_worker_stays_in_its_module_then_takes_one_no_other_worker_is_in() -> None:
    """pick: the next test of the module the worker was last given; else the first of a module
    no other worker was last given; else the first left (a module shared at the end)."""
    modules = ["a", "b", "a", "c", "b", "c"]
    pending = list(range(len(modules)))

    def module_of(index: int) -> str:
        return modules[index]

    assert pick(pending, module_of, mine="c", taken={"a"}) == 3
    assert pick(pending, module_of, mine=None, taken={"a"}) == 1
    assert pick(pending, module_of, mine="a", taken={"b"}) == 0
    assert pick(pending, module_of, mine="d", taken={"a", "b", "c"}) == 0
    assert pick([4, 5], module_of, mine="a", taken={"b"}) == 5
