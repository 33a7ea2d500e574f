"""Real ``celery worker`` subprocesses for the throughput benchmarks.

Each worker runs ``python -m celery -A benchmarks.bench_app worker`` from the repository root
in its own session, so :meth:`BenchWorker.close` can SIGKILL its whole process group. Workers
log at WARNING: a per-task INFO line would cost more than some of the differences measured.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from .bench_app import URL_ENV

REPO_ROOT = Path(__file__).resolve().parents[1]

_LIVE: set[BenchWorker] = set()


class BenchWorker:
    """One worker process (solo, or prefork with ``concurrency`` children)."""

    def __init__(self, url: str, pool: str, concurrency: int) -> None:
        self.pool = pool
        self.concurrency = concurrency
        name = f"bench-{pool}-{uuid.uuid4().hex[:6]}"
        self.nodename = f"{name}@{socket.gethostname()}"
        self.log_path = Path(tempfile.gettempdir()) / f"cslt-{name}.log"
        args = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "benchmarks.bench_app",
            "worker",
            "-P",
            pool,
            "-c",
            str(concurrency),
            "-n",
            f"{name}@%h",
            "-Q",
            "bench",
            "--without-mingle",
            "--without-gossip",
            "--without-heartbeat",
            "-l",
            "WARNING",
        ]
        env = {**os.environ, URL_ENV: url, "PYTHONUNBUFFERED": "1"}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                args,
                cwd=REPO_ROOT,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        _LIVE.add(self)

    def wait_ready(self, app: Any, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited early:\n{self.log_tail()}")
            replies = app.control.ping(destination=[self.nodename], timeout=0.5)
            if any(self.nodename in reply for reply in replies or ()):
                return
        raise TimeoutError(f"worker not ready within {timeout}s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def cpu_seconds(self) -> float:
        """User + system CPU of the worker and its children so far (from /proc)."""
        total = 0.0
        for pid in [self.proc.pid, *_descendants(self.proc.pid)]:
            total += _proc_cpu(pid)
        return total

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=10)
        _LIVE.discard(self)
        with contextlib.suppress(OSError):
            self.log_path.unlink()


def _proc_cpu(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read().decode(errors="replace")
    except OSError:
        return 0.0
    fields = data[data.rfind(")") + 2 :].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks  # utime + stime


def _descendants(pid: int) -> list[int]:
    parents: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as fh:
                data = fh.read().decode(errors="replace")
        except OSError:
            continue
        ppid = int(data[data.rfind(")") + 2 :].split()[1])
        parents.setdefault(ppid, []).append(int(name))
    found, todo = [], [pid]
    while todo:
        for kid in parents.get(todo.pop(), []):
            found.append(kid)
            todo.append(kid)
    return found


@atexit.register
def _kill_leftover_workers() -> None:
    for worker in list(_LIVE):
        with contextlib.suppress(Exception):
            worker.close()
