"""The composition matrix's column "a redelivered copy" (tests/support/matrix.py): each policy
and each modifier while the broker hands a waiting call's message out again.

A module of its own, with its own prefix: its worker's Redis broker has a visibility timeout
of 1 s (tests/support/chaos.py ``configure_visibility``), so every message left unacknowledged
for a second (a countdown, an eta, a requeued duplicate, a watch copy, a debounced call's
wait) is handed out again; kombu restores the unacknowledged messages of a whole prefix, which
would redeliver the other matrix module's too. Each waiting call is sent with a countdown
longer than that, and released only once two of its deliveries reached the worker.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.matrix import Cell, cells_of
from tests.support.matrix_run import Beds, CellRun, assert_cells, known_failure
from tests.support.workers import WorkerFactory

QUEUE = "matrix-redelivery"
CELLS = cells_of(event="redelivered")


@pytest.fixture(scope="module")
def beds(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, module_prefix: str
) -> Iterator[Beds]:
    factory = WorkerFactory(
        Path(tmp_path_factory.mktemp("matrix-redelivery")),
        base_env={"SINGLETON_TEST_REDIS_URL": redis_url, "SINGLETON_TEST_PREFIX": module_prefix},
    )
    try:
        made = Beds(
            factory,
            redis_url,
            module_prefix,
            {QUEUE: ("threads", 32)},
            env={"SINGLETON_TEST_VISIBILITY": "1"},
        )
        yield made
        made.close()
    finally:
        factory.close()


def _runs(beds: Beds) -> list[CellRun]:
    return beds.runs("redelivered", CELLS, lambda cell: QUEUE)


@pytest.mark.slow(seconds=15)
def test_a_waiting_calls_message_redelivered(beds: Beds) -> None:
    runs = _runs(beds)
    assert_cells([run for run in runs if run.cell.known_failure is None])


_KNOWN = [
    pytest.param(cell, marks=known_failure(cell), id=cell.id)
    for cell in CELLS
    if cell.known_failure is not None
]

if _KNOWN:  # none while every redelivery cell works

    @pytest.mark.parametrize("cell", _KNOWN)
    def test_a_known_failure(beds: Beds, cell: Cell) -> None:
        """A cell that shows a defect of the library, run with the others."""
        (run,) = [run for run in _runs(beds) if run.cell is cell]
        assert_cells([run])
