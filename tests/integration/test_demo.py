"""The README's demo runs for real: a private server, 3 workers, 2 beats, kills, a clean report."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from xml.etree import ElementTree

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow(seconds=50)
def test_demo_runs_each_scheduled_run_once_without_overlap(tmp_path: Path) -> None:
    """A 12 s demo with a beat and a worker SIGKILLed: 0 overlaps, 0 missed, each run once, and
    every entry of the schedule ran, the crontab one too (the window grows to take in the next
    minute: 12 to about 63 s)."""
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "DEMO_REDIS_URL")}
    env["PYTHONUNBUFFERED"] = "1"
    chart, numbers = tmp_path / "timeline.svg", tmp_path / "report.json"
    args = ["--seconds", "12", "--chart", str(chart), "--json", str(numbers)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "examples.demo", *args],
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        output, _ = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # the demo stops its processes and server on SIGTERM
        try:
            output, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
        pytest.fail(f"the demo did not finish in 180 s:\n{output}")

    assert proc.returncode == 0, output
    assert "private valkey-server" in output or "private redis-server" in output, output
    report = json.loads(numbers.read_text())
    assert set(report["kills"]) == {"beat1", "w3"}, output
    for name, entry in report["entries"].items():
        assert (entry["overlaps"], entry["missed_runs"], entry["executed_twice"]) == (0, 0, 0), (
            name,
            output,
        )
        # every scheduled run executed, or skipped while the previous run still held the lock
        assert entry["runs_executed"] + entry["scheduled_runs_skipped"] == entry["runs_scheduled"]
    # the report has one entry per entry of the schedule (examples/demo_app.py's SCHEDULE)
    assert set(report["entries"]) >= {"short", "long", "cron"}, report["entries"].keys()
    for name, entry in report["entries"].items():
        assert entry["runs_executed"] >= 1, (name, output)  # every entry ran in the window
        assert entry["runs_scheduled"] >= 1, (name, output)
    assert report["entries"]["cron"]["schedule"] == "crontab()", output
    assert 12 <= report["window_seconds"] <= 12 + 60 + 5, report["window_seconds"]
    assert "no run due in this window" not in output, output
    assert report["entries"]["short"]["runs_executed"] >= 3, output
    assert report["entries"]["long"]["runs_executed"] >= 1, output
    assert min(report["entries"]["long"]["renewals"]) >= 2, output  # runs 3 s on a 1 s ttl
    for what, calls in report["by_hand"].items():
        assert calls["not_finished"] == 0, (what, output)
        assert calls["duplicates_skipped"] > 0, (what, output)
    assert report["overlaps"] == 0, output
    assert report["tokens_in_order"], output
    svg = chart.read_text()
    ElementTree.fromstring(svg)  # well-formed
    assert svg.startswith("<svg")
    assert svg.count("<rect") > 10
    assert "SIGKILL w3" in svg
