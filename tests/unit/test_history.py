"""The mutual-exclusion checker, on hand-made executions."""

from __future__ import annotations

import json

import pytest

from tests.support.history import (
    Execution,
    assert_no_overlap,
    check_history,
    parse_history,
)


def run(
    exec_id: str, start: int, end: int | None, key: str = "k", token: int | str | None = None
) -> Execution:
    """A hand-made execution of ``key`` on worker w, pid 1."""
    return Execution(exec_id, key, token, "w@h", 1, start, end)


def test_disjoint_runs_pass() -> None:
    """Runs of one key one after another report nothing."""
    report = check_history([run("a", 0, 10, token=1), run("b", 20, 30, token=2)])
    assert report.ok
    assert report.overlaps == []
    assert report.token_regressions == []
    assert report.unfinished == []
    assert_no_overlap(report)


def test_overlap_found() -> None:
    """Two runs of one key whose intervals intersect are reported as a pair."""
    a, b = run("a", 0, 10), run("b", 5, 15)
    report = check_history([b, a])
    assert report.overlaps == [(a, b)]
    with pytest.raises(AssertionError, match="OVERLAP"):
        assert_no_overlap(report)


def test_contained_run_overlaps() -> None:
    """A run entirely inside another run's interval overlaps it."""
    a, b, c = run("a", 0, 100), run("b", 10, 20), run("c", 30, 40)
    report = check_history([a, b, c])
    assert report.overlaps == [(a, b), (a, c)]


def test_touching_runs_do_not_overlap() -> None:
    """One run ending at the very microsecond the next starts is fine."""
    report = check_history([run("a", 0, 10), run("b", 10, 20), run("c", 20, 20)])
    assert report.overlaps == []
    assert_no_overlap(report)


def test_other_keys_may_overlap() -> None:
    """Runs of different keys at the same time are not a violation."""
    report = check_history([run("a", 0, 10, key="x"), run("b", 5, 15, key="y")])
    assert report.ok


def test_unfinished_run_is_open_ended() -> None:
    """An unfinished run overlaps every later run of its key and is listed as unfinished."""
    a, b = run("a", 0, None), run("b", 1000, 1010)
    report = check_history([a, b])
    assert report.unfinished == [a]
    assert report.overlaps == [(a, b)]


def test_unfinished_last_run_is_no_overlap() -> None:
    """A lone unfinished run after the others is reported only as unfinished."""
    a, b = run("a", 0, 10), run("b", 20, None)
    report = check_history([a, b])
    assert report.ok
    assert report.unfinished == [b]
    assert_no_overlap(report)
    with pytest.raises(AssertionError, match="UNFINISHED"):
        assert_no_overlap(report, allow_unfinished=False)


def test_token_regression_found() -> None:
    """A token not strictly greater than the previous run's is reported."""
    a, b, c = run("a", 0, 10, token=5), run("b", 20, 30, token=5), run("c", 40, 50, token=3)
    report = check_history([a, b, c])
    assert report.overlaps == []
    assert report.token_regressions == [(a, b), (b, c)]
    with pytest.raises(AssertionError, match="TOKEN REGRESSION"):
        assert_no_overlap(report)
    assert_no_overlap(report, check_tokens=False)


def test_tokens_compared_per_key_and_numerically() -> None:
    """Tokens are compared within one key, as numbers even when stored as digit strings."""
    report = check_history(
        [
            run("a", 0, 10, key="x", token="9"),
            run("b", 20, 30, key="x", token="10"),
            run("c", 25, 35, key="y", token="1"),
            run("d", 40, 50, key="x", token=None),
        ]
    )
    assert report.token_regressions == []


def test_parse_history_folds_events() -> None:
    """Start and end events fold into executions sorted by start; a missing end stays None."""
    events = [
        {"ev": "start", "exec_id": "b", "key": "k", "token": 2, "worker": "w", "pid": 2, "ts": 20},
        {"ev": "start", "exec_id": "a", "key": "k", "token": 1, "worker": "w", "pid": 1, "ts": 10},
        {"ev": "end", "exec_id": "a", "ts": 15},
    ]
    executions = parse_history(json.dumps(e).encode() for e in events)
    assert [(e.exec_id, e.start_us, e.end_us) for e in executions] == [
        ("a", 10, 15),
        ("b", 20, None),
    ]
