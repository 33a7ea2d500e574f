"""Load with random kills: 3 worker nodes x 4 prefork processes, 3 active beats,
20 lock keys, tasks longer than their ttl, a steady feed of duplicate calls, and SIGKILLs of
pool children, whole nodes and beats, each replaced; and a node SIGKILLed right after
a run's body, before its ack: no message that finished runs again.

``SINGLETON_LOAD_SECONDS`` sets the duration (default 70), ``SINGLETON_LOAD_SEED`` the random
seed (printed, and in every failure message). The figures go to
``$SINGLETON_RELIABILITY_OUT`` (tests/support/chaos.py).

70 s: the first kill comes 5-12 s in and one every 5-9 s after the one before ended (a kill
may wait a few seconds for its moment), the four kill kinds in a shuffled order before any
repeats, so all four happen by about 48 s, before the quiet end at 55 s, and every key still
runs many times over (at least one run a second in all is asserted). A run of 120 s or more
spaces its kills 8-16 s apart, as docs/reliability.md's figures were measured
(``SINGLETON_LOAD_SECONDS=180``); it only repeats the same kills more often.
"""

from __future__ import annotations

import math
import os
import random
import time
from collections import Counter

import pytest
import redis
from celery import Celery

from tests.support.beats import BeatFactory
from tests.support.chaos import LoadRig, record_figures, with_twice
from tests.support.workers import WorkerFactory

LOAD_SECONDS = float(os.environ.get("SINGLETON_LOAD_SECONDS", "70"))
SEED = int(os.environ.get("SINGLETON_LOAD_SEED", "20240611"))
NODES, CONCURRENCY, BEATS, KEYS = 3, 4, 3, 20
KILL_KINDS = ["child", "node", "beat", "after-body"]
#: the broker restores a killed node's unacked messages after this many seconds
VISIBILITY_S = 8.0
#: no kill in the last seconds, so that the last node's messages come back before the end
QUIET_END_S = 15.0
#: seconds between two kills: closer in the suite's short run, as measured in the long one
KILL_EVERY_S = (5.0, 9.0) if LOAD_SECONDS < 120 else (8.0, 16.0)
TTL_S = 1.0
#: the entries of beat_app checked for runs fired twice or not at all, with their periods
PERIODS = {"every-second": 1.0, "remote-every-2s": 2.0, "load-fanout": 1.0, "every-minute": 60.0}


def next_phase(now: float) -> float:
    """The next x.25 or x.75 second: sends stay clear of the beats' publishes and the kills."""
    base = math.floor(now)
    for phase in (0.25, 0.75, 1.25):
        if base + phase > now:
            return base + phase
    return base + 1.25  # pragma: no cover - unreachable


@pytest.mark.slow(seconds=LOAD_SECONDS + 10)
@pytest.mark.timeout(LOAD_SECONDS + 240)
def test_load_with_random_kills_no_overlap_no_stuck_lock(
    worker_factory: WorkerFactory,
    beat_factory: BeatFactory,
    client_app: Celery,
    redis_client: redis.Redis,
    key_prefix: str,
) -> None:
    """3 nodes x 4, 3 beats, 20 keys, duplicate feed, random SIGKILLs: exclusion holds."""
    print(f"load: seed={SEED} seconds={LOAD_SECONDS:g}")
    started = time.monotonic()
    rng = random.Random(SEED)
    rig = LoadRig(
        workers=worker_factory,
        beats=beat_factory,
        app=client_app,
        client=redis_client,
        prefix=key_prefix,
        keys=KEYS,
        visibility=VISIBILITY_S,
        rng=rng,
    )
    rig.start(nodes=NODES, concurrency=CONCURRENCY, beats=BEATS)

    begin = time.time()
    end, quiet = begin + LOAD_SECONDS, begin + LOAD_SECONDS - QUIET_END_S
    kinds: list[str] = []
    next_kill = begin + rng.uniform(5, 12)
    sends = 0
    next_send = next_phase(begin)
    while time.time() < end:
        time.sleep(max(0.0, next_send - time.time()))
        # two calls a second, every fourth one sent twice: ~2.5 calls/s of 1.2-2.5 s each
        rig.send_random(copies=2 if sends % 4 == 0 else 1)
        sends += 1
        if time.time() >= next_kill and time.time() < quiet:
            if not kinds:
                kinds = rng.sample(KILL_KINDS, len(KILL_KINDS))
            kind = kinds.pop()
            {
                "child": rig.kill_child,
                "node": rig.kill_node,
                "beat": rig.kill_beat,
                "after-body": rig.kill_after_body,
            }[kind]()
            next_kill = time.time() + rng.uniform(*KILL_EVERY_S)
        next_send = next_phase(time.time())

    report = rig.report(PERIODS, drain_timeout=60, lock_grace=TTL_S + 1)
    load_runs = report.load_runs
    killed = Counter(k.kind for k in report.kills)
    record_figures(
        with_twice(
            f"load: {NODES} nodes x {CONCURRENCY}, {BEATS} beats, {KEYS} keys, random kills, "
            f"{LOAD_SECONDS:g} s",
            len(report.beat.fired_twice),
        ),
        runs=len(load_runs) + len(report.beat.fired),
        overlaps=report.overlaps,
        stuck_locks=len(report.stuck_locks),
        lost_runs=report.lost_runs,
        run_twice=len(report.run_twice),
    )
    print(
        f"load summary: seed={SEED} seconds={LOAD_SECONDS:g} lock_runs={len(load_runs)} "
        f"keys={len({e.key for e in load_runs})} calls={report.sent} "
        f"overlaps={report.overlaps} token_regressions={len(report.history.token_regressions)} "
        f"scheduled_runs={len(report.beat.fired)} fired_twice={len(report.beat.fired_twice)} "
        f"beat_lost={report.beat.lost_count} lost_runs={report.lost_runs} "
        f"broker_drops={report.broker_drops} stuck_locks={len(report.stuck_locks)} "
        f"run_twice={len(report.run_twice)} finished_twice={len(report.finished_twice)} "
        f"kills: child={killed['child']} node={killed['node']} beat={killed['beat']} "
        f"after-body={killed['after-body']} "
        f"wall={time.monotonic() - started:.0f}s"
    )

    detail = f"seed={SEED} (SINGLETON_LOAD_SEED)\n{report.summary()}\n{rig.logs()}"
    assert report.history.ok, detail
    assert not report.history.unfinished, detail
    for key in {e.key for e in load_runs}:
        tokens = [e.token for e in load_runs if e.key == key]
        assert tokens == sorted(tokens), f"{key}: tokens not increasing\n{detail}"
        assert len(set(tokens)) == len(tokens), f"{key}: a token issued twice\n{detail}"
    assert report.beat.ok, detail
    assert not report.unexplained_calls, detail
    assert not report.unexplained_runs, detail
    assert not report.stuck_locks, detail
    assert not report.run_twice, f"messages run again after they finished\n{detail}"
    # the load was real: every key ran, the locks were contended and the kills happened
    assert len({e.key for e in load_runs}) == KEYS, detail
    assert len(load_runs) >= LOAD_SECONDS, detail
    retried = sum(n.log_text().count("singleton: duplicate retried") for n in rig.nodes)
    assert retried >= len(load_runs) / 10, f"{retried} duplicates retried: too little contention"
    assert report.kills, detail
    if LOAD_SECONDS >= 60:
        assert set(killed) == set(KILL_KINDS), detail
