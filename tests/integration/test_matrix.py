"""The library's features together, on real workers: each duplicate policy with each modifier,
each policy and each modifier meeting each event a waiting call can meet (but a redelivered
copy: tests/integration/test_matrix_redelivery.py), and the combinations refused at worker
start. The cells are declared in tests/support/matrix.py (docs/compatibility.md's tables
follow them); their scenarios and checks are in tests/support/matrix_run.py.

Two workers serve the module: a threads worker for most cells, a prefork worker for the cells
that kill the pool child running a holder. Each test runs its cells at once, each on keys of
its own; a known failure of a cell is a test of its own, marked xfail, reading the same run.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support.matrix import Cell, cells_of, refused_cells
from tests.support.matrix_app import MATRIX_APP, go_key
from tests.support.matrix_run import Beds, CellRun, assert_cells, known_failure
from tests.support.waiting import wait_for
from tests.support.workers import WorkerFactory

THREADS = "matrix"
PREFORK = "matrix-prefork"
INVALID = "celery_singleton_lock: invalid setting: "

#: the sets of cells run together, each by a test of its own
GROUPS = {
    "PxM": cells_of(table="PxM"),
    "revoke": cells_of(event="revoke"),
    "expires": cells_of(event="expires"),
    "kill": cells_of(event="kill"),
    "refused_retry": cells_of(event="refused_retry"),
}


def _queue(cell: Cell) -> str:
    return PREFORK if cell.event == "kill" else THREADS


@pytest.fixture(scope="module")
def factory(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, module_prefix: str
) -> Iterator[WorkerFactory]:
    made = WorkerFactory(
        Path(tmp_path_factory.mktemp("matrix")),
        base_env={"SINGLETON_TEST_REDIS_URL": redis_url, "SINGLETON_TEST_PREFIX": module_prefix},
    )
    yield made
    made.close()


@pytest.fixture(scope="module")
def beds(factory: WorkerFactory, redis_url: str, module_prefix: str) -> Iterator[Beds]:
    made = Beds(
        factory,
        redis_url,
        module_prefix,
        {THREADS: ("threads", 48), PREFORK: ("prefork", 16)},
    )
    yield made
    made.close()


def _group(beds: Beds, name: str) -> list[CellRun]:
    return beds.runs(name, GROUPS[name], _queue)


def _expected_to_work(runs: list[CellRun]) -> list[CellRun]:
    return [run for run in runs if run.cell.known_failure is None]


@pytest.mark.slow(seconds=15)
def test_each_policy_with_each_modifier(beds: Beds) -> None:
    """P x M: a holder, duplicates meanwhile (and, with a rate or a window, one after it)."""
    assert_cells(_expected_to_work(_group(beds, "PxM")))


@pytest.mark.slow(seconds=8)
def test_a_waiting_call_revoked(beds: Beds) -> None:
    """``app.control.revoke()`` of the call that waits, acknowledged before the holder ends."""
    assert_cells(_expected_to_work(_group(beds, "revoke")))


@pytest.mark.slow(seconds=8)
def test_a_waiting_call_whose_expires_passes(beds: Beds) -> None:
    """The waiting call's ``expires`` passes before the holder ends."""
    assert_cells(_expected_to_work(_group(beds, "expires")))


@pytest.mark.slow(seconds=8)
def test_the_holders_pool_child_killed(beds: Beds) -> None:
    """SIGKILL of the prefork child running the holder, while a call waits."""
    assert_cells(_expected_to_work(_group(beds, "kill")))


@pytest.mark.slow(seconds=8)
def test_the_holders_retry_refused(beds: Beds) -> None:
    """The holder asks for a retry that ``max_retries=0`` refuses: it fails, a call waits."""
    assert_cells(_expected_to_work(_group(beds, "refused_retry")))


_KNOWN = [
    pytest.param(name, cell, marks=known_failure(cell), id=cell.id)
    for name, cells in GROUPS.items()
    for cell in cells
    if cell.known_failure is not None
]

if _KNOWN:  # none once every defect the matrix shows is fixed

    @pytest.mark.slow(seconds=8)
    @pytest.mark.parametrize(("group", "cell"), _KNOWN)
    def test_a_known_failure(beds: Beds, group: str, cell: Cell) -> None:
        """A cell that shows a defect of the library, run with the others of its group."""
        (run,) = [run for run in _group(beds, group) if run.cell is cell]
        assert_cells([run])


