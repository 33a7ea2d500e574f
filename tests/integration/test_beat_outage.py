"""Beats that lose the lock Redis: cut off one by one, or all at once when it stops or dies.

Real ``celery beat`` processes of ``tests.support.beat_app`` and one prefork worker. The lock
store (run claims, leader lease) is a private Redis; each beat reaches it through a TCP proxy of
its own (``tests/support/proxy.py``), so one beat's Redis can be cut (connections reset) or
blackholed (connections held, nothing answered) while the others keep theirs. The broker, the
results and the executions' history stay on the shared Redis; the worker reaches the lock store
directly (its witness of each scheduled run). Every execution records its run label
``<entry>@<run id ms>``, so the history says how often each nominal run executed: none twice,
and none missed but where the test says why.

Active mode (one group of beats for the module's tests, their sockets timing out after 1 s): a
beat cut off publishes nothing, logs the outage once and again when Redis answers; the others
publish every run meanwhile. Leader mode (a group of its own): the leader cut off stops
publishing and stands by before its lease ends, a standby takes over within the lease.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.basic_app import BEAT_APP, history_key
from tests.support.beats import BeatHistory, BeatProcess, LogLine
from tests.support.bed import Bed
from tests.support.history import load_history
from tests.support.prefixes import private_prefix
from tests.support.proxy import TcpProxy
from tests.support.servers import RedisServer
from tests.support.waiting import wait_for

#: the outage lines (celery_singleton_lock/beat/outage.py)
OUTAGE = "beat: redis unreachable, publishing nothing until it answers: "
ANSWERS = re.compile(r"beat: redis answers again after (\d+\.\d)s")
#: leader mode (celery_singleton_lock/beat/leader.py)
BECAME_LEADER = "beat: became leader"
STILL_LEADING = "beat: redis error, lease not renewed, still leading"
STANDING_BY = re.compile(r"beat: redis error, standing by: lease not renewed for (\d+\.\d)s")
#: lines no beat may log: a per-run error line of older versions, a crash
FORBIDDEN = ("run not published yet", "Traceback", "CRITICAL")

#: the active beats' socket timeouts: a paused server is an error after 1 s, not 5 s
ACTIVE_QUERY = "socket_timeout=1"
LEASE_S = 3.0
LEADER_ENV = {"SINGLETON_TEST_BEAT_MODE": "leader", "SINGLETON_TEST_BEAT_LEASE": f"{LEASE_S:g}"}
#: leader mode's socket timeouts: a quarter of the lease (settings/options.py)
LEADER_TIMEOUT_S = LEASE_S / 4
#: how late a beat may log what it decided, on a loaded machine
LATE_S = 1.0
#: how late a standby may take the lease over, past its end and its poll interval
TAKEOVER_LATE_S = 1.5


class Group:
    """Beats of beat_app on one bed, each reaching the group's lock server through a proxy."""

    def __init__(self, bed: Bed, server: RedisServer, env: dict[str, str], query: str) -> None:
        self.bed, self.server, self.env, self.query = bed, server, env, query
        self.beats: list[BeatProcess] = []
        self.proxies: dict[str, TcpProxy] = {}
        #: when the last of the first beats was ready (epoch s): every slot after it runs
        self.ready_at = 0.0

    def start_beat(self, cut: bool = False) -> BeatProcess:
        """A beat with a proxy of its own (cut from the start if ``cut``)."""
        proxy = TcpProxy(self.server.port)
        if cut:
            proxy.cut()
        url = proxy.url(query=self.query)
        beat = self.bed.beats.start(env={**self.env, "SINGLETON_TEST_LOCK_URL": url})
        self.beats.append(beat)
        self.proxies[beat.name] = proxy
        return beat

    def proxy(self, beat: BeatProcess) -> TcpProxy:
        return self.proxies[beat.name]

    def stop_beat(self, beat: BeatProcess) -> int:
        """Stop ``beat`` (SIGTERM) and take it out of the group; its exit code."""
        code = beat.terminate()
        self.beats.remove(beat)
        self.proxies.pop(beat.name).close()
        return code

    def history(self) -> BeatHistory:
        return BeatHistory(load_history(self.bed.client, history_key(self.bed.prefix)))

    def logs(self) -> str:
        return self.bed.beats.logs(150)

    def close(self) -> None:
        self.bed.beats.close()
        for proxy in self.proxies.values():
            proxy.close()


