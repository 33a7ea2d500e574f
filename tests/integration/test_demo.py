"""The README's demo runs for real: a private server, two workers, a report without overlaps."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_demo_runs_and_reports_no_overlap() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "DEMO_REDIS_URL")}
    env["PYTHONUNBUFFERED"] = "1"
    proc = subprocess.Popen(
        [sys.executable, "-m", "examples.demo", "--seconds", "5"],
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
        proc.send_signal(signal.SIGTERM)  # the demo stops its workers and server on SIGTERM
        try:
            output, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
        pytest.fail(f"the demo did not finish in 180 s:\n{output}")

    assert proc.returncode == 0, output
    assert "private valkey-server" in output or "private redis-server" in output, output
    assert re.search(r"^\s*overlaps: 0$", output, re.MULTILINE), output
    assert number(output, "executed") > 0, output
    assert number(output, "skipped") > 0, output


def number(report: str, label: str) -> int:
    """The count on the report line ``<label>: <n>``."""
    match = re.search(rf"^\s*{label}:\s+(\d+)", report, re.MULTILINE)
    assert match is not None, f"no {label!r} line in:\n{report}"
    return int(match.group(1))