@pytest.mark.slow(seconds=3)
def test_refused_combinations_stop_the_worker_at_start(factory: WorkerFactory) -> None:
    """A worker whose app holds only a refused cell's task exits at start, with one line naming
    both settings."""
    started = [
        (
            cell,
            factory.start(MATRIX_APP, concurrency=1, env={"SINGLETON_TEST_MATRIX_ONLY": cell.id}),
        )
        for cell in refused_cells()
    ]
    for cell, worker in started:
        code = worker.wait(timeout=60)
        log = worker.log_text()
        assert code != 0, log
        lines = [line for line in log.splitlines() if INVALID in line]
        assert len(lines) == 1, log
        assert f"task {cell.task}:" in lines[0], lines[0]
        for setting in cell.refused:
            assert setting in lines[0], (cell.id, lines[0])
        assert " ready." not in log
        assert "Traceback" not in log


@pytest.mark.parametrize("policy", ["skip", "raise"])
def test_a_copy_of_a_duplicate_that_ended_is_dropped_not_run(beds: Beds, policy: str) -> None:
    """A regression the redelivery column found (a copy of a skipped duplicate's eta message
    that Redis handed out again ran once the holder had ended): a duplicate sent with a
    countdown, skipped or raised, records its message as completed, as a run does; a copy of
    that message delivered after the holder ended (here published again with its task id, as
    the broker's redelivery is) is dropped, not run, and the duplicate's result stays."""
    bed = beds.bed
    task = beds.app.tasks[f"m.{policy}"]
    key = f"copy-{policy}-{uuid.uuid4().hex[:8]}"
    holder = task.apply_async((key,), {"hold": "H"}, queue=THREADS)

    def seen(predicate: Callable[[], bool], what: str) -> None:
        def check() -> bool:
            bed.refresh()
            return predicate()

        wait_for(check, 20, what, *bed.workers.values())

    seen(lambda: holder.id in bed.starts, "the holder's start")
    duplicate = task.apply_async((key,), countdown=0.5, queue=THREADS)
    wait_for(duplicate.ready, 20, "the duplicate's end", *bed.workers.values())
    ended = bed.metas([duplicate.id])[duplicate.id]
    assert ended is not None
    bed.client.rpush(go_key(bed.prefix, key, "H"), 1)
    wait_for(holder.ready, 20, "the holder's end", *bed.workers.values())
    task.apply_async((key,), task_id=duplicate.id, queue=THREADS)  # its message, again
    seen(lambda: bed.signals[("redelivery_dropped", duplicate.id)] == 1, "the copy dropped")
    assert duplicate.id not in bed.starts
    again = bed.metas([duplicate.id])[duplicate.id]
    assert again is not None
    assert (again["status"], repr(again["result"])) == (ended["status"], repr(ended["result"]))


@pytest.mark.parametrize("policy", ["queue", "cancel"])
def test_a_copy_of_a_queued_call_that_ran_is_dropped_not_run(beds: Beds, policy: str) -> None:
    """A regression the redelivery column found (a copy of a queued call's eta message that
    Redis handed out again ran a second time once the call had run, its link called twice): a
    call that waited in its key's queue and was handed the key records its run as completed, as
    the run of a delayed message does (its own message, published again at its turn, carries
    no eta); a copy of its original message delivered after it ran (here published again with
    its task id, as the broker's redelivery is) is dropped, not run, and its result stays."""
    bed = beds.bed
    task = beds.app.tasks[f"m.{policy}"]
    key = f"copy-{policy}-{uuid.uuid4().hex[:8]}"
    holder = task.apply_async((key,), {"hold": "H"}, queue=THREADS)

    def seen(predicate: Callable[[], bool], what: str) -> None:
        def check() -> bool:
            bed.refresh()
            return predicate()

        wait_for(check, 20, what, *bed.workers.values())

    seen(lambda: holder.id in bed.starts, "the holder's start")
    waiting = task.apply_async((key,), countdown=0.5, queue=THREADS)
    met = "duplicate_queued" if policy == "queue" else "stop_asked"
    seen(lambda: bed.signals[(met, waiting.id)] >= 1, "the call waiting in line")
    if policy == "cancel":  # the holder, asked to stop, ends cancelled once it saw the request
        seen(lambda: holder.id in bed.saw_cancel, "the holder to see the stop request")
    bed.client.rpush(go_key(bed.prefix, key, "H"), 1)
    wait_for(waiting.ready, 20, "the waiting call's run", *bed.workers.values())
    ran = bed.metas([waiting.id])[waiting.id]
    assert ran is not None
    assert ran["result"] == {"ran": waiting.id, "key": key}
    task.apply_async((key,), task_id=waiting.id, queue=THREADS)  # its message, again
    dropped = ("redelivery_dropped", waiting.id)
    seen(lambda: bed.signals[dropped] or len(bed.starts[waiting.id]) > 1, "the copy handled")
    assert len(bed.starts[waiting.id]) == 1, "the copy ran"
    assert bed.signals[dropped] == 1
    again = bed.metas([waiting.id])[waiting.id]
    assert again is not None
    assert (again["status"], again["result"]) == (ran["status"], ran["result"])
