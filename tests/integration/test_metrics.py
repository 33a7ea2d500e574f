"""Renewed-late detection, the Prometheus metrics fed by real lock events (real Redis), and the
Grafana dashboard in examples/ against what a real worker serves."""

from __future__ import annotations

import json
import re
import socket
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from celery_singleton_lock import SingletonTask, metrics, signals, skip_info
from celery_singleton_lock.core.backend import Acquired
from celery_singleton_lock.core.connection import store_for
from celery_singleton_lock.core.keys import derive_keys, lock_keys
from celery_singleton_lock.core.renewer import HeldLock, Renewer
from celery_singleton_lock.core.store import LockStore
from celery_singleton_lock.run.events import configure_renewer
from tests.support.basic_app import SINGLETON_APP, history_key
from tests.support.history import load_history
from tests.support.mainskip import reached_celery, turn_hot
from tests.support.waiting import wait_for
from tests.support.workers import REPO_ROOT, WorkerFactory, WorkerProcess


def _hold(store: LockStore, prefix: str, ttl_ms: int) -> HeldLock:
    keys = lock_keys(prefix, "tests.late", b"x")
    outcome = store.acquire(keys, "owner-x", 0, ttl_ms)
    assert isinstance(outcome, Acquired)
    return HeldLock(keys.lock, "owner-x", 0, ttl_ms, outcome.token, acquired_at=0.0)


def test_renewal_with_less_than_a_third_left_is_late(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    """On time renewals are quiet; one with under a third of the ttl left sends the signal."""
    store = LockStore(redis_client)
    renewer = Renewer(store)
    configure_renewer(renewer)
    received: list[dict[str, Any]] = []

    def receiver(sender: Any = None, **kwargs: Any) -> None:
        received.append(kwargs)

    signals.lock_renewed_late.connect(receiver, weak=False)
    try:
        held = _hold(store, key_prefix, 3000)
        renewer.add(held)
        renewer.run_due(1.0)  # on time: 2 s were left
        renewer.run_due(3.0)  # 1 s since the last renewal, 2 s left
        assert received == []
        renewer.run_due(5.5)  # 2.5 s since the last renewal: 0.5 s left
    finally:
        signals.lock_renewed_late.disconnect(receiver)
    assert held.renewals == 3
    assert len(received) == 1
    assert received[0]["key"] == held.key
    assert received[0]["task_id"] == "owner-x"
    assert received[0]["left"] == pytest.approx(0.5)


@pytest.fixture
def eager_app(redis_url: str, key_prefix: str) -> Iterator[Celery]:
    """An app whose SingletonTask runs in this process (``apply``) against real Redis."""
    app = Celery("tests.metrics", broker="memory://", set_as_current=False)
    app.conf.singleton_redis_url = redis_url
    app.conf.singleton_key_prefix = key_prefix
    yield app
    app.close()


def test_prometheus_counts_real_lock_events(
    eager_app: Celery, redis_client: redis.Redis, key_prefix: str
) -> None:
    """acquired, released and duplicate_raised are counted; the held gauge goes up and down."""
    registry = CollectorRegistry()
    lock_metrics = metrics.install(registry)
    assert metrics.install(registry) is lock_metrics
    seen: list[float | None] = []

    @eager_app.task(bind=True, base=SingletonTask, name="m.job", singleton_on_duplicate="raise")
    def job(self: Any, account: int) -> int:
        seen.append(registry.get_sample_value("singleton_locks_held", {"task": "m.job"}))
        return int(self.singleton.fencing_token)

    def value(event: str) -> float | None:
        return registry.get_sample_value(
            "singleton_lock_events_total", {"event": event, "task": "m.job"}
        )

    try:
        assert job.apply(args=(1,)).successful()
        assert seen == [1.0]
        assert value("acquired") == 1.0
        assert value("released") == 1.0
        assert registry.get_sample_value("singleton_locks_held", {"task": "m.job"}) == 0.0
        hold_count = {"task": "m.job"}
        assert registry.get_sample_value("singleton_lock_hold_seconds_count", hold_count) == 1.0
        assert registry.get_sample_value("singleton_lock_hold_seconds_sum", hold_count) > 0
        # no run waited as a requeued duplicate
        assert (
            registry.get_sample_value("singleton_duplicate_wait_seconds_count", hold_count) is None
        )

        keys = job.singleton_keys((2,), {})
        LockStore(redis_client).acquire(keys, "someone-else", 0, 60_000)
        assert job.apply(args=(2,)).failed()
        assert value("duplicate_raised") == 1.0
        assert value("acquired") == 1.0
    finally:
        lock_metrics.close()
    assert job.apply(args=(3,)).successful()
    assert value("acquired") == 1.0  # closed: no longer counting


# -- the Grafana dashboard against a real worker's endpoint ------------------------------------

DASHBOARD = REPO_ROOT / "examples" / "grafana-dashboard.json"
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)")
_MATCHER_LABEL = re.compile(r"([a-zA-Z_]\w*)\s*(?:=~|!~|!=|=)")
_IDENTIFIER = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_KEYWORDS = frozenset({"and", "or", "unless", "bool", "offset"})