@pytest.fixture(scope="module")
def active(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, module_prefix: str
) -> Iterator[Group]:
    """Three active beats and a worker, the lock store on a private server; every run missed
    within the last hour is caught up."""
    env = {"SINGLETON_TEST_BEAT_CATCH_UP": "3600"}
    yield from _group(
        tmp_path_factory.mktemp("active"), redis_url, module_prefix, env, ACTIVE_QUERY
    )


@pytest.fixture(scope="module")
def leaders(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[Group]:
    """Three leader-mode beats (lease 3 s) and a worker, on a prefix and lock server of their
    own."""
    with private_prefix(redis_url) as prefix:
        yield from _group(tmp_path_factory.mktemp("leaders"), redis_url, prefix, LEADER_ENV, "")


def _group(
    work_dir: Path, redis_url: str, prefix: str, env: dict[str, str], query: str
) -> Iterator[Group]:
    with (
        RedisServer() as server,
        Bed(redis_url, prefix, work_dir, env={"SINGLETON_TEST_LOCK_URL": server.url}) as bed,
    ):
        group = Group(bed, server, env, query)
        try:
            for _ in range(3):
                group.start_beat()
            bed.start(BEAT_APP, concurrency=2)
            group.ready_at = max(beat.wait_ready() for beat in group.beats)
            yield group
        finally:
            group.close()


# -- helpers -------------------------------------------------------------------------------------


def lines(beat: BeatProcess, needle: str | re.Pattern[str], start: int = 0) -> list[LogLine]:
    """``beat``'s log lines (from byte offset ``start``) containing ``needle``."""
    if isinstance(needle, str):
        return [ln for ln in beat.lines(start) if needle in ln.text]
    return [ln for ln in beat.lines(start) if needle.search(ln.text)]


def wait_line(
    beat: BeatProcess, needle: str | re.Pattern[str], start: int, timeout: float, count: int = 1
) -> LogLine:
    """Wait until ``beat`` logged ``count`` lines with ``needle`` after ``start``; the last."""
    found = wait_for(
        lambda: len(lines(beat, needle, start)) >= count and lines(beat, needle, start),
        timeout,
        f"{beat.name} to log {needle!r}",
        beat,
    )
    return found[count - 1]


def slot_ms(when: float, step_s: float = 1.0) -> int:
    """Start (epoch ms) of the ``step_s`` slot containing ``when``."""
    return math.floor(when / step_s) * round(step_s * 1000)


def sleep_until(deadline: float) -> None:
    """Let the scenario go on until ``time.time()`` reaches ``deadline``."""
    delay = deadline - time.time()
    if delay > 0:
        time.sleep(delay)


def step_ms(entry: str) -> int:
    return 1000 if entry == "every-second" else 2000


def missing(group: Group, entry: str, first_ms: int, last_ms: int) -> list[int]:
    """The slots of ``entry`` from ``first_ms`` (rounded up to a slot) to ``last_ms`` that
    did not execute."""
    step = step_ms(entry)
    return group.history().missing_slots(entry, step, first_ms + -first_ms % step, last_ms)


def wait_ran(group: Group, entry: str, first_ms: int, last_ms: int, timeout: float) -> None:
    """Wait until every ``entry`` slot from ``first_ms`` to ``last_ms`` executed."""
    wait_for(
        lambda: not missing(group, entry, first_ms, last_ms),
        timeout,
        f"{entry} runs {first_ms}..{last_ms}",
        details=lambda: f"{group.history().summary()}\n{group.logs()}",
    )


def publishers(group: Group) -> dict[str, list[str]]:
    """Run label -> the beats that logged it as published."""
    found: dict[str, list[str]] = {}
    for beat in group.beats:
        for published in beat.published():
            found.setdefault(published.label, []).append(beat.name)
    return found


def assert_once(group: Group, context: str) -> None:
    """No run executed twice, none without its label, none published by two beats, no beat
    log with a forbidden line, every beat alive."""
    hist = group.history()
    twice = {label: names for label, names in publishers(group).items() if len(names) > 1}
    detail = f"{context}\n{hist.summary()}\n{group.logs()}"
    assert not hist.duplicates(), f"runs executed twice {hist.duplicates()}: {detail}"
    assert not hist.unlabelled(), f"runs without a label: {detail}"
    assert not twice, f"runs published by two beats {twice}: {detail}"
    for beat in group.beats:
        if beat.killed_at is None:
            assert beat.is_running(), f"{beat.name} died: {detail}"
        bad = [ln for ln in beat.log_text().splitlines() if any(f in ln for f in FORBIDDEN)]
        assert not bad, f"{beat.name} logged {bad}: {detail}"


# -- active mode ---------------------------------------------------------------------------------


@pytest.mark.slow(seconds=11)
def test_active_beat_cut_from_its_redis_publishes_nothing_and_logs_the_outage_once(
    active: Group,
) -> None:
    """One of three active beats loses its Redis (its proxy resets every connection) for four
    slots of the 1 s entry: the other two publish every run meanwhile; the cut beat logs one
    line when the outage starts and one when Redis answers again, publishes nothing while cut,
    and publishes again after (the other two paused for two slots: every run is its)."""
    victim, *others = active.beats
    proxy = active.proxy(victim)
    offset = victim.log_size()
    cut_at = proxy.cut()
    wait_line(victim, OUTAGE, offset, timeout=5)
    wait_ran(active, "every-second", slot_ms(cut_at) + 1000, slot_ms(cut_at) + 4000, timeout=10)
    restored_at = proxy.restore()
    answered = wait_line(victim, ANSWERS, offset, timeout=5)
    # the cut beat publishes again: alone for two slots (its peers paused, resumed after)
    for beat in others:
        beat.stop()
    alone_at = time.time()
    try:
        wait_ran(active, "every-second", slot_ms(alone_at) + 1000, slot_ms(alone_at) + 2000, 10)
    finally:
        for beat in others:
            beat.cont()
    last = slot_ms(time.time()) + 1000
    first = max(slot_ms(cut_at) - 2000, slot_ms(active.ready_at) + 1000)
    wait_ran(active, "every-second", first, last, timeout=10)
    wait_ran(active, "remote-every-2s", first, last, timeout=10)

    logs = f"cut at {cut_at:.3f}, restored at {restored_at:.3f}\n{active.logs()}"
    assert len(lines(victim, OUTAGE, offset)) == 1, logs
    assert len(lines(victim, ANSWERS, offset)) == 1, logs
    outage_line = lines(victim, OUTAGE, offset)[0]
    assert outage_line.level == "ERROR", logs
    assert answered.level == "WARNING", logs
    lasted = float(ANSWERS.search(answered.text).group(1))  # type: ignore[union-attr]
    assert lasted <= answered.ts - outage_line.ts + 0.2, logs
    assert lasted >= restored_at - outage_line.ts - 0.2, logs
    # while cut: nothing published by the cut beat, but runs claimed before the cut
    by = publishers(active)
    cut_runs = [
        label
        for label in by
        if cut_at * 1000 < int(label.rsplit("@", 1)[1]) < restored_at * 1000 - 1000
    ]
    assert cut_runs, logs
    assert not [label for label in cut_runs if victim.name in by[label]], logs
    mine = [p for p in victim.published() if p.ts > alone_at]
    assert mine, f"{victim.name} published nothing once its Redis answered\n{logs}"
    assert_once(active, "one active beat cut from its Redis")


@pytest.mark.slow(seconds=5)
def test_active_beat_started_while_its_redis_is_cut_waits_for_it(active: Group) -> None:
    """A beat started with its Redis cut does not crash at start (beat_init, the banner, its
    first ticks): it logs the outage once, publishes nothing, and takes part once Redis
    answers."""
    beat = active.start_beat(cut=True)
    proxy = active.proxy(beat)
    started = beat.wait_ready()
    wait_line(beat, OUTAGE, 0, timeout=5)
    wait_ran(active, "every-second", slot_ms(started) + 1000, slot_ms(started) + 3000, timeout=10)
    assert beat.is_running(), beat.log_tail()
    assert not beat.published(), beat.log_tail()
    restored_at = proxy.restore()
    wait_line(beat, ANSWERS, 0, timeout=5)
    # it claims again: each run it tries after that is published by it or found claimed
    wait_line(beat, re.compile(r"beat: (published run|run already claimed)"), beat.log_size(), 5)
    logs = f"restored at {restored_at:.3f}\n{active.logs()}"
    assert len(lines(beat, OUTAGE)) == 1, logs
    assert len(lines(beat, ANSWERS)) == 1, logs
    assert_once(active, "a beat started while its Redis was cut")
    assert active.stop_beat(beat) == 0, beat.log_tail()


@pytest.mark.slow(seconds=14)
def test_active_beats_lose_their_redis_together_and_publish_each_run_at_most_once(
    active: Group,
) -> None:
    """The lock Redis itself, for every beat: paused (SIGSTOP, 3 s: calls time out) and then
    killed and restarted empty (3 s down). No beat crashes; each logs each outage once and
    Redis answering again once; no run is published twice. The runs that came due while no
    beat could claim them are missed runs, caught up when Redis answers (the beats' window is
    an hour): published late, once each; those before and after are all published on time."""
    server = active.server
    beats = [b for b in active.beats if b.is_running()]
    offsets = {b.name: b.log_size() for b in beats}
    sleep_until(math.floor(time.time()) + 1.3)  # mid-slot: no claim is being made
    server.pause()
    paused_at = time.time()
    try:
        for beat in beats:
            wait_line(beat, OUTAGE, offsets[beat.name], timeout=5)
        sleep_until(paused_at + 3)
    finally:
        server.resume()
    resumed_at = time.time()
    for beat in beats:
        wait_line(beat, ANSWERS, offsets[beat.name], timeout=5)
    wait_ran(active, "every-second", slot_ms(paused_at), slot_ms(resumed_at) + 1000, timeout=10)

    # killed mid-slot: a run one beat published just before the kill, whose claim another beat
    # tried just after it (an error: retried), would be claimed again on the empty server
    sleep_until(math.floor(time.time()) + 1.5)
    server.kill()
    killed_at = time.time()
    for beat in beats:
        wait_line(beat, OUTAGE, offsets[beat.name], timeout=5, count=2)
    sleep_until(killed_at + 3)
    restarting_at = time.time()  # a beat may reach the server before restart() returns
    server.restart()
    restarted_at = time.time()
    for beat in beats:
        wait_line(beat, ANSWERS, offsets[beat.name], timeout=5, count=2)
    last = slot_ms(time.time()) + 1000
    first = max(slot_ms(paused_at) - 2000, slot_ms(active.ready_at) + 1000)
    wait_ran(active, "every-second", first, last, timeout=10)
    wait_ran(active, "remote-every-2s", first, last, timeout=10)

    logs = (
        f"paused {paused_at:.3f}-{resumed_at:.3f}, killed {killed_at:.3f}, restarted "
        f"{restarted_at:.3f}\n{active.logs()}"
    )
    for beat in beats:
        assert len(lines(beat, OUTAGE, offsets[beat.name])) == 2, logs
        assert len(lines(beat, ANSWERS, offsets[beat.name])) == 2, logs
    # the runs due while Redis was down went out late (caught up), once each
    late = [
        p
        for p in (p for b in beats for p in b.published(offsets[b.name]))
        if killed_at * 1000 < int(p.run) < restarted_at * 1000 - 1000
    ]
    assert late, logs
    assert all(p.ts >= restarting_at for p in late), logs
    assert not missing(active, "every-second", first, last), logs
    assert_once(active, "the lock Redis paused, then killed and restarted")


# -- leader mode ---------------------------------------------------------------------------------


def leader_since(group: Group, since: float, timeout: float) -> tuple[BeatProcess, float]:
    """The beat that became leader after ``since`` (epoch s), and when (its log time)."""

    def found() -> tuple[BeatProcess, float] | None:
        for beat in group.beats:
            times = [ln.ts for ln in lines(beat, BECAME_LEADER) if ln.ts >= since]
            if times:
                return beat, times[0]
        return None

    result: tuple[BeatProcess, float] = wait_for(
        found, timeout, "a beat to become leader", interval=0.05, details=group.logs
    )
    return result


def check_stood_by(group: Group, leader: BeatProcess, offset: int, cut_at: float) -> None:
    """``leader``, cut from its Redis at ``cut_at``, stood by before its lease could end and
    published nothing after the cut."""
    line = wait_line(leader, STANDING_BY, offset, timeout=LEASE_S + 5)
    logs = f"{leader.name} cut at {cut_at:.3f}\n{group.logs()}"
    # its lease was last renewed before the cut: it ends by cut_at + LEASE_S. The leader stops
    # at 0.9 of it by its own clock, and logs it at its next tick (a call waiting for its
    # socket timeout, or a busy machine, can make that tick late)
    unrenewed = float(STANDING_BY.search(line.text).group(1))  # type: ignore[union-attr]
    assert LEASE_S * 0.9 - 0.05 <= unrenewed <= LEASE_S * 0.9 + LEADER_TIMEOUT_S + LATE_S, logs
    # nothing published after the cut (the claims fail), and no publish logged past the
    # trusted part of the lease (a run claimed before the cut is logged once its confirmation
    # failed: at once when cut, after a socket timeout when blackholed)
    published = leader.published(offset)
    after = [p for p in published if int(p.run) > cut_at * 1000]
    assert not after, f"{leader.name} published {after} after its Redis was cut\n{logs}"
    late = [p for p in published if p.ts >= cut_at + LEASE_S * 0.9]
    assert not late, f"{leader.name} published {late} past 0.9 of its lease\n{logs}"
    assert len(lines(leader, STILL_LEADING, offset)) <= 1, logs  # once, if at all
    assert leader.is_running(), logs


@dataclass
class Failover:
    """A leader cut from its Redis (``how``: the proxy's cut or blackhole) at ``cut_at``; the
    standby that led from ``took_over``; the leader's Redis restored at ``restored_at``."""

    how: str
    leader: BeatProcess
    cut_at: float
    successor: BeatProcess
    took_over: float
    restored_at: float


def fail_over(group: Group, leader: BeatProcess, how: str) -> Failover:
    """Cut ``leader`` from its Redis (``how``), check it stands by in time and a standby takes
    over within the lease, then restore its Redis."""
    proxy = group.proxy(leader)
    offset = leader.log_size()
    cut_at = proxy.cut() if how == "cut" else proxy.blackhole()
    check_stood_by(group, leader, offset, cut_at)
    successor, took_over = leader_since(group, cut_at, timeout=LEASE_S + 5)
    logs = f"{how}: {leader.name} at {cut_at:.3f}\n{group.logs()}"
    assert successor is not leader, logs
    assert took_over - cut_at <= LEASE_S + LEASE_S / 10 + TAKEOVER_LATE_S, logs
    wait_for(
        lambda: [p for p in successor.published() if p.ts >= took_over],
        5,
        f"{successor.name} to publish",
        successor,
    )
    restored_at = proxy.restore()
    wait_line(leader, ANSWERS, offset, timeout=5)
    assert len(lines(leader, OUTAGE, offset)) == 1, logs
    beside = [p for p in leader.published(offset) if p.ts >= took_over]
    assert not beside, f"{leader.name} published {beside} beside {successor.name}\n{logs}"
    return Failover(how, leader, cut_at, successor, took_over, restored_at)


@pytest.mark.slow(seconds=12)
def test_leader_cut_from_its_redis_stands_by_before_its_lease_ends(leaders: Group) -> None:
    """Leader mode, three beats. The leader's Redis is cut (connections reset): it publishes
    nothing, stands by before its lease ends and a standby leads within the lease and its poll
    interval. Redis answers again: it stays a standby. The new leader's Redis is then
    blackholed (connections held, nothing answered: each call waits for its socket timeout, a
    quarter of the lease): the same. No run is published twice; only the runs due between a
    cut and the takeover are missing (leader mode's failover window)."""
    first, _ = leader_since(leaders, 0.0, timeout=15)
    wait_for(first.published, 5, f"{first.name} to publish", first)
    cut = fail_over(leaders, first, "cut")
    blackholed = fail_over(leaders, cut.successor, "blackhole")
    end = time.time() + 2
    sleep_until(end)

    logs = f"{cut}\n{blackholed}\n{leaders.logs()}"
    # a deposed leader whose Redis answers again stands by while its successor leads
    for failover, until in ((cut, blackholed.cut_at), (blackholed, end)):
        deposed = failover.leader
        led = [ln for ln in lines(deposed, BECAME_LEADER) if failover.restored_at < ln.ts < until]
        assert not led, logs
    # runs are missing only from a cut to its takeover (leader mode's failover window)
    hist = leaders.history()
    ids = hist.run_ids("every-second")
    window = [(f.cut_at - 1, f.took_over) for f in (cut, blackholed)]
    gaps = [
        slot
        for slot in range(ids[0], slot_ms(end) - 1000, 1000)
        if slot not in ids and not any(a < slot / 1000 < b for a, b in window)
    ]
    assert not gaps, f"runs missing outside the failover windows: {gaps}\n{hist.summary()}\n{logs}"
    assert_once(leaders, "leaders cut from their Redis")
