"""The order tests run in: the long ones first, so that under pytest-xdist no worker is left
running one long test at the end while the others are idle.

A long test says how long it takes with ``@pytest.mark.slow(seconds=N)`` (its usual wall
time on the 2-core CI machine, setup and teardown included). :func:`longest_first` puts those
first, longest first, the first :data:`INTERLEAVED` of them each followed by one unmarked test,
then the unmarked tests in their collection order (which keeps a module's tests together, so
its module-scoped fixtures are set up a few times only).

Why one unmarked test after each of the first long ones: an xdist worker only starts a test
once it holds the next one as well (``--dist load --maxschedchunk 1`` hands them out one at a
time, but each worker is given two to start with). Without the short one in between, the first
worker would be handed the two longest tests and run them back to back. After that first
handout every worker is given one test each time it finishes one, so the later long tests go
back to back: those of one module with equal lengths stay together, and a worker handed two of
them in a row keeps the module's fixtures (a short test in between tore them down).

Which test a worker gets next (:class:`ModuleAffineScheduling`): the next one of the module it
was last given, while that module has tests left; else the first one, in the order above, of a
module that no other worker is in; else the first one left. A module's tests then mostly run on
one worker, which sets up its module-scoped fixtures (a module's shared Celery workers) once:
handed out in plain order, consecutive tests went to whichever worker was free, and a module of
ten tests set its workers up on up to eight xdist workers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import pytest
from xdist.scheduler import LoadScheduling

__test__ = False

#: the marker's name; it is declared in pyproject.toml
SLOW = "slow"

#: how many long tests get a short one after them: the first handout of two tests per xdist
#: worker, for up to 8 workers
INTERLEAVED = 8

ItemT = TypeVar("ItemT", bound=pytest.Item)


def expected_seconds(item: pytest.Item) -> float:
    """The ``seconds`` of the item's ``slow`` marker, 0.0 for an unmarked test.

    A ``slow`` marker without ``seconds`` is an error: the order depends on it.
    """
    marker = item.get_closest_marker(SLOW)
    if marker is None:
        return 0.0
    seconds = marker.kwargs.get("seconds", marker.args[0] if marker.args else None)
    if not isinstance(seconds, int | float) or seconds <= 0:
        raise pytest.UsageError(
            f"{item.nodeid}: write @pytest.mark.slow(seconds=N), N its usual wall time in seconds"
        )
    return float(seconds)


def longest_first(items: Sequence[ItemT], interleaved: int = INTERLEAVED) -> list[ItemT]:
    """The long tests, longest first, the first ``interleaved`` of them each followed by one
    unmarked test; then the others.

    Stable: tests of equal length keep their collection order.
    """
    seconds = {id(item): expected_seconds(item) for item in items}
    slow = sorted((i for i in items if seconds[id(i)] > 0), key=lambda i: -seconds[id(i)])
    rest = [i for i in items if seconds[id(i)] == 0]
    ordered: list[ItemT] = []
    for index, item in enumerate(slow):
        ordered.append(item)
        if rest and index < interleaved:
            ordered.append(rest.pop())  # from the end: tests/unit, the shortest ones
    return ordered + rest


def pick(
    pending: Sequence[int], module_of: Callable[[int], str], mine: str | None, taken: set[str]
) -> int:
    """The test (an index into ``pending``'s collection) a worker gets next: the first of
    ``pending`` in the module ``mine`` it was last given; else the first in a module not in
    ``taken`` (the modules other workers were last given); else the first."""
    free = None
    for index in pending:
        module = module_of(index)
        if module == mine:
            return index
        if free is None and module not in taken:
            free = index
    return pending[0] if free is None else free


class ModuleAffineScheduling(LoadScheduling):
    """pytest-xdist's ``load`` scheduling (the same number of tests handed out, at the same
    moments), but each test chosen by :func:`pick`."""

    def __init__(self, config: pytest.Config, log: Any = None) -> None:
        super().__init__(config, log)
        self.last_module: dict[Any, str] = {}

    def _send_tests(self, node: Any, num: int) -> None:
        chosen: list[int] = []
        for _ in range(num):
            if not self.pending:
                break
            taken = {module for other, module in self.last_module.items() if other is not node}
            index = pick(self.pending, self._module_of, self.last_module.get(node), taken)
            self.pending.remove(index)
            self.last_module[node] = self._module_of(index)
            chosen.append(index)
        if chosen:
            self.node2pending[node].extend(chosen)
            node.send_runtest_some(chosen)

    def remove_node(self, node: Any) -> str | None:
        self.last_module.pop(node, None)
        return super().remove_node(node)

    def _module_of(self, index: int) -> str:
        return str(self.collection[index]).split("::", 1)[0]