def promql_names(expr: str) -> tuple[set[str], set[str]]:
    """(metric names, label names) a PromQL expression refers to.

    Label names come from selectors' matchers and from ``by``/``without``/``on``/``ignoring``;
    metric names are the identifiers left once those, range selectors and strings are cut out,
    except function names (followed by ``(``) and operators' keywords.
    """
    labels: set[str] = set()
    for matchers in re.findall(r"\{([^}]*)\}", expr):
        labels |= set(_MATCHER_LABEL.findall(re.sub(r'"[^"]*"', '""', matchers)))
    for grouping in _GROUPING.findall(expr):
        labels |= {name.strip() for name in grouping.split(",") if name.strip()}
    bare = re.sub(r'\{[^}]*\}|\[[^\]]*\]|"[^"]*"', " ", _GROUPING.sub(" ", expr))
    names = set()
    for found in _IDENTIFIER.finditer(bare):
        if bare[found.end() :].lstrip().startswith("(") or found.group() in _KEYWORDS:
            continue
        names.add(found.group())
    return names, labels


def dashboard_queries() -> list[tuple[str, set[str], set[str]]]:
    """(where, metric names, label names) of every query of the dashboard: each panel's
    targets and each templating variable's ``label_values(metric, label)``."""
    board = json.loads(DASHBOARD.read_text())
    queries = []
    for panel in board["panels"]:
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        for target in panel["targets"]:
            names, labels = promql_names(target["expr"])
            queries.append((f"{panel['title']}: {target['expr']}", names, labels))
    for variable in board["templating"]["list"]:
        if variable["type"] != "query":
            continue
        definition = variable["definition"]
        found = re.fullmatch(r"label_values\(\s*(\w+)\s*,\s*(\w+)\s*\)", definition)
        assert found is not None, definition
        assert variable["query"]["query"] == definition
        queries.append((f"${variable['name']}: {definition}", {found[1]}, {found[2]}))
    return queries


def test_promql_names_reads_metrics_and_labels() -> None:
    """The reader the dashboard test relies on, on the dashboard's kinds of expression."""
    expr = (
        'histogram_quantile(0.95, sum by (le, task) (rate(singleton_x_bucket{task=~"$task", '
        'event=~"a|b"}[$__rate_interval]))) / sum(rate(singleton_y_count[5m])) or vector(0)'
    )
    assert promql_names(expr) == (
        {"singleton_x_bucket", "singleton_y_count"},
        {"le", "task", "event"},
    )
    assert promql_names("singleton_locks_held") == ({"singleton_locks_held"}, set())


def test_dashboard_event_matchers_name_real_events() -> None:
    """Every ``event`` the dashboard selects (``event=~"a|b"``, each alternative a regex) is an
    event the counter has: a misspelt one would chart nothing, and the served-names test would
    not see it (it checks metric and label names, not label values)."""
    board = DASHBOARD.read_text()
    matchers = re.findall(r'event\s*=~?\s*\\"([^"\\]*)\\"', board)
    assert matchers, "the dashboard selects no event"
    events = set(metrics.EVENTS.values())
    for matcher in matchers:
        for alternative in matcher.split("|"):
            matched = {e for e in events if re.fullmatch(alternative, e)}
            assert matched, f"event=~{matcher!r}: {alternative!r} is no event of {sorted(events)}"


@dataclass(frozen=True)
class Served:
    """What the worker's endpoint serves: family names and (sample name, labels, value)."""

    families: frozenset[str]
    samples: tuple[tuple[str, dict[str, str], float], ...]

    def labels_of(self, name: str) -> set[str]:
        return {label for sample, labels, _ in self.samples if sample == name for label in labels}

    def value(self, name: str, **labels: str) -> float | None:
        found = [v for sample, got, v in self.samples if sample == name and got == labels]
        return found[0] if found else None


