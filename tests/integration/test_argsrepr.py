"""A secret argument the caller masked for Celery (``apply_async(argsrepr=..., kwargsrepr=...)``)
is masked for the library too: real worker processes hold locks of a call whose card number
is masked, and the card appears nowhere the library shows or keeps a call: not in the lock
hash, not in ``celery singleton list``/``show``, not in the worker's log, not in a skipped or
coalesced duplicate's marker, not in a signal's payload; a coalesced duplicate's follow-up and
a requeued duplicate carry the mask on. A huge call (a 100 kB argument, argsrepr or kwargsrepr)
leaves a lock hash of bounded size, and nothing of its key past ttl + fence margin.

One worker (lock ttl 4 s) serves the module's tests; each holds its runs at gates of its own."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from celery.result import AsyncResult
from click.testing import CliRunner

from celery_singleton_lock import SingletonTask, skip_info
from celery_singleton_lock.core.backend import FENCE_MARGIN_MS, MAX_META_VALUE_BYTES
from celery_singleton_lock.tools.cli import singleton
from tests.support.bed import Bed
from tests.support.singleton_app import signal_payloads_key
from tests.support.waiting import wait_for

CARD = "4111111111111111"
#: what the caller shows of the card, as Celery documents it
MASK = "('****',)"
#: the most a held lock's hash takes in Redis (MEMORY USAGE), as docs/configuration.md states
LOCK_HASH_MAX_BYTES = 3072


def charge_task(bed: Bed, name: str) -> Any:
    """``name`` of the worker's app, as a SingletonTask of the client app (its apply_async);
    declared at the first test that calls it (the module's tests share the app)."""
    if name in bed.app.tasks:
        return bed.app.tasks[name]
    bed.app.conf.singleton_key_prefix = f"{bed.prefix}lock:"

    @bed.app.task(
        bind=True, base=SingletonTask, name=name, shared=False, singleton_key_args=("card",)
    )
    def charge(self: Any, card: str, until: str | None = None) -> None:
        """Same signature as the worker's."""

    return charge


def cli(bed: Bed, *args: str) -> str:
    """``celery singleton <args>`` on the worker's locks."""
    shown = CliRunner().invoke(
        singleton, ["--url", bed.redis_url, "--prefix", f"{bed.prefix}lock:", *args]
    )
    assert shown.exit_code == 0, shown.output
    return shown.output


def held(bed: Bed, owner: str, generation: int = 0) -> dict[str, Any]:
    """The lock ``owner`` holds (its run of that retries count), as `list --json` shows it,
    once it holds one."""

    def listed() -> dict[str, Any] | None:
        mine = [
            lock
            for lock in json.loads(cli(bed, "list", "--json"))
            if (lock["owner"], lock["generation"]) == (owner, generation)
        ]
        return mine[0] if mine else None

    found: dict[str, Any] = wait_for(listed, 30, f"the lock of {owner}", bed.worker)
    return found


def check_lock_masked(bed: Bed, lock: dict[str, Any]) -> None:
    """The lock's hash in Redis, `list` and `show` show the mask, never the card."""
    assert lock["args"].startswith(MASK), lock
    stored = bed.client.hgetall(lock["key"])
    assert stored[b"args"].startswith(MASK.encode()), stored
    assert not any(CARD.encode() in value for value in stored.values()), stored
    listed, shown = cli(bed, "list"), cli(bed, "show", lock["key"])
    assert MASK in listed
    assert MASK in shown
    assert CARD not in listed + shown


def check_nothing_leaked(bed: Bed, *results: AsyncResult) -> None:
    """Neither the worker's log, nor the signals' payloads, nor the duplicates' results."""
    assert CARD not in bed.worker.log_text()
    logged = bed.client.lrange(signal_payloads_key(bed.prefix), 0, -1)
    payloads = [p.decode() for p in logged]
    assert payloads  # the receivers are there
    assert not [p for p in payloads if CARD in p]
    for result in results:
        assert CARD not in repr(result.result)


@pytest.fixture(scope="module")
def shared_bed(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, module_prefix: str
) -> Iterator[Bed]:
    """One worker of the test app for the module's tests (lock ttl 4 s, the signals' payloads
    logged)."""
    env = {"SINGLETON_TEST_TTL": "4", "SINGLETON_TEST_SIGNAL_PAYLOADS": "1"}
    with Bed(redis_url, module_prefix, tmp_path_factory.mktemp("argsrepr"), env=env) as made:
        made.start(concurrency=3)
        yield made


@pytest.fixture
def bed(shared_bed: Bed) -> Iterator[Bed]:
    """The module's bed; the gates a test made are opened after it (no run of it is left
    holding a pool slot or a lock for the next test)."""
    yield shared_bed
    shared_bed.open_gates()


@pytest.mark.slow(seconds=6)
def test_a_masked_secret_never_shows_under_the_skip_policy(bed: Bed) -> None:
    """A holder called with ``argsrepr``: its lock shows the mask; a duplicate called the same
    way is skipped naming it, and nothing of either shows the card."""
    task, gate = charge_task(bed, "t.charge"), bed.gate("skip")
    holder = task.apply_async(args=(CARD,), kwargs={"until": gate}, argsrepr=MASK)
    check_lock_masked(bed, held(bed, holder.id))

    duplicate = task.apply_async(args=(CARD,), kwargs={"until": gate}, argsrepr=MASK)
    wait_for(duplicate.ready, 20, "the duplicate skipped", bed.worker)
    info = skip_info(duplicate)
    assert info is not None
    assert info.holder == holder.id
    bed.worker.wait_for_log(rf"singleton: duplicate skipped: t\.charge\[{duplicate.id}\]")

    bed.open(gate)
    holder.get(timeout=20)
    check_nothing_leaked(bed, holder, duplicate)


@pytest.mark.slow(seconds=8)
def test_a_masked_secret_never_shows_under_the_coalesce_policy(bed: Bed) -> None:
    """A coalesced duplicate's call is kept whole for its follow-up (it must run it), but the
    pending record is shown by id and count only, and the follow-up is published with the
    duplicate's mask: its own lock shows the mask, never the card."""
    task, first, second = (
        charge_task(bed, "t.charge_coalesce"),
        bed.gate("first"),
        bed.gate("second"),
    )
    holder = task.apply_async(args=(CARD,), kwargs={"until": first}, argsrepr=MASK)
    lock = held(bed, holder.id)

    duplicate = task.apply_async(
        args=(CARD,), kwargs={"until": second}, argsrepr=MASK, kwargsrepr="{'until': '*'}"
    )
    wait_for(duplicate.ready, 20, "the duplicate coalesced", bed.worker)
    info = skip_info(duplicate)
    assert info is not None
    assert info.follow_up is not None
    pending = held(bed, holder.id)
    assert pending["pending_follow_up"] == info.follow_up
    check_lock_masked(bed, pending)

    bed.open(first)
    holder.get(timeout=20)
    follow_up = held(bed, info.follow_up)
    assert follow_up["key"] == lock["key"]
    assert follow_up["args"] == f"{MASK} {{'until': '*'}}"  # the duplicate's kwargsrepr too
    check_lock_masked(bed, follow_up)

    bed.open(second)
    AsyncResult(info.follow_up, app=bed.app).get(timeout=20)
    check_nothing_leaked(bed, holder, duplicate)


@pytest.mark.slow(seconds=8)
def test_a_requeued_duplicate_keeps_its_mask(bed: Bed) -> None:
    """Under the retry policy a duplicate is published again while it waits: with its mask, so
    when it finally takes the lock, the lock shows the mask."""
    task, first, second = (
        charge_task(bed, "t.charge_retry"),
        bed.gate("first"),
        bed.gate("second"),
    )
    holder = task.apply_async(args=(CARD,), kwargs={"until": first}, argsrepr=MASK)
    held(bed, holder.id)
    duplicate = task.apply_async(args=(CARD,), kwargs={"until": second}, argsrepr=MASK)
    bed.worker.wait_for_log(rf"singleton: duplicate retried in .*t\.charge_retry\[{duplicate.id}\]")

    bed.open(first)
    holder.get(timeout=20)
    check_lock_masked(bed, held(bed, duplicate.id))
    bed.open(second)
    duplicate.get(timeout=20)
    check_nothing_leaked(bed, holder)


@pytest.mark.slow(seconds=6)
def test_a_run_that_retries_itself_keeps_its_mask(bed: Bed) -> None:
    """``self.retry()`` publishes the same call again (Celery's retry drops the reprs): the
    retried run's lock shows the mask."""
    task, gate = charge_task(bed, "t.charge_self_retry"), bed.gate("retried")
    run = task.apply_async(args=(CARD,), kwargs={"until": gate}, argsrepr=MASK)
    check_lock_masked(bed, held(bed, run.id, generation=1))  # the retried run's
    bed.open(gate)
    run.get(timeout=20)
    check_nothing_leaked(bed, run)


def _bounded(bed: Bed, lock: dict[str, Any]) -> dict[bytes, bytes]:
    """The lock's hash: every metadata value within its bound, and the whole hash within the
    documented 3 kB (docs/configuration.md, "Memory per key")."""
    stored = bed.client.hgetall(lock["key"])
    meta = {k: v for k, v in stored.items() if k in (b"task", b"host", b"pid", b"args")}
    assert meta.keys() == {b"task", b"host", b"pid", b"args"}, stored.keys()
    assert all(len(value) <= MAX_META_VALUE_BYTES for value in meta.values()), meta
    assert bed.client.memory_usage(lock["key"], samples=0) <= LOCK_HASH_MAX_BYTES
    return stored


@pytest.mark.slow(seconds=6)
def test_a_huge_call_leaves_a_bounded_lock_and_nothing_past_the_bound(bed: Bed) -> None:
    """A 100 kB argument, then huge argsrepr/kwargsrepr, through a worker: the lock hash stays
    within its bound; once each run ended, every key of its lock expires within the lock's ttl
    + the fence margin (the worker's ttl is 4 s)."""
    task = charge_task(bed, "t.charge")
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = [
        (("4" * 100_000,), {}),
        (("4" * 16,), {"argsrepr": "a" * 100_000, "kwargsrepr": "k" * 100_000}),
    ]
    for args, options in calls:
        gate = bed.gate("huge")
        holder = task.apply_async(args=args, kwargs={"until": gate}, **options)
        lock = held(bed, holder.id)
        stored = _bounded(bed, lock)
        assert stored[b"args"].endswith(b"..."), stored[b"args"]
        bed.open(gate)
        holder.get(timeout=20)
        tag = lock["key"][lock["key"].index("{") : lock["key"].index("}") + 1]
        found = bed.client.scan_iter(count=1000, match=f"*{tag}*")
        # a key released between the SCAN and its PTTL (-2) is gone, as it should be
        left = {key: pttl for key in found if (pttl := bed.client.pttl(key)) != -2}
        assert left, "the fencing counter is there until its bound"
        bound = 4000 + FENCE_MARGIN_MS
        assert all(0 < pttl <= bound for pttl in left.values()), left
