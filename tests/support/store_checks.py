"""Checks every lock store passes, whatever the topology behind it: one server, Sentinel,
Cluster, Redlock. Each test module of a topology runs them through its own store
(test_coalesce and test_permits on one server, test_sentinel, test_cluster, test_redlock_url).
"""

from __future__ import annotations

from celery_singleton_lock.core.backend import (
    Acquired,
    Contended,
    LockBackend,
    ReleaseStatus,
    release_lost_slot,
)
from celery_singleton_lock.core.keys import LockKeys
from celery_singleton_lock.core.pending import leave_pending, put_back, superseded_by, take_pending

__test__ = False


def check_pending_scripts(store: LockBackend, keys: LockKeys) -> None:
    """The pending record's three scripts through ``store`` (one server, Sentinel, Cluster,
    Redlock): left only beside the holder's lock (the latest call wins, one follow-up id, the
    holder named), taken only once nobody holds the lock, and only once; put back when nothing
    newer is."""
    run = store.run_script
    assert isinstance(store.acquire(keys, "holder", 0, 30_000), Acquired)
    left = [leave_pending(run, keys, "holder", f"f-{n}", {"call": f"c{n}"}) for n in range(3)]
    assert [(x.follow_up, x.count) for x in left] == [("f-0", 1), ("f-0", 2), ("f-0", 3)]
    assert leave_pending(run, keys, "someone", "f-9", {"call": "x"}).follow_up is None
    assert take_pending(run, keys) is None  # held: the holder's release takes it
    assert store.release(keys.lock, "holder", 0) is ReleaseStatus.RELEASED
    assert leave_pending(run, keys, "holder", "f-9", {"call": "late"}).follow_up is None
    record = take_pending(run, keys)
    assert record is not None
    assert (record["id"], record["count"], record["call"]) == (b"f-0", b"3", b"c2")
    assert (superseded_by(record, "holder"), superseded_by(record, "newer")) == (None, "newer")
    assert take_pending(run, keys) is None  # taken once
    assert put_back(run, keys, record)
    assert take_pending(run, keys) == record


def check_permit_slots(store: LockBackend, keys: LockKeys) -> None:
    """Three permits through ``store`` (one server, Sentinel, Cluster): three owners take slots
    1 to 3 with increasing tokens, the fourth meets a holder, the main process's search finds a
    lost run's slot, and the freed slot is taken again."""
    taken = [store.acquire(keys, owner, 0, 30_000) for owner in ("a", "b", "c")]
    assert [t.slot for t in taken if isinstance(t, Acquired)] == [1, 2, 3]
    tokens = [t.token for t in taken if isinstance(t, Acquired)]
    assert tokens == sorted(set(tokens))
    assert isinstance(store.acquire(keys, "d", 0, 30_000), Contended)
    assert release_lost_slot(store, keys, "b", 0, 0) == (keys.slot(2), ReleaseStatus.RELEASED)
    again = store.acquire(keys, "d", 0, 30_000)
    assert isinstance(again, Acquired)
    assert (again.slot, again.token > tokens[-1]) == (2, True)
    for owner, slot in (("a", 1), ("d", 2), ("c", 3)):
        assert store.release(keys.slot(slot), owner, 0) is ReleaseStatus.RELEASED