def _scrape(port: int) -> Served:
    """The worker's HTTP endpoint, parsed by prometheus_client."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    families = list(text_string_to_metric_families(text))
    return Served(
        frozenset(family.name for family in families),
        tuple(
            (sample.name, dict(sample.labels), float(sample.value))
            for family in families
            for sample in family.samples
        ),
    )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _serving_worker(
    factory: WorkerFactory, app: Celery, tmp_path: Path, concurrency: int, pool: str = "prefork"
) -> tuple[WorkerProcess, int]:
    """A worker (prefork by default) serving the metrics as docs/operations.md shows
    (multiprocess mode), ready; and the port it serves them on."""
    multiproc = tmp_path / "prometheus"
    multiproc.mkdir()
    port = _free_port()
    worker = factory.start(
        SINGLETON_APP,
        pool=pool,
        concurrency=concurrency,
        env={"SINGLETON_TEST_METRICS_PORT": str(port), "PROMETHEUS_MULTIPROC_DIR": str(multiproc)},
    )
    worker.wait_ready(app)
    return worker, port


@pytest.mark.slow(seconds=5)
def test_worker_serves_every_metric_the_dashboard_queries(
    worker_factory: WorkerFactory,
    client_app: Celery,
    redis_client: redis.Redis,
    key_prefix: str,
    tmp_path: Path,
) -> None:
    """A prefork worker serving the metrics as docs/operations.md shows (multiprocess mode):
    after a run, a requeued duplicate that then ran, and a skip, its endpoint serves every
    metric name and label that a query of examples/grafana-dashboard.json refers to, and every
    metric family of the library is charted. The wait histogram has one observation: the
    duplicate's, not the holder's."""
    queries = dashboard_queries()
    worker, port = _serving_worker(worker_factory, client_app, tmp_path, concurrency=3)
    history = history_key(key_prefix)
    holder = client_app.signature("t.hold_retry", kwargs={"key": "m", "seconds": 1.0}).delay()
    wait_for(lambda: load_history(redis_client, history), 20, "the holder to start", worker)
    waiter = client_app.signature("t.hold_retry", kwargs={"key": "m"}).delay()
    skip_holder = client_app.signature("t.hold", kwargs={"key": "s", "seconds": 0.5}).delay()
    wait_for(lambda: len(load_history(redis_client, history)) >= 2, 20, "t.hold to start", worker)
    skipped = client_app.signature("t.hold", kwargs={"key": "s"}).delay()
    for result in (holder, waiter, skip_holder, skipped):
        result.get(timeout=30)
    assert skip_info(skipped) is not None
    assert skip_info(waiter) is None  # it waited, then ran

    def histograms_served() -> Served | None:
        served = _scrape(port)
        held = served.value("singleton_lock_hold_seconds_count", task="t.hold_retry")
        return served if held == 2.0 else None  # both runs of t.hold_retry ended

    served = wait_for(histograms_served, 20, "the hold histogram", worker, ignore=(OSError,))
    assert served.value("singleton_duplicate_wait_seconds_count", task="t.hold_retry") == 1.0
    assert (served.value("singleton_duplicate_wait_seconds_sum", task="t.hold_retry") or 0) > 0
    assert served.value("singleton_duplicate_wait_seconds_count", task="t.hold") is None
    skips = served.value("singleton_lock_events_total", event="duplicate_skipped", task="t.hold")
    assert skips == 1.0

    served_names = {sample for sample, _labels, _value in served.samples}
    charted: set[str] = set()
    for where, names, labels in queries:
        assert names, f"no metric in {where}"
        for name in names:
            assert name in served_names, f"{where}: {name} is not served"
            missing = labels - served.labels_of(name)
            assert not missing, f"{where}: {name} is served without the labels {missing}"
        charted |= names
    ours = {family for family in served.families if family.startswith("singleton_")}
    assert len(ours) == 4, ours
    uncharted = {f for f in ours if not any(n == f or n.startswith(f"{f}_") for n in charted)}
    assert not uncharted, f"served but on no panel of the dashboard: {sorted(uncharted)}"


@pytest.mark.slow(seconds=5)
def test_skips_of_the_main_process_are_counted_with_the_pools(
    worker_factory: WorkerFactory,
    client_app: Celery,
    key_prefix: str,
    redis_url: str,
    tmp_path: Path,
) -> None:
    """A threads worker serving the metrics (docs/operations.md): the duplicates its pool
    threads skip and those its main process turns away itself (worker/mainskip.py) add up to one
    count per duplicate."""
    worker, port = _serving_worker(
        worker_factory, client_app, tmp_path, concurrency=2, pool="threads"
    )
    keys = derive_keys(f"{key_prefix}lock:", "t.hold", _hold_signature, (), {"key": "f"}, ("key",))
    store_for(redis_url).acquire(keys, "the-holder", 0, 60_000)
    sent = turn_hot(client_app, worker, "t.hold", {"key": "f"})
    sent += [client_app.send_task("t.hold", kwargs={"key": "f"}) for _ in range(20)]
    assert all(skip_info(result.get(timeout=30)) is not None for result in sent)
    in_main = [r for r in sent if not reached_celery(worker, "t.hold", r.id)]
    assert len(in_main) >= 20

    def counted() -> float | None:
        return _scrape(port).value(
            "singleton_lock_events_total", event="duplicate_skipped", task="t.hold"
        )

    wait_for(lambda: counted() == len(sent), 20, "every skip counted", worker, ignore=(OSError,))


def _hold_signature(key: str, seconds: float = 0.0, payload: Any = None) -> None:
    """The parameters of t.hold."""
